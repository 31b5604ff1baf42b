"""Block-scaled GEMM Triton kernels over the published quantized weight formats: y = x @ W^T.

The weights stay in GPU memory exactly as the checkpoint stores them (`opweave.models.quantized`
has the layouts and the CPU dequantizers these kernels must agree with) and are dequantized in
registers, tile by tile, right before the `tl.dot`; activations and the output keep the model
dtype (float32, float16 or bfloat16), the sums are float32.

fp8 with 128 x 128 block scales (DeepSeek-V3, Kimi-K2): `weight` float8_e4m3fn [N, K], one byte
    a value, passed as its raw bytes (`weight.view(torch.uint8)`, so no float8 dtype is needed, on
    any target or in the interpreter), and `weight_scale_inv` float32 [ceil(N / 128), ceil(K / 128)];
    W[n, k] = e4m3(weight[n, k]) * scale_inv[n // 128, k // 128] (last blocks may be partial). A
    K tile lies in one 128-column scale block, so the scale is applied per output column after the
    tile's `tl.dot`, whose weight operand is the unscaled e4m3 value: exact in float16 and bfloat16.
MXFP4 (GPT-OSS's experts): `blocks` uint8 [N, K / 32, 16], two 4-bit e2m1 values a byte (half a
    byte a value), low nibble first: byte j of group g holds k = 32 g + 2 j (low) and 32 g + 2 j + 1
    (high); `scales` uint8 [N, K / 32], e8m0: 2 ** (s - 127); W[n, k] = FP4_E2M1[nibble] *
    scale[n, k // 32]. A tile spans several groups, so each value is scaled before the `tl.dot` (in
    float32, then rounded to the dot's operand dtype, as `dequantize_mxfp4(dtype=...)` rounds); the
    low and high nibbles are two `tl.dot`s against the even and odd columns of x.

Decoding is integer arithmetic on the bits: an e4m3 byte's sign, exponent and mantissa moved into a
float16's fields is the value times 2 ** -8 (float16's exponent bias is 15, e4m3's 7; subnormals,
exponent 0, land on float16 subnormals: m/8 * 2^-6 * 2^-8); an e2m1 nibble so moved is the value
times 2 ** -14. Both are exact; the power of two goes into the scale. The e4m3 NaN codes (0x7F,
0xFF) are not special-cased (they decode as +-480): published weights have none. An e8m0 scale is
the float32 with exponent field s: exact for s in 1..254 (s = 0, 2 ** -127, reads 0; 255, NaN,
reads inf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opweave.kernels.stored import FP8_BLOCK, MXFP4_GROUP
from opweave.kernels.triton_kernels.common import _dot_fp32

FP8_BLOCK_M, FP8_BLOCK_N, FP8_BLOCK_K = 16, 64, FP8_BLOCK[1]  # a K tile is one scale column
MXFP4_BLOCK_M, MXFP4_BLOCK_N, MXFP4_BLOCK_K = 16, 64, 128      # a K tile is 4 MXFP4 groups
# float32 x: tl.dot runs on FMA units and its [BLOCK_K, 64] float32 weight tiles spill registers at
# BLOCK_K 128 (and 64 at 4 warps): a quarter of a scale column (fp8), one group (MXFP4), 8 warps
# (no spills for sm_80/89/90, `python -m opweave.kernels.aot --kernel ...`)
FP32_BLOCK_K, FP32_WARPS = 32, 8
assert FP8_BLOCK[1] % FP8_BLOCK_K == 0 and FP8_BLOCK[1] % FP32_BLOCK_K == 0
assert MXFP4_BLOCK_K % MXFP4_GROUP == 0 and FP32_BLOCK_K % MXFP4_GROUP == 0
_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _e4m3_to_fp16(bits):
    """float8 e4m3fn bytes (uint8) -> float16 values times 2 ** -8 (exact, NaN codes not special)."""
    b = bits.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_to_fp16(code):
    """4-bit e2m1 codes (in the low bits of a uint8) -> float16 values times 2 ** -14 (exact)."""
    c = code.to(tl.uint16)
    return (((c & 0x8) << 12) | ((c & 0x7) << 9)).to(tl.float16, bitcast=True)


@triton.jit
def _e8m0_to_fp32(s):
    """e8m0 scale bytes -> 2 ** (s - 127) in float32 (exact for s in 1..254)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------------------------- fp8, 128 x 128 scales

@triton.jit
def _fp8_block_linear_kernel(
    x_ptr,                    # [M, K] activations, model dtype
    w_ptr,                    # [N, K] float8 e4m3fn weight as uint8 bytes
    s_ptr,                    # [ceil(N / SCALE_N), ceil(K / SCALE_K)] float32 scale_inv
    y_ptr,                    # [M, N] output, model dtype
    stride_xm, stride_wn, stride_sn, stride_ym,  # elements between rows
    M, N, K,
    SCALE_N: tl.constexpr,    # weight rows per scale row (128)
    SCALE_K: tl.constexpr,    # weight columns per scale column (128)
    BLOCK_M: tl.constexpr,    # rows of x per program
    BLOCK_N: tl.constexpr,    # output columns (weight rows) per program
    BLOCK_K: tl.constexpr,    # columns per iteration, a divisor of SCALE_K: one scale per output column
    DOT_FP32: tl.constexpr,   # cast tl.dot operands to float32 and use IEEE precision
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rows < M, n < N
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + n.to(tl.int64)[None, :] * stride_wn
    s_base = s_ptr + (n // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_base + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        bits = tl.load(w_base + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        w = _e4m3_to_fp16(bits)                                                                # value * 2^-8
        scale = tl.load(s_base + k0 // SCALE_K, mask=n_mask, other=0.0) * 256.0               # [BLOCK_N]
        if DOT_FP32:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x_ptr.dtype.element_ty))  # e4m3 values are exact in fp16 / bf16
        acc += part * scale[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_linear(x: torch.Tensor, weight_bits: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x @ W^T for a DeepSeek-V3 fp8 weight with 128 x 128 block scales, read in its stored format.

    Args:
        x: [M, K] float32 / float16 / bfloat16, contiguous.
        weight_bits: [N, K] uint8: the float8_e4m3fn weight's bytes (`weight.view(torch.uint8)`).
        scale_inv: [ceil(N / 128), ceil(K / 128)] float32 (`weight_scale_inv`).
    Returns:
        [M, N] in x's dtype: sum_k x[m, k] * e4m3(weight[n, k]) * scale_inv[n // 128, k // 128], float32 sums.
    """
    (m, k), (n, k2), sb = x.shape, weight_bits.shape, FP8_BLOCK
    assert (x.dtype in _X_DTYPES and k2 == k and weight_bits.dtype == torch.uint8 and scale_inv.dtype == torch.float32
            and tuple(scale_inv.shape) == (triton.cdiv(n, sb[0]), triton.cdiv(k, sb[1]))
            and x.is_contiguous() and weight_bits.is_contiguous() and scale_inv.is_contiguous()), \
        f"fp8_block_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight_bits.shape)} {weight_bits.dtype}, " \
        f"scale_inv {tuple(scale_inv.shape)} {scale_inv.dtype} (want x float, weight uint8 [N, K], scale_inv " \
        "float32 [ceil(N/128), ceil(K/128)], contiguous)"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        fp32 = x.dtype == torch.float32
        grid = (triton.cdiv(m, FP8_BLOCK_M), triton.cdiv(n, FP8_BLOCK_N))
        _fp8_block_linear_kernel[grid](
            x, weight_bits, scale_inv, y, x.stride(0), weight_bits.stride(0), scale_inv.stride(0), y.stride(0),
            m, n, k, SCALE_N=sb[0], SCALE_K=sb[1], BLOCK_M=FP8_BLOCK_M, BLOCK_N=FP8_BLOCK_N,
            BLOCK_K=FP32_BLOCK_K if fp32 else FP8_BLOCK_K, DOT_FP32=_dot_fp32(x.dtype),
            num_warps=FP32_WARPS if fp32 else 4)
    return y


# ---------------------------------------------------------------------------------------------- MXFP4

@triton.jit
def _mxfp4_linear_kernel(
    x_ptr,                    # [M, K] activations, model dtype
    b_ptr,                    # [N, K / 32, 16] uint8: two e2m1 codes a byte, low nibble first
    s_ptr,                    # [N, K / 32] uint8 e8m0 scales
    y_ptr,                    # [M, N] output, model dtype
    stride_xm, stride_bn, stride_sn, stride_ym,  # elements between rows (stride_bn: K / 2 bytes)
    M, N, K,
    GROUP: tl.constexpr,      # values per scale (32)
    BLOCK_M: tl.constexpr,    # rows of x per program
    BLOCK_N: tl.constexpr,    # output columns (weight rows) per program
    BLOCK_K: tl.constexpr,    # columns per iteration (a multiple of GROUP): BLOCK_K / 2 bytes a row
    DOT_FP32: tl.constexpr,   # cast tl.dot operands to float32 and use IEEE precision
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rows < M, n < N
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    b_base = b_ptr + n.to(tl.int64)[None, :] * stride_bn
    s_base = s_ptr + n.to(tl.int64)[None, :] * stride_sn
    dtype = tl.float32 if DOT_FP32 else x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte j of a row: columns 2j (low nibble), 2j + 1 (high)
        j_mask = j < K // 2
        x_mask = m_mask[:, None] & j_mask[None, :]
        x_even = tl.load(x_base + 2 * j[None, :], mask=x_mask, other=0.0).to(dtype)
        x_odd = tl.load(x_base + 2 * j[None, :] + 1, mask=x_mask, other=0.0).to(dtype)
        w_mask = j_mask[:, None] & n_mask[None, :]
        packed = tl.load(b_base + j[:, None], mask=w_mask, other=0)                      # [BLOCK_K / 2, BLOCK_N]
        scale = _e8m0_to_fp32(tl.load(s_base + (2 * j // GROUP)[:, None], mask=w_mask, other=0))
        lo = (_e2m1_to_fp16(packed & 0xF).to(tl.float32) * 16384.0 * scale).to(dtype)  # (value * 2^-14) * 2^14
        hi = (_e2m1_to_fp16(packed >> 4).to(tl.float32) * 16384.0 * scale).to(dtype)
        if DOT_FP32:
            acc += tl.dot(x_even, lo, input_precision="ieee")
            acc += tl.dot(x_odd, hi, input_precision="ieee")
        else:
            acc += tl.dot(x_even, lo)
            acc += tl.dot(x_odd, hi)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ W^T for a GPT-OSS MXFP4 weight, read in its stored format (half a byte a value).

    Args:
        x: [M, K] float32 / float16 / bfloat16, contiguous; K a multiple of 32.
        blocks: [N, K / 32, 16] uint8 (`P_blocks` of one matrix), contiguous.
        scales: [N, K / 32] uint8 e8m0 (`P_scales`), contiguous.
    Returns:
        [M, N] in x's dtype: sum_k x[m, k] * FP4_E2M1[code(n, k)] * 2 ** (scales[n, k // 32] - 127),
        float32 sums (a scaled value is rounded to x's dtype before its product, as
        `dequantize_mxfp4(dtype=x.dtype)` rounds it).
    """
    (m, k), (n, g, b) = x.shape, blocks.shape
    assert (x.dtype in _X_DTYPES and k == g * MXFP4_GROUP and b == MXFP4_GROUP // 2
            and blocks.dtype == scales.dtype == torch.uint8 and tuple(scales.shape) == (n, g)
            and x.is_contiguous() and blocks.is_contiguous() and scales.is_contiguous()), \
        f"mxfp4_linear: x {tuple(x.shape)} {x.dtype}, blocks {tuple(blocks.shape)} {blocks.dtype}, scales " \
        f"{tuple(scales.shape)} {scales.dtype} (want x float, K = 32 G, uint8 [N, G, 16] and [N, G], contiguous)"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        fp32 = x.dtype == torch.float32
        grid = (triton.cdiv(m, MXFP4_BLOCK_M), triton.cdiv(n, MXFP4_BLOCK_N))
        _mxfp4_linear_kernel[grid](
            x, blocks, scales, y, x.stride(0), blocks.stride(0), scales.stride(0), y.stride(0), m, n, k,
            GROUP=MXFP4_GROUP, BLOCK_M=MXFP4_BLOCK_M, BLOCK_N=MXFP4_BLOCK_N,
            BLOCK_K=FP32_BLOCK_K if fp32 else MXFP4_BLOCK_K, DOT_FP32=_dot_fp32(x.dtype),
            num_warps=FP32_WARPS if fp32 else 4)
    return y
