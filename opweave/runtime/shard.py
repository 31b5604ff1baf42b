"""Materialising a rank's operator modules: its TP shard of each, with only its weights.

Operators are built on the meta device with the model; a rank materialises the ones it runs.
With TP degree t an operator the TP table (`opweave.ir.tp`) shards is rebuilt for a sharded
configuration (its share of the heads, of the intermediate size, of the vocabulary) and loads the
table's blocks of its checkpoint tensors (`runtime/tp.py`); the runtime all-reduces the partial
sums the table names. Replicated operators (the embedding, norms, the router) load whole. Routed
experts follow the rank program's expert layout (`experts`: "tp" slices every expert's channels,
"ep" gives each rank E / t whole experts; `runtime/tp.shard_module`).

Weights are copied into the tensors the module already holds on the run device
(`opweave.models.ops.load_into`), and `check_placement` then asserts that every parameter, buffer
and state tensor of the rank is on that device: a host tensor left on a CUDA rank is a one-line
error naming the op and the tensor, not a device-mismatch failure deep inside the first round.
"""

from __future__ import annotations

import zlib

import torch

from opweave.errors import OpWeaveError
from opweave.ir.kinds import OpKind
from opweave.models.ops import OpModule
from opweave.runtime.heartbeat import Phase, report
from opweave.runtime.tp import check_layout, module_tp, needs_shard, shard_module


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
    if callable(weights):  # a reader factory given the full shapes (runtime/memory.py: meta tensors)
        return weights(_reader("random", cfg, modules))
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
    from opweave.models.config import refuse_quantized

    refuse_quantized(cfg, weights)
    return CheckpointReader(weights)


def materialize(modules: dict[int, OpModule], weights: str, tp: int, tp_rank: int,
                device: torch.device, load: bool | None = None, names: list[str] | None = None,
                who: str = "", experts: str = "tp") -> dict[int, OpModule]:
    """The rank's operators on `device` with their (sharded) weights loaded: the TP table
    (`opweave.ir.tp`) says which are sharded and how, `experts` ("tp" | "ep", the rank program's
    `experts`) how routed experts are held. A tied LM head on the rank that also holds
    the embedding views its block of the embedding's weight (held once, as the planner counts).
    On the meta device nothing is read unless `load` says so (by default, `load` is whether the
    device is a real one): the modules show what the rank would allocate. Every tensor of the
    result is checked to be on `device` (`check_placement`: `names` names the ops, `who` the rank)."""
    check_layout(experts)
    if not modules:
        return {}
    device = torch.device(device)
    if load is None:
        load = device.type != "meta"
    reader = _reader(weights, next(iter(modules.values())).cfg, modules) if load else None
    out = {}
    for index, module in modules.items():
        if tp > 1 and needs_shard(module):
            module = shard_module(module, tp, tp_rank, reader, device, experts)
        else:
            module = module.to_empty(device=device)
            module.init_buffers()
            if reader is not None:
                module.load_weights(reader)
        out[index] = module.eval()
        report(Phase.LOADING)  # a long load is progress, not a stall
    _tie(out, tp, tp_rank)
    check_placement(out, device, names, who)
    return out


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` lives on `device` (a device without an index, "cuda", means any of its kind)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def module_tensors(module: torch.nn.Module):
    """(what, name, tensor) for every tensor a module holds: parameters ("weight"), buffers
    ("buffer") and tensors set as attributes, such as per-sequence state ("state")."""
    for name, p in module.named_parameters(recurse=False):
        yield "weight", name, p
    for name, b in module.named_buffers(recurse=False):
        if b is not None:
            yield "buffer", name, b
    for name, v in vars(module).items():
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            yield "state", name, v


def check_placement(modules: dict[int, torch.nn.Module], device, names: list[str] | None = None,
                    who: str = "") -> None:
    """Raises a one-line `OpWeaveError` naming the first op and tensor not on `device`
    (`names`: the ops' names by index, else the index; `who`: e.g. "rank 2")."""
    device = torch.device(device)
    for index, module in modules.items():
        for sub_name, sub in module.named_modules():
            for what, name, t in module_tensors(sub):
                if not on_device(t, device):
                    op = names[index] if names is not None else str(index)
                    if sub_name:
                        name = f"{sub_name}.{name}"
                    prefix = f"{who}: " if who else ""
                    raise OpWeaveError(f"{prefix}op {op} {what} '{name}' is on {t.device}, "
                                       f"the run device is {device}")


def _tie(modules: dict[int, OpModule], tp: int, tp_rank: int) -> None:
    embed = next((m for m in modules.values() if m.kind == OpKind.EMBED), None)
    for m in modules.values():
        if m.kind != OpKind.LM_HEAD or "weight" not in m.tied or embed is None:
            continue
        full = embed.weight
        found = module_tp(m).weight_split(m.tied["weight"], tuple(full.shape)) if tp > 1 else None
        if found is None:
            block = full
        else:
            dim, split = found
            (start, length), = split.blocks(tp, tp_rank)
            block = full.narrow(dim, start, length)
        if tuple(block.shape) != tuple(m.weight.shape):
            raise AssertionError(f"tied LM head {tuple(m.weight.shape)} vs embedding block {tuple(block.shape)}")
        m.weight = torch.nn.Parameter(block, requires_grad=False)
