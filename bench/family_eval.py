"""The §7-style comparison for any built-in models: OpWeave vs colocated, AFD and CAD on an H100
cluster and an H100+H200 cluster, plus `opweave analyze` per model.

    python bench/family_eval.py                                  # gpt-oss-120b, gpt-oss-20b
    python bench/family_eval.py --models deepseek-v3,kimi-k2 --out bench/results/family_eval_dsv3.md
    python bench/family_eval.py --quick                          # 8K on H100 only, stdout only

Grid per model: 2 clusters (h100x32, h100x32+h200x32) x 2 contexts (8K, 32K) x 4 systems, at one
TPOT SLO per model. The systems are bench/paper_eval.py's (its `plan_one`: the same search, Pareto
and branch-and-bound on, differing only in the template family: OpWeave = all templates,
colocated, AFD, CAD).

SLO, chosen by probing (`probe_slo`): the tightest value of `SLO_LADDER_MS` at which all four
systems find a plan on the H100 cluster at the longest context (the hardest setting of the grid:
the most state per sequence, one GPU type), found by bisection over the ladder; `--slo
model=ms,...` fixes it instead. Tighter SLOs leave some baselines without a plan (OpWeave's
tightest feasible SLO is colocated's too, at this grid's contexts: a single stage has the fewest
hops), looser ones stop binding; elsewhere in the grid a system that cannot meet the SLO is
reported infeasible with the closest TPOT its search simulated.

The report checks that OpWeave's cost is at most every feasible baseline's (they are in its search
space) and that OpWeave on H100+H200 costs at most OpWeave on H100 alone (a sub-cluster), and exits
1 on a violation.
"""

from __future__ import annotations

import argparse
import os
import sys

from opweave.cli.costs import planner_splits
from opweave.compiler.frontend import run_front_end
from opweave.cost.analysis import TP_SCAN, analyze
from opweave.cost.report import format_analysis
from opweave.cost.split import SplitLimits
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.models.registry import builtin_names
from opweave.passes.search import DEFAULT_MAX_BATCH, SearchOptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RunClock, emit, git_commit, header_lines  # noqa: E402
from paper_eval import (REL_TOL, SYSTEM_LABEL, SYSTEMS, Run, ctx_text, kb, md_escape, money, num,  # noqa: E402
                        plan_one, table)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "family_eval.md")
DEFAULT_MODELS = ("gpt-oss-120b", "gpt-oss-20b")
CONTEXTS = (8192, 32768)
CLUSTERS = (("H100", "h100x32"), ("H100+H200", "h100x32+h200x32"))
SLO_LADDER_MS = (4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0, 200.0)
"""Round TPOT SLOs the probe picks from (ms)."""
ANALYZE_GPUS = ("h100", "h200")


def parse_models(text: str) -> list[str]:
    """Comma-separated built-in model names; an unknown one is a one-line error."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    known = builtin_names()
    bad = [m for m in models if m not in known]
    if not models or bad:
        raise OpWeaveError(f"--models: unknown built-in model {', '.join(bad) or '(none given)'} "
                           f"(built-in: {', '.join(known)})")
    return models


def parse_slos(text: str | None, models: list[str]) -> dict[str, float]:
    """`model=ms,...` -> {model: ms}; every name must be one of `models`."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, value = part.partition("=")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in models or ms <= 0:
            raise OpWeaveError(f"--slo: expected model=ms with a model of --models and ms > 0, got '{part}'")
        out[name] = ms
    return out


def parse_clusters(text: str) -> tuple[tuple[str, str], ...]:
    """`label=spec,...` -> ((label, spec), ...); a malformed entry is a one-line error."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        label, sep, spec = part.partition("=")
        if not sep or not label or not spec:
            raise OpWeaveError(f"--clusters: expected label=spec, got '{part}'")
        out.append((label, spec))
    return tuple(out)


def probe_slo(feasible_at) -> tuple[float | None, list[tuple[float, bool]]]:
    """The tightest ladder SLO at which `feasible_at(slo_ms)` holds, by bisection over
    `SLO_LADDER_MS` (feasibility is monotone in the SLO); None when even the loosest fails.
    Returns (slo, the probes made as (slo, feasible))."""
    probes: list[tuple[float, bool]] = []
    lo, hi = 0, len(SLO_LADDER_MS) - 1
    if not feasible_at(SLO_LADDER_MS[hi]):
        return None, [(SLO_LADDER_MS[hi], False)]
    probes.append((SLO_LADDER_MS[hi], True))
    while lo < hi:
        mid = (lo + hi) // 2
        ok = feasible_at(SLO_LADDER_MS[mid])
        probes.append((SLO_LADDER_MS[mid], ok))
        if ok:
            hi = mid
        else:
            lo = mid + 1
    return SLO_LADDER_MS[hi], probes


def model_section(model: str, fe, slo_ms: float, probes, runs: dict, contexts, clusters,
                  analyze_gpus=ANALYZE_GPUS) -> tuple[list[str], list[str]]:
    """Markdown of one model's grid and the invariant violations found in it."""
    lines = [f"## {model}", ""]
    if probes:
        lines.append(f"SLO {slo_ms:g} ms: the tightest of the ladder at which all four systems are feasible on "
                     f"{clusters[0][1]} at {ctx_text(contexts[-1])}; probes: "
                     + ", ".join(f"{s:g} ms {'all feasible' if ok else 'not all feasible'}" for s, ok in probes) + ".")
    else:
        lines.append(f"SLO {slo_ms:g} ms (given with --slo).")
    lines.append("")
    header = ["cluster", "context"] + [f"{SYSTEM_LABEL[s]} $/Mtok" for s in SYSTEMS] + \
        ["gain", "OpWeave template", "OpWeave owners", "TPOT ms", "stages", "kB/token inter-node"]
    rows, violations = [], []
    for label, spec in clusters:
        for context in contexts:
            r = {s: runs[(model, spec, context, s)] for s in SYSTEMS}
            ow = r["opweave"]
            feasible = [r[s].cost for s in SYSTEMS[1:] if r[s].feasible]
            gain = min(feasible) / ow.cost if feasible and ow.feasible else None
            for s in SYSTEMS[1:]:
                if r[s].feasible and (not ow.feasible or ow.cost > r[s].cost * (1 + REL_TOL)):
                    violations.append(f"{model} {spec} {ctx_text(context)}: OpWeave {money(ow)} > {s} {money(r[s])}")
            rows.append([label, ctx_text(context)] + [money(r[s]) for s in SYSTEMS]
                        + [num(gain, ".2f") + ("x" if gain else ""), f"`{md_escape(ow.template)}`" if ow.feasible else "-",
                           ow.owners or "-", num(ow.tpot_ms, ".1f"), str(ow.stages) if ow.feasible else "-", kb(ow)])
    lines += [table(header, rows), ""]
    het = []
    for context in contexts if len(clusters) > 1 else ():
        homog, mixed = (runs[(model, spec, context, "opweave")] for _, spec in clusters[:2])
        if homog.feasible and mixed.feasible:
            het.append(f"{ctx_text(context)} {homog.cost / mixed.cost:.3f}x")
            if mixed.cost > homog.cost * (1 + REL_TOL):
                violations.append(f"{model} {ctx_text(context)}: OpWeave on {clusters[1][1]} {money(mixed)} > "
                                  f"on {clusters[0][1]} {money(homog)}")
    if het:
        lines += [f"Heterogeneous gain (OpWeave on {clusters[0][1]} / on {clusters[1][1]}): " + ", ".join(het) + ".", ""]
    seconds = [runs[k].seconds for k in runs if k[0] == model]
    lines += [f"Planning time: {sum(seconds):.0f} s for {len(seconds)} searches (max {max(seconds):.1f} s).", ""]
    gpus = [load_catalog_gpu(g) for g in analyze_gpus]
    grid = SearchOptions()  # as `opweave analyze --tpot-slo`: the bound covers the search's own grid
    limits = SplitLimits(tpot_slo_s=slo_ms / 1e3, microbatches=grid.microbatches, max_rows=DEFAULT_MAX_BATCH,
                         max_replicas=max(grid.replicas), tp_degrees=TP_SCAN)
    result = analyze(fe.graph, gpus, list(contexts), limits=limits,
                     splits=planner_splits(fe) if len(gpus) >= 2 else ())
    lines += [f"`opweave analyze {model} --gpus {','.join(analyze_gpus)} --context "
              f"{','.join(ctx_text(c).lower() for c in contexts)} --tpot-slo {slo_ms:g}ms`:", "", "```",
              format_analysis(result), "```", ""]
    return lines, violations


def load_catalog_gpu(name: str):
    return load_catalog()[name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="built-in model names, comma-separated")
    ap.add_argument("--slo", default=None, help="model=ms,... : fix a model's TPOT SLO instead of probing it")
    ap.add_argument("--clusters", default=None,
                    help="label=spec,... : the clusters (default " + ",".join(f"{l}={c}" for l, c in CLUSTERS)
                    + "); the first is where the SLO is probed, and OpWeave on the second must cost at most on "
                    "the first when the first is a sub-cluster of it")
    ap.add_argument("--analyze-gpus", default=",".join(ANALYZE_GPUS), help="GPU types for `opweave analyze`")
    ap.add_argument("--quick", action="store_true", help="8K on the H100 cluster only; prints, writes no file unless --out")
    ap.add_argument("--out", help=f"markdown output (default {os.path.relpath(DEFAULT_OUT, REPO)}; none with --quick)")
    args = ap.parse_args(argv)
    try:
        models = parse_models(args.models)
        slos = parse_slos(args.slo, models)
        all_clusters = parse_clusters(args.clusters) if args.clusters else CLUSTERS
        analyze_gpus = tuple(g.strip() for g in args.analyze_gpus.split(",") if g.strip())
    except OpWeaveError as err:
        print(f"family_eval: error: {err}", file=sys.stderr)
        return 2
    out = args.out if args.out else (None if args.quick else DEFAULT_OUT)
    contexts = CONTEXTS[:1] if args.quick else CONTEXTS
    clusters = all_clusters[:1] if args.quick else all_clusters
    clock, commit = RunClock.start(), git_commit()
    catalog = load_catalog()
    parsed = {spec: parse_cluster(spec, catalog) for _, spec in clusters}
    runs: dict[tuple, Run] = {}

    def run(model, fe, spec, context, slo_ms, system) -> Run:
        key = (model, spec, context, system, slo_ms)
        if key not in runs:
            runs[key] = plan_one(fe, parsed[spec], context, slo_ms, system)
        return runs[key]

    body, violations = [], []
    for model in models:
        print(f"tracing {model} ...", file=sys.stderr, flush=True)
        fe = run_front_end(model)
        hard = (clusters[0][1], contexts[-1])
        probes = []
        if model in slos:
            slo_ms = slos[model]
        else:
            order = ("colocated", "afd", "cad", "opweave")  # the cheap searches first: all() stops at a failure
            slo_ms, probes = probe_slo(lambda ms: all(run(model, fe, *hard, ms, s).feasible for s in order))
            if slo_ms is None:
                body += [f"## {model}", "", f"No plan meets even {SLO_LADDER_MS[-1]:g} ms on {hard[0]}.", ""]
                continue
        grid = {}
        for _, spec in clusters:
            for context in contexts:
                for system in SYSTEMS:
                    grid[(model, spec, context, system)] = r = run(model, fe, spec, context, slo_ms, system)
                print(f"{model} {spec} {ctx_text(context)} SLO {slo_ms:g} ms: "
                      + ", ".join(f"{SYSTEM_LABEL[s]} {money(grid[(model, spec, context, s)])}" for s in SYSTEMS)
                      + f" (last {r.seconds:.1f} s); elapsed {clock.elapsed():.0f} s", file=sys.stderr, flush=True)
        lines, bad = model_section(model, fe, slo_ms, probes, grid, contexts, clusters, analyze_gpus)
        body += lines
        violations += bad
    argv_shown = ["python", "bench/family_eval.py"] + (sys.argv[1:] if argv is None else argv)
    intro = ["OpWeave vs colocated, AFD and CAD per model (bench/family_eval.py's docstring says how the SLO is "
             "probed); $/Mtoken per replica set on the calibrated catalog at its default (AWS) prices; gain = the "
             "cheapest feasible baseline / OpWeave.", ""]
    emit(header_lines("Model-family evaluation" + (" (quick)" if args.quick else ""), argv_shown, clock, commit)
         + intro + body, out)
    for v in violations:
        print(f"INVARIANT VIOLATION: {v}", file=sys.stderr)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
