"""Identical compiles give byte-identical artifact folders (but for compile-info.json).

Each compile runs `opweave compile` in its own process with the full search and a different
PYTHONHASHSEED, so nothing may depend on the wall clock, the host, or set and dict order.
"""

import json
import os
import subprocess
import sys

import pytest

ARGS = ["llama-3.1-8b", "--cluster", "h100x4+l40sx4", "--tpot-slo", "30ms", "--context", "8k", "--quiet"]
INFO = "compile-info.json"


def _compile(out, seed: int, extra=()) -> None:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    done = subprocess.run([sys.executable, "-m", "opweave", "compile", *ARGS, *extra, "-o", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("templates", ["all", "afd"])
@pytest.mark.slow
def test_two_compiles_are_byte_identical(tmp_path, templates):
    a, b = tmp_path / "a", tmp_path / "b"
    _compile(a, 1, ["--templates", templates])
    _compile(b, 2, ["--templates", templates])
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in ("plan.json", "plan.txt", "ir.txt", "trace.json", "gantt.png", "manifest.json", "rank_00.py",
                 "rank_00.json", INFO):
        assert name in names
    differ = [n for n in names if n != INFO and (a / n).read_bytes() != (b / n).read_bytes()]
    assert differ == []
    # the one file that may differ holds the wall-clock and host facts, and only those
    info = json.loads((a / INFO).read_text())
    assert info["search_seconds"] > 0 and "host" in info
    assert INFO not in json.loads((a / "manifest.json").read_text())["files"]
    plan = json.loads((a / "plan.json").read_text())
    assert "seconds" not in plan["counters"]
    if templates == "afd":
        assert len(plan["owners"]) == 2  # a cut between owners: sends, receives and the return in every file
