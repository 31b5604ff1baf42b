"""Where commands write: `compile -o` folders, output files, and signals that end a command.

Nothing a user holds is lost (a folder that is not an artifact, the model's own folder), a bad
path is one line before any work, and an interrupted command leaves nothing half-written and
nothing hidden (`.opweave-*`).
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import opweave.compiler.compile as compile_module
from opweave.cli import main
from opweave.errors import Interrupted
from opweave.outputs import atomic_file
from opweave.signals import raising_on_signals

FAST = ["--cluster", "h100x2", "--tpot-slo", "50ms", "--templates", "colocated", "--max-batch", "4", "--quiet"]
SLOW_SEARCH = ["gemma-3-27b", "--cluster", "h100x8+l40sx8", "--tpot-slo", "100ms", "--context", "32k"]
"""A search of a few seconds that prints progress lines while it runs."""


def compile_argv(out, model="tiny-gemma3", context="64", *extra):
    return ["compile", model, *FAST, "--context", context, "-o", str(out), *extra]


def hidden(folder) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(".opweave-") or n.endswith(".tmp")]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def digest(folder) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def is_complete_artifact(folder) -> bool:
    manifest = json.loads((folder / "manifest.json").read_text())
    return set(manifest["files"]) == set(os.listdir(folder)) - {"manifest.json", "compile-info.json"}


@pytest.fixture
def no_search(monkeypatch):
    """Fails the test if the command got as far as the search (a path must be refused before)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the search started before the output path was checked")

    monkeypatch.setattr(compile_module, "compile_model", refuse)


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path):
    """A private copy of a tiny checkpoint, inside tmp_path/models (so its parent is ours too)."""
    folder = tmp_path / "models" / "ckpt"
    shutil.copytree(tiny_checkpoint("llama", num_hidden_layers=2), folder)
    return folder


# ---------------------------------------------------------------- compile -o DIR

def test_a_folder_of_user_files_is_refused_and_kept(tmp_path, capsys):
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("keep me")
    (user / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = digest(user)
    assert main(compile_argv(user)) == 2
    line = one_line(capsys)
    assert "holds no OpWeave artifact" in line and "--force" in line and "notes.txt" in line
    assert digest(user) == before and (user / "sub" / "data.bin").read_bytes() == b"\x00\x01"
    assert hidden(tmp_path) == []


def test_force_replaces_a_user_folder(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("old")
    assert main(compile_argv(user, "tiny-gemma3", "64", "--force")) == 0
    assert "notes.txt" not in os.listdir(user) and is_complete_artifact(user)
    assert hidden(tmp_path) == []


@pytest.mark.slow
def test_a_previous_artifact_is_replaced_without_a_word(tmp_path, capsys):
    out = tmp_path / "art"
    assert main(compile_argv(out, "tiny-gemma3", "64")) == 0
    assert main(compile_argv(out, "tiny-gemma3", "128")) == 0
    assert capsys.readouterr().err == ""
    assert json.loads((out / "plan.json").read_text())["context"] == 128 and is_complete_artifact(out)
    assert sorted(os.listdir(tmp_path)) == ["art"]


def test_an_artifact_holding_other_files_is_refused(tmp_path, capsys):
    out = tmp_path / "art"
    assert main(compile_argv(out)) == 0
    (out / "my-notes.md").write_text("results")
    capsys.readouterr()
    assert main(compile_argv(out)) == 2
    assert "my-notes.md" in one_line(capsys)
    assert (out / "my-notes.md").read_text() == "results"


def test_an_empty_folder_is_filled(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(compile_argv(out)) == 0
    assert is_complete_artifact(out) and hidden(tmp_path) == []


@pytest.mark.parametrize("where", ["checkpoint", "its parent"])
def test_force_never_replaces_the_model(checkpoint, tmp_path, capsys, where):
    out = checkpoint if where == "checkpoint" else checkpoint.parent
    weights = checkpoint / "model.safetensors"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert main(compile_argv(out, str(checkpoint), "64", "--force")) == 2
    assert "an input of this command" in one_line(capsys)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == before
    assert hidden(checkpoint.parent) == [] and hidden(tmp_path) == []


def test_write_artifact_itself_refuses_the_model_folder(checkpoint, tmp_path, capsys):
    """The check in write_artifact holds even for callers that skip the CLI's early one."""
    from opweave.compiler.compile import compile_model
    from opweave.errors import OpWeaveError
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.passes.search import SearchOptions

    compiled = compile_model(str(checkpoint), parse_cluster("h100x2", load_catalog()), 0.05, 64,
                             SearchOptions(batches=(4,), templates="colocated"))
    with pytest.raises(OpWeaveError, match="an input of this command"):
        compile_module.write_artifact(str(checkpoint), compiled, force=True)
    assert (checkpoint / "model.safetensors").exists() and hidden(checkpoint.parent) == []


def _bad_outputs(tmp_path, monkeypatch):
    """name -> (-o value, extra args, message); the current folder is tmp_path/work."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".profile").write_text("x")
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "a-file").write_text("x")
    return {
        "current folder": (".", ["--force"], "current folder"),
        "a parent of it": ("..", ["--force"], "holding the current folder"),
        "empty name": ("", [], "needs a folder name"),
        "missing parent": (str(tmp_path / "no" / "out"), [], "does not exist"),
        "a file": (str(tmp_path / "a-file"), [], "not a folder"),
        "home": (str(home), ["--force"], "home folder"),
        "root": ("/", ["--force"], "root folder"),
    }


@pytest.mark.parametrize("case", ["current folder", "a parent of it", "empty name", "missing parent", "a file",
                                  "home", "root"])
def test_bad_output_folder_is_one_line_before_the_search(tmp_path, monkeypatch, capsys, no_search, case):
    out, extra, message = _bad_outputs(tmp_path, monkeypatch)[case]
    assert main(["compile", "tiny-gemma3", *FAST, "--context", "64", "-o", out, *extra]) == 2
    line = one_line(capsys)
    assert line.startswith("opweave: error: -o") and message in line, line
    assert (tmp_path / "work" / "keep.txt").exists() and (tmp_path / "home" / ".profile").exists()
    assert hidden(tmp_path) == [] and hidden(tmp_path / "work") == []


def test_unwritable_parent_is_one_line(tmp_path, capsys, no_search):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        assert main(compile_argv(locked / "out")) == 2
        assert "not writable" in one_line(capsys)
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o700)


# ---------------------------------------------------------------- signals

def _kill_self_after(monkeypatch, target, name, signum):
    """Makes `target.name` send `signum` to this process once it has run."""
    real = getattr(target, name)
    sent = []

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        if not sent:
            assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN), "no handler installed"
            sent.append(signum)
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # let the handler run here if nothing holds it back
        return result

    monkeypatch.setattr(target, name, wrapped)
    return sent


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
@pytest.mark.parametrize("previous", [False, True])
@pytest.mark.slow
def test_signal_while_writing_leaves_nothing(tmp_path, monkeypatch, capsys, signum, code, previous):
    out = tmp_path / "art"
    if previous:
        assert main(compile_argv(out, "tiny-gemma3", "64")) == 0
        before = digest(out)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    _kill_self_after(monkeypatch, compile_module, "write_schedule", signum)
    capsys.readouterr()
    assert main(compile_argv(out, "tiny-gemma3", "128")) == code
    assert one_line(capsys) == f"opweave: interrupted ({signal.Signals(signum).name})"
    assert hidden(tmp_path) == []
    if previous:
        assert digest(out) == before
    else:
        assert not out.exists()
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # restored for the caller


@pytest.mark.slow
def test_a_signal_during_the_swap_waits_until_it_is_done(tmp_path, monkeypatch, capsys):
    """The renames that swap the new artifact in run with signals held back: the signal ends the
    command right after, with the new artifact whole in place and nothing hidden."""
    out = tmp_path / "art"
    assert main(compile_argv(out, "tiny-gemma3", "64")) == 0
    sent = _kill_self_after(monkeypatch, os, "rename", signal.SIGTERM)
    assert main(compile_argv(out, "tiny-gemma3", "128")) == 143
    assert sent and "interrupted (SIGTERM)" in capsys.readouterr().err
    assert json.loads((out / "plan.json").read_text())["context"] == 128 and is_complete_artifact(out)
    assert sorted(os.listdir(tmp_path)) == ["art"]


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.slow
def test_a_compile_killed_during_the_search(tmp_path, signum, code):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "opweave", "compile", *SLOW_SEARCH, "-o", str(out)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        steps = [proc.stderr.readline() for _ in range(4)]  # the steps before it, then the search under way
        assert [line.split(":")[0] for line in steps[:3]] == ["  ... trace", "  ... blocks", "  ... search"], steps
        assert steps[3].startswith("  ... templates"), steps
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code
    lines = [ln for ln in err.splitlines() if not ln.startswith("  ... ")]
    assert lines == [f"opweave: interrupted ({signal.Signals(signum).name})"]
    assert os.listdir(tmp_path) == []


def test_handlers_respect_ignored_signals_and_forked_children():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with raising_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
            pid = os.fork()
            if pid == 0:  # a rank forked by the launcher dies of SIGTERM as before
                os._exit(0 if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            with pytest.raises(Interrupted):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)


# ---------------------------------------------------------------- output files

@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("outputs") / "art"
    assert main(compile_argv(out)) == 0
    return out


def _sentinel(monkeypatch, module: str, name: str) -> None:
    import importlib

    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran before the output path was checked")

    monkeypatch.setattr(importlib.import_module(module), name, refuse)


@pytest.mark.parametrize("command,where", [
    *[(c, w) for c in ("analyze --plot", "run --trace", "profile -o", "demo --out")
      for w in ("a folder", "missing parent")],
    ("run --trace", "an input"),  # the artifact's own trace.json
])
def test_bad_output_file_is_one_line_before_the_work(artifact, tmp_path, monkeypatch, capsys, command, where):
    path = {"a folder": str(tmp_path), "missing parent": str(tmp_path / "no" / "f.out"),
            "an input": str(artifact / "trace.json")}[where]
    if command == "demo --out" and where == "a folder":
        path = str(tmp_path / "a-file")
        (tmp_path / "a-file").write_text("x")
    argv = {"analyze --plot": ["analyze", "tiny-gemma3", "--plot", path],
            "run --trace": ["run", str(artifact), "--weights", "random", "--prompt-ids", "1", "--trace", path],
            "profile -o": ["profile", "--model", "tiny-gemma3", "-o", path],
            "demo --out": ["demo", "--out", path]}[command]
    _sentinel(monkeypatch, "opweave.cost.analysis", "analyze")
    _sentinel(monkeypatch, "opweave.runtime.launch", "run_detailed")
    _sentinel(monkeypatch, "opweave.profile.measure", "profile")
    _sentinel(monkeypatch, "opweave.compiler.compile", "compile_model")
    before = digest(artifact)
    assert main(argv) == 2
    line = one_line(capsys)
    flag = command.split()[1]
    assert line.startswith(f"opweave: error: {flag} {path}:"), line
    assert {"a folder": "folder", "missing parent": "does not exist", "an input": "an input"}[where] in line
    assert digest(artifact) == before


def test_atomic_file_keeps_the_old_file_when_interrupted(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(str(path)) as f:
            f.write("half of the new")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    with atomic_file(str(path)) as f:
        f.write("new")
    mask = os.umask(0)
    os.umask(mask)
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_plot_is_written_whole(tmp_path, capsys):
    plot = tmp_path / "g.png"
    assert main(["analyze", "tiny-gemma3", "--context", "1k,4k", "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:4] == b"\x89PNG" and os.listdir(tmp_path) == ["g.png"]
