"""Helpers shared by the benchmark scripts: provenance of a result and writing it."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def git_commit() -> str:
    """Hash of the checked-out commit, flagged when the working tree has uncommitted changes
    ("unknown" outside a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True).stdout.strip()
        return head + (" (working tree has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def emit(lines: list[str], path: str | None) -> None:
    """Prints a markdown report and, with a path, writes it there."""
    text = "\n".join(lines) + "\n"
    print(text)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class RunClock:
    """When a benchmark started, the load average then, and a wall clock for its runtime."""

    started: datetime.datetime
    load_before: tuple[float, float, float]
    t0: float

    @classmethod
    def start(cls) -> "RunClock":
        return cls(datetime.datetime.now(datetime.timezone.utc), os.getloadavg(), time.perf_counter())

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def header_lines(title: str, argv: list[str], clock: RunClock, commit: str | None = None) -> list[str]:
    """A result file's provenance header: date, machine, load before/after, commit, command, runtime."""
    load_after = os.getloadavg()
    return [
        f"# {title}",
        "",
        f"- date: {clock.started.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in clock.load_before)}, after: "
        f"{' '.join(f'{x:.2f}' for x in load_after)} (other processes share this machine; times are wall times)",
        f"- git commit: {commit or git_commit()}",
        f"- command: `{' '.join(shlex.quote(a) for a in argv)}` (from the repository root)",
        f"- total runtime: {clock.elapsed():.0f} s",
        "",
    ]
