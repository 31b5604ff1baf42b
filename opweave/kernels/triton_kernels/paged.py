"""Paged-KV-cache Triton kernels: split-KV decode attention, prefill-chunk attention, cache writes.

Same interface and page layout as the torch references (`opweave.kernels.paged`): pools
`[N, P, Hkv, D]` whose last page is the null page, tables `[B, W]` of page ids, position p of row
b in page `table[b, p // P]` at slot `p % P`, `span` the table entries read per row. Each program
reads its keys through the table (one page id per key row, loaded with the block), so a row's
pages may lie anywhere in the pool and rows may share pages (a common prefix). Keys past a row's
newest cached position are masked loads: the null page and unwritten slots are never read.

Grids depend on shapes and the device only (never on positions or page ids): no host
synchronisation, so every launch can be captured in a CUDA graph. The decode kernel splits the
span like `attention.decode_attention` (`targets.attention_split` over span · P positions, the
tunables `attention.ATTN_BLOCK_N` / `ATTN_MIN_SPLIT` read at each launch) and merges the splits
with `attention._decode_attention_merge_kernel`. `CHUNK_BLOCK_M` is read from this module at each
launch.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from opweave.kernels import targets
from opweave.kernels.triton_kernels import attention
from opweave.kernels.triton_kernels.common import _check_last_contiguous, _dot_fp32, _pow2

_INT_MAX = tl.constexpr(2 ** 31 - 1)  # "no valid position" while looking for a chunk's first one

CHUNK_BLOCK_M = 64  # most (token, query head) rows per chunk-attention program (>= 16; tests lower it)


# ---------------------------------------------------------------------------------------------- decode

@triton.jit
def _paged_decode_attention_kernel(
    q_ptr,                    # [B, Hq, D] queries, model dtype
    k_ptr, v_ptr,             # [N, P, Hkv, D] page pools, model dtype
    acc_ptr,                  # [B, Hq, S, D] float32 out: this split's unnormalised p·v
    ml_ptr,                   # [B, Hq, 2, S] float32 out: this split's running max, then its sum of exp
    table_ptr,                # [B, W] int page ids (entry e holds positions e·P .. e·P + P - 1)
    pos_ptr,                  # [B] int positions: attend positions <= pos (none when pos < 0)
    stride_qb, stride_qh,     # q strides (batch, head)
    stride_kn, stride_kp, stride_kh,  # k pool strides (page, slot, head)
    stride_vn, stride_vp, stride_vh,  # v pool strides
    stride_tb,                # table row stride
    L, D,                     # positions the span holds (span · P), head size
    SPLIT_LEN,                # positions per split (a multiple of BLOCK_N)
    scale,                    # softmax scale of q·k
    PAGE: tl.constexpr,       # slots per page
    GROUP: tl.constexpr,      # query heads per kv head (GQA group size)
    BLOCK_G: tl.constexpr,    # power of two >= max(GROUP, 16) (tl.dot needs 16 rows)
    BLOCK_N: tl.constexpr,    # key positions per iteration
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
    # attended positions [0, min(pos + 1, L)); this split takes [lo, hi) (none: an empty split)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, tl.minimum(pos + 1, L))
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: a fully masked block gives exp(-inf) = 0, not NaN
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if DOT_FP32:
        q = q.to(tl.float32)
    table = table_ptr + b * stride_tb
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)                    # positions of this block
        live = n < hi
        page = tl.load(table + n // PAGE, mask=live, other=0).to(tl.int64)  # where the table keeps them
        slot = (n % PAGE).to(tl.int64)
        kv_mask = live[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + (page * stride_kn + slot * stride_kp + kvh * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)  # an fp8 pool: dequantized here
        v = tl.load(v_ptr + (page * stride_vn + slot * stride_vp + kvh * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(live[None, :], s * scale, float("-inf"))
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


def _check_pages(k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, batch: int) -> None:
    assert k_pages.dim() == 4 and k_pages.shape == v_pages.shape, \
        f"pools {tuple(k_pages.shape)}, {tuple(v_pages.shape)}"
    assert k_pages.shape[0] >= 1 and k_pages.shape[1] >= 1, f"pool {tuple(k_pages.shape)}: no page"
    assert table.dim() == 2 and table.shape[0] == batch, f"table {tuple(table.shape)} vs batch {batch}"
    assert table.dtype in (torch.int32, torch.int64), f"table dtype {table.dtype}: int page ids"
    assert table.shape[1] >= 1, "empty table"


def paged_plan(q: torch.Tensor, k_pages: torch.Tensor, table: torch.Tensor,
               span: int) -> tuple[targets.AttentionLaunch, targets.AttentionSplit]:
    """The block/stages and the split-KV cut `paged_decode_attention` launches with, from shapes,
    dtype, span and device only: `attention_plan`'s choices over span · P positions."""
    b, hkv, page = q.shape[0], k_pages.shape[2], k_pages.shape[1]
    dot_fp32 = _dot_fp32(q.dtype)
    # float32 keys (FMA tl.dot) in blocks of at most 32: the table's per-row page offsets add
    # registers, and 64 spilled at head dim 64 on sm_80 (`aot.py`)
    max_block_n = min(attention.ATTN_BLOCK_N, 32) if dot_fp32 else attention.ATTN_BLOCK_N
    launch = targets.attention_launch(_pow2(q.shape[-1], 16), 4 if dot_fp32 else q.element_size(),
                                      targets.launch_smem_limit(q.device), max_block_n)
    length = max(min(span, table.shape[1]) * page, 1)
    split = targets.attention_split(b, hkv, length, launch.block_n, targets.launch_sm_count(q.device),
                                    max(attention.ATTN_MIN_SPLIT, launch.block_n))
    return launch, split


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                           positions: torch.Tensor, scale: float, span: int,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See `paged.paged_decode_attention`. Split-KV: grid (B, Hkv, splits) over the first `span`
    table entries (span · P positions), each program attends one split for the whole GQA group,
    reading its keys through the table, and writes its partial (max, sum of exp, p·v);
    `_decode_attention_merge_kernel`, grid (B, Hq), merges the splits with log-sum-exp, starting
    from the head's sink logit when `sinks` is given. No host synchronisation."""
    b, hq, d = q.shape
    _check_pages(k_pages, v_pages, table, b)
    page, hkv = k_pages.shape[1], k_pages.shape[2]
    assert k_pages.shape[3] == d, f"pool {tuple(k_pages.shape)} vs q {tuple(q.shape)}"
    assert hq % hkv == 0, f"{hq} query heads not a multiple of {hkv} kv heads"
    assert positions.shape == (b,), f"positions {tuple(positions.shape)} != ({b},)"
    assert span >= 1, f"span {span}: read at least one table entry"
    assert k_pages.dtype == v_pages.dtype in (q.dtype, torch.float8_e4m3fn), \
        "pools in q's dtype or float8 e4m3 (`--kv-cache-dtype fp8`)"
    assert attention.ATTN_BLOCK_N >= 16 and attention.ATTN_BLOCK_N & (attention.ATTN_BLOCK_N - 1) == 0, \
        "ATTN_BLOCK_N: power of two >= 16"
    assert sinks is None or sinks.shape == (hq,), f"sinks {tuple(sinks.shape)} != ({hq},)"
    _check_last_contiguous(q=q, k_pages=k_pages, v_pages=v_pages, table=table)
    o = torch.empty_like(q)
    group = hq // hkv
    block_d = _pow2(d, 16)
    launch, split = paged_plan(q, k_pages, table, span)
    if b:
        acc = torch.empty(b, hq, split.splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, hq, 2, split.splits, dtype=torch.float32, device=q.device)
        _paged_decode_attention_kernel[(b, hkv, split.splits)](
            q, k_pages, v_pages, acc, ml, table, positions.contiguous(),
            q.stride(0), q.stride(1), *k_pages.stride()[:3], *v_pages.stride()[:3], table.stride(0),
            min(span, table.shape[1]) * page, d, split.split_len, float(scale),
            PAGE=page, GROUP=group, BLOCK_G=_pow2(group, 16), BLOCK_N=launch.block_n, BLOCK_D=block_d,
            DOT_FP32=_dot_fp32(q.dtype), num_stages=launch.num_stages)
        attention._decode_attention_merge_kernel[(b, hq)](
            acc, ml, o, sinks.contiguous() if sinks is not None else ml, o.stride(0), o.stride(1), split.splits, d,
            BLOCK_S=attention.ATTN_MERGE_BLOCK_S, BLOCK_D=block_d, HAS_SINKS=sinks is not None)
    return o


# ---------------------------------------------------------------------------------------------- chunk

@triton.jit
def _attend_block(q, k, v, allowed, m_i, l_i, acc, scale, DOT_FP32: tl.constexpr):
    """One key block of the online softmax: scores q·kᵀ · scale where `allowed` [rows, keys], else
    -inf; returns the rows' new (max, sum of exp, unnormalised p·v)."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(allowed, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)  # probabilities in the model dtype, like the reference
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _paged_chunk_attention_kernel(
    q_ptr,                    # [B, T, Hq, D] the chunk's queries, model dtype
    k_ptr, v_ptr,             # [B, T, Hkv, D] the chunk's own keys and values
    kp_ptr, vp_ptr,           # [N, P, Hkv, D] page pools holding the cached positions
    o_ptr,                    # [B, T, Hq, D] output, model dtype
    table_ptr,                # [B, W] int page ids
    pos_ptr,                  # [B, T] int positions, < 0 for padding
    sinks_ptr,                # [Hq] sink logits (read only when HAS_SINKS)
    stride_qb, stride_qt, stride_qh,  # q strides (batch, token, head)
    stride_kb, stride_kt, stride_kh,  # chunk k strides
    stride_vb, stride_vt, stride_vh,  # chunk v strides
    stride_kpn, stride_kpp, stride_kph,  # k pool strides (page, slot, head)
    stride_vpn, stride_vpp, stride_vph,  # v pool strides
    stride_ob, stride_ot, stride_oh,  # output strides
    stride_tb, stride_pb,     # table and positions row strides
    T, L, D,                  # chunk tokens, positions the span holds (span · P), head size
    scale,                    # softmax scale of q·k
    PAGE: tl.constexpr,       # slots per page
    GROUP: tl.constexpr,      # query heads per kv head
    BLOCK_M: tl.constexpr,    # (token, query head) rows per program: BLOCK_M / GROUP tokens x the group
    BLOCK_N: tl.constexpr,    # keys per iteration
    BLOCK_T: tl.constexpr,    # positions per step of the search for the chunk's first valid one
    BLOCK_D: tl.constexpr,    # power of two >= max(D, 16)
    HAS_SINKS: tl.constexpr,  # GPT-OSS: the softmax has one more term exp(sink) with a zero value
    DOT_FP32: tl.constexpr,   # cast tl.dot operands to float32 and use IEEE precision
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = (r // GROUP).to(tl.int64)                      # row r: token r // G, query head kvh·G + r % G
    heads = kvh * GROUP + (r % GROUP)
    rows = tok < T
    d = tl.arange(0, BLOCK_D)
    q_mask = rows[:, None] & (d < D)[None, :]
    q_rows = q_ptr + b * stride_qb + tok * stride_qt + heads * stride_qh
    q = tl.load(q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)
    pos_row = pos_ptr + b * stride_pb
    q_pos = tl.load(pos_row + tok, mask=rows, other=-1).to(tl.int32)
    # the cache holds the positions before the chunk's first valid one (none for a row of padding)
    first = tl.full([BLOCK_T], _INT_MAX, tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        p = tl.load(pos_row + t, mask=t < T, other=-1).to(tl.int32)
        first = tl.minimum(first, tl.where(p >= 0, p, _INT_MAX))
    first = tl.min(first, axis=0)
    cache_hi = tl.where(first == _INT_MAX, 0, tl.minimum(first, L))
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # one more term: max starts at the sink, the sum at exp(sink - sink) = 1
        m_i = tl.load(sinks_ptr + heads, mask=rows, other=-1.0e30).to(tl.float32)
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = table_ptr + b * stride_tb
    # the cached positions [0, cache_hi), read through the table
    for start in range(0, cache_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        live = n < cache_hi
        page = tl.load(table + n // PAGE, mask=live, other=0).to(tl.int64)
        slot = (n % PAGE).to(tl.int64)
        kv_mask = live[:, None] & (d < D)[None, :]
        k = tl.load(kp_ptr + (page * stride_kpn + slot * stride_kpp + kvh * stride_kph)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)  # an fp8 pool: dequantized here
        v = tl.load(vp_ptr + (page * stride_vpn + slot * stride_vpp + kvh * stride_vph)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        if DOT_FP32:  # re-read (cached): a float32 q held across the loop as an FMA operand spills registers
            qk = tl.load(q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
        else:
            qk = q
        m_i, l_i, acc = _attend_block(qk, k, v, live[None, :] & (n[None, :] <= q_pos[:, None]), m_i, l_i, acc,
                                      scale, DOT_FP32)
    # the chunk's own keys, causally by position (padding keys, pos < 0, never count)
    for start in range(0, T, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        live = j < T
        k_pos = tl.load(pos_row + j, mask=live, other=-1).to(tl.int32)
        jj = j.to(tl.int64)
        kv_mask = live[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + b * stride_kb + (jj * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + b * stride_vb + (jj * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        if DOT_FP32:
            qk = tl.load(q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
        else:
            qk = q
        m_i, l_i, acc = _attend_block(qk, k, v, (k_pos >= 0)[None, :] & (k_pos[None, :] <= q_pos[:, None]),
                                      m_i, l_i, acc, scale, DOT_FP32)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding: l = 0 (or 1 with a sink), acc = 0 -> zeros
    tl.store(o_ptr + b * stride_ob + (tok * stride_ot + heads * stride_oh)[:, None] + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=q_mask)


@dataclasses.dataclass(frozen=True)
class ChunkLaunch:
    """Chunk attention's rows per program, keys per iteration, warps and pipeline depth."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def chunk_plan(q: torch.Tensor, fp8_pool: bool = False) -> ChunkLaunch:
    """`paged_chunk_attention`'s launch from head dim, dtype and device only. Under the
    interpreter (no shared-memory limit): `CHUNK_BLOCK_M` rows, `attention.ATTN_BLOCK_N` keys, 4
    warps. On a GPU, 2 stages and (rows, keys, warps): 16-bit (64, 64, 4) at head dim <= 64,
    (128, 64, 8) at 128, (64, 32, 8) at 256; float32, whose tl.dot runs on FMA units and keeps
    its operands in registers, (32, 32, 8) at <= 64 and (32, 16, 8) above: the largest tiles
    tried that compile without register spills on sm_80/89/90 (`aot.py`; at most 97 KiB of
    shared memory on sm_90, 69 KiB on sm_80/89). An fp8 pool's dequantized tiles take more
    registers: at head dim 128, (64, 64, 8) (`fp8_pool`). Not yet timed on a GPU."""
    block_d = _pow2(q.shape[-1], 16)
    if targets.launch_smem_limit(q.device) is None:
        return ChunkLaunch(CHUNK_BLOCK_M, attention.ATTN_BLOCK_N, 4, 3)
    if _dot_fp32(q.dtype):
        return ChunkLaunch(32, 32 if block_d <= 64 else 16, 8, 2)
    if block_d <= 64:
        return ChunkLaunch(64, 64, 4, 2)
    if block_d <= 128:
        return ChunkLaunch(64 if fp8_pool else 128, 64, 8, 2)
    return ChunkLaunch(64, 32, 8, 2)


def paged_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                          v_pages: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, scale: float,
                          span: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See `paged.paged_chunk_attention`. Grid (B, Hkv, cdiv(T·G, block_m)): a program takes
    block_m (token, query head) rows of one KV head's group (the group's heads share each K/V
    block), finds the row's first valid position (the cache holds those before it), attends the
    cached positions through the table, then the chunk's own keys causally by position, with one
    online softmax (from the sink logit when `sinks` is given). Padding queries get zeros. No host
    synchronisation."""
    b, t, hq, d = q.shape
    _check_pages(k_pages, v_pages, table, b)
    page, hkv = k_pages.shape[1], k_pages.shape[2]
    assert k.shape == v.shape == (b, t, hkv, d), f"k {tuple(k.shape)}, v {tuple(v.shape)} vs q {tuple(q.shape)}"
    assert k_pages.shape[3] == d, f"pool {tuple(k_pages.shape)} vs q {tuple(q.shape)}"
    assert hq % hkv == 0, f"{hq} query heads not a multiple of {hkv} kv heads"
    assert positions.shape == (b, t), f"positions {tuple(positions.shape)} != ({b}, {t})"
    assert span >= 1, f"span {span}: read at least one table entry"
    assert q.dtype == k.dtype == v.dtype and k_pages.dtype == v_pages.dtype in (q.dtype, torch.float8_e4m3fn), \
        "q, k, v in one dtype; pools in it or float8 e4m3 (`--kv-cache-dtype fp8`)"
    assert sinks is None or sinks.shape == (hq,), f"sinks {tuple(sinks.shape)} != ({hq},)"
    _check_last_contiguous(q=q, k=k, v=v, k_pages=k_pages, v_pages=v_pages, table=table, positions=positions)
    o = torch.empty(b, t, hq, d, dtype=q.dtype, device=q.device)
    group = hq // hkv
    launch = chunk_plan(q, fp8_pool=k_pages.dtype == torch.float8_e4m3fn)
    assert launch.block_m >= 16 and launch.block_m & (launch.block_m - 1) == 0, "CHUNK_BLOCK_M: power of two >= 16"
    if b and t:
        _paged_chunk_attention_kernel[(b, hkv, triton.cdiv(t * group, launch.block_m))](
            q, k, v, k_pages, v_pages, o, table, positions, sinks.contiguous() if sinks is not None else o,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *k_pages.stride()[:3], *v_pages.stride()[:3],
            *o.stride()[:3], table.stride(0), positions.stride(0),
            t, min(span, table.shape[1]) * page, d, float(scale),
            PAGE=page, GROUP=group, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
            BLOCK_T=min(_pow2(t, 16), 1024), BLOCK_D=_pow2(d, 16), HAS_SINKS=sinks is not None,
            DOT_FP32=_dot_fp32(q.dtype), num_warps=launch.num_warps, num_stages=launch.num_stages)
    return o


# ---------------------------------------------------------------------------------------------- cache write

@triton.jit
def _paged_cache_write_kernel(
    k_ptr, v_ptr,             # [B, T, Hkv, D] the step's keys and values
    kp_ptr, vp_ptr,           # [N, P, Hkv, D] page pools, written in place
    table_ptr,                # [B, W] int page ids
    pos_ptr,                  # [B, T] int positions, < 0 for padding (not written)
    stride_kb, stride_kt, stride_kh,  # k strides (batch, token, head)
    stride_vb, stride_vt, stride_vh,  # v strides
    stride_kpn, stride_kpp, stride_kph,  # k pool strides (page, slot, head)
    stride_vpn, stride_vpp, stride_vph,  # v pool strides
    stride_tb, stride_pb,     # table and positions row strides
    T, W, H, D,               # tokens, table entries, kv heads, head size
    PAGE: tl.constexpr,       # slots per page
    BLOCK_H: tl.constexpr,    # power of two >= Hkv: every head of the token in one program
    BLOCK_D: tl.constexpr,    # power of two >= D
    FP8: tl.constexpr,        # the pools are float8 e4m3: values saturate at +-448 (`reference.to_cache`)
):
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // T, bt % T
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    pos = tl.load(pos_ptr + b * stride_pb + t + 0 * h)   # per lane: the interpreter rejects a mask from a scalar
    valid = pos >= 0
    p = tl.maximum(pos, 0)
    entry = tl.minimum(p // PAGE, W - 1)                 # the reference's clamp to the table's last entry
    page = tl.load(table_ptr + b * stride_tb + entry, mask=valid, other=0).to(tl.int64)
    slot = (p % PAGE).to(tl.int64)
    mask = (valid & (h < H))[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + b * stride_kb + t * stride_kt + (h * stride_kh)[:, None] + d[None, :], mask=mask)
    v = tl.load(v_ptr + b * stride_vb + t * stride_vt + (h * stride_vh)[:, None] + d[None, :], mask=mask)
    if FP8:  # saturate, and keep a NaN a NaN (as `reference.to_cache`: its row stays non-finite)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        k = tl.where(k != k, k, tl.minimum(tl.maximum(k, -448.0), 448.0))
        v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0))
    tl.store(kp_ptr + (page * stride_kpn + slot * stride_kpp + h * stride_kph)[:, None] + d[None, :],
             k.to(kp_ptr.dtype.element_ty), mask=mask)
    tl.store(vp_ptr + (page * stride_vpn + slot * stride_vpp + h * stride_vph)[:, None] + d[None, :],
             v.to(vp_ptr.dtype.element_ty), mask=mask)


def paged_cache_write(k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, positions: torch.Tensor) -> None:
    """See `paged.paged_cache_write`: one program per token writes its every head. Padding
    (position < 0) is a masked store, so the null page is not written at all; every other page
    ends as the reference leaves it. No host synchronisation."""
    b, t = positions.shape
    _check_pages(k_pages, v_pages, table, b)
    page, hkv, d = k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
    assert k.shape == v.shape == (b, t, hkv, d), \
        f"k {tuple(k.shape)}, v {tuple(v.shape)} vs pool {tuple(k_pages.shape)}"
    assert k.is_floating_point() and v.is_floating_point(), "k, v: floating point"
    _check_last_contiguous(k=k, v=v, k_pages=k_pages, v_pages=v_pages, table=table, positions=positions)
    if b and t:
        _paged_cache_write_kernel[(b * t,)](
            k, v, k_pages, v_pages, table, positions,
            *k.stride()[:3], *v.stride()[:3], *k_pages.stride()[:3], *v_pages.stride()[:3],
            table.stride(0), positions.stride(0), t, table.shape[1], hkv, d,
            PAGE=page, BLOCK_H=_pow2(hkv), BLOCK_D=_pow2(d), FP8=k_pages.dtype == torch.float8_e4m3fn)
