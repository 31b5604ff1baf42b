"""Printing, JSON and plotting of an `Analysis` (what `opweave analyze` shows)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from opweave.cost.analysis import Analysis
from opweave.ir.graph import human_bytes
from opweave.outputs import atomic_file, check_output_file


def context_label(s: float) -> str:
    return f"{s / 1024:g}k" if s >= 1024 and s % 1024 == 0 else f"{s:g}"


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:.3g}"


def _num(x: float | None, fmt: str = ".3g") -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else format(x, fmt)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    return out + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


FIGURES_NOTE = ("colocated: the cost model (fixed costs and TP collectives included) at the memory-limited batch "
                "b_max, on the TP degree (tp) with the least cost per token in the TP scan; hom-ODS: the cost "
                "model's marginal cost per token, on the TP degree where it is least (ODS tp); G_hom = colocated / "
                "hom-ODS; closed: Theorem 3.1's closed form on the colocated group alone (b_rel, no fixed costs); "
                "bound(closed): M / (M - M_w) on that group, Theorem 3.1's bound on `closed` (not on G_hom)")
"""Which figure each column reports (the closed form and the cost model differ: docs/analysis.md)."""

ABOVE_BOUND_NOTE = ("* G_hom (cost model) above bound(closed), which bounds only the closed form: the colocated cost "
                    "counts the step's fixed costs (per-step and launch overheads) and the TP collectives, which the "
                    "closed form leaves out and the ideal hom-ODS amortises away, and hom-ODS runs on its own TP "
                    "degree; they weigh less as the state read grows with the context, so G_hom falls towards "
                    "`closed` as the context grows")

SPLIT_NOTE = ("G_het ideal: Theorem 3.2 (memory-bound ops on the type cheapest for them, GEMMs on the type "
              "cheapest for them, marginal costs only: no network, no memory limit). split >=: the least $/Mtoken "
              "a plan of {templates} with its two owners on the two GPU types can reach (attention owner | the "
              "other), paying the activations that cross the NICs at every boundary (the planner's network model), "
              "the attention owner's memory holding the KV cache, each owner's weights, {slo} and the planner's "
              "grid. G_het = best hom-ODS / split >= (at most G_het ideal); vs colocated = the cheapest colocated / "
              "split >= (below 1: the split loses to colocated serving); binds: what keeps the split above the "
              "ideal (network, memory, SLO, replicas: lifting it lowers the bound; else bandwidth or compute: the "
              "cost model's step at the rows the bound runs)")
"""What the heterogeneous table's columns report (docs/analysis.md, "What a plan can reach")."""


def _templates(a: Analysis) -> str:
    return " or ".join(dict.fromkeys(t for t in a.templates)) or "no template"


def _slo_text(slo_s: float) -> str:
    return "no TPOT SLO (give --tpot-slo)" if math.isinf(slo_s) else f"the TPOT SLO of {slo_s * 1e3:g} ms"


def _g_hom(g) -> str:
    """G_hom (cost model), marked when above the closed form's bound (`ABOVE_BOUND_NOTE`)."""
    text = _num(g.g_hom)
    return text + "*" if g.g_hom is not None and g.g_hom > g.g_hom_bound else text


def _same_text(p) -> str:
    same = p.split_same
    if same is None or not same.feasible:
        return ""
    return f"; one type on both sides: {same.describe()} >= {_money(same.cost_per_token * 1e6)}"


def _split_rows(a: Analysis) -> tuple[list[tuple[str, ...]], list[str]]:
    """The heterogeneous table's rows and, per context, where the split's bound is."""
    rows, notes = [], []
    for p in a.points:
        sp = p.split
        rows.append((context_label(p.context), p.het_attention_gpu, p.het_gemm_gpu, _money(p.cost_het_ods),
                     _money(min(g.cost_hom_ods for g in p.gpus)), _num(p.g_het_ideal), sp.describe(),
                     _money(p.cost_split) if p.cost_split is not None else "none fits", _num(p.g_het),
                     _money(p.cost_colocated_best), _num(p.g_het_vs_colocated), ", ".join(sp.binds) or "-"))
        if not sp.feasible:
            notes.append(f"{context_label(p.context)}: {sp.reason}{_same_text(p)}")
            continue
        t = {k: f"{v * 1e3:.3g}" for k, v in sp.terms_s.items()}
        notes.append(f"{context_label(p.context)}: {sp.describe()}: {sp.attention_rows} sequences per attention "
                     f"replica (its memory holds {sp.attention_rows_max}), {sp.rest_rows} per replica of the other, "
                     f"{sp.microbatches} microbatch(es); TPOT >= {sp.tpot_s * 1e3:.3g} ms (attention owner "
                     f"{t['attention_s']}, other {t['rest_s']}, links {t['attention_link_s']} / "
                     f"{t['rest_link_s']}, round trip {t['round_trip_s']} ms); "
                     f"{sp.network_bytes_per_token / 1e3:.4g} kB/token cross between the owners" + _same_text(p))
    return rows, notes


def format_analysis(a: Analysis) -> str:
    header = ("context", "state/seq", "gpu", "tp", "regime", "b_max", "b*", "colocated", "ODS tp", "hom-ODS",
              "G_hom", "closed", "bound(closed)", "CAD")
    rows = []
    for p in a.points:
        for g in p.gpus:
            rows.append((context_label(p.context), human_bytes(p.state_bytes), g.gpu, str(g.tp), g.regime,
                         str(g.b_max), f"{g.b_star:.0f}", _money(g.cost_colocated), str(g.ods_tp),
                         _money(g.cost_hom_ods),
                         _g_hom(g), _num(g.g_hom_closed), _num(g.g_hom_bound), "yes" if g.cad_feasible else "no"))
    lines = [f"Decode cost analysis of {a.model} on {', '.join(a.gpu_names)} ($ per million output tokens)",
             FIGURES_NOTE]
    lines += _table(header, rows)
    scan_header = ("context", "gpu", "tp", "b_max", "colocated", "hom-ODS", "G_hom", "closed", "bound(closed)",
                   "chosen")
    scan_rows = [(context_label(p.context), g.gpu, str(t.tp), str(t.b_max), _money(t.cost_colocated),
                  _money(t.cost_hom_ods), _g_hom(t), _num(t.g_hom_closed), _num(t.g_hom_bound),
                  " ".join(m for m, on in (("<- colocated", t.tp == g.tp and g.cost_colocated is not None),
                                           ("<- ODS", t.tp == g.ods_tp)) if on))
                 for p in a.points for g in p.gpus for t in g.tp_scan]
    lines += ["", "TP scan (per TP degree: colocated at its memory-limited batch b_max, hom-ODS on that degree; "
                  "G_hom against the least hom-ODS of the scan)"]
    lines += _table(scan_header, scan_rows)
    if any(r[10].endswith("*") for r in rows) or any(r[6].endswith("*") for r in scan_rows):
        lines.append(ABOVE_BOUND_NOTE)
    if a.points[0].g_het_ideal is not None and a.points[0].split is None:
        het_rows = [(context_label(p.context), p.het_attention_gpu, p.het_gemm_gpu, _money(p.cost_het_ods),
                     _money(min(g.cost_hom_ods for g in p.gpus)), _num(p.g_het_ideal)) for p in a.points]
        lines += ["", "Heterogeneous ODS, ideal only (Theorem 3.2: marginal costs, no network, no memory limit; "
                      "no split was bounded)"]
        lines += _table(("context", "attention on", "GEMM on", "het-ODS", "best hom-ODS", "G_het ideal"), het_rows)
    if a.points[0].split is not None:
        het_header = ("context", "attention on", "GEMM on", "het-ODS", "best hom-ODS", "G_het ideal",
                      "split (attention | other)", "split >=", "G_het", "colocated", "vs colocated", "binds")
        het_rows, notes = _split_rows(a)
        lines += ["", "Heterogeneous ODS: ideal, and what a plan of the attention / rest split can reach",
                  SPLIT_NOTE.format(slo=_slo_text(a.limits.tpot_slo_s), templates=_templates(a))]
        lines += _table(het_header, het_rows)
        lines += notes
    lines.append("")
    if a.crossing_context is not None:
        lines.append(f"cheapest homogeneous-ODS GPU type changes at s ~ {a.crossing_context:,.0f} tokens "
                     "(where G_het ideal peaks)")
    elif len(a.gpu_names) >= 2:
        lines.append("the cheapest homogeneous-ODS GPU type is the same over the whole range (no crossing inside it)")
    last = a.points[-1]
    for g in last.gpus:
        lines.append(f"CAD on {g.gpu} at {context_label(last.context)}: {g.cad_reason}")
    if a.hybrid_note:
        lines.append(a.hybrid_note)
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SearchedPlan:
    """What `opweave compile`'s search found at one context (`opweave analyze --plan` fills it in)."""

    context: int
    cost: float | None = None             # $/Mtoken of the best plan (None: no plan meets the SLO)
    plan: str = ""                        # e.g. "cad: hbm tp1 x3 + flop tp4 x1"
    gpu_types: tuple[str, ...] = ()       # the GPU types its owners use
    colocated_cost: float | None = None   # $/Mtoken of the best colocated plan (the same search, colocated only)
    colocated_plan: str = ""
    error: str = ""                       # why there is no plan (one line)

    @property
    def gain(self) -> float | None:
        """The best plan's gain over colocated serving."""
        if self.cost is None or self.colocated_cost is None:
            return None
        return self.colocated_cost / self.cost


PLAN_TOLERANCE = 0.2
"""The bound should be within this fraction of the searched gain, or the output says why not."""


def compare_plan(p, searched: SearchedPlan, templates: tuple[str, ...] = ()) -> dict[str, Any]:
    """The searched gain beside the split's bound at one context (`p`, a `ContextPoint`): the bound
    is the searched colocated cost over the split's (below 1: the split loses to colocated, and the
    search's gain should be 1), and a verdict: whether they agree within `PLAN_TOLERANCE`, why not
    when they do not, and why the gain is above the bound whenever it is. `templates`: the splits
    the bound covers (`Analysis.templates`)."""
    gain = searched.gain
    bound = None if p.cost_split is None or searched.colocated_cost is None else searched.colocated_cost / p.cost_split
    binds = ", ".join(p.split.binds) or "nothing"
    out = {"context": p.context, "gain": gain, "bound": bound, "binds": list(p.split.binds)}
    if gain is None:
        return out | {"verdict": f"no comparison: {searched.error or 'no colocated plan meets the SLO'}"}
    expected = max(1.0, bound or 0.0)
    close = abs(expected - gain) <= PLAN_TOLERANCE * gain
    head = f"within {PLAN_TOLERANCE:.0%}" if close else f"not within {PLAN_TOLERANCE:.0%}"
    loses = (f"the split across GPU types cannot beat colocated serving ({binds} binds), so the search's gain "
             "should be 1" if bound is None or bound < 1 else "")
    if gain > expected * (1 + 1e-6):  # above the bound: say why, close or not
        if len(searched.gpu_types) < 2:
            same = p.split_same
            hom = (f" (one type on both owners the split is >= {_money(same.cost_per_token * 1e6)}, a gain <= "
                   f"{searched.colocated_cost / (same.cost_per_token * 1e6):.3g})"
                   if same is not None and same.feasible else "")
            why = f"the best plan runs on {searched.gpu_types[0]} alone, which the two-type bound does not cover{hom}"
        else:
            why = (f"the best plan ({searched.plan}) is not a two-owner {' or '.join(templates) or 'bounded'} split, "
                   "which is all the bound covers")
        verdict = f"{head}, above the bound: {why}" + (f"; {loses}" if loses else "")
    elif close:
        verdict = head + (f": {loses}" if loses else f" ({binds} binds)")
    else:
        verdict = (f"{head}: the search stays below the bound; {binds} binds at the bound's optimum, and the bound "
                   "relaxes the plan space (any replica ratio up to the grid's, rows on a fine grid, no placement)")
    return out | {"verdict": verdict}


def format_searched(a: Analysis, searched: list[SearchedPlan], cluster: str) -> str:
    """`opweave analyze --plan`'s table: per context the best plan, the best colocated plan, the
    gain, the split's bound on it and the verdict."""
    header = ("context", "best plan", "$/Mtoken", "colocated plan", "$/Mtoken", "gain", "bound", "binds")
    rows, verdicts = [], []
    for p, sp in zip(a.points, searched):
        c = compare_plan(p, sp, a.templates)
        rows.append((context_label(p.context), sp.plan or "-", _money(sp.cost), sp.colocated_plan or "-",
                     _money(sp.colocated_cost), _num(c["gain"]), _num(c["bound"]), ", ".join(c["binds"]) or "-"))
        verdicts.append(f"{context_label(p.context)}: {c['verdict']}")
    lines = ["", f"Searched plans (opweave compile's search on {cluster}, {_slo_text(a.limits.tpot_slo_s)}): gain = "
                 "the best colocated plan's $/Mtoken over the best plan's; bound = the best colocated plan's over "
                 "split >= (the most the split across GPU types can gain)"]
    return "\n".join(lines + _table(header, rows) + verdicts)


def searched_to_json(a: Analysis, searched: list[SearchedPlan], cluster: str) -> dict[str, Any]:
    """`opweave analyze --plan --format json`'s `searched`: per context the `SearchedPlan` and `compare_plan`."""
    return _clean({"cluster": cluster, "tpot_slo_s": a.limits.tpot_slo_s,
                   "points": [dataclasses.asdict(sp) | {"gpu_types": list(sp.gpu_types)}
                              | compare_plan(p, sp, a.templates) for p, sp in zip(a.points, searched)]})


def _clean(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def analysis_to_json(a: Analysis) -> dict[str, Any]:
    """Per context: the first GPU type's figures at top level, every type under `gpus` (with its
    `tp_scan` and each scanned TP's cost-model `terms`), and with two or more types heterogeneous
    ODS (`g_het_ideal`, the `split` a plan can reach, `g_het`, `g_het_vs_colocated`); `figures` and
    `split_figures` say which figure each key reports."""
    points = []
    for p in a.points:
        first = p.gpus[0]
        entry = {"context": p.context, "state_bytes": p.state_bytes, "tp": first.tp, "ods_tp": first.ods_tp,
                 "b_max": first.b_max,
                 "b_rel": first.b_rel, "b_star": first.b_star, "regime": first.regime, "g_hom": first.g_hom,
                 "g_hom_closed": first.g_hom_closed, "g_hom_bound": first.g_hom_bound,
                 "cost_colocated_per_mtok": first.cost_colocated,
                 "cost_colocated_closed_per_mtok": first.cost_colocated_closed,
                 "cost_hom_ods_per_mtok": first.cost_hom_ods, "cad_feasible": first.cad_feasible,
                 "gpus": {g.gpu: dataclasses.asdict(g) for g in p.gpus}}
        if p.g_het_ideal is not None:
            entry.update(g_het_ideal=p.g_het_ideal, cost_het_ods_per_mtok=p.cost_het_ods,
                         het_attention_gpu=p.het_attention_gpu, het_gemm_gpu=p.het_gemm_gpu)
        if p.split is not None:
            entry.update(g_het=p.g_het, g_het_ideal=p.g_het_ideal, g_het_vs_colocated=p.g_het_vs_colocated,
                         cost_het_ods_per_mtok=p.cost_het_ods, cost_split_per_mtok=p.cost_split,
                         cost_colocated_best_per_mtok=p.cost_colocated_best,
                         het_attention_gpu=p.het_attention_gpu, het_gemm_gpu=p.het_gemm_gpu,
                         split=dataclasses.asdict(p.split) | {"binds": list(p.split.binds)},
                         split_same=dataclasses.asdict(p.split_same) | {"binds": list(p.split_same.binds)})
        points.append(entry)
    out = {"model": a.model, "gpus": list(a.gpu_names), "figures": FIGURES_NOTE,
           "crossing_context": a.crossing_context, "hybrid_note": a.hybrid_note, "points": points}
    if a.points and a.points[0].split is not None:
        out.update(split_figures=SPLIT_NOTE.format(slo=_slo_text(a.limits.tpot_slo_s), templates=_templates(a)),
                   tpot_slo_s=a.limits.tpot_slo_s)
    return _clean(out)


def plot_analysis(a: Analysis, path: str) -> None:
    """Cost per Mtoken and gains against context length, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.context for p in a.points]
    fig, (ax_cost, ax_gain) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(a.gpu_names):
        col = [p.gpus[i].cost_colocated for p in a.points]
        ax_cost.plot(xs, [math.nan if c is None else c for c in col], "o-", label=f"colocated {name}")
        ax_cost.plot(xs, [p.gpus[i].cost_hom_ods for p in a.points], "s--", label=f"hom-ODS {name}")
        line, = ax_gain.plot(xs, [math.nan if p.gpus[i].g_hom is None else p.gpus[i].g_hom for p in a.points],
                             "o-", label=f"G_hom {name} (cost model)")
        ax_gain.plot(xs, [math.nan if p.gpus[i].g_hom_closed is None else p.gpus[i].g_hom_closed for p in a.points],
                     "x--", color=line.get_color(), label=f"G_hom {name} (closed form)")
        ax_gain.plot(xs, [p.gpus[i].g_hom_bound if math.isfinite(p.gpus[i].g_hom_bound) else math.nan
                          for p in a.points], ":", color=line.get_color(),
                     label=f"closed-form bound {name} (at its TP)")
    if a.points[0].split is not None:
        ax_cost.plot(xs, [p.cost_het_ods for p in a.points], "k^--", label="het-ODS ideal")
        ax_cost.plot(xs, [math.nan if p.cost_split is None else p.cost_split for p in a.points], "kv-",
                     label="split >= (network, memory)")
        ax_gain.plot(xs, [p.g_het_ideal for p in a.points], "k^--", label="G_het ideal")
        ax_gain.plot(xs, [math.nan if p.g_het is None else p.g_het for p in a.points], "kv-",
                     label="G_het (split, network + memory)")
        if a.crossing_context:
            ax_gain.axvline(a.crossing_context, color="k", linestyle=":", label="crossing")
    for ax, title, ylabel in ((ax_cost, "cost", "$ per million tokens"), (ax_gain, "gain", "ratio")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [context_label(x) for x in xs], rotation=45)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{a.model}: {title}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_cost.set_yscale("log")
    fig.tight_layout()
    try:
        check_output_file(path, "--plot")  # checked before the analysis too; the folder may have gone since
        with atomic_file(path, binary=True, flag="--plot") as f:
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)
