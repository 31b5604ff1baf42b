"""Matrices held as a published checkpoint stores them (fp8 with 128 x 128 block scales, MXFP4),
for the kernels that dequantize them in registers.

A rank on the Triton backend (a GPU, or `OPWEAVE_KERNELS=triton` under the interpreter) holds the
weights of a quantized checkpoint in their stored format, so its memory is what the planner
counted (`ir.graph.DTYPE_SIZE`: 1 byte and a float32 per 128 x 128 block for fp8, half a byte and
a byte per 32 for MXFP4). An operator module that can compute from stored weights replaces each
such dense parameter P by two buffers, `P_values` and `P_scales` (`hold`), before it is
materialised on the device; its loader reads them with `CheckpointReader.get_stored` (sliced for a
TP or expert-parallel shard, in whole blocks). Layouts, from the dense tensor of shape
[..., R, C] (`models.quantized`):

- fp8: values uint8 [..., R, C] (the e4m3 bytes), scales float32 [..., ceil(R/128), ceil(C/128)];
- MXFP4 (GPT-OSS's dense [..., 32 G, N] is the stored matrix transposed): values uint8
  [..., N, G, 16], scales uint8 [..., N, G].
"""

from __future__ import annotations

import torch
from torch import nn

from opweave.kernels.stored import StoredMatrix
from opweave.models import quantized as Q

VALUES, SCALES = "_values", "_scales"  # P -> P_values, P_scales


def stored_dim(method: str, ndim: int, dim: int) -> int:
    """The stored tensors' dimension that dense dimension `dim` (of `ndim`) is cut along: the same
    for fp8; for MXFP4 the dense [..., 32 G, N] swaps its last two (N is the stored rows, 32 G the
    groups)."""
    dim %= ndim
    if method == "mxfp4" and dim >= ndim - 2:
        return (ndim - 2) if dim == ndim - 1 else (ndim - 1)
    return dim


def stored_shapes(method: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
    """(values shape, scales shape, scales dtype) of a dense tensor of `shape` stored as `method`."""
    if method == "fp8":
        return tuple(shape), Q.fp8_scale_shape(tuple(shape)), torch.float32
    *lead, k, n = shape
    if k % Q.MXFP4_GROUP:
        raise ValueError(f"an MXFP4 tensor's input dimension {k} is not a whole number of {Q.MXFP4_GROUP}-groups")
    groups = k // Q.MXFP4_GROUP
    return (*lead, n, groups, Q.MXFP4_GROUP // 2), (*lead, n, groups), torch.uint8


def hold(module: nn.Module, attr: str, method: str, linear: bool = False) -> None:
    """Replaces dense parameter `attr` of `module` (on the meta device) by its stored form's two
    empty buffers (`attr`_values, `attr`_scales); a `linear` weight (read only through `K.linear`)
    is then a `kernels.stored.StoredMatrix` over them."""
    param = getattr(module, attr)
    values, scales, scale_dtype = stored_shapes(method, tuple(param.shape))
    del module._parameters[attr]
    module.register_buffer(attr + VALUES, torch.empty(values, dtype=torch.uint8, device=param.device))
    module.register_buffer(attr + SCALES, torch.empty(scales, dtype=scale_dtype, device=param.device))
    if linear:
        object.__setattr__(module, attr, StoredMatrix(module, attr, method))


def cat_stored(parts: list[tuple[torch.Tensor, torch.Tensor]], ndim: int, dim: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored parts (values, scales) read along dense dimension `dim` (of `ndim`), joined (MXFP4's
    values have one dimension more than its scales, fp8's as many)."""
    if len(parts) == 1:
        return parts[0]
    method = "mxfp4" if parts[0][0].dim() == parts[0][1].dim() + 1 else "fp8"
    at = stored_dim(method, ndim, dim)
    return torch.cat([v for v, _ in parts], dim=at), torch.cat([s for _, s in parts], dim=at)
