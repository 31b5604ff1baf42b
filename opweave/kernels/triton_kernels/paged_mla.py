"""Paged latent-attention (MLA) Triton kernel: absorbed decode attention over a paged latent cache.

Same interface and page layout as the torch reference (`paged.paged_mla_decode_attention`): pools
`[N, P, rank + rope]` of latent rows `[latent | rope key]` whose last page is the null page, tables
`[B, W]` of page ids, position p of row b in page `table[b, p // P]` at slot `p % P`, `span` the
table entries read per row. The kernel is `attention._mla_decode_kernel` (every head attends the
same rows: the key is the whole row, the value its latent part; one load of a block of rows serves
both products) reading its rows through the table like `paged._paged_decode_attention_kernel`
(one page id per key row, loaded with the block): a row's pages may lie anywhere in the pool and
rows may share pages. Rows past a row's newest cached position are masked loads: the null page and
unwritten slots are never read.

The grid depends on shapes and the device only (never on positions or page ids): no host
synchronisation, CUDA-graph capturable. The span (span · P positions) is cut into splits by
`targets.attention_split` over (batch, head blocks of `attention.MLA_BLOCK_H`), with the tunables
`attention.ATTN_BLOCK_N` / `ATTN_MIN_SPLIT` read at each launch, and the splits are merged by
`attention._decode_attention_merge_kernel`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opweave.kernels import targets
from opweave.kernels.triton_kernels import attention
from opweave.kernels.triton_kernels.common import _check_last_contiguous, _dot_fp32, _pow2


@triton.jit
def _paged_mla_decode_kernel(
    q_ptr,                    # [B, H, R + P] queries: absorbed latent part | rope part, model dtype
    kv_ptr,                   # [N, PAGE, R + P] latent row pool (latent | rope key), model dtype
    acc_ptr,                  # [B, H, S, R] float32 out: this split's unnormalised p·latent
    ml_ptr,                   # [B, H, 2, S] float32 out: this split's running max, then its sum of exp
    table_ptr,                # [B, W] int page ids (entry e holds positions e·PAGE .. e·PAGE + PAGE - 1)
    pos_ptr,                  # [B] int positions: attend positions <= pos (none when pos < 0)
    stride_qb, stride_qh,     # q strides (batch, head)
    stride_kn, stride_kp,     # pool strides (page, slot)
    stride_tb,                # table row stride
    H, L, R, P,               # heads, positions the span holds (span · PAGE), latent width, rope width
    SPLIT_LEN,                # positions per split (a multiple of BLOCK_N)
    scale,                    # softmax scale
    PAGE: tl.constexpr,       # slots per page
    BLOCK_H: tl.constexpr,    # heads per program (>= 16)
    BLOCK_N: tl.constexpr,    # key positions per iteration
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
    # attended positions [0, min(pos + 1, L)); this split takes [lo, hi) (none: an empty split)
    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, tl.minimum(pos + 1, L))
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: a fully masked block gives exp(-inf) = 0, not NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table = table_ptr + b * stride_tb
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)                    # positions of this block
        live = n < hi
        page = tl.load(table + n // PAGE, mask=live, other=0).to(tl.int64)  # where the table keeps them
        row = kv_ptr + (page * stride_kn + (n % PAGE).to(tl.int64) * stride_kp)[:, None]
        c = tl.load(row + r[None, :], mask=live[:, None] & (r < R)[None, :],
                    other=0.0).to(q_ptr.dtype.element_ty)   # latent = value (an fp8 pool: dequantized here)
        k_pe = tl.load(row + R + p[None, :], mask=live[:, None] & (p < P)[None, :], other=0.0).to(q_ptr.dtype.element_ty)
        if DOT_FP32:
            c = c.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(live[None, :], s * scale, float("-inf"))
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


def paged_mla_plan(q: torch.Tensor, kv_pages: torch.Tensor, table: torch.Tensor, span: int,
                   rank: int) -> tuple[targets.MLALaunch, targets.AttentionSplit]:
    """Block/stages/warps (`targets.mla_launch`) and split-KV cut of `paged_mla_decode_attention`,
    from shapes, dtype, span and device only: `mla_plan`'s choices over span · P positions, with
    float32 blocks of at most 32 positions as in `paged.paged_plan` (the per-row page offsets add
    registers to the FMA tl.dot's operands)."""
    b, h, page = q.shape[0], q.shape[1], kv_pages.shape[1]
    dot_fp32 = _dot_fp32(q.dtype)
    max_block_n = min(attention.ATTN_BLOCK_N, 32) if dot_fp32 else attention.ATTN_BLOCK_N
    launch = targets.mla_launch(_pow2(rank, 16), 4 if dot_fp32 else q.element_size(),
                                targets.launch_smem_limit(q.device), max_block_n)
    head_blocks = -(-h // attention.MLA_BLOCK_H)
    length = max(min(span, table.shape[1]) * page, 1)
    split = targets.attention_split(b, head_blocks, length, launch.block_n, targets.launch_sm_count(q.device),
                                    max(attention.ATTN_MIN_SPLIT, launch.block_n))
    return launch, split


def paged_mla_decode_attention(q: torch.Tensor, kv_pages: torch.Tensor, table: torch.Tensor,
                               positions: torch.Tensor, scale: float, rank: int, span: int) -> torch.Tensor:
    """See `paged.paged_mla_decode_attention`. Split-KV over the first `span` table entries (span ·
    P positions): grid (B, head blocks of `MLA_BLOCK_H`, splits); each program reads a block of
    latent rows through the table once for both products (scores against [q_abs | q_pe], then
    p·latent) and writes its partial (max, sum of exp, p·latent); `_decode_attention_merge_kernel`,
    grid (B, H), merges the splits. No host synchronisation."""
    b, h, width = q.shape
    assert kv_pages.dim() == 3 and kv_pages.shape[2] == width, f"pool {tuple(kv_pages.shape)} vs q {tuple(q.shape)}"
    assert kv_pages.shape[0] >= 1 and kv_pages.shape[1] >= 1, f"pool {tuple(kv_pages.shape)}: no page"
    assert table.dim() == 2 and table.shape[0] == b, f"table {tuple(table.shape)} vs batch {b}"
    assert table.dtype in (torch.int32, torch.int64), f"table dtype {table.dtype}: int page ids"
    assert table.shape[1] >= 1, "empty table"
    assert 0 < rank < width, f"rank {rank} of rows of {width}"
    assert positions.shape == (b,), f"positions {tuple(positions.shape)} != ({b},)"
    assert span >= 1, f"span {span}: read at least one table entry"
    assert kv_pages.dtype in (q.dtype, torch.float8_e4m3fn), "a pool in q's dtype or float8 e4m3 (`--kv-cache-dtype fp8`)"
    assert attention.ATTN_BLOCK_N >= 16 and attention.ATTN_BLOCK_N & (attention.ATTN_BLOCK_N - 1) == 0, \
        "ATTN_BLOCK_N: power of two >= 16"
    _check_last_contiguous(q=q, kv_pages=kv_pages, table=table)
    o = torch.empty(b, h, rank, dtype=q.dtype, device=q.device)
    page = kv_pages.shape[1]
    launch, split = paged_mla_plan(q, kv_pages, table, span, rank)
    block_r = _pow2(rank, 16)
    if b:
        acc = torch.empty(b, h, split.splits, rank, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, h, 2, split.splits, dtype=torch.float32, device=q.device)
        _paged_mla_decode_kernel[(b, -(-h // attention.MLA_BLOCK_H), split.splits)](
            q, kv_pages, acc, ml, table, positions.contiguous(),
            q.stride(0), q.stride(1), kv_pages.stride(0), kv_pages.stride(1), table.stride(0),
            h, min(span, table.shape[1]) * page, rank, width - rank, split.split_len, float(scale),
            PAGE=page, BLOCK_H=attention.MLA_BLOCK_H, BLOCK_N=launch.block_n, BLOCK_R=block_r,
            BLOCK_P=_pow2(width - rank, 16), DOT_FP32=_dot_fp32(q.dtype),
            num_warps=launch.num_warps, num_stages=launch.num_stages)
        attention._decode_attention_merge_kernel[(b, h)](
            acc, ml, o, ml, o.stride(0), o.stride(1), split.splits, rank,  # no sinks (`ml` fills the pointer)
            BLOCK_S=attention.ATTN_MERGE_BLOCK_S, BLOCK_D=block_r, HAS_SINKS=False)
    return o
