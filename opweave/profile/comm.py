"""Point-to-point and all-reduce figures between two ranks, with the runtime's own transport.

Two processes join a torch.distributed group over 127.0.0.1 like `opweave run` does (gloo on
CPU, forked; NCCL on CUDA, spawned, one GPU each). Rank 0 times ping-pongs (`dist.send` then
`dist.recv` of a float32 tensor) and all-reduces; one-way time = median round trip / 2. The
samples are fitted to latency + bytes / bandwidth, weighting each size's relative error equally.
"""

from __future__ import annotations

import dataclasses
import queue as queue_mod
import socket
import statistics
import time

P2P_SIZES = tuple(2 ** k for k in range(10, 23, 2))
"""1 KiB .. 4 MiB in steps of 4x: from latency-bound to bandwidth-bound on loopback and NVLink."""

ALLREDUCE_SIZES = (2 ** 10, 2 ** 16, 2 ** 20)
"""1 KiB, 64 KiB, 1 MiB: a decode step all-reduces batch x hidden activations (KiBs to MiBs)."""

COMM_WARMUP = 2
COMM_REPS = 10
COMM_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkFit:
    latency_s: float
    bandwidth: float                        # bytes/s
    samples: tuple[tuple[int, float], ...]  # (bytes, seconds)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CommFigures:
    p2p: LinkFit
    allreduce: LinkFit


def fit_link(samples: list[tuple[int, float]] | tuple[tuple[int, float], ...]) -> LinkFit:
    """Least-squares fit of t = a + n / bw in relative error; falls back to the raw extremes
    (smallest message's time as latency, largest message's rate as bandwidth) when a fitted
    coefficient is not positive."""
    pts = sorted((int(n), float(t)) for n, t in samples)
    w = [1.0 / t ** 2 for _, t in pts]
    sw = sum(w)
    sx = sum(wi * n for wi, (n, _) in zip(w, pts))
    sy = sum(wi * t for wi, (_, t) in zip(w, pts))
    sxx = sum(wi * n * n for wi, (n, _) in zip(w, pts))
    sxy = sum(wi * n * t for wi, (n, t) in zip(w, pts))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if len(pts) > 1 and det > 0 else 0.0
    intercept = (sy - slope * sx) / sw
    bandwidth = 1.0 / slope if slope > 0 else pts[-1][0] / pts[-1][1]
    latency = intercept if intercept > 0 else pts[0][1]
    return LinkFit(latency_s=latency, bandwidth=bandwidth, samples=tuple(pts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comm_worker(rank: int, port: int, device: str, results) -> None:
    """One of the two ranks; rank 0 puts ("ok", {"p2p": [...], "allreduce": [...]}) on `results`."""
    import os

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=2)
        dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize(dev)

        out: dict[str, list] = {"p2p": [], "allreduce": []}
        for nbytes in P2P_SIZES:
            t = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
            times = []
            for _ in range(COMM_WARMUP + COMM_REPS):
                if rank == 0:
                    sync()
                    start = time.perf_counter()
                    dist.send(t, 1)
                    dist.recv(t, 1)
                    sync()
                    times.append(time.perf_counter() - start)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
            if rank == 0:
                out["p2p"].append((nbytes, statistics.median(times[COMM_WARMUP:]) / 2))
        for nbytes in ALLREDUCE_SIZES:
            t = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
            times = []
            for _ in range(COMM_WARMUP + COMM_REPS):
                sync()
                start = time.perf_counter()
                dist.all_reduce(t)
                sync()
                times.append(time.perf_counter() - start)
            if rank == 0:
                out["allreduce"].append((nbytes, statistics.median(times[COMM_WARMUP:])))
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", out))
    except Exception as e:  # reported by the parent as one line
        results.put(("error", f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())}"))
    results.close()
    results.join_thread()
    os._exit(0)


def measure_comm(device: str = "cpu", timeout_s: float = COMM_TIMEOUT_S) -> CommFigures:
    """Point-to-point and all-reduce figures between two ranks on this machine.

    Raises:
        RuntimeError: a rank failed or the measurement did not finish within `timeout_s`.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn" if device == "cuda" else "fork")  # CUDA cannot be used after fork
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_comm_worker, args=(r, port, device, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        try:
            kind, payload = results.get(timeout=timeout_s)
        except queue_mod.Empty:
            raise RuntimeError(f"no result within {timeout_s:.0f} s") from None
        if kind != "ok":
            raise RuntimeError(payload)
        return CommFigures(p2p=fit_link(payload["p2p"]), allreduce=fit_link(payload["allreduce"]))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
