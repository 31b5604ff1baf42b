"""`opweave run`: starts one process per rank of the artifact and collects the generated tokens.

Processes are started on this machine and joined with torch.distributed (gloo on CPU, NCCL on
CUDA) over loopback. CPU runs of one thread per rank fork them (fast); CUDA runs, and CPU runs of
several threads per rank, spawn them (`start_method`), and the
launcher counts CUDA devices without initialising CUDA (NVML, `cuda_device_count`): a process
forked after CUDA was initialised cannot use CUDA at all. The launcher watches the ranks: if a
rank fails, dies or makes no progress for the stall timeout, the others are killed at once and
the error names the rank. For clusters of several nodes it prints the `torchrun` command for each
node instead.

Note: nothing of a run outlives the launcher or waits on it. Each rank asks the kernel to kill
it when the launcher dies (Linux `PR_SET_PDEATHSIG`; elsewhere a thread watching the parent pid),
ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C, `timeout`, systemd and container
runtimes send them to the whole process group; the launcher, or the server, decides what they do
and stops the ranks itself), and writes its results and errors as files in the run's private
folder (written whole, then renamed), so a rank never blocks on a reader that is gone. The ranks meet through a
file store in that folder (0700) and their gloo/NCCL sockets are bound to the loopback
interface: a local run listens on no network interface.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import json
import math
import multiprocessing.util  # noqa: F401 - its exit handler is registered before `_kill_left_ranks`
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

from opweave import config
from opweave.errors import OpWeaveError
from opweave.kernels.logprobs import MAX_TOP_LOGPROBS
from opweave.runtime import heartbeat
from opweave.runtime.heartbeat import Heartbeat, Phase, StallWatch
from opweave.artifact import VerifiedArtifact, load_artifact
from opweave.runtime.checks import check_inputs, parse_prompt_ids
from opweave.runtime.run_io import RunTokenizer, read_prompts
from opweave.runtime.scheduler import Request
from opweave.signals import deferred

POLL_S = 0.05
ROOT_CAUSE_WAIT_S = 0.5
STALL_TIMEOUT_S = 120.0       # default `--stall-timeout`
MAX_STALL_TIMEOUT_S = 7 * 24 * 3600.0
PG_TIMEOUT_MARGIN_S = 30.0    # the process group's own timeout exceeds the stall timeout by this, so
                              # the launcher names a stalled rank before its peers time out waiting
PARENT_POLL_S = 0.5           # the parent watch where PR_SET_PDEATHSIG does not exist
PR_SET_PDEATHSIG = 1          # <linux/prctl.h>
RANK_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # left to the launcher (`_become_rank`)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A validated `opweave run`."""

    artifact: str
    weights: str              # checkpoint folder or "random"
    device: str               # cpu | cuda
    requests: tuple[Request, ...]
    timeout_s: float | None = None  # a bound on the whole run; none by default: a long healthy
                                    # run is never cut, a stalled one ends after stall_timeout_s
    interpret: bool = False   # run the op-by-op interpreter instead of the generated modules
    port: int | None = None   # unused: local ranks meet through a file store, not a port
    trace: bool = False       # record every rank's spans (opweave.runtime.timeline)
    replica_sets: int = 1     # independent copies of the plan's ranks, requests dealt round-robin
    stall_timeout_s: float = STALL_TIMEOUT_S  # a rank without progress for this long ends the run
    verify_key: bytes | None = None  # refuse an artifact whose manifest.sig does not match (--verify-key)
    serve: object = None      # `channel.ServeQueues`: requests arrive while the ranks run (opweave serve)
    threads: int | None = None  # torch threads per rank; None: the cores this process may use, shared by the ranks
    prefill_budget: int | None = None  # prompt tokens per round and microbatch; None: the plan's prefill chunk
    prefix_cache: bool = True  # prompts start on cached KV pages where the model and plan allow (`runtime.prefix`)
    kv_pages: int | None = None  # KV pages per replica's pool; None: every slot at the plan's context
    max_logprobs: int | None = None  # serving: top log-probabilities a request may ask for; None: none
    prefill_sets: int | None = None  # a disaggregated plan's prefill sets (TP groups of its prefill pool); None: 1

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise OpWeaveError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.weights != "random" and not os.path.isdir(self.weights):
            raise OpWeaveError(f"--weights {self.weights}: not a checkpoint folder (or use --weights random)")
        if not self.requests and self.serve is None:
            raise OpWeaveError("no prompts: give --prompts FILE.jsonl or --prompt-ids 1,2,3")
        if self.replica_sets < 1:
            raise OpWeaveError(f"--replica-sets must be at least 1, got {self.replica_sets}")
        if not _seconds_ok(self.stall_timeout_s, MAX_STALL_TIMEOUT_S):
            raise OpWeaveError(f"--stall-timeout must be a positive number of seconds up to "
                               f"{MAX_STALL_TIMEOUT_S:.0f} (a week), got {self.stall_timeout_s!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or not 1 <= self.threads <= 4096):
            raise OpWeaveError(f"--threads must be a whole number from 1 to 4096, got {self.threads!r}")
        if self.prefill_budget is not None and (isinstance(self.prefill_budget, bool)
                                                or not isinstance(self.prefill_budget, int) or self.prefill_budget < 1):
            raise OpWeaveError(f"--prefill-budget must be a whole number of tokens, at least 1, got {self.prefill_budget!r}")
        if self.kv_pages is not None and (isinstance(self.kv_pages, bool) or not isinstance(self.kv_pages, int)
                                          or self.kv_pages < 1):
            raise OpWeaveError(f"--kv-pages must be a whole number of pages, at least 1, got {self.kv_pages!r}")
        if self.max_logprobs is not None and (isinstance(self.max_logprobs, bool) or not isinstance(
                self.max_logprobs, int) or not 0 <= self.max_logprobs <= MAX_TOP_LOGPROBS):
            raise OpWeaveError(f"--max-logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}, "
                               f"got {self.max_logprobs!r}")
        if self.timeout_s is not None and not _seconds_ok(self.timeout_s, math.inf):
            raise OpWeaveError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")


def _seconds_ok(value, most: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
            and 0 < value <= most)


def threads_per_rank(threads: int | None, ranks: int) -> int:
    """Torch threads of each of `ranks` local ranks: `threads` (`--threads`), or the cores this
    process may run on divided among them (at least one)."""
    if threads is not None:
        return threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, ranks))


def world_size(artifact: str, manifest: dict | None = None) -> int:
    """Ranks of the artifact: its rank programs (those the manifest lists, when given)."""
    names = manifest["files"] if manifest is not None else os.listdir(artifact)
    n = sum(1 for name in names if name.startswith("rank_") and name.endswith(".json"))
    if n == 0:
        raise OpWeaveError(f"{artifact}: the artifact has no rank programs (was the model a model.py?)")
    return n


class _RunFolder:
    """A run's private folder (0700, removed at the end): each replica set's rendezvous store,
    rank 0's results and every failing rank's error. A file is written under a temporary name and
    renamed, so the launcher reads only whole files, and a rank writing one never waits for a
    reader (a pipe would block a rank once its reader is gone)."""

    def __init__(self):
        try:
            self.path = tempfile.mkdtemp(prefix="opweave-run-")
        except OSError as e:
            raise OpWeaveError(f"cannot create the run's folder in {tempfile.gettempdir()} ({e.strerror}); "
                               "set TMPDIR to a writable folder") from None

    def store(self, replica_set: int, world: int, timeout_s: float):
        """The ranks' rendezvous: a file, so a local run listens on no port at all."""
        import torch.distributed as dist

        store = dist.FileStore(os.path.join(self.path, f"store-{replica_set}"), world)
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store

    def _put(self, name: str, text: str) -> None:
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(self.path, name))

    def put_result(self, replica_set: int, outputs: list[Request], stats: dict) -> None:
        self._put(f"result-{replica_set}.json",
                  json.dumps({"outputs": [dataclasses.asdict(r) for r in outputs], "stats": stats}))

    def put_error(self, replica_set: int, rank: int, message: str) -> None:
        self._put(f"error-{replica_set}-{rank}.txt", message)

    def result(self, replica_set: int) -> tuple[list[Request], dict] | None:
        try:
            with open(os.path.join(self.path, f"result-{replica_set}.json")) as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        stats = data["stats"]
        if "spans" in stats:  # JSON keys are strings
            stats["spans"] = {int(r): rows for r, rows in stats["spans"].items()}
        return [Request(**r) for r in data["outputs"]], stats

    def errors(self) -> dict[tuple[int, int], str]:
        out = {}
        for name in os.listdir(self.path):
            if name.startswith("error-") and name.endswith(".txt"):
                k, r = name[len("error-"):-len(".txt")].split("-")
                with open(os.path.join(self.path, name)) as f:
                    out[(int(k), int(r))] = f.read()
        return out

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _worker(cfg: RunConfig, artifact: VerifiedArtifact, rank: int, world: int, folder: _RunFolder, beats: Heartbeat,
            launcher_pid: int, replica_set: int = 0, beat: int | None = None, ranks: int | None = None,
            pd=None, requests: tuple | None = None) -> None:
    """One rank, started by the launcher (`start_method`): `artifact` holds the files the launcher
    read and checked (the rank never re-opens them). `beat`: its heartbeat slot (default: by set
    and rank), `ranks`: every rank of the run, `pd`: its part in a disaggregated run."""
    _become_rank(launcher_pid)
    beat = replica_set * world + rank if beat is None else beat
    heartbeat.install(beats, beat)
    heartbeat.report(Phase.STARTED)
    import torch
    import torch.distributed as dist

    from opweave.runtime.worker import run_rank

    try:
        torch.set_num_threads(threads_per_rank(cfg.threads, ranks or world * cfg.replica_sets))
        gpu = beat % torch.cuda.device_count() if cfg.device == "cuda" else None
        use_loopback_interface()
        timeout_s = cfg.stall_timeout_s + PG_TIMEOUT_MARGIN_S
        join_process_group(cfg.device, timeout_s, gpu, store=folder.store(replica_set, world, timeout_s),
                           rank=rank, world=world)
        heartbeat.report(Phase.JOINED)
        requests = cfg.requests if requests is None else requests  # a prefill set's: none (a decode leader's jobs)
        out = run_rank(artifact, rank, cfg.weights, cfg.device, list(requests), cfg.interpret,
                       cfg.trace, serve=cfg.serve, replica_set=replica_set, prefill_budget=cfg.prefill_budget,
                       prefix_cache=cfg.prefix_cache, kv_pages=cfg.kv_pages if pd is None or pd.role.kind == "decode"
                       else None, max_logprobs=cfg.max_logprobs, pd=pd)
        if rank == 0:
            folder.put_result(replica_set, *out)
        dist.destroy_process_group()
    except Exception as e:  # report to the launcher in one line, then exit non-zero
        from opweave.errors import OpWeaveError as UserError

        detail = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, UserError) and config.debug_enabled():
            detail += "\n" + traceback.format_exc()
        folder.put_error(replica_set, rank, detail.splitlines()[0] if not config.debug_enabled() else detail)
        os._exit(1)
    os._exit(0)


def _become_rank(launcher_pid: int) -> None:
    """In a freshly started rank: die with the launcher, and leave termination signals to it.

    SIGINT (Ctrl-C), SIGHUP (a closed terminal) and SIGTERM (`timeout`, systemd, a container
    runtime: `kill -TERM -PGID`) may reach the whole process group; the ranks ignore them and the
    launcher, which gets them too, decides: `opweave run` kills its ranks and exits 128+N,
    `opweave serve` drains its requests and stops its ranks. A rank is ended by the launcher
    (SIGKILL) or dies with it. The signals were held back since the launcher forked or spawned
    this process (`_held_signals`); one sent meanwhile is discarded by SIG_IGN."""
    for sig in RANK_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RANK_IGNORES)
    if not _kill_me_with_parent():
        threading.Thread(target=_watch_parent, args=(launcher_pid,), daemon=True, name="parent-watch").start()
    if os.getppid() != launcher_pid:  # the launcher died before the above took effect
        os._exit(1)


@contextlib.contextmanager
def _held_signals():
    """Blocks SIGINT, SIGTERM and SIGHUP in this thread while a rank is started: a forked or spawned
    process inherits the mask, so a signal sent to the process group before the new rank ignores
    it (`_become_rank`) waits instead of killing the rank half started; this process gets it as
    the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, RANK_IGNORES)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _kill_me_with_parent() -> bool:
    """Linux: SIGKILL this process when the thread that forked it ends (the launcher's thread
    running `run_detailed`, even if the launcher itself is SIGKILLed). False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(launcher_pid: int) -> None:
    """Ends this process once its parent is gone (it is then re-parented)."""
    while os.getppid() == launcher_pid:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def join_process_group(device: str, timeout_s: float, gpu: int | None, store=None, rank: int | None = None,
                       world: int | None = None) -> None:
    """Joins the run's process group: gloo on CPU; on CUDA, NCCL with this rank's GPU selected
    (`gpu`) and bound to the group (`device_id`, where this torch has it), so the communicator is
    created now, at start-up, on every rank together, not lazily by the first collective.
    Without `store`, the group meets through torchrun's environment (`runtime/entry.py`)."""
    import inspect

    import torch
    import torch.distributed as dist

    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world)
    if device == "cuda":
        torch.cuda.set_device(gpu)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", gpu)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", **kwargs)


def use_loopback_interface() -> None:
    """Binds this rank's gloo and NCCL sockets to the loopback interface. Unset, gloo binds to the
    address the host name resolves to, which may be a public one."""
    name = _loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = name


def _loopback_interface() -> str:
    import socket

    names = [n for _, n in socket.if_nameindex()]
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    raise OpWeaveError(f"no loopback interface on this machine (interfaces: {', '.join(names)}); "
                       "local ranks talk over loopback only")


def run(cfg: RunConfig) -> list[Request]:
    """Runs every rank to completion; returns the requests with their generated tokens."""
    return run_detailed(cfg)[0]


def run_detailed(cfg: RunConfig) -> tuple[list[Request], dict]:
    """`run`, plus rank 0's per-round wall and host times (and every rank's spans with `cfg.trace`);
    with several replica sets, those of set 0, and `stats["replica_sets"]` holds every set's."""
    ranks = Ranks(cfg)
    try:  # whatever ends the watch (a failure, a stall, a signal turned into an exception), no rank is left
        ranks.start()
        done = ranks.watch()
    finally:
        ranks.stop()
    outputs = []
    for k, (_, original) in enumerate(ranks.sets):
        outputs += [dataclasses.replace(r, index=original[r.index]) for r in done[k][0]]
    stats = dict(done[0][1])
    if len(ranks.sets) > 1:
        stats["replica_sets"] = [done[k][1] for k in range(len(ranks.sets))]
    return sorted(outputs, key=lambda r: r.index), stats


class Ranks:
    """The rank processes of a run (every replica set), started and watched by this process."""

    def __init__(self, cfg: RunConfig):
        self.artifact = load_artifact(cfg.artifact, verify_key=cfg.verify_key)  # read once, checked, used by every rank
        self.cfg = cfg = planned_prefill(cfg, self.artifact)
        check_inputs(cfg, self.artifact)
        self.world = world_size(cfg.artifact, self.artifact.manifest)
        _check_devices(cfg, self.artifact, self.world)

        self.sets = _deal(cfg.requests, cfg.replica_sets) if cfg.requests else [((), [])] * cfg.replica_sets
        self.procs: dict[tuple[int, int], object] = {}
        self.folder = _RunFolder()
        self.prefill = disaggregated(self.artifact)  # the prefill pool's view, or None
        self.prefill_world = 0 if self.prefill is None else world_size_of(self.prefill)
        config.check_run(cfg.device, self.world, self.prefill_world)  # fault ranks it has, kernels it can run
        self.beat = {(k, r): k * self.world + r for k in range(len(self.sets)) for r in range(self.world)}
        if self.prefill is None and cfg.prefill_sets is not None:
            raise OpWeaveError(f"--prefill-sets {cfg.prefill_sets}: the plan has no prefill GPUs of its own (its "
                               "prefill is aggregated); only a disaggregated plan starts prefill sets")
        self.prefill_sets = (1 if cfg.prefill_sets is None else cfg.prefill_sets) if self.prefill is not None else 0
        if self.prefill is not None:
            if isinstance(cfg.prefill_sets, bool) or not isinstance(self.prefill_sets, int) or \
                    not 1 <= self.prefill_sets <= 255:
                raise OpWeaveError(f"--prefill-sets must be a whole number from 1 to 255, got {cfg.prefill_sets!r}")
            base = len(self.sets) * self.world
            self.beat.update({(len(self.sets) + j, s): base + j * self.prefill_world + s
                              for j in range(self.prefill_sets) for s in range(self.prefill_world)})

    def start(self) -> None:
        import multiprocessing as mp

        cfg = self.cfg
        method = rank_start_method(cfg.device, cfg.threads, len(self.beat))
        ctx = mp.get_context(method)
        if method == "fork":
            _import_for_ranks()
        self.beats = Heartbeat(len(self.beat), ctx)
        with deferred():  # a signal meanwhile raises once every started rank is in `procs` (to be stopped)
            self._start_all(cfg, ctx)

    def _start_all(self, cfg: RunConfig, ctx) -> None:
        pd = self._pd_ranks(cfg, ctx) if self.prefill is not None else None
        for k, (requests, _) in enumerate(self.sets):
            mine = dataclasses.replace(cfg, requests=requests)
            for r in range(self.world):
                self._start((k, r), ctx, mine, self.artifact, self.world, None if pd is None else pd("decode", k))
        for j in range(self.prefill_sets):
            k = len(self.sets) + j
            for r in range(self.prefill_world):
                self._start((k, r), ctx, cfg, self.prefill, self.prefill_world, pd("prefill", j), requests=())

    def _start(self, key, ctx, cfg: RunConfig, artifact: VerifiedArtifact, world: int, pd,
               requests: tuple | None = None) -> None:
        k, r = key
        self.procs[key] = ctx.Process(
            target=_worker, args=(cfg, artifact, r, world, self.folder, self.beats, os.getpid(), k,
                                  self.beat[key], len(self.beat), pd, requests),
            name=self.name(key), daemon=True)
        with _held_signals():
            self.procs[key].start()
        _STARTED.add(self.procs[key])

    def name(self, key: tuple[int, int]) -> str:
        if self.prefill is not None and key[0] >= len(self.sets):
            return f"prefill set {key[0] - len(self.sets)}, rank {key[1]}"
        return _name(key, len(self.sets))

    def _pd_ranks(self, cfg: RunConfig, ctx):
        """The parts of a disaggregated run's ranks (`opweave.runtime.pd`): one function of
        (kind, set) to the rank's `PDRank`, sharing the queues and the KV group's store."""
        from opweave.runtime import pd as PD

        decode = tuple(self.artifact.json(f"rank_{r:02d}.json") for r in range(self.world))
        leaders = len(decode[0]["scheduler_leaders"])
        queues = PD.Queues(tuple(tuple(ctx.Queue() for _ in range(leaders)) for _ in self.sets),
                           tuple(ctx.Queue() for _ in range(self.prefill_sets)))
        tp = self.prefill.json("rank_00.json")["tp"]
        store = os.path.join(self.folder.path, "store-kv")
        timeout_s = cfg.stall_timeout_s + PG_TIMEOUT_MARGIN_S

        def part(kind: str, k: int):
            role = PD.Role(kind, k, len(self.sets), self.prefill_sets, self.world, self.prefill_world, leaders, store,
                           timeout_s)
            return PD.PDRank(role, queues, decode, tp)
        return part

    def watch(self) -> dict[int, tuple[list[Request], dict]]:
        """Until every rank exits 0 (each set's results) or one fails, dies or stalls (OpWeaveError)."""
        done = _watch(self.procs, self.folder, StallWatch(self.beats, self.cfg.stall_timeout_s), self.cfg.timeout_s,
                      len(self.sets) + self.prefill_sets, self.beat, self.name)
        return {k: v for k, v in done.items() if k < len(self.sets)}

    def stop(self) -> None:
        _stop(list(self.procs.values()))
        self.folder.remove()


def _import_for_ranks() -> None:
    """Before forking: the modules every rank imports, imported once here and inherited. Each rank
    would otherwise import them itself, all at the same time (seconds of CPU each on a loaded
    machine, with no progress to report meanwhile). torch imports its compiler stack lazily, at
    the first reference op of the meta-device model a rank builds."""
    import opweave.runtime.worker  # noqa: F401

    try:
        import torch._dynamo  # noqa: F401
    except ImportError:  # an older or stripped torch: the ranks import what they need
        pass


def _check_devices(cfg: RunConfig, artifact: VerifiedArtifact, world: int) -> None:
    planned = planned_replica_sets(artifact)
    if cfg.replica_sets > planned:
        raise OpWeaveError(f"--replica-sets {cfg.replica_sets}: the plan places {planned} replica set(s)")
    if cfg.device == "cuda":
        need = world * cfg.replica_sets
        have = cuda_device_count()
        if have < need:
            what = (f"the plan has {world} ranks" if cfg.replica_sets == 1 else
                    f"{cfg.replica_sets} replica sets of {world} ranks need {need} CUDA devices")
            raise OpWeaveError(f"{what} but this machine has {have} CUDA device(s); use --device cpu for a tiny "
                               "model, or run the torchrun commands per node")


def start_method(device: str, threads: int = 1) -> str:
    """How the launcher starts rank processes: `fork` for CPU runs whose ranks run one thread each
    (a rank is ready in a fraction of a second), `spawn` otherwise (a fresh interpreter): CUDA
    cannot be used in a process forked from one that initialised it, and a forked rank that runs
    several OpenMP threads hangs at its first parallel region when the launcher had used its own
    thread pool (the OpenMP runtime is not fork-safe; `tests/test_processes.py`)."""
    return "spawn" if device == "cuda" or threads > 1 else "fork"


def rank_start_method(device: str, threads: int | None, ranks: int) -> str:
    """`start_method` of `ranks` local ranks at `--threads` `threads` (None: the default)."""
    return start_method(device, threads_per_rank(threads, ranks))


def cuda_device_count() -> int:
    """CUDA devices visible to this process, counted without initialising CUDA here: torch counts
    them through NVML while CUDA is uninitialised (`torch.cuda.device_count`, which honours
    CUDA_VISIBLE_DEVICES); `torch.cuda.is_available()` would initialise the driver instead.
    0 on a build without CUDA."""
    import torch

    try:
        return int(torch.cuda.device_count())
    except (RuntimeError, OSError):  # a broken driver install: no usable device
        return 0


def planned_prefill(cfg: RunConfig, artifact: VerifiedArtifact) -> RunConfig:
    """`cfg` with the plan's prefill arrangement (plan.json's "prefill", `passes/traffic.py`): an
    aggregated plan's token budget is the default `--prefill-budget`; a disaggregated plan is
    served by prefill ranks of its own (`disaggregated`)."""
    plan = artifact.json("plan.json") if "plan.json" in artifact.files else None
    prefill = plan.get("prefill") if isinstance(plan, dict) else None
    if not isinstance(prefill, dict):
        return cfg
    if prefill.get("mode") == "disaggregated":
        if not artifact.has("prefill_rank_00.json"):
            raise OpWeaveError(f"{os.path.join(artifact.folder, 'plan.json')}: the plan prefills on GPUs of its own "
                               "(prefill mode disaggregated) and the artifact holds no prefill programs "
                               "(prefill_rank_XX files): recompile it with this version")
        return cfg
    budget = prefill.get("token_budget")
    if cfg.prefill_budget is None and type(budget) is int and budget >= 1:
        return dataclasses.replace(cfg, prefill_budget=budget)
    return cfg


def disaggregated(artifact: VerifiedArtifact) -> VerifiedArtifact | None:
    """A disaggregated plan's prefill programs, as an artifact of their own (`prefill_rank_XX`
    as `rank_XX`, `prefill_plan.json` as `plan.json`); None for any other plan."""
    if not artifact.has("prefill_rank_00.json"):
        return None
    return artifact.view("prefill_")


def world_size_of(artifact: VerifiedArtifact) -> int:
    return sum(1 for name in artifact.manifest["files"] if re.fullmatch(r"rank_\d\d\.json", name))


def planned_replica_sets(artifact: str | VerifiedArtifact) -> int:
    """The replica sets the plan places (plan.json's "replica_sets"; `--replica-sets all`), from
    the folder (plan.json checked against the manifest) or from the files already checked.

    Raises:
        OpWeaveError: one line naming plan.json when it is missing, damaged or holds no count.
    """
    if isinstance(artifact, str):
        artifact = load_artifact(artifact, ["plan.json"])
    plan = artifact.json("plan.json")
    count = plan.get("replica_sets") if isinstance(plan, dict) else None
    if type(count) is not int or count < 1:
        raise OpWeaveError(f"{os.path.join(artifact.folder, 'plan.json')}: 'replica_sets' must be a whole number "
                           f"of at least 1, got {count!r} (recompile)")
    return count


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


def _watch(procs: dict, folder: _RunFolder, stall: StallWatch, timeout_s: float | None,
           sets: int, beat: dict | None = None, name=None) -> dict[int, tuple[list[Request], dict]]:
    """Waits for every rank to exit 0 (then returns each set's results); raises naming the rank
    on the first error, death or stall. `beat`: each rank's heartbeat slot (default: set x world
    + rank), `name`: a rank's name in messages."""
    from multiprocessing.connection import wait

    start = time.monotonic()
    world = len(procs) // sets
    beat = beat or {key: key[0] * world + key[1] for key in procs}
    key_of = {w: key for key, w in beat.items()}
    name = name or (lambda key: _name(key, sets))
    while True:
        wait([p.sentinel for p in procs.values() if p.exitcode is None], timeout=POLL_S)
        if any(p.exitcode not in (None, 0) for p in procs.values()) or folder.errors():
            raise OpWeaveError(_root_cause(procs, folder, sets, name))
        if all(p.exitcode == 0 for p in procs.values()):
            return _results(folder, sets)
        running = [[beat[key] for key in procs if key[0] == k and procs[key].exitcode is None] for k in range(sets)]
        slot = stall.stalled(running, lambda w: _is_stopped(procs[key_of[w]].pid))
        if slot is not None:
            raise OpWeaveError(f"{name(key_of[slot])} made no progress for {stall.timeout_s:g} s "
                               f"(last: {stall.heartbeat.describe(slot)})")
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise OpWeaveError(f"the run did not finish within {timeout_s:g} s")


def _results(folder: _RunFolder, sets: int) -> dict[int, tuple[list[Request], dict]]:
    done = {}
    for k in range(sets):
        done[k] = folder.result(k)
        if done[k] is None:
            raise OpWeaveError(f"{_name((k, 0), sets)} exited without writing its results")
    return done


def _is_stopped(pid: int | None) -> bool:
    """Whether a process is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: Linux's
    /proc/PID/stat state T or t; False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _root_cause(procs: dict, folder: _RunFolder, sets: int, name=None) -> str:
    """The failure to report: a rank that died without a word (killed) before the errors its
    peers then raise (lost connections), else the first error reported."""
    from multiprocessing.connection import wait

    name = name or (lambda key: _name(key, sets))
    deadline = time.monotonic() + ROOT_CAUSE_WAIT_S  # peers of a dead rank fail within it
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs.values()):
        wait([p.sentinel for p in procs.values() if p.exitcode is None], timeout=POLL_S)
    errors = folder.errors()
    for key, p in procs.items():
        if p.exitcode is not None and p.exitcode < 0 and key not in errors:
            return f"{name(key)} died (killed by signal {-p.exitcode})"
    if errors:
        key = min(errors, key=lambda k: ("Connection closed" in errors[k] or "connection" in errors[k].lower(), k))
        return f"{name(key)} failed: {errors[key]}"
    key = next(k for k, p in procs.items() if p.exitcode not in (None, 0))
    return f"{name(key)} died (exit code {procs[key].exitcode})"


def _stop(procs) -> None:
    """Kills every started rank and reaps it. SIGKILL at once: a rank keeps nothing to save (its
    results are whole files or nothing), and it also ends a rank stopped by SIGSTOP."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join()
        _STARTED.discard(p)


_STARTED: set = set()  # rank processes started here and not yet reaped by `_stop`


def _kill_left_ranks() -> None:
    """At interpreter exit, ranks still running (their launcher never stopped them) are killed.
    Ranks ignore SIGTERM, and multiprocessing's own exit handler ends daemonic children with
    SIGTERM and then joins them: it would wait forever. Registered after that handler, so it runs
    first (atexit runs handlers last in, first out)."""
    _stop(list(_STARTED))


atexit.register(_kill_left_ranks)


def read_requests(prompts_file: str | None, prompt_ids: str | None, max_new_tokens: int,
                  tokenizer: RunTokenizer | None = None) -> tuple[Request, ...]:
    """Requests from one id list (`--prompt-ids 1,2,3`) and a JSONL file (one object per line:
    token ids, text or a chat, and an optional max_new_tokens; `opweave.runtime.run_io`), checked
    line by line before any rank starts (`opweave.runtime.checks`; the vocabulary is checked
    against the artifact by `check_inputs`). `tokenizer`: what turns text lines into ids (without
    one they are refused). Each request remembers its source (file and line) for later messages."""
    if type(max_new_tokens) is not int or max_new_tokens <= 0:
        raise OpWeaveError(f"--max-new-tokens must be a positive whole number, got {max_new_tokens!r}")
    requests: list[Request] = []
    if prompt_ids is not None:
        requests.append(parse_prompt_ids(prompt_ids, max_new_tokens))
    if prompts_file:
        requests += read_prompts(prompts_file, max_new_tokens, tokenizer or RunTokenizer())
    return tuple(dataclasses.replace(r, index=i) for i, r in enumerate(requests))
