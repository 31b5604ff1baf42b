"""Process-wide flags, read from environment variables (documented in docs/flags.md).

Every OpWeave environment variable is read here and nowhere else. Each flag is read when asked
for, so tests can set the environment without reloading modules. A boolean flag is on for "1",
"true", "yes" and "on", off for "", "0", "false", "no" and "off" (any case); any other value is
an error naming the variable, like every value a variable cannot mean. The CLI checks them all
before any work (`check_environment`), and the launcher checks the fault ranks against the plan
(`check_run`).
"""

from __future__ import annotations

import os
import tempfile

from opweave.errors import OpWeaveError

_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")
BOOLEAN_FLAGS = ("OPWEAVE_VERIFY", "OPWEAVE_DEBUG", "OPWEAVE_CHECK_SYNC", "OPWEAVE_CUDA_GRAPHS",
                 "OPWEAVE_REGEN_GOLDEN", "OPWEAVE_CPU_KERNELS", "OPWEAVE_HUGE_PAGES")
FAULT_VARIABLES = ("OPWEAVE_FAULT_KILL", "OPWEAVE_FAULT_STALL", "OPWEAVE_FAULT_RAISE", "OPWEAVE_FAULT_SLOW_OP")


def _flag(name: str, default: str = "0") -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value not in _ON + _OFF:
        raise OpWeaveError(f"{name}={_shown(os.environ[name])}: expected {', '.join(_ON)} (on) or "
                           f"{', '.join(_OFF[1:])} or empty (off)")
    return value in _ON


def _shown(value: str) -> str:
    """`value` quoted for an error message, shortened."""
    return repr(value if len(value) <= 40 else value[:40] + "...")


def verify_enabled() -> bool:
    """OPWEAVE_VERIFY=1: run each IR's verifier after its compile pipeline step (compiler/pipeline.py)."""
    return _flag("OPWEAVE_VERIFY")


def debug_dir() -> str | None:
    """OPWEAVE_DEBUG_DIR=path: each compile pipeline step writes its IR there as `NN_<step>.txt`.
    The path must be a folder files can be written in, or one that can be made (OpWeaveError)."""
    folder = os.environ.get("OPWEAVE_DEBUG_DIR") or None
    if folder is not None:
        _check_writable_folder(folder, "OPWEAVE_DEBUG_DIR")
    return folder


def _check_writable_folder(folder: str, name: str) -> None:
    """Refuses `folder` unless it is a folder (or the nearest existing one above it, where it
    would be made) in which a file can be made: tried, not judged from the mode bits, which
    root ignores and /proc ignores for root."""
    existing = folder
    while not os.path.lexists(existing) and os.path.dirname(os.path.abspath(existing)) != os.path.abspath(existing):
        existing = os.path.dirname(os.path.abspath(existing))
    what = f"{name}={_shown(folder)}"
    if not os.path.isdir(existing):
        where = "is" if existing == folder else f"would be made in {existing}, which is"
        raise OpWeaveError(f"{what}: {where} not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".opweave-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OpWeaveError(f"{what}: cannot write files in {existing} ({e.strerror or e})") from None


def debug_enabled() -> bool:
    """OPWEAVE_DEBUG=1: show tracebacks for user errors too (for reporting bugs). Never raises
    (the CLI asks while reporting an error): a value it cannot mean is off here, and reported by
    `check_environment`."""
    try:
        return _flag("OPWEAVE_DEBUG")
    except OpWeaveError:
        return False


def check_sync() -> bool:
    """OPWEAVE_CHECK_SYNC=1: every rank runs its decode rounds under `runtime.syncguard.NoHostSync`
    and fails naming the first op that synchronises with the host (a test of the GPU path on CPU)."""
    return _flag("OPWEAVE_CHECK_SYNC")


def cuda_graphs_enabled() -> bool:
    """OPWEAVE_CUDA_GRAPHS=0: CUDA ranks run every round eagerly instead of replaying a captured
    decode round (`runtime.graphs`). On by default."""
    return _flag("OPWEAVE_CUDA_GRAPHS", default="1")


def cpu_kernels_enabled() -> bool:
    """OPWEAVE_CPU_KERNELS=0: CPU ranks attend their paged caches with the torch reference kernels
    instead of the C kernels (`opweave.kernels.cpu`). On by default."""
    return _flag("OPWEAVE_CPU_KERNELS", default="1")


def huge_pages_enabled() -> bool:
    """OPWEAVE_HUGE_PAGES=0: CPU ranks leave their weights and KV pool in the pages the allocator
    gave them instead of collapsing them into transparent huge pages (`opweave.runtime.hugepages`).
    On by default."""
    return _flag("OPWEAVE_HUGE_PAGES", default="1")


def c_compiler() -> str | None:
    """CC (the usual variable, read here like every other): the C compiler that builds the CPU
    kernels; None: look for `cc`, then `gcc`, on PATH."""
    return os.environ.get("CC") or None


def cache_root() -> str:
    """Where OpWeave keeps what it builds for this machine: $XDG_CACHE_HOME/opweave, else
    ~/.cache/opweave."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "opweave")


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
    """TRITON_INTERPRET=1 (Triton's own flag, read as Triton reads it): Triton kernels run on the
    CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in _OFF


def fault_injection(rank: int, prefill: bool = False) -> dict[str, int]:
    """The fault tests' injections for `rank`: OPWEAVE_FAULT_KILL=RANK:ROUND makes that rank kill
    itself after that round, OPWEAVE_FAULT_STALL=RANK:ROUND makes it sleep forever there,
    OPWEAVE_FAULT_RAISE=RANK:ROUND makes it raise an exception there. RANK `pN` names rank N of
    the prefill sets of a disaggregated run (`prefill`), a plain number the plan's ranks.
    Returns {"kill": round, "stall": round, "raise": round} for the faults aimed at this rank."""
    faults = {}
    for kind in ("kill", "stall", "raise"):
        name = f"OPWEAVE_FAULT_{kind.upper()}"
        text = os.environ.get(name, "").strip()
        if not text:
            continue
        target, _, at = text.partition(":")
        aimed_at_prefill = target.startswith("p")
        try:
            target_rank, at_round = int(target[aimed_at_prefill:]), int(at or 0)
        except ValueError:
            raise OpWeaveError(f"{name}={text!r}: expected RANK:ROUND") from None
        if target_rank < 0 or at_round < 0:
            raise OpWeaveError(f"{name}={text!r}: RANK and ROUND must be 0 or more")
        if target_rank == rank and aimed_at_prefill == prefill:
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


def check_environment() -> None:
    """Every OPWEAVE_* variable's value, checked before any work (docs/flags.md): one-line
    OpWeaveError naming the first one set to a value it cannot mean."""
    for name in BOOLEAN_FLAGS:
        _flag(name)
    kernels_forced()
    fault_injection(-1)
    fault_slow_op(-1)
    debug_dir()


def check_run(device: str, world: int, prefill_world: int = 0) -> None:
    """What the variables ask of a run on `device` with `world` ranks per replica set (and
    `prefill_world` per prefill set), checked before any rank starts: a fault aimed at a rank the
    plan does not have, Triton kernels on the CPU without Triton's interpreter."""
    check_environment()
    for name in FAULT_VARIABLES:
        text = os.environ.get(name, "").strip()
        target = text.partition(":")[0]
        ranks, kind = (prefill_world, "prefill sets have") if target.startswith("p") else (world, "plan has")
        if text and not 0 <= int(target.lstrip("p")) < ranks:
            raise OpWeaveError(f"{name}={text!r}: the {kind} no rank {target} "
                               f"({f'ranks 0..{ranks - 1}' if ranks else 'no ranks'})")
    if kernels_forced() == "triton" and device == "cpu" and not triton_interpret():
        raise OpWeaveError("OPWEAVE_KERNELS=triton on --device cpu needs TRITON_INTERPRET=1 (Triton's CPU "
                           "interpreter, slow) or a GPU; unset OPWEAVE_KERNELS to use the torch kernels on CPU")
