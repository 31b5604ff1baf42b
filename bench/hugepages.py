"""Huge pages under a CPU rank's weights (`opweave.runtime.hugepages`): the GEMMs of one decode step
of the serving benchmark's model (`bench/serve_peer.py`: hidden 1024, 8 layers, 16/4 heads of 64,
intermediate 2816, vocab 32000, float32), packed as a rank packs them (q/k/v and gate/up fused,
oneDNN's layout, `kernel_ops.pack_cpu_gemms`), timed on one thread with OPWEAVE_HUGE_PAGES=1 and =0.

Each measurement is a fresh process (the switch is read when the weights are in place), the two
settings interleaved --repeats times; each process times --passes passes over the step's GEMMs at
16 rows (a decode round of 16 sequences; the LM head at 16 rows too) and at 144 rows (16 decode
rows and a 128-token prompt chunk; the LM head at its 17 live rows), and reports the median pass.

    python bench/hugepages.py [--repeats 5] [--passes 30] [--out bench/results/hugepages.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import RunClock, emit, header_lines  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 2816, 8, 16, 4, 64, 32000
ROWS = (16, 144)


def _child(passes: int) -> dict:
    import torch

    from opweave.kernels.reference import linear, pack_linear
    from opweave.runtime.hugepages import anon_huge_bytes, back_with_huge_pages

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN), (HIDDEN, 2 * INTER),
              (INTER, HIDDEN)] * LAYERS
    weights = [pack_linear(torch.randn(n, k, generator=g) * 0.02) for k, n in shapes]
    head = pack_linear(torch.randn(VOCAB, HIDDEN, generator=g) * 0.02)
    done = back_with_huge_pages()
    out = {"collapsed_mb": done.collapsed / 2**20, "skipped": done.skipped, "anon_huge_mb": anon_huge_bytes() / 2**20}
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, generator=g) for k, _ in shapes}
        live = torch.randn(min(rows, 17), HIDDEN, generator=g)

        def one_pass():
            for (k, _), w in zip(shapes, weights):
                linear(xs[k], w)
            linear(live, head)

        one_pass()
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - t0)
        out[f"ms_{rows}"] = statistics.median(times) * 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.passes)))
        return 0
    if args.repeats < 1 or args.passes < 1:
        print("hugepages.py: --repeats and --passes must be at least 1", file=sys.stderr)
        return 2
    clock = RunClock.start()
    runs = []
    for r in range(args.repeats):
        for setting in ("1", "0"):
            env = dict(os.environ, OPWEAVE_HUGE_PAGES=setting, OMP_NUM_THREADS="1")
            proc = subprocess.run([sys.executable, __file__, "--child", "--passes", str(args.passes)], env=env,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"hugepages.py: the measuring process failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}",
                      file=sys.stderr)
                return 1
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            res.update(repeat=r + 1, huge=setting == "1")
            runs.append(res)
            print(f"repeat {r + 1}, huge pages {'on ' if res['huge'] else 'off'}: "
                  + ", ".join(f"{rows} rows {res[f'ms_{rows}']:.1f} ms" for rows in ROWS)
                  + f" (collapsed {res['collapsed_mb']:.0f} MB)", flush=True)
    lines = header_lines("Huge pages under a CPU rank's packed GEMM weights", sys.argv, clock)
    lines += ["", f"One decode step's GEMMs of the serving benchmark's model ({LAYERS} layers, hidden {HIDDEN}, "
              f"intermediate {INTER}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, vocab {VOCAB}, float32: "
              f"{(sum(k * n for k, n in [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]) * LAYERS + VOCAB * HIDDEN) * 4 / 1e6:.0f} MB "
              "of weights), packed as a rank packs them, one thread; each line a fresh process, the settings "
              f"interleaved; median of {args.passes} passes each.", "",
              "| repeat | huge pages | MB collapsed | " + " | ".join(f"{r} rows ms" for r in ROWS) + " |",
              "|---:|---|---:|" + "---:|" * len(ROWS)]
    for res in runs:
        lines.append(f"| {res['repeat']} | {'on' if res['huge'] else 'off'} | {res['collapsed_mb']:.0f} | "
                     + " | ".join(f"{res[f'ms_{r}']:.1f}" for r in ROWS) + " |")
    lines += ["", "Medians over the repeats, and on / off (below 1: faster with huge pages; each repeat's ratio "
              "in brackets):", "", "| rows | on ms | off ms | on / off |", "|---:|---:|---:|---:|"]
    for rows in ROWS:
        on = [x[f"ms_{rows}"] for x in runs if x["huge"]]
        off = [x[f"ms_{rows}"] for x in runs if not x["huge"]]
        ratios = [a / b for a, b in zip(on, off)]
        lines.append(f"| {rows} | {statistics.median(on):.1f} | {statistics.median(off):.1f} | "
                     f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)}) |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
