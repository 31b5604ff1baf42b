"""Timing a decode step's operators in place: the op sequence in graph order, rotating copies.

`measure_sequence` is what `opweave.profile.measure.profile` runs per TP degree (see its
docstring and docs/profile.md); `start_busy_cores` keeps other cores running the same sequence
while it does (`opweave profile --busy-cores`).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Callable

import torch

from opweave.ir.graph import Op
from opweave.ir.kinds import OpClass, OpKind
from opweave.models.ops import OpModule
from opweave.profile.signature import is_replicated

MIN_REPS = 5
MAX_REPS = 20
TARGET_POINT_S = 0.02
"""Timed decode steps per (batch, context) point: enough to give each op group TARGET_POINT_S,
within [MIN_REPS, MAX_REPS]: a tiny model's whole grid takes seconds, a large one MIN_REPS steps."""

SEQUENCE_WARMUP = 2
"""Untimed decode steps before each point (first-call allocations, caches, lazy kernel builds)."""

MEASURE_THREADS = 1
"""Torch threads while measuring: `opweave run` runs one thread per rank."""

ROTATE_FACTOR = 2
MAX_COPIES = 16
"""Cold weights, warm interpreter: each point is timed over copies of the operator (own weights,
own state) called in turn, as many as make ROTATE_FACTOR times the device's last-level cache (at
most MAX_COPIES). In a decode step an op's weights and state were last touched a whole step ago
(the other layers' evicted them), so timing one copy again and again would be optimistic for
every op that fits in the cache (a 4096x1024 fp32 matrix fits this kind of CPU's 32 MB L3), while
flushing the whole cache before each call would also evict the interpreter's own data and make
small ops several times slower than they run in a step (measured: an RMSNorm 100 us in a step,
350 us after a flush)."""

DEFAULT_CPU_LLC_BYTES = 32 << 20



def make_inputs(specs, module: OpModule, batch: int, context: int, device: torch.device) -> list:
    """Random inputs of the recorded shapes at `batch`; token ids in the vocabulary, expert ids a
    top-k of random scores, positions = context - 1."""
    out = []
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        shape, dtype = (batch,) + spec[0][1:], spec[1]
        if dtype.is_floating_point:
            out.append(0.1 * torch.randn(shape, device=device).to(dtype))
        elif module.kind == OpKind.EMBED:
            out.append(torch.randint(0, module.weight.shape[0], shape, device=device))
        elif module.kind in (OpKind.MOE_EXPERTS, OpKind.MOE_EXPERTS_SWIGLU):
            scores = torch.rand(shape[:-1] + (module.gate_up.shape[0],), device=device)
            out.append(scores.topk(shape[-1], dim=-1).indices)
        else:
            out.append(torch.full(shape, context - 1, dtype=dtype, device=device))
    return out


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (sysfs), or DEFAULT_CPU_LLC_BYTES where sysfs does not say."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    try:
        for index in os.listdir(root):
            with open(os.path.join(root, index, "size"), encoding="utf-8") as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return max(sizes, default=DEFAULT_CPU_LLC_BYTES)


def cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return last_level_cache_bytes()


def rotation_copies(bytes_per_copy: float, device: torch.device) -> int:
    """How many copies of an op to rotate through so that each call finds its data cold."""
    need = ROTATE_FACTOR * cache_bytes(device)
    return max(1, min(MAX_COPIES, -(-int(need) // max(1, int(bytes_per_copy)))))


def measure_sequence(graph, groups: dict[str, list[Op]], full_modules: dict, specs: dict, tp: int,
                      device: torch.device, batches, contexts, say) -> dict[str, dict[tuple[int, int], list[float]]]:
    """Runs the decode step's operators in graph order as TP rank 0 of `tp` and times every call.

    Each op of the graph is played by a copy of its group's representative (random weights, own
    state), rotating over as many copies as make ROTATE_FACTOR times the device's last-level
    cache (never more than the group has ops): every call finds its weights and state as cold,
    and the interpreter's data as warm or as thrashed by the op before it, as in a rank's decode
    step. Inputs are random tensors of the recorded shapes (outputs are not chained).

    Returns:
        samples[signature][(batch, context)]: seconds per call, every occurrence of every timed step.
    """
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    copies, sequence = _sequence(graph, groups, full_modules, tp, device, max(batches), max(contexts))
    _huge_pages(device)
    samples: dict[str, dict[tuple[int, int], list[float]]] = {sig: {} for sig in groups}
    has_attn = any(ops[0].cls == OpClass.ATTN for ops in groups.values())
    for context in (contexts if has_attn else (contexts[0],)):
        for batch in batches:
            calls = _calls_at(copies, sequence, groups, specs, batch, context, device)
            for _ in range(SEQUENCE_WARMUP):
                _run_sequence(calls, sync)
            budget, steps, start = TARGET_POINT_S * len(groups), 0, time.perf_counter()
            while steps < MIN_REPS or (steps < MAX_REPS and time.perf_counter() - start < budget):
                for (sig, _, _), dt in zip(calls, _run_sequence(calls, sync)):
                    samples[sig].setdefault((batch, context), []).append(dt)
                steps += 1
            say(f"tp {tp}, batch {batch}, context {context}: {steps} timed steps of {len(calls)} ops")
    return samples


def _sequence(graph, groups: dict[str, list[Op]], full_modules: dict, tp: int, device: torch.device,
              top_batch: int, top_context: int) -> tuple[dict[str, list[tuple[OpModule, Callable]]], list]:
    """The rotating copies of every group, and (signature, copy index) for each op of the graph."""
    copies: dict[str, list[tuple[OpModule, Callable]]] = {}
    for sig, ops in groups.items():
        op = ops[0]
        shard = 1 if is_replicated(op) else tp
        per_copy = op.weight_bytes / shard + top_batch * op.state_bytes(top_context) / shard
        n = min(len(ops), rotation_copies(per_copy, device))
        copies[sig] = _materialize_copies(full_modules[op.name], op.index, tp, device, n)
    signature_of = {op.index: sig for sig, ops in groups.items() for op in ops}
    used: dict[str, int] = {}
    sequence = []
    for op in graph.ops:
        sig = signature_of.get(op.index)
        if sig is not None:
            sequence.append((sig, used.get(sig, 0) % len(copies[sig])))
            used[sig] = used.get(sig, 0) + 1
    return copies, sequence


def _calls_at(copies, sequence, groups, specs, batch: int, context: int, device: torch.device) -> list:
    """The sequence's calls at one (batch, context) point: every copy's state allocated for it,
    random inputs of the recorded shapes per group; (signature, callable, args) per op."""
    for group in copies.values():
        for module, _ in group:
            module.allocate_state(batch, context, device)
    inputs = {sig: make_inputs(specs[ops[0].name], copies[sig][0][0], batch, context, device)
              for sig, ops in groups.items()}
    return [(sig, copies[sig][k][1], inputs[sig]) for sig, k in sequence]


def _busy_loop(graph, groups, full_modules, specs, batch: int, context: int, stop) -> None:
    """A background core's load while ops are timed: the same decode-step sequence, its own
    copies of the weights and state, again and again until `stop` is set (a forked process)."""
    torch.set_num_threads(MEASURE_THREADS)
    cpu = torch.device("cpu")
    with torch.no_grad():
        copies, sequence = _sequence(graph, groups, full_modules, 1, cpu, batch, context)
        _huge_pages(cpu)
        calls = _calls_at(copies, sequence, groups, specs, batch, context, cpu)
        while not stop.is_set():
            _run_sequence(calls, lambda: None)


def start_busy_cores(n: int, graph, groups, full_modules, specs, batch: int, context: int) -> tuple[list, object]:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_busy_loop, args=(graph, groups, full_modules, specs, batch, context, stop),
                         daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return procs, stop


def _run_sequence(calls, sync) -> list[float]:
    """One pass over the calls; seconds of each."""
    out = []
    for _, run, args in calls:
        sync()
        t0 = time.perf_counter()
        run(*args)
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _huge_pages(device: torch.device) -> None:
    """The copies' weights in huge pages, as a CPU rank keeps its own (`runtime.hugepages`)."""
    if device.type == "cpu":
        from opweave.runtime.hugepages import back_with_huge_pages

        back_with_huge_pages()


def _materialize_copies(meta_module: OpModule, index: int, tp: int, device: torch.device,
                        n: int) -> list[tuple[OpModule, Callable]]:
    """`n` copies of one op as TP rank 0 of `tp` loads it (random weights), its GEMM weights packed
    as a rank packs them on the CPU (`kernel_ops.pack_cpu_gemms`), so the op is timed as it runs."""
    from opweave.runtime.kernel_ops import pack_cpu_gemms, with_kernels
    from opweave.runtime.shard import materialize

    out = []
    for _ in range(n):
        # materialize shards the full (unsharded) module itself; a copy keeps the meta model intact
        module = materialize({index: copy.deepcopy(meta_module)}, "random", tp, 0, device)[index]
        pack_cpu_gemms({index: module}, device)
        out.append((module, with_kernels({index: module}, device)[index]))
    return out
