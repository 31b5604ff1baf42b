"""The device side of a scheduler replica's rows: each round's packed token ids and positions.

A round feeds, per microbatch, the packed tokens its plan lays out (`opweave.runtime.layout`):
prompt chunks from the host, and for each decoding row the token the last stage sampled for it in
the previous round, which arrives on the device (`Transport.recv_tokens`) and never goes through
the host. Everything the host knows about a round (its positions, which row each token comes
from, the prompt tokens, the rows' sampling words) is written between rounds (`prepare`, outside
the round); inside it, `ids` only picks the received tokens on the device: no host
synchronisation in a round.

The host learns the sampled tokens through `TokenCopies`: each round's received tokens are copied
to host memory without blocking (pinned on CUDA) and read at the end of the next round, when that
copy has long completed; only then does the scheduler learn them (two rounds after sampling).
"""

from __future__ import annotations

import torch

from opweave.ir.plan import HOST_TOKEN_LAG
from opweave.kernels.sampling import FIELDS, GREEDY
from opweave.runtime.layout import Layout
from opweave.runtime.scheduler import StepPlan


class RowInputs:
    """Per-microbatch inputs of a scheduler replica's leader: `words[mb]` holds each row's request's
    sampling word (`opweave.kernels.sampling`), loaded when a request takes the row; `prepare`
    writes a round's positions and token sources, `ids` builds its token ids on the device."""

    def __init__(self, rows: int, num_microbatches: int, device: torch.device):
        self.rows, self.device = rows, device
        self.words = [torch.tensor([GREEDY] * rows, dtype=torch.long, device=device) for _ in range(num_microbatches)]
        self._loaded = [[None] * rows for _ in range(num_microbatches)]  # request index whose word a row holds
        self._target = [[0] * rows for _ in range(num_microbatches)]  # the `target` field a row's word holds
        self._round: list = [None] * num_microbatches  # (positions, host ids, source rows, from device) per mb
        self._static: dict = {}  # (mb, layout) -> its device tensors, least recently used first

    MAX_LAYOUTS = 64

    def prepare(self, mb: int, plan: StepPlan, layout: Layout) -> None:
        """Between rounds (on the host): microbatch `mb`'s positions [1, T], prompt tokens, and for
        each decoding row's token the row whose received token it is; the words of new requests,
        and the `target` of rows whose prompt log-probabilities are asked (`RowStep.target`)."""
        if plan.counts != layout.counts:
            raise RuntimeError(f"microbatch {mb}: planned tokens {plan.counts} are not the agreed {layout.counts}")
        positions, ids, source, device_fed = [], [], [], []
        changed, targets = [], []
        for r, step in enumerate(plan.rows):
            if step.idle:  # padding where a request ended after the round was agreed: writes nothing
                positions += [-1] * step.pad
                ids += [0] * step.pad
                source += [0] * step.pad
                device_fed += [False] * step.pad
                continue
            if self._loaded[mb][r] != step.request.index:
                self._loaded[mb][r] = step.request.index
                changed.append((r, step.request.sampling))
                self._target[mb][r] = step.request.sampling[TARGET]
            if self._target[mb][r] != step.target + 1:
                self._target[mb][r] = step.target + 1
                targets.append((r, step.target + 1))
            if step.imported:  # its state arrives from a prefill rank: no token this round
                continue
            if step.tokens:
                n = len(step.tokens)
                positions += range(step.first, step.first + n)
                ids += step.tokens
                source += [0] * n
                device_fed += [False] * n
            else:
                positions.append(step.first)
                ids.append(0)
                source.append(r)
                device_fed.append(True)
        if layout.pad:  # no row has a token: one padding token (writes no state)
            positions, ids, source, device_fed = [-1], [0], [0], [False]
        for r, word in changed:
            self.words[mb][r] = torch.tensor(word, dtype=torch.long, device=self.device)
        for r, target in targets:
            self.words[mb][r, TARGET] = target
        host = (torch.tensor([positions], dtype=torch.long), torch.tensor([ids], dtype=torch.long),
                torch.tensor(source, dtype=torch.long), torch.tensor([device_fed]))
        key = (mb, layout.counts, layout.pad)
        static = self._static.pop(key, None)
        if static is None:  # a captured round reads these very tensors: one set per layout
            static = tuple(torch.empty_like(t, device=self.device) for t in host)
            while len(self._static) >= self.MAX_LAYOUTS:
                self._static.pop(next(iter(self._static)))
        self._static[key] = static
        for dst, src in zip(static, host):
            dst.copy_(src)
        self._round[mb] = (*static, all(device_fed))

    def ids(self, mb: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) [1, T] of microbatch `mb` this round, on the device: decoding rows take
        their received token (its record's id; NON_FINITE_TOKEN, -1, becomes 0: that row's
        request has ended)."""
        positions, host_ids, source, from_device, all_device = self._round[mb]
        received = tokens.view(tokens.shape[0], -1)[:, 0].clamp(min=0).index_select(0, source).view(1, -1)
        if all_device:
            return received, positions
        return torch.where(from_device, received, host_ids), positions


TARGET = FIELDS.index("target")


class TokenCopies:
    """The host's view of the sampled tokens, one round late and without blocking the device.

    Inside a round the received tokens are copied into a static device buffer (`stage`: part of
    a captured graph, the same memory every round); after the round, outside it, that buffer is
    copied to the host without blocking (pinned memory on CUDA) into one of two host buffers,
    with an event; the host reads it at the end of the next round (`read`), when it has long
    completed."""

    LAG = HOST_TOKEN_LAG  # host buffers: a round's copy is read at the end of the next round, so the
    # tokens sampled in round r reach the host at the end of round r + 2 (what the traffic model counts)

    def __init__(self, rows: int, num_microbatches: int, device: torch.device, width: int = 1):
        pin = device.type == "cuda"
        self._stage = [torch.zeros((rows, width), dtype=torch.long, device=device) for _ in range(num_microbatches)]
        self._host = [[torch.zeros((rows, width), dtype=torch.long, pin_memory=pin) for _ in range(num_microbatches)]
                      for _ in range(self.LAG)]
        self._events: list = [None] * self.LAG
        self._cuda = device.type == "cuda"

    def stage(self, mb: int, tokens: torch.Tensor) -> None:
        """Inside the round: keep `tokens` (records [rows, width], sampled in the previous round) on
        the device."""
        self._stage[mb].copy_(tokens)

    def round_done(self, round_index: int) -> None:
        """After the round is enqueued: start the copies to the host and mark when they complete."""
        for host, staged in zip(self._host[round_index % self.LAG], self._stage):
            host.copy_(staged, non_blocking=self._cuda)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[round_index % self.LAG] = event

    def read(self, round_index: int) -> list[tuple[list[int], torch.Tensor]]:
        """The records staged in round `round_index` (sampled in the round before), per microbatch:
        (each row's token id, the host buffer of its records [rows, width], read before this
        buffer's next copy; the scheduler converts only the rows that report log-probabilities);
        waits for that round's copies (long done when read a round later)."""
        event = self._events[round_index % self.LAG]
        if event is not None:
            event.synchronize()
        return [(t[:, 0].tolist(), t) for t in self._host[round_index % self.LAG]]
