"""Planner vs runtime memory per GPU: what `opweave.cost.memory` plans and what the rank's modules
allocate when built on the meta device as the worker builds them (`opweave.profile.allocated`).

Real configs, no weights. Each model is placed as one colocated owner with one replica on TP
1/2/4/8 H100s, a fixed 16 state slots (batch 16, one microbatch), at 8K/32K/128K context. The
H100 is given unbounded memory so that plans which would not fit are still measured (the
"fits" column says whether the planned total fits an H100's usable memory). Activations are
planned for one prefill step (16 rows x the prefill chunk); their measured peak (running the
generated module once on meta tensors) is taken at 8K only: attention walks the cache in key
blocks, so at 128K one measurement takes minutes, and the figure does not grow with the context.
At 32K and 128K the allocated total adds the 8K measurement.

    python bench/memory.py [--out bench/results/memory.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

from opweave.compiler.frontend import run_front_end
from opweave.hardware.catalog import load_catalog
from opweave.profile.allocated import pinned_memory

MODELS = ("gemma-3-27b", "qwen3-next-80b-a3b", "llama-3.1-70b")
TPS = (1, 2, 4, 8)
CONTEXTS = (8192, 32768, 131072)
BATCH = 16
COMMAND = "python bench/memory.py --out bench/results/memory.md"


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def rows() -> list[str]:
    usable = load_catalog()["h100"].usable_memory_bytes
    out = []
    for name in MODELS:
        fe = run_front_end(name)
        for tp in TPS:
            measured = None
            for context in CONTEXTS:
                r = pinned_memory(fe, "colocated", [("h100", tp, 1)], batch=BATCH, microbatches=1,
                                  context=context, activations=measured is None, ranks=[0])[0]
                p, a = r.planned, r.allocated
                measured = a.activations if measured is None else measured
                allocated_total = a.weights + a.state + a.buffers + measured
                out.append(f"| {name} | {tp} | {context // 1024}K | {gb(p.weights)} | {gb(a.weights)} | "
                           f"{gb(p.state)} | {gb(a.state)} | {gb(p.activations)} | {gb(measured)} | {gb(p.total)} | "
                           f"{gb(allocated_total)} | {allocated_total / p.total:.3f} | "
                           f"{'yes' if p.total <= usable else 'no'} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here as well")
    args = parser.parse_args()
    t0 = time.time()
    table = rows()
    lines = [f"`{COMMAND}`", "",
             f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
             f"{platform.machine()} {platform.system()} (CPU, meta device), {time.time() - t0:.0f} s.", "",
             f"Per GPU (rank 0 of a colocated owner, one replica, batch {BATCH} = {BATCH} state slots), GB. "
             "Planned: `opweave.cost.memory`; allocated: the rank's modules built on meta as the worker builds "
             "them (weights, state), and the peak of one prefill step of the generated module run on meta "
             "(measured at 8K). "
             "Fits: the planned total within an H100's usable memory.", "",
             "| model | TP | context | weights plan | weights alloc | state plan | state alloc | activations plan "
             "| activations measured | total plan | total alloc | alloc/plan | fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *table]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
