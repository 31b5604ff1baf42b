"""Materialising a rank's operator modules: its TP shard of each, with only its weights.

Operators are built on the meta device with the model; a rank materialises the ones it runs.
With TP degree t an operator the TP table (`opweave.ir.tp`) shards is rebuilt for a sharded
configuration and loads the table's blocks of its checkpoint tensors (`shard_module`); the runtime
all-reduces the partial sums the table names. Replicated operators (the embedding, norms, the
router) load whole. Routed experts follow the rank program's expert layout (`experts`: "tp" slices
every expert's channels, "ep" gives each rank E / t whole experts).

A shard of an operator is the same module class built for a sharded configuration
(`sharded_config`, `rebuild`): the table's share of the attention heads (q heads / t; KV heads /
t, or one replicated KV head when t exceeds them), of the dense and expert intermediate sizes, of
the Gated-DeltaNet key/value heads and of the vocabulary. Its weights are the table's blocks of
the checkpoint tensors (`OpTP.weight_split`: which dimension, which packed parts), read with
safetensors slices (`ShardReader`); the module's parameter shapes are checked against the table,
so the two never drift apart. With the expert-parallel layout ("ep",
`opweave.ir.tp.EXPERT_LAYOUTS`) a routed-experts module is instead rebuilt as its rank's block of
whole experts (`OpTP.expert_block`: E / t experts, each with every intermediate channel), reading
its block of every fused expert tensor and, from a per-expert checkpoint, only its own experts'
tensors. Every other op shards as under TP.

Weights are copied into the tensors the module already holds on the run device
(`opweave.models.ops.load_into`), and `check_placement` then asserts that every parameter, buffer
and state tensor of the rank is on that device: a host tensor left on a CUDA rank is a one-line
error naming the op and the tensor, not a device-mismatch failure deep inside the first round.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from opweave.errors import OpWeaveError
from opweave.ir.kinds import OpKind
from opweave.ir.tp import EXPERT_KINDS, EXPERT_LAYOUTS, OpTP, share
from opweave.models.config import ModelConfig
from opweave.models.ops import OpModule
from opweave.models.stored import cat_stored
from opweave.runtime.heartbeat import Phase, report
from opweave.runtime.kernel_ops import kernel_backend


# ---------------------------------------------------------------- one operator's shard (the TP table's)
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


RUN_LAYOUTS = EXPERT_LAYOUTS
"""The layouts a rank runs ("dp": a TP 1 rank whose routed experts are its expert group's share)."""


def program_ep(program) -> tuple[int, int]:
    """(expert group size, this rank's place in it) of a rank program: "dp" ranks' `ep_group`,
    (1, 0) for every other rank."""
    return (len(program.ep_group), program.ep_group.index(program.rank)) if program.ep_group else (1, 0)


def program_slots(program) -> dict[int, tuple[int, ...]]:
    """Per MoE layer, the experts a rank program's routed experts hold where its group keeps
    copies (`RankProgram.ep_slots`; empty without copies)."""
    me = program.ep_group.index(program.rank) if program.ep_group else program.tp_rank
    return {layer: tuple(slots[me]) for layer, slots in program.ep_slots}


def program_copies(program, cfg) -> dict:
    """Per MoE layer, the group's placement (`runtime.dpexperts.ExpertCopies`) where it keeps copies."""
    if not program.ep_slots:
        return {}
    from opweave.runtime.dpexperts import ExpertCopies

    me = program.ep_group.index(program.rank) if program.ep_group else program.tp_rank
    return {layer: ExpertCopies(tuple(tuple(s) for s in slots), cfg.moe.num_experts, me)
            for layer, slots in program.ep_slots}


def check_layout(layout: str) -> None:
    """Raises a one-line OpWeaveError unless a rank runs `layout` (`RUN_LAYOUTS`)."""
    if layout not in RUN_LAYOUTS:
        raise OpWeaveError(f"routed-experts layout {layout!r}: a rank runs one of {', '.join(RUN_LAYOUTS)}")


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

    def get_stored(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's block of quantized matrix `key` as stored (`models.stored`): the same split
        as `get`'s, read in whole quantization blocks."""
        full = tuple(self.reader.shape(key))
        found = self.view.weight_split(key, full, self.layout)
        if found is None:
            return self.reader.get_stored(key)
        dim, split = found
        return cat_stored([self.reader.get_stored(key, (dim, start, start + length))
                           for start, length in split.blocks(self.tp, self.rank)], len(full), dim)

    def _degree(self) -> str:
        return f"{'EP' if self.view.expert_parallel(self.layout) else 'TP'} {self.tp}"


def needs_shard(module: OpModule) -> bool:
    """Whether a TP group runs a shard of `module` (a weightless, stateless op is the same module
    at any degree: the sampler, RoPE's rotation, the activation)."""
    if not module_tp(module).rule.sharded:
        return False
    return any(True for _ in module.parameters(recurse=False)) or bool(module.state_attrs)


def shard_module(module: OpModule, tp: int, rank: int, reader, device: torch.device,
                 layout: str = "tp", stored=None, strict: bool = True) -> OpModule:
    """This rank's shard of `module`, materialised on `device` with its weight blocks.

    Args:
        module: the full (unsharded) operator, on the meta device.
        tp, rank: the group's degree and this rank's place in it.
        reader: checkpoint reader of the full tensors (None: shapes only, nothing loaded).
        layout: how the group holds routed experts ("tp": a slice of every expert's channels;
            "ep": E / tp whole experts per rank); other ops shard the same under both.
        stored, strict: the checkpoint's `WeightFormat` where its quantized matrices are held as
            stored (`stored_format`), else None; `OpModule.hold_stored`'s `strict`.
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
    if stored is not None:
        sharded.hold_stored(stored, strict)
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


class SlotReader:
    """Reads the expert-stacked tensors of a routed-experts module as the slots it holds (each
    slot's expert's row of the stacked tensor, `RoutedExperts.slots`); other keys as they are."""

    def __init__(self, reader, slots: tuple[int, ...], stacked: set[str]):
        self.reader, self.slots, self.stacked = reader, slots, stacked

    def has(self, key: str) -> bool:
        return self.reader.has(key)

    def get(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if key not in self.stacked:
            return self.reader.get(key, shape)
        out = torch.cat([self.reader.get_slice(key, 0, e, e + 1) for e in self.slots])
        if shape is not None and tuple(out.shape) != tuple(shape):
            raise OpWeaveError(f"tensor '{key}': {len(self.slots)} expert slots of it are {tuple(out.shape)}, "
                               f"the operator expects {tuple(shape)}")
        return out

    def get_stored(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self.stacked:
            return self.reader.get_stored(key)
        full = tuple(self.reader.shape(key))
        return cat_stored([self.reader.get_stored(key, (0, e, e + 1)) for e in self.slots], len(full), 0)


def slot_module(module: OpModule, slots: tuple[int, ...], reader, device: torch.device, stored=None,
                strict: bool = True) -> OpModule:
    """Routed experts `module` holding the experts `slots` name (copies included), on `device`
    (`stored`, `strict`: as `shard_module`'s)."""
    with torch.device("meta"):
        held = type(module)(module.cfg, module.layer, slots=slots)
    if stored is not None:
        held.hold_stored(stored, strict)
    held = held.to_empty(device=device)
    held.init_buffers()
    if reader is not None:
        held.load_weights(SlotReader(reader, held.slots, set(held.weight_keys.values())))
    return held


# ---------------------------------------------------------------- a rank's operators
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
    if callable(weights):  # a reader factory given the full shapes (profile/allocated.py: meta tensors)
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

    return CheckpointReader(weights)  # a published fp8 / MXFP4 checkpoint reads dequantized (`models.quantized`)


def stored_format(weights, cfg: ModelConfig, device: torch.device):
    """The `WeightFormat` a rank holds its quantized matrices in as stored (`models.stored`): a
    published fp8 / MXFP4 checkpoint run on the Triton kernels (CUDA's, or forced with
    `OPWEAVE_KERNELS=triton`), which dequantize them in registers; None where weights are dense or
    random, or read dequantized (CPU ranks on the torch kernels). On CUDA with the torch kernels a
    quantized checkpoint is a one-line error: held dequantized it would exceed the planned memory."""
    if cfg.weight_format is None or callable(weights) or weights == "random":
        return None
    if kernel_backend(device) == "triton":
        return cfg.weight_format
    if device.type == "cuda":
        raise OpWeaveError(f"{weights}: the checkpoint's weights are {cfg.weight_format.method} "
                           "(quantization_config); on a GPU the torch kernels would hold them dequantized, above the "
                           "planned memory: run with the Triton kernels (the default on CUDA; unset OPWEAVE_KERNELS)")
    return None


def materialize(modules: dict[int, OpModule], weights: str, tp: int, tp_rank: int,
                device: torch.device, load: bool | None = None, names: list[str] | None = None,
                who: str = "", experts: str = "tp", ep: tuple[int, int] = (1, 0),
                slots: dict[int, tuple[int, ...]] | None = None, stored=None) -> dict[int, OpModule]:
    """The rank's operators on `device` with their (sharded) weights loaded: the TP table
    (`opweave.ir.tp`) says which are sharded and how, `experts` ("tp" | "ep", the rank program's
    `experts`) how routed experts are held. A tied LM head on the rank that also holds
    the embedding views its block of the embedding's weight (held once, as the planner counts).
    On the meta device nothing is read unless `load` says so (by default, `load` is whether the
    device is a real one): the modules show what the rank would allocate. Every tensor of the
    result is checked to be on `device` (`check_placement`: `names` names the ops, `who` the rank).
    `ep`: under "dp" (a TP 1 rank of an expert group), the group's size and this rank's place in
    it: its routed experts are that block of the experts, every other op whole. `slots`: per MoE
    layer, the experts this rank's routed experts hold where its expert group keeps copies
    (`opweave.ir.experts.placement`, the rank program's `ep_slots`). `stored`: the checkpoint's
    `WeightFormat` to hold quantized matrices in as stored (`stored_format`; by default what the
    weights and the kernel backend call for); given, modules that have no kernel over it keep
    theirs dense (the meta measurement of a GPU rank, `profile/allocated.py`)."""
    check_layout(experts)
    if not modules:
        return {}
    device = torch.device(device)
    if load is None:
        load = device.type != "meta"
    cfg = next(iter(modules.values())).cfg
    strict = stored is None
    if strict:
        stored = stored_format(weights, cfg, device) if load else None
    reader = _reader(weights, cfg, modules) if load else None
    out = {}
    for index, module in modules.items():
        if slots and module.kind in EXPERT_KINDS and module.layer in slots:
            module = slot_module(module, slots[module.layer], reader, device, stored, strict)
        elif experts == "dp" and ep[0] > 1 and module.kind in EXPERT_KINDS:
            module = shard_module(module, ep[0], ep[1], reader, device, "ep", stored, strict)
        elif tp > 1 and needs_shard(module):
            module = shard_module(module, tp, tp_rank, reader, device, experts, stored, strict)
        else:
            if stored is not None:
                module.hold_stored(stored, strict)
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
