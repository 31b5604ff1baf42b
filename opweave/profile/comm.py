"""Point-to-point and all-reduce figures between two ranks, with the runtime's own transport.

Two processes join a torch.distributed group over 127.0.0.1 like `opweave run` does (gloo on
CPU, forked; NCCL on CUDA, spawned, one GPU each). Rank 0 times ping-pongs (`dist.send` then
`dist.recv` of a float32 tensor) and all-reduces (on CPU each after ALLREDUCE_GAP_S of compute,
as in a decode step; mean of ALLREDUCE_REPS); one-way time = median round trip / 2. The samples are fitted to latency + bytes / bandwidth, weighting each size's relative error equally.
On CPU it also times the host side of a runtime transfer (packing and posting; receiving and
unpacking an arrived message), which a rank's only core spends outside its operators.
"""

from __future__ import annotations

import dataclasses
import os
import queue as queue_mod
import shutil
import statistics
import tempfile
import time

P2P_SIZES = tuple(2 ** k for k in range(10, 23, 2))
"""1 KiB .. 4 MiB in steps of 4x: from latency-bound to bandwidth-bound on loopback and NVLink."""

ALLREDUCE_SIZES = (2 ** 10, 2 ** 16, 2 ** 20)
"""1 KiB, 64 KiB, 1 MiB: a decode step all-reduces batch x hidden activations (KiBs to MiBs)."""

COMM_WARMUP = 2
COMM_REPS = 10
ALLREDUCE_REPS = 30
"""All-reduces after compute take either a fast path or a slow one (0.6 ms or 3-5 ms here), so
their figure is the mean of more repetitions: a step pays the mean."""
COMM_TIMEOUT_S = 120.0
ALLREDUCE_GAP_S = 0.003
"""CPU: each timed all-reduce follows this much compute on both ranks, as a TP group's
collectives do in a decode step (a CPU step's ops run for milliseconds between two). Measured on
a 2-core VM, a 16 KB gloo all-reduce took a median 0.65 ms back to back, 1.1 ms after 1 ms of
compute and 2.5 ms after 3 ms (the ranks' transport threads have gone idle, and each rank waits
for the other's late start); a TP-2 run paid about 3 ms per collective."""
HOST_SETTLE_S = 0.002


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkFit:
    latency_s: float
    bandwidth: float                        # bytes/s
    samples: tuple[tuple[int, float], ...]  # (bytes, seconds)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CommFigures:
    p2p: LinkFit
    allreduce: LinkFit
    send_host: LinkFit | None = None   # host time of packing and posting one transfer (CPU ranks)
    recv_host: LinkFit | None = None   # host time of taking in one transfer that has arrived


HOST_ROWS = 2
"""Rows of the messages whose host cost is timed (a decode microbatch share)."""


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


def _comm_worker(rank: int, store_path: str, device: str, results) -> None:
    """One of the two ranks; rank 0 puts ("ok", {"p2p": [...], "allreduce": [...]}) on `results`.
    The ranks meet through a file store in a private folder and talk over loopback (as `opweave
    run` does): nothing listens on a network interface."""
    import os

    try:
        import torch
        import torch.distributed as dist

        from opweave.runtime.launch import use_loopback_interface

        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank)
        use_loopback_interface()
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.FileStore(store_path, 2),
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
            for _ in range(COMM_WARMUP + ALLREDUCE_REPS):
                if device == "cpu":
                    _compute_for(ALLREDUCE_GAP_S, torch)
                sync()
                start = time.perf_counter()
                dist.all_reduce(t)
                sync()
                times.append(time.perf_counter() - start)
            if rank == 0:
                out["allreduce"].append((nbytes, statistics.fmean(times[COMM_WARMUP:])))
        if device == "cpu":
            out["send_host"], out["recv_host"] = _host_times(rank, dist, torch)
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", out))
    except Exception as e:  # reported by the parent as one line
        results.put(("error", f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())}"))
    results.close()
    results.join_thread()
    os._exit(0)


def _compute_for(seconds: float, torch) -> None:
    """Keeps this rank's core busy with matrix products for `seconds`."""
    a, x = torch.ones(256, 256), torch.ones(4, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x @ a


def _host_times(rank: int, dist, torch) -> tuple[list, list]:
    """Rank 0's host seconds per side of a runtime transfer, per message size (CPU ranks).

    Send side: `pack_message` of a decode-sized message and posting the `isend` (the peer takes it
    in, then acknowledges, so each sample starts from an idle connection). Receive side: the peer
    sends, rank 0 lets it arrive, then times the `recv` and `unpack_message` into a fresh tensor,
    as the runtime does."""
    from opweave.runtime.message import message_bytes, pack_message, unpack_message

    sends, recvs = [], []
    ack = torch.zeros(1, dtype=torch.long)
    for nbytes in P2P_SIZES:
        per_row = max(1, nbytes // (HOST_ROWS * 4))
        positions = torch.zeros(1, HOST_ROWS, dtype=torch.long)
        value = torch.zeros(HOST_ROWS, 1, per_row)
        word = torch.zeros(HOST_ROWS, 3, dtype=torch.long)
        size = message_bytes(HOST_ROWS, HOST_ROWS, per_row * 4)
        times_send, times_recv = [], []
        for i in range(COMM_WARMUP + COMM_REPS):
            buffer = torch.empty(size, dtype=torch.uint8)
            if rank == 0:
                start = time.perf_counter()
                work = dist.isend(pack_message(positions, word, [value]), 1)
                times_send.append(time.perf_counter() - start)
                work.wait()
                dist.recv(ack, 1)
                time.sleep(HOST_SETTLE_S + size / 1e9)  # the peer's message arrives meanwhile
                start = time.perf_counter()
                dist.recv(buffer, 1)
                _, _, payload = unpack_message(buffer, HOST_ROWS, HOST_ROWS, torch.float32)
                torch.zeros(HOST_ROWS, 1, per_row).view(-1).copy_(payload)
                times_recv.append(time.perf_counter() - start)
            else:
                dist.recv(buffer, 0)
                dist.send(ack, 0)
                dist.send(pack_message(positions, word, [value]), 0)
        if rank == 0:
            sends.append((size, statistics.median(times_send[COMM_WARMUP:])))
            recvs.append((size, statistics.median(times_recv[COMM_WARMUP:])))
    return sends, recvs


def measure_comm(device: str = "cpu", timeout_s: float = COMM_TIMEOUT_S) -> CommFigures:
    """Point-to-point and all-reduce figures between two ranks on this machine.

    Raises:
        RuntimeError: a rank failed or the measurement did not finish within `timeout_s`.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn" if device == "cuda" else "fork")  # CUDA cannot be used after fork
    results = ctx.Queue()
    folder = tempfile.mkdtemp(prefix="opweave-profile-")  # 0700
    procs = [ctx.Process(target=_comm_worker, args=(r, os.path.join(folder, "store"), device, results), daemon=True)
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        try:
            kind, payload = results.get(timeout=timeout_s)
        except queue_mod.Empty:
            raise RuntimeError(f"no result within {timeout_s:.0f} s") from None
        if kind != "ok":
            raise RuntimeError(payload)
        host = {k: fit_link(payload[k]) if payload.get(k) else None for k in ("send_host", "recv_host")}
        return CommFigures(p2p=fit_link(payload["p2p"]), allreduce=fit_link(payload["allreduce"]), **host)
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(folder, ignore_errors=True)
