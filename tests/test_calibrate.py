"""`opweave calibrate`: the fit recovers known terms, agrees with the cost model, says what it cannot
fit, and refuses bad measurement files in one line."""

import csv
import dataclasses
import json
import os

import numpy as np
import pytest

from opweave.cli import main
from opweave.compiler.frontend import run_front_end
from opweave.profile import calibrate as C
from opweave.cost.model import CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog

TRUE = {"mem_efficiency": 0.7, "kv_efficiency": 0.45, "step_overhead": 600e-6, "sequence_overhead": 25e-6,
        "collective_latency": 12e-6, "serial_fraction": 0.3, "launch_overhead": 3e-6}
GRAPHS = {}


def _graph(model):
    if model not in GRAPHS:
        GRAPHS[model] = run_front_end(model).graph
    return GRAPHS[model]


def _tpot_ms(spec, model, tp, batch, context):
    g = _graph(model)
    return CostModel().ops_latency(g.ops, spec, tp, batch, context, g.cuts[0].bytes_per_token) * 1e3


def _write_csv(path, rows, columns=("gpu", "engine", "model", "tp", "batch", "context", "tpot_ms")):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)
    return str(path)


def _synthetic(path, spec, models=(("llama-3.1-8b", (1, 2, 4)), ("llama-3.1-70b", (4, 8))),
               batches=(1, 16, 64, 256), contexts=(512, 4096), noise=0.0):
    rng = np.random.default_rng(0)
    rows = []
    for model, tps in models:
        for tp in tps:
            for b in batches:
                for s in contexts:
                    t = _tpot_ms(spec, model, tp, b, s) * (1 + noise * rng.standard_normal())
                    rows.append((spec.name, "synthetic", model, tp, b, s, f"{t:.6f}"))
    return _write_csv(path, rows)


@pytest.fixture(scope="module")
def truth():
    return dataclasses.replace(load_catalog()["h100"], **TRUE)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, truth):
    return _synthetic(tmp_path_factory.mktemp("cal") / "m.csv", truth)


@pytest.mark.slow
def test_fit_recovers_the_terms_that_made_the_data(synthetic):
    cal = C.calibrate(synthetic, load_catalog("roofline"), graphs=GRAPHS)
    (fit,) = cal.fits
    assert fit.held == {} and fit.rows == 2 * 4 * 5
    for field, value in TRUE.items():
        assert fit.values[field] == pytest.approx(value, rel=0.02, abs=2e-8), field
    totals = C.totals(cal)
    assert totals["after"]["max_abs"] < 1e-3 and totals["logo"]["mean_abs"] < 0.01
    assert totals["before"]["mean_signed"] < -0.2   # the ideal roofline is optimistic


def test_prediction_is_the_cost_models(synthetic):
    """The fit's array form gives what `CostModel` gives with the fitted catalog entry."""
    catalog = load_catalog("roofline")
    rows = C.read_measurements(synthetic, catalog)[::7]
    params = C.params_of(dataclasses.replace(catalog["h100"], **TRUE))
    spec = dataclasses.replace(catalog["h100"], **C.values_of(params))
    pred = C.predict(params, C.features(rows, catalog["h100"], GRAPHS))
    for r, p in zip(rows, pred):
        assert p * 1e3 == pytest.approx(_tpot_ms(spec, r.model, r.tp, r.batch, r.context), rel=1e-9)


def test_noisy_data_fits_within_the_noise(tmp_path, truth):
    path = _synthetic(tmp_path / "noisy.csv", truth, noise=0.03)
    cal = C.calibrate(path, load_catalog("roofline"), logo=False, graphs=GRAPHS)
    assert C.totals(cal)["after"]["mean_abs"] < 0.035
    # the fit predicts the noise-free truth better than the noisy rows it saw
    fitted = dataclasses.replace(load_catalog("roofline")["h100"], **cal.fits[0].values)
    points = [("llama-3.1-8b", 2, 32, 2048), ("llama-3.1-70b", 8, 128, 1024), ("llama-3.1-8b", 1, 4, 8192)]
    for p in points:
        assert _tpot_ms(fitted, *p) == pytest.approx(_tpot_ms(truth, *p), rel=0.02)


def test_terms_the_rows_cannot_identify_keep_their_start_value(tmp_path, truth):
    path = _synthetic(tmp_path / "narrow.csv", truth, models=(("llama-3.1-8b", (1,)),), batches=(1,),
                      contexts=(256, 1024, 4096, 16384))
    start = load_catalog("roofline")
    cal = C.calibrate(path, start, graphs=GRAPHS)
    (fit,) = cal.fits
    assert "every row has batch 1" in fit.held["sequence_overhead"]
    assert "every row has TP 1" in fit.held["collective_latency"]
    assert "every row's model has 356 ops" in fit.held["launch_overhead"]
    for field in fit.held:
        assert fit.values[field] == pytest.approx(fit.start[field])
    assert "mem_efficiency" not in fit.held and C.totals(cal)["after"]["max_abs"] < 0.02
    text = C.format_calibration(cal)
    assert "not fitted: every row has batch 1" in text and "left out" in text


@pytest.mark.slow
def test_cli_writes_a_catalog_every_command_accepts(tmp_path, synthetic, truth, capsys):
    out = tmp_path / "fitted.json"
    assert main(["calibrate", synthetic, "-o", str(out), "--catalog", "roofline", "--no-logo"]) == 0
    text = capsys.readouterr().out
    assert "h100: 40 rows, 5 groups" in text and f"wrote {out}" in text
    data = json.loads(out.read_text())
    assert data["h100"]["mem_efficiency"] == pytest.approx(0.7, rel=0.02)
    assert data["h100"]["sources"]["step_overhead"].startswith("fit: opweave calibrate m.csv")
    spec = load_catalog(str(out))["h100"]
    assert spec.kv_efficiency == pytest.approx(0.45, rel=0.02)
    assert main(["estimate", "llama-3.1-8b", "--gpu", "h100", "--batch", "16", "--context", "4096",
                 "--catalog", str(out), "--format", "json"]) == 0
    point = json.loads(capsys.readouterr().out)["points"][0]
    assert point["tpot_ms"] == pytest.approx(_tpot_ms(spec, "llama-3.1-8b", 1, 16, 4096), rel=1e-5)
    assert point["tpot_ms"] == pytest.approx(_tpot_ms(truth, "llama-3.1-8b", 1, 16, 4096), rel=0.01)
    assert main(["analyze", "llama-3.1-8b", "--gpus", "h100", "--context", "4k", "--catalog", str(out)]) == 0
    capsys.readouterr()
    tpots = {}
    for catalog in (str(out), "roofline"):
        art = tmp_path / f"art-{len(tpots)}"
        assert main(["compile", "llama-3.1-8b", "--cluster", "h100x2", "--tpot-slo", "100ms", "--context", "4k",
                     "--templates", "colocated", "--max-batch", "16", "--catalog", catalog, "-o", str(art),
                     "--quiet", "--format", "json"]) == 0
        tpots[catalog] = json.loads(capsys.readouterr().out)["tpot_ms"]
    assert tpots["roofline"] < 0.8 * tpots[str(out)]


def test_engine_selects_rows_and_the_rest_is_the_prior(tmp_path, truth):
    slow = dataclasses.replace(truth, step_overhead=2e-3)
    rows = []
    for spec, engine in ((truth, "fast"), (slow, "slow")):
        for model, tp in (("llama-3.1-8b", 1), ("llama-3.1-8b", 2), ("llama-3.1-70b", 4)):
            for b in (1, 16, 64, 256):
                for s in (512, 4096):
                    rows.append(("h100", engine, model, tp, b, s, _tpot_ms(spec, model, tp, b, s)))
    path = _write_csv(tmp_path / "two.csv", rows)
    cal = C.calibrate(path, load_catalog("roofline"), logo=False, engine="slow", graphs=GRAPHS)
    assert len(cal.rows) == 24 and all(g.group.startswith("h100 slow") for g in cal.groups)
    assert C.totals(cal)["after"]["max_abs"] < 1e-3
    fast = C.calibrate(path, load_catalog("roofline"), logo=False, engine="fast", graphs=GRAPHS)
    assert C.totals(fast)["after"]["max_abs"] < 1e-3
    extra = cal.fits[0].values["step_overhead"] - fast.fits[0].values["step_overhead"]
    assert extra == pytest.approx(2e-3 - TRUE["step_overhead"], rel=0.05)
    both = C.calibrate(path, load_catalog("roofline"), logo=False, graphs=GRAPHS)  # one fit of two engines
    assert C.totals(both)["after"]["mean_abs"] > 0.01
    with pytest.raises(OpWeaveError, match="no row has engine 'medium'"):
        C.calibrate(path, load_catalog(), engine="medium", graphs=GRAPHS)


def test_nnls_and_bounds_against_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        a, b = rng.standard_normal((12, 4)), rng.standard_normal(12)
        lower, upper = np.array([0.0, 1.0, 0.0, -1.0]), np.array([np.inf, np.inf, 0.5, np.inf])
        x = C.bounded_lstsq(a, b, lower, upper)
        assert (x >= lower - 1e-12).all() and (x <= upper + 1e-12).all()
        best = np.linalg.norm(a @ x - b)
        for _ in range(300):  # no feasible point nearby does better
            y = np.clip(x + 0.05 * rng.standard_normal(4), lower, upper)
            assert np.linalg.norm(a @ y - b) >= best - 1e-9


GOOD_HEADER = "gpu,model,tp,batch,context,tpot_ms\n"


@pytest.mark.parametrize("text, message", [
    ("gpu,model,tp,batch,context\nh100,llama-3.1-8b,1,1,512\n", "missing column(s) tpot_ms"),
    ("", "missing column(s) gpu, model, tp, batch, context, tpot_ms"),
    (GOOD_HEADER, "no measurement rows"),
    (GOOD_HEADER + "h100,llama-3.1-8b,one,1,512,7.5\n", "line 2: tp must be a whole number, got 'one'"),
    (GOOD_HEADER + "h100,llama-3.1-8b,1,1.5,512,7.5\n", "line 2: batch must be a positive whole number"),
    (GOOD_HEADER + "h100,llama-3.1-8b,1,1,512,fast\n", "line 2: tpot_ms must be a number, got 'fast'"),
    (GOOD_HEADER + "h100,llama-3.1-8b,1,1,512,-3\n", "line 2: tpot_ms must be a positive number"),
    (GOOD_HEADER + "h100,llama-3.1-8b,1,1,512,nan\n", "line 2: tpot_ms must be a positive number"),
    (GOOD_HEADER + "h100,llama-3.1-8b,1,1,,7.5\n", "line 2: empty context"),
    (GOOD_HEADER + "h999,llama-3.1-8b,1,1,512,7.5\n", "line 2: unknown GPU type 'h999'"),
    (GOOD_HEADER + "h100,no-such-model,1,1,512,7.5\n", "line 2: model 'no-such-model'"),
    (GOOD_HEADER + "h100,llama-3.1-8b,3,1,512,7.5\n" * 4, "TP 3 does not divide"),
    (GOOD_HEADER + "h100,llama-3.1-8b,1,1,512,7.5\nh100,llama-3.1-8b,1,4,512,7.9\n",
     "h100: 2 measurement row(s), at least 4 are needed"),
])
@pytest.mark.slow
def test_bad_measurement_files_are_one_line_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    assert main(["calibrate", str(path), "-o", str(tmp_path / "out.json"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert main(["calibrate", str(path), "-o", str(tmp_path / "out.json")]) == 2  # progress lines, then the error
    err = capsys.readouterr().err.splitlines()
    assert message in err[-1] and all(line.startswith("  ... ") for line in err[:-1])
    assert not (tmp_path / "out.json").exists()


def test_bad_files_and_outputs(tmp_path, capsys):
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xff\xfe\x00gpu")
    for args, message in (([str(tmp_path / "missing.csv"), "-o", str(tmp_path / "o.json")], "not found"),
                          ([str(tmp_path), "-o", str(tmp_path / "o.json")], "is a folder"),
                          ([str(binary), "-o", str(tmp_path / "o.json")], "not UTF-8 text"),
                          ([str(binary), "-o", str(tmp_path / "o.txt")], "must end in .json")):
        assert main(["calibrate", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


MEASUREMENTS_CSV = os.path.join(os.path.dirname(__file__), "..", "bench", "data", "decode-measurements.csv")


@pytest.mark.slow
def test_builtin_catalog_is_the_fit_of_the_shared_measurements():
    """catalog.json's fitted terms are `calibrate --engine trtllm --catalog roofline` (3 digits)."""
    cal = C.calibrate(MEASUREMENTS_CSV, load_catalog("roofline"), logo=False, engine="trtllm", graphs=GRAPHS)
    builtin = load_catalog()
    for fit in cal.fits:
        for field, value in fit.values.items():
            assert getattr(builtin[fit.gpu], field) == pytest.approx(value, rel=5e-3, abs=1e-12), (fit.gpu, field)
    assert C.totals(cal)["after"]["median_abs"] < 0.04
