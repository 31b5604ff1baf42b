"""Fitting a GPU type's prefill efficiency to measured prefill times (`opweave calibrate` of a
file with a `prefill_ms` column).

A row is one prefill step: GPU type, model, TP degree, prompts in the step (`batch`), tokens per
prompt (`isl`) and the measured time (`prefill_ms`, or `ttft_ms` for a time to first token
measured on an idle server). The cost model prices it as `cost.prefill.prefill_s`; its one term a
prefill has and decode does not is `GPUSpec.prefill_efficiency` (the share of peak FLOP/s a
prefill's GEMMs and attention reach). Per GPU type the fit is the efficiency in [0.02, 1] that
minimises the squared log error over the type's rows (golden-section search: the prediction is
monotone in it), and the report gives each row's error before and after.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import math
import os

from opweave.cost.model import CostModel
from opweave.cost.prefill import prefill_s
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import GPUSpec, get_gpu

COLUMNS = ("gpu", "model", "tp", "batch", "isl")
TIMES = ("prefill_ms", "ttft_ms")
BOUNDS = (0.02, 1.0)


@dataclasses.dataclass(frozen=True)
class PrefillRow:
    line: int
    gpu: str
    model: str
    tp: int
    batch: int
    isl: int
    measured_s: float


@dataclasses.dataclass(frozen=True)
class PrefillFit:
    gpu: str
    efficiency: float
    start: float
    rows: tuple[PrefillRow, ...]
    before: tuple[float, ...]     # predicted seconds at the starting catalog's efficiency
    after: tuple[float, ...]      # ... at the fitted one


def is_prefill_file(path: str) -> bool:
    """Whether a measurements CSV holds prefill rows (a `prefill_ms` or `ttft_ms` column)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error):   # the decode reader names what is wrong with it
        return False
    return any(t in header for t in TIMES) and "tpot_ms" not in header


def _whole(raw: dict, key: str, where: str) -> int:
    try:
        value = int(raw[key])
    except (TypeError, ValueError):
        raise OpWeaveError(f"{where}: {key} must be a whole number, got {raw.get(key)!r}") from None
    if value < 1 or value > 1 << 24:
        raise OpWeaveError(f"{where}: {key} must be between 1 and {1 << 24}, got {value}")
    return value


def read_prefill_rows(path: str, catalog: dict[str, GPUSpec]) -> list[PrefillRow]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            time = next((t for t in TIMES if t in (reader.fieldnames or [])), None)
            if missing or time is None:
                raise OpWeaveError(f"{path}: missing column(s) {', '.join(missing + ([] if time else ['prefill_ms']))}")
            rows = []
            for line, raw in enumerate(reader, 2):
                where = f"{path} line {line}"
                try:
                    seconds = float(raw[time]) / 1e3
                except (TypeError, ValueError):
                    raise OpWeaveError(f"{where}: {time} must be a number, got {raw.get(time)!r}") from None
                if not (seconds > 0 and math.isfinite(seconds)):
                    raise OpWeaveError(f"{where}: {time} must be positive, got {raw[time]!r}")
                gpu = get_gpu(raw["gpu"].strip(), catalog).name
                rows.append(PrefillRow(line=line, gpu=gpu, model=raw["model"].strip(), tp=_whole(raw, "tp", where),
                                       batch=_whole(raw, "batch", where), isl=_whole(raw, "isl", where),
                                       measured_s=seconds))
    except OSError as e:
        raise OpWeaveError(f"{path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise OpWeaveError(f"{path}: not a text file") from None
    if not rows:
        raise OpWeaveError(f"{path}: no measurements")
    return rows


def _predictions(gpu: GPUSpec, rows, graphs: dict, efficiency: float) -> tuple[float, ...]:
    from opweave.profile.calibrate import graph_of

    spec = dataclasses.replace(gpu, prefill_efficiency=efficiency)
    out = []
    for r in rows:
        graph = graph_of(r.model, graphs)
        hidden = graph.cuts[0].bytes_per_token if graph.cuts else 0
        out.append(prefill_s(graph.ops, spec, r.tp, r.isl, r.batch, hidden, "tp", CostModel(cuda_graphs=False)).total_s)
    return tuple(out)


def _loss(gpu, rows, graphs, efficiency) -> float:
    return sum(math.log(p / r.measured_s) ** 2 for p, r in zip(_predictions(gpu, rows, graphs, efficiency), rows))


def fit_prefill(path: str, catalog: dict[str, GPUSpec], progress=None) -> list[PrefillFit]:
    """One fit per GPU type of the file's rows (module docstring); `progress` gets a line per model
    traced and per GPU type fitted."""
    from opweave.profile.calibrate import graph_of

    say = progress or (lambda message: None)
    rows = read_prefill_rows(path, catalog)
    graphs: dict = {}
    for model in dict.fromkeys(r.model for r in rows):
        say(f"tracing {model}'s decode step")
        graph_of(model, graphs)
    fits = []
    for name in sorted({r.gpu for r in rows}):
        gpu, mine = catalog[name], [r for r in rows if r.gpu == name]
        say(f"{name}: fitting the prefill efficiency to {len(mine)} rows")
        lo, hi = math.log(BOUNDS[0]), math.log(BOUNDS[1])
        ratio = (math.sqrt(5) - 1) / 2
        for _ in range(60):   # golden section on log(efficiency)
            a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
            if _loss(gpu, mine, graphs, math.exp(a)) <= _loss(gpu, mine, graphs, math.exp(b)):
                hi = b
            else:
                lo = a
        efficiency = math.exp((lo + hi) / 2)
        start = gpu.prefill_flops / gpu.peak_flops
        fits.append(PrefillFit(gpu=name, efficiency=efficiency, start=start, rows=tuple(mine),
                               before=_predictions(gpu, mine, graphs, start),
                               after=_predictions(gpu, mine, graphs, efficiency)))
    return fits


def format_prefill(fits: list[PrefillFit]) -> str:
    lines = ["Prefill efficiency per GPU type (share of peak FLOP/s a prefill reaches), fitted to measured prefills:"]
    for fit in fits:
        lines.append(f"  {fit.gpu}: {fit.efficiency:.3f} (starting catalog {fit.start:.3f}), {len(fit.rows)} rows")
        for r, b, a in zip(fit.rows, fit.before, fit.after):
            lines.append(f"    line {r.line}: {r.model} tp{r.tp} batch {r.batch} x {r.isl} tokens: measured "
                         f"{r.measured_s * 1e3:.4g} ms, predicted {b * 1e3:.4g} ms before "
                         f"({b / r.measured_s - 1:+.1%}), {a * 1e3:.4g} ms after ({a / r.measured_s - 1:+.1%})")
    return "\n".join(lines)


def prefill_catalog(fits: list[PrefillFit], path: str) -> dict:
    """An override catalog (the layout of `catalog.json`) with each fitted GPU type's efficiency."""
    stamp, name = datetime.date.today().isoformat(), os.path.basename(path)
    out: dict = {"_meta": {"written_by": "opweave calibrate", "date": stamp, "measurements": name}}
    for fit in fits:
        out[fit.gpu] = {"prefill_efficiency": float(f"{fit.efficiency:.6g}"),
                        "sources": {"prefill_efficiency": f"fit: opweave calibrate {name} ({stamp}), "
                                                          f"{len(fit.rows)} prefill rows"}}
    return out


def prefill_to_json(fits: list[PrefillFit]) -> dict:
    return {"prefill": [{"gpu": f.gpu, "efficiency": f.efficiency, "start": f.start,
                         "rows": [{"line": r.line, "measured_ms": r.measured_s * 1e3, "before_ms": b * 1e3,
                                   "after_ms": a * 1e3} for r, b, a in zip(f.rows, f.before, f.after)]}
                        for f in fits]}


def calibrate_file(path: str, catalog: dict[str, GPUSpec], logo: bool = True,
                   engine: str | None = None, progress=None) -> tuple[dict, dict, str]:
    """`opweave calibrate` of either kind of file: (override catalog, JSON report, text report) of
    a prefill fit (`is_prefill_file`) or of the decode fit (`profile/calibrate.py`); `progress`
    gets their progress lines."""
    if is_prefill_file(path):
        if engine is not None:
            raise OpWeaveError("--engine selects decode rows; a prefill file is fitted whole")
        fits = fit_prefill(path, catalog, progress)
        return prefill_catalog(fits, path), prefill_to_json(fits), format_prefill(fits)
    from opweave.profile.calibrate import calibrate, calibration_to_json, catalog_entries, format_calibration

    result = calibrate(path, catalog, logo=logo, engine=engine, progress=progress)
    return catalog_entries(result), calibration_to_json(result), format_calibration(result)
