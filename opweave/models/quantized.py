"""Dequantizing the published block-quantized weight formats (pure functions, no file access).

Two formats, as Hugging Face transformers reads them (`integrations/finegrained_fp8.py`,
`integrations/mxfp4.py`; `tests/test_quantized_checkpoints.py` checks against them):

fp8 with block scales (DeepSeek-V3, Kimi-K2; `quant_method` fp8, `weight_block_size` [128, 128]):
    `X.weight` float8_e4m3fn [..., R, C] and `X.weight_scale_inv` float32
    [..., ceil(R / 128), ceil(C / 128)]; the weight is `weight.float() * scale_inv[r // 128, c // 128]`
    (the last row and column blocks may be partial).

MXFP4 (GPT-OSS's experts; `quant_method` mxfp4): `P_blocks` uint8 [..., N, G, 16] (two 4-bit
    e2m1 values per byte, low nibble first: 32 values per group) and `P_scales` uint8 [..., N, G]
    (an e8m0 exponent: scale 2 ** (s - 127)); row n's values n, 32 g + j are FP4_E2M1[nibble] *
    scale[n, g]. GPT-OSS's dense tensor `P` is that [..., N, 32 G] matrix with its last two
    dimensions swapped: [..., 32 G, N] (`gate_up_proj` [E, H, 2I] from blocks [E, 2I, H/32, 16],
    `down_proj` [E, I, H] from blocks [E, H, I/32, 16]).

`fp8_read` and `mxfp4_read` say which part of the stored tensors a slice of the dense tensor
needs (a tensor-parallel shard reads only its rows and their scales); the dequantizers take that
part and where it starts, so a slice that starts or ends inside a block gets each row's and
column's own scale. Every error is a one-line OpWeaveError naming the tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from opweave.errors import OpWeaveError
from opweave.kernels.stored import FP8_BLOCK, MXFP4_GROUP  # noqa: F401  (the kernels' definition, re-exported)

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code (sign bit 3, two exponent bits, one mantissa bit)."""

FP8_SCALE_SUFFIX = "_scale_inv"    # X.weight -> X.weight_scale_inv
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Read:
    """The stored slices one dense read needs: `values` and `scales` are index tuples into the stored
    values and scales; `cut` is (dim, start, length) to narrow the dequantized part by (None: all)."""

    values: tuple[slice, ...]
    scales: tuple[slice, ...]
    offset: int = 0            # fp8: where the read part starts within its first block (on `dim`)
    dim: int | None = None
    cut: tuple[int, int, int] | None = None


# ---------------------------------------------------------------- fp8, 128 x 128 block scales
def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, ...]:
    """The `weight_scale_inv` shape of an fp8 weight of `shape` [..., R, C]."""
    return (*shape[:-2], _ceil(shape[-2], block[0]), _ceil(shape[-1], block[1]))


def check_fp8(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...],
              block: tuple[int, int] = FP8_BLOCK) -> None:
    """Raises a one-line OpWeaveError unless `scale_shape` is the block scales of a weight of `shape`."""
    if len(shape) < 2:
        raise OpWeaveError(f"tensor '{name}' is stored float8_e4m3fn with shape {tuple(shape)}; "
                           "block-scaled fp8 needs a matrix")
    want = fp8_scale_shape(shape, block)
    if tuple(scale_shape) != want:
        raise OpWeaveError(f"tensor '{name}{FP8_SCALE_SUFFIX}' has shape {tuple(scale_shape)}; the "
                           f"{block[0]}x{block[1]} block scales of '{name}' {tuple(shape)} have shape {want}")


def fp8_read(shape: tuple[int, ...], dim: int, start: int, stop: int,
             block: tuple[int, int] = FP8_BLOCK) -> Read:
    """Rows [start, stop) of dimension `dim` of an fp8 weight of `shape`: exactly those rows of the
    weight and the scale rows (or columns) that cover them."""
    n = len(shape)
    dim = dim % n
    values = tuple([slice(None)] * dim + [slice(start, stop)])
    if dim < n - 2:  # a leading (expert) dimension: the same rows of the scales
        return Read(values=values, scales=values)
    b = block[dim - (n - 2)]
    scales = tuple([slice(None)] * dim + [slice(start // b, _ceil(stop, b))])
    return Read(values=values, scales=scales, offset=start % b, dim=dim)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                   *, row0: int = 0, col0: int = 0, dtype: torch.dtype = torch.float32,
                   name: str = "weight") -> torch.Tensor:
    """DeepSeek-V3's fp8 weights with 128 x 128 block scales, dequantized.

    Layout: `weight` float8_e4m3fn [..., R, C]; `scale_inv` float32 [..., ceil((row0 + R) / 128),
    ceil((col0 + C) / 128)]; value (r, c) = float(weight[r, c]) * scale_inv[(row0 + r) // 128,
    (col0 + c) // 128]. `row0` / `col0` (< the block) place a slice inside its first block: a read
    of rows 200..300 passes weight rows 200..300, scale rows 1..2 and row0 = 200 % 128.
    Computed in float32 (as transformers' `Fp8Dequantize`), then cast to `dtype`.
    """
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], _ceil(row0 + rows, block[0]), _ceil(col0 + cols, block[1]))
    if tuple(scale_inv.shape) != want:
        raise OpWeaveError(f"tensor '{name}{FP8_SCALE_SUFFIX}' read as {tuple(scale_inv.shape)} for "
                           f"{tuple(weight.shape)} values of '{name}'; expected {want}")
    out = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    row_block = (torch.arange(rows) + row0) // block[0]
    scale = scale.index_select(-2, row_block)                      # [..., R, column blocks]
    for j in range(scale.shape[-1]):                               # one column block at a time: no
        lo, hi = max(j * block[1] - col0, 0), min((j + 1) * block[1] - col0, cols)  # weight-sized scale
        out[..., lo:hi].mul_(scale[..., j:j + 1])
    return out.to(dtype)


# ---------------------------------------------------------------- mxfp4, one e8m0 scale per 32 values
def mxfp4_dense_shape(blocks_shape: tuple[int, ...], name: str = "weight") -> tuple[int, ...]:
    """GPT-OSS's dense shape [..., 32 G, N] of `P_blocks` [..., N, G, 16]."""
    if len(blocks_shape) < 3 or blocks_shape[-1] != MXFP4_GROUP // 2:
        raise OpWeaveError(f"tensor '{name}{MXFP4_BLOCKS}' has shape {tuple(blocks_shape)}; MXFP4 blocks are "
                           f"[..., rows, groups, {MXFP4_GROUP // 2}] bytes")
    *lead, n, g, b = blocks_shape
    return (*lead, g * 2 * b, n)


def check_mxfp4(name: str, blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> None:
    """Raises a one-line OpWeaveError unless `P_blocks` / `P_scales` have the MXFP4 layout."""
    mxfp4_dense_shape(blocks_shape, name)
    if tuple(scales_shape) != tuple(blocks_shape[:-1]):
        raise OpWeaveError(f"tensor '{name}{MXFP4_SCALES}' has shape {tuple(scales_shape)}; the scales of "
                           f"'{name}{MXFP4_BLOCKS}' {tuple(blocks_shape)} have shape {tuple(blocks_shape[:-1])}")


def mxfp4_read(blocks_shape: tuple[int, ...], dim: int, start: int, stop: int) -> Read:
    """Rows [start, stop) of dimension `dim` of the dense tensor [..., 32 G, N] of `P_blocks`
    [..., N, G, 16]: those rows of N, or the groups covering the rows of 32 G (then cut)."""
    n = len(blocks_shape) - 1  # the dense tensor's dimensions
    dim = dim % n
    lead = [slice(None)] * (n - 2)
    if dim < n - 2:
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        return Read(values=index, scales=index)
    if dim == n - 1:  # the stored rows (N)
        index = tuple(lead + [slice(start, stop)])
        return Read(values=index, scales=index)
    g0, g1 = start // MXFP4_GROUP, _ceil(stop, MXFP4_GROUP)  # the input channels: whole groups
    index = tuple(lead + [slice(None), slice(g0, g1)])
    return Read(values=index, scales=index, cut=(n - 2, start - g0 * MXFP4_GROUP, stop - start))


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                     name: str = "weight") -> torch.Tensor:
    """GPT-OSS's MXFP4 expert weights, dequantized to its dense layout.

    Layout: `blocks` uint8 [..., N, G, 16], two FP4 e2m1 codes per byte, low nibble first (value
    32 g + 2 j from byte j's low nibble, 32 g + 2 j + 1 from its high one); `scales` uint8
    [..., N, G], e8m0: scale 2 ** (s - 127). Returns [..., 32 G, N] (the stored [N, 32 G] matrix
    with its last two dimensions swapped, as transformers' `convert_moe_packed_tensors`).
    Computed in float32 (exact: every value is a power of two times a 2-bit mantissa), then cast.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise OpWeaveError(f"tensor '{name}': MXFP4 blocks and scales are uint8, read "
                           f"{str(blocks.dtype).removeprefix('torch.')} and {str(scales.dtype).removeprefix('torch.')}")
    check_mxfp4(name, tuple(blocks.shape), tuple(scales.shape))
    *lead, n, g, b = blocks.shape
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, n, g, b), scales.reshape(-1, n, g)
    out = torch.empty(flat_blocks.shape[0], g * 2 * b, n, dtype=dtype)
    for i in range(out.shape[0]):  # one expert at a time: float32 temporaries of one matrix only
        codes = torch.stack((flat_blocks[i] & 0x0F, flat_blocks[i] >> 4), dim=-1).long()  # [N, G, 16, 2]
        values = lut[codes].flatten(-2)                                                    # [N, G, 32]
        values = torch.ldexp(values, flat_scales[i].to(torch.int32).sub_(127).unsqueeze(-1))
        out[i] = values.flatten(-2).transpose(0, 1)
    return out.reshape(*lead, g * 2 * b, n)
