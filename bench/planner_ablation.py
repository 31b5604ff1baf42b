"""The planner ablation of the summary's §7.5 / Table 3: the search with and without its two reductions.

    python bench/planner_ablation.py          # 4 settings x 4 modes, writes bench/results/planner_ablation.md
    python bench/planner_ablation.py --quick  # Gemma-3-27B on h100x32 only, stdout only

For each setting the same plan space is searched four ways, side by side in one run:
  both        Pareto frontiers + branch-and-bound (the default planner)
  no-Pareto   SearchOptions(pareto=False)
  no-BnB      SearchOptions(bnb=False)       every frontier product goes to the simulator
  neither     pareto=False, bnb=False        every configuration product goes to the simulator
and the report gives simulator calls, complete candidates considered, owner configurations and
frontier sizes, seconds, the ratios no-Pareto/both (simulator calls), no-BnB/both (candidates),
neither/both (seconds, the speed-up of the two reductions together) and whether all four reach the
same optimum cost (they must: both reductions are exact over the grid).

Settings: Gemma-3-27B and Qwen3-Next-80B-A3B, each on h100x32 and on h100x32+a100x32 (the clusters of
bench/paper_eval.py), context 128K, TPOT SLO 100 ms (paper_eval's relaxed SLO).

Template restriction (said in the report): "neither" simulates every configuration product, about
2.5 ms per simulate() for a ~125-stage plan on the 2-core machine. On the full 256-template family it
does not finish in reasonable time: AFD alone took 106 s and CAD 74 s with branch-and-bound off on
Gemma h100x32 (29,000 simulator calls each), and the 6-24-cut templates with 3 owner slots are far
larger. So every mode searches the same subset, SearchOptions(only_templates=...): colocated and every
template with at most MAX_CUTS (default 2) cuts per partition block, i.e. the templates that cut only the
global-attention layer of each block (11 per model, 7 of them with an owner split: a template with
1 cut per block has no owner count k >= 2 that divides it and is skipped by the planner). At 128K and
100 ms these contain the full family's optimum in all four settings; the report checks this by also
running the default planner on the full family (`full family, both`). `--max-cuts 3` widens the
subset (about 5x slower on h100x32, too slow for the heterogeneous cluster in "neither").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from opweave.compiler.frontend import run_front_end
from opweave.compiler.inputs import plan_space
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.passes.search import SearchOptions, search
from opweave.passes.space import PlanSpace
from opweave.passes.templates import enumerate_templates

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RunClock, emit, git_commit, header_lines  # noqa: E402
from paper_eval import REPO, md_escape, table  # noqa: E402  (same table format)

DEFAULT_OUT = os.path.join(REPO, "bench", "results", "planner_ablation.md")
SETTINGS = (  # (model, label, cluster label, cluster)
    ("gemma-3-27b", "Gemma-3-27B", "H100", "h100x32"),
    ("gemma-3-27b", "Gemma-3-27B", "A100+H100", "h100x32+a100x32"),
    ("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B", "H100", "h100x32"),
    ("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B", "A100+H100", "h100x32+a100x32"),
)
CONTEXT = 131072
SLO_MS = 100.0
MODES = (("both", True, True), ("no-Pareto", False, True), ("no-BnB", True, False), ("neither", False, False))
PAPER = {  # summary §7.5 / Table 3
    "pareto": {"H100": 1.85, "A100+H100": 3.75},
    "bnb": "> 45x on each setup",
    "speedup": {"H100": 1.45, "A100+H100": 3.35},
}
REL_TOL = 1e-9


@dataclasses.dataclass
class ModeRun:
    mode: str
    seconds: float
    counters: dict
    cost: float | None
    template: str


def run_mode(space: PlanSpace, templates: tuple[str, ...] | None, pareto: bool, bnb: bool, mode: str) -> ModeRun:
    start = time.perf_counter()
    r = search(space, SearchOptions(templates="all", only_templates=templates, pareto=pareto, bnb=bnb))
    seconds = time.perf_counter() - start
    return ModeRun(mode=mode, seconds=seconds, counters=dataclasses.asdict(r.counters),
                   cost=r.best.cost if r.best else None, template=r.best.stage_plan.template.name if r.best else "-")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="Gemma-3-27B on h100x32 only; stdout only unless --out")
    ap.add_argument("--max-cuts", type=int, default=2, help="templates with at most this many cuts per block (default 2)")
    ap.add_argument("--out", help=f"markdown output (default {os.path.relpath(DEFAULT_OUT, REPO)}; none with --quick)")
    args = ap.parse_args(argv)
    out = args.out if args.out else (None if args.quick else DEFAULT_OUT)

    clock, commit = RunClock.start(), git_commit()
    catalog = load_catalog()
    settings = SETTINGS[:1] if args.quick else SETTINGS
    front_ends: dict = {}
    results = []   # (setting, subset names, {mode: ModeRun}, full ModeRun)
    for model, label, cl_label, spec in settings:
        if model not in front_ends:
            print(f"tracing {model} ...", file=sys.stderr, flush=True)
            front_ends[model] = run_front_end(model)
        fe = front_ends[model]
        subset = tuple(t.name for t in enumerate_templates(fe.blocks, "all") if t.num_cuts_per_block <= args.max_cuts)
        space = plan_space(fe.graph, fe.blocks, cluster=parse_cluster(spec, catalog), context=CONTEXT,
                           tpot_slo_s=SLO_MS / 1e3)
        runs = {}
        for mode, pareto, bnb in MODES:
            runs[mode] = run_mode(space, subset, pareto, bnb, mode)
            c = runs[mode].counters
            print(f"{model} {spec} {mode}: {runs[mode].seconds:.1f} s, {c['simulator_calls']} simulator calls, "
                  f"{c['candidates']} candidates, cost {runs[mode].cost}; elapsed {clock.elapsed():.0f} s",
                  file=sys.stderr, flush=True)
        full = run_mode(space, None, True, True, "full family, both")
        print(f"{model} {spec} full family, both: {full.seconds:.1f} s, cost {full.cost}", file=sys.stderr, flush=True)
        results.append(((model, label, cl_label, spec), subset, runs, full))

    # ---- report
    lines = ["## Setup", "",
             f"Context {CONTEXT // 1024}K, TPOT SLO {SLO_MS:g} ms, the default batch / microbatch / TP / replica grid. "
             f"Every mode searches the same template subset: colocated and the templates with at most {args.max_cuts} "
             "cut(s) per partition block (the full 256-template family is too slow for `neither`: with "
             "branch-and-bound off, AFD alone takes 106 s and CAD 74 s on Gemma-3-27B/h100x32; see the script's "
             "docstring). The last row of each setting runs the default planner on the full family, to check that "
             "the subset holds the full optimum. Times are wall times of the search() call, in one process, one "
             "after another.", ""]
    for (model, label, cl_label, spec), subset, runs, full in results:
        lines.append(f"- {label}, {spec}: {len(subset)} templates: " + ", ".join(f"`{md_escape(t)}`" for t in subset))
    lines.append("")

    rows = []
    for (model, label, cl_label, spec), subset, runs, full in results:
        for m in list(runs.values()) + [full]:
            c = m.counters
            rows.append([label, spec, m.mode, f"{c['templates']}", f"{c['stage_plans']:,}", f"{c['owner_configs']:,}",
                         f"{c['frontier_configs']:,}", f"{c['candidates']:,}", f"{c['simulator_calls']:,}",
                         f"{c['pruned_prefixes']:,}", f"{m.seconds:.2f}",
                         f"${m.cost:.4f}" if m.cost is not None else "none", f"`{md_escape(m.template)}`"])
    lines += ["## Counters", "",
              "owner configs = memory-feasible owner configurations built; frontier = those kept after Pareto "
              "(= owner configs without it); candidates = complete plans reached; pruned = DFS prefixes cut by the "
              "bounds.", "",
              table(["model", "cluster", "mode", "templates", "stage plans", "owner configs", "frontier", "candidates",
                     "simulator calls", "pruned", "seconds", "optimum $/Mtok", "optimum template"], rows), ""]

    why_rows = []
    for (model, label, cl_label, spec), subset, runs, full in results:
        c = runs["both"].counters
        why_rows.append([label, spec, f"{c['owner_configs'] - c['frontier_configs']:,} of {c['owner_configs']:,}",
                         f"{c['pruned_root_slo']:,} / {c['pruned_root_cost']:,}",
                         f"{c['pruned_slo']:,} / {c['pruned_cost']:,}", f"{c['over_capacity']:,}",
                         f"{c.get('unplaceable', 0):,}", f"{c['simulator_calls']:,}"])
    rows, checks, bad = [], [], []
    for (model, label, cl_label, spec), subset, runs, full in results:
        b, np_, nb, ne = (runs[k] for k in ("both", "no-Pareto", "no-BnB", "neither"))
        sc = lambda m: m.counters["simulator_calls"]      # noqa: E731
        cand = lambda m: m.counters["candidates"]         # noqa: E731
        kept = nb.counters["frontier_configs"] / nb.counters["owner_configs"]
        rows.append([label, cl_label, f"{spec}", f"{kept:.1%}",
                     f"{ratio(sc(np_), sc(b))} (paper {PAPER['pareto'][cl_label]:g}x)",
                     f"{ratio(sc(ne), sc(nb))}",
                     f"{ratio(cand(nb), cand(b))} (paper {PAPER['bnb']})",
                     f"{ratio(nb.seconds, b.seconds)}",
                     f"{ratio(ne.seconds, b.seconds)} (paper {PAPER['speedup'][cl_label]:g}x)"])
        costs = [m.cost for m in runs.values()]
        same = all(c is not None for c in costs) and max(costs) <= min(costs) * (1 + REL_TOL)
        in_subset = full.cost is not None and same and abs(full.cost - b.cost) <= b.cost * REL_TOL
        if not same:
            bad.append(f"{label} {spec}: optimum costs differ across modes: "
                       + ", ".join(f"{m.mode} {m.cost}" for m in runs.values()))
        checks.append(f"- {label}, {spec}: all four modes reach "
                      + (f"the same optimum, ${b.cost:.4f} (`{md_escape(b.template)}`)" if same else "**DIFFERENT optima**")
                      + "; the full family's optimum is "
                      + (f"${full.cost:.4f}" if full.cost is not None else "none")
                      + (" (the same: the subset holds it)." if in_subset else " (**not in the subset**).")
                      + f" Full-family search with both reductions: {full.seconds:.1f} s, "
                      f"{full.counters['simulator_calls']:,} simulator calls.")
    lines += ["## Ratios (measured side by side in this run)", "",
              "no-Pareto/both: simulator calls (with branch-and-bound on); neither/no-BnB: simulator calls with "
              "branch-and-bound off (Pareto's effect on the exhaustive product); no-BnB/both: candidates; "
              "no-BnB/both and neither/both: seconds (the speed-up of branch-and-bound alone and of both "
              "reductions together).", "",
              table(["model", "setup", "cluster", "Pareto keeps (no-BnB)", "no-Pareto/both sim calls", "neither/no-BnB sim calls",
                     "no-BnB/both candidates", "no-BnB/both time", "neither/both time"], rows), "",
              "Pareto keeps = frontier / owner configurations (no-BnB mode).", "",
              "## What each reduction removes, and why", "",
              "Counters of the default planner (`both`) on the subset; see `opweave/passes/owners.py` and "
              "`opweave/passes/search.py` for the rules.", "",
              table(["model", "cluster", "Pareto drops",
                     "root cuts: TPOT / cost", "prefix cuts: TPOT / cost", "over the cluster's GPUs",
                     "not placeable", "simulated"], why_rows), "",
              "- **Pareto** drops an owner configuration only for another of the same group shape (GPU type, TP "
              "degree, replicas) that is no slower, no dearer and sends no more: shapes are never compared, because "
              "which transfers stay inside a node comes from placing every owner, and another shape moves every "
              "owner placed after it (`opweave/passes/owners.py`). Within one shape the routed experts' layout "
              "varies: sliced over the group or expert-parallel (whole experts per GPU). Both take the same GPUs, "
              "cost the same and send the same rows; under uniform routing the expert-parallel one reads its whole "
              "experts in the grouped kernel's blocks (larger on a shard, which counts every routed pair) plus the "
              "busiest GPU's excess, so Pareto keeps whichever of the two is faster: the configurations it removes "
              "for Qwen3-Next (512 experts) are such twins, and Gemma-3 (no experts) loses none. Expert-parallel groups of whole nodes (TP 16, 32) have no sliced twin and stay. The "
              "paper's Pareto gains (1.85x, 3.75x) hold for dense models too, because it compares configurations "
              "across shapes, which is unsound here (above); here Pareto acts on models with routed experts.",
              "- **Branch-and-bound at the root** skips a (template, batch, microbatches) before building any "
              "owner when its stages at their fastest already exceed the SLO (TPOT cuts) or at their cheapest "
              "GPU-time cannot beat the incumbent (cost cuts); **in the DFS** it cuts a prefix of owner choices "
              "by the same two bounds with the chosen owners' real figures. These cuts are what make the search "
              "fast: most of the batch grid is far from the optimum's batch.",
              "- **Over the cluster's GPUs**: prefixes needing more GPUs of a type than the pool has. **Not "
              "placeable**: complete plans whose TP groups do not fit in the nodes.", "",
              "## Checks", "", *checks, ""]
    if bad:
        lines += ["**EXACTNESS VIOLATION** (a planner bug):", *[f"- {x}" for x in bad], ""]

    argv_shown = ["python", "bench/planner_ablation.py"] + (sys.argv[1:] if argv is None else argv)
    text = "\n".join(header_lines("OpWeave planner ablation (summary §7.5, Table 3)" + (" (quick)" if args.quick else ""),
                                  argv_shown, clock, commit)) + "\n" + "\n".join(lines)
    emit([text], out)
    if bad:
        print("EXACTNESS VIOLATION: the four modes disagree on the optimum:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
