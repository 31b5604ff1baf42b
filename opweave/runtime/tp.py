"""Tensor-parallel shards of operator modules, as `opweave.ir.tp` says.

A shard of an operator is the same module class built for a sharded configuration: the table's
share of the attention heads (q heads / t; KV heads / t, or one replicated KV head when t exceeds
them), of the dense and expert intermediate sizes, of the Gated-DeltaNet key/value heads and of
the vocabulary. Its weights are the table's blocks of the checkpoint tensors (`OpTP.weight_split`:
which dimension, which packed parts), read with safetensors slices; the module's parameter shapes
are checked against the table, so the two never drift apart. The generated code all-reduces the
partial sums the table names.

With the expert-parallel layout ("ep", `opweave.ir.tp.EXPERT_LAYOUTS`) a routed-experts module is
instead rebuilt as its rank's block of whole experts (`OpTP.expert_block`: E / t experts, each
with every intermediate channel), reading its block of every fused expert tensor and, from a
per-expert checkpoint, only its own experts' tensors. Every other op shards as under TP.
"""

from __future__ import annotations

import dataclasses

import torch

from opweave.errors import OpWeaveError
from opweave.ir.tp import EXPERT_LAYOUTS, OpTP, share
from opweave.models.config import ModelConfig
from opweave.models.ops import OpModule


def module_tp(module: OpModule) -> OpTP:
    """The table's view of an operator module (full, unsharded shapes)."""
    facts = module.facts()
    weights = tuple((module.tied.get(attr) or module.weight_keys[attr], tuple(p.shape))
                    for attr, p in module.named_parameters(recurse=False, remove_duplicate=False))
    return OpTP(kind=module.kind, units=facts.tp_units, kv_heads=facts.kv_heads, weights=weights)


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The configuration one rank's shards are built for (`share` of every unit count). Units an
    op cannot split are refused by `shard_module` for the ops a rank really runs."""
    def part(n: int) -> int:
        return share(n, tp) if n else 0

    changes = dict(num_heads=part(cfg.num_heads), num_kv_heads=part(cfg.num_kv_heads),
                   intermediate_size=part(cfg.intermediate_size), vocab_size=part(cfg.vocab_size))
    if cfg.moe:
        changes["moe"] = dataclasses.replace(
            cfg.moe, intermediate_size=part(cfg.moe.intermediate_size),
            shared_expert_intermediate_size=part(cfg.moe.shared_expert_intermediate_size))
    if cfg.linear_attn:
        changes["linear_attn"] = dataclasses.replace(
            cfg.linear_attn, num_key_heads=part(cfg.linear_attn.num_key_heads),
            num_value_heads=part(cfg.linear_attn.num_value_heads))
    return dataclasses.replace(cfg, **changes)


def check_layout(layout: str) -> None:
    """Raises a one-line OpWeaveError unless `layout` is one of `EXPERT_LAYOUTS`."""
    if layout not in EXPERT_LAYOUTS:
        raise OpWeaveError(f"routed-experts layout {layout!r}: expected one of {', '.join(EXPERT_LAYOUTS)}")


class ShardReader:
    """Reads this rank's block of each checkpoint tensor of one operator (see the module docstring),
    routed experts held as `layout` says ("tp" | "ep")."""

    def __init__(self, reader, view: OpTP, tp: int, rank: int, layout: str = "tp"):
        self.reader, self.view, self.tp, self.rank, self.layout = reader, view, tp, rank, layout

    def has(self, key: str) -> bool:
        return self.reader.has(key)

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        full = tuple(self.reader.shape(key))
        expected = dict(self.view.weights).get(key)
        if expected is not None and full != tuple(expected):  # before splitting it: name the tensor
            raise OpWeaveError(f"tensor '{key}' has shape {full}, the model's config implies {tuple(expected)}")
        found = self.view.weight_split(key, full, self.layout)
        local = self.view.local_shape(key, full, self.tp, self.layout)
        if shape is not None and tuple(shape) != local:
            raise OpWeaveError(f"tensor '{key}' has shape {full}: a {self._degree()} shard is {local}, "
                               f"the operator expects {tuple(shape)}")
        if self.view.added_once(key, self.layout) and self.rank != 0:  # a partial-sum op's bias: the first rank adds it
            return torch.zeros(full)
        if found is None:
            return self.reader.get(key, full)
        dim, split = found
        return torch.cat([self.reader.get_slice(key, dim, start, start + length)
                          for start, length in split.blocks(self.tp, self.rank)], dim=dim)

    def _degree(self) -> str:
        return f"{'EP' if self.view.expert_parallel(self.layout) else 'TP'} {self.tp}"


def needs_shard(module: OpModule) -> bool:
    """Whether a TP group runs a shard of `module` (a weightless, stateless op is the same module
    at any degree: the sampler, RoPE's rotation, the activation)."""
    if not module_tp(module).rule.sharded:
        return False
    return any(True for _ in module.parameters(recurse=False)) or bool(module.state_attrs)


def shard_module(module: OpModule, tp: int, rank: int, reader, device: torch.device,
                 layout: str = "tp") -> OpModule:
    """This rank's shard of `module`, materialised on `device` with its weight blocks.

    Args:
        module: the full (unsharded) operator, on the meta device.
        tp, rank: the group's degree and this rank's place in it.
        reader: checkpoint reader of the full tensors (None: shapes only, nothing loaded).
        layout: how the group holds routed experts ("tp": a slice of every expert's channels;
            "ep": E / tp whole experts per rank); other ops shard the same under both.
    Raises:
        OpWeaveError (one line) when the op does not split over the group as `layout` says."""
    check_layout(layout)
    view = module_tp(module)
    if not view.legal(tp, layout):
        if view.expert_parallel(layout):
            raise OpWeaveError(f"{module.cfg.name}: {module.kind.value} ({view.experts} experts) "
                               f"does not split over EP {tp}")
        raise OpWeaveError(f"{module.cfg.name}: {module.kind.value} ({view.units} units, {view.kv_heads} KV heads) "
                           f"does not split over TP {tp}")
    block = view.expert_block(tp, rank) if view.expert_parallel(layout) else None
    sharded = rebuild(module, sharded_config(module.cfg, tp), tp, block)
    for attr, p in sharded.named_parameters(recurse=False, remove_duplicate=False):
        key = sharded.tied.get(attr) or sharded.weight_keys[attr]
        expected = view.local_shape(key, dict(view.weights)[key], tp, layout)
        if tuple(p.shape) != expected:
            raise AssertionError(f"{module.kind.value} shard {attr}: built {tuple(p.shape)}, the TP table says {expected}")
    sharded = sharded.to_empty(device=device)
    sharded.init_buffers()
    if reader is not None:  # None: on the meta device, shapes only
        sharded.load_weights(ShardReader(reader, view, tp, rank, layout))
    return sharded


def rebuild(module: OpModule, cfg: ModelConfig, tp: int, experts: tuple[int, int] | None = None) -> OpModule:
    """The same operator for the TP-`tp` sharded configuration `cfg`, on the meta device; routed
    experts given `experts` (first expert id, count: an expert-parallel block) hold those whole
    experts instead (built from the module's full configuration: every intermediate channel)."""
    from opweave.models import ops

    cls = type(module)
    with torch.device("meta"):
        if experts is not None:
            return cls(module.cfg, module.layer, experts=experts)
        if cls is ops.Attention:
            return ops.Attention(cfg, module.layer, module.window)
        if cls is ops.Rope:
            return ops.Rope(cfg, module.layer, module.spec)
        if cls is ops.OProj:
            key = module.weight_keys["weight"]
            in_features = module_tp(module).local_shape(key, tuple(module.weight.shape), tp)[1]
            return ops.OProj(cfg, module.layer, key, in_features)
        if cls is ops.LMHead:
            head = ops.LMHead.__new__(ops.LMHead)
            ops.OpModule.__init__(head, cfg, None)
            key = module.tied.get("weight") or module.weight_keys["weight"]
            head._param("weight", key, cfg.vocab_size, cfg.hidden_size)
            if module.tied:  # still the embedding's weight: a view of it where both are on a rank
                head.tied = dict(module.tied)
                del head.weight_keys["weight"]
            return head
        return cls(cfg, module.layer)

