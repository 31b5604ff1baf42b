"""The device side of a scheduler replica's rows: each round's token ids and positions.

A decode step feeds the token the last stage sampled for the row in the previous round, which
arrives on the device (`Transport.recv_tokens`), at the next position. So a decode round builds
its inputs on the device from static buffers with no host synchronisation: the ids are the
received tokens, the positions advance by one where a row is live (position >= 0). The host only
writes when the plan changes a row (`opweave.runtime.scheduler`): before a round it stops rows
that end (position -1), and a round where some row feeds a prompt chunk is built on the host
(ids, positions, and which rows decode from the device's tokens) and run eagerly.

The host learns the sampled tokens through `TokenCopies`: each round's received tokens are copied
to host memory without blocking (pinned on CUDA) and read at the end of the next round, when that
copy has long completed; only then does the scheduler learn them (two rounds after sampling).
"""

from __future__ import annotations

import torch

from opweave.kernels.sampling import GREEDY
from opweave.runtime.scheduler import StepPlan


class RowInputs:
    """Static per-microbatch buffers of a scheduler replica's leader: `positions[mb]` holds each
    row's position in the microbatch's last round (-1: idle), `ids[mb]` its decode ids, `words[mb]`
    its request's sampling word (`opweave.kernels.sampling`; set with the prefill that admits it)."""

    def __init__(self, rows: int, num_microbatches: int, device: torch.device):
        self.rows, self.device = rows, device
        self.positions = [torch.full((rows, 1), -1, dtype=torch.long, device=device) for _ in range(num_microbatches)]
        self.ids = [torch.zeros(rows, 1, dtype=torch.long, device=device) for _ in range(num_microbatches)]
        self.words = [torch.tensor([GREEDY] * rows, dtype=torch.long, device=device) for _ in range(num_microbatches)]
        self._live = [set() for _ in range(num_microbatches)]  # rows with position >= 0 (host's mirror)

    def prepare(self, mb: int, plan: StepPlan) -> None:
        """Before the round (on the host): rows that end get position -1. Only for a decode
        round; a host-fed round sets every row."""
        if plan.host_fed:
            return
        busy = {r for r, s in enumerate(plan.rows) if not s.idle}
        if busy - self._live[mb]:
            raise RuntimeError(f"microbatch {mb}: rows {sorted(busy - self._live[mb])} decode without a prefill")
        stop = sorted(self._live[mb] - busy)
        if stop:
            self.positions[mb][stop] = -1
        self._live[mb] = busy

    def decode(self, mb: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) [rows, 1] of a decode round, on the device: no host synchronisation."""
        pos = self.positions[mb]
        pos.add_(pos.ge(0).to(pos.dtype))
        torch.clamp(tokens.view(-1, 1), min=0, out=self.ids[mb])  # NON_FINITE_TOKEN (-1): the row ends, dropped
        return self.ids[mb], pos

    def host_fed(self, mb: int, plan: StepPlan, tokens: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) [rows, width] of a round where some row feeds a prompt chunk, or
        where the agreed width (the largest of every scheduler's) exceeds one: built on the host,
        left-padded with position -1; decoding rows take the device's token."""
        assert width >= plan.width, f"agreed width {width} < planned {plan.width}"
        ids = torch.zeros(self.rows, width, dtype=torch.long)
        positions = torch.full((self.rows, width), -1, dtype=torch.long)
        from_device = torch.zeros(self.rows, dtype=torch.bool)
        words = torch.tensor([GREEDY] * self.rows, dtype=torch.long)
        for r, step in enumerate(plan.rows):
            if step.idle:
                continue
            words[r] = torch.tensor(step.request.sampling)
            n = len(step.tokens) or 1
            positions[r, width - n:] = torch.arange(step.first, step.first + n)
            if step.tokens:
                ids[r, width - n:] = torch.tensor(step.tokens)
            else:
                from_device[r] = True
        ids, positions = ids.to(self.device), positions.to(self.device)
        ids[:, -1] = torch.where(from_device.to(self.device), tokens.view(-1).clamp(min=0), ids[:, -1])
        self.positions[mb].copy_(positions[:, -1:])
        self.words[mb].copy_(words)
        self._live[mb] = {r for r, s in enumerate(plan.rows) if not s.idle}
        return ids, positions


class TokenCopies:
    """The host's view of the sampled tokens, one round late and without blocking the device.

    Inside a round the received tokens are copied into a static device buffer (`stage`: part of
    a captured graph, the same memory every round); after the round, outside it, that buffer is
    copied to the host without blocking (pinned memory on CUDA) into one of two host buffers,
    with an event; the host reads it at the end of the next round (`read`), when it has long
    completed."""

    LAG = 2  # host buffers: a round's copy is read at the end of the next round

    def __init__(self, rows: int, num_microbatches: int, device: torch.device):
        pin = device.type == "cuda"
        self._stage = [torch.zeros(rows, dtype=torch.long, device=device) for _ in range(num_microbatches)]
        self._host = [[torch.zeros(rows, dtype=torch.long, pin_memory=pin) for _ in range(num_microbatches)]
                      for _ in range(self.LAG)]
        self._events: list = [None] * self.LAG
        self._cuda = device.type == "cuda"

    def stage(self, mb: int, tokens: torch.Tensor) -> None:
        """Inside the round: keep `tokens` (sampled in the previous round) on the device."""
        self._stage[mb].copy_(tokens.view(-1))

    def round_done(self, round_index: int) -> None:
        """After the round is enqueued: start the copies to the host and mark when they complete."""
        for host, staged in zip(self._host[round_index % self.LAG], self._stage):
            host.copy_(staged, non_blocking=self._cuda)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[round_index % self.LAG] = event

    def read(self, round_index: int) -> list[list[int]]:
        """The tokens staged in round `round_index` (sampled in the round before), per microbatch;
        waits for that round's copies (long done when read a round later)."""
        event = self._events[round_index % self.LAG]
        if event is not None:
            event.synchronize()
        return [t.tolist() for t in self._host[round_index % self.LAG]]
