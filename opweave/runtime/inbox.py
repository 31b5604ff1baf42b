"""A rank's point-to-point receives of one round, into buffers reused round after round.

Every receive of a round is known before it starts (its peer, key and size: the round's widths
are agreed between rounds), so a decode-sized receive has one buffer, allocated once and reused:
a decode round receives into the same memory every time, as a captured CUDA graph needs. A wider
receive (a prefill round, run eagerly) gets a buffer for that round only.

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
    numel: int          # elements at width 1 (`per_token` times the width when `scales`), beside `fixed`
    dtype: torch.dtype
    from_round: int = 0  # first round that has this receive (token ids come back from round 1)
    mb: int = 0          # the microbatch, whose width scales the message
    scales: bool = True  # the size grows with the microbatch's width (token ids do not)
    fixed: int = 0       # elements whatever the width (the rows' sampling words of an activation message)


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
        self._buffers: dict[tuple, torch.Tensor] = {}  # key -> its decode-sized buffer, reused
        self._round, self._widths = -1, ()

    def numel(self, s: Slot) -> int:
        return s.numel * (self._widths[s.mb] if s.scales and self._widths else 1) + s.fixed

    def buffer(self, s: Slot) -> torch.Tensor:
        """The receive buffer of `s` this round: a decode-sized one is made once and reused every
        round; a wider one (a prefill) is made for the round and freed after it."""
        n = self.numel(s)
        if n != s.numel + s.fixed:
            return torch.empty(n, dtype=s.dtype, device=self.device)
        buf = self._buffers.get(s.key)
        if buf is None:
            buf = self._buffers[s.key] = torch.empty(n, dtype=s.dtype, device=self.device)
        return buf

    def start_round(self, round_index: int, widths: tuple[int, ...]) -> None:
        """The round's widths per microbatch; on CPU, posts its first receive from every peer."""
        self._round, self._widths = round_index, tuple(widths)
        for peer in self._by_peer:
            self._cursor[peer] = 0
            if self.prepost:
                self._post_next(peer)

    def _post_next(self, peer: int) -> None:
        slots, i = self._by_peer[peer], self._cursor[peer]
        while i < len(slots) and slots[i].from_round > self._round:
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
