"""The queues between a serving process (`opweave.serve.engine`) and the scheduler leaders, and
the messages that cross them.

Each scheduler leader (the embedding owner's replica leaders, in every replica set) reads its own
inbox between rounds: `Add` (a request, with its sampling word: `opweave.kernels.sampling.encode`),
`Cancel` and `Stop`; all of them write to one outbox: `TokenEvent` as tokens are learned and
requests end, and `Ready` once loaded. Every rank (leader or not) writes `RoundReport`, its round
times, at most every `ROUND_REPORT_S`. A message is a frozen dataclass of plain values (ints,
strings, tuples): the queues pickle it, and no other object crosses processes.
"""

from __future__ import annotations

import dataclasses
import queue

IDLE_WAIT_S = 0.02  # an idle leader waits this long for a request before its next (idle) round
ROUND_REPORT_S = 0.25  # a rank reports its round times at most this often


# ---------------------------------------------------------------- server -> a scheduler leader
@dataclasses.dataclass(frozen=True)
class Add:
    """A new request for the leader's scheduler."""

    id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    stop_ids: tuple[int, ...]         # ids that end the request besides the model's EOS ids
    sampling_word: tuple[int, ...]    # `opweave.kernels.sampling.encode`
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: bool = False     # each prompt token's log-probability too (`Scheduler`)


@dataclasses.dataclass(frozen=True)
class Cancel:
    """End request `id` within a round (unknown ids: nothing)."""

    id: int


@dataclasses.dataclass(frozen=True)
class Stop:
    """End every request now; the ranks stop once all agree."""


# ---------------------------------------------------------------- a rank -> the server
@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """A token learned for request `id` (`token`), or its end (`finish_reason`, with `error`)."""

    id: int
    token: int | None
    finish_reason: str | None         # None while running; then "stop", "length", "cancelled" or "error"
    error: str | None = None
    logprob: tuple | None = None      # the token's (log-probability, ((id, log-probability), ...) best first)
    prompt_logprobs: tuple | None = None  # with the first token: one such pair per prompt token after the first


@dataclasses.dataclass(frozen=True)
class Ready:
    """A scheduler leader has loaded and runs rounds."""


@dataclasses.dataclass(frozen=True)
class RoundReport:
    """Rank `rank` of replica set `replica_set` ran rounds of these wall times (seconds); a
    scheduler leader adds the token positions its rows computed in them and how many of those were
    real tokens (the rest: padding tokens of microbatches its rows did not feed), the prompt tokens
    it looked up in its prefix cache and found there and the requests it preempted (since its last
    report), and the share of its KV pages that sequences hold now (`opweave.runtime.pages`)."""

    replica_set: int
    rank: int
    seconds: tuple[float, ...]
    computed: int = 0
    used: int = 0
    prefix_queried: int = 0
    prefix_hit: int = 0
    kv_usage: float = 0.0
    preempted: int = 0


ToLeader = Add | Cancel | Stop
ToServer = TokenEvent | Ready | RoundReport


@dataclasses.dataclass
class ServeChannel:
    """One leader's end: its inbox and the shared outbox (multiprocessing queues)."""

    inbox: object
    outbox: object

    def receive(self, wait_s: float = 0.0) -> list[ToLeader]:
        """Every message waiting; with `wait_s`, waits that long for the first one."""
        out = []
        try:
            out.append(self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def send(self, message: ToServer) -> None:
        self.outbox.put(message)


@dataclasses.dataclass
class ServeQueues:
    """Every leader's inbox, per replica set (in `scheduler_leaders` order), and the outbox."""

    inboxes: tuple[tuple[object, ...], ...]
    outbox: object

    def channel(self, replica_set: int, leader: int) -> ServeChannel:
        return ServeChannel(self.inboxes[replica_set][leader], self.outbox)
