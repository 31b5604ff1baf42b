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


def format_analysis(a: Analysis) -> str:
    header = ("context", "state/seq", "gpu", "tp", "regime", "b_max", "b*", "colocated", "hom-ODS",
              "G_hom", "bound", "CAD")
    rows = []
    for p in a.points:
        for g in p.gpus:
            rows.append((context_label(p.context), human_bytes(p.state_bytes), g.gpu, str(g.tp), g.regime,
                         str(g.b_max), f"{g.b_star:.0f}", _money(g.cost_colocated), _money(g.cost_hom_ods),
                         _num(g.g_hom), _num(g.g_hom_bound), "yes" if g.cad_feasible else "no"))
    lines = [f"Decode cost analysis of {a.model} on {', '.join(a.gpu_names)} ($ per million output tokens; "
             "colocated at the relaxed batch b_rel, ideal ODS as in summary §3)"]
    lines += _table(header, rows)
    if a.points[0].g_het is not None:
        het_header = ("context", "attention on", "GEMM on", "het-ODS", "best hom-ODS", "G_het")
        het_rows = [(context_label(p.context), p.het_attention_gpu, p.het_gemm_gpu, _money(p.cost_het_ods),
                     _money(min(g.cost_hom_ods for g in p.gpus)), f"{p.g_het:.3g}") for p in a.points]
        lines += ["", "Heterogeneous ODS (attention on the cheapest bytes/s, GEMMs on the cheapest FLOP/s)"]
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
    """Per context: the first GPU type's figures at top level, every type under `gpus`."""
    points = []
    for p in a.points:
        first = p.gpus[0]
        entry = {"context": p.context, "state_bytes": p.state_bytes, "b_max": first.b_max, "b_rel": first.b_rel,
                 "b_star": first.b_star, "regime": first.regime, "g_hom": first.g_hom,
                 "g_hom_bound": first.g_hom_bound, "cost_colocated_per_mtok": first.cost_colocated,
                 "cost_hom_ods_per_mtok": first.cost_hom_ods, "cad_feasible": first.cad_feasible,
                 "gpus": {g.gpu: dataclasses.asdict(g) for g in p.gpus}}
        if p.g_het is not None:
            entry.update(g_het=p.g_het, cost_het_ods_per_mtok=p.cost_het_ods,
                         het_attention_gpu=p.het_attention_gpu, het_gemm_gpu=p.het_gemm_gpu)
        points.append(entry)
    return _clean({"model": a.model, "gpus": list(a.gpu_names), "crossing_context": a.crossing_context,
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
        ax_gain.plot(xs, [math.nan if p.gpus[i].g_hom is None else p.gpus[i].g_hom for p in a.points], "o-",
                     label=f"G_hom {name}")
        bound = [p.gpus[i].g_hom_bound for p in a.points]
        ax_gain.axhline(bound[0], linestyle=":", color="gray")
        ax_gain.annotate(f"bound {name} {bound[0]:.3g}", (xs[0], bound[0]), fontsize=8)
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
