"""How long `opweave calibrate` takes on a large measurement file.

Writes N rows (default 200,000) made from the published decode measurements
(`bench/data/decode-measurements.csv`), each copy at a context moved by a few tokens so every row
is a distinct point, then runs `opweave calibrate` on it (leave-one-group-out included, as by
default) and reports the wall time, median of `--repeat` runs.

    python bench/calibrate_scale.py [--rows 200000] [--repeat 3] [--out bench/results/calibrate_scale.md]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import HERE, RunClock, emit, header_lines

MEASUREMENTS = os.path.join(HERE, "data", "decode-measurements.csv")


def write_rows(path: str, n: int) -> None:
    with open(MEASUREMENTS, newline="") as f:
        base = list(csv.DictReader(f))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(base[0]))
        w.writeheader()
        for i in range(n):
            row = dict(base[i % len(base)])
            row["context"] = str(int(row["context"]) + i // len(base))  # a distinct point per copy
            w.writerow(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="markdown report to write")
    args = ap.parse_args()
    clock = RunClock.start()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.csv")
        write_rows(path, args.rows)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "opweave", "calibrate", path, "-o",
                                   os.path.join(tmp, "catalog.json")], capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
    lines = header_lines("`opweave calibrate` on a large measurement file", sys.argv, clock)
    lines += [f"| rows | runs | wall s, median | min | max |", "|---|---|---|---|---|",
              f"| {args.rows:,} | {len(times)} | {statistics.median(times):.1f} | {min(times):.1f} | {max(times):.1f} |",
              "", "Each row is a published decode point (`bench/data/decode-measurements.csv`) at its own "
              "context; the time includes tracing the two Llama models and the leave-one-group-out check."]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
