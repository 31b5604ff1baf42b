"""`ProfileTable`: measured operator latencies and link figures, as the cost model reads them.

A table holds, per op signature (`opweave.profile.signature`) and TP degree, the median latency of
one decode step of that op on a grid of batch sizes (and, for ATTN ops, context lengths), plus
the per-op dispatch overhead and point-to-point / all-reduce figures between two ranks. It
implements the cost model's `OpProfile` protocol (`op_latency`), counting hits and misses so
the planner can report which figures it used.

Interpolation (per axis, batch first, then context):
  - at a measured point: the measured median;
  - between two measured points: linear;
  - below the smallest measured point: the smallest point's figure (no extrapolation down);
  - above the largest: linear from the last two points with the slope floored at 0, so an
    extrapolated figure is never below the largest point's (nor, a fortiori, the smallest).

File format: JSON, `{"format": "opweave-profile", "version": 1, ...}` (docs/profile.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from opweave.errors import OpWeaveError
from opweave.hardware.catalog import GPUSpec, normalize_name
from opweave.ir.graph import OP_CLASS, Op, OpGraph
from opweave.ir.kinds import OpClass, OpKind
from opweave.outputs import atomic_file, check_output_file
from opweave.profile.signature import graph_hash, graph_signatures, is_replicated, op_signature

FORMAT = "opweave-profile"
FORMAT_VERSION = 2
"""2: op figures measured in place (a decode step's op sequence), host time per transfer side."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OpEntry:
    """Measured latencies of one op signature at one TP degree (one TP shard, no collective)."""

    signature: str
    kind: str
    example: str                  # the representative op's name
    num_ops: int                  # ops of the profiled graph with this signature
    tp: int
    flops_per_token: int          # of the whole op (before sharding), at context 0
    weight_bytes: int             # of the whole op (before sharding)
    batches: tuple[int, ...]
    contexts: tuple[int, ...]     # () for context-independent ops (all but ATTN)
    latency_s: tuple[tuple[float, ...], ...]  # [context][batch]; one row when contexts == ()

    def latency(self, batch: int, context: int) -> float:
        """The figure at (batch, context) by the interpolation rule of the module docstring."""
        per_context = [interpolate(self.batches, row, batch) for row in self.latency_s]
        if not self.contexts:
            return per_context[0]
        return interpolate(self.contexts, per_context, context)


def interpolate(xs: tuple[int, ...] | list[int], ys: list[float] | tuple[float, ...], x: float) -> float:
    """Piecewise linear in x over sorted points; flat below, slope >= 0 above (module docstring)."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return float(ys[i - 1] + t * (ys[i] - ys[i - 1]))
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return float(ys[-1] + slope * (x - xs[-1]))


def fresh_counts() -> dict[str, int]:
    """Lookup counters: hits, misses, and misses by reason."""
    return {"hit": 0, "miss": 0, "miss_signature": 0, "miss_gpu": 0, "miss_tp": 0, "beyond_grid": 0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileTable:
    """A profile of one model on one device (see the module docstring)."""

    model: str
    graph_hash: str               # `opweave.profile.signature.graph_hash` of the profiled graph
    gpu: str                      # the catalog key the planner passes ("cpu", "h100", ...)
    device_name: str              # the hardware as the machine names it (CPU model, CUDA device)
    dtype: str                    # dtype the ops ran in
    torch_version: str
    opweave_version: str
    python_version: str
    date: str                     # ISO 8601, UTC
    num_threads: int              # torch threads during the measurement
    settings: dict[str, Any]      # warm-up, repetitions, grids (for the record)
    entries: tuple[OpEntry, ...]
    dispatch_s: float             # one no-op module call from Python
    prefill_flops: float | None = None        # the largest GEMM's FLOP/s at `measure.PREFILL_ROWS` rows
    transfer_latency_s: float | None = None   # point-to-point, fitted: latency + bytes / bandwidth
    transfer_bandwidth: float | None = None   # bytes/s
    transfer_samples: tuple[tuple[int, float], ...] = ()  # (bytes, one-way seconds)
    allreduce_latency_s: float | None = None  # two ranks, fitted like the transfer
    allreduce_bandwidth: float | None = None
    allreduce_samples: tuple[tuple[int, float], ...] = ()
    send_host_latency_s: float | None = None   # host time of packing and posting one transfer, fitted
    send_host_bandwidth: float | None = None
    send_host_samples: tuple[tuple[int, float], ...] = ()
    recv_host_latency_s: float | None = None   # host time of taking in one arrived transfer, fitted
    recv_host_bandwidth: float | None = None
    recv_host_samples: tuple[tuple[int, float], ...] = ()
    warnings: tuple[str, ...] = ()
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: fresh_counts(), compare=False, repr=False)
    _index: dict = dataclasses.field(init=False, compare=False, repr=False)
    _sig_cache: dict = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        index: dict[str, dict[int, OpEntry]] = {}
        for e in self.entries:
            index.setdefault(e.signature, {})[e.tp] = e
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_sig_cache", {})

    # ---------------------------------------------------------------- OpProfile
    def op_latency(self, op: Op, gpu: str, tp: int, batch: int, context: int) -> float | None:
        """Measured latency of `op` on one GPU of a TP-`tp` group of `gpu`, or None (the roofline)."""
        entry, reason = self._entry(op, gpu, tp)
        if entry is None:
            return self._miss(reason)
        self.counts["hit"] += 1
        return entry.latency(batch, context)

    def grid_limits(self, op: Op, gpu: str, tp: int) -> tuple[int, int | None] | None:
        """(largest measured batch, largest measured context or None) of the op's figures, or None
        where the table has none. Beyond them the cost model scales the figure at the limit by the
        roofline's growth (`CostModel.op_cost`) instead of extrapolating noisy points."""
        entry, _ = self._entry(op, gpu, tp)
        if entry is None:
            return None
        return entry.batches[-1], (entry.contexts[-1] if entry.contexts else None)

    def count_beyond_grid(self) -> None:
        self.counts["beyond_grid"] += 1

    def _entry(self, op: Op, gpu: str, tp: int) -> tuple[OpEntry | None, str]:
        if gpu != self.gpu and normalize_name(gpu) != normalize_name(self.gpu):
            return None, "miss_gpu"
        by_tp = self._index.get(self._signature(op))
        if not by_tp:
            return None, "miss_signature"
        entry = by_tp.get(tp) or (by_tp.get(1) if is_replicated(op) else None)
        return (entry, "") if entry is not None else (None, "miss_tp")

    def collective_s(self, gpu: str, tp: int, nbytes: float) -> float | None:
        """A TP-`tp` all-reduce (or all-gather) of `nbytes` with the runtime's transport, from the
        two-rank all-reduce fit t2 = a + n / bw, as a ring: (tp - 1) * a + 2 (tp - 1) / tp * n / bw
        (t2 at tp = 2); None where the table has no figure."""
        if gpu != self.gpu and normalize_name(gpu) != normalize_name(self.gpu):
            return None
        if self.allreduce_latency_s is None or not self.allreduce_bandwidth or tp <= 1:
            return None
        return (tp - 1) * self.allreduce_latency_s + 2 * (tp - 1) / tp * nbytes / self.allreduce_bandwidth

    def transfer_host_s(self, gpu: str, side: str, nbytes: float) -> float | None:
        """Host time one side ("send" or "recv") of a transfer of `nbytes` spends on its own stream
        (the runtime's packing, posting, unpacking), or None where the table has no figure."""
        if gpu != self.gpu and normalize_name(gpu) != normalize_name(self.gpu):
            return None
        latency, bandwidth = ((self.send_host_latency_s, self.send_host_bandwidth) if side == "send"
                              else (self.recv_host_latency_s, self.recv_host_bandwidth))
        if latency is None or not bandwidth:
            return None
        return latency + nbytes / bandwidth

    def _signature(self, op: Op) -> str:
        cached = self._sig_cache.get(id(op))
        if cached is not None and cached[0] is op:
            return cached[1]
        sig = op_signature(op)
        self._sig_cache[id(op)] = (op, sig)
        return sig

    def _miss(self, reason: str) -> None:
        self.counts["miss"] += 1
        self.counts[reason] += 1
        return None

    def reset_counts(self) -> None:
        for key in self.counts:
            self.counts[key] = 0

    def usage_summary(self) -> str:
        """'profile (cpu, <device>, <date>): 812 op figures measured, 40 from the roofline (...)'."""
        c = self.counts
        reasons = [f"{c[k]} {text}" for k, text in (("miss_signature", "unprofiled ops"),
                                                     ("miss_gpu", "other GPU types"),
                                                     ("miss_tp", "unprofiled TP degrees")) if c[k]]
        detail = f" ({', '.join(reasons)})" if reasons else ""
        host = "; transfer host time measured" if self.send_host_latency_s is not None else ""
        if self.allreduce_latency_s is not None:
            host += "; TP collectives from the measured all-reduce"
        if c["beyond_grid"]:
            host += (f"; {c['beyond_grid']} figures beyond the measured batch/context grid, scaled from its edge "
                     "by the roofline (profile the batches you plan for)")
        return (f"profile of {self.model} on {self.gpu} ({self.device_name}, {self.date[:10]}): "
                f"{c['hit']} op figures measured, {c['miss']} from the roofline{detail}{host}")

    def signatures(self) -> set[str]:
        return set(self._index)

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION}
        for f in dataclasses.fields(self):
            if f.name in ("counts", "_index", "_sig_cache", "warnings"):
                continue
            value = getattr(self, f.name)
            if f.name == "entries":
                value = [dataclasses.asdict(e) for e in value]
            out[f.name] = value
        return out

    def save(self, path: str) -> None:
        """Writes the table as JSON (to a temporary file in the same folder, then renamed), so an
        interrupted or failed write leaves any previous file at `path` as it was."""
        check_output_file(path, "-o")  # checked before the measurements too; the folder may have gone since
        with atomic_file(path, flag="-o") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")


def table_from_json(data: dict[str, Any], where: str = "profile") -> ProfileTable:
    """The table from its JSON form; OpWeaveError (one line) on a bad or foreign document."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise OpWeaveError(f"{where}: not an opweave profile (no \"format\": \"{FORMAT}\")")
    version = data.get("version")
    if version != FORMAT_VERSION:
        raise OpWeaveError(f"{where}: profile format version {version!r} is not supported (this opweave reads "
                           f"version {FORMAT_VERSION}); re-run `opweave profile`")
    try:
        entries = tuple(OpEntry(
            signature=str(e["signature"]), kind=str(e["kind"]), example=str(e["example"]), num_ops=int(e["num_ops"]),
            tp=int(e["tp"]), flops_per_token=int(e["flops_per_token"]), weight_bytes=int(e["weight_bytes"]),
            batches=tuple(int(b) for b in e["batches"]), contexts=tuple(int(c) for c in e["contexts"]),
            latency_s=tuple(tuple(float(x) for x in row) for row in e["latency_s"]),
        ) for e in data["entries"])
        for e in entries:
            rows = len(e.contexts) or 1
            if not e.batches or len(e.latency_s) != rows or any(len(r) != len(e.batches) for r in e.latency_s):
                raise ValueError(f"entry {e.signature}: latency grid does not match its batches/contexts")

        def opt(key: str) -> float | None:
            return None if data.get(key) is None else float(data[key])

        def samples(key: str) -> tuple[tuple[int, float], ...]:
            return tuple((int(n), float(t)) for n, t in data.get(key, ()))

        return ProfileTable(
            model=str(data["model"]), graph_hash=str(data["graph_hash"]), gpu=str(data["gpu"]),
            device_name=str(data["device_name"]), dtype=str(data["dtype"]), torch_version=str(data["torch_version"]),
            opweave_version=str(data["opweave_version"]), python_version=str(data["python_version"]),
            date=str(data["date"]), num_threads=int(data["num_threads"]), settings=dict(data.get("settings", {})),
            entries=entries, dispatch_s=float(data["dispatch_s"]), prefill_flops=opt("prefill_flops"),
            transfer_latency_s=opt("transfer_latency_s"), transfer_bandwidth=opt("transfer_bandwidth"),
            transfer_samples=samples("transfer_samples"), allreduce_latency_s=opt("allreduce_latency_s"),
            allreduce_bandwidth=opt("allreduce_bandwidth"), allreduce_samples=samples("allreduce_samples"),
            send_host_latency_s=opt("send_host_latency_s"), send_host_bandwidth=opt("send_host_bandwidth"),
            send_host_samples=samples("send_host_samples"), recv_host_latency_s=opt("recv_host_latency_s"),
            recv_host_bandwidth=opt("recv_host_bandwidth"), recv_host_samples=samples("recv_host_samples"),
        )
    except KeyError as err:
        raise OpWeaveError(f"{where}: not a valid opweave profile (missing field {err})") from None
    except (TypeError, ValueError) as err:
        raise OpWeaveError(f"{where}: not a valid opweave profile ({' '.join(str(err).split())})") from None


def load_profile(path: str, graph: OpGraph | None = None, device_name: str | None = None) -> ProfileTable:
    """Reads a profile and checks it applies.

    Args:
        path: a file written by `ProfileTable.save` (`opweave profile -o`).
        graph: the graph the planner will cost. A profile of another graph is refused unless some
            op signatures match; then only the matching ones are kept and `warnings` says so.
        device_name: the device the plan is for, as a catalog key ("cpu") or the machine's own
            name (`opweave.profile.measure.device_name`); a different device is refused.
    Returns:
        the table (restricted to `graph`'s signatures when they only partly match).
    Raises:
        OpWeaveError: unreadable, truncated, non-JSON, older format, other model, other device.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise OpWeaveError(f"profile file '{path}' not found") from None
    except json.JSONDecodeError as err:
        raise OpWeaveError(f"{path}: not a valid profile (truncated or not JSON: {err.msg} "
                           f"at line {err.lineno})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise OpWeaveError(f"{path}: cannot read profile ({' '.join(str(err).split())})") from None
    table = table_from_json(data, path)
    if device_name is not None and normalize_name(device_name) not in (
            normalize_name(table.gpu), normalize_name(table.device_name)):
        raise OpWeaveError(f"{path}: measured on {table.device_name} ({table.gpu}), not on {device_name}; "
                           f"profile this device with `opweave profile`")
    if graph is not None:
        table = _restrict_to_graph(table, graph, path)
    return table


def _restrict_to_graph(table: ProfileTable, graph: OpGraph, path: str) -> ProfileTable:
    digest = graph_hash(graph)
    if digest == table.graph_hash:
        return table
    sigs = graph_signatures(graph)
    shared = set(sigs) & table.signatures()
    what = (f"{path} is a profile of {table.model} ({table.dtype}, graph {table.graph_hash[:12]}), "
            f"not of {graph.model} ({graph.dtype}, graph {digest[:12]})")
    if not shared:
        raise OpWeaveError(f"{what}, and no operator of {graph.model} matches a profiled one; "
                           f"run `opweave profile --model {graph.model}`")
    matched = sum(1 for s in sigs if s in shared)
    warning = (f"{what}: {matched} of {len(sigs)} ops match a profiled operator and use measured figures, "
               f"the other {len(sigs) - matched} use the roofline")
    return dataclasses.replace(table, entries=tuple(e for e in table.entries if e.signature in shared),
                               warnings=table.warnings + (warning,), counts=fresh_counts())


# ---------------------------------------------------------------- the catalog's cpu entry

MIN_COMPUTE_FRACTION = 0.1
"""When a figure is derived from (latency - dispatch_s), at least this share of the latency counts
as compute, so a noisy dispatch figure close to a tiny op's latency cannot make it vanish."""


def _compute_s(latency_s: float, dispatch_s: float) -> float:
    return max(latency_s - dispatch_s, MIN_COMPUTE_FRACTION * latency_s)


def cpu_gpu_spec(table: ProfileTable, base: GPUSpec) -> GPUSpec:
    """The catalog entry for the profiled device (e.g. `cpu`) with achieved figures from `table`.

    - peak_flops: the GEMM with the most FLOPs per token, at its largest measured batch, TP 1:
      batch * FLOPs / (latency - dispatch);
    - mem_bandwidth: the GEMM with the most weight bytes, at batch 1, TP 1: bytes / (latency - dispatch);
    - launch_overhead: `dispatch_s`;
    - link figures: the measured point-to-point latency and bandwidth, the bandwidths divided by
      the cost model's link efficiencies so the cost model's effective bandwidth is the measured one;
    - gemm_efficiency = mem_efficiency = 1.0 (the figures are achieved ones); where the profile
      timed the largest GEMM at a prefill chunk's rows (`prefill_flops`), peak_flops is the larger
      of the two figures, gemm_efficiency the decode batch's share of it and prefill_efficiency
      the prefill's, so decode math and prefill math each run at their measured rate;
    - memory, usable fraction, node size and price stay `base`'s.
    """
    from opweave.cost.model import INTER_LINK_EFFICIENCY, INTRA_LINK_EFFICIENCY

    gemms = [e for e in table.entries if e.tp == 1 and OP_CLASS.get(OpKind(e.kind), OpClass.LIGHT) == OpClass.GEMM]
    if not gemms:
        raise OpWeaveError(f"the profile of {table.model} measured no GEMM at TP 1: cannot derive FLOP/s and bandwidth")
    measured = f"measured by opweave profile on {table.device_name} {table.date[:10]}"
    big = max(gemms, key=lambda e: e.flops_per_token)
    b = big.batches[-1]
    flops = b * big.flops_per_token / _compute_s(big.latency(b, 0), table.dispatch_s)
    heavy = max(gemms, key=lambda e: e.weight_bytes)
    bandwidth = heavy.weight_bytes / _compute_s(heavy.latency(1, 0), table.dispatch_s)
    values: dict[str, float] = {"peak_flops": flops, "mem_bandwidth": bandwidth, "gemm_efficiency": 1.0,
                                "mem_efficiency": 1.0, "kv_efficiency": 1.0, "launch_overhead": table.dispatch_s}
    sources = {
        "peak_flops": f"{measured}: {big.example} ({big.kind}) at batch {b}, FLOPs / (latency - dispatch)",
        "mem_bandwidth": f"{measured}: {heavy.example} ({heavy.kind}) weights at batch 1, bytes / (latency - dispatch)",
        "gemm_efficiency": f"{measured}: 1.0, peak_flops is an achieved figure",
        "mem_efficiency": f"{measured}: 1.0, mem_bandwidth is an achieved figure",
        "kv_efficiency": f"{measured}: 1.0, mem_bandwidth is an achieved figure",
        "launch_overhead": f"{measured}: median no-op module call",
    }
    if table.prefill_flops:  # a prefill's GEMMs: the largest one timed at a prompt chunk's rows
        peak = max(flops, table.prefill_flops)
        values |= {"peak_flops": peak, "gemm_efficiency": flops / peak,
                   "prefill_efficiency": table.prefill_flops / peak}
        sources |= {
            "peak_flops": f"{measured}: the larger of its largest GEMM's FLOP/s at batch {b} and at a prefill's rows",
            "gemm_efficiency": f"{measured}: {big.example} ({big.kind}) at batch {b}, FLOPs / (latency - dispatch), "
                               "over peak_flops",
            "prefill_efficiency": f"{measured}: the largest GEMM at a prefill chunk's rows, FLOP/s over peak_flops"}
    if table.transfer_latency_s is not None and table.transfer_bandwidth is not None:
        link = f"{measured}: torch.distributed send/recv between two ranks, median round trip / 2, fitted"
        values |= {"intra_link_latency": table.transfer_latency_s, "inter_link_latency": table.transfer_latency_s,
                   "intra_link_bandwidth": table.transfer_bandwidth / INTRA_LINK_EFFICIENCY,
                   "inter_link_bandwidth": table.transfer_bandwidth / INTER_LINK_EFFICIENCY}
        sources |= {"intra_link_latency": link, "inter_link_latency": link,
                    "intra_link_bandwidth": f"{link}; divided by the cost model's INTRA_LINK_EFFICIENCY",
                    "inter_link_bandwidth": f"{link}; divided by the cost model's INTER_LINK_EFFICIENCY"}
    description = f"{base.description.split(' (')[0]} ({table.device_name}, figures {measured})"
    return dataclasses.replace(base, description=description, **values, sources={**base.sources, **sources})
