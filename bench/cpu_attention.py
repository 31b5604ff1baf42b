"""CPU attention on one thread, the CPU kernels (`opweave.kernels.cpu`) beside the torch reference
(`opweave.kernels.paged`), on the serving benchmark's attention shape (16 query heads / 4 KV heads
of 64, pages of 16 positions scattered over the pool):
  - paged decode attention (the C kernel): --rows rows, every one at --position;
  - a prompt's first chunk of --chunk tokens (nothing cached before it): torch's fused causal
    attention (`causal_attention`) against the paged chunk reference.
Prints the median time per call of each, their ratio and the largest difference.

    python bench/cpu_attention.py [--rows 16] [--position 180] [--chunk 128] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from opweave.kernels import cpu as CPUK
from opweave.kernels import paged as PK


def _median_ms(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--position", type=int, default=180)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hq, hkv, d, page = 16, 4, 64, 16
    width = args.position // page + 1
    g = torch.Generator().manual_seed(0)
    pages = args.rows * width + 1
    k = torch.randn(pages, page, hkv, d, generator=g)
    v = torch.randn(pages, page, hkv, d, generator=g)
    table = torch.randperm(pages - 1, generator=g)[: args.rows * width].view(args.rows, width).int()
    pos = torch.full((args.rows,), args.position)
    q = torch.randn(args.rows, hq, d, generator=g)
    ref = _median_ms(lambda: PK.paged_decode_attention(q, k, v, table, pos, 0.125, width), args.calls)
    c = _median_ms(lambda: CPUK.paged_decode_attention(q, k, v, table, pos, 0.125, width), args.calls)
    diff = (PK.paged_decode_attention(q, k, v, table, pos, 0.125, width)
            - CPUK.paged_decode_attention(q, k, v, table, pos, 0.125, width)).abs().max().item()
    print(f"C kernels: {CPUK.status()}")
    print(f"{args.rows} rows at position {args.position}, one thread, median of {args.calls} calls: "
          f"torch {ref:.3f} ms, C {c:.3f} ms, torch / C = {ref / c:.1f}x; largest difference {diff:.2e}")

    t = args.chunk
    qc, kc, vc = (torch.randn(1, t, h, d, generator=g) for h in (hq, hkv, hkv))
    span = -(-t // page)
    ctable = table[:1, :span] if span <= width else torch.arange(span, dtype=torch.int32)[None]
    cpos = torch.arange(t)[None]
    kp, vp = (k, v) if span <= width else (torch.zeros(span + 1, page, hkv, d), torch.zeros(span + 1, page, hkv, d))
    ref_c = _median_ms(lambda: PK.paged_chunk_attention(qc, kc, vc, kp, vp, ctable, cpos, 0.125, span), args.calls)
    fused = _median_ms(lambda: CPUK.causal_attention(qc, kc, vc, 0.125), args.calls)
    diff = (PK.paged_chunk_attention(qc, kc, vc, kp, vp, ctable, cpos, 0.125, span)
            - CPUK.causal_attention(qc, kc, vc, 0.125)).abs().max().item()
    print(f"a first chunk of {t} tokens, one thread, median of {args.calls} calls: paged reference {ref_c:.3f} ms, "
          f"causal fused {fused:.3f} ms, reference / fused = {ref_c / fused:.1f}x; largest difference {diff:.2e}")


if __name__ == "__main__":
    main()
