"""The runtime's scheduling loop in one process, for tests of the scheduler with a real model:
plans two rounds ahead, builds each round's packed inputs with `RowInputs` (decoding rows take the
device's tokens), and learns the sampled tokens two rounds late, as `Runtime.end_round` does.

The model here is the plain `DecodeStep` ([rows, width] batches), so each round's packed tokens
are laid back out per row, left-padded with position -1: what the scheduler plans is checked
against transformers, the packed operators by the multi-process runtime tests."""

import torch

from opweave.runtime.inputs import RowInputs
from opweave.runtime.layout import Layout


def unpack(ids: torch.Tensor, positions: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [1, T] ids and positions -> [rows, width], each row's tokens at its right end."""
    rows, width = len(layout.counts), max(layout.counts + (1,))
    out_ids = torch.zeros(rows, width, dtype=torch.long)
    out_pos = torch.full((rows, width), -1, dtype=torch.long)
    for r, c in enumerate(layout.counts):
        a, b = layout.offsets[r], layout.offsets[r + 1]
        if c:
            out_ids[r, width - c:] = ids[0, a:b]
            out_pos[r, width - c:] = positions[0, a:b]
    return out_ids, out_pos


def drive(sched, step, rows: int, num_microbatches: int = 1, on_round=None) -> int:
    """Runs `step(ids, positions) -> tokens` until the scheduler is idle; returns the rounds run.
    `on_round(round, mb, plan, ids, positions)` sees every step that runs (packed ids, positions)."""
    inputs = RowInputs(rows, num_microbatches, torch.device("cpu"))
    tokens = [torch.zeros(rows, dtype=torch.long) for _ in range(num_microbatches)]
    sampled: dict[int, list[list[int]]] = {}
    sched.plan(), sched.plan()
    r = 0
    while sched.active:
        sampled[r] = []
        for mb in range(num_microbatches):
            plan = sched.take(r, mb)
            layout = Layout(plan.counts)
            if layout.tokens:
                inputs.prepare(mb, plan, layout)
                ids, positions = inputs.ids(mb, tokens[mb])
                if on_round is not None:
                    on_round(r, mb, plan, ids, positions)
                tokens[mb] = step(*unpack(ids, positions, layout)).view(-1).clone()
            sampled[r].append(tokens[mb].tolist())
        if r >= 2:
            for mb, t in enumerate(sampled.pop(r - 2)):
                sched.learn(r - 2, mb, t)
        sched.plan()
        r += 1
    return r
