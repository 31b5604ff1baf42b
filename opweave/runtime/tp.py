"""Tensor-parallel shards of operator modules, as `opweave.ir.tp` says.

A shard of an operator is the same module class built for a sharded configuration: the table's
share of the attention heads (q heads / t; KV heads / t, or one replicated KV head when t exceeds
them), of the dense and expert intermediate sizes, of the Gated-DeltaNet key/value heads and of
the vocabulary. Its weights are the table's blocks of the checkpoint tensors (`OpTP.weight_split`:
which dimension, which packed parts), read with safetensors slices; the module's parameter shapes
are checked against the table, so the two never drift apart. The generated code all-reduces the
partial sums the table names.
"""

from __future__ import annotations

import dataclasses

import torch

from opweave.errors import OpWeaveError
from opweave.ir.tp import OpTP, share
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


class ShardReader:
    """Reads this rank's block of each checkpoint tensor of one operator (see the module docstring)."""

    def __init__(self, reader, view: OpTP, tp: int, rank: int):
        self.reader, self.view, self.tp, self.rank = reader, view, tp, rank

    def has(self, key: str) -> bool:
        return self.reader.has(key)

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        full = tuple(self.reader.shape(key))
        expected = dict(self.view.weights).get(key)
        if expected is not None and full != tuple(expected):  # before splitting it: name the tensor
            raise OpWeaveError(f"tensor '{key}' has shape {full}, the model's config implies {tuple(expected)}")
        found = self.view.weight_split(key, full)
        local = self.view.local_shape(key, full, self.tp)
        if shape is not None and tuple(shape) != local:
            raise OpWeaveError(f"tensor '{key}' has shape {full}: a TP {self.tp} shard is {local}, "
                               f"the operator expects {tuple(shape)}")
        if self.view.added_once(key) and self.rank != 0:  # a partial-sum op's bias: the first rank adds it
            return torch.zeros(full)
        if found is None:
            return self.reader.get(key, full)
        dim, split = found
        return torch.cat([self.reader.get_slice(key, dim, start, start + length)
                          for start, length in split.blocks(self.tp, self.rank)], dim=dim)


def needs_shard(module: OpModule) -> bool:
    """Whether a TP group runs a shard of `module` (a weightless, stateless op is the same module
    at any degree: the sampler, RoPE's rotation, the activation)."""
    if not module_tp(module).rule.sharded:
        return False
    return any(True for _ in module.parameters(recurse=False)) or bool(module.state_attrs)


def shard_module(module: OpModule, tp: int, rank: int, reader, device: torch.device) -> OpModule:
    """This rank's shard of `module`, materialised on `device` with its weight blocks."""
    view = module_tp(module)
    if not view.legal(tp):
        raise OpWeaveError(f"{module.cfg.name}: {module.kind.value} ({view.units} units, {view.kv_heads} KV heads) "
                           f"does not split over TP {tp}")
    sharded = rebuild(module, sharded_config(module.cfg, tp), tp)
    for attr, p in sharded.named_parameters(recurse=False, remove_duplicate=False):
        key = sharded.tied.get(attr) or sharded.weight_keys[attr]
        expected = view.local_shape(key, dict(view.weights)[key], tp)
        if tuple(p.shape) != expected:
            raise AssertionError(f"{module.kind.value} shard {attr}: built {tuple(p.shape)}, the TP table says {expected}")
    sharded = sharded.to_empty(device=device)
    sharded.init_buffers()
    if reader is not None:  # None: on the meta device, shapes only
        sharded.load_weights(ShardReader(reader, view, tp, rank))
    return sharded


def rebuild(module: OpModule, cfg: ModelConfig, tp: int) -> OpModule:
    """The same operator for the TP-`tp` sharded configuration `cfg`, on the meta device."""
    from opweave.models import ops

    cls = type(module)
    with torch.device("meta"):
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

