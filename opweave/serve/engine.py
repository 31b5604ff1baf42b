"""The serving engine: a compiled plan's ranks started once, fed requests while they run.

`Engine.start` starts every rank of the plan (every replica set) as `opweave run` does
(`runtime.launch.Ranks`), in serving mode: each scheduler leader (the embedding owner's replica
leaders) reads its own inbox between rounds and admits new requests into free batch slots
(continuous batching: `runtime.scheduler`), and every leader reports the tokens it learns and the
ends of requests to one outbox (`runtime.channel`). A reader thread turns those into per-request
`Event`s, in order, through the callback given to `submit`; a watcher thread follows the ranks
(a rank that fails, dies or stalls makes the engine unhealthy and ends every request in flight
with an error). Requests go to the leader with the fewest in flight.

Sampling happens on the device, in the last stage (`opweave.kernels.sampling`): each request's
temperature, top_k, top_p, min_p, seed and EOS ban (min_tokens) travel with its row as a sampling
word; temperature 0 is greedy and gives exactly `opweave run`'s tokens. A request without a seed
gets a random one. `ignore_eos` and `min_tokens` also reach the row's scheduler, which then does
not end the request on an EOS id (or, before min_tokens, on a stop id).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import secrets
import threading
import time
from collections.abc import Callable

from opweave.artifact import load_artifact
from opweave.errors import OpWeaveError
from opweave.runtime.channel import Add, Cancel, Ready, RoundReport, ServeQueues, Stop, TokenEvent
from opweave.runtime.launch import STALL_TIMEOUT_S, RunConfig, Ranks, rank_start_method, world_size
from opweave.kernels.logprobs import MAX_TOP_LOGPROBS
from opweave.kernels.sampling import MAX_TOP_K, encode

MAX_TEMPERATURE = 2.0  # OpenAI's range [0, 2]

READY_TIMEOUT_S = 600.0  # loading the weights of every rank


class SamplingError(ValueError):
    """A sampling parameter out of its range; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A request's generation parameters, checked once (`check`) wherever they come from."""

    max_tokens: int
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0
    seed: int | None = None         # None: a random seed (`opweave.kernels.sampling`)
    stop_token_ids: tuple[int, ...] = ()   # extra ids that end the request (the model's EOS does too)
    top_k: int = 0                  # 0: off
    min_p: float = 0.0              # 0: off
    min_tokens: int = 0             # the model's EOS ids are banned, and no stop id ends it, before this many
    ignore_eos: bool = False        # the model's EOS ids do not end the request
    logprobs: int | None = None     # top log-probabilities with each output token (None: no log-probabilities)
    prompt_logprobs: bool = False   # each prompt token's log-probability too (fed a token a round)

    def check(self, vocab_size: int, max_logprobs: int | None = None) -> None:
        """Raises SamplingError for a value the device sampler cannot serve as asked
        (`max_logprobs`: the server's `--max-logprobs`; None: it serves no log-probabilities)."""
        if self.logprobs is not None or self.prompt_logprobs:
            if max_logprobs is None:
                raise SamplingError("log-probabilities are off on this server (--max-logprobs)", "logprobs")
            if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
                raise SamplingError(f"logprobs must be between 0 and this server's --max-logprobs "
                                    f"({max_logprobs}), got {self.logprobs}", "logprobs")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature:g}",
                                "temperature")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p:g}", "top_p")
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be between 0 and 1, got {self.min_p:g}", "min_p")
        if self.top_k < 0 or MAX_TOP_K < self.top_k < vocab_size:
            raise SamplingError(f"top_k must be 0 (off), at most {MAX_TOP_K}, or at least the vocabulary "
                                f"({vocab_size}), got {self.top_k}", "top_k")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), "
                                f"got {self.min_tokens}", "min_tokens")

    def word(self, prompt_len: int, seed: int) -> tuple[int, ...]:
        """The row's sampling word (`opweave.kernels.sampling.encode`) for a prompt of `prompt_len`:
        output k is sampled at position prompt_len - 2 + k, so EOS is banned before
        prompt_len - 1 + min_tokens."""
        logprobs = self.logprobs if self.logprobs is not None or not self.prompt_logprobs else 0
        return encode(self.temperature, self.top_p, seed, top_k=self.top_k, min_p=self.min_p,
                      ban_until=prompt_len - 1 + self.min_tokens if self.min_tokens else 0, logprobs=logprobs)


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request's callback receives, in order: one per new token, then a last one."""

    token: int | None             # one new token id (None on the last event)
    finish_reason: str | None     # None while running; then "stop", "length", "cancelled" or "error"
    error: str | None = None
    logprob: tuple | None = None  # the token's (log-probability, ((id, log-probability), ...)), when asked
    prompt_logprobs: tuple | None = None  # with the first token, when asked: one such pair per prompt
                                          # token after the first


class QueueFull(Exception):
    """`submit` while `max_queue` requests already wait."""


@dataclasses.dataclass
class _Request:
    on_event: Callable[[Event], None]
    leader: tuple[int, int]       # (replica set, leader index)
    tokens: int = 0


class Engine:
    def __init__(self, artifact: str, weights: str, device: str = "cpu", replica_sets: int = 1,
                 max_queue: int = 256, stall_timeout_s: float = STALL_TIMEOUT_S, threads: int | None = None,
                 prefill_budget: int | None = None, prefix_cache: bool = True, kv_pages: int | None = None,
                 max_logprobs: int | None = MAX_TOP_LOGPROBS, prefill_sets: int | None = None):
        from opweave.runtime.checks import artifact_model_config

        if max_queue < 1:
            raise OpWeaveError(f"--max-queue must be at least 1, got {max_queue}")
        files = load_artifact(artifact, ["model_config.json", "rank_00.json"])  # checked against the manifest
        # a disaggregated plan: its prefill sets' leaders have inboxes too (for `Stop`), after the decode sets'
        self._prefill_leaders = (1 if prefill_sets is None else prefill_sets) if files.has("prefill_rank_00.json") else 0
        cfg = artifact_model_config(files)
        program = files.json("rank_00.json")
        self.model = program["model"]
        self.context = int(program["context"])
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.vocab_size = cfg.vocab_size
        self._leaders = [(k, j) for k in range(replica_sets) for j in range(len(program["scheduler_leaders"]))]
        self._args = dict(artifact=artifact, weights=weights, device=device, replica_sets=replica_sets,
                          stall_timeout_s=stall_timeout_s, threads=threads, prefill_budget=prefill_budget,
                          prefix_cache=prefix_cache, kv_pages=kv_pages, max_logprobs=max_logprobs,
                          prefill_sets=prefill_sets)
        self.max_logprobs = max_logprobs
        self.max_queue = max_queue
        self.healthy, self.error = False, None
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._rounds: dict[tuple[int, int], collections.deque] = {}  # (replica set, rank) -> recent round times
        self._tokens_computed = self._tokens_used = 0  # token positions the rounds computed / real tokens
        self._prefix_queried = self._prefix_hit = 0     # prompt tokens looked up in / found in prefix caches
        self._preempted = 0                              # requests preempted (computed again later)
        self._kv_usage: dict[tuple[int, int], float] = {}  # per leader: share of its KV pages held
        self._rejected = 0
        self._ranks = None
        self._ready = 0
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._stopping = False  # `stop` was called

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        """Starts every rank and waits until each has loaded (OpWeaveError if one fails)."""
        import multiprocessing as mp

        sets = self._args["replica_sets"]
        ctx = mp.get_context(rank_start_method(self._args["device"], self._args["threads"],
                                               world_size(self._args["artifact"]) * sets))
        per_set = len(self._leaders) // sets
        self._queues = ServeQueues(tuple(tuple(ctx.Queue() for _ in range(per_set)) for _ in range(sets))
                                   + tuple((ctx.Queue(),) for _ in range(self._prefill_leaders)), ctx.Queue())
        cfg = RunConfig(requests=(), serve=self._queues, **self._args)
        self._ranks = Ranks(cfg)
        self._ranks.start()
        threading.Thread(target=self._watch, name="opweave-engine-watch", daemon=True).start()
        threading.Thread(target=self._read, name="opweave-engine-read", daemon=True).start()
        if not self._started.wait(READY_TIMEOUT_S) or not self.healthy:
            self.stop(timeout_s=5)
            raise OpWeaveError(self.error or f"the ranks did not load within {READY_TIMEOUT_S:g} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops admitting, ends every request (cancelled), and joins every rank (killed after `timeout_s`)."""
        if self._ranks is None:
            return
        self._stopping = True  # the ranks' end is asked for: what is left ends "cancelled" (`_watch`)
        for k, inboxes in enumerate(self._queues.inboxes):
            for inbox in inboxes:
                inbox.put(Stop())
        if self.healthy:  # running ranks end their requests and stop; ranks still loading are killed
            self._stopped.wait(timeout_s)
        self._ranks.stop()
        self._fail_all("cancelled", None)
        self.healthy = False
        self.error = self.error or "the engine stopped"
        self._started.set()

    def _watch(self) -> None:
        """Follows the ranks until they end: a rank that fails, dies or stalls is the engine's
        error (one line naming the rank: `rank 1 died (killed by signal 9)`); ranks that end
        without `stop` having asked for it are an error too."""
        try:
            self._ranks.watch()
            if not self._stopping:
                self.error = "the ranks stopped on their own"
        except OpWeaveError as e:
            self.error = str(e)
        except Exception as e:  # noqa: BLE001 - reported as the engine's error
            self.error = f"{type(e).__name__}: {e}"
        self.healthy = False
        self._stopped.set()
        time.sleep(0.2)  # let the reader deliver what the ranks sent last
        if self._stopping and self.error is None:
            self._fail_all("cancelled", None)
        else:
            self._fail_all("error", self.error or "the ranks stopped")
        self._started.set()

    def _read(self) -> None:
        while not (self._stopped.is_set() and self._queues.outbox.empty()):
            try:
                message = self._queues.outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            if isinstance(message, TokenEvent):
                self._deliver(message)
            elif isinstance(message, RoundReport):
                with self._lock:
                    key = (message.replica_set, message.rank)
                    self._rounds.setdefault(key, collections.deque(maxlen=256)).extend(message.seconds)
                    self._tokens_computed += message.computed
                    self._tokens_used += message.used
                    self._prefix_queried += message.prefix_queried
                    self._prefix_hit += message.prefix_hit
                    self._preempted += message.preempted
                    if message.computed or message.prefix_queried or message.kv_usage:  # a leader's
                        self._kv_usage[key] = message.kv_usage
            elif isinstance(message, Ready):
                self._ready += 1
                if self._ready == len(self._leaders) + self._prefill_leaders:
                    self.healthy = True
                    self._started.set()

    def _deliver(self, event: TokenEvent) -> None:
        with self._lock:
            req = self._requests.get(event.id)
            if req is None:
                return
            if event.token is not None:
                req.tokens += 1
            if event.finish_reason is not None:
                del self._requests[event.id]
        if event.token is not None:
            req.on_event(Event(event.token, None, logprob=event.logprob, prompt_logprobs=event.prompt_logprobs))
        if event.finish_reason is not None:
            req.on_event(Event(None, event.finish_reason, event.error))

    def _fail_all(self, reason: str, error: str | None) -> None:
        with self._lock:
            left, self._requests = self._requests, {}
        for req in left.values():
            req.on_event(Event(None, reason, error))

    # ---------------------------------------------------------------- requests
    def submit(self, prompt_ids: list[int], sampling: Sampling, on_event: Callable[[Event], None]) -> int:
        """Queues a request; its events go to `on_event` (from an engine thread). Returns its id.

        Raises:
            QueueFull: `max_queue` requests already wait for a first token.
            ValueError: the request cannot run (one line: the prompt does not fit, sampling...).
            RuntimeError: the engine is not running.
        """
        if not self.healthy:
            raise RuntimeError(self.error or "the engine is not running")
        sampling.check(self.vocab_size, self.max_logprobs)
        seed = secrets.randbits(63) if sampling.seed is None else sampling.seed
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the plan's context of {self.context} "
                             f"allows at most {self.context - 1}")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        with self._lock:
            if sum(r.tokens == 0 for r in self._requests.values()) >= self.max_queue:
                self._rejected += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            index = next(self._ids)
            load = collections.Counter(r.leader for r in self._requests.values())
            leader = min(self._leaders, key=lambda key: (load[key], key))
            self._requests[index] = _Request(on_event, leader)
        self._queues.inboxes[leader[0]][leader[1]].put(Add(
            id=index, prompt_ids=tuple(int(t) for t in prompt_ids), max_new_tokens=int(sampling.max_tokens),
            stop_ids=tuple(int(t) for t in sampling.stop_token_ids),
            sampling_word=tuple(sampling.word(len(prompt_ids), seed)), ignore_eos=bool(sampling.ignore_eos),
            min_tokens=int(sampling.min_tokens), prompt_logprobs=bool(sampling.prompt_logprobs)))
        return index

    def cancel(self, request_id: int) -> None:
        """Ends the request within a round (a last Event "cancelled" follows); unknown ids: nothing."""
        with self._lock:
            req = self._requests.get(request_id)
        if req is not None:
            self._queues.inboxes[req.leader[0]][req.leader[1]].put(Cancel(request_id))

    def stats(self) -> dict:
        with self._lock:
            running = sum(r.tokens > 0 for r in self._requests.values())
            waiting = len(self._requests) - running
            rounds = {key: list(times) for key, times in sorted(self._rounds.items())}
            computed, used = self._tokens_computed, self._tokens_used
            queried, hit = self._prefix_queried, self._prefix_hit
            usage = max(self._kv_usage.values(), default=0.0)
            preempted = self._preempted
        return {"running": running, "waiting": waiting, "rejected": self._rejected, "round_s": rounds,
                "tokens_computed": computed, "tokens_used": used, "prefix_queried": queried, "prefix_hit": hit,
                "kv_usage": usage, "preemptions": preempted}
