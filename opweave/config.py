"""Process-wide flags, read from environment variables (documented in docs/flags.md).

Every OpWeave environment variable is read here and nowhere else. Each flag is read when asked
for, so tests can set the environment without reloading modules. A boolean flag is on for any
value but "", "0", "false", "no" and "off" (any case): `OPWEAVE_DEBUG=0` is off.
"""

from __future__ import annotations

import os

from opweave.errors import OpWeaveError

_OFF = ("", "0", "false", "no", "off")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in _OFF


def verify_enabled() -> bool:
    """OPWEAVE_VERIFY=1: run each IR's verifier after its compile pipeline step (compiler/pipeline.py)."""
    return _flag("OPWEAVE_VERIFY")


def debug_dir() -> str | None:
    """OPWEAVE_DEBUG_DIR=path: each compile pipeline step writes its IR there as `NN_<step>.txt`."""
    return os.environ.get("OPWEAVE_DEBUG_DIR") or None


def debug_enabled() -> bool:
    """OPWEAVE_DEBUG=1: show tracebacks for user errors too (for reporting bugs)."""
    return _flag("OPWEAVE_DEBUG")


def check_sync() -> bool:
    """OPWEAVE_CHECK_SYNC=1: every rank runs its decode rounds under `runtime.syncguard.NoHostSync`
    and fails naming the first op that synchronises with the host (a test of the GPU path on CPU)."""
    return _flag("OPWEAVE_CHECK_SYNC")


def cuda_graphs_enabled() -> bool:
    """OPWEAVE_CUDA_GRAPHS=0: CUDA ranks run every round eagerly instead of replaying a captured
    decode round (`runtime.graphs`). On by default."""
    return os.environ.get("OPWEAVE_CUDA_GRAPHS", "1").strip().lower() not in _OFF


KERNEL_BACKENDS = ("triton", "torch")


def kernels_forced() -> str | None:
    """OPWEAVE_KERNELS=triton|torch: the runtime's kernel backend, whatever the device (None: the
    device decides). Any other value is an error, not a silent fallback."""
    value = os.environ.get("OPWEAVE_KERNELS", "").strip().lower()
    if not value:
        return None
    if value not in KERNEL_BACKENDS:
        raise OpWeaveError(f"OPWEAVE_KERNELS={value!r}: expected one of {', '.join(KERNEL_BACKENDS)}")
    return value


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 (Triton's own flag): Triton kernels run on the CPU interpreter."""
    return _flag("TRITON_INTERPRET")


def fault_injection(rank: int) -> dict[str, int]:
    """The fault tests' injections for `rank`: OPWEAVE_FAULT_KILL=RANK:ROUND makes that rank kill
    itself after that round, OPWEAVE_FAULT_STALL=RANK:ROUND makes it sleep forever there,
    OPWEAVE_FAULT_RAISE=RANK:ROUND makes it raise an exception there.
    Returns {"kill": round, "stall": round, "raise": round} for the faults aimed at this rank."""
    faults = {}
    for kind in ("kill", "stall", "raise"):
        name = f"OPWEAVE_FAULT_{kind.upper()}"
        text = os.environ.get(name, "").strip()
        if not text:
            continue
        target, _, at = text.partition(":")
        try:
            target_rank, at_round = int(target), int(at or 0)
        except ValueError:
            raise OpWeaveError(f"{name}={text!r}: expected RANK:ROUND") from None
        if target_rank == rank:
            faults[kind] = at_round
    return faults


def fault_slow_op(rank: int) -> float:
    """OPWEAVE_FAULT_SLOW_OP=RANK:SECONDS makes every operator call of that rank in a prefill step
    (a microbatch whose rows take more than one token) sleep SECONDS first: a long round made of
    short operators, for the stall tests. 0.0 for the other ranks, and when unset."""
    text = os.environ.get("OPWEAVE_FAULT_SLOW_OP", "").strip()
    if not text:
        return 0.0
    target, _, seconds = text.partition(":")
    try:
        target_rank, value = int(target), float(seconds)
    except ValueError:
        raise OpWeaveError(f"OPWEAVE_FAULT_SLOW_OP={text!r}: expected RANK:SECONDS") from None
    if not 0 <= value < 3600:
        raise OpWeaveError(f"OPWEAVE_FAULT_SLOW_OP={text!r}: SECONDS must be in [0, 3600)")
    return value if target_rank == rank else 0.0


def api_key() -> str | None:
    """OPWEAVE_API_KEY: the key `opweave serve` requires when `--api-key` is not given (None: none)."""
    return os.environ.get("OPWEAVE_API_KEY") or None
