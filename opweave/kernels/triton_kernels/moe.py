"""MoE and gated-MLP Triton kernels: the gated activation, top-k routing, grouped experts."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from opweave.kernels.blocks import MOE_BLOCK_MIN, moe_block_pairs
from opweave.kernels.stored import FP8_BLOCK, MXFP4_GROUP
from opweave.kernels.triton_kernels.common import _MAX_BLOCK, _check_last_contiguous, _dot_fp32, _pow2
from opweave.kernels.triton_kernels.quant import _e2m1_to_fp16, _e4m3_to_fp16, _e8m0_to_fp32

MOE_WARPS = 8  # float32 MoE tl.dot tiles spill registers at 4 warps (docs/kernels.md, ahead-of-time checks)


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


def moe_block_m(tokens: int, top_k: int, experts: int) -> int:
    """(token, expert) pairs per grouped block for `tokens` tokens routed to `top_k` of `experts`
    (`opweave.kernels.blocks.moe_block_pairs` of the mean pairs per expert: from the shapes alone)."""
    return moe_block_pairs(tokens * top_k / max(1, experts))


def moe_tile(block_m: int, fp32: bool) -> int:
    """The square weight tile (channels x hidden columns) of both grouped kernels at `block_m`
    pairs per block: 64, narrowed as the blocks grow so the accumulators ([block_m, tile] float32,
    two in the gate/up kernel) and a float32 model's operand tiles stay in registers (no spills
    for sm_80/89/90, `tests/test_kernels_aot.py`)."""
    if fp32:
        return 64 if block_m <= 16 else 32 if block_m <= 64 else 16
    return 64 if block_m <= 64 else 32


def moe_block_table(ids: torch.Tensor, num_experts: int,
                    block_m: int = MOE_BLOCK_MIN) -> tuple[torch.Tensor, torch.Tensor]:
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


DENSE, FP8, MXFP4 = 0, 1, 2  # how the grouped kernels' expert weights are held (`WEIGHTS`)


@triton.jit
def _fp8_tile(bits_ptrs, scale_ptr, mask, dtype):
    """A tile of fp8 weights read as stored: e4m3 byte times its block's scale in float32, rounded
    to `dtype` (as `kernels.stored` / `models.quantized` dequantize). The tile lies in one 128 x 128
    scale block (its sides divide 128 and it is aligned), so `scale_ptr` is that block's one scale:
    a scalar load, not a tile of them (a float32 tile of scales per weight tile overflowed sm_89's
    shared memory and spilled at block_m 16)."""
    bits = tl.load(bits_ptrs, mask=mask, other=0)
    scale = tl.load(scale_ptr) * 256.0  # _e4m3_to_fp16 is the value / 256: the same product, one multiply
    return (_e4m3_to_fp16(bits).to(tl.float32) * scale).to(dtype)


@triton.jit
def _mxfp4_tile(byte_ptrs, shift, scale_ptrs, mask, dtype):
    """A tile of MXFP4 weights read as stored: the nibble at `shift` (0 low, 4 high) of each byte,
    an e2m1 value times 2 ** (its group's e8m0 scale - 127), exact, in `dtype`."""
    code = (tl.load(byte_ptrs, mask=mask, other=0) >> shift) & 0xF
    scale = _e8m0_to_fp32(tl.load(scale_ptrs, mask=mask, other=127))
    return (_e2m1_to_fp16(code).to(tl.float32) * 16384.0 * scale).to(dtype)


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
    stride_be,                # bias strides: expert
    bias_c, bias_up,          # bias: elements per channel, from a gate bias to its up bias
    gus_ptr,                  # the weights' scales (WEIGHTS FP8: [E, 2 ceil(I/128), ceil(H/128)] float32,
                              # the gate's block rows then the up's; MXFP4: [E, 2I, H/32] uint8 e8m0)
    stride_se, stride_sc, stride_sh,  # scale strides: expert, channel (fp8: per 128 channels), hidden (fp8: per 128)
    up_scale_offset,          # elements from a gate's scales to its up's
    H, I,                     # hidden size, expert intermediate size
    alpha, limit,             # GPT_OSS: SwiGLU's sigmoid gain; clamp of gate (above) and up (both sides)
    K: tl.constexpr,          # experts per token
    GPT_OSS: tl.constexpr,    # biases and the clamped SwiGLU; else silu(gate) * up
    WEIGHTS: tl.constexpr,    # DENSE (model dtype), FP8 ([E, 2I, H] e4m3 bytes) or MXFP4 ([E, 2I, H/32, 16]
                              # blocks, stored row 2c the gate of channel c, 2c + 1 its up)
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
    wdt = act_ptr.dtype.element_ty  # a stored weight's values, dequantized to the model dtype
    h_end = tl.where(busy, H, 0)  # an empty block reads nothing
    for h0 in range(0, h_end, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + token[:, None] * stride_x + hs[None, :], mask=m_mask[:, None] & (hs < H)[None, :],
                    other=0.0)
        w_mask = (hs < H)[:, None] & (ch < I)[None, :]
        # [BLOCK_H, BLOCK_I] tiles of the gate and up weights: once per block of pairs
        if WEIGHTS == 2:    # MXFP4: byte h // 2 of the channel's stored row, nibble h % 2
            b_base = gu_ptr + expert * stride_ge + ch[None, :] * stride_gc + (hs // 2)[:, None]
            shift = ((hs % 2) * 4)[:, None].to(tl.uint8)
            s_base = gus_ptr + expert * stride_se + ch[None, :] * stride_sc + (hs // 32)[:, None] * stride_sh
            wg = _mxfp4_tile(b_base, shift, s_base, w_mask, wdt)
            wu = _mxfp4_tile(b_base + up_offset, shift, s_base + up_scale_offset, w_mask, wdt)
        else:
            w_base = gu_ptr + expert * stride_ge + hs[:, None] * stride_gh + ch[None, :] * stride_gc
            if WEIGHTS == 1:  # fp8: the tile's 128 x 128 block scale (BLOCK_I, BLOCK_H divide 128)
                s_base = gus_ptr + expert * stride_se + (tl.program_id(1) * BLOCK_I // 128) * stride_sc + \
                    (h0 // 128) * stride_sh
                wg = _fp8_tile(w_base, s_base, w_mask, wdt)
                wu = _fp8_tile(w_base + up_offset, s_base + up_scale_offset, w_mask, wdt)
            else:
                wg = tl.load(w_base, mask=w_mask, other=0.0)
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
        bias = gub_ptr + expert * stride_be + ch * bias_c
        bg = tl.load(bias, mask=ch < I, other=0.0).to(tl.float32)
        bu = tl.load(bias + bias_up, mask=ch < I, other=0.0).to(tl.float32)
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
    ds_ptr,                   # the down weights' scales (WEIGHTS FP8: [E, ceil(H/128), ceil(I/128)] float32;
                              # MXFP4: [E, H, I/32] uint8 e8m0)
    stride_se, stride_sh, stride_si,  # scale strides: expert, output column (fp8: per 128), intermediate (per block)
    H, I,                     # hidden size, expert intermediate size
    K: tl.constexpr,          # experts per token
    HAS_BIAS: tl.constexpr,   # add the expert's down bias before the routing weight
    WEIGHTS: tl.constexpr,    # DENSE, FP8 ([E, H, I] e4m3 bytes) or MXFP4 ([E, H, I/32, 16] blocks)
    BLOCK_M: tl.constexpr,    # pairs per block
    BLOCK_H: tl.constexpr,    # output columns per program
    BLOCK_I: tl.constexpr,    # intermediate rows per iteration
    DOT_FP32: tl.constexpr,   # cast tl.dot operands to float32 and use IEEE precision
):
    expert, pair, m_mask, busy = _moe_block(table_ptr, order_ptr, BLOCK_M)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    wdt = out_ptr.dtype.element_ty
    # fp8: the scales of this program's 128 output columns (BLOCK_H divides 128)
    s_row = ds_ptr + expert * stride_se + (tl.program_id(1) * BLOCK_H // 128) * stride_sh
    i_end = tl.where(busy, I, 0)  # an empty block reads nothing
    for i0 in range(0, i_end, BLOCK_I):
        rows = i0 + tl.arange(0, BLOCK_I)
        a = tl.load(act_ptr + pair[:, None] * I + rows[None, :], mask=m_mask[:, None] & (rows < I)[None, :],
                    other=0.0)
        w_mask = (rows < I)[:, None] & (hs < H)[None, :]
        # [BLOCK_I, BLOCK_H], once per block of pairs
        if WEIGHTS == 2:    # MXFP4: output column h is stored row h; byte i // 2, nibble i % 2
            b_ptrs = down_ptr + expert * stride_de + hs[None, :] * stride_dh + (rows // 2)[:, None]
            s_ptrs = ds_ptr + expert * stride_se + hs[None, :] * stride_sh + (rows // 32)[:, None] * stride_si
            w = _mxfp4_tile(b_ptrs, ((rows % 2) * 4)[:, None].to(tl.uint8), s_ptrs, w_mask, wdt)
        else:
            w_ptrs = down_ptr + expert * stride_de + rows[:, None] * stride_di + hs[None, :] * stride_dh
            if WEIGHTS == 1:  # the tile's block scale (BLOCK_H, BLOCK_I divide 128)
                w = _fp8_tile(w_ptrs, s_row + (i0 // 128) * stride_si, w_mask, wdt)
            else:
                w = tl.load(w_ptrs, mask=w_mask, other=0.0)
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


@dataclasses.dataclass(frozen=True)
class _Stored:
    """How the grouped kernels read expert weights held as stored (`WEIGHTS` FP8 or MXFP4): the
    scale tensors and their strides (expert, then the two the kernel's `stride_s*` name), the offset
    from a gate's scales to its up's, and the bias layout (elements per channel, gate to up)."""

    weights: int
    gate_up_scales: torch.Tensor
    gate_up_scale_strides: tuple[int, int, int]
    up_scale_offset: int
    down_scales: torch.Tensor
    down_scale_strides: tuple[int, int, int]
    bias: tuple[int, int] = (0, 0)


def _grouped_experts(x, weights, ids, e: int, i: int, gate_up, gate_up_strides, up_offset: int, down,
                     down_strides, gate_up_bias=None, down_bias=None, alpha: float = 0.0, limit: float = 0.0,
                     stored: _Stored | None = None):
    """The launch every expert layout shares: the (token, expert) pairs sorted by expert in blocks of
    `moe_block_m` pairs (`moe_block_table`, on the device), `_moe_gate_up_act_kernel` then
    `_moe_down_kernel` per block, and the k weighted outputs of a token summed in float32 in a fixed
    order (no atomics). Sentinel pairs (id == e: not on this expert-parallel shard) have no block,
    so their output rows are never written: they are zeroed before the sum (on the device).
    `gate_up_strides` = (hidden, intermediate channel), `down_strides` = (output column,
    intermediate row); with the biases, GPT-OSS's clamped SwiGLU; `stored`: weights held as a
    checkpoint stores them (strides then count bytes; the kernels dequantize each tile)."""
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
    block_m = moe_block_m(n, k, e)
    order, table = moe_block_table(ids2, e, block_m)
    act = torch.empty(n * k, i, dtype=x.dtype, device=x.device)
    out = torch.empty(n * k, h, dtype=x.dtype, device=x.device)
    dot_fp32 = _dot_fp32(x.dtype)
    # float32 tl.dot runs on FMA units: its tiles spill registers at 4 warps, as do blocks of 64
    # pairs or more (ahead-of-time checks)
    warps = MOE_WARPS if x.dtype == torch.float32 or block_m >= 64 else 4
    if stored is not None and x.dtype == torch.float32 and block_m >= 128:
        warps = 2 * MOE_WARPS  # a float32 model's dequantized tiles at 128 pairs a block spill at 8 warps
    tile = moe_tile(block_m, x.dtype == torch.float32)
    block_i, block_h = min(_pow2(i, 16), tile), min(_pow2(h, 16), tile)  # weight tiles of both kernels
    if stored is not None and stored.weights == FP8:  # a tile lies in one scale block: one scale
        assert FP8_BLOCK[0] % block_i == 0 and FP8_BLOCK[1] % block_h == 0 and \
            FP8_BLOCK[0] % block_h == 0 and FP8_BLOCK[1] % block_i == 0, (block_i, block_h)
    if stored is None:
        stored = _Stored(DENSE, gate_up, (0, 0, 0), 0, down, (0, 0, 0),
                         (gate_up_strides[1], up_offset))
    _moe_gate_up_act_kernel[(table.shape[0], triton.cdiv(i, block_i))](
        x2, order, table, gate_up, gate_up_bias if gpt_oss else gate_up, act, x2.stride(0), gate_up.stride(0),
        *gate_up_strides, up_offset, gate_up_bias.stride(0) if gpt_oss else 0, *stored.bias,
        stored.gate_up_scales, *stored.gate_up_scale_strides, stored.up_scale_offset, h, i, float(alpha),
        float(limit), K=k, GPT_OSS=gpt_oss, WEIGHTS=stored.weights, BLOCK_M=block_m, BLOCK_I=block_i,
        BLOCK_H=block_h, DOT_FP32=dot_fp32, num_warps=warps)
    _moe_down_kernel[(table.shape[0], triton.cdiv(h, block_h))](
        act, w2, order, table, down, down_bias if gpt_oss else down, out, w2.stride(0), down.stride(0),
        *down_strides, down_bias.stride(0) if gpt_oss else 0, stored.down_scales, *stored.down_scale_strides, h,
        i, K=k, HAS_BIAS=gpt_oss, WEIGHTS=stored.weights, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_I=block_i,
        DOT_FP32=dot_fp32, num_warps=warps)
    out = out.view(n, k, h).masked_fill_((ids2 >= e)[..., None], 0.0)  # sentinel rows: never written
    y = torch.sum(out, dim=1, dtype=torch.float32).to(x.dtype)  # k in order: deterministic
    return y.view(x.shape)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """See `reference.moe_experts`. Grouped (`_grouped_experts`): gate_up + activation then down +
    routing weight per block of pairs of one expert with `tl.dot`, so each expert's weights are read
    once per block of up to `moe_block_m` pairs (once per step for up to 128 pairs an expert). No host synchronisation: the grid is sized from the shapes. Ids must
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


def moe_experts_fp8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_bits: torch.Tensor,
                    gate_up_scale: torch.Tensor, down_bits: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    """See `reference.moe_experts_fp8`: `moe_experts` over experts held as DeepSeek-V3's fp8 checkpoint
    stores them, each tile dequantized in registers (e4m3 times its 128 x 128 block's scale in float32,
    rounded to x's dtype, as the reference dequantizes).

    Args:
        gate_up_bits: uint8 [E, 2I, H]: per expert the e4m3 bytes of `gate_proj.weight` then `up_proj.weight`.
        gate_up_scale: float32 [E, 2 ceil(I/128), ceil(H/128)]: the gate's `weight_scale_inv` then the up's.
        down_bits: uint8 [E, H, I]; down_scale: float32 [E, ceil(H/128), ceil(I/128)].
    """
    e, two_i, h = gate_up_bits.shape
    i, rows = two_i // 2, triton.cdiv(two_i // 2, FP8_BLOCK[0])
    assert two_i == 2 * i and h == x.shape[-1], f"gate_up {tuple(gate_up_bits.shape)} vs hidden {x.shape[-1]}"
    assert gate_up_bits.dtype == down_bits.dtype == torch.uint8, "fp8 weights are passed as their bytes (uint8)"
    assert tuple(down_bits.shape) == (e, h, i), f"down {tuple(down_bits.shape)} != ({e}, {h}, {i})"
    assert tuple(gate_up_scale.shape) == (e, 2 * rows, triton.cdiv(h, FP8_BLOCK[1])), \
        f"gate_up_scale {tuple(gate_up_scale.shape)}: want ({e}, {2 * rows}, {triton.cdiv(h, FP8_BLOCK[1])})"
    assert tuple(down_scale.shape) == (e, triton.cdiv(h, FP8_BLOCK[0]), triton.cdiv(i, FP8_BLOCK[1])), \
        f"down_scale {tuple(down_scale.shape)}"
    assert gate_up_scale.dtype == down_scale.dtype == torch.float32 and x.dtype == weights.dtype
    gs, ds = gate_up_scale.stride(), down_scale.stride()
    stored = _Stored(FP8, gate_up_scale, (gs[0], gs[1], gs[2]), rows * gs[1], down_scale, (ds[0], ds[1], ds[2]))
    return _grouped_experts(x, weights, ids, e, i, gate_up_bits, (gate_up_bits.stride(2), gate_up_bits.stride(1)),
                            i * gate_up_bits.stride(1), down_bits, (down_bits.stride(1), down_bits.stride(2)),
                            stored=stored)


def moe_experts_swiglu_mxfp4(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_blocks: torch.Tensor,
                             gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor, down_blocks: torch.Tensor,
                             down_scales: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                             limit: float) -> torch.Tensor:
    """See `reference.moe_experts_swiglu_mxfp4`: `moe_experts_swiglu` over GPT-OSS's experts as its
    checkpoint stores them (MXFP4), each tile dequantized in registers (exact: an e2m1 value times a
    power of two).

    Args:
        gate_up_blocks: uint8 [E, 2I, H/32, 16] (`gate_up_proj_blocks`: stored row 2c is channel c's
            gate, 2c + 1 its up); gate_up_scales: uint8 [E, 2I, H/32] e8m0.
        down_blocks: uint8 [E, H, I/32, 16]; down_scales: uint8 [E, H, I/32].
        gate_up_bias [E, 2I], down_bias [E, H]: x's dtype, as `moe_experts_swiglu` takes them.
    """
    e, two_i, groups, half = gate_up_blocks.shape
    h, i = groups * MXFP4_GROUP, two_i // 2
    assert half == MXFP4_GROUP // 2 and h == x.shape[-1] and two_i == 2 * i, \
        f"gate_up_blocks {tuple(gate_up_blocks.shape)} vs hidden {x.shape[-1]}"
    assert i % MXFP4_GROUP == 0, f"expert channels {i}: not whole groups of {MXFP4_GROUP}"
    assert tuple(down_blocks.shape) == (e, h, i // MXFP4_GROUP, half), f"down_blocks {tuple(down_blocks.shape)}"
    assert tuple(gate_up_scales.shape) == (e, two_i, groups) and tuple(down_scales.shape) == (e, h, i // MXFP4_GROUP)
    assert all(t.dtype == torch.uint8 for t in (gate_up_blocks, gate_up_scales, down_blocks, down_scales))
    assert x.dtype == weights.dtype == gate_up_bias.dtype == down_bias.dtype, "x, weights and biases share a dtype"
    assert tuple(gate_up_bias.shape) == (e, two_i) and tuple(down_bias.shape) == (e, h)
    _check_last_contiguous(gate_up_scales=gate_up_scales, down_scales=down_scales)
    row, srow = gate_up_blocks.stride(1), gate_up_scales.stride(1)  # bytes / scales per stored row
    stored = _Stored(MXFP4, gate_up_scales, (gate_up_scales.stride(0), 2 * srow, 1), srow, down_scales,
                     (down_scales.stride(0), down_scales.stride(1), 1), (2 * gate_up_bias.stride(1), gate_up_bias.stride(1)))
    # gate_up: channel c's gate is stored row 2c, its up the next row; down: output column h is row h
    return _grouped_experts(x, weights, ids, e, i, gate_up_blocks, (0, 2 * row), row, down_blocks,
                            (down_blocks.stride(1), 0), gate_up_bias, down_bias, alpha, limit, stored=stored)
