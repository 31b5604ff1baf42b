"""What each rank did and when, as measured: the runtime's counterpart of the simulator's trace.

With tracing on (`opweave run --trace FILE`), every rank records one span per piece of work of a
round, in the order the generated module does it:

    wait     blocked receiving a stage's inputs (or, at stage 0, the previous step's token ids),
             including unpacking and the fan-out to TP peers
    compute  a stage's operators for one microbatch (from its inputs in hand to its outputs sent)
    send     packing the outputs and posting the non-blocking sends (or returning the token ids)
    sync     end of round: completing the previous round's sends, the liveness all-reduce

Clocks are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: one clock for every process of the
machine), so the ranks' spans line up. `chrome_trace` writes them in the simulator trace's layout
(pid = rank, tid 0 = its stream); `write_trace` adds the plan's simulated schedule (the artifact's
`trace.json`, pids from 1000) starting with the first decode round, so predicted and measured
rounds lie one above the other at ui.perfetto.dev.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from opweave.artifact import load_artifact
from opweave.outputs import atomic_file, check_output_file

US_PER_S = 1e6
KINDS = ("wait", "compute", "send", "sync")


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    kind: str        # one of KINDS
    round: int
    stage: int       # -1 for sync
    microbatch: int  # -1 for sync
    start_s: float
    end_s: float

    @property
    def dur_s(self) -> float:
        return self.end_s - self.start_s


class Timeline:
    """One rank's spans; `mark` closes the span open since the last mark."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._last = time.perf_counter()

    def mark(self, kind: str, round_index: int, stage: int, mb: int) -> None:
        now = time.perf_counter()
        self.spans.append(Span(kind, round_index, stage, mb, self._last, now))
        self._last = now

    def restart(self) -> None:
        """Start the next span now (time between rounds is not attributed)."""
        self._last = time.perf_counter()

    def to_rows(self) -> list[tuple]:
        return [dataclasses.astuple(s) for s in self.spans]


def from_rows(rows: list[tuple]) -> list[Span]:
    return [Span(*r) for r in rows]


def per_round(spans: list[Span], rounds: range | None = None) -> dict[str, float]:
    """Median seconds per round spent in each kind (over `rounds`, default all)."""
    by_round: dict[int, dict[str, float]] = {}
    for s in spans:
        if rounds is not None and s.round not in rounds:
            continue
        row = by_round.setdefault(s.round, dict.fromkeys(KINDS, 0.0))
        row[s.kind] += s.dur_s
    if not by_round:
        return dict.fromkeys(KINDS, 0.0)
    return {k: statistics.median(r[k] for r in by_round.values()) for k in KINDS}


def chrome_trace(spans_by_rank: dict[int, list[Span]], labels: dict[int, str] | None = None) -> dict:
    """Chrome trace-event JSON: pid = rank, one complete event per span, time from the first span."""
    labels = labels or {}
    t0 = min((s.start_s for spans in spans_by_rank.values() for s in spans), default=0.0)
    events: list[dict] = []
    for rank in sorted(spans_by_rank):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": labels.get(rank, f"rank {rank}")}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for s in spans_by_rank[rank]:
            name = s.kind if s.kind == "sync" else f"{s.kind} s{s.stage}"
            events.append({"name": name, "cat": s.kind, "ph": "X", "pid": rank, "tid": 0,
                           "ts": (s.start_s - t0) * US_PER_S, "dur": s.dur_s * US_PER_S,
                           "args": {"round": s.round, "microbatch": s.microbatch, "stage": s.stage}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


STEADY_SKIP = 2
"""Rounds left out of a run's summary at each end: the first are prefill, the last drain."""


def summary(spans_by_rank: dict[int, list[Span]], rounds: int) -> list[str]:
    """One line per rank: median ms per decode round in each kind (first/last STEADY_SKIP rounds left out)."""
    steady = range(STEADY_SKIP, rounds - STEADY_SKIP) if rounds > 2 * STEADY_SKIP else range(rounds)
    out = []
    for rank in sorted(spans_by_rank):
        figures = per_round(spans_by_rank[rank], steady)
        out.append(f"rank {rank}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in figures.items())
                   + " ms per round (median)")
    return out


SIMULATED_PID_OFFSET = 1000
"""The simulator's owners appear as pids 1000, 1001, ... beside the measured ranks."""


def with_simulated(trace: dict, spans_by_rank: dict[int, list[Span]], simulated: dict, at_round: int) -> dict:
    """Adds the simulator's schedule (the artifact's `trace.json`) to a measured trace, its round 0
    starting where measured round `at_round` starts on rank 0, so predicted and measured rounds lie
    one above the other."""
    t0 = min((s.start_s for spans in spans_by_rank.values() for s in spans), default=0.0)
    starts = [s.start_s for s in spans_by_rank.get(0, []) if s.round == at_round]
    shift = ((min(starts) - t0) * US_PER_S) if starts else 0.0
    events = list(trace["traceEvents"])
    for e in simulated.get("traceEvents", []):
        e = dict(e, pid=e["pid"] + SIMULATED_PID_OFFSET)
        if e.get("ph") == "M" and e.get("name") == "process_name":
            e["args"] = {"name": f"simulated {e['args']['name']}"}
        elif e.get("ph") == "M" and e.get("name") == "process_sort_index":
            e["args"] = {"sort_index": SIMULATED_PID_OFFSET + e["args"]["sort_index"]}
        elif "ts" in e:
            e["ts"] = e["ts"] + shift
        events.append(e)
    return {**trace, "traceEvents": events}


def write_trace(stats: dict, path: str, artifact: str | None = None, device: str | None = None) -> list[str]:
    """Writes the Chrome trace of a traced run's stats (atomically), with the plan's simulated
    schedule beside it when `artifact` holds one (its trace.json and plan.json, checked against the
    manifest); returns a summary to print. `device` is where the ranks ran (cpu | cuda): when it is
    not the kind of device the plan was made for (CPU ranks of a plan for GPUs), the TPOT line says
    so instead of a percentage, which would compare two different machines."""
    spans = {int(r): from_rows(rows) for r, rows in stats["spans"].items()}
    trace = chrome_trace(spans)
    files = load_artifact(artifact, ["trace.json", "plan.json"], missing_ok=True) if artifact else None
    simulated = files is not None and files.has("trace.json")
    if simulated:
        trace = with_simulated(trace, spans, files.json("trace.json"), STEADY_SKIP)
    check_output_file(path, "--trace")  # checked before the run too; the folder may have gone since
    with atomic_file(path, flag="--trace") as f:
        json.dump(trace, f)
    beside = "; the simulated schedule beside it" if simulated else ""
    n_ranks, n_rounds = len(spans), len(stats["round_s"])
    lines = [f"trace: {path} ({n_ranks} rank{'s' * (n_ranks != 1)}, {n_rounds} round{'s' * (n_rounds != 1)}"
             f"{beside}; open at ui.perfetto.dev)"]
    lines += summary(spans, n_rounds)
    steady = stats["round_s"][STEADY_SKIP:-STEADY_SKIP] if n_rounds > 2 * STEADY_SKIP else []
    if files is not None and files.has("plan.json") and steady:
        plan = files.json("plan.json")
        predicted = float(plan["tpot_ms"]) / 1e3
        measured = statistics.median(steady)
        line = (f"TPOT: predicted {predicted * 1e3:.2f} ms (plan.json), measured {measured * 1e3:.2f} ms "
                f"(rank 0's median decode round")
        other = other_device(plan_gpus(plan), device)
        if other is None:
            lines.append(f"{line}; predicted/measured - 1 = {predicted / measured - 1:+.1%})")
        else:  # a percentage here would compare two machines: say so on the next line
            lines += [f"{line})", f"  {other}"]
    return lines


def plan_gpus(plan: dict) -> tuple[str, ...]:
    """The catalog GPU types a plan.json's owners run on, in owner order, each once."""
    return tuple(dict.fromkeys(str(o["gpu"]) for o in plan["owners"]))


CPU_GPU = "cpu"
"""The catalog's entry for CPU ranks (`--cluster cpuxN`, sized from a profile)."""


def other_device(gpus: tuple[str, ...], device: str | None) -> str | None:
    """Why a prediction for `gpus` does not describe ranks that ran on `device` (cpu | cuda), or
    None when it does (or `device` is not known): CPU ranks running a plan for GPUs, or CUDA ranks
    running a plan for the `cpu` entry."""
    names = "+".join(gpus)
    if device == "cpu" and any(g != CPU_GPU for g in gpus):
        return (f"(the prediction is for {names}; these ranks ran on this machine's CPU, so the two are not "
                "compared: for a CPU prediction, compile with --profile and --cluster cpuxN, docs/profile.md)")
    if device == "cuda" and CPU_GPU in gpus:
        return f"(the prediction is for {names}; these ranks ran on CUDA devices, so the two are not compared)"
    return None
