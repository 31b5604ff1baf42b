"""Host-side helpers the Triton kernel wrappers share (block sizes, layout checks, tl.dot precision)."""

from __future__ import annotations

import torch
import triton

from opweave import config

_MAX_BLOCK = 1024  # elements per program along a streamed dimension (vocab, intermediate, hidden)


def _interpreting() -> bool:
    return config.triton_interpret()


def _pow2(n: int, minimum: int = 1) -> int:
    return max(triton.next_power_of_2(n), minimum)


def _check_last_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous (stride {t.stride()})"


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreting())
