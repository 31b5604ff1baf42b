"""Point-to-point transfers of one rank and the agreement between rounds.

A replica's port for a cut (the TP rank that takes it: `StageProgram.recv_port` / `send_port`,
the group's ranks in turn) exchanges one message per peer and transfer
(`opweave.runtime.message`): activations at a stage cut to / from the neighbouring owners'
replicas whose rows overlap, and the new token ids from the last stage back to the embedding
owner's leaders (TP rank 0, where the scheduler runs). Sends are
non-blocking and completed one round later; receives go through the `Inbox`, in the plan's global
order (round, stage, microbatch), into buffers reused every round.

Every buffer sent or received lives on the rank's run device (messages are packed there, the
receives land in device buffers, the token ids stay there): NCCL moves only device tensors, and
gloo the CPU ones of a CPU run.

Between rounds (`complete_round`) a rank completes the previous round's sends and all-reduces,
asynchronously, whether its scheduler still has work and the tokens per row it planned two rounds
ahead (every row of every microbatch: the round's packed layout, `opweave.runtime.layout`); the
answer is read one round later, so ranks never wait for each other between rounds (a round of
idle steps follows the last real one) and every rank knows a round's layout before it starts:
nothing in a round is read on the host. A microbatch no row feeds in a round is not run by any
rank: no message of it is sent or received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from opweave.ir.program import RankProgram, StageProgram, Transfer
from opweave.runtime.inbox import Inbox, Slot
from opweave.runtime.layout import Layout
from opweave.runtime.message import WORD_BYTES, pack_message, unpack_message
from opweave.runtime.pages import decode, logprobs, sampled
from opweave.kernels.sampling import WORD


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def assemble(parts, rows: int, layout: Layout, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One stage's inputs from its peers' unpacked messages: `parts` holds (first row, end row,
    positions [1, tokens], sampling words [n, WORD], values' elements in packing order) per peer,
    the rows replica-local; `layout` places each part's tokens. One peer holding every row gives
    views of its message (no copy); several are copied into one tensor per value. A layout of
    padding only gets its padding token (position -1, zero values). Returns (positions [1, T],
    words [rows, WORD], values [1, T, *shape]), on the parts' device."""
    total = layout.tokens
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == rows and not layout.pad:
        _, _, positions, word, payload = parts[0]
        values, offset = [], 0
        for shape in shapes:
            n = total * numel(shape)
            values.append(payload[offset:offset + n].view(1, total, *shape))
            offset += n
        return positions, word, values
    device = parts[0][2].device
    positions = torch.full((1, total), -1, dtype=torch.long, device=device)
    words = torch.zeros((rows, WORD), dtype=torch.long, device=device)
    values = [torch.zeros(1, total, *shape, dtype=dtype, device=device) for shape in shapes]
    for a, b, pos, word, payload in parts:
        words[a:b] = word
        t0, t1 = layout.tokens_of(a, b)
        if t1 == t0:
            continue
        positions[:, t0:t1] = pos
        offset = 0
        for v, shape in zip(values, shapes):
            n = (t1 - t0) * numel(shape)
            v[:, t0:t1] = payload[offset:offset + n].view(1, t1 - t0, *shape)
            offset += n
    return positions, words, values


class Transport:
    """The point-to-point side of one rank: the receives and sends of the cuts it is the port of,
    the token ids back to its scheduler, and the control word between rounds.

    `tokens_back`: whether this rank's scheduler gets the new token ids (its replica leads a
    scheduler); `device`: the run device, where every buffer lives; `comm`: torch.distributed, or
    a stand-in with its `isend`, `irecv`, `recv` and `all_reduce` (tests)."""

    def __init__(self, program: RankProgram, dtype: torch.dtype, tokens_back: bool,
                 device: torch.device | str = "cpu", comm=dist, width: int = 1):
        """`width`: int64s per row the last stage returns (its record: the token id alone, or with
        its log-probabilities, `opweave.kernels.logprobs.record_width`)."""
        self.program, self.dtype, self.tokens_back = program, dtype, tokens_back
        self.width = width
        self.device, self.comm = torch.device(device), comm
        self.rows = program.rows[1] - program.rows[0]
        self._pending: list = []   # this round's sends (work, buffer kept alive)
        self._previous: list = []  # the previous round's
        self._flag = None          # the in-flight all-reduce of the last round's control word
        m = program.num_microbatches
        # the last stage's token ids: a rank returning to itself keeps them here, and a scheduler's
        # leader assembles the received ones here (static: a decode round always uses this memory)
        self._local_tokens = [torch.zeros((self.rows, width), dtype=torch.long, device=self.device) for _ in range(m)]
        self._tokens = [torch.zeros((self.rows, width), dtype=torch.long, device=self.device) for _ in range(m)]
        self.inbox = Inbox(self.receive_slots(), self.device, comm=comm)
        b = program.microbatch_size
        self.counts: tuple[tuple[int, ...], ...] = ((0,) * b,) * m  # this round's tokens per row (global rows)
        self.last_counts = self.counts  # the previous round's
        self.layouts: tuple[Layout, ...] = tuple(self.layout(c) for c in self.counts)  # this replica's rows
        self._second = self.counts  # round 1's, set by `agree`
        self._second_aux = self.next_aux = self.aux = self.counts  # transfer keys per row (zeros: none)

    def layout(self, counts: tuple[int, ...], values: tuple[int, ...] = ()) -> Layout:
        """This replica's packed layout of a microbatch whose rows feed `counts` tokens (global
        rows); padding only when the microbatch runs but none of these rows has a token; sampled
        when one of these rows' control-word `values` draws at a positive temperature, logprobs
        when one reports log-probabilities."""
        lo, hi = self.program.rows
        mine = tuple(counts[lo:hi])
        return Layout(mine, pad=any(counts) and not any(mine), sampled=any(sampled(v) for v in values[lo:hi]),
                      logprobs=any(logprobs(v) for v in values[lo:hi]))

    def live(self, mb: int) -> bool:
        """Microbatch `mb` runs this round (some row of it, in any replica, has a token)."""
        return any(self.counts[mb])

    def was_live(self, mb: int) -> bool:
        """Microbatch `mb` ran last round (so its token ids come back now)."""
        return any(self.last_counts[mb])

    def per_token_bytes(self, transfer: Transfer) -> int:
        """Bytes of a transfer's values per token (positions not included)."""
        return sum(numel(s) for s in transfer.shapes) * torch.empty(0, dtype=self.dtype).element_size()

    def receive_slots(self) -> list[Slot]:
        """Every point-to-point receive of this rank in one round, in program order (the cuts it
        is the port of, and its scheduler's token ids); sizes at one token per row."""
        prog, slots = self.program, []
        for st in prog.stages:
            for mb in range(prog.num_microbatches):
                if st.recv is not None and st.recv_port != prog.rank:
                    continue
                if st.recv is None:
                    if self.tokens_back:
                        slots += [Slot(("tok", mb, p.rank), p.rank, (p.hi - p.lo) * self.width, torch.long,
                                       from_round=1, mb=mb,
                                       scales=False, rows=(p.lo, p.hi))
                                  for p in prog.token_sources if p.rank != prog.rank]
                    continue
                per_token = self.per_token_bytes(st.recv)
                slots += [Slot(("act", st.stage, mb, p.rank), p.rank, (p.hi - p.lo) * (8 + per_token),
                               torch.uint8, mb=mb, fixed=(p.hi - p.lo) * WORD_BYTES, rows=(p.lo, p.hi))
                          for p in st.recv.peers]
        return slots

    # ---------------------------------------------------------------- activations at a cut
    def recv_values(self, st: StageProgram, mb: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(positions [1, T], the rows' sampling words [rows, WORD], each whole value [1, T, *shape])
        of stage `st`'s inputs for microbatch `mb`, from every upstream peer (the stage's
        receiving port only)."""
        lo, counts = self.program.rows[0], self.counts[mb]
        peers = sorted(st.recv.peers, key=lambda p: p.rank)
        parts = []
        for p, body in zip(peers, self.inbox.take([("act", st.stage, mb, p.rank) for p in peers])):
            pos, word, payload = unpack_message(body, p.hi - p.lo, sum(counts[p.lo:p.hi]), self.dtype)
            parts.append((p.lo - lo, p.hi - lo, pos, word, payload))
        return assemble(parts, self.rows, self.layouts[mb], st.recv.shapes, self.dtype)

    def send_values(self, st: StageProgram, mb: int, positions: torch.Tensor, word: torch.Tensor, values) -> None:
        """Stage `st`'s whole output values (with the tokens' positions and the rows' sampling
        words) to every downstream peer: one message each (its rows' tokens)."""
        lo, layout = self.program.rows[0], self.layouts[mb]
        messages = []
        for p in st.send.peers:
            a, b = layout.tokens_of(p.lo - lo, p.hi - lo)
            messages.append((pack_message(positions[:, a:b], word[p.lo - lo:p.hi - lo], [v[:, a:b] for v in values]),
                             p.rank))
        self._isend_group(messages)

    # ---------------------------------------------------------------- token ids back to the scheduler
    def send_tokens(self, st: StageProgram, mb: int, tokens: torch.Tensor) -> None:
        """The last stage's new token ids (records [rows, width]) to the embedding owners' leaders
        (their rows); ids alone [rows] when the width is 1."""
        lo = self.program.rows[0]
        tokens = tokens.view(tokens.shape[0], -1)
        remote = []
        for p in st.returns:
            part = tokens[p.lo - lo:p.hi - lo]
            if p.rank == self.program.rank:
                self._local_tokens[mb][p.lo - lo:p.hi - lo].copy_(part)
            else:
                remote.append((part.contiguous(), p.rank))
        self._isend_group(remote)

    def no_tokens(self, mb: int) -> torch.Tensor:
        """Round 0 of microbatch `mb`: no step before it, no token ids (zeros)."""
        return self._tokens[mb]

    def recv_tokens(self, mb: int) -> torch.Tensor:
        """The previous step's new token ids of microbatch `mb`'s rows (from every last stage; records
        [rows, width], the id first), in a buffer of the run device that every round reuses (only
        when `mb` ran last round)."""
        out, lo, me = self._tokens[mb], self.program.rows[0], self.program.rank
        remote = sorted((p for p in self.program.token_sources if p.rank != me), key=lambda p: p.rank)
        for p, part in zip(remote, self.inbox.take([("tok", mb, p.rank) for p in remote])):
            out[p.lo - lo:p.hi - lo].copy_(part.view(-1, self.width))
        for p in self.program.token_sources:
            if p.rank == me:
                out[p.lo - lo:p.hi - lo].copy_(self._local_tokens[mb][p.lo - lo:p.hi - lo])
        return out

    def _isend_group(self, messages: list[tuple[torch.Tensor, int]]) -> None:
        """One transfer point's sends (tensor, destination rank) in one grouped call, in ascending
        destination order (`batch_isend_irecv`: one NCCL group); completed a round later."""
        if not messages:
            return
        messages = sorted(messages, key=lambda m: m[1])
        if any(dst == self.program.rank for _, dst in messages):
            raise RuntimeError("a rank never sends to itself: consecutive stages of one owner are merged")
        works = self.comm.batch_isend_irecv([self.comm.P2POp(self.comm.isend, t, dst) for t, dst in messages])
        self._pending += [(work, t) for work, (t, _) in zip(works, messages)]

    # ---------------------------------------------------------------- between rounds
    def agree(self, counts: list[tuple[tuple[int, ...], ...]], aux: list | None = None
              ) -> list[tuple[tuple[int, ...], ...]]:
        """Before the first round: every rank's planned tokens per row of the first rounds, merged
        (each scheduler plans its own rows; ranks without a scheduler pass zeros), and their
        transfer keys (`aux`, as `complete_round`); blocking."""
        n = self._flat_size
        aux = aux or [((0,) * self.program.microbatch_size,) * self.program.num_microbatches] * len(counts)
        word = torch.tensor([c for rnd in counts for mb in rnd for c in mb] + [a for rnd in aux for mb in rnd for a in mb],
                            dtype=torch.long, device=self.device)
        self.comm.all_reduce(word, op=dist.ReduceOp.MAX)
        values = word.tolist()
        agreed = [self._unflatten(values[i * n:(i + 1) * n]) for i in range(len(counts))]
        keys = [self._unflatten(values[(len(counts) + i) * n:(len(counts) + i + 1) * n]) for i in range(len(counts))]
        self._second = agreed[1]  # what the first `complete_round` answers (no word a round ago yet)
        self._second_aux, self.next_aux = keys[1], keys[0]
        return agreed

    @property
    def _flat_size(self) -> int:
        return self.program.num_microbatches * self.program.microbatch_size

    def _unflatten(self, values: list[int]) -> tuple[tuple[int, ...], ...]:
        b = self.program.microbatch_size
        return tuple(tuple(values[mb * b:(mb + 1) * b]) for mb in range(self.program.num_microbatches))

    def complete_round(self, active: bool, counts_ahead: tuple[tuple[int, ...], ...],
                       aux_ahead: tuple[tuple[int, ...], ...] | None = None
                       ) -> tuple[bool, tuple[tuple[int, ...], ...]]:
        """Completes the previous round's sends (this round's token ids are only received at the
        start of the next round) and starts the all-reduce of this rank's control word: whether
        it still has work, the tokens per row it planned two rounds ahead, and those rows'
        transfer keys (`aux_ahead`: 0, or a prefill/decode KV transfer's key + 1,
        `opweave.runtime.kvtransfer`). Answers the word of one round ago: whether any rank had
        work then (always, after the first round), and the tokens per row of the next round (its
        keys: `next_aux`)."""
        for work, _ in self._previous:
            work.wait()
        self._previous, self._pending = self._pending, []
        n = self._flat_size
        aux = [a for mb in aux_ahead for a in mb] if aux_ahead is not None else [0] * n
        word = torch.tensor([1 if active else 0, *(c for mb in counts_ahead for c in mb), *aux], dtype=torch.long,
                            device=self.device)
        previous, self._flag = self._flag, (self.comm.all_reduce(word, op=dist.ReduceOp.MAX, async_op=True), word)
        if previous is None:
            self.next_aux = self._second_aux
            return True, self._second
        previous[0].wait()
        values = previous[1].tolist()
        self.next_aux = self._unflatten(values[1 + n:])
        return bool(values[0]), self._unflatten(values[1:1 + n])

    def start_round(self, round_index: int, values: tuple[tuple[int, ...], ...]) -> None:
        """The round's control-word values per row (global rows, per microbatch: tokens and page
        event, `opweave.runtime.pages.encode`; their transfer keys: `aux`); posts its first
        receives (CPU)."""
        self.values, self.aux = values, self.next_aux
        self.last_counts, self.counts = self.counts, tuple(tuple(decode(v)[0] for v in mb) for mb in values)
        self.layouts = tuple(self.layout(c, v) for c, v in zip(self.counts, values))
        for layout, counts in zip(self.layouts, self.counts):
            if any(counts):
                layout.last(self.device)  # made now, between rounds: nothing in a round comes from the host
        self.inbox.start_round(round_index, self.counts, self.last_counts)

    def drain(self) -> None:
        """Completes every send and the last control word (after the last round's token ids are taken)."""
        for work, _ in self._previous + self._pending + ([self._flag] if self._flag else []):
            work.wait()
        self._previous, self._pending, self._flag = [], [], None
