"""Triton decode kernels: the CUDA path of the runtime, same interface as `reference`.

Each `@triton.jit` kernel has a host wrapper with the reference's name and signature; the wrapper
asserts shapes, dtypes and strides, allocates the outputs and computes the grid. Arithmetic is in
float32; where an operator module rounds an intermediate to the model dtype (an activation before
the `* up`, an expert's output before its routing weight) the kernel rounds it too, so the two
backends agree to a few units in the last place of the model dtype (`tests/test_kernels.py`).

On CPU the kernels run under `TRITON_INTERPRET=1` (set before triton is imported).

Note: the interpreter computes `tl.dot` on bfloat16 operands from their raw bit patterns, so
decode attention casts its `tl.dot` operands to float32 when interpreting bfloat16 (`_dot_fp32`);
float32 operands use IEEE precision (not TF32) on the GPU too, so float32 runs match the reference.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from opweave import config
from opweave.codegen.kernels import targets
from opweave.codegen.kernels.reference import NON_FINITE_TOKEN

# l2-normalisation epsilon of Gated-DeltaNet's q and k (reference.l2_normalize's default)
_L2_EPS = tl.constexpr(1e-6)

# 2*pi split for Cody-Waite range reduction in `_rope_kernel`: _TWO_PI_HI has 8 significant bits,
# so k * _TWO_PI_HI is exact in float32 for |k| < 2**16 (angles up to ~4e5 rad; positions up to
# 4e5 at inv_freq <= 1); _TWO_PI_MID and _TWO_PI_LO are the float32 roundings of the remainders.
_TWO_PI_HI = tl.constexpr(6.28125)
_TWO_PI_MID = tl.constexpr(0.0019353071693331003)
_TWO_PI_LO = tl.constexpr(1.0253131677018246e-11)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)

_MAX_BLOCK = 1024  # elements per program along a streamed dimension (vocab, intermediate, hidden)
MOE_WARPS = 8  # float32 MoE tl.dot tiles spill registers at 4 warps (docs/kernels.md, ahead-of-time checks)
ATTN_BLOCK_N = 64  # most cache slots per decode-attention iteration (power of two >= 16; tests lower it);
                  # on a GPU `targets.attention_launch` may pick fewer (shared memory, registers)


def _interpreting() -> bool:
    return config.triton_interpret()


def _pow2(n: int, minimum: int = 1) -> int:
    return max(triton.next_power_of_2(n), minimum)


def _check_last_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous (stride {t.stride()})"


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


# ---------------------------------------------------------------------------------------------- attention

ATTN_MIN_SPLIT = 256  # fewest positions per split-KV program (tests lower it to split short caches)
ATTN_MERGE_BLOCK_S = 16  # splits the merge kernel combines per iteration


@triton.jit
def _decode_attention_kernel(
    q_ptr,                    # [B, Hq, D] queries, model dtype
    k_ptr, v_ptr,             # [B, L, Hkv, D] ring-buffer caches (position p at slot p % L), model dtype
    acc_ptr,                  # [B, Hq, S, D] float32 out: this split's unnormalised p·v
    ml_ptr,                   # [B, Hq, 2, S] float32 out: this split's running max, then its sum of exp
    pos_ptr,                  # [B] int positions: attend positions <= pos (none when pos < 0)
    stride_qb, stride_qh,     # q strides (batch, head)
    stride_kb, stride_kl, stride_kh,  # k cache strides (batch, slot, head)
    stride_vb, stride_vl, stride_vh,  # v cache strides
    L, D,                     # cache slots, head size
    SPLIT_LEN,                # positions per split (a multiple of BLOCK_N)
    scale,                    # softmax scale of q·k
    window,                   # sliding window (positions > pos - window), 0 for full attention
    GROUP: tl.constexpr,      # query heads per kv head (GQA group size)
    BLOCK_G: tl.constexpr,    # power of two >= max(GROUP, 16) (tl.dot needs 16 rows)
    BLOCK_N: tl.constexpr,    # cache slots per iteration
    BLOCK_D: tl.constexpr,    # power of two >= max(D, 16)
    DOT_FP32: tl.constexpr,   # cast tl.dot operands to float32 and use IEEE precision
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_mask = (g < GROUP)[:, None] & (d < D)[None, :]
    heads = kvh * GROUP + g                              # the GQA group's query heads
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    # attended positions [first, end): the window's, and at most the L the ring holds; this split
    # takes [lo, hi), SPLIT_LEN of them counted from `first` (none: an empty split)
    first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    first = tl.maximum(first, pos - L + 1)
    end = pos + 1
    lo = first + split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, end)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: a fully masked block gives exp(-inf) = 0, not NaN
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if DOT_FP32:
        q = q.to(tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)                    # positions of this block
        slot = (n % L).to(tl.int64)                          # where the ring keeps them
        kv_mask = (n < hi)[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + b * stride_kb + slot[:, None] * stride_kl + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + b * stride_vb + slot[:, None] * stride_vl + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where((n < hi)[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)  # probabilities in the model dtype, like the reference
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    row = (b * (tl.num_programs(1) * GROUP) + heads).to(tl.int64)  # [BLOCK_G] rows of [B * Hq]
    tl.store(acc_ptr + ((row * num_splits + split) * D)[:, None] + d[None, :], acc, mask=q_mask)
    ml = ml_ptr + row * (2 * num_splits) + split
    tl.store(ml, m_i, mask=g < GROUP)
    tl.store(ml + num_splits, l_i, mask=g < GROUP)


@triton.jit
def _decode_attention_merge_kernel(
    acc_ptr,                  # [B, Hq, S, D] float32 partial p·v of each split
    ml_ptr,                   # [B, Hq, 2, S] float32 max and sum of exp of each split
    o_ptr,                    # [B, Hq, D] output, model dtype
    sinks_ptr,                # [Hq] sink logits (read only when HAS_SINKS)
    stride_ob, stride_oh,     # output strides
    S, D,                     # splits, head size
    BLOCK_S: tl.constexpr,    # splits per iteration
    BLOCK_D: tl.constexpr,    # power of two >= D
    HAS_SINKS: tl.constexpr,  # GPT-OSS: the softmax has one more term exp(sink) with a zero value
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = b * tl.num_programs(1) + h
    d = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, BLOCK_S)
    # log-sum-exp merge: each split's max m_s, sum l_s and p·v acc_s rescaled to the common max.
    # An empty split has m_s = -1e30, l_s = 0, acc_s = 0: its weight is 0 beside any attended split,
    # and a row with no attended split (padding) ends with l = 0 and gives zeros.
    m_run = tl.max(tl.full([BLOCK_S], -1.0e30, tl.float32), axis=0)
    l_run = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    if HAS_SINKS:  # the sink is one more "split": max = sink, sum of exp = 1, p·v = 0
        m_run = tl.load(sinks_ptr + h).to(tl.float32)
        l_run = l_run + 1.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + lanes
        m = tl.load(ml_ptr + row * 2 * S + s, mask=s < S, other=-1.0e30)
        l = tl.load(ml_ptr + row * 2 * S + S + s, mask=s < S, other=0.0)
        a = tl.load(acc_ptr + ((row * S + s) * D)[:, None] + d[None, :], mask=(s < S)[:, None] & (d < D)[None, :],
                    other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        alpha = tl.exp(m_run - m_new)
        w = tl.exp(m - m_new)
        l_run = l_run * alpha + tl.sum(w * l, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
        m_run = m_new
    o = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, o.to(o_ptr.dtype.element_ty), mask=d < D)


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreting())


def attention_plan(q: torch.Tensor, k_cache: torch.Tensor, window: int | None) -> tuple[targets.AttentionLaunch,
                                                                                       targets.AttentionSplit]:
    """The block/stages and the split-KV cut `decode_attention` launches with, from shapes, dtype,
    window and device only (`targets.py`)."""
    b, hkv, slots = q.shape[0], k_cache.shape[2], k_cache.shape[1]
    dot_fp32 = _dot_fp32(q.dtype)
    launch = targets.attention_launch(_pow2(q.shape[-1], 16), 4 if dot_fp32 else q.element_size(),
                                      targets.launch_smem_limit(q.device), ATTN_BLOCK_N)
    span = min(slots, window) if window and window > 0 else slots
    split = targets.attention_split(b, hkv, max(span, 1), launch.block_n, targets.launch_sm_count(q.device),
                                    max(ATTN_MIN_SPLIT, launch.block_n))
    return launch, split


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See `reference.decode_attention`. Split-KV: grid (B, Hkv, splits), each program attends one
    split of the span for the whole GQA group (K/V read once per group) and writes its partial
    (max, sum of exp, p·v) to a float32 scratch; a second kernel, grid (B, Hq), merges the splits
    with log-sum-exp, starting from the head's sink logit when `sinks` is given. The split count
    depends on shapes and the device only, never on positions: no host synchronisation
    (CUDA-graph capturable)."""
    b, hq, d = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
    assert k_cache.shape[0] == b and k_cache.shape[3] == d, f"cache {tuple(k_cache.shape)} vs q {tuple(q.shape)}"
    hkv, slots = k_cache.shape[2], k_cache.shape[1]
    assert hq % hkv == 0, f"{hq} query heads not a multiple of {hkv} kv heads"
    assert slots > 0, "empty cache"
    assert positions.shape == (b,), f"positions {tuple(positions.shape)} != ({b},)"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and caches must share a dtype"
    assert ATTN_BLOCK_N >= 16 and ATTN_BLOCK_N & (ATTN_BLOCK_N - 1) == 0, "ATTN_BLOCK_N: power of two >= 16"
    assert sinks is None or sinks.shape == (hq,), f"sinks {tuple(sinks.shape)} != ({hq},)"
    _check_last_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    o = torch.empty_like(q)
    group = hq // hkv
    block_d = _pow2(d, 16)
    # block size and pipeline depth within the device's shared memory per block, splits from the SMs
    launch, split = attention_plan(q, k_cache, window)
    if b:
        acc = torch.empty(b, hq, split.splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, hq, 2, split.splits, dtype=torch.float32, device=q.device)
        _decode_attention_kernel[(b, hkv, split.splits)](
            q, k_cache, v_cache, acc, ml, positions.contiguous(),
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            slots, d, split.split_len, float(scale), int(window or 0),
            GROUP=group, BLOCK_G=_pow2(group, 16), BLOCK_N=launch.block_n, BLOCK_D=block_d,
            DOT_FP32=_dot_fp32(q.dtype), num_stages=launch.num_stages)
        _decode_attention_merge_kernel[(b, hq)](
            acc, ml, o, sinks.contiguous() if sinks is not None else ml, o.stride(0), o.stride(1), split.splits, d,
            BLOCK_S=ATTN_MERGE_BLOCK_S, BLOCK_D=block_d, HAS_SINKS=sinks is not None)
    return o


# ---------------------------------------------------------------------------------------------- Gated-DeltaNet

@triton.jit
def _gdn_step_kernel(
    q_ptr, k_ptr,             # [B, Hk, Dk] conv outputs (before l2norm), any float dtype
    v_ptr,                    # [B, Hv, Dv] values, model dtype
    g_ptr, beta_ptr,          # [B, Hv] log decay and write strength, float32
    s_ptr,                    # [B, Hv, Dk, Dv] state, float32: read, then overwritten with the new state
    o_ptr,                    # [B, Hv, Dv] output, model dtype
    pos_ptr,                  # [B] int positions (read only when HAS_POS)
    stride_qb, stride_qh, stride_kb, stride_kh,   # q, k strides (batch, head)
    stride_vb, stride_vh, stride_gb, stride_betab,  # v strides; g, beta batch strides
    stride_sb, stride_sh, stride_sk,              # state strides (batch, head, key dim)
    stride_ob, stride_oh,                          # output strides
    HV, DK, DV,               # value heads, key head size, value head size
    R,                        # value heads per key head
    q_scale,                  # Dk ** -0.5
    HAS_POS: tl.constexpr,    # position 0 resets the state, position < 0 keeps it
    BLOCK_DK: tl.constexpr,   # power of two >= Dk: the whole key dim in one program
    BLOCK_DV: tl.constexpr,   # value dims per program
):
    # Each program owns one (sequence, value head, block of Dv) tile of the state: it reads the
    # whole tile before writing it, and no other program touches it, so the update is in place.
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // HV, bh % HV
    kh = h // R
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mk, mv = dk < DK, dv < DV
    q = tl.load(q_ptr + b * stride_qb + kh * stride_qh + dk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + kh * stride_kh + dk, mask=mk, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + _L2_EPS) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + _L2_EPS)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + dv, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_betab + h).to(tl.float32)
    m2 = mk[:, None] & mv[None, :]
    tile = s_ptr + b * stride_sb + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    s = tl.load(tile, mask=m2, other=0.0)
    if HAS_POS:
        pos = tl.load(pos_ptr + b + 0 * dv)             # per lane: the interpreter rejects a mask from a scalar
        s = tl.where((pos == 0)[None, :], 0.0, s)
        m2 = m2 & (pos >= 0)[None, :]                   # padding: the state stays as it is
    s = s * tl.exp(g)                                   # decay
    predicted = tl.sum(s * k[:, None], axis=0)          # S^T k
    s = s + k[:, None] * ((v - predicted) * beta)[None, :]  # delta rule
    o = tl.sum(s * q[:, None], axis=0)                  # S^T q
    tl.store(o_ptr + b * stride_ob + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=mv)
    tl.store(tile, s, mask=m2)


def gdn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.gdn_step`; same results, but `state` is updated in place and returned as the
    new state (no second state buffer: the caller's state slots are the kernel's output, as a
    CUDA-graph replay needs). Callers use the returned state, as with the reference."""
    b, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape, f"k {tuple(k.shape)} != q {tuple(q.shape)}"
    assert v.shape[0] == b and hv % hk == 0, f"v {tuple(v.shape)} vs q {tuple(q.shape)}"
    assert g.shape == beta.shape == (b, hv), f"g {tuple(g.shape)}, beta {tuple(beta.shape)} != ({b}, {hv})"
    assert state.shape == (b, hv, dk, dv) and state.dtype == torch.float32, f"state {tuple(state.shape)} {state.dtype}"
    assert positions is None or positions.shape == (b,), f"positions {tuple(positions.shape)}"
    _check_last_contiguous(q=q, k=k, v=v, state=state)
    assert g.stride(1) == 1 and beta.stride(1) == 1, "g, beta: head dim must be contiguous"
    o = torch.empty(b, hv, dv, dtype=v.dtype, device=v.device)
    block_dv = min(_pow2(dv), 64)
    pos = positions.contiguous() if positions is not None else state  # dummy pointer when unused
    if b:
        _gdn_step_kernel[(b * hv, triton.cdiv(dv, block_dv))](
            q, k, v, g, beta, state, o, pos,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1),
            hv, dk, dv, hv // hk, dk ** -0.5,
            HAS_POS=positions is not None, BLOCK_DK=_pow2(dk), BLOCK_DV=block_dv)
    return o, state


# ---------------------------------------------------------------------------------------------- gated MLP

@triton.jit
def _gelu_tanh(x):
    # 0.5 x (1 + tanh(u)) == x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
    return x * tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))


@triton.jit
def _gated_act_kernel(
    gate_ptr, up_ptr,         # [N, I] inputs, model dtype
    out_ptr,                  # [N, I] output, model dtype
    stride_g, stride_u, stride_o,  # elements between rows
    I,                        # row length
    SILU: tl.constexpr,       # True: silu; False: tanh-approximated gelu
    BLOCK_I: tl.constexpr,    # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    x = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        a = x * tl.sigmoid(x)
    else:
        a = _gelu_tanh(x)
    a = a.to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference rounds act(gate) before * up
    tl.store(out_ptr + row * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def gated_act(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """See `reference.gated_act`."""
    assert gate.shape == up.shape and gate.dtype == up.dtype, f"gate {tuple(gate.shape)} vs up {tuple(up.shape)}"
    i = gate.shape[-1]
    g2, u2 = gate.reshape(-1, i), up.reshape(-1, i)
    _check_last_contiguous(gate=g2, up=u2)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = min(_pow2(i), _MAX_BLOCK)
    if g2.shape[0]:
        _gated_act_kernel[(g2.shape[0], triton.cdiv(i, block))](
            g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), i, SILU=kind == "silu", BLOCK_I=block)
    return out.view(gate.shape)


# ---------------------------------------------------------------------------------------------- MoE

@triton.jit
def _moe_route_kernel(
    logits_ptr,               # [N, E] router logits, model dtype
    w_ptr,                    # [N, K] routing weights out, model dtype
    ids_ptr,                  # [N, K] int64 expert ids out
    stride_l,                 # elements between rows of logits
    E,                        # experts
    TOP_K: tl.constexpr,      # experts per token
    RENORM: tl.constexpr,     # divide the k weights by their sum
    BLOCK_E: tl.constexpr,    # power of two >= E
    BLOCK_K: tl.constexpr,    # power of two >= TOP_K
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(cols < E, e / tl.sum(e, axis=0), -1.0)  # padding lanes below any probability
    slot = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):  # k rounds of argmax; ties go to the lower expert id
        best = tl.argmax(p, axis=0)
        top_w = tl.where(slot == j, tl.max(p, axis=0), top_w)
        top_i = tl.where(slot == j, best.to(tl.int64), top_i)
        p = tl.where(cols == best, -2.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(w_ptr + row * TOP_K + slot, top_w.to(w_ptr.dtype.element_ty), mask=slot < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slot, top_i, mask=slot < TOP_K)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.moe_route`."""
    e = logits.shape[-1]
    assert 0 < top_k <= e, f"top_k {top_k} with {e} experts"
    rows = logits.reshape(-1, e)
    _check_last_contiguous(logits=rows)
    weights = torch.empty(rows.shape[0], top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(rows.shape[0], top_k, dtype=torch.int64, device=logits.device)
    if rows.shape[0]:
        _moe_route_kernel[(rows.shape[0],)](rows, weights, ids, rows.stride(0), e, TOP_K=top_k,
                                            RENORM=bool(renormalize), BLOCK_E=_pow2(e), BLOCK_K=_pow2(top_k))
    lead = tuple(logits.shape[:-1])
    return weights.view(*lead, top_k), ids.view(*lead, top_k)


MOE_BLOCK_M = 16  # (token, expert) pairs per grouped block: the rows of each `tl.dot` (>= 16)


def moe_block_table(ids: torch.Tensor, num_experts: int,
                    block_m: int = MOE_BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped MoE schedule of a routing, computed on the device with static shapes.

    The N*k (token, expert) pairs (pair p = token * k + j) are sorted by expert (stable, so the
    pairs of an expert stay in token order) and cut into blocks of at most `block_m` pairs of one
    expert. The number of blocks is data dependent, so the table has a static upper bound of rows,
    min(N*k, N*k // block_m + min(E, N*k)) (each expert with pairs adds at most one partial block);
    the rows past the real blocks are empty (start == stop) and their programs do no work.
    Pairs of id num_experts (the foreign-pair sentinel of an expert-parallel shard) sort last and
    fall in no block: no program computes them.

    Args:
        ids: [N, k] int64 expert ids, each in [0, num_experts].
    Returns:
        (order [N*k] int64: pair indices sorted by expert, table [G, 3] int64: per block its
        expert, and the range [start, stop) of `order` it covers).
    """
    flat = ids.reshape(-1)
    pairs = flat.shape[0]
    grid = min(pairs, pairs // block_m + min(num_experts, pairs))
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    first = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=ids.device))  # [E+1]
    blocks = (first[1:] - first[:-1] + block_m - 1) // block_m                                # [E]
    block_end = torch.cumsum(blocks, 0)
    b = torch.arange(grid, device=ids.device)
    expert = torch.searchsorted(block_end, b, right=True).clamp(max=num_experts - 1)
    start = first[expert] + (b - (block_end[expert] - blocks[expert])) * block_m
    stop = torch.minimum(start + block_m, first[expert + 1])
    stop = torch.where(b < block_end[-1], stop, start)  # rows past the last real block: empty
    return order, torch.stack((expert, start, stop), dim=1)


@triton.jit
def _moe_block(table_ptr, order_ptr, BLOCK_M: tl.constexpr):
    """This program's block of the table: (expert, its pairs [BLOCK_M], their mask, any pair at all)."""
    blk = tl.program_id(0).to(tl.int64)
    expert = tl.load(table_ptr + blk * 3)
    start = tl.load(table_ptr + blk * 3 + 1)
    stop = tl.load(table_ptr + blk * 3 + 2)
    m = start + tl.arange(0, BLOCK_M)
    m_mask = m < stop
    pair = tl.load(order_ptr + m, mask=m_mask, other=0)
    return expert, pair, m_mask, stop > start


@triton.jit
def _moe_gate_up_act_kernel(
    x_ptr,                    # [N, H] tokens, model dtype
    order_ptr,                # [N*K] int64 pair indices (token * K + j) sorted by expert
    table_ptr,                # [G, 3] int64 per block: expert, start, stop (a range of order)
    gu_ptr,                   # gate/up weights, model dtype: [E, 2I, H] gate rows then up rows (Qwen,
                              # Mixtral), or [E, H, 2I] gate / up columns interleaved (GPT-OSS)
    gub_ptr,                  # [E, 2I] gate/up bias laid out like a weight row (read only with GPT_OSS)
    act_ptr,                  # [N*K, I] act(gate, up) per pair, model dtype, contiguous
    stride_x,                 # elements between rows of x
    stride_ge, stride_gh, stride_gc,  # gate_up strides: expert, hidden, intermediate channel
    up_offset,                # elements from a gate weight to its up weight (I rows, or the next column)
    stride_be,                # bias strides: expert (its channels are laid out as the weight's)
    H, I,                     # hidden size, expert intermediate size
    alpha, limit,             # GPT_OSS: SwiGLU's sigmoid gain; clamp of gate (above) and up (both sides)
    K: tl.constexpr,          # experts per token
    GPT_OSS: tl.constexpr,    # biases and the clamped SwiGLU; else silu(gate) * up
    BLOCK_M: tl.constexpr,    # pairs per block (rows of the tl.dot)
    BLOCK_I: tl.constexpr,    # intermediate channels per program
    BLOCK_H: tl.constexpr,    # hidden columns per iteration
    DOT_FP32: tl.constexpr,   # cast tl.dot operands to float32 and use IEEE precision
):
    expert, pair, m_mask, busy = _moe_block(table_ptr, order_ptr, BLOCK_M)
    token = pair // K
    ch = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    acc_g = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
    h_end = tl.where(busy, H, 0)  # an empty block reads nothing
    for h0 in range(0, h_end, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + token[:, None] * stride_x + hs[None, :], mask=m_mask[:, None] & (hs < H)[None, :],
                    other=0.0)
        w_mask = (hs < H)[:, None] & (ch < I)[None, :]
        w_base = gu_ptr + expert * stride_ge + hs[:, None] * stride_gh + ch[None, :] * stride_gc
        wg = tl.load(w_base, mask=w_mask, other=0.0)       # [BLOCK_H, BLOCK_I]: once per block of pairs
        wu = tl.load(w_base + up_offset, mask=w_mask, other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            acc_g += tl.dot(x, wg.to(tl.float32), input_precision="ieee")
            acc_u += tl.dot(x, wu.to(tl.float32), input_precision="ieee")
        else:
            acc_g += tl.dot(x, wg)
            acc_u += tl.dot(x, wu)
    dtype = act_ptr.dtype.element_ty
    # rounded to the model dtype where the reference rounds
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    if GPT_OSS:  # the biased sums, glu, up + 1
        bias = gub_ptr + expert * stride_be + ch * stride_gc
        bg = tl.load(bias, mask=ch < I, other=0.0).to(tl.float32)
        bu = tl.load(bias + up_offset, mask=ch < I, other=0.0).to(tl.float32)
        gate = tl.minimum((gate + bg[None, :]).to(dtype).to(tl.float32), limit)
        up = (up + bu[None, :]).to(dtype).to(tl.float32)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        glu = (gate * tl.sigmoid(gate * alpha)).to(dtype).to(tl.float32)
        act = (up + 1.0).to(dtype).to(tl.float32) * glu
    else:        # silu(gate), then the product
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up
    tl.store(act_ptr + pair[:, None] * I + ch[None, :], act.to(dtype), mask=m_mask[:, None] & (ch < I)[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr,                  # [N*K, I] expert activations per pair, model dtype, contiguous
    w_ptr,                    # [N, K] routing weights, model dtype
    order_ptr,                # [N*K] int64 pair indices sorted by expert
    table_ptr,                # [G, 3] int64 per block: expert, start, stop
    down_ptr,                 # down projections, model dtype: [E, H, I] (Qwen, Mixtral) or [E, I, H] (GPT-OSS)
    db_ptr,                   # [E, H] down bias, model dtype (read only with HAS_BIAS)
    out_ptr,                  # [N*K, H] weighted expert outputs per pair, model dtype, contiguous
    stride_w,                 # elements between rows of weights
    stride_de, stride_dh, stride_di,  # down strides (expert, output column, intermediate row)
    stride_be,                # down bias stride (expert)
    H, I,                     # hidden size, expert intermediate size
    K: tl.constexpr,          # experts per token
    HAS_BIAS: tl.constexpr,   # add the expert's down bias before the routing weight
    BLOCK_M: tl.constexpr,    # pairs per block
    BLOCK_H: tl.constexpr,    # output columns per program
    BLOCK_I: tl.constexpr,    # intermediate rows per iteration
    DOT_FP32: tl.constexpr,   # cast tl.dot operands to float32 and use IEEE precision
):
    expert, pair, m_mask, busy = _moe_block(table_ptr, order_ptr, BLOCK_M)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    i_end = tl.where(busy, I, 0)  # an empty block reads nothing
    for i0 in range(0, i_end, BLOCK_I):
        rows = i0 + tl.arange(0, BLOCK_I)
        a = tl.load(act_ptr + pair[:, None] * I + rows[None, :], mask=m_mask[:, None] & (rows < I)[None, :],
                    other=0.0)
        w = tl.load(down_ptr + expert * stride_de + rows[:, None] * stride_di + hs[None, :] * stride_dh,
                    mask=(rows < I)[:, None] & (hs < H)[None, :], other=0.0)  # [BLOCK_I, BLOCK_H], once per block
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(db_ptr + expert * stride_be + hs, mask=hs < H, other=0.0).to(tl.float32)
        out = (out + bias[None, :]).to(dtype).to(tl.float32)
    weight = tl.load(w_ptr + (pair // K) * stride_w + pair % K, mask=m_mask, other=0.0).to(tl.float32)
    out = (out * weight[:, None]).to(dtype)  # rounded like the reference
    tl.store(out_ptr + pair[:, None] * H + hs[None, :], out, mask=m_mask[:, None] & (hs < H)[None, :])


def _grouped_experts(x, weights, ids, e: int, i: int, gate_up, gate_up_strides, up_offset: int, down,
                     down_strides, gate_up_bias=None, down_bias=None, alpha: float = 0.0, limit: float = 0.0):
    """The launch both expert layouts share: the (token, expert) pairs sorted by expert in blocks of
    `MOE_BLOCK_M` (`moe_block_table`, on the device), `_moe_gate_up_act_kernel` then
    `_moe_down_kernel` per block, and the k weighted outputs of a token summed in float32 in a fixed
    order (no atomics). Sentinel pairs (id == e: not on this expert-parallel shard) have no block,
    so their output rows are never written: they are zeroed before the sum (on the device).
    `gate_up_strides` = (hidden, intermediate channel), `down_strides` = (output column,
    intermediate row); with the biases, GPT-OSS's clamped SwiGLU."""
    h, k = x.shape[-1], ids.shape[-1]
    x2, w2, ids2 = x.reshape(-1, h), weights.reshape(-1, k), ids.reshape(-1, k)
    n = x2.shape[0]
    assert w2.shape == ids2.shape == (n, k), f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)} vs x {tuple(x.shape)}"
    assert ids.dtype == torch.int64, f"ids dtype {ids.dtype}"
    biases = {} if gate_up_bias is None else {"gate_up_bias": gate_up_bias, "down_bias": down_bias}
    _check_last_contiguous(x=x2, weights=w2, ids=ids2, gate_up=gate_up, down=down, **biases)
    if not n * k:
        return torch.zeros_like(x)
    gpt_oss = gate_up_bias is not None
    order, table = moe_block_table(ids2, e)
    act = torch.empty(n * k, i, dtype=x.dtype, device=x.device)
    out = torch.empty(n * k, h, dtype=x.dtype, device=x.device)
    dot_fp32 = _dot_fp32(x.dtype)
    # float32 tl.dot runs on FMA units: its tiles spill registers at 4 warps (ahead-of-time checks)
    warps = MOE_WARPS if x.dtype == torch.float32 else 4
    block_i, block_h = min(_pow2(i, 16), 64), min(_pow2(h, 16), 64)  # weight tiles of both kernels
    _moe_gate_up_act_kernel[(table.shape[0], triton.cdiv(i, block_i))](
        x2, order, table, gate_up, gate_up_bias if gpt_oss else gate_up, act, x2.stride(0), gate_up.stride(0),
        *gate_up_strides, up_offset, gate_up_bias.stride(0) if gpt_oss else 0, h, i, float(alpha), float(limit),
        K=k, GPT_OSS=gpt_oss, BLOCK_M=MOE_BLOCK_M, BLOCK_I=block_i, BLOCK_H=block_h, DOT_FP32=dot_fp32,
        num_warps=warps)
    _moe_down_kernel[(table.shape[0], triton.cdiv(h, block_h))](
        act, w2, order, table, down, down_bias if gpt_oss else down, out, w2.stride(0), down.stride(0),
        *down_strides, down_bias.stride(0) if gpt_oss else 0, h, i, K=k, HAS_BIAS=gpt_oss, BLOCK_M=MOE_BLOCK_M,
        BLOCK_H=block_h, BLOCK_I=block_i, DOT_FP32=dot_fp32, num_warps=warps)
    out = out.view(n, k, h).masked_fill_((ids2 >= e)[..., None], 0.0)  # sentinel rows: never written
    y = torch.sum(out, dim=1, dtype=torch.float32).to(x.dtype)  # k in order: deterministic
    return y.view(x.shape)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """See `reference.moe_experts`. Grouped (`_grouped_experts`): gate_up + activation then down +
    routing weight per block of pairs of one expert with `tl.dot`, so each expert's weights are read
    once per block of tokens. No host synchronisation: the grid is sized from the shapes. Ids must
    be in [0, E]; id E (the foreign-pair sentinel, `reference.local_expert_ids`) contributes
    nothing."""
    h = x.shape[-1]
    e, two_i, h2 = gate_up.shape
    i = two_i // 2
    assert h2 == h and two_i == 2 * i, f"gate_up {tuple(gate_up.shape)} vs hidden {h}"
    assert down.shape == (e, h, i), f"down {tuple(down.shape)} != ({e}, {h}, {i})"
    assert x.dtype == weights.dtype == gate_up.dtype == down.dtype, "x, weights and expert weights must share a dtype"
    # gate_up [E, 2I, H]: gate rows then up rows; down [E, H, I]
    return _grouped_experts(x, weights, ids, e, i, gate_up, (gate_up.stride(2), gate_up.stride(1)),
                            i * gate_up.stride(1), down, (down.stride(1), down.stride(2)))


def moe_experts_swiglu(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                       gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                       limit: float) -> torch.Tensor:
    """See `reference.moe_experts_swiglu`. Grouped like `moe_experts` (`_grouped_experts`), with the
    biases and the clamped SwiGLU (a gate column and its up column are neighbours, so one program
    reads both). No host synchronisation. Ids must be in [0, E]; id E contributes nothing (nor its
    bias)."""
    h = x.shape[-1]
    e, h2, two_i = gate_up.shape
    i = two_i // 2
    assert h2 == h and two_i == 2 * i, f"gate_up {tuple(gate_up.shape)} vs hidden {h}"
    assert gate_up_bias.shape == (e, two_i), f"gate_up_bias {tuple(gate_up_bias.shape)} != ({e}, {two_i})"
    assert down.shape == (e, i, h), f"down {tuple(down.shape)} != ({e}, {i}, {h})"
    assert down_bias.shape == (e, h), f"down_bias {tuple(down_bias.shape)} != ({e}, {h})"
    assert x.dtype == weights.dtype == gate_up.dtype == down.dtype == gate_up_bias.dtype == down_bias.dtype, \
        "x, weights, expert weights and biases must share a dtype"
    # gate_up [E, H, 2I]: gate / up columns interleaved; down [E, I, H]: its rows are I
    return _grouped_experts(x, weights, ids, e, i, gate_up, (gate_up.stride(1), 2 * gate_up.stride(2)),
                            gate_up.stride(2), down, (down.stride(2), down.stride(1)), gate_up_bias, down_bias,
                            alpha, limit)


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


# ---------------------------------------------------------------------------------------------- MLA decode

MLA_BLOCK_H = 16  # query heads per program (tl.dot needs 16 rows); every head block re-reads the latent rows


@triton.jit
def _mla_decode_kernel(
    q_ptr,                    # [B, H, R + P] queries: absorbed latent part | rope part, model dtype
    kv_ptr,                   # [B, L, R + P] latent cache rows (latent | rope key), ring buffer, model dtype
    acc_ptr,                  # [B, H, S, R] float32 out: this split's unnormalised p·latent
    ml_ptr,                   # [B, H, 2, S] float32 out: this split's running max, then its sum of exp
    pos_ptr,                  # [B] int positions: attend positions <= pos (none when pos < 0)
    stride_qb, stride_qh,     # q strides (batch, head)
    stride_kb, stride_kl,     # cache strides (batch, slot)
    H, L, R, P,               # heads, cache slots, latent width, rope width
    SPLIT_LEN,                # positions per split (a multiple of BLOCK_N)
    scale,                    # softmax scale
    BLOCK_H: tl.constexpr,    # heads per program (>= 16)
    BLOCK_N: tl.constexpr,    # cache slots per iteration
    BLOCK_R: tl.constexpr,    # power of two >= max(R, 16)
    BLOCK_P: tl.constexpr,    # power of two >= max(P, 16)
    DOT_FP32: tl.constexpr,   # cast tl.dot operands to float32 and use IEEE precision
):
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    q_row = q_ptr + b * stride_qb + heads[:, None].to(tl.int64) * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=h_mask[:, None] & (r < R)[None, :], other=0.0)
    q_pe = tl.load(q_row + R + p[None, :], mask=h_mask[:, None] & (p < P)[None, :], other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    first = tl.maximum(pos - L + 1, 0)
    end = pos + 1
    lo = first + split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, end)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        slot = (n % L).to(tl.int64)
        row = kv_ptr + b * stride_kb + slot[:, None] * stride_kl
        c = tl.load(row + r[None, :], mask=(n < hi)[:, None] & (r < R)[None, :], other=0.0)     # latent = value
        k_pe = tl.load(row + R + p[None, :], mask=(n < hi)[:, None] & (p < P)[None, :], other=0.0)
        if DOT_FP32:
            c = c.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where((n < hi)[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        prob = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        if DOT_FP32:
            pv = tl.dot(prob, c, input_precision="ieee")
        else:
            pv = tl.dot(prob.to(c.dtype), c)  # probabilities in the model dtype, like the reference
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out_row = (b * H + heads).to(tl.int64)
    tl.store(acc_ptr + ((out_row * num_splits + split) * R)[:, None] + r[None, :], acc,
             mask=h_mask[:, None] & (r < R)[None, :])
    ml = ml_ptr + out_row * (2 * num_splits) + split
    tl.store(ml, m_i, mask=h_mask)
    tl.store(ml + num_splits, l_i, mask=h_mask)


def mla_plan(q: torch.Tensor, kv_cache: torch.Tensor, rank: int) -> tuple[targets.AttentionLaunch,
                                                                          targets.AttentionSplit]:
    """Block/stages (`targets.mla_launch`) and split-KV cut of `mla_decode_attention`, from
    shapes, dtype and device only."""
    b, h, slots = q.shape[0], q.shape[1], kv_cache.shape[1]
    dot_fp32 = _dot_fp32(q.dtype)
    launch = targets.mla_launch(_pow2(rank, 16), 4 if dot_fp32 else q.element_size(),
                                targets.launch_smem_limit(q.device), ATTN_BLOCK_N)
    head_blocks = -(-h // MLA_BLOCK_H)
    split = targets.attention_split(b, head_blocks, max(slots, 1), launch.block_n, targets.launch_sm_count(q.device),
                                    max(ATTN_MIN_SPLIT, launch.block_n))
    return launch, split


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor, scale: float,
                         rank: int) -> torch.Tensor:
    """See `reference.mla_decode_attention`. Split-KV over the latent cache: grid (B, head blocks of
    `MLA_BLOCK_H`, splits); each program loads a block of latent rows once for both products
    (scores against [q_abs | q_pe], then p·latent) and writes its partial (max, sum of exp, p·latent);
    `_decode_attention_merge_kernel` merges the splits. No host synchronisation."""
    b, h, width = q.shape
    assert kv_cache.dim() == 3 and kv_cache.shape[0] == b and kv_cache.shape[2] == width, \
        f"cache {tuple(kv_cache.shape)} vs q {tuple(q.shape)}"
    assert 0 < rank < width, f"rank {rank} of rows of {width}"
    assert positions.shape == (b,), f"positions {tuple(positions.shape)} != ({b},)"
    assert q.dtype == kv_cache.dtype, "q and cache must share a dtype"
    slots = kv_cache.shape[1]
    assert slots > 0, "empty cache"
    _check_last_contiguous(q=q, kv_cache=kv_cache)
    o = torch.empty(b, h, rank, dtype=q.dtype, device=q.device)
    launch, split = mla_plan(q, kv_cache, rank)
    block_r = _pow2(rank, 16)
    if b:
        acc = torch.empty(b, h, split.splits, rank, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, h, 2, split.splits, dtype=torch.float32, device=q.device)
        _mla_decode_kernel[(b, -(-h // MLA_BLOCK_H), split.splits)](
            q, kv_cache, acc, ml, positions.contiguous(),
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            h, slots, rank, width - rank, split.split_len, float(scale),
            BLOCK_H=MLA_BLOCK_H, BLOCK_N=launch.block_n, BLOCK_R=block_r, BLOCK_P=_pow2(width - rank, 16),
            DOT_FP32=_dot_fp32(q.dtype), num_warps=launch.num_warps, num_stages=launch.num_stages)
        _decode_attention_merge_kernel[(b, h)](
            acc, ml, o, ml, o.stride(0), o.stride(1), split.splits, rank,  # no sinks (`ml` fills the pointer)
            BLOCK_S=ATTN_MERGE_BLOCK_S, BLOCK_D=block_r, HAS_SINKS=False)
    return o
