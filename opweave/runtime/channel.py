"""The queues between a serving process (`opweave.serve.engine`) and the scheduler leaders.

Each scheduler leader (the embedding owner's replica leaders, in every replica set) reads its own
inbox between rounds: `("add", id, prompt_ids, max_new_tokens, stop_ids, sampling_word, ignore_eos, min_tokens)` (the word:
`opweave.runtime.sampling.encode`), `("cancel", id)` and `("stop",)`; all of them write to one
outbox: `("event", id, token, finish_reason, error)` as tokens are learned and requests end, and
`("ready",)` once loaded. Every rank (leader or not) writes `("rounds", replica_set, rank,
[seconds, ...])`, its round times, at most every `ROUND_REPORT_S`. Messages are tuples of plain
values (no objects cross processes).
"""

from __future__ import annotations

import dataclasses
import queue

IDLE_WAIT_S = 0.02  # an idle leader waits this long for a request before its next (idle) round
ROUND_REPORT_S = 0.25  # a rank reports its round times at most this often


@dataclasses.dataclass
class ServeChannel:
    """One leader's end: its inbox and the shared outbox (multiprocessing queues)."""

    inbox: object
    outbox: object

    def receive(self, wait_s: float = 0.0) -> list[tuple]:
        """Every message waiting; with `wait_s`, waits that long for the first one."""
        out = []
        try:
            out.append(self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def send(self, message: tuple) -> None:
        self.outbox.put(message)


@dataclasses.dataclass
class ServeQueues:
    """Every leader's inbox, per replica set (in `scheduler_leaders` order), and the outbox."""

    inboxes: tuple[tuple[object, ...], ...]
    outbox: object

    def channel(self, replica_set: int, leader: int) -> ServeChannel:
        return ServeChannel(self.inboxes[replica_set][leader], self.outbox)
