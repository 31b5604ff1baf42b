"""Helpers shared by the benchmark scripts: provenance of a result and writing it."""

from __future__ import annotations

import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def git_commit() -> str:
    """Short hash of the checked-out commit (empty outside a git checkout)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=HERE).stdout.strip()


def emit(lines: list[str], path: str) -> None:
    """Prints a markdown report and writes it to `path`."""
    text = "\n".join(lines) + "\n"
    print(text)
    with open(path, "w") as f:
        f.write(text)
