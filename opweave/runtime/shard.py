"""Materialising a rank's operator modules: its TP shard of each, with only its weights.

Operators are built on the meta device with the model; a rank materialises the ones it runs.
With TP degree t an operator is rebuilt for a sharded configuration (1/t of the heads, of the
intermediate size, of the vocabulary) and loads the matching slices of its checkpoint tensors
(`runtime/tp.py` says which dimension and block layout); the runtime all-reduces the
partial sums of row-parallel operators.
"""

from __future__ import annotations

import zlib

import torch

from opweave.ir.kinds import OpKind, TPRule
from opweave.models.ops import OpModule
from opweave.runtime.heartbeat import Phase, report


class RandomWeights:
    """Deterministic random tensors per checkpoint key (the same on every rank)."""

    def __init__(self, cfg, full_shapes: dict[str, tuple[int, ...]] | None = None):
        self.cfg = cfg
        self.full_shapes = full_shapes or {}

    def has(self, key: str) -> bool:
        return True

    def shape(self, key: str) -> tuple[int, ...]:
        return self.full_shapes[key]

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shape = tuple(shape if shape is not None else self.full_shapes[key])
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        if len(shape) == 1:  # norm weights, gates' biases: near their neutral value
            base = 0.0 if (self.cfg.norm_offset or "A_log" in key or "dt_bias" in key) else 1.0
            return base + 0.05 * torch.randn(shape, generator=g)
        return 0.05 * torch.randn(shape, generator=g)

    def get_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.get(key).narrow(dim, start, stop - start)


def _reader(weights: str, cfg, modules: dict[int, OpModule]):
    if weights == "random":
        shapes = {}
        for m in modules.values():  # full (unsharded) shapes, for slicing
            for attr, p in m.named_parameters(recurse=False, remove_duplicate=False):
                shapes[m.tied.get(attr) or m.weight_keys.get(attr)] = tuple(p.shape)
        for m in modules.values():  # per-expert keys of fused experts
            if hasattr(m, "prefix") and m.cfg.moe:
                e_i, h = m.cfg.moe.intermediate_size, m.cfg.hidden_size
                for e in range(m.cfg.moe.num_experts):
                    shapes[f"{m.prefix}{e}.gate_proj.weight"] = shapes[f"{m.prefix}{e}.up_proj.weight"] = (e_i, h)
                    shapes[f"{m.prefix}{e}.down_proj.weight"] = (h, e_i)
        return RandomWeights(cfg, shapes)
    from opweave.models.checkpoint import CheckpointReader

    return CheckpointReader(weights)


def materialize(modules: dict[int, OpModule], weights: str, tp: int, tp_rank: int,
                device: torch.device) -> dict[int, OpModule]:
    """The rank's operators on `device` with their (sharded) weights loaded."""
    if not modules:
        return {}
    reader = _reader(weights, next(iter(modules.values())).cfg, modules)
    out = {}
    for index, module in modules.items():
        replicated = module.facts().tp_rule == TPRule.REPLICATE or module.kind in (OpKind.EMBED, OpKind.SAMPLE)
        if tp > 1 and not replicated:
            from opweave.runtime.tp import shard_module

            module = shard_module(module, tp, tp_rank, reader, device)
        else:
            module = module.to_empty(device=device)
            module.init_buffers()
            module.load_weights(reader)
        out[index] = module.eval()
        report(Phase.LOADING)  # a long load is progress, not a stall
    return out

