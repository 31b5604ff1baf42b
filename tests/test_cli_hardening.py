"""CLI and input files under hostile input: deep or self-referencing data files, bad environment
variables, absurd calibration rows, negative flag values, permissive umasks and key files, and
files in an artifact that are not regular files. Each is one line `opweave: error: ...` and exit
2, before any work (docs/reliability.md, "CLI and input files")."""

import contextlib
import csv
import dataclasses
import os
import signal
import stat

import numpy as np
import pytest

from opweave.artifact import load_artifact, read_key
from opweave.cli import main
from opweave.profile import calibrate as C
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog

FAST = ["--cluster", "h100x2", "--tpot-slo", "50ms", "--templates", "colocated", "--max-batch", "4", "--quiet"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and err[0].startswith("opweave: error: "), err
    return err[0]


@contextlib.contextmanager
def deadline(seconds: int = 60):
    """Fails the test instead of hanging forever (a FIFO opened for reading blocks)."""
    def expired(*_):
        raise AssertionError(f"still running after {seconds} s (blocked?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("hardening") / "art"
    assert main(["compile", "tiny-gemma3", *FAST, "--context", "64", "-o", str(out)]) == 0
    return str(out)


# ---------------------------------------------------------------- 1. catalog and cluster files

CATALOGS = {
    "deep.json": "[" * 100_000,
    "deep_entry.json": '{"h100": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "deeper_than_16.json": '{"h100": {"peak_flops": ' + "[" * 40 + "]" * 40 + "}}",
    "deep.yaml": "[" * 100_000,
    "itself.yaml": "h100: &a\n  sources: [*a]\n",
    "laughs.yaml": "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdef", "bcdefg")),
    "set.yaml": "h100: !!set {a, b}\n",
    "list.json": "[1, 2]",
}


@pytest.mark.parametrize("name, message", [
    ("deep.json", "nested too deeply"), ("deep_entry.json", "nested too deeply"),
    ("deeper_than_16.json", "nested too deeply at h100.peak_flops"), ("deep.yaml", "nested too deeply"),
    ("itself.yaml", "holds itself"), ("laughs.yaml", "more than 1,000,000 values"),
    ("set.yaml", "holds a set"), ("list.json", "must hold a mapping, not list"),
])
@pytest.mark.slow
def test_hostile_catalog_files_are_one_line(tmp_path, capsys, name, message):
    path = tmp_path / name
    path.write_text(CATALOGS[name])
    with deadline():
        assert main(["estimate", "tiny-gemma3", "--gpu", "h100", "--catalog", str(path)]) == 2
    assert message in one_line(capsys)


def test_catalog_that_is_a_fifo_is_refused_unopened(tmp_path, capsys):
    fifo = tmp_path / "catalog.json"
    os.mkfifo(fifo)
    with deadline():
        assert main(["estimate", "tiny-gemma3", "--gpu", "h100", "--catalog", str(fifo)]) == 2
    assert "is a FIFO, not a regular file" in one_line(capsys)


def test_catalog_with_a_byte_order_mark_and_a_date_note_still_reads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("\ufeff_meta: {date: 2024-05-01}\nh100: {price_per_hour: 3.5}\n", encoding="utf-8")
    assert load_catalog(str(path))["h100"].price_per_hour == 3.5


@pytest.mark.parametrize("text, message", [
    ('{"pools": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"pools": ' + "[" * 30 + "]" * 30 + "}", "nested too deeply"),
    ('{"pools": [[[1]]]}', "pool 0: needs 'gpu'"),
    ('{"pools": {"gpu": "h100"}}', "a non-empty list"),
    ('{"pools": [{"gpu": ["h100"], "count": 8}]}', "pool 0: needs 'gpu'"),
    ('{"pools": [{"gpu": "h100", "count": [8]}]}', "field 'count': must be a positive whole number"),
    ('{"pools": [{"gpu": "h100", "count": 8, "peak_flops": {"a": [1]}}]}', "field 'peak_flops': must be a number"),
])
def test_hostile_cluster_files_are_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "cluster.json"
    path.write_text(text)
    out = tmp_path / "art"
    assert main(["compile", "tiny-gemma3", "--cluster", str(path), "--tpot-slo", "50ms", "--context", "64",
                 "-o", str(out)]) == 2
    assert message in one_line(capsys)
    assert not out.exists()


# ---------------------------------------------------------------- 2. OPWEAVE_DEBUG_DIR

def _unwritable_debug_dirs(tmp_path) -> list[tuple[str, str]]:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [(str(a_file), "is not a folder"), (str(a_file / "sub"), "which is not a folder")]
    if os.path.isdir("/proc/1"):
        cases.append(("/proc/1", "cannot write files in /proc/1"))
    if os.geteuid() != 0:  # root writes in a folder whatever its mode
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((str(locked), "cannot write files in"))
    return cases


def test_bad_debug_dir_is_one_line_before_the_work(tmp_path, capsys, monkeypatch):
    import opweave.compiler.frontend as frontend

    monkeypatch.setattr(frontend, "run_front_end", lambda *a, **k: pytest.fail("the work started"))
    out = tmp_path / "art"
    for folder, message in _unwritable_debug_dirs(tmp_path):
        monkeypatch.setenv("OPWEAVE_DEBUG_DIR", folder)
        for argv in (["dump", "tiny-gemma3"], ["compile", "tiny-gemma3", *FAST, "--context", "64", "-o", str(out)]):
            assert main(argv) == 2
            line = one_line(capsys)
            assert "OPWEAVE_DEBUG_DIR=" in line and message in line, (folder, line)
    assert not out.exists()


def test_debug_dir_that_can_be_made_is_made(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "new" / "debug"
    monkeypatch.setenv("OPWEAVE_DEBUG_DIR", str(folder))
    assert main(["dump", "tiny-gemma3", "--what", "blocks"]) == 0
    assert sorted(os.listdir(folder)) == ["01_trace.txt", "02_blocks.txt"]


# ---------------------------------------------------------------- 3. calibration files

HEADER = "gpu,model,tp,batch,context,tpot_ms\n"
ROW = "h100,llama-3.1-8b,1,{batch},{context},{tpot}\n"


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes(("\ufeff" + HEADER + ROW.format(batch=1, context=512, tpot=7.5)).encode("utf-8"))
    (row,) = C.read_measurements(str(path), load_catalog())
    assert (row.gpu, row.batch, row.context, row.tpot_s) == ("h100", 1, 512, 0.0075)


@pytest.mark.parametrize("batch, context, tpot, tp, message", [
    ("1000000000", 512, 7.5, 1, "line 2: batch must be at most 1,048,576, got '1000000000'"),
    ("1e9", 512, 7.5, 1, "line 2: batch must be at most 1,048,576, got '1e9'"),
    (1, "99999999", 7.5, 1, "line 2: context must be at most 16,777,216"),
    (1, 512, "1e7", 1, "line 2: tpot_ms must be at most 1,000,000 (ms per output token)"),
    (1, 512, "inf", 1, "line 2: tpot_ms must be a positive number"),
    (1, 512, 7.5, 2048, "line 2: tp must be at most 1,024"),
    (1, "1e400", 7.5, 1, "line 2: context must be a positive whole number"),
])
def test_absurd_calibration_values_name_file_line_and_column(tmp_path, capsys, batch, context, tpot, tp, message):
    path = tmp_path / "m.csv"
    path.write_text(HEADER + ROW.format(batch=batch, context=context, tpot=tpot).replace(",1,", f",{tp},", 1))
    out = tmp_path / "out.json"
    assert main(["calibrate", str(path), "-o", str(out)]) == 2
    line = one_line(capsys)
    assert f"{path} {message}" in line, line
    assert not out.exists()


TRUE = {"mem_efficiency": 0.7, "kv_efficiency": 0.45, "step_overhead": 600e-6, "sequence_overhead": 25e-6,
        "collective_latency": 12e-6, "serial_fraction": 0.3, "launch_overhead": 3e-6}


@pytest.mark.slow
def test_two_hundred_thousand_rows_fit(tmp_path):
    """200,000 rows at distinct points (the fit's per-point and per-op arrays stay small);
    the measured times are the cost model's at known terms, which the fit recovers."""
    rng = np.random.default_rng(0)
    n, graphs = 200_000, {}
    roofline = load_catalog("roofline")
    # one model: every row has as many ops, so the launch overhead keeps its starting value
    truth = dataclasses.replace(roofline["h100"], **TRUE | {"launch_overhead": roofline["h100"].launch_overhead})
    rows = [C.Measurement(line=i + 2, gpu="h100", model="llama-3.1-8b", engine="", tp=int(tp), batch=int(b),
                          context=int(s), tpot_s=1.0)
            for i, (tp, b, s) in enumerate(zip(rng.choice([1, 2, 4], n), rng.integers(1, 257, n),
                                               rng.integers(64, 32769, n)))]
    tpot_ms = C.predict(C.params_of(truth), C.features(rows, truth, graphs)) * 1e3
    path = tmp_path / "big.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gpu", "model", "tp", "batch", "context", "tpot_ms"])
        w.writerows((r.gpu, r.model, r.tp, r.batch, r.context, f"{t:.9g}") for r, t in zip(rows, tpot_ms))
    cal = C.calibrate(str(path), roofline, logo=False, graphs=graphs)
    (fit,) = cal.fits
    assert fit.rows == n and len(fit.groups) == 3
    assert fit.held.keys() == {"launch_overhead"}
    for field in TRUE:
        assert fit.values[field] == pytest.approx(getattr(truth, field), rel=1e-3), field
    assert C.totals(cal)["after"]["max_abs"] < 1e-4


# ---------------------------------------------------------------- 4. negative flag values

@pytest.mark.parametrize("argv, message", [
    (["compile", "tiny-gemma3", "--cluster", "h100x2", "--tpot-slo", "-5ms", "--context", "64", "-o", "x"],
     "--tpot-slo must be positive, got '-5ms'"),
    (["compile", "tiny-gemma3", "--cluster", "h100x2", "--tpot-slo=-5ms", "--context", "64", "-o", "x"],
     "--tpot-slo must be positive, got '-5ms'"),
    (["compile", "tiny-gemma3", "--cluster", "h100x2", "--tpot-slo", "50ms", "--context", "-32k", "-o", "x"],
     "context length must be positive, got '-32k'"),
    (["compile", "tiny-gemma3", "--cluster", "h100x2", "--tpot-slo", "50ms", "--context", "64",
      "--prefill-chunk", "-5", "-o", "x"], "--prefill-chunk must be positive, got '-5'"),
    (["compile", "tiny-gemma3", "--cluster", "h100x2", "--tpot-slo", "50ms", "--context", "64",
      "--max-batch", "-3", "-o", "x"], "--max-batch must be at least 1, got -3"),
    (["estimate", "tiny-gemma3", "--gpu", "h100", "--batch", "-1,2"], "--batch must list positive whole numbers"),
    (["estimate", "tiny-gemma3", "--gpu", "h100", "--context", "-1k"], "context length must be positive"),
    (["profile", "--model", "tiny-gemma3", "-o", "p.json", "--batches", "-1,2"], "--batches must list positive"),
])
def test_negative_values_are_refused_as_values(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in one_line(capsys)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- 5. environment variables

@pytest.mark.parametrize("name, value, message", [
    ("OPWEAVE_CUDA_GRAPHS", "maybe", "OPWEAVE_CUDA_GRAPHS='maybe': expected 1, true, yes, on (on) or 0, false"),
    ("OPWEAVE_VERIFY", "2", "OPWEAVE_VERIFY='2': expected"),
    ("OPWEAVE_CHECK_SYNC", "enabled", "OPWEAVE_CHECK_SYNC='enabled': expected"),
    ("OPWEAVE_KERNELS", "cuda", "OPWEAVE_KERNELS='cuda': expected one of triton, torch"),
    ("OPWEAVE_FAULT_KILL", "one:2", "OPWEAVE_FAULT_KILL='one:2': expected RANK:ROUND"),
    ("OPWEAVE_FAULT_STALL", "-1:2", "OPWEAVE_FAULT_STALL='-1:2': RANK and ROUND must be 0 or more"),
])
def test_environment_values_are_checked_before_any_command(capsys, monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    assert main(["dump", "tiny-gemma3", "--what", "blocks"]) == 2
    assert message in one_line(capsys)


def test_bad_debug_flag_is_reported_without_a_traceback(capsys, monkeypatch):
    monkeypatch.setenv("OPWEAVE_DEBUG", "sometimes")
    assert main(["dump", "tiny-gemma3"]) == 2
    assert "OPWEAVE_DEBUG='sometimes'" in one_line(capsys)


def test_fault_aimed_at_a_rank_the_plan_lacks_is_refused_before_the_ranks(artifact, capsys, monkeypatch):
    monkeypatch.setenv("OPWEAVE_FAULT_KILL", "9:9")
    assert main(["run", artifact, "--weights", "random", "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    assert "OPWEAVE_FAULT_KILL='9:9': the plan has no rank 9 (ranks 0.." in one_line(capsys)


def test_triton_kernels_on_cpu_need_the_interpreter(artifact, capsys, monkeypatch):
    monkeypatch.setenv("OPWEAVE_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["run", artifact, "--weights", "random", "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    assert "OPWEAVE_KERNELS=triton on --device cpu needs TRITON_INTERPRET=1" in one_line(capsys)


# ---------------------------------------------------------------- 6. modes, keys, non-regular files

def _modes(folder: str) -> set[tuple[str, int]]:
    kinds = {stat.S_IMODE(os.stat(folder).st_mode)}
    return {("folder", m) for m in kinds} | {("file", stat.S_IMODE(os.stat(os.path.join(folder, n)).st_mode))
                                             for n in os.listdir(folder)}


@contextlib.contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def _key(path, mode: int) -> str:
    path.write_bytes(os.urandom(32))
    path.chmod(mode)
    return str(path)


@pytest.mark.slow
def test_artifact_modes_do_not_follow_the_umask(tmp_path, capsys):
    key = _key(tmp_path / "key", 0o600)
    with umask(0o000):
        assert main(["compile", "tiny-gemma3", *FAST, "--context", "64", "-o", str(tmp_path / "open")]) == 0
        assert main(["compile", "tiny-gemma3", *FAST, "--context", "64", "-o", str(tmp_path / "signed"),
                     "--sign-key", key]) == 0
    assert _modes(str(tmp_path / "open")) == {("folder", 0o755), ("file", 0o644)}
    assert _modes(str(tmp_path / "signed")) == {("folder", 0o700), ("file", 0o600)}


def test_key_files_others_may_read_are_refused(artifact, tmp_path, capsys):
    key = _key(tmp_path / "key", 0o644)
    out = tmp_path / "art"
    assert main(["compile", "tiny-gemma3", *FAST, "--context", "64", "-o", str(out), "--sign-key", key]) == 2
    assert f"--sign-key {key}: permissions 0644 for {key} are too open" in one_line(capsys)
    assert not out.exists()
    os.chmod(key, 0o640)
    assert main(["run", artifact, "--weights", "random", "--prompt-ids", "1", "--verify-key", key]) == 2
    assert "permissions 0640" in one_line(capsys)
    os.chmod(key, 0o400)
    assert len(read_key(key, "--verify-key")) == 32


def test_key_that_is_a_fifo_is_refused_unopened(tmp_path):
    fifo = tmp_path / "key"
    os.mkfifo(fifo, 0o600)
    with deadline(), pytest.raises(OpWeaveError, match="is a FIFO, not a regular file"):
        read_key(str(fifo), "--sign-key")


@pytest.mark.parametrize("kind", ["FIFO", "symlink to /dev/zero", "folder"])
def test_artifact_files_that_are_not_regular_files_are_named(artifact, tmp_path, capsys, kind):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    victim = art / "rank_00.py"
    victim.unlink()
    expected = {"FIFO": "is a FIFO", "symlink to /dev/zero": "is a character device", "folder": "is a folder"}[kind]
    if kind == "FIFO":
        os.mkfifo(victim)
    elif kind == "folder":
        victim.mkdir()
    else:
        victim.symlink_to("/dev/zero")
    with deadline():
        with pytest.raises(OpWeaveError, match=f"rank_00.py {expected}, not a regular file"):
            load_artifact(str(art))
        assert main(["run", str(art), "--weights", "random", "--prompt-ids", "1", "--max-new-tokens", "1"]) == 2
    line = one_line(capsys)
    assert f"rank_00.py {expected}, not a regular file" in line and "missing" not in line


def test_a_fifo_in_place_of_the_manifest_is_named(artifact, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    (art / "manifest.json").unlink()
    os.mkfifo(art / "manifest.json")
    with deadline(), pytest.raises(OpWeaveError, match="manifest.json is a FIFO, not a regular file"):
        load_artifact(str(art))
