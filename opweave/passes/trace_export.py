"""Exports of a simulated schedule: Chrome trace-event JSON and a Gantt PNG (docs/simulator.md).

Chrome trace: pid = owner (process_name = the owner's name), tid 0 = its compute stream, tids
1, 2, ... = the links leaving it ("send -> o2"), one complete event ("ph": "X", microseconds) per
executed task. Open it at ui.perfetto.dev or chrome://tracing.

Both come from the Plan alone: `problem_from_plan` rebuilds the simulator's problem from the
figures plan.json keeps (each stage's compute and send time, each owner's price, the token-id
return), so `opweave dump ARTIFACT --what plan --trace FILE --gantt FILE` redraws them from any
artifact, and the compiler writes them the same way. Both are deterministic: the same plan gives
the same bytes (the PNG carries no date).
"""

from __future__ import annotations

import os
import tempfile

from opweave.errors import OpWeaveError
from opweave.ir.plan import Plan
from opweave.passes.simulate import (KIND_COMPUTE, KIND_RETURN, SimOwner, SimProblem, SimResult, SimStage,
                                     simulate)

US_PER_S = 1e6
COMPUTE_TID = 0
GANTT_MAX_OUTLINED_STAGES = 16   # beyond this, bar outlines would hide the colors


def problem_from_plan(plan: Plan) -> SimProblem:
    """The simulator's problem of a plan's replica set, from the plan's own figures.

    Raises OpWeaveError for a plan written before plans kept them (format opweave-plan/2)."""
    if plan.return_s is None or any(s.compute_s is None or s.send_s is None for s in plan.stages) \
            or any(o.price_per_hour is None for o in plan.owners):
        raise OpWeaveError(f"the plan of {plan.model} has no schedule figures (an older plan format); "
                           "recompile it to draw its trace or Gantt chart")
    owners = tuple(SimOwner(name=f"o{o.slot} {o.replicas}x {o.gpu} tp{o.tp}" + (" ep" if o.experts == "ep" else ""),
                            replicas=o.replicas,
                            gpus_per_replica=o.tp, price_per_hour=o.price_per_hour,
                            memory_per_gpu=o.memory_per_gpu_bytes) for o in plan.owners)
    stages = tuple(SimStage(owner=s.owner, compute_s=s.compute_s, send_s=s.send_s, send_bytes=s.send_bytes or 0.0,
                            inter_node=bool(s.send_inter_node), label=s.label) for s in plan.stages)
    return SimProblem(owners=owners, stages=stages, return_s=plan.return_s, batch=plan.batch,
                      num_microbatches=plan.microbatches, return_bytes=plan.return_bytes or 0.0,
                      return_inter_node=bool(plan.return_inter_node))


def write_schedule(plan: Plan, trace_path: str | None = None, gantt_path: str | None = None) -> SimResult:
    """Simulates the plan's schedule again and writes its Chrome trace and / or Gantt chart."""
    import json

    problem = problem_from_plan(plan)
    result = simulate(problem)
    if trace_path is not None:
        with open(trace_path, "w", encoding="utf-8") as f:
            json.dump(chrome_trace(problem, result), f)
    if gantt_path is not None:
        gantt_png(problem, result, gantt_path)
    return result


def link_tids(result: SimResult) -> dict[tuple[int, int], int]:
    """(src, dst) -> tid on the source owner's pid: 1, 2, ... in the links' first-use order."""
    tids: dict[tuple[int, int], int] = {}
    per_src: dict[int, int] = {}
    for ln in result.links:
        per_src[ln.src] = per_src.get(ln.src, 0) + 1
        tids[(ln.src, ln.dst)] = per_src[ln.src]
    return tids


def chrome_trace(problem: SimProblem, result: SimResult) -> dict:
    """Chrome trace-event JSON of the recorded rounds (deterministic; json.dump it as is).

    Args:
        problem: the simulated problem (owner names, stage labels).
        result: simulate(problem).
    Returns:
        {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}.
    """
    tids = link_tids(result)
    events: list[dict] = []
    for k, owner in enumerate(problem.owners):
        events.append({"ph": "M", "name": "process_name", "pid": k, "tid": 0, "args": {"name": owner.name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": k, "tid": 0, "args": {"sort_index": k}})
        events.append({"ph": "M", "name": "thread_name", "pid": k, "tid": COMPUTE_TID, "args": {"name": "compute"}})
    for (src, dst), tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": src, "tid": tid, "args": {"name": f"send -> o{dst}"}})
    for iv in result.intervals():
        label = problem.stages[iv.stage].label
        if iv.kind == KIND_COMPUTE:
            name, tid = label, COMPUTE_TID
        else:
            name = "return token ids" if iv.kind == KIND_RETURN else f"send {label}"
            tid = tids[(iv.owner, iv.dst_owner)]
        events.append({"name": name, "cat": iv.kind, "ph": "X", "pid": iv.owner, "tid": tid,
                       "ts": iv.start_s * US_PER_S, "dur": (iv.end_s - iv.start_s) * US_PER_S,
                       "args": {"round": iv.round, "microbatch": iv.microbatch, "stage": iv.stage,
                                "label": label}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"tpot_s": result.tpot_s, "tokens_per_s": result.tokens_per_s,
                          "cost_per_mtok_usd": result.cost_per_mtok_usd}}


def gantt_png(problem: SimProblem, result: SimResult, path: str, max_rounds: int = 2) -> None:
    """Gantt chart of the last `max_rounds` recorded rounds, written atomically as a PNG.

    One row per owner compute stream (owners with stages) and per link; bars colored by microbatch.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    first_round = problem.rounds - max_rounds
    used = sorted({s.owner for s in problem.stages})
    rows = [(KIND_COMPUTE, o, o) for o in used] + [("link", ln.src, ln.dst) for ln in result.links]
    row_of = {key: r for r, key in enumerate(rows)}
    names = [f"o{src} compute" if kind == KIND_COMPUTE else f"o{src} -> o{dst}" for kind, src, dst in rows]
    fig = Figure(figsize=(12, 1.0 + 0.45 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = colormaps["tab10"]
    spans: dict[tuple[int, int], list[tuple[float, float]]] = {}    # (row, microbatch) -> bars
    for iv in result.intervals():
        if iv.round < first_round or iv.end_s <= iv.start_s:
            continue
        key = (KIND_COMPUTE, iv.owner, iv.owner) if iv.kind == KIND_COMPUTE else ("link", iv.owner, iv.dst_owner)
        spans.setdefault((row_of[key], iv.microbatch), []).append((iv.start_s * 1e3, (iv.end_s - iv.start_s) * 1e3))
    thin = len(problem.stages) > GANTT_MAX_OUTLINED_STAGES
    for (row, mb), bars in sorted(spans.items()):
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors(mb % colors.N),
                       edgecolor="none" if thin else "black", linewidth=0.4)
    ax.legend(handles=[Patch(color=colors(m % colors.N), label=f"mb {m}") for m in range(problem.num_microbatches)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    occupancy = ", ".join(f"o{k} {st.occupancy:.0%}" for k, st in enumerate(result.owners) if k in used)
    ax.set_title(f"TPOT {result.tpot_s * 1e3:.4g} ms, {result.tokens_per_s:.4g} tok/s; occupancy {occupancy}"
                 f" (rounds {max(first_round, 0)}..{problem.rounds - 1}, colors = microbatch)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".gantt.", suffix=".png")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100, metadata={"Software": None})  # no version: same bytes
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
