"""`profile()`: measures one model's operators, the dispatch overhead and the links on this machine.

Steps:
1. trace the model's decode step into an OpGraph (at the measured dtype) and group its ops by
   cost signature: one representative op per group (every layer's `qkv_proj` is one group);
2. record each operator's input shapes by running the decode step on meta tensors with a
   forward pre-hook per operator (for TP > 1, the decode step of the sharded configuration);
3. materialise each representative with random weights exactly as a rank does
   (`opweave.runtime.shard.materialize`, then `with_kernels`), allocate its state for
   (batch, context), build random inputs of the recorded shapes (positions = context - 1), and
   time one decode token: warm-up calls, then adaptive repetitions rotating over copies of the
   op so that its weights and state are cold as in a step (ROTATE_FACTOR), median;
4. time a no-op module call (the Python dispatch every op pays);
5. time send/recv and all-reduce between two ranks (`opweave.profile.comm`).

Everything runs with `torch.set_num_threads(1)`, like each rank of `opweave run`.
"""

from __future__ import annotations

import copy
import datetime
import itertools
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
from opweave.ir.kinds import OpClass, OpKind
from opweave.models.model import DecodeStep, build_model
from opweave.models.ops import OpModule
from opweave.profile.signature import graph_hash, is_replicated, op_signature
from opweave.profile.table import OpEntry, ProfileTable

WARMUP_CALLS = 3
"""Untimed calls before timing each point (first-call allocations, caches, lazy kernel builds)."""

MIN_REPS = 5
MAX_REPS = 20
TARGET_POINT_S = 0.02
"""Repetitions per point: enough to fill TARGET_POINT_S, within [MIN_REPS, MAX_REPS]: a tiny model's
whole grid takes seconds, a large op still gets MIN_REPS."""

DISPATCH_CALLS = 1000
DISPATCH_ROUNDS = 7

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
            measure_links: bool = True) -> ProfileTable:
    """Measures `model`'s operators on `device`.

    Args:
        model: a MODEL argument (built-in name, checkpoint folder, model.py).
        device: "cpu" or "cuda" (the first CUDA device; links need two).
        batches, contexts: the grid; contexts only apply to ATTN ops.
        tp_degrees: TP degrees to measure one shard at (replicated ops: TP 1 only).
        progress: called with one line per op group and per phase.
        dtype: the dtype ops run in; default float32 on CPU, the model's dtype on CUDA.
        measure_links: time send/recv and all-reduce between two ranks.
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
    warnings: list[str] = []
    links = None
    if measure_links:  # first: the forked ranks start before this process runs any parallel op
        links = _measure_links(device, say, warnings)
    fe = run_front_end(model, dtype or ("float32" if device == "cpu" else None))
    graph = fe.graph
    say(f"{graph.model}: {len(graph.ops)} ops, dtype {graph.dtype}, device {device_name(device)}")
    groups: dict[str, list[Op]] = {}
    for op in graph.ops:
        groups.setdefault(op_signature(op), []).append(op)
    threads = torch.get_num_threads()
    torch.set_num_threads(MEASURE_THREADS)
    try:
        with torch.no_grad():
            entries = _measure_ops(fe.source, graph.dtype, groups, torch.device(device), batches, contexts,
                                   tp_degrees, say)
            dispatch_s = _measure_dispatch()
    finally:
        torch.set_num_threads(threads)
    say(f"dispatch overhead {dispatch_s * 1e6:.2f} us per module call")
    return ProfileTable(
        model=graph.model, graph_hash=graph_hash(graph), gpu=catalog_key(device), device_name=device_name(device),
        dtype=graph.dtype, torch_version=torch.__version__, opweave_version=__version__,
        python_version=platform.python_version(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), num_threads=MEASURE_THREADS,
        settings={"batches": list(batches), "contexts": list(contexts), "tp_degrees": list(tp_degrees),
                  "warmup_calls": WARMUP_CALLS, "min_reps": MIN_REPS, "max_reps": MAX_REPS,
                  "target_point_s": TARGET_POINT_S, "statistic": "median", "device": device},
        entries=tuple(entries), dispatch_s=dispatch_s,
        transfer_latency_s=links.p2p.latency_s if links else None,
        transfer_bandwidth=links.p2p.bandwidth if links else None,
        transfer_samples=links.p2p.samples if links else (),
        allreduce_latency_s=links.allreduce.latency_s if links else None,
        allreduce_bandwidth=links.allreduce.bandwidth if links else None,
        allreduce_samples=links.allreduce.samples if links else (),
        warnings=tuple(warnings),
    )


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
        from opweave.runtime.tp import sharded_config

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


def _make_inputs(specs, module: OpModule, batch: int, context: int, device: torch.device) -> list:
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
        elif module.kind == OpKind.MOE_EXPERTS:
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


def time_call(fn: Callable[[], object], device: torch.device, warmup: int = WARMUP_CALLS) -> tuple[float, int]:
    """Median seconds of `fn()` after `warmup` calls, with adaptive repetitions; returns (median, reps)."""
    cuda = device.type == "cuda"

    def once() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for _ in range(warmup):
        once()
    first = once()
    reps = max(MIN_REPS, min(MAX_REPS, int(TARGET_POINT_S / max(first, 1e-9))))
    times = [first] + [once() for _ in range(reps - 1)]
    return statistics.median(times), reps


def _measure_ops(source, dtype: str, groups: dict[str, list[Op]], device: torch.device, batches, contexts,
                 tp_degrees, say) -> list[OpEntry]:
    entries: list[OpEntry] = []
    steps: dict[int, tuple[dict, dict]] = {}
    for sig, ops in groups.items():
        op = ops[0]
        degrees = (1,) if is_replicated(op) else tuple(t for t in tp_degrees if op.tp_units % t == 0)
        skipped = [t for t in tp_degrees if t not in degrees and not is_replicated(op)]
        if skipped:
            say(f"{op.kind.value}: TP {skipped} does not divide {op.tp_units} units: not measured")
        for tp in degrees:
            for t in {1, tp} - set(steps):
                step = _meta_step(source, dtype, t)
                steps[t] = (dict(step.named_modules()), _input_specs(step))
            specs = steps[tp][1]
            grid = contexts if op.cls == OpClass.ATTN else (None,)
            rows = []
            for context in grid:
                row = []
                for batch in batches:
                    per_copy = op.weight_bytes / (1 if is_replicated(op) else tp) + batch * op.state_bytes(context or 1)
                    copies = _materialize_copies(steps[1][0][op.name], op.index, tp, device,
                                                 rotation_copies(per_copy, device), batch, context or 1)
                    args = _make_inputs(specs[op.name], copies[0][0], batch, context or 1, device)
                    turn = itertools.cycle([run for _, run in copies])
                    latency, _ = time_call(lambda: next(turn)(*args), device, max(WARMUP_CALLS, len(copies)))
                    row.append(latency)
                    del copies, turn
                rows.append(tuple(row))
            entries.append(OpEntry(
                signature=sig, kind=op.kind.value, example=op.name, num_ops=len(ops), tp=tp,
                flops_per_token=op.flops_per_token, weight_bytes=op.weight_bytes, batches=tuple(batches),
                contexts=tuple(contexts) if op.cls == OpClass.ATTN else (), latency_s=tuple(rows)))
            say(_entry_line(entries[-1]))
    return entries


def _materialize_copies(meta_module: OpModule, index: int, tp: int, device: torch.device, n: int, batch: int,
                        context: int) -> list[tuple[OpModule, Callable]]:
    """`n` copies of one op (TP rank 0's shard, random weights as a rank loads them, own state)."""
    from opweave.runtime.kernel_ops import with_kernels
    from opweave.runtime.shard import materialize

    out = []
    for _ in range(n):
        # materialize shards the full (unsharded) module itself; a copy keeps the meta model intact
        module = materialize({index: copy.deepcopy(meta_module)}, "random", tp, 0, device)[index]
        module.allocate_state(batch, context, device)
        out.append((module, with_kernels({index: module}, device)[index]))
    return out


def _entry_line(e: OpEntry) -> str:
    def us(x: float) -> str:
        return f"{x * 1e6:.1f}"

    if e.contexts:
        grid = "; ".join(f"s={c}: " + " ".join(us(x) for x in row) for c, row in zip(e.contexts, e.latency_s))
    else:
        grid = " ".join(us(x) for x in e.latency_s[0])
    return f"{e.kind} x{e.num_ops} (tp {e.tp}, {e.example}): {grid} us at batch {','.join(map(str, e.batches))}"


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
