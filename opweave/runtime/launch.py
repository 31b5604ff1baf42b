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
    port: int | None = None   # rendezvous port on loopback (default: a free one)
    trace: bool = False       # record every rank's spans (opweave.runtime.timeline)

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise OpWeaveError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.weights != "random" and not os.path.isdir(self.weights):
            raise OpWeaveError(f"--weights {self.weights}: not a checkpoint folder (or use --weights random)")
        if not self.requests:
            raise OpWeaveError("no prompts: give --prompts FILE.jsonl or --prompt-ids 1,2,3")


def world_size(artifact: str) -> int:
    n = sum(1 for name in os.listdir(artifact) if name.startswith("rank_") and name.endswith(".json"))
    if n == 0:
        raise OpWeaveError(f"{artifact}: the artifact has no rank programs (was the model a model.py?)")
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(cfg: RunConfig, rank: int, world: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from opweave.runtime.worker import run_rank

    try:
        torch.set_num_threads(1)
        verify_manifest(cfg.artifact, [f"rank_{rank:02d}.py", f"rank_{rank:02d}.json", "model_config.json",
                                       "ops.json", "plan.json"])
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        out = run_rank(cfg.artifact, rank, cfg.weights, cfg.device, list(cfg.requests), cfg.interpret,
                       cfg.trace)
        if rank == 0:
            outputs, stats = out
            results.put(("done", rank, ([dataclasses.asdict(r) for r in outputs], stats)))
        dist.destroy_process_group()
    except Exception as e:  # report to the launcher in one line, then exit non-zero
        from opweave.errors import OpWeaveError as UserError

        detail = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, UserError) and os.environ.get("OPWEAVE_DEBUG"):
            detail += "\n" + traceback.format_exc()
        results.put(("error", rank, detail.splitlines()[0] if not os.environ.get("OPWEAVE_DEBUG") else detail))
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
    """`run`, plus rank 0's per-round wall and host times (and every rank's spans with `cfg.trace`)."""
    import multiprocessing as mp

    verify_manifest(cfg.artifact)
    world = world_size(cfg.artifact)
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < world:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise OpWeaveError(f"the plan has {world} ranks but this machine has {have} CUDA device(s); "
                               "use --device cpu for a tiny model, or run the torchrun commands per node")
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = cfg.port or _free_port()
    procs = [ctx.Process(target=_worker, args=(cfg, r, world, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _watch(procs, results, cfg.timeout_s)
    finally:
        _stop(procs)


def _watch(procs, results, timeout_s: float) -> tuple[list[Request], dict]:
    start = time.monotonic()
    outputs = None
    errors: dict[int, str] = {}
    while True:
        try:
            kind, rank, payload = results.get(timeout=POLL_S)
            if kind == "error":
                errors.setdefault(rank, payload)
            else:
                outputs = ([Request(**r) for r in payload[0]], payload[1])
        except queue_mod.Empty:
            pass
        if errors or any(p.exitcode not in (None, 0) for p in procs):
            raise OpWeaveError(_root_cause(procs, results, errors))
        if outputs is not None and all(p.exitcode == 0 for p in procs):
            return outputs
        if time.monotonic() - start > timeout_s:
            raise OpWeaveError(f"the run did not finish within {timeout_s:.0f} s")


def _root_cause(procs, results, errors: dict[int, str]) -> str:
    """The failure to report: a rank that died without a word (killed) before the errors its
    peers then raise (lost connections), else the first error reported."""
    deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
    while time.monotonic() < deadline:
        try:
            kind, rank, payload = results.get(timeout=POLL_S)
            if kind == "error":
                errors.setdefault(rank, payload)
        except queue_mod.Empty:
            pass
    for rank, p in enumerate(procs):
        if p.exitcode is not None and p.exitcode < 0 and rank not in errors:
            return f"rank {rank} died (killed by signal {-p.exitcode})"
    if errors:
        rank = min(errors, key=lambda r: ("Connection closed" in errors[r] or "connection" in errors[r].lower(), r))
        return f"rank {rank} failed: {errors[rank]}"
    rank = next(r for r, p in enumerate(procs) if p.exitcode not in (None, 0))
    return f"rank {rank} died (exit code {procs[rank].exitcode})"


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
