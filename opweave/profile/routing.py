"""`opweave profile --routing PROMPTS.jsonl`: measured expert load of a MoE checkpoint.

The model runs on CPU with the checkpoint's weights over each prompt (its prefill and one
decode step, `opweave.models.model.generate`), and every router's choices are counted: per MoE
layer, the (token, expert) pairs each expert took. The counts (`opweave.ir.experts.ExpertLoad`)
go to `opweave compile --expert-load`, where the planner charges the busiest expert-parallel
GPU's share of them and searches redundant copies of the hottest experts (`--redundant-experts`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from opweave.errors import OpWeaveError
from opweave.ir.experts import ExpertLoad
from opweave.ir.kinds import OpKind


def measure_expert_load(model: str, prompts: Sequence[Sequence[int]],
                        progress: Callable[[str], None] | None = None) -> ExpertLoad:
    """Counts each MoE layer's routed pairs per expert over `prompts` (token ids) on `model` (a
    checkpoint folder)."""
    from opweave.models.model import generate
    from opweave.models.registry import resolve

    source = resolve(model)
    net = source.load()
    if net.cfg.moe is None:
        raise OpWeaveError(f"{model}: not a mixture-of-experts model (no routed experts to count)")
    experts = net.cfg.moe.num_experts
    counts: dict[int, torch.Tensor] = {}

    def count(module, _inputs, output):
        ids = output[1].reshape(-1)
        counts.setdefault(module.layer, torch.zeros(experts, dtype=torch.long))
        counts[module.layer] += torch.bincount(ids.to(torch.long), minlength=experts)

    hooks = [m.register_forward_hook(count) for m in net.modules() if getattr(m, "kind", None) == OpKind.MOE_ROUTER]
    tokens = 0
    try:
        for i, prompt in enumerate(prompts):
            if not prompt:
                continue
            generate(net, list(prompt), 2)
            tokens += len(prompt) + 1
            if progress is not None and (i + 1) % 16 == 0:
                progress(f"routing: {i + 1}/{len(prompts)} prompts")
    finally:
        for h in hooks:
            h.remove()
    if not tokens:
        raise OpWeaveError("--routing: no prompt with tokens")
    return ExpertLoad(model=net.cfg.name, counts={layer: tuple(int(c) for c in v) for layer, v in sorted(counts.items())},
                      tokens=tokens)
