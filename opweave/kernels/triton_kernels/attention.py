"""Attention Triton kernels: split-KV decode attention and its merge, MLA decode, Gated-DeltaNet.

The launch tunables (`ATTN_BLOCK_N`, `ATTN_MIN_SPLIT`) are read from this module at each launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opweave.kernels import targets
from opweave.kernels.triton_kernels.common import _check_last_contiguous, _dot_fp32, _pow2

# l2-normalisation epsilon of Gated-DeltaNet's q and k (reference.l2_normalize's default)
_L2_EPS = tl.constexpr(1e-6)

ATTN_BLOCK_N = 64  # most cache slots per decode-attention iteration (power of two >= 16; tests lower it);
                  # on a GPU `targets.attention_launch` may pick fewer (shared memory, registers)


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
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)  # an fp8 cache: dequantized here
        v = tl.load(v_ptr + b * stride_vb + slot[:, None] * stride_vl + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
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
    assert k_cache.dtype == v_cache.dtype in (q.dtype, torch.float8_e4m3fn), \
        "caches in q's dtype or float8 e4m3 (`--kv-cache-dtype fp8`)"
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
        c = tl.load(row + r[None, :], mask=(n < hi)[:, None] & (r < R)[None, :],
                    other=0.0).to(q_ptr.dtype.element_ty)   # latent = value (an fp8 cache: dequantized here)
        k_pe = tl.load(row + R + p[None, :], mask=(n < hi)[:, None] & (p < P)[None, :],
                       other=0.0).to(q_ptr.dtype.element_ty)
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
    assert kv_cache.dtype in (q.dtype, torch.float8_e4m3fn), "a cache in q's dtype or float8 e4m3 (`--kv-cache-dtype fp8`)"
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
