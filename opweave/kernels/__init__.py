"""The decode kernel library: one interface, two backends.

`get_backend("torch")` returns the torch reference kernels (`reference`, the CPU path, numerically
identical to the operator modules in `opweave.models`); `get_backend("triton")` returns the Triton
kernels (`triton_kernels`, the CUDA path; on CPU they run only under `TRITON_INTERPRET=1`). Both
modules define the functions in `KERNEL_NAMES` with the same signatures (`docs/kernels.md`).
Triton is imported only when its backend is asked for. Also here: the sampler (`sampling`), the
torch kernels' block sizes (`blocks`), per-GPU launch limits (`targets`), the AOT checks (`aot`).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from opweave.errors import OpWeaveError

BACKENDS = ("torch", "triton")

# the functions every backend defines, with identical signatures
KERNEL_NAMES = ("rms_norm", "add_rms_norm", "rope", "decode_attention", "gdn_step", "gated_act",
                "moe_route", "moe_experts", "argmax", "moe_experts_swiglu", "mla_decode_attention")

_MODULES = {"torch": "opweave.kernels.reference", "triton": "opweave.kernels.triton_kernels"}


def backend_name(device) -> str:
    """The kernel backend a rank on `device` runs: `OPWEAVE_KERNELS` where set, else "triton" on
    CUDA and "torch" elsewhere."""
    from opweave import config

    return config.kernels_forced() or ("triton" if getattr(device, "type", str(device)) == "cuda" else "torch")


def get_backend(name: str) -> ModuleType:
    """The kernel module of backend `name` ("torch" or "triton").

    Raises:
        OpWeaveError: unknown backend, or "triton" when the triton package is not installed.
    """
    if name not in _MODULES:
        raise OpWeaveError(f"unknown kernel backend '{name}' (supported: {', '.join(BACKENDS)})")
    if name == "triton" and importlib.util.find_spec("triton") is None:
        raise OpWeaveError("kernel backend 'triton' needs the triton package (pip install triton==3.9.0); "
                           "use backend 'torch' on machines without it")
    return importlib.import_module(_MODULES[name])
