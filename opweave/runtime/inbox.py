"""A rank's point-to-point receives of one round, into buffers reused round after round.

Every receive of a round is known before it starts (its peer, key and size: the round's tokens
per row are agreed between rounds, `opweave.runtime.layout`), and so is which receives a round has
at all: a microbatch that does not run this round has no activation message, and one that did not
run last round sends no token ids back. A receive's buffer is kept per key and size and reused
whenever the size comes again: a decode round of the same rows receives into the same memory
every time, as a captured CUDA graph needs.

With gloo (CPU runs), a blocking receive of a message that arrived while the rank was computing
costs a mean 1.3 ms on a 2-core machine (median 0.35 ms, tail to 6 ms: the transport's thread must
be scheduled to read it), against 0.1 ms when the receive was already posted (measured by timing
the excess over arrival, both ranks computing). So on CPU the inbox keeps one receive posted per
peer, in the order that peer sends: when a receive completes, the next one from the same peer is
posted at once; a round's first ones are posted when it starts (`prepost`). On CUDA (NCCL) a
receive is enqueued on the stream when the round asks for it, which blocks no host thread and
keeps every communication of the round inside the round (so it can be captured).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    key: tuple          # what the runtime asks for: ("act", stage, mb, peer) or ("tok", mb, peer)
    peer: int           # the sending rank
    numel: int          # elements at one token per row (when `scales`: per token times the rows), beside `fixed`
    dtype: torch.dtype
    from_round: int = 0  # first round that has this receive (token ids come back from round 1)
    mb: int = 0          # the microbatch, whose tokens scale the message
    scales: bool = True  # the size grows with the tokens of the message's rows (token ids do not)
    fixed: int = 0       # elements whatever the tokens (the rows' sampling words of an activation message)
    rows: tuple[int, int] = (0, 1)  # the message's rows [lo, hi) of the microbatch (global rows)


class Inbox:
    """One round's receives in program order; on CPU at most one posted per peer at a time."""

    def __init__(self, slots: list[Slot], device: torch.device | str = "cpu", prepost: bool | None = None,
                 comm=dist):
        self.device = torch.device(device)  # where the receive buffers live (the run device)
        self.prepost = self.device.type == "cpu" if prepost is None else prepost
        self.comm = comm  # torch.distributed, or a stand-in (tests)
        self._by_peer: dict[int, list[Slot]] = {}
        for s in slots:
            self._by_peer.setdefault(s.peer, []).append(s)
        self._slot = {s.key: s for s in slots}
        self._cursor: dict[int, int] = {}
        self._posted: dict[tuple, tuple] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}  # (key, size) -> its buffer, reused
        self._round = -1
        self._counts: tuple = ()    # this round's tokens per row, per microbatch (global rows)
        self._previous: tuple = ()  # the previous round's

    def numel(self, s: Slot) -> int:
        if not s.scales:
            return s.numel + s.fixed
        lo, hi = s.rows
        tokens = sum(self._counts[s.mb][lo:hi]) if self._counts else hi - lo
        return s.numel // (hi - lo) * tokens + s.fixed

    def expected(self, s: Slot) -> bool:
        """Whether receive `s` happens this round: an activation message when its microbatch runs,
        token ids when it ran last round (and `from_round` has come)."""
        if s.from_round > self._round:
            return False
        counts = self._counts if s.scales else self._previous
        return not counts or any(counts[s.mb])

    MAX_BUFFERS = 256  # distinct (key, size) buffers kept; beyond, the oldest go

    def buffer(self, s: Slot) -> torch.Tensor:
        """The receive buffer of `s` this round, reused whenever the same size comes again."""
        n = self.numel(s)
        buf = self._buffers.get((s.key, n))
        if buf is None:
            if len(self._buffers) >= self.MAX_BUFFERS:
                self._buffers.pop(next(iter(self._buffers)))
            buf = self._buffers[(s.key, n)] = torch.empty(n, dtype=s.dtype, device=self.device)
        return buf

    def start_round(self, round_index: int, counts: tuple, previous: tuple = ()) -> None:
        """The round's tokens per row per microbatch (and the previous round's); on CPU, posts its
        first receive from every peer."""
        self._round, self._counts, self._previous = round_index, tuple(counts), tuple(previous)
        for peer in self._by_peer:
            self._cursor[peer] = 0
            if self.prepost:
                self._post_next(peer)

    def _post_next(self, peer: int) -> None:
        slots, i = self._by_peer[peer], self._cursor[peer]
        while i < len(slots) and not self.expected(slots[i]):
            i += 1
        if i < len(slots):
            s = slots[i]
            buffer = self.buffer(s)
            self._posted[s.key] = (self.comm.irecv(buffer, src=peer), buffer)
            i += 1
        self._cursor[peer] = i

    def take(self, keys: list[tuple]) -> list[torch.Tensor]:
        """The messages of `keys` (one transfer point: a stage's input from each peer, or the token
        ids from each last stage), waited for. Pre-posted ones (CPU) are waited one by one; the
        others are received in one grouped call (`batch_isend_irecv`: one NCCL group), in the
        order given (ascending peer rank), and waited (on CUDA the wait is the stream's)."""
        out, group = {}, []
        for key in keys:
            posted = self._posted.pop(key, None)
            if posted is None:
                group.append((key, self.buffer(self._slot[key])))
                continue
            posted[0].wait()
            self._post_next(self._slot[key].peer)
            out[key] = posted[1]
        if group:
            ops = [self.comm.P2POp(self.comm.irecv, buffer, self._slot[key].peer) for key, buffer in group]
            for work in self.comm.batch_isend_irecv(ops):
                work.wait()
            out.update(group)
        return [out[key] for key in keys]
