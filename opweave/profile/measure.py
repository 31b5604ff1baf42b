"""`profile()`: measures one model's operators, the dispatch overhead and the links on this machine.

Steps:
1. trace the model's decode step into an OpGraph (at the measured dtype) and group its ops by
   cost signature: one representative op per group (every layer's `qkv_proj` is one group); a
   grid whose estimated memory (`memory_needed`) does not fit the machine is refused here, before
   any measurement (an allocation failure later is reported in one line as well);
2. record each operator's input shapes by running the decode step on meta tensors with a
   forward pre-hook per operator (for TP > 1, the decode step of the sharded configuration);
3. per TP degree, materialise copies of each representative with random weights exactly as a
   rank does (`opweave.runtime.shard.materialize`, then `with_kernels`) and, per (batch,
   context) point, allocate their state, build random inputs of the recorded shapes
   (positions = context - 1) and run the decode step's ops in graph order, each op played by a
   copy of its representative in turn (ROTATE_FACTOR), timing every call: warm-up steps, then
   adaptive repetitions; per group the median over its calls;
4. time a no-op module call (the Python dispatch every op pays);
5. time send/recv and all-reduce between two ranks (`opweave.profile.comm`).

Everything runs with `torch.set_num_threads(1)`, like each rank of `opweave run --threads 1`.
"""

from __future__ import annotations

import copy
import datetime
import os
import platform
import statistics
import time
from typing import Callable

import torch
from torch import nn

from opweave import __version__
from opweave.errors import OpWeaveError
from opweave.ir.graph import Op
from opweave.ir.kinds import OpClass
from opweave.ir.tp import legal_tp
from opweave.models.model import DecodeStep, build_model
from opweave.models.ops import OpModule
from opweave.profile.sequence import (MAX_REPS, MEASURE_THREADS, MIN_REPS, ROTATE_FACTOR, SEQUENCE_WARMUP,
                                      TARGET_POINT_S, measure_sequence, rotation_copies, start_busy_cores)
from opweave.profile.signature import graph_hash, is_replicated, op_signature
from opweave.profile.table import OpEntry, ProfileTable


PREFILL_ROWS = 256
"""Rows (prompt tokens) at which `profile` times the model's largest GEMM once more: the FLOP/s a
prefill chunk's GEMMs reach, which on a CPU can be several times a decode batch's."""
DISPATCH_CALLS = 1000
DISPATCH_ROUNDS = 7



def device_name(device: str = "cpu") -> str:
    """The machine's name for the device: the CPU model from /proc/cpuinfo, or the CUDA device name."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def catalog_key(device: str) -> str:
    """The catalog key the planner will pass for this device ("cpu", or the CUDA device's entry)."""
    if device == "cpu":
        return "cpu"
    from opweave.hardware.catalog import find_gpu_name, load_catalog, normalize_name

    name = device_name(device)
    return find_gpu_name(name, load_catalog()) or normalize_name(name)


def _check_grid(name: str, values) -> tuple[int, ...]:
    out = tuple(sorted(set(int(v) for v in values)))
    if not out or out[0] < 1:
        raise OpWeaveError(f"{name} must be positive whole numbers, got {list(values)}")
    return out


def profile(model: str, device: str = "cpu", batches=(1, 2, 4, 8), contexts=(64, 256, 1024), tp_degrees=(1,),
            progress: Callable[[str], None] | None = None, *, dtype: str | None = None,
            measure_links: bool = True, busy_cores: int = 0) -> ProfileTable:
    """Measures `model`'s operators on `device`.

    Args:
        model: a MODEL argument (built-in name, checkpoint folder, model.py).
        device: "cpu" or "cuda" (the first CUDA device; links need two).
        batches, contexts: the grid; contexts only apply to ATTN ops.
        tp_degrees: TP degrees to measure one shard at (replicated ops: TP 1 only).
        progress: called with one line per op group and per phase.
        dtype: the dtype ops run in; default float32 on CPU, the model's dtype on CUDA.
        measure_links: time send/recv and all-reduce between two ranks.
        busy_cores: CPU only: other cores that run the decode step while the ops are timed (links
            are timed before, between idle ranks), as the ranks of a plan that fills the machine do.
    Returns:
        the `ProfileTable` (save it with `.save(path)`).
    """
    from opweave.compiler.frontend import run_front_end

    say = progress or (lambda message: None)
    if device not in ("cpu", "cuda"):
        raise OpWeaveError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise OpWeaveError("--device cuda: no CUDA device on this machine")
    batches, contexts, tp_degrees = (_check_grid("batches", batches), _check_grid("contexts", contexts),
                                     _check_grid("TP degrees", tp_degrees))
    cores = os.cpu_count() or 1
    if busy_cores and (device != "cpu" or not 0 < busy_cores < cores):
        raise OpWeaveError(f"--busy-cores {busy_cores}: needs --device cpu and fewer than this machine's {cores} cores")
    warnings: list[str] = []
    # the front end only traces on the meta device (no parallel op runs before the links fork)
    fe = run_front_end(model, dtype or ("float32" if device == "cpu" else None))
    graph = fe.graph
    groups: dict[str, list[Op]] = {}
    for op in graph.ops:
        groups.setdefault(op_signature(op), []).append(op)
    check_memory(fe.source, graph, groups, torch.device(device), batches, contexts, tp_degrees, busy_cores)
    links = None
    if measure_links:  # first: the forked ranks start before this process runs any parallel op
        links = _measure_links(device, say, warnings)
    say(f"{graph.model}: {len(graph.ops)} ops, dtype {graph.dtype}, device {device_name(device)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(MEASURE_THREADS)
    try:
        with torch.no_grad():
            entries = _measure_ops(fe.source, graph.dtype, graph, groups, torch.device(device), batches, contexts,
                                   tp_degrees, say, busy_cores)
            dispatch_s = _measure_dispatch()
            prefill_flops = _measure_prefill_flops(fe.source, graph.dtype, graph, torch.device(device))
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not _out_of_memory(e):
            raise
        raise OpWeaveError(f"profiling {graph.model} ran out of memory at batch up to {max(batches)}, context up "
                           f"to {max(contexts)} ({_first_line(e)}); lower --batches or --contexts") from None
    finally:
        torch.set_num_threads(threads)
    say(f"dispatch overhead {dispatch_s * 1e6:.2f} us per module call")
    if prefill_flops:
        say(f"largest GEMM at {PREFILL_ROWS} rows: {prefill_flops / 1e9:.1f} GFLOP/s")
    return ProfileTable(
        model=graph.model, graph_hash=graph_hash(graph), gpu=catalog_key(device), device_name=device_name(device),
        dtype=graph.dtype, torch_version=torch.__version__, opweave_version=__version__,
        python_version=platform.python_version(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), num_threads=MEASURE_THREADS,
        settings={"batches": list(batches), "contexts": list(contexts), "tp_degrees": list(tp_degrees),
                  "warmup_steps": SEQUENCE_WARMUP, "rotate_factor": ROTATE_FACTOR,
                  "busy_cores": busy_cores, "min_reps": MIN_REPS, "max_reps": MAX_REPS,
                  "target_point_s": TARGET_POINT_S, "statistic": "median", "device": device},
        entries=tuple(entries), dispatch_s=dispatch_s, prefill_flops=prefill_flops,
        transfer_latency_s=links.p2p.latency_s if links else None,
        transfer_bandwidth=links.p2p.bandwidth if links else None,
        transfer_samples=links.p2p.samples if links else (),
        allreduce_latency_s=links.allreduce.latency_s if links else None,
        allreduce_bandwidth=links.allreduce.bandwidth if links else None,
        allreduce_samples=links.allreduce.samples if links else (),
        **_host_fields(links),
        warnings=tuple(warnings),
    )


# ---------------------------------------------------------------- memory, checked up front

MEMORY_HEADROOM = 0.9
"""Profiling is refused when its estimated peak exceeds this fraction of the memory available: the
estimate counts what grows with the grid (weights and state of the rotating copies, the inputs)
and leaves out the interpreter, torch and each op's transient output."""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _out_of_memory(e: BaseException) -> bool:
    """torch's CUDA and CPU allocation failures (`DefaultCPUAllocator: can't allocate memory`)."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or any(s in text for s in ("out of memory", "allocate memory",
                                                                   "not enough memory"))


def _input_bytes(specs, batch: int) -> int:
    total = 0
    for spec in specs:
        if spec is not None:
            numel = batch
            for d in spec[0][1:]:
                numel *= d
            total += numel * torch.empty(0, dtype=spec[1]).element_size()
    return total


def memory_needed(source, graph, groups: dict[str, list[Op]], device: torch.device, batches, contexts,
                  tp_degrees, busy_cores: int = 0) -> int:
    """Estimated peak bytes of a profile: at the largest batch and context, every group's rotating
    copies (weights and state, as `sequence._sequence` makes them) and random inputs, at the TP
    degree that needs most; each busy core holds its own TP-1 copies."""
    top_b, top_c = max(batches), max(contexts)
    specs = _input_specs(_meta_step(source, graph.dtype, 1))
    inputs = sum(_input_bytes(specs[ops[0].name], top_b) for ops in groups.values())

    def resident(tp: int) -> float:
        total = 0.0
        for ops in groups.values():
            op = ops[0]
            shard = 1 if is_replicated(op) else tp
            per_copy = op.weight_bytes / shard + top_b * op.state_bytes(top_c) / shard
            total += min(len(ops), rotation_copies(per_copy, device)) * per_copy
        return total

    busy = busy_cores * (resident(1) + inputs)
    return int(max(resident(tp) for tp in tp_degrees) + inputs + busy)


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still allocate: free device memory on CUDA; on CPU the kernel's
    MemAvailable, capped by the cgroup's limit (a container's) when there is one. None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    known = []
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit, encoding="utf-8") as f, open(usage, encoding="utf-8") as g:
                known.append(int(f.read().strip()) - int(g.read().strip()))  # "max": no limit (ValueError)
        except (OSError, ValueError):
            pass
    return min(known) if known else None


def check_memory(source, graph, groups, device: torch.device, batches, contexts, tp_degrees,
                 busy_cores: int = 0) -> None:
    """Refuses, before anything is measured, a grid whose estimated peak (`memory_needed`) does
    not fit the memory available: on CPU such a profile would otherwise be killed by the kernel,
    or swap for hours, after the links were measured."""
    available = available_memory(device)
    if available is None:
        return
    need = memory_needed(source, graph, groups, device, batches, contexts, tp_degrees, busy_cores)
    if need > MEMORY_HEADROOM * available:
        busy = f" with {busy_cores} busy core(s)" if busy_cores else ""
        flags = "--batches, --contexts or --busy-cores" if busy_cores else "--batches or --contexts"
        raise OpWeaveError(f"profiling {graph.model} at batch {max(batches)} and context {max(contexts)}{busy} needs "
                           f"about {need / 2**30:.3g} GiB, this machine's {device.type} has {available / 2**30:.3g} GiB "
                           f"available; lower {flags}")


def _host_fields(links) -> dict:
    out = {}
    for side in ("send_host", "recv_host"):
        fit = getattr(links, side, None) if links else None
        if fit is not None:
            out |= {f"{side}_latency_s": fit.latency_s, f"{side}_bandwidth": fit.bandwidth,
                    f"{side}_samples": fit.samples}
    return out


def _measure_links(device: str, say: Callable[[str], None], warnings: list[str]):
    from opweave.profile.comm import measure_comm

    if device == "cuda" and torch.cuda.device_count() < 2:
        warnings.append("links not measured: one CUDA device (send/recv needs two)")
        say(warnings[-1])
        return None
    try:
        links = measure_comm(device)
    except RuntimeError as err:
        warnings.append(f"links not measured: {err}")
        say(warnings[-1])
        return None
    say(f"send/recv: {links.p2p.latency_s * 1e6:.1f} us + bytes / {links.p2p.bandwidth / 1e9:.2f} GB/s; "
        f"all-reduce (2 ranks): {links.allreduce.latency_s * 1e6:.1f} us + bytes / "
        f"{links.allreduce.bandwidth / 1e9:.2f} GB/s")
    for side in ("send_host", "recv_host"):
        fit = getattr(links, side)
        if fit is not None:
            say(f"{side.replace('_', ' ')} per transfer: {fit.latency_s * 1e6:.1f} us + bytes / "
                f"{fit.bandwidth / 1e9:.2f} GB/s")
    return links


# ---------------------------------------------------------------- operators


def _meta_step(source, dtype: str, tp: int) -> DecodeStep:
    """The decode step on the meta device, for the TP-`tp` shard's configuration."""
    if source.module is not None:
        if tp > 1:
            raise OpWeaveError(f"{source.name}: TP > 1 profiles need a model built from a config, not a model.py")
        return DecodeStep(copy.deepcopy(source.module).to("meta"))
    cfg = source.cfg.with_dtype(dtype)
    if tp > 1:
        from opweave.runtime.shard import sharded_config

        cfg = sharded_config(cfg, tp)
    return DecodeStep(build_model(cfg, "meta"))


def _input_specs(step: DecodeStep) -> dict[str, list[tuple[tuple[int, ...], torch.dtype] | None]]:
    """Each operator's positional inputs at batch 1, one token: (shape, dtype), None for a None."""
    specs: dict[str, list] = {}
    handles = []
    for name, module in step.named_modules():
        if isinstance(module, OpModule):
            def hook(mod, args, name=name):
                specs[name] = [(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in args]
            handles.append(module.register_forward_pre_hook(hook))
    step.model.allocate_state(1, 2, "meta")
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    try:
        step(ids, torch.ones(1, 1, dtype=torch.long, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return specs


def _measure_ops(source, dtype: str, graph, groups: dict[str, list[Op]], device: torch.device, batches,
                 contexts, tp_degrees, say, busy_cores: int = 0) -> list[OpEntry]:
    """Every group at every TP degree, measured in place (see `_measure_sequence`), with
    `busy_cores` other cores running the decode step meanwhile."""
    entries: list[OpEntry] = []
    full_modules = dict(_meta_step(source, dtype, 1).named_modules())
    busy = ([], None)
    if busy_cores:
        busy = start_busy_cores(busy_cores, graph, groups, full_modules, _input_specs(_meta_step(source, dtype, 1)),
                                 max(batches), max(contexts))
        say(f"{busy_cores} other core(s) run the decode step while ops are timed")
    try:
        _measure_all(source, dtype, graph, groups, device, batches, contexts, tp_degrees, say, full_modules, entries)
    finally:
        procs, stop = busy
        if stop is not None:
            stop.set()
        for p in procs:
            p.join()
    return entries


def _measure_all(source, dtype: str, graph, groups, device, batches, contexts, tp_degrees, say, full_modules,
                 entries: list[OpEntry]) -> None:
    for tp in tp_degrees:
        specs = _input_specs(_meta_step(source, dtype, tp))
        runnable = {}
        for sig, ops in groups.items():
            op = ops[0]
            if is_replicated(op) or legal_tp([op], tp):
                runnable[sig] = ops
            else:
                say(f"{op.kind.value}: {op.tp_units} units (KV heads {op.kv_heads}) do not split over TP {tp}: "
                    "not measured")
        samples = measure_sequence(graph, runnable, full_modules, specs, tp, device, batches, contexts, say)
        for sig, ops in runnable.items():
            op = ops[0]
            if tp > 1 and is_replicated(op):
                continue  # one figure for any TP: the TP 1 one
            attn = op.cls == OpClass.ATTN
            grid = contexts if attn else (None,)
            rows = tuple(tuple(_pooled(samples[sig], batch, context) for batch in batches) for context in grid)
            entries.append(OpEntry(
                signature=sig, kind=op.kind.value, example=op.name, num_ops=len(ops), tp=tp,
                flops_per_token=op.flops_per_token, weight_bytes=op.weight_bytes, batches=tuple(batches),
                contexts=tuple(contexts) if attn else (), latency_s=rows))
            say(_entry_line(entries[-1]))


def _pooled(samples: dict[tuple[int, int], list[float]], batch: int, context: int | None) -> float:
    """Median at (batch, context); a context-independent op pools its samples over every context."""
    if context is not None:
        return statistics.median(samples[(batch, context)])
    return statistics.median([x for (b, _), xs in samples.items() if b == batch for x in xs])


def _entry_line(e: OpEntry) -> str:
    def us(x: float) -> str:
        return f"{x * 1e6:.1f}"

    if e.contexts:
        grid = "; ".join(f"s={c}: " + " ".join(us(x) for x in row) for c, row in zip(e.contexts, e.latency_s))
    else:
        grid = " ".join(us(x) for x in e.latency_s[0])
    return f"{e.kind} x{e.num_ops} (tp {e.tp}, {e.example}): {grid} us at batch {','.join(map(str, e.batches))}"


def _measure_prefill_flops(source, dtype: str, graph, device: torch.device) -> float | None:
    """FLOP/s of the model's largest GEMM (TP 1) at `PREFILL_ROWS` rows, its weights as a rank holds
    them (on CPU: one packed oneDNN GEMM of its stacked weights, `kernel_ops.pack_cpu_gemms`); None
    where it has no dense GEMM of 2-D weights."""
    from opweave.kernels.reference import can_pack_linear, linear, pack_linear

    modules = dict(_meta_step(source, dtype, 1).named_modules())
    gemms = [op for op in graph.ops if op.cls == OpClass.GEMM and op.flops_per_token > 0
             and getattr(modules.get(op.name), "linear_weights", ())]
    if not gemms:
        return None
    op = max(gemms, key=lambda o: o.flops_per_token)
    shapes = [tuple(getattr(modules[op.name], name).shape) for name in modules[op.name].linear_weights]
    if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
        return None
    n, k = sum(s[0] for s in shapes), shapes[0][1]
    torch_dtype = getattr(torch, dtype)
    weight = torch.randn(n, k, dtype=torch_dtype, device=device) * 0.02
    if device.type == "cpu" and can_pack_linear():
        try:
            weight = pack_linear(weight)
        except RuntimeError:
            pass
    x = torch.randn(PREFILL_ROWS, k, dtype=torch_dtype, device=device)
    times = []
    for i in range(2 + MIN_REPS):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        linear(x, weight)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # after two warm-up calls
            times.append(time.perf_counter() - t0)
    return 2.0 * PREFILL_ROWS * n * k / statistics.median(times)


class _NoOp(nn.Module):
    def forward(self, x):
        return x


def _measure_dispatch() -> float:
    """Median seconds of one call of a module that does nothing."""
    noop, x = _NoOp(), torch.zeros(1)
    rounds = []
    for _ in range(DISPATCH_ROUNDS):
        start = time.perf_counter()
        for _ in range(DISPATCH_CALLS):
            noop(x)
        rounds.append((time.perf_counter() - start) / DISPATCH_CALLS)
    return statistics.median(rounds)
