"""What the long commands print: the results on stdout, progress lines ("  ... ") on stderr, and
nothing on stderr with --quiet; output folders printed once-slashed, counts in the right number."""

import contextlib
import io

import pytest

from opweave.cli import main
from opweave.cli.common import count, folder

PROGRESS = "  ... "


def _progress(err: str) -> list[str]:
    lines = err.splitlines()
    assert all(line.startswith(PROGRESS) for line in lines), lines  # nothing else on stderr
    return [line[len(PROGRESS):] for line in lines]


def test_folder_and_count_wording():
    assert folder("out") == folder("out/") == folder("out//") == folder("./out/") == "out/"
    assert count(1, "rank module") == "1 rank module" and count(18, "rank module") == "18 rank modules"
    assert count(0, "row") == "0 rows" and count(2, "replica set", "replica sets") == "2 replica sets"


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint, tmp_path_factory):
    """A compile of a tiny checkpoint on one GPU with its output folder given with a trailing slash,
    and what it printed."""
    out, checkpoint = tmp_path_factory.mktemp("progress") / "art", tiny_checkpoint("llama")
    stdout, stderr = io.StringIO(), io.StringIO()  # capsys is per test: this fixture is per module
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["compile", checkpoint, "--cluster", "h100x1", "--context", "64", "--tpot-slo", "1s",
                     "-o", f"{out}/"])
    assert code == 0, stderr.getvalue()
    return out, stdout.getvalue(), stderr.getvalue()


@pytest.mark.slow
def test_compile_says_each_step_and_writes_one_slash(compiled, tiny_checkpoint, tmp_path, capsys):
    out, stdout, stderr = compiled
    steps = [line.split(":")[0] for line in _progress(stderr)]
    for step in ("trace", "blocks", "search", "place", "plan", "lower", "render"):
        assert step in steps, steps
    assert steps.index("trace") < steps.index("search") < steps.index("render")
    assert f"wrote {out}/ (plan.json" in stdout and "//" not in stdout
    assert ", 1 rank module, manifest.json" in stdout  # one GPU: one rank
    assert main(["compile", tiny_checkpoint("llama"), "--cluster", "h100x2", "--context", "64", "--tpot-slo", "1s",
                 "-o", str(tmp_path / "quiet"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "wrote " in captured.out


@pytest.mark.slow
def test_dump_memory_says_each_rank_and_quiet_silences_it(compiled, capsys):
    out = str(compiled[0])
    assert main(["dump", out, "--what", "memory"]) == 0
    captured = capsys.readouterr()
    lines = _progress(captured.err)
    assert lines[0].startswith("tracing ") and any(line.startswith("rank 0 of ") for line in lines)
    assert "rank 0:" in captured.out and PROGRESS not in captured.out
    assert main(["dump", out, "--what", "memory", "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == captured.out


@pytest.mark.slow
def test_calibrate_says_what_it_traces_and_fits(tmp_path, capsys):
    rows = "".join(f"h100,llama-3.1-8b,1,{b},{s},{t}\n" for b, s, t in
                   ((1, 512, 7.1), (8, 512, 7.6), (32, 4096, 9.9), (64, 8192, 13.0), (16, 2048, 8.3)))
    path = tmp_path / "m.csv"
    path.write_text("gpu,model,tp,batch,context,tpot_ms\n" + rows)
    assert main(["calibrate", str(path), "-o", str(tmp_path / "c.json"), "--no-logo"]) == 0
    captured = capsys.readouterr()
    assert _progress(captured.err) == ["tracing llama-3.1-8b's decode step", "h100: fitting 5 rows"]
    assert "h100: 5 rows, 1 group\n" in captured.out and PROGRESS not in captured.out
    assert main(["calibrate", str(path), "-o", str(tmp_path / "q.json"), "--no-logo", "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out.replace("q.json", "c.json") == captured.out
