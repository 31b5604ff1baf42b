"""Point-to-point transfers of one rank and the completion of a round.

A replica's leader exchanges one message per peer and transfer (`opweave.runtime.message`):
activations at a stage cut to / from the neighbouring owners' replicas whose rows overlap, and
the new token ids from the last stage back to the embedding owner's leaders. Sends are
non-blocking and completed one round later; receives are posted ahead by the `Inbox`, in the
plan's global order (round, stage, microbatch), so nothing waits on a coordinator.

Every buffer sent or received lives on the rank's run device (messages are packed there, the
receives are posted into device buffers, the round's flag is a device tensor): NCCL moves only
device tensors, and gloo the CPU ones of a CPU run.

A round ends (`complete_round`) by completing the previous round's sends and all-reducing,
asynchronously, whether any scheduler still has work: the answer is read one round later, so
ranks never wait for each other between rounds (a round of idle steps follows the last real one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from opweave.ir.program import RankProgram, StageProgram, Transfer
from opweave.runtime.inbox import Inbox, Slot
from opweave.runtime.message import message_bytes, message_width, pack_message, unpack_message, width_message


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def assemble(parts, rows: int, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One stage's inputs from its peers' unpacked messages: `parts` holds (first row, end row,
    width, positions [n, width], values' elements in packing order) per peer. The result is as
    wide as the widest part; narrower rows are left-padded (position -1, values 0). The result is
    on the parts' device."""
    width = max(w for _, _, w, _, _ in parts)
    device = parts[0][3].device
    positions = torch.full((rows, width), -1, dtype=torch.long, device=device)
    values = [torch.zeros(rows, width, *shape, dtype=dtype, device=device) for shape in shapes]
    for a, b, w, pos, payload in parts:
        positions[a:b, width - w:] = pos
        offset = 0
        for v, shape in zip(values, shapes):
            n = (b - a) * w * numel(shape)
            v[a:b, width - w:] = payload[offset:offset + n].view(b - a, w, *shape)
            offset += n
    return positions, values


class Transport:
    """The point-to-point side of one rank: its receives (leaders only), sends and round flag.

    `tokens_back`: whether this rank's scheduler gets the new token ids from other ranks (its
    replica leads a scheduler); `device`: the run device, where every buffer lives."""

    def __init__(self, program: RankProgram, dtype: torch.dtype, tokens_back: bool,
                 device: torch.device | str = "cpu"):
        self.program, self.dtype, self.tokens_back = program, dtype, tokens_back
        self.device = torch.device(device)
        self.rows = program.rows[1] - program.rows[0]
        self.is_leader = program.tp_rank == 0
        self._pending: list = []   # this round's sends (work, buffer kept alive)
        self._previous: list = []  # the previous round's
        self._flag = None          # the in-flight "any work left?" all-reduce of the last round
        self._local_tokens: dict[int, torch.Tensor] = {}  # colocated: the last stage returns to itself
        self.inbox = Inbox(self.receive_slots() if self.is_leader else [], self.device)
        self.inbox.start_round(0)

    def per_token_bytes(self, transfer: Transfer) -> int:
        """Bytes of a transfer's values per token (positions not included)."""
        return sum(numel(s) for s in transfer.shapes) * torch.empty(0, dtype=self.dtype).element_size()

    def receive_slots(self) -> list[Slot]:
        """Every point-to-point receive of one round, in program order (leaders only)."""
        prog, slots = self.program, []
        for st in prog.stages:
            for mb in range(prog.num_microbatches):
                if st.recv is None:
                    if self.tokens_back:
                        slots += [Slot(("tok", mb, p.rank), p.rank, p.hi - p.lo, torch.long, from_round=1)
                                  for p in prog.token_sources if p.rank != prog.rank]
                    continue
                per_token = self.per_token_bytes(st.recv)
                slots += [Slot(("act", st.stage, mb, p.rank), p.rank, message_bytes(p.hi - p.lo, 1, per_token),
                               torch.uint8) for p in st.recv.peers]
        return slots

    # ---------------------------------------------------------------- activations at a cut
    def recv_values(self, st: StageProgram, mb: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(positions [rows, width], each whole value [rows, width, *shape]) of stage `st`'s
        inputs for microbatch `mb`, from every upstream peer (leaders only). Each peer pads its
        rows to its own width; narrower rows are left-padded here, padding at position -1."""
        lo = self.program.rows[0]
        per_token = self.per_token_bytes(st.recv)
        parts = []
        for p in st.recv.peers:
            n = p.hi - p.lo
            first = self.inbox.take(("act", st.stage, mb, p.rank))
            w = message_width(first)
            body = first if w == 1 else torch.empty(message_bytes(n, w, per_token), dtype=torch.uint8,
                                                    device=self.device)
            if w != 1:  # a prefill: the first message held only the width
                dist.recv(body, src=p.rank)
            self.inbox.next_from(p.rank)
            pos, payload = unpack_message(body, n, w, self.dtype)
            parts.append((p.lo - lo, p.hi - lo, w, pos, payload))
        return assemble(parts, self.rows, st.recv.shapes, self.dtype)

    def send_values(self, st: StageProgram, positions: torch.Tensor, values) -> None:
        """Stage `st`'s whole output values to every downstream peer: one message each (its
        rows); a prefill's message is preceded by a decode-sized one carrying its width."""
        lo = self.program.rows[0]
        width = positions.shape[1]
        for p in st.send.peers:
            a, b = p.lo - lo, p.hi - lo
            message = pack_message(width, positions[a:b], [v[a:b] for v in values])
            if width != 1:
                self._isend(width_message(message, b - a, width), p.rank)
            self._isend(message, p.rank)

    # ---------------------------------------------------------------- token ids back to the scheduler
    def send_tokens(self, st: StageProgram, mb: int, tokens: torch.Tensor) -> None:
        """The last stage's new token ids to the embedding owners' leaders (their rows)."""
        lo = self.program.rows[0]
        for p in st.returns:
            part = tokens[p.lo - lo:p.hi - lo].to(self.device).contiguous()
            if p.rank == self.program.rank:
                self._local_tokens[mb] = part
            else:
                self._isend(part, p.rank)

    def recv_tokens(self, mb: int) -> torch.Tensor:
        """The previous step's new token ids of microbatch `mb`'s rows (from every last stage)."""
        out = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        lo = self.program.rows[0]
        for p in self.program.token_sources:
            if p.rank == self.program.rank:
                part = self._local_tokens.pop(mb)
            else:
                part = self.inbox.take(("tok", mb, p.rank))
                self.inbox.next_from(p.rank)
            out[p.lo - lo:p.hi - lo] = part
        return out

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        if dst == self.program.rank:
            raise RuntimeError("a rank never sends to itself: consecutive stages of one owner are merged")
        self._pending.append((dist.isend(tensor, dst=dst), tensor))

    # ---------------------------------------------------------------- rounds
    def complete_round(self, active: bool) -> bool:
        """Completes the previous round's sends (this round's token ids are only received at the
        start of the next round), starts the all-reduce of `active` (this rank still has work)
        and answers whether any rank had work one round ago (always, after the first round)."""
        for work, _ in self._previous:
            work.wait()
        self._previous, self._pending = self._pending, []
        flag = torch.tensor([1 if active else 0], dtype=torch.long, device=self.device)
        previous, self._flag = self._flag, (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        if previous is not None:
            previous[0].wait()
        return previous is None or bool(int(previous[1]))

    def start_round(self, round_index: int) -> None:
        """Posts the round's first receives."""
        self.inbox.start_round(round_index)

    def drain(self) -> None:
        """Completes every send and the last flag (after the last round's token ids are taken)."""
        for work, _ in self._previous + self._pending + ([self._flag] if self._flag else []):
            work.wait()
        self._previous, self._pending, self._flag = [], [], None
