"""Tensor-parallel shards of operator modules.

A shard of an operator is the same module class built for a sharded configuration: 1/t of the
attention heads (q, kv and Gated-DeltaNet key/value heads), of the dense and expert intermediate
sizes, and of the vocabulary. Its weights are the matching slices of the checkpoint tensors,
read with safetensors slices: a sharded dimension is the one whose size differs from the full
tensor's, split in t contiguous blocks, except two packed layouts split part by part:
  - fused experts `gate_up_proj` [E, 2I, H]: the gate half and the up half;
  - the Gated-DeltaNet causal conv [q | k | v channels, 1, K]: each of the three parts.
Row-parallel shards (o_proj, down, experts) produce partial sums: the generated code all-reduces.
"""

from __future__ import annotations

import dataclasses

import torch

from opweave.errors import OpWeaveError
from opweave.models.config import ModelConfig
from opweave.models.ops import OpModule


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    def div(n: int, what: str) -> int:
        if n % tp:
            raise OpWeaveError(f"{cfg.name}: {what} ({n}) does not divide by TP {tp}")
        return n // tp

    changes = dict(num_heads=div(cfg.num_heads, "attention heads"),
                   num_kv_heads=div(cfg.num_kv_heads, "KV heads"),
                   intermediate_size=div(cfg.intermediate_size, "intermediate size") if cfg.intermediate_size else 0,
                   vocab_size=div(cfg.vocab_size, "vocabulary"))
    if cfg.moe:
        changes["moe"] = dataclasses.replace(
            cfg.moe, intermediate_size=div(cfg.moe.intermediate_size, "expert intermediate size"),
            shared_expert_intermediate_size=div(cfg.moe.shared_expert_intermediate_size, "shared expert size")
            if cfg.moe.shared_expert_intermediate_size else 0)
    if cfg.linear_attn:
        changes["linear_attn"] = dataclasses.replace(
            cfg.linear_attn, num_key_heads=div(cfg.linear_attn.num_key_heads, "linear key heads"),
            num_value_heads=div(cfg.linear_attn.num_value_heads, "linear value heads"))
    return dataclasses.replace(cfg, **changes)


class ShardReader:
    """Reads this rank's slice of each checkpoint tensor (see the module docstring)."""

    def __init__(self, reader, cfg: ModelConfig, tp: int, rank: int):
        self.reader, self.cfg, self.tp, self.rank = reader, cfg, tp, rank

    def has(self, key: str) -> bool:
        return self.reader.has(key)

    def _full_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.reader.shape(key))

    def _block(self, key: str, dim: int, start: int, size: int) -> torch.Tensor:
        return self.reader.get_slice(key, dim, start, start + size)

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        full = self._full_shape(key)
        if shape is None or tuple(shape) == full:
            return self.reader.get(key, full)
        dims = [d for d in range(len(full)) if full[d] != shape[d]]
        if len(dims) != 1 or full[dims[0]] != shape[dims[0]] * self.tp:
            raise OpWeaveError(f"tensor '{key}' has shape {full}, the config implies {self.tp} TP shards "
                               f"of {tuple(shape)}")
        dim = dims[0]
        if key.endswith("gate_up_proj"):
            half = full[dim] // 2
            part = half // self.tp
            return torch.cat([self._block(key, dim, h * half + self.rank * part, part) for h in (0, 1)], dim=dim)
        if key.endswith("conv1d.weight"):
            la = self.cfg.linear_attn
            sizes = [la.num_key_heads * la.key_head_dim] * 2 + [la.num_value_heads * la.value_head_dim]
            parts, offset = [], 0
            for size in sizes:
                parts.append(self._block(key, dim, offset + self.rank * size // self.tp, size // self.tp))
                offset += size
            return torch.cat(parts, dim=dim)
        size = shape[dim]
        return self._block(key, dim, self.rank * size, size)


def shard_module(module: OpModule, tp: int, rank: int, reader, device: torch.device) -> OpModule:
    """This rank's shard of `module`, materialised on `device` with its weight slices."""
    cfg = sharded_config(module.cfg, tp)
    sharded = rebuild(module, cfg)
    sharded = sharded.to_empty(device=device)
    sharded.init_buffers()
    sharded.load_weights(ShardReader(reader, module.cfg, tp, rank))
    return sharded


def rebuild(module: OpModule, cfg: ModelConfig) -> OpModule:
    """The same operator for another (sharded) configuration, on the meta device."""
    from opweave.models import ops

    cls = type(module)
    with torch.device("meta"):
        if cls is ops.Attention:
            return ops.Attention(cfg, module.layer, module.window)
        if cls is ops.Rope:
            return ops.Rope(cfg, module.layer, module.spec)
        if cls is ops.OProj:
            return ops.OProj(cfg, module.layer, module.weight_keys["weight"], module.weight.shape[1] // _tp(module, cfg))
        if cls is ops.LMHead:
            head = ops.LMHead.__new__(ops.LMHead)
            ops.OpModule.__init__(head, cfg, None)
            key = module.tied.get("weight") or module.weight_keys["weight"]
            head._param("weight", key, cfg.vocab_size, cfg.hidden_size)
            return head
        return cls(cfg, module.layer)


def _tp(module: OpModule, cfg: ModelConfig) -> int:
    return module.cfg.num_heads // cfg.num_heads
