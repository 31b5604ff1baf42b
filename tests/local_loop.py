"""The runtime's scheduling loop in one process, for tests of the scheduler with a real model:
plans two rounds ahead, builds each round's inputs with `RowInputs` (decode rounds on the device
buffers), and learns the sampled tokens two rounds late, as `Runtime.end_round` does."""

import torch

from opweave.runtime.inputs import RowInputs


def drive(sched, step, rows: int, num_microbatches: int = 1, on_round=None) -> int:
    """Runs `step(ids, positions) -> tokens` until the scheduler is idle; returns the rounds run.
    `on_round(round, mb, plan, ids, positions)` sees every step."""
    inputs = RowInputs(rows, num_microbatches, torch.device("cpu"))
    tokens = [torch.zeros(rows, dtype=torch.long) for _ in range(num_microbatches)]
    sampled: dict[int, list[list[int]]] = {}
    plans = [sched.plan(), sched.plan()]
    r = 0
    while sched.active:
        sampled[r] = []
        for mb in range(num_microbatches):
            plan = sched.take(r, mb)
            inputs.prepare(mb, plan)
            width = plans[r][mb]
            ids, positions = (inputs.decode(mb, tokens[mb]) if width == 1 and not plan.host_fed
                              else inputs.host_fed(mb, plan, tokens[mb], width))
            if on_round is not None:
                on_round(r, mb, plan, ids, positions)
            tokens[mb] = step(ids, positions).view(-1).clone()
            sampled[r].append(tokens[mb].tolist())
        if r >= 2:
            for mb, t in enumerate(sampled.pop(r - 2)):
                sched.learn(r - 2, mb, t)
        plans.append(sched.plan())
        r += 1
    return r
