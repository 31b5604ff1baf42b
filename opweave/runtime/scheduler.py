"""Request scheduling on an embedding-owner replica: its rows of every microbatch are slots.

A free slot takes the next request of this replica's queue and prefills its prompt through the
same compiled stages, at most `prefill_chunk` tokens per step (a planned figure carried by the
rank program, `opweave.models.activation.PREFILL_CHUNK` by default): a longer prompt takes several
steps, and the token sampled after a chunk that is not the prompt's last is dropped. Later steps
feed one token. Rows prefilling and rows decoding share a step: a step's tokens for a microbatch
are left-padded to its longest chunk with position -1 (no state is written for padding), so the
last column always holds each slot's newest token. A slot frees when its
sequence emits an EOS id, reaches `max_new_tokens`, or fills the planned context; or when the
sampler marks its row NON_FINITE_TOKEN (its logits held a NaN or an infinity): the request then
ends with an error naming the output token, and the other slots carry on.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import torch

from opweave.errors import OpWeaveError
from opweave.models.activation import PREFILL_CHUNK
from opweave.models.ops import NON_FINITE_TOKEN


@dataclasses.dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None
    source: str = ""  # where the prompt came from, for messages ("--prompts p.jsonl: line 3")


@dataclasses.dataclass
class _Slot:
    request: Request | None = None
    position: int = 0          # next position to write
    pending: list[int] | None = None  # tokens still to feed (the prompt's rest, or the last new token)
    fed: int = 0               # tokens fed at this microbatch's last step


class Scheduler:
    def __init__(self, requests: list[Request], num_microbatches: int, rows: int, context: int,
                 eos_ids: tuple[int, ...], prefill_chunk: int = PREFILL_CHUNK):
        if prefill_chunk < 1:
            raise OpWeaveError(f"prefill chunk must be at least 1 token, got {prefill_chunk}")
        self.queue = deque(requests)
        self.prefill_chunk = prefill_chunk
        self.slots = [[_Slot() for _ in range(rows)] for _ in range(num_microbatches)]
        self.context = context
        self.eos = set(eos_ids)
        self.done: list[Request] = []

    @property
    def active(self) -> bool:
        return bool(self.queue) or any(s.request for row in self.slots for s in row)

    def _fill(self, slot: _Slot) -> None:
        while self.queue and slot.request is None:
            req = self.queue.popleft()
            if not req.prompt:
                req.error = "empty prompt"
            elif len(req.prompt) >= self.context:
                req.error = f"prompt of {len(req.prompt)} tokens does not fit the planned context of {self.context}"
            else:
                slot.request, slot.position, slot.pending = req, 0, list(req.prompt)
                return
            self.done.append(req)

    def step_inputs(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) [rows, T] for microbatch `mb`, left-padded with position -1."""
        for slot in self.slots[mb]:
            if slot.request is None:
                self._fill(slot)
        chunks = [s.pending[:self.prefill_chunk] if s.request else [] for s in self.slots[mb]]
        width = max([len(c) for c in chunks] + [1])
        ids = torch.zeros(len(chunks), width, dtype=torch.long)
        positions = torch.full((len(chunks), width), -1, dtype=torch.long)
        for row, (slot, chunk) in enumerate(zip(self.slots[mb], chunks)):
            slot.fed = len(chunk)
            if chunk:
                ids[row, width - len(chunk):] = torch.tensor(chunk)
                positions[row, width - len(chunk):] = torch.arange(slot.position, slot.position + len(chunk))
        return ids, positions

    def take_tokens(self, mb: int, tokens: torch.Tensor) -> None:
        """Records the ids the last stage produced for microbatch `mb`'s previous step."""
        for slot, token in zip(self.slots[mb], tokens.tolist()):
            req = slot.request
            if req is None or slot.pending is None or not slot.fed:
                continue
            slot.position += slot.fed
            slot.pending = slot.pending[slot.fed:]
            slot.fed = 0
            if slot.pending:  # the prompt is not all in yet: this token is not an output
                continue
            if token == NON_FINITE_TOKEN:
                req.error = f"non-finite logits at output token {len(req.output) + 1}"
                finished = True
            else:
                req.output.append(int(token))
                finished = (int(token) in self.eos or len(req.output) >= req.max_new_tokens
                            or slot.position >= self.context)
            if finished:
                self.done.append(req)
                slot.request, slot.pending = None, None
            else:
                slot.pending = [int(token)]
