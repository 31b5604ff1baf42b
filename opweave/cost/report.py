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
                "bound: M / (M - M_w) on that group")
"""Which figure each column reports (the closed form and the cost model differ: docs/analysis.md)."""


def format_analysis(a: Analysis) -> str:
    header = ("context", "state/seq", "gpu", "tp", "regime", "b_max", "b*", "colocated", "ODS tp", "hom-ODS",
              "G_hom", "closed", "bound", "CAD")
    rows = []
    for p in a.points:
        for g in p.gpus:
            rows.append((context_label(p.context), human_bytes(p.state_bytes), g.gpu, str(g.tp), g.regime,
                         str(g.b_max), f"{g.b_star:.0f}", _money(g.cost_colocated), str(g.ods_tp),
                         _money(g.cost_hom_ods),
                         _num(g.g_hom), _num(g.g_hom_closed), _num(g.g_hom_bound), "yes" if g.cad_feasible else "no"))
    lines = [f"Decode cost analysis of {a.model} on {', '.join(a.gpu_names)} ($ per million output tokens)",
             FIGURES_NOTE]
    lines += _table(header, rows)
    scan_header = ("context", "gpu", "tp", "b_max", "colocated", "hom-ODS", "G_hom", "closed", "bound", "chosen")
    scan_rows = [(context_label(p.context), g.gpu, str(t.tp), str(t.b_max), _money(t.cost_colocated),
                  _money(t.cost_hom_ods), _num(t.g_hom), _num(t.g_hom_closed), _num(t.g_hom_bound),
                  " ".join(m for m, on in (("<- colocated", t.tp == g.tp and g.cost_colocated is not None),
                                           ("<- ODS", t.tp == g.ods_tp)) if on))
                 for p in a.points for g in p.gpus for t in g.tp_scan]
    lines += ["", "TP scan (per TP degree: colocated at its memory-limited batch b_max, hom-ODS on that degree; "
                  "G_hom against the least hom-ODS of the scan)"]
    lines += _table(scan_header, scan_rows)
    if a.points[0].g_het is not None:
        het_header = ("context", "attention on", "GEMM on", "het-ODS", "best hom-ODS", "G_het")
        het_rows = [(context_label(p.context), p.het_attention_gpu, p.het_gemm_gpu, _money(p.cost_het_ods),
                     _money(min(g.cost_hom_ods for g in p.gpus)), f"{p.g_het:.3g}") for p in a.points]
        lines += ["", "Heterogeneous ODS (memory-bound ops on the type cheapest for them, GEMMs on the type cheapest "
                      "for them; each type on its ODS TP)"]
        lines += _table(het_header, het_rows)
    lines.append("")
    if a.crossing_context is not None:
        lines.append(f"cheapest homogeneous-ODS GPU type changes at s ~ {a.crossing_context:,.0f} tokens "
                     "(where G_het peaks)")
    elif len(a.gpu_names) >= 2:
        lines.append("the cheapest homogeneous-ODS GPU type is the same over the whole range (no crossing inside it)")
    last = a.points[-1]
    for g in last.gpus:
        lines.append(f"CAD on {g.gpu} at {context_label(last.context)}: {g.cad_reason}")
    if a.hybrid_note:
        lines.append(a.hybrid_note)
    return "\n".join(lines)


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
    `tp_scan` and each scanned TP's cost-model `terms`); `figures` says which figure each key reports."""
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
        if p.g_het is not None:
            entry.update(g_het=p.g_het, cost_het_ods_per_mtok=p.cost_het_ods,
                         het_attention_gpu=p.het_attention_gpu, het_gemm_gpu=p.het_gemm_gpu)
        points.append(entry)
    return _clean({"model": a.model, "gpus": list(a.gpu_names), "figures": FIGURES_NOTE,
                   "crossing_context": a.crossing_context,
                   "hybrid_note": a.hybrid_note, "points": points})


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
                          for p in a.points], ":", color=line.get_color(), label=f"bound {name} (at its TP)")
    if a.points[0].g_het is not None:
        ax_cost.plot(xs, [p.cost_het_ods for p in a.points], "k^-", label="het-ODS")
        ax_gain.plot(xs, [p.g_het for p in a.points], "k^-", label="G_het")
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
