"""The cost model against published decode measurements: before and after calibration.

Reads `bench/data/decode-measurements.csv` (263 decode points of Llama-3-8B/70B on A100
and H100, vLLM and TensorRT-LLM, TP 1/2/4, batch 1-64; its README gives the source) and reports,
per group (GPU, engine, model, TP):

- before: the ideal roofline (`--catalog roofline`, the catalog before calibration);
- default: the built-in catalog, whose terms are the TensorRT-LLM fit below;
- after: `opweave calibrate --engine E --catalog roofline` for the group's engine (the file's other
  engine gives the starting values of terms the engine's rows cannot identify);
- left out: the same fit without the group (neither in the engine's fit nor in its prior), which
  then predicts the group: leave-one-group-out.

Errors are predicted / measured - 1 per row; the tables give their mean absolute value, median
and mean signed value. A plot shows predicted against measured TPOT before, after and left out.

    python bench/calibration.py [--csv FILE] [--out bench/results/calibration.md] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import HERE, RunClock, emit, header_lines  # noqa: E402
from opweave.profile import calibrate as C  # noqa: E402
from opweave.hardware.catalog import load_catalog  # noqa: E402

DEFAULT_CSV = os.path.join(HERE, "data", "decode-measurements.csv")
DEFAULT_ENGINE = "trtllm"
"""The engine class the built-in catalog's fitted terms represent."""


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _errors(pred, measured) -> list[float]:
    return [p / m - 1.0 for p, m in zip(pred, measured)]


def _stats(errors: list[float]) -> str:
    s = C.summary(errors)
    return f"{_pct(s['mean_abs'])} / {_pct(s['median_abs'])} / {s['mean_signed']:+.1%}" if s else "-"


def _default_predictions(path: str, graphs: dict) -> dict[int, float]:
    """Line -> TPOT ms of every row with the built-in catalog (the cost model's own figures)."""
    catalog = load_catalog()
    rows = C.read_measurements(path, catalog)
    out = {}
    for gpu in dict.fromkeys(r.gpu for r in rows):
        mine = [r for r in rows if r.gpu == gpu]
        pred = C.predict(C.params_of(catalog[gpu]), C.features(mine, catalog[gpu], graphs))
        out.update({r.line: p * 1e3 for r, p in zip(mine, pred)})
    return out


def _fit_table(cals: dict[str, C.Calibration]) -> list[str]:
    lines = ["| engine | GPU | rows | " + " | ".join(t.field for t in C.TERMS) + " |",
             "|---|---|---:|" + "---:|" * len(C.TERMS)]
    for engine, cal in cals.items():
        for fit in cal.fits:
            cells = []
            for t in C.TERMS:
                value = fit.values[t.field]
                shown = f"{value * 1e6:.4g} us" if t.unit == "us" else f"{value:.3f}"
                cells.append(shown + (" (kept)" if t.field in fit.held else ""))
            lines.append(f"| {engine} | {fit.gpu} | {fit.rows} | " + " | ".join(cells) + " |")
    return lines


def _plot(path: str, groups: list[C.GroupReport]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 5), sharex=True, sharey=True)
    for ax, key, title in zip(axes, ("before_ms", "after_ms", "logo_ms"),
                              ("before: ideal roofline", "after: calibrated per engine", "left out: group not in fit")):
        for i, g in enumerate(groups):
            pred = getattr(g, key)
            if pred:
                ax.scatter(g.measured_ms, pred, s=14, label=g.group, alpha=0.8, color=plt.cm.tab20(i % 20),
                           marker="^" if "vllm" in g.group else "o")
        ax.plot([2, 200], [2, 200], "k-", lw=0.8)
        for f in (0.88, 1.12):
            ax.plot([2, 200], [2 * f, 200 * f], "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured TPOT (ms)")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("predicted TPOT (ms)")
    axes[2].legend(fontsize=6, loc="upper left")
    fig.suptitle("Decode TPOT, Llama-3-8B/70B on A100/H100 (LLM-Inference-Bench); dotted: ±12%")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=DEFAULT_CSV)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "calibration.md"))
    parser.add_argument("--plot", default=os.path.join(HERE, "results", "calibration.png"))
    args = parser.parse_args(argv)
    clock = RunClock.start()
    graphs: dict = {}
    roofline = load_catalog("roofline")
    engines = list(dict.fromkeys(r.engine for r in C.read_measurements(args.csv, roofline)))
    cals = {}
    for engine in engines:
        print(f"fitting {engine} ...", file=sys.stderr, flush=True)
        cals[engine] = C.calibrate(args.csv, roofline, engine=engine, graphs=graphs)
    print("fitting all engines together ...", file=sys.stderr, flush=True)
    pooled = C.calibrate(args.csv, roofline, graphs=graphs)
    default = _default_predictions(args.csv, graphs)
    groups = [g for cal in cals.values() for g in cal.groups]
    rows = {g.group: [r for r in cal.rows if r.group == g.group] for cal in cals.values() for g in cal.groups}

    lines = header_lines("Cost model calibration against published decode measurements", ["python"] + sys.argv,
                         clock)
    lines += [f"Measurements: `{os.path.relpath(args.csv, os.path.join(HERE, '..'))}`, {len(pooled.rows)} rows "
              "(LLM-Inference-Bench: Llama-3-8B/70B, FP16, A100-80GB and H100, vLLM and TensorRT-LLM mid-2024, "
              "TP 1/2/4, batch 1-64, context = input + output / 2). Prediction: `opweave estimate` (colocated, one "
              "TP group), i.e. the cost model's sum over the model's ops; error = predicted / measured - 1.", "",
              "Columns: mean |error| / median |error| / mean signed error over the group's rows. **before**: "
              "`--catalog roofline` (the ideal bound, the catalog before calibration); **default**: the built-in "
              f"catalog (its terms are the `{DEFAULT_ENGINE}` fit); **after**: `opweave calibrate --engine E "
              "--catalog roofline` for the group's engine E; **left out**: the same fit without the group "
              "(not in the engine's rows nor in the prior fitted from the other engine), predicting the group.", ""]
    lines += ["| group | rows | measured ms | before | default | after | left out |", "|---|---:|---|---|---|---|---|"]
    for g in groups:
        measured = g.measured_ms
        d = [default[r.line] for r in rows[g.group]]
        lines.append(f"| {g.group} | {g.rows} | {min(measured):.1f}-{max(measured):.1f} | "
                     f"{_stats(_errors(g.before_ms, measured))} | {_stats(_errors(d, measured))} | "
                     f"{_stats(_errors(g.after_ms, measured))} | {_stats(_errors(g.logo_ms, measured))} |")
    def row(label: str, mine: list[C.GroupReport]) -> str:
        errors = [[e for g in mine for e in _errors(pred(g), g.measured_ms)] for pred in (
            lambda g: g.before_ms, lambda g: [default[r.line] for r in rows[g.group]], lambda g: g.after_ms,
            lambda g: g.logo_ms)]
        return f"| {label} | {len(errors[0])} | | " + " | ".join(_stats(e) for e in errors) + " |"

    lines.append(row("**all**", groups))
    lines += [row(f"all {engine}", list(cal.groups)) for engine, cal in cals.items()]
    every = {key: [e for g in groups for e in _errors(getattr(g, key), g.measured_ms)]
             for key in ("before_ms", "after_ms", "logo_ms")}
    logo = C.summary(every["logo_ms"])
    lines += ["", f"**Leave-one-group-out mean absolute TPOT error: {_pct(logo['mean_abs'])}** "
              f"(median {_pct(logo['median_abs'])}, worst {_pct(logo['max_abs'])}; target 12% or less). "
              f"One fit of both engines together (a catalog per GPU type that ignores the engine): after "
              f"{_pct(C.totals(pooled)['after']['mean_abs'])}, left out {_pct(C.totals(pooled)['logo']['mean_abs'])}: "
              "the engines differ by up to a third at TP 2-4 (their all-reduces and per-step costs), which one "
              "set of terms cannot follow.", ""]
    by = {}
    for g in groups:
        for r, e0, e1 in zip(rows[g.group], _errors(g.before_ms, g.measured_ms), _errors(g.after_ms, g.measured_ms)):
            for key in (f"batch {r.batch}", f"TP {r.tp}", r.gpu):
                by.setdefault(key, ([], []))
                by[key][0].append(e0)
                by[key][1].append(e1)
    lines += ["Predicted / measured by batch, TP and GPU type (median ratio, before -> after):", "",
              "| rows of | before | after |", "|---|---:|---:|"]
    for key, (e0, e1) in sorted(by.items(), key=lambda kv: (kv[0][0].isdigit() or kv[0][0] == "a" or kv[0][0] == "h",
                                                             kv[0].split()[0], int(kv[0].split()[-1])
                                                             if kv[0].split()[-1].isdigit() else 0)):
        lines.append(f"| {key} | {1 + statistics.median(e0):.2f}x | {1 + statistics.median(e1):.2f}x |")
    lines += ["", "Fitted terms (`opweave calibrate --engine E --catalog roofline`; \"kept\": the rows cannot "
              "identify the term, so it keeps the starting value, the other engine's fit):", ""]
    lines += _fit_table(cals)
    lines += ["", "Reasons given for kept terms:", ""]
    for engine, cal in cals.items():
        for fit in cal.fits:
            for field, why in fit.held.items():
                lines.append(f"- {engine} {fit.gpu} {field}: {why}")
    worst = sorted(((abs(e), g.group, r) for g in groups for r, e in
                    zip(rows[g.group], _errors(g.after_ms, g.measured_ms))), key=lambda x: -x[0])[:6]
    lines += ["", "Largest errors after calibration (kept in every figure above; the measurements' README names "
              "the A100 TensorRT-LLM 70B TP 4, L 1024, batch 16 point as a likely outlier):", ""]
    for e, group, r in worst:
        lines.append(f"- {group}, batch {r.batch}, context {r.context}: measured {r.tpot_s * 1e3:.2f} ms, error "
                     f"{_pct(e)}")
    if args.plot:
        _plot(args.plot, groups)
        lines += ["", f"![predicted vs measured]({os.path.basename(args.plot)})"]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
