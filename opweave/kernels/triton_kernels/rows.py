"""Row-wise Triton kernels: RMSNorm, fused add + RMSNorm, RoPE and the greedy argmax."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opweave.kernels.reference import NON_FINITE_TOKEN
from opweave.kernels.triton_kernels.common import _MAX_BLOCK, _check_last_contiguous, _pow2

# 2*pi split for Cody-Waite range reduction in `_rope_kernel`: _TWO_PI_HI has 8 significant bits,
# so k * _TWO_PI_HI is exact in float32 for |k| < 2**16 (angles up to ~4e5 rad; positions up to
# 4e5 at inv_freq <= 1); _TWO_PI_MID and _TWO_PI_LO are the float32 roundings of the remainders.
_TWO_PI_HI = tl.constexpr(6.28125)
_TWO_PI_MID = tl.constexpr(0.0019353071693331003)
_TWO_PI_LO = tl.constexpr(1.0253131677018246e-11)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)


# ---------------------------------------------------------------------------------------------- RMSNorm

@triton.jit
def _rms_norm_kernel(
    x_ptr,                    # [N, H] input rows, model dtype
    w_ptr,                    # [H] weight, model dtype
    y_ptr,                    # [N, H] output rows, model dtype
    stride_x,                 # elements between rows of x
    stride_y,                 # elements between rows of y
    H,                        # row length
    eps,                      # added to the mean square
    OFFSET: tl.constexpr,     # True: scale by (1 + w) in float32; False: round norm(x) to dtype, then * w
    BLOCK_H: tl.constexpr,    # power of two >= H: one program holds a whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = _rms_row(x, w_ptr, cols, mask, H, eps, OFFSET, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_row(x, w_ptr, cols, mask, H, eps, OFFSET: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm of one float32 row `x` (masked to `H` columns) by the weight at `w_ptr`, as the
    reference rounds it: (1 + w) in float32 with OFFSET, else norm(x) rounded to `dtype`, then * w."""
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        y = h * (1.0 + w)
    else:
        y = h.to(dtype).to(tl.float32) * w
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """See `reference.rms_norm`."""
    h = x.shape[-1]
    assert weight.shape == (h,), f"weight {tuple(weight.shape)} != ({h},)"
    assert weight.dtype == x.dtype, f"weight dtype {weight.dtype} != x dtype {x.dtype}"
    rows = x.reshape(-1, h)
    _check_last_contiguous(x=rows, weight=weight)
    y = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, y, rows.stride(0), y.stride(0), h, eps,
                                           OFFSET=bool(offset), BLOCK_H=_pow2(h))
    return y.view(x.shape)


# ---------------------------------------------------------------------------------------------- fused add + RMSNorm

@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr,             # [N, H] a sub-block's output and the residual stream, model dtype
    w_ptr,                    # [H] norm weight, model dtype
    y_ptr, s_ptr,             # [N, H] outputs: normed sum, sum, model dtype
    stride_x, stride_r,       # elements between rows of the inputs
    stride_y, stride_s,       # elements between rows of the outputs
    H,                        # row length
    eps,                      # added to the mean square
    OFFSET: tl.constexpr,     # True: scale by (1 + w) in float32; False: round norm(x) to dtype, then * w
    BLOCK_H: tl.constexpr,    # power of two >= H: one program holds a whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    dtype = s_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(dtype)  # the new residual stream, in the model dtype like the reference's add
    tl.store(s_ptr + row * stride_s + cols, s, mask=mask)
    y = _rms_row(s.to(tl.float32), w_ptr, cols, mask, H, eps, OFFSET, dtype)
    tl.store(y_ptr + row * stride_y + cols, y.to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.add_rms_norm`: one pass over the rows reads x and the residual once and
    writes the sum and its norm."""
    h = x.shape[-1]
    assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
    assert weight.shape == (h,), f"weight {tuple(weight.shape)} != ({h},)"
    assert x.dtype == residual.dtype == weight.dtype, "x, residual and weight must share a dtype"
    rows, res = x.reshape(-1, h), residual.reshape(-1, h)
    _check_last_contiguous(x=rows, residual=res, weight=weight)
    y, s = torch.empty_like(rows), torch.empty_like(rows)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](rows, res, weight, y, s, rows.stride(0), res.stride(0),
                                               y.stride(0), s.stride(0), h, eps, OFFSET=bool(offset),
                                               BLOCK_H=_pow2(h))
    return y.view(x.shape), s.view(x.shape)


# ---------------------------------------------------------------------------------------------- RoPE

@triton.jit
def _rope_rotate(
    x_ptr, o_ptr,             # this token's first head of the input / output
    stride_xh, stride_oh,     # elements between heads
    num_heads, D,             # heads of this tensor, head size
    cos, sin,                 # [1, BLOCK_HALF] float32, rounded through the model dtype
    HALF: tl.constexpr,       # rot_dim // 2
    ROT: tl.constexpr,        # rotated dims per head
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    c = tl.arange(0, BLOCK_HALF)[None, :]
    m = (heads < num_heads) & (c < HALF)
    xh = x_ptr + heads * stride_xh
    oh = o_ptr + heads * stride_oh
    x1 = tl.load(xh + c, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xh + HALF + c, mask=m, other=0.0).to(tl.float32)
    # rotate-half: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
    tl.store(oh + c, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=m)
    tl.store(oh + HALF + c, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=m)
    d = tl.arange(0, BLOCK_D)[None, :]
    keep = (heads < num_heads) & (d >= ROT) & (d < D)  # partial rotary: the rest passes through
    tl.store(oh + d, tl.load(xh + d, mask=keep, other=0.0), mask=keep)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr,             # [N, Hq, D], [N, Hkv, D] inputs, model dtype
    qo_ptr, ko_ptr,           # outputs, same shapes, contiguous
    pos_ptr,                  # [N] int positions (negative -> 0)
    inv_freq_ptr,             # [rot_dim // 2] float32 inverse frequencies
    stride_qn, stride_qh,     # q strides (tokens, heads)
    stride_kn, stride_kh,     # k strides
    stride_qon, stride_qoh,   # q output strides
    stride_kon, stride_koh,   # k output strides
    HQ, HKV, D,               # heads of q, of k; head size
    attn_factor,              # scale of cos and sin (YaRN; 1.0 otherwise)
    HALF: tl.constexpr,       # rot_dim // 2
    ROT: tl.constexpr,        # rotated dims per head
    BLOCK_HEADS: tl.constexpr,  # power of two >= max(Hq, Hkv)
    BLOCK_HALF: tl.constexpr,   # power of two >= HALF
    BLOCK_D: tl.constexpr,      # power of two >= D
):
    n = tl.program_id(0).to(tl.int64)
    pos = tl.maximum(tl.load(pos_ptr + n), 0).to(tl.float32)
    c = tl.arange(0, BLOCK_HALF)[None, :]
    ang = pos * tl.load(inv_freq_ptr + c, mask=c < HALF, other=0.0)
    # Cody-Waite reduction to [-pi, pi]: exact for small angles, accurate for long contexts even
    # where the GPU's sin/cos are approximations valid near zero
    turns = tl.floor(ang * _INV_TWO_PI + 0.5)
    ang = ((ang - turns * _TWO_PI_HI) - turns * _TWO_PI_MID) - turns * _TWO_PI_LO
    dtype = qo_ptr.dtype.element_ty
    cos = (tl.cos(ang) * attn_factor).to(dtype).to(tl.float32)  # the reference rounds cos/sin to the model dtype
    sin = (tl.sin(ang) * attn_factor).to(dtype).to(tl.float32)
    _rope_rotate(q_ptr + n * stride_qn, qo_ptr + n * stride_qon, stride_qh, stride_qoh, HQ, D, cos, sin,
                 HALF, ROT, BLOCK_HEADS, BLOCK_HALF, BLOCK_D)
    _rope_rotate(k_ptr + n * stride_kn, ko_ptr + n * stride_kon, stride_kh, stride_koh, HKV, D, cos, sin,
                 HALF, ROT, BLOCK_HEADS, BLOCK_HALF, BLOCK_D)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         rot_dim: int, attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.rope`."""
    d = q.shape[-1]
    assert k.shape[-1] == d and q.shape[:-2] == k.shape[:-2], f"q {tuple(q.shape)} vs k {tuple(k.shape)}"
    assert tuple(positions.shape) == tuple(q.shape[:-2]), f"positions {tuple(positions.shape)} vs q {tuple(q.shape)}"
    assert rot_dim % 2 == 0 and 0 < rot_dim <= d, f"rot_dim {rot_dim} with head size {d}"
    assert inv_freq.shape == (rot_dim // 2,) and inv_freq.dtype == torch.float32, "inv_freq: [rot_dim/2] float32"
    assert q.dtype == k.dtype, f"q dtype {q.dtype} != k dtype {k.dtype}"
    hq, hkv = q.shape[-2], k.shape[-2]
    q3, k3 = q.reshape(-1, hq, d), k.reshape(-1, hkv, d)
    pos = positions.reshape(-1).contiguous()
    _check_last_contiguous(q=q3, k=k3, inv_freq=inv_freq)
    qo, ko = torch.empty_like(q3), torch.empty_like(k3)
    if q3.shape[0]:
        _rope_kernel[(q3.shape[0],)](
            q3, k3, qo, ko, pos, inv_freq,
            q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
            hq, hkv, d, float(attention_factor), HALF=rot_dim // 2, ROT=rot_dim,
            BLOCK_HEADS=_pow2(max(hq, hkv)), BLOCK_HALF=_pow2(rot_dim // 2), BLOCK_D=_pow2(d))
    return qo.view(q.shape), ko.view(k.shape)


# ---------------------------------------------------------------------------------------------- sampling

@triton.jit
def _argmax_kernel(
    logits_ptr,               # [B, V] logits
    ids_ptr,                  # [B] int64 out
    stride_l,                 # elements between rows of logits
    V,                        # vocabulary size
    BLOCK_V: tl.constexpr,    # vocabulary entries per iteration
    NON_FINITE: tl.constexpr,  # the id of a row whose logits are not all finite
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_V)
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = lanes.to(tl.int64)
    num_bad = tl.zeros([BLOCK_V], tl.int32)  # per lane: logits that are NaN or infinite
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < V, other=0.0).to(tl.float32)
        num_bad += ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)  # x != x: NaN
        x = tl.where(cols < V, x, float("-inf"))
        better = x > best_val  # strict: each lane keeps its first maximum
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, cols.to(tl.int64), best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)  # the first index among the maxima
    idx = tl.where(tl.sum(num_bad, axis=0) > 0, NON_FINITE, idx.to(tl.int64))
    tl.store(ids_ptr + row, idx.to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """See `reference.argmax` (`NON_FINITE_TOKEN` for a row whose logits are not all finite)."""
    assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
    _check_last_contiguous(logits=logits)
    b, v = logits.shape
    ids = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b:
        _argmax_kernel[(b,)](logits, ids, logits.stride(0), v, BLOCK_V=min(_pow2(v), _MAX_BLOCK),
                             NON_FINITE=NON_FINITE_TOKEN)
    return ids
