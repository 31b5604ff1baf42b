"""Heterogeneous gain against the price ratio of two GPU types: Theorem 3.2's prediction vs the planner.

    python bench/price_sensitivity.py            # writes bench/results/price_sensitivity.md and one PNG per pair
    python bench/price_sensitivity.py --quick    # 3 ratios per pair, stdout only (smoke test)

For H100 + A100 and H100 + L40S, the second type's price per GPU-hour is set to `ratio` x the
H100's (catalog entry with `override_spec`; the catalog file is not edited) for each ratio of
`RATIOS` and for the predicted crossing ratio itself, and at each point:

  predicted  `opweave.cost.analysis.price_sweep`: G_het of the two types (Theorem 3.2 on the cost
             model's terms, each type on its ODS TP degree) and the crossing ratio
             where the cheaper homogeneous type changes (where G_het peaks);
  planner    `search` (the public API `bench/paper_eval.py` uses, default options) on the
             heterogeneous cluster and on the second type's homogeneous sub-cluster; the H100
             sub-cluster's plan does not depend on the second type's price, so it is planned once.
             Planner gain = the cheaper homogeneous plan's $/Mtoken / the heterogeneous plan's.

A homogeneous plan's cost is its price x GPU-seconds per token, so its optimum cannot move with
the price: the second type's homogeneous cost must scale exactly with the ratio (checked: the
report prints the largest deviation), and the planner's own crossing ratio is where it equals the
H100 plan's cost.

Model and context (defaults qwen3-32b at 8K, TPOT SLO 100 ms, 32 GPUs per type): a dense model
whose decode step is dominated by attention (the report prints by how much) that plans in a few
seconds per point. The report's first table gives the prediction for a few other settings so the
choice can be checked: the predicted peak G_het is largest when the memory-bound and GEMM sides
cost about the same, and falls towards 1 as attention dominates (longer contexts).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

from opweave.compiler.frontend import run_front_end
from opweave.compiler.inputs import plan_space
from opweave.cost.analysis import ods_choice, price_sweep, tp_scan
from opweave.hardware.catalog import get_gpu, load_catalog, override_spec
from opweave.hardware.cluster import parse_cluster
from opweave.passes.search import SearchOptions, search

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RunClock, emit, git_commit, header_lines  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "price_sensitivity.md")

FIRST = "h100"
SECONDS = ("a100", "l40s")
RATIOS = (0.1, 0.14, 0.2, 0.28, 0.4, 0.56, 0.8, 1.0, 1.4, 2.0)
"""Second type's price / the H100's: 0.1x to 2x, about x1.4 apart (the L40S's crossing lies near 0.2,
the A100's near 0.45 on the default model)."""
QUICK_RATIOS = (0.2, 0.5, 1.0)
CANDIDATES = (("gemma-3-27b", 8192), ("gemma-3-27b", 32768), ("llama-3.1-8b", 8192), ("llama-3.1-8b", 32768),
              ("llama-3.1-70b", 8192), ("qwen3-32b", 8192), ("qwen3-32b", 32768))
"""Settings whose prediction the report lists beside the chosen one (analysis only, no planning)."""
REL_TOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Plan:
    feasible: bool
    cost: float = math.nan          # $/Mtoken
    seconds: float = 0.0            # wall time of search()
    gpu_types: tuple[str, ...] = ()
    owners: str = ""
    template: str = ""
    note: str = ""


def plan(fe, spec: str, catalog, context: int, slo_s: float) -> Plan:
    cluster = parse_cluster(spec, catalog)
    start = time.perf_counter()
    result = search(plan_space(fe.graph, fe.blocks, cluster=cluster, context=context, tpot_slo_s=slo_s),
                    SearchOptions())
    seconds = time.perf_counter() - start
    b = result.best
    if b is None:
        return Plan(feasible=False, seconds=seconds, note=result.reason[:80])
    return Plan(feasible=True, cost=b.cost, seconds=seconds, gpu_types=tuple(sorted({o.gpu.name for o in b.owners})),
                owners=" + ".join(o.describe() for o in b.owners), template=b.stage_plan.template.name)


def priced(catalog, second: str, ratio: float):
    """The catalog with `second`'s price per GPU-hour at `ratio` x the first type's."""
    out = dict(catalog)
    out[second] = override_spec(catalog[second], {"price_per_hour": ratio * catalog[FIRST].price_per_hour},
                                f"price_sensitivity ratio {ratio:g}")
    return out


@dataclasses.dataclass
class Point:
    ratio: float
    predicted: float
    predicted_best: str
    het: Plan
    hom_second: Plan
    is_crossing: bool = False

    def best_hom(self, hom_first: Plan) -> float:
        costs = [p.cost for p in (hom_first, self.hom_second) if p.feasible]
        return min(costs) if costs else math.nan

    def gain(self, hom_first: Plan) -> float:
        return self.best_hom(hom_first) / self.het.cost if self.het.feasible else math.nan


def money(p: Plan) -> str:
    return f"${p.cost:.3f}" if p.feasible else f"infeasible ({p.note})"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def plot_pair(path: str, model: str, context: int, second: str, points: list[Point], hom_first: Plan,
              sweep_fine, crossing: float, planner_crossing: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(sweep_fine.ratios, sweep_fine.g_het, "-", color="k",
            label="predicted G_het (Theorem 3.2, cost-model terms)")
    xs = [p.ratio for p in points if p.het.feasible]
    ax.plot(xs, [p.gain(hom_first) for p in points if p.het.feasible], "o", color="tab:blue",
            label="planner: best homogeneous / heterogeneous plan")
    mixed = [p for p in points if p.het.feasible and len(p.het.gpu_types) > 1]
    if mixed:
        ax.plot([p.ratio for p in mixed], [p.gain(hom_first) for p in mixed], "o", mfc="none", mec="tab:red", ms=11,
                label="heterogeneous plan mixes both types")
    ax.axvline(crossing, color="k", linestyle=":", label=f"predicted crossing {crossing:.3g}")
    if planner_crossing is not None:
        ax.axvline(planner_crossing, color="tab:blue", linestyle="--",
                   label=f"planner's homogeneous crossing {planner_crossing:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel(f"{second} price / {FIRST} price (per GPU-hour)")
    ax.set_ylabel("gain")
    ax.set_title(f"{model} at {context // 1024}K: {FIRST} + {second}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def candidate_rows(catalog, skip: tuple[str, int]) -> tuple[list[list[str]], list[tuple[str, int, float, float]]]:
    """The prediction (analysis only) for the `CANDIDATES` settings: table rows, and per setting
    (model, context, memory-bound / GEMM cost on the first type, the highest peak G_het of the pairs)."""
    rows, graphs, figures = [], {}, []
    first = get_gpu(FIRST, catalog)
    for model, context in CANDIDATES:
        print(f"  predicting {model} at {context // 1024}K ...", file=sys.stderr, flush=True)
        if model not in graphs:
            graphs[model] = run_front_end(model).graph
        g = graphs[model]
        terms = ods_choice(tp_scan(g, first, context)).terms
        dominance = terms.memory_s / (terms.gemm_s + terms.comm_s)
        cells = [model + (" (chosen)" if (model, context) == skip else ""), f"{context // 1024}K", f"{dominance:.1f}"]
        peaks = []
        for second in SECONDS:
            s = price_sweep(g, context, first, get_gpu(second, catalog), [1.0])
            cells.append(f"{s.crossing_ratio:.3g} / {s.peak_g_het:.3f}")
            peaks.append(s.peak_g_het)
        rows.append(cells)
        figures.append((model, context, dominance, max(peaks)))
    return rows, figures


def why_line(figures: list[tuple[str, int, float, float]], chosen: tuple[str, int]) -> str:
    """How the chosen setting compares with the candidates at least as attention-dominated as it."""
    mine = next((f for f in figures if f[:2] == chosen), None)
    if mine is None:
        return "The chosen setting is not among the candidates."
    rivals = [f for f in figures if f[2] >= mine[2]]
    best = max(rivals, key=lambda f: f[3])
    if best[:2] == chosen:
        return (f"Why this setting: attention dominates (memory-bound side {mine[2]:.1f}x the GEMMs), and of the "
                f"candidates where it dominates at least as much it has the highest predicted peak G_het "
                f"({mine[3]:.3f}): the peak shrinks as attention dominates more.")
    return (f"Note: {best[0]} at {best[1] // 1024}K is at least as attention-dominated ({best[2]:.1f}x) and has a "
            f"higher predicted peak ({best[3]:.3f} vs {mine[3]:.3f}).")


@dataclasses.dataclass
class Context:
    """What every point of a run shares."""

    fe: object
    catalog: dict
    model: str
    context: int
    slo_s: float
    n: int                # GPUs per type
    hom_first: Plan       # the first type alone (its plan does not depend on the second's price)
    clock: RunClock


@dataclasses.dataclass
class Pair:
    second: str
    sweep: object         # PriceSweep over the planned ratios
    fine: object          # PriceSweep on a fine grid (the plot's curve)
    points: list[Point]

    @property
    def crossing(self) -> float:
        return self.sweep.crossing_ratio

    def unit_costs(self) -> list[float]:
        """The second type's homogeneous plan cost per unit price ratio at each point."""
        return [p.hom_second.cost / p.ratio for p in self.points if p.hom_second.feasible]

    def planner_crossing(self, hom_first: Plan) -> float | None:
        """Price ratio at which the planner's two homogeneous plans cost the same."""
        unit = self.unit_costs()
        return hom_first.cost / unit[0] if unit and hom_first.feasible else None


def sweep_pair(ctx: Context, second: str, ratios: tuple[float, ...]) -> Pair:
    """Plan every ratio of `ratios` and the predicted crossing for FIRST + `second`."""
    first, spec = get_gpu(FIRST, ctx.catalog), get_gpu(second, ctx.catalog)
    crossing = price_sweep(ctx.fe.graph, ctx.context, first, spec, ratios).crossing_ratio
    grid = sorted(set(ratios) | {crossing})
    sweep = price_sweep(ctx.fe.graph, ctx.context, first, spec, grid)
    points = []
    for r, g, best in zip(sweep.ratios, sweep.g_het, sweep.best_hom):
        cat = priced(ctx.catalog, second, r)
        het = plan(ctx.fe, f"{FIRST}x{ctx.n}+{second}x{ctx.n}", cat, ctx.context, ctx.slo_s)
        hom = plan(ctx.fe, f"{second}x{ctx.n}", cat, ctx.context, ctx.slo_s)
        p = Point(ratio=r, predicted=g, predicted_best=best, het=het, hom_second=hom, is_crossing=r == crossing)
        points.append(p)
        print(f"{FIRST}+{second} ratio {r:.3g}: predicted G_het {g:.3f}; het {money(het)} [{', '.join(het.gpu_types)}] "
              f"({het.seconds:.1f} s), {second} {money(hom)} ({hom.seconds:.1f} s), planner gain "
              f"{p.gain(ctx.hom_first):.3f}; elapsed {ctx.clock.elapsed():.0f} s", file=sys.stderr, flush=True)
    fine = price_sweep(ctx.fe.graph, ctx.context, first, spec,  # the peak (at the crossing) drawn exactly
                       sorted([grid[0] * (grid[-1] / grid[0]) ** (k / 200) for k in range(201)] + [crossing]))
    return Pair(second=second, sweep=sweep, fine=fine, points=points)


def pair_lines(ctx: Context, pair: Pair, png: str | None) -> list[str]:
    """The markdown section of one pair."""
    second, n, hom_first = pair.second, ctx.n, ctx.hom_first
    first_price = ctx.catalog[FIRST].price_per_hour
    rows = []
    for p in pair.points:
        label = f"**{p.ratio:.3g} (predicted crossing)**" if p.is_crossing else f"{p.ratio:.3g}"
        rows.append([label, f"${p.ratio * first_price:.2f}", f"{p.predicted:.3f}",
                     "tie" if p.is_crossing else p.predicted_best, money(p.het), money(p.hom_second),
                     f"{p.gain(hom_first):.3f}" if p.het.feasible else "-", ", ".join(p.het.gpu_types) or "-",
                     f"`{p.het.owners}`; `{p.het.template}`" if p.het.feasible else "-"])
    unit = pair.unit_costs()
    scale_dev = (max(unit) - min(unit)) / min(unit) if unit else math.nan
    planner_crossing = pair.planner_crossing(hom_first)
    scaling = ("(scales exactly, as it must)." if scale_dev <= REL_TOL
               else "(**should be 0: the planner's optimum moved with a price**).")
    lines = [f"## {FIRST.upper()} + {second.upper()}", "",
             f"Each type's group for the prediction: {FIRST} TP {pair.sweep.first_tp}, {second} TP "
             f"{pair.sweep.second_tp} (each type's ODS TP degree). Predicted crossing ratio "
             f"{pair.crossing:.4g} (peak predicted G_het {pair.sweep.peak_g_het:.4f}); the planner's homogeneous "
             "plans cross at " + (f"{planner_crossing:.4g}" if planner_crossing is not None
                                  else "- (a homogeneous plan is infeasible)")
             + f". {FIRST}x{n} alone: {money(hom_first)} (`{hom_first.owners}`; `{hom_first.template}`). "
             f"{second}x{n} cost / ratio varies by {scale_dev:.2e} (relative) over the sweep {scaling}", "",
             *table(["ratio", f"{second} $/h", "predicted G_het", "cheaper homogeneous (predicted)",
                     f"heterogeneous plan {FIRST}x{n}+{second}x{n}", f"{second}x{n} plan", "planner gain",
                     "GPU types used", "heterogeneous plan"], rows), ""]
    if png:
        lines += [f"![{FIRST} + {second}]({os.path.basename(png)})", ""]
    mixed = [p for p in pair.points if p.het.feasible and len(p.het.gpu_types) > 1]
    top = max(mixed, key=lambda p: p.gain(hom_first)) if mixed else None
    lines += [f"Heterogeneous plans mixing both types: {len(mixed)} of {len(pair.points)}"
              + (f" (ratios {', '.join(f'{p.ratio:.3g}' for p in mixed)}; largest planner gain "
                 f"{top.gain(hom_first):.3f} at ratio {top.ratio:.3g})." if top else "."), ""]
    return lines


def intro_lines(ctx: Context, pairs: list[Pair], slo_ms: float, candidates: bool) -> list[str]:
    first = get_gpu(FIRST, ctx.catalog)
    terms = ods_choice(tp_scan(ctx.fe.graph, first, ctx.context)).terms
    lines = ["## Setting", "",
             f"Model {ctx.model}, context {ctx.context}, TPOT SLO {slo_ms:g} ms, {ctx.n} GPUs per type; "
             f"{FIRST} at the catalog's ${first.price_per_hour:.2f}/h, the second type's price = ratio x that. "
             f"On the {FIRST} (TP {terms.tp}) the memory-bound ops cost "
             f"{terms.memory_s / (terms.gemm_s + terms.comm_s):.1f}x the GEMMs per token. Predicted: "
             "`opweave.cost.analysis.price_sweep`; planner: `search` with default options; planner gain = cheaper "
             "homogeneous plan / heterogeneous plan (1.000 when the heterogeneous plan uses one type). See the "
             "script's docstring for the method.", ""]
    if not candidates:
        return lines
    print("predictions for other settings ...", file=sys.stderr, flush=True)
    rows, figures = candidate_rows(ctx.catalog, (ctx.model, ctx.context))
    het_seconds = [p.het.seconds for pair in pairs for p in pair.points]
    return lines + [
        "Prediction for other settings (analysis only): memory-bound / GEMM cost per token on the "
        f"{FIRST} at its ODS TP degree, and per second type the predicted crossing ratio / peak G_het.", "",
        *table(["model", "context", "memory-bound / GEMM", f"{SECONDS[0]}: crossing / peak",
                f"{SECONDS[1]}: crossing / peak"], rows), "",
        why_line(figures, (ctx.model, ctx.context)) + " Planning time of the heterogeneous searches here: mean "
        f"{statistics.fmean(het_seconds):.1f} s, max {max(het_seconds):.1f} s (Gemma-3-27B's take 25-38 s each at "
        "8K-32K in `bench/results/paper_eval.md`, too slow for this sweep's budget of 10 minutes on 2 cores).", ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-32b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--slo-ms", type=float, default=100.0)
    ap.add_argument("--gpus-per-type", type=int, default=32)
    ap.add_argument("--quick", action="store_true",
                    help=f"ratios {QUICK_RATIOS}, no candidates table; prints, writes no file unless --out")
    ap.add_argument("--out", help=f"markdown output (default {os.path.relpath(DEFAULT_OUT, REPO)}; none with --quick)")
    args = ap.parse_args(argv)
    out = args.out if args.out else (None if args.quick else DEFAULT_OUT)

    clock, commit = RunClock.start(), git_commit()
    catalog = load_catalog()
    print(f"tracing {args.model} ...", file=sys.stderr, flush=True)
    fe = run_front_end(args.model)
    n, slo_s = args.gpus_per_type, args.slo_ms / 1e3
    hom_first = plan(fe, f"{FIRST}x{n}", catalog, args.context, slo_s)
    print(f"{FIRST}x{n}: {money(hom_first)} ({hom_first.seconds:.1f} s)", file=sys.stderr, flush=True)
    ctx = Context(fe=fe, catalog=catalog, model=args.model, context=args.context, slo_s=slo_s, n=n,
                  hom_first=hom_first, clock=clock)

    body: list[str] = []
    pairs = []
    for second in SECONDS:
        pair = sweep_pair(ctx, second, QUICK_RATIOS if args.quick else RATIOS)
        pairs.append(pair)
        png = None
        if out:
            png = os.path.join(os.path.dirname(os.path.abspath(out)), f"price_sensitivity_{FIRST}_{second}.png")
            os.makedirs(os.path.dirname(png), exist_ok=True)
            plot_pair(png, args.model, args.context, second, pair.points, hom_first, pair.fine, pair.crossing,
                      pair.planner_crossing(hom_first))
            print(f"wrote {png}", file=sys.stderr)
        body += pair_lines(ctx, pair, png)
    intro = intro_lines(ctx, pairs, args.slo_ms, candidates=not args.quick)
    argv_shown = ["python", "bench/price_sensitivity.py"] + (sys.argv[1:] if argv is None else argv)
    text = "\n".join(header_lines("Heterogeneous gain vs GPU price ratio (Theorem 3.2 vs the planner)"
                                  + (" (quick)" if args.quick else ""), argv_shown, clock, commit))
    emit([text + "\n" + "\n".join(intro + body)], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
