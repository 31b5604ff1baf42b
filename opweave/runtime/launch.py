"""`opweave run`: starts one process per rank of the artifact and collects the generated tokens.

Processes are forked on this machine and joined with torch.distributed (gloo on CPU, NCCL on
CUDA) over loopback. The launcher watches them: if a rank fails or dies, the others are killed
within seconds and the error names the rank. For clusters of several nodes it prints the
`torchrun` command for each node instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue as queue_mod
import socket
import time
import traceback

from opweave.errors import OpWeaveError
from opweave.runtime.manifest import verify_manifest
from opweave.runtime.scheduler import Request

POLL_S = 0.05
KILL_GRACE_S = 2.0
ROOT_CAUSE_WAIT_S = 0.5


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A validated `opweave run`."""

    artifact: str
    weights: str              # checkpoint folder or "random"
    device: str               # cpu | cuda
    requests: tuple[Request, ...]
    timeout_s: float = 3600.0
    interpret: bool = False   # run the op-by-op interpreter instead of the generated modules
    port: int | None = None   # rendezvous port on loopback (default: a free one); set k uses port + k
    trace: bool = False       # record every rank's spans (opweave.runtime.timeline)
    replica_sets: int = 1     # independent copies of the plan's ranks, requests dealt round-robin

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise OpWeaveError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.weights != "random" and not os.path.isdir(self.weights):
            raise OpWeaveError(f"--weights {self.weights}: not a checkpoint folder (or use --weights random)")
        if not self.requests:
            raise OpWeaveError("no prompts: give --prompts FILE.jsonl or --prompt-ids 1,2,3")
        if self.replica_sets < 1:
            raise OpWeaveError(f"--replica-sets must be at least 1, got {self.replica_sets}")


def world_size(artifact: str) -> int:
    n = sum(1 for name in os.listdir(artifact) if name.startswith("rank_") and name.endswith(".json"))
    if n == 0:
        raise OpWeaveError(f"{artifact}: the artifact has no rank programs (was the model a model.py?)")
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(cfg: RunConfig, rank: int, world: int, port: int, results, replica_set: int = 0) -> None:
    import torch
    import torch.distributed as dist

    from opweave.runtime.worker import run_rank

    try:
        torch.set_num_threads(1)
        verify_manifest(cfg.artifact, [f"rank_{rank:02d}.py", f"rank_{rank:02d}.json", "model_config.json",
                                       "ops.json", "plan.json"])
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.device == "cuda":
            torch.cuda.set_device((replica_set * world + rank) % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        out = run_rank(cfg.artifact, rank, cfg.weights, cfg.device, list(cfg.requests), cfg.interpret,
                       cfg.trace)
        if rank == 0:
            outputs, stats = out
            results.put(("done", (replica_set, rank), ([dataclasses.asdict(r) for r in outputs], stats)))
        dist.destroy_process_group()
    except Exception as e:  # report to the launcher in one line, then exit non-zero
        from opweave.errors import OpWeaveError as UserError

        detail = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, UserError) and os.environ.get("OPWEAVE_DEBUG"):
            detail += "\n" + traceback.format_exc()
        results.put(("error", (replica_set, rank),
                     detail.splitlines()[0] if not os.environ.get("OPWEAVE_DEBUG") else detail))
        results.close()
        results.join_thread()  # flush the message before exiting
        os._exit(1)
    results.close()
    results.join_thread()
    os._exit(0)


def run(cfg: RunConfig) -> list[Request]:
    """Runs every rank to completion; returns the requests with their generated tokens."""
    return run_detailed(cfg)[0]


def run_detailed(cfg: RunConfig) -> tuple[list[Request], dict]:
    """`run`, plus rank 0's per-round wall and host times (and every rank's spans with `cfg.trace`);
    with several replica sets, those of set 0, and `stats["replica_sets"]` holds every set's."""
    import multiprocessing as mp

    verify_manifest(cfg.artifact)
    world = world_size(cfg.artifact)
    planned = planned_replica_sets(cfg.artifact)
    if cfg.replica_sets > planned:
        raise OpWeaveError(f"--replica-sets {cfg.replica_sets}: the plan places {planned} replica set(s)")
    if cfg.device == "cuda":
        import torch

        need = world * cfg.replica_sets
        if not torch.cuda.is_available() or torch.cuda.device_count() < need:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            what = (f"the plan has {world} ranks" if cfg.replica_sets == 1 else
                    f"{cfg.replica_sets} replica sets of {world} ranks need {need} CUDA devices")
            raise OpWeaveError(f"{what} but this machine has {have} CUDA device(s); use --device cpu for a tiny "
                               "model, or run the torchrun commands per node")
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    sets = _deal(cfg.requests, cfg.replica_sets)
    procs: dict[tuple[int, int], object] = {}
    for k, (requests, _) in enumerate(sets):
        port = cfg.port + k if cfg.port else _free_port()
        mine = dataclasses.replace(cfg, requests=requests)
        for r in range(world):
            procs[(k, r)] = ctx.Process(target=_worker, args=(mine, r, world, port, results, k), daemon=True)
    for p in procs.values():
        p.start()
    try:
        done = _watch(procs, results, cfg.timeout_s, len(sets))
    finally:
        _stop(list(procs.values()))
    outputs = []
    for k, (_, original) in enumerate(sets):
        outputs += [dataclasses.replace(r, index=original[r.index]) for r in done[k][0]]
    stats = dict(done[0][1])
    if len(sets) > 1:
        stats["replica_sets"] = [done[k][1] for k in range(len(sets))]
    return sorted(outputs, key=lambda r: r.index), stats


def planned_replica_sets(artifact: str) -> int:
    try:
        with open(os.path.join(artifact, "plan.json")) as f:
            return max(1, int(json.load(f).get("replica_sets", 1)))
    except (OSError, ValueError, TypeError):
        return 1


def _deal(requests: tuple[Request, ...], sets: int) -> list[tuple[tuple[Request, ...], list[int]]]:
    """Requests round-robin over the replica sets (no more sets than requests), each set's
    re-numbered from 0 so its own schedulers share them evenly; with the original indices."""
    sets = max(1, min(sets, len(requests)))
    out = []
    for k in range(sets):
        mine = [r for i, r in enumerate(requests) if i % sets == k]
        out.append((tuple(dataclasses.replace(r, index=j) for j, r in enumerate(mine)), [r.index for r in mine]))
    return out


def _name(key: tuple[int, int], sets: int) -> str:
    return f"rank {key[1]}" if sets == 1 else f"replica set {key[0]}, rank {key[1]}"


def _watch(procs: dict, results, timeout_s: float, sets: int) -> dict[int, tuple[list[Request], dict]]:
    start = time.monotonic()
    done: dict[int, tuple[list[Request], dict]] = {}
    errors: dict[tuple[int, int], str] = {}
    while True:
        try:
            kind, key, payload = results.get(timeout=POLL_S)
            if kind == "error":
                errors.setdefault(tuple(key), payload)
            else:
                done[key[0]] = ([Request(**r) for r in payload[0]], payload[1])
        except queue_mod.Empty:
            pass
        if errors or any(p.exitcode not in (None, 0) for p in procs.values()):
            raise OpWeaveError(_root_cause(procs, results, errors, sets))
        if len(done) == sets and all(p.exitcode == 0 for p in procs.values()):
            return done
        if time.monotonic() - start > timeout_s:
            raise OpWeaveError(f"the run did not finish within {timeout_s:.0f} s")


def _root_cause(procs: dict, results, errors: dict[tuple[int, int], str], sets: int) -> str:
    """The failure to report: a rank that died without a word (killed) before the errors its
    peers then raise (lost connections), else the first error reported."""
    deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
    while time.monotonic() < deadline:
        try:
            kind, key, payload = results.get(timeout=POLL_S)
            if kind == "error":
                errors.setdefault(tuple(key), payload)
        except queue_mod.Empty:
            pass
    for key, p in procs.items():
        if p.exitcode is not None and p.exitcode < 0 and key not in errors:
            return f"{_name(key, sets)} died (killed by signal {-p.exitcode})"
    if errors:
        key = min(errors, key=lambda k: ("Connection closed" in errors[k] or "connection" in errors[k].lower(), k))
        return f"{_name(key, sets)} failed: {errors[key]}"
    key = next(k for k, p in procs.items() if p.exitcode not in (None, 0))
    return f"{_name(key, sets)} died (exit code {procs[key].exitcode})"


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def read_requests(prompts_file: str | None, prompt_ids: str | None, max_new_tokens: int) -> tuple[Request, ...]:
    """Requests from a JSONL file ({"prompt_ids": [...], "max_new_tokens": N}) or one id list."""
    if max_new_tokens <= 0:
        raise OpWeaveError("--max-new-tokens must be positive")
    prompts: list[tuple[list[int], int]] = []
    if prompt_ids:
        try:
            prompts.append(([int(x) for x in prompt_ids.split(",") if x.strip()], max_new_tokens))
        except ValueError:
            raise OpWeaveError(f"--prompt-ids: not a comma-separated list of token ids: {prompt_ids}") from None
    if prompts_file:
        try:
            with open(prompts_file) as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    ids = item["prompt_ids"]
                    if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                        raise ValueError("prompt_ids must be a list of token ids")
                    prompts.append((ids, int(item.get("max_new_tokens", max_new_tokens))))
        except OSError as e:
            raise OpWeaveError(f"--prompts {prompts_file}: cannot read ({e.strerror})") from None
        except (ValueError, KeyError, TypeError) as e:
            raise OpWeaveError(f"--prompts {prompts_file}: line {n}: {e}") from None
    return tuple(Request(index=i, prompt=p, max_new_tokens=m) for i, (p, m) in enumerate(prompts))
