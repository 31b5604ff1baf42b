"""Weights kept in a published checkpoint's stored format, read by the kernels that dequantize them.

The formats (`opweave.models.quantized` has their full description, the checkpoint reader and the
CPU dequantizers): fp8 e4m3 values with a float32 scale per `FP8_BLOCK` block (DeepSeek-V3,
Kimi-K2), and MXFP4, 4-bit e2m1 values with a one-byte e8m0 scale per `MXFP4_GROUP` (GPT-OSS's
experts). `StoredMatrix` stands where an operator module's dense linear weight was
(`models.stored.hold`): `reference.linear` computes with it by its `linear`, the Triton GEMM over
the stored bytes on the Triton backend (`triton_kernels.quant.fp8_block_linear`), else the matrix
dequantized on the fly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_BLOCK = (128, 128)
"""Rows x columns of one fp8 scale block (`weight_block_size`)."""

MXFP4_GROUP = 32
"""Values per MXFP4 scale (16 bytes of two 4-bit values)."""


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 matrices [..., R, C] from their bytes (uint8) and block scales (float32 [..., ceil(R/128),
    ceil(C/128)]), on their device: each e4m3 value times its block's scale in float32, then rounded
    to `dtype` (as the checkpoint reader's `models.quantized.dequantize_fp8`)."""
    rows, cols = values.shape[-2:]
    full = scales.repeat_interleave(FP8_BLOCK[0], -2)[..., :rows, :].repeat_interleave(FP8_BLOCK[1], -1)[..., :cols]
    return (values.view(torch.float8_e4m3fn).to(torch.float32) * full).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 matrices from `P_blocks` (uint8 [..., N, G, 16]) and `P_scales` (uint8 [..., N, G]), on
    their device, as the dense [..., 32 G, N] (transposed, as `models.quantized.dequantize_mxfp4`):
    exact values (an e2m1 code times 2 ** (s - 127)) in `dtype`."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()                 # [..., N, G, 16, 2]
    values = lut[codes].flatten(-2) * torch.exp2(scales.to(torch.float32) - 127.0)[..., None]
    return values.flatten(-2).transpose(-1, -2).to(dtype)                            # [..., 32 G, N]


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code (sign bit 3, two exponent bits, one mantissa bit)."""


class StoredMatrix:
    """A linear weight [N, K] held as stored fp8 by `module` (its buffers `attr`_values and
    `attr`_scales, looked up at each use: materialising a module replaces its buffers)."""

    def __init__(self, module: torch.nn.Module, attr: str, method: str):
        if method != "fp8":
            raise ValueError(f"a stored linear weight is fp8, not {method}")
        self._module, self.attr, self.method = module, attr, method

    @property
    def values(self) -> torch.Tensor:
        return getattr(self._module, self.attr + "_values")

    @property
    def scales(self) -> torch.Tensor:
        return getattr(self._module, self.attr + "_scales")

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias): on the Triton backend the block-scaled GEMM over the stored bytes, else
        the dequantized matrix's `F.linear`."""
        from opweave.kernels import backend_name, get_backend

        name = backend_name(x.device)
        if name == "triton":
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            y = get_backend(name).fp8_block_linear(flat, self.values, self.scales).view(*x.shape[:-1], self.shape[0])
            return y if bias is None else y + bias
        return F.linear(x, dequantize_fp8(self.values, self.scales, x.dtype), bias)

    def __deepcopy__(self, memo):
        return StoredMatrix(memo.get(id(self._module), self._module), self.attr, self.method)
