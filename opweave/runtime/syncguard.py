"""A check that a decode round never synchronises with the host, on any device.

A CUDA graph replays a round without Python: anything in the round that reads a tensor's value on
the host (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.numpy()`), makes a tensor of data-dependent
size (`nonzero`, boolean masks), creates a tensor from host data (`torch.tensor(...)`, a Python
scalar assigned through a mask) or copies between the host and the device (other than a
non-blocking copy into pinned memory, as `TokenCopies` does) cannot be captured, and on a GPU
each one stalls the host until the device catches up. `NoHostSync` is a `TorchDispatchMode` that
sees every aten op a round runs, on CPU too, and raises `HostSyncError` naming the first such op
(the Python methods that bypass the dispatcher, `tolist` and `numpy`, are patched while it is
active). The runtime runs its decode rounds under it when `OPWEAVE_CHECK_SYNC=1`
(`opweave.config.check_sync`); CI runs every family's plans that way.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose result the host must read, or whose output size depends on tensor values
SYNC_OPS = {
    aten._local_scalar_dense.default: "reads a tensor's value on the host (.item(), int(), bool(), float())",
    aten.is_nonzero.default: "reads a tensor's truth value on the host",
    aten.equal.default: "torch.equal reads the result on the host",
    aten.nonzero.default: "nonzero has a data-dependent size",
    aten.masked_select.default: "masked_select has a data-dependent size",
    aten._unique2.default: "unique has a data-dependent size",
    aten.unique_consecutive.default: "unique_consecutive has a data-dependent size",
    aten.lift_fresh.default: "creates a tensor from host data (torch.tensor(...) or a Python scalar through a mask)",
}


class HostSyncError(RuntimeError):
    """A decode round synchronised with the host (the message names the op)."""


def _device(x) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


class NoHostSync(TorchDispatchMode):
    """Raises `HostSyncError` on the first op of the round that synchronises with the host.
    `ops` counts the aten ops seen (a round that ran nothing proves nothing)."""

    def __init__(self, where: str = "a decode round"):
        super().__init__()
        self.where, self.ops = where, 0
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        reason = SYNC_OPS.get(func)
        if reason is None and func in (aten._to_copy.default, aten.copy_.default):
            reason = self._cross_device(func, args, kwargs)
        if reason is None and func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                reason = "indexes with a boolean mask (a data-dependent size)"

        if reason is not None:
            raise HostSyncError(f"{self.where} synchronises with the host: {func} {reason}")
        return func(*args, **kwargs)

    @staticmethod
    def _cross_device(func, args, kwargs) -> str | None:
        if func is aten._to_copy.default:
            src, dst = _device(args[0]), kwargs.get("device")
            if dst is not None and src is not None and torch.device(dst) != src:
                return f"copies from {src} to {dst}"
            return None
        dst, src = args[0], args[1]
        if _device(src) is None or src.device == dst.device:
            return None
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if dst.device.type == "cpu" and non_blocking and dst.is_pinned():
            return None  # an asynchronous copy to pinned memory: read later, after an event
        return f"copies from {src.device} to {dst.device}"

    def __enter__(self):
        def refuse(name):
            def method(tensor, *args, **kwargs):
                raise HostSyncError(f"{self.where} synchronises with the host: Tensor.{name}() reads values on the host")
            return method

        for name in ("tolist", "numpy"):
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        self._saved.clear()
        return super().__exit__(*exc)
