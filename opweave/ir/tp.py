"""Tensor-parallel semantics of every operator kind: the one table the planner, the cost model,
the lowering, the runtime's sharding and the profiler all read (docs/layout.md).

A TP group of degree t runs an op in one of two ways (`KindRule.sharded`):
  - replicated: every rank runs the whole op on the whole activation with all of its weights
    (norms, residual adds, the router, and the embedding: a lookup reads one row per token, so
    splitting it would buy little memory for an all-reduce per step);
  - sharded: every rank holds a block of the op's heads / intermediate channels / vocabulary
    (its "units"), the matching slices of its weights (`weight_split`) and of its state.

Units are split in contiguous blocks (units / t each). KV heads may be fewer than t: then each
rank holds ceil(kv / t) = 1 KV head, the one its query heads use (rank r: head r * kv // t), so a
KV head is replicated t / kv times. A degree is legal for an op only when every one of its unit
counts divides by t, or (KV heads) t divides by it (`legal_tp`).

Outputs: a sharded op's output is either split like its units (`value_layout`), or a partial sum
over the group (`KindRule.partial_sum`: o_proj, MLP down, routed and shared experts) that one
all-reduce completes (`allreduce_after`). Routed experts followed by a shared expert are reduced
once, after the shared expert (it adds its own partial sum to theirs). The LM head is split over
the vocabulary and the sampler gathers one (max logit, index) pair per token from each rank.

Routed experts have a second layout, expert parallelism (`EXPERT_LAYOUTS`: "ep"): every rank holds
E / t whole experts (a contiguous block of expert ids, `expert_block`) instead of a slice of every
expert; each rank runs the (token, expert) pairs routed to its experts and the same all-reduce sums
the partial outputs. Legal when t divides the expert count. Every rank of the group holds every row
(the rows reach every rank as they do under TP), so no all-to-all is needed; the cost is the load
imbalance between ranks (`opweave.cost.model.ep_imbalance`).

A third, "dp" (data-parallel attention inside the expert-parallel group, as DeepSeek's and
SGLang's wide-EP deployments run): every op but the routed experts runs as at TP 1 on its own
rows (1 / t of the group's: its weights whole, its KV cache for its rows alone), and the routed
experts are expert-parallel over the t GPUs; each MoE layer gathers the group's tokens to every
rank and reduce-scatters the experts' sums back (the all-reduce's bytes). Legal when t divides the
expert count. Searched by default (`--no-attention-dp` leaves it out). The runtime lowers such an owner to TP 1
replicas whose routed experts meet over the group (`opweave.runtime.dpexperts`).

Weights stored block-quantized (`QUANT_BLOCK`: fp8 with 128 x 128 scales, mxfp4 with one scale per
32 values) are planned as stored: a TP split that would cut a quantization block is illegal (gpt-oss's
expert down projection, 2880 channels in blocks of 32, splits over TP 2 but not 4 or 8); expert
parallelism keeps every expert whole.

Layouts of values crossing a stage cut are typed (`Replicated`, `Split`) and written to the
rank programs in that form (`layout_to_json` / `layout_from_json`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from opweave.ir.graph import DTYPE_SIZE
from opweave.ir.kinds import OpKind

EXPERT_KINDS = (OpKind.MOE_EXPERTS, OpKind.MOE_EXPERTS_SWIGLU)
"""Routed experts: the op kinds expert parallelism applies to."""

EXPERT_LAYOUTS = ("tp", "ep", "dp")
"""How an owner's TP group holds routed experts: "tp" (a slice of every expert's intermediate
channels on every rank), "ep" (whole experts, E / t per rank), or "dp" (whole experts, E / t per
rank, and every other op data-parallel: each rank its own rows at TP 1)."""

QUANT_BLOCK = {"float8_e4m3fn": 128, "mxfp4": 32}
"""Elements per quantization block along a split dimension, per stored weight dtype (one scale per
128 x 128 block for fp8, per 32 values for mxfp4): a rank's slice must hold whole blocks."""

# ---------------------------------------------------------------- splitting units over a group


def legal_units(units: int, tp: int, replicable: bool = False) -> bool:
    """Whether `units` split over `tp` ranks: they divide by tp, or (replicable: KV heads) tp
    divides by them and each rank holds one."""
    return units % tp == 0 or (replicable and tp % units == 0)


def share(units: int, tp: int) -> int:
    """Units one rank holds: units / tp, at least one (a replicated KV head)."""
    return max(1, units // tp)


def first_unit(units: int, tp: int, rank: int) -> int:
    """The first unit rank `rank` holds (with replication, the one its query heads use)."""
    return rank * units // tp


@dataclasses.dataclass(frozen=True, slots=True)
class Layout(abc.ABC):
    """How a TP group holds a tensor along one dimension (base of `Replicated` and `Split`)."""

    @abc.abstractmethod
    def local_size(self, size: int, tp: int) -> int:
        """Elements of a dimension of `size` that one rank of a TP group of `tp` holds."""


@dataclasses.dataclass(frozen=True, slots=True)
class Replicated(Layout):
    """Every rank holds the whole tensor."""

    def local_size(self, size: int, tp: int) -> int:
        return size


@dataclasses.dataclass(frozen=True, slots=True)
class Split(Layout):
    """The dimension is `sizes` packed parts (elements of each part, in order); each part holds
    `units` (heads, channels…) and splits in contiguous unit blocks, part by part. One part of
    one unit count is the plain contiguous split."""

    sizes: tuple[int, ...]
    units: tuple[int, ...]

    def __post_init__(self):
        if len(self.sizes) != len(self.units) or any(u < 1 or s % u for s, u in zip(self.sizes, self.units)):
            raise ValueError(f"split sizes {self.sizes} do not hold {self.units} units")

    def local_size(self, size: int, tp: int) -> int:
        if size != sum(self.sizes):
            raise ValueError(f"a split of {self.sizes} laid on a dimension of {size}")
        return sum(length for _, length in self.blocks(tp, 0))

    def blocks(self, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
        """(start, length) in the full dimension of each part's block on rank `rank`."""
        out, offset = [], 0
        for size, units in zip(self.sizes, self.units):
            unit = size // units
            out.append((offset + first_unit(units, tp, rank) * unit, share(units, tp) * unit))
            offset += size
        return tuple(out)

    def sources(self, tp: int) -> tuple[tuple[int, ...], ...]:
        """Per part, the ranks whose blocks, in order, make the whole part (with replicated
        units, the first rank holding each)."""
        out = []
        for units in self.units:
            if units >= tp:
                out.append(tuple(range(tp)))
            else:
                out.append(tuple(u * tp // units for u in range(units)))
        return tuple(out)

    def legal(self, tp: int) -> bool:
        return all(legal_units(u, tp, replicable=True) for u in self.units)


REPLICATED = Replicated()


def layout_to_json(layout: Layout) -> dict[str, Any]:
    if isinstance(layout, Split):
        return {"split": {"sizes": list(layout.sizes), "units": list(layout.units)}}
    return {"replicated": {}}


def layout_from_json(data: Any) -> Layout:
    """Inverse of `layout_to_json` (ValueError on anything else)."""
    if data == {"replicated": {}}:
        return REPLICATED
    if isinstance(data, dict) and set(data) == {"split"} and isinstance(data["split"], dict):
        s = data["split"]
        if set(s) == {"sizes", "units"} and all(isinstance(v, list) for v in s.values()) \
                and all(isinstance(x, int) and x > 0 for v in s.values() for x in v):
            return Split(sizes=tuple(s["sizes"]), units=tuple(s["units"]))
    raise ValueError(f"not a value layout: {data!r}")


def split_on(dim: int, shape: Sequence[int], layout: Layout, tp: int) -> tuple[int, ...]:
    """The per-rank shape of a tensor of `shape` laid out `layout` on dimension `dim`."""
    out = list(shape)
    out[dim] = layout.local_size(out[dim], tp)
    return tuple(out)


# ---------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True, slots=True)
class KindRule:
    """TP semantics of one op kind."""

    sharded: bool = False          # False: every rank runs the whole op with all its weights
    partial_sum: bool = False      # the output is a partial sum over the group
    extends_partial: bool = False  # adds its partial sum to a partial-sum input: the reduce moves after it
    gathers: bool = False          # the vocab-split sampler: all-gather of (max logit, index) per token
    kv: bool = False               # holds KV heads (replicated beyond them)
    weights: tuple[tuple[str, int, str], ...] = ()
    """(checkpoint key suffix, split dim, units) per sharded weight; units: "units" (the op's
    `tp_units`), "kv" (its KV heads), "halves" (two packed halves of `tp_units` each: fused
    experts' gate | up), "conv" (Gated-DeltaNet's q | k | v conv channels, by key head), "once" (the
    bias of a partial-sum op: every rank holds it whole, only the group's first rank adds it, so
    the all-reduce adds it once; `OpTP.added_once`). A weight no suffix matches is replicated (norm
    weights, the shared expert's gate)."""


_REPLICATED = KindRule()

TP_TABLE: dict[OpKind, KindRule] = {
    OpKind.EMBED: _REPLICATED,
    OpKind.FINAL_NORM: _REPLICATED,
    OpKind.NORM: _REPLICATED,
    OpKind.RESIDUAL: _REPLICATED,
    OpKind.MOE_ROUTER: _REPLICATED,
    OpKind.LM_HEAD: KindRule(sharded=True, weights=(("", 0, "units"),)),
    OpKind.SAMPLE: KindRule(sharded=True, gathers=True),
    OpKind.QKV_PROJ: KindRule(sharded=True, kv=True, weights=(
        ("q_proj.weight", 0, "units"), ("k_proj.weight", 0, "kv"), ("v_proj.weight", 0, "kv"),
        ("q_proj.bias", 0, "units"), ("k_proj.bias", 0, "kv"), ("v_proj.bias", 0, "kv"),  # Qwen2
        ("in_proj_qkvz.weight", 0, "units"), ("in_proj_ba.weight", 0, "units"),
        # multi-head latent attention: q_b_proj and W_UK by heads (q_a_proj, kv_a_proj_with_mqa and
        # their norms replicated); kv_b_proj.weight is the checkpoint tensor W_UK / W_UV are read from
        ("q_b_proj.weight", 0, "units"), ("kv_b_proj.w_uk", 0, "units"), ("kv_b_proj.weight", 0, "units"))),
    OpKind.QK_NORM: KindRule(sharded=True, kv=True),
    OpKind.ROPE: KindRule(sharded=True, kv=True),
    OpKind.ATTN_FULL: KindRule(sharded=True, kv=True, weights=(("sinks", 0, "units"),)),  # GPT-OSS sinks
    OpKind.ATTN_SLIDING: KindRule(sharded=True, kv=True, weights=(("sinks", 0, "units"),)),
    OpKind.ATTN_LINEAR: KindRule(sharded=True, weights=(
        ("conv1d.weight", 0, "conv"), ("A_log", 0, "units"), ("dt_bias", 0, "units"))),
    OpKind.ATTN_MLA: KindRule(sharded=True, kv=True),  # query heads split; the one latent "KV head" replicated
    OpKind.O_PROJ: KindRule(sharded=True, partial_sum=True, weights=(
        ("kv_b_proj.w_uv", 0, "units"), ("kv_b_proj.weight", 0, "units"),  # latent attention's W_UV, by heads
        ("o_proj.bias", 0, "once"),  # GPT-OSS
        ("", 1, "units"))),
    OpKind.MLP_GATE_UP: KindRule(sharded=True, weights=(("gate_proj.weight", 0, "units"),
                                                         ("up_proj.weight", 0, "units"))),
    OpKind.ACT: KindRule(sharded=True),
    OpKind.MLP_DOWN: KindRule(sharded=True, partial_sum=True, weights=(("down_proj.weight", 1, "units"),)),
    OpKind.MOE_EXPERTS: KindRule(sharded=True, partial_sum=True, weights=(
        ("gate_up_proj", 1, "halves"), ("down_proj", 2, "units"),           # fused [E, 2I, H], [E, H, I]
        ("gate_proj.weight", 0, "units"), ("up_proj.weight", 0, "units"),  # per-expert checkpoints
        ("down_proj.weight", 1, "units"))),
    OpKind.SHARED_EXPERT: KindRule(sharded=True, partial_sum=True, extends_partial=True, weights=(
        ("shared_expert.gate_proj.weight", 0, "units"), ("shared_expert.up_proj.weight", 0, "units"),
        ("shared_expert.down_proj.weight", 1, "units"),
        ("shared_experts.gate_proj.weight", 0, "units"), ("shared_experts.up_proj.weight", 0, "units"),  # DeepSeek
        ("shared_experts.down_proj.weight", 1, "units"))),
    OpKind.MOE_EXPERTS_SWIGLU: KindRule(sharded=True, partial_sum=True, weights=(  # GPT-OSS [E, H, 2I] interleaved
        ("gate_up_proj", 2, "units"), ("gate_up_proj_bias", 1, "units"),   # whole (gate, up) column pairs
        ("down_proj", 1, "units"), ("down_proj_bias", 0, "once"))),
}

_SPLIT_OUTPUT = (OpKind.QKV_PROJ, OpKind.QK_NORM, OpKind.ROPE, OpKind.ATTN_FULL, OpKind.ATTN_SLIDING,
                 OpKind.ATTN_LINEAR, OpKind.ATTN_MLA)
"""Sharded kinds whose outputs stay split (the others' are partial sums, reduced, or internal to
a stage: no cut follows a gate/up projection)."""


def rule(kind: OpKind) -> KindRule:
    return TP_TABLE[kind]


# ---------------------------------------------------------------- an op's view of the table


@dataclasses.dataclass(frozen=True, slots=True)
class OpTP:
    """What the table needs to know of one op: its kind, units, KV heads and weight shapes.

    Built from an IR `Op` (`of_op`) or from an operator module (the runtime's `runtime/shard.py`),
    so the cost model and the runtime shard from the same facts."""

    kind: OpKind
    units: int
    kv_heads: int
    weights: tuple[tuple[str, tuple[int, ...]], ...]   # (checkpoint key, full shape)
    blocks: tuple[int, ...] = ()  # per weight, elements per quantization block (`QUANT_BLOCK`; () or 1: none)

    @property
    def rule(self) -> KindRule:
        return TP_TABLE[self.kind]

    @property
    def linear(self) -> bool:
        """A Gated-DeltaNet projection (its outputs are packed by key head, not q/k/v heads)."""
        return any(key.endswith("in_proj_qkvz.weight") for key, _ in self.weights)

    @property
    def experts(self) -> int:
        """Routed experts' count (their weights' leading dimension); 0 for other kinds."""
        return self.weights[0][1][0] if self.kind in EXPERT_KINDS and self.weights else 0

    def expert_parallel(self, layout: str) -> bool:
        """Whether `layout` ("tp" | "ep" | "dp") holds this op's experts whole (only routed experts)."""
        return layout in ("ep", "dp") and self.kind in EXPERT_KINDS

    def data_parallel(self, layout: str) -> bool:
        """Whether `layout` runs this op data-parallel (whole weights, its own rows): "dp", every
        op but the routed experts."""
        return layout == "dp" and self.kind not in EXPERT_KINDS

    def legal(self, tp: int, layout: str = "tp") -> bool:
        """Whether a TP group of `tp` can run this op, its routed experts held as `layout` says
        (the planner's, pinned plans' and the profiler's test)."""
        if tp == 1 or not self.rule.sharded or self.data_parallel(layout):
            return True
        if self.expert_parallel(layout):
            return self.experts % tp == 0
        if not legal_units(self.units, tp):
            return False
        if self.rule.kv and self.kv_heads and not legal_units(self.kv_heads, tp, replicable=True):
            return False
        if not all(s.legal(tp) for s in self._splits().values() if s is not None):
            return False
        return self._whole_blocks(tp)

    def _whole_blocks(self, tp: int) -> bool:
        """Whether every split of a block-quantized weight keeps whole quantization blocks. The
        stored tensor is a matrix per leading index (rows: the dims before the last merged, as a
        per-head view [heads, d, c] is stored [heads * d, c]), so a rank's part of split dim `dim`
        spans its elements times the dims between it and the last."""
        for (key, shape), block in zip(self.weights, self.blocks):
            found = self.weight_split(key, shape) if block > 1 else None
            if found is not None:
                dim, split = found
                inner = math.prod(shape[dim + 1:-1]) if dim < len(shape) - 1 else 1
                if any(length * inner % block for _, length in split.blocks(tp, 0)):
                    return False
        return True

    def expert_block(self, tp: int, rank: int) -> tuple[int, int]:
        """(first expert id, experts) rank `rank` of an expert-parallel group of `tp` holds."""
        per = self.experts // tp
        return rank * per, per

    def _conv_parts(self) -> tuple[int, int]:
        """(q and k channels each, v channels) of a Gated-DeltaNet conv: v = A_log heads x norm size."""
        shapes = dict(self.weights)
        conv = next(s for k, s in shapes.items() if k.endswith("conv1d.weight"))[0]
        heads = next(s for k, s in shapes.items() if k.endswith("A_log"))[0]
        dv = next(s for k, s in shapes.items() if k.endswith("norm.weight"))[0]
        return (conv - heads * dv) // 2, heads * dv

    def added_once(self, key: str, layout: str = "tp") -> bool:
        """Whether tensor `key` is a partial-sum op's bias that only the group's first rank adds
        (every rank holds it whole: the others hold zeros). An expert-parallel expert's bias is
        its own rank's."""
        if not self.rule.sharded or self.expert_parallel(layout):
            return False
        found = next((units for suffix, _, units in self.rule.weights if key.endswith(suffix)), None)
        return found == "once"

    def weight_split(self, key: str, shape: Sequence[int], layout: str = "tp") -> tuple[int, Split] | None:
        """(dim, split) of checkpoint tensor `key` of full `shape`; None: replicated (or held
        whole, `added_once`). Expert-parallel experts split every fused tensor by expert (its
        leading dimension); a per-expert checkpoint tensor is read whole by the rank holding it."""
        if not self.rule.sharded or self.data_parallel(layout):
            return None
        if self.expert_parallel(layout):
            e = self.experts
            return (0, Split(sizes=(e,), units=(e,))) if shape and shape[0] == e and key in dict(self.weights) \
                else None
        for suffix, dim, units in self.rule.weights:
            if key.endswith(suffix):
                if units == "once":
                    return None
                size = shape[dim]
                if units == "kv":
                    return dim, Split(sizes=(size,), units=(self.kv_heads,))
                if units == "halves":
                    return dim, Split(sizes=(size // 2, size // 2), units=(self.units, self.units))
                if units == "conv":
                    qk, v = self._conv_parts()
                    heads = self.units  # key heads: q, k and each key head's value heads
                    return dim, Split(sizes=(qk, qk, v), units=(heads, heads, heads))
                return dim, Split(sizes=(size,), units=(self.units,))
        return None

    def _splits(self) -> dict[str, Split | None]:
        out = {}
        for key, shape in self.weights:
            found = self.weight_split(key, shape)
            out[key] = None if found is None else found[1]
        return out

    def local_shape(self, key: str, shape: Sequence[int], tp: int, layout: str = "tp") -> tuple[int, ...]:
        """The shape of rank-local tensor `key` at degree `tp` (any rank: blocks are equal)."""
        found = self.weight_split(key, shape, layout) if tp > 1 else None
        return tuple(shape) if found is None else split_on(found[0], shape, found[1], tp)

    def output_layout(self, index: int, shapes: Mapping[int, Sequence[int]]) -> Layout:
        """How the group holds output `index`, split on its first per-token dim; `shapes` are
        the per-token shapes of the op's outputs that cross the cut (by output index)."""
        shape = shapes.get(index, ())
        if self.kind not in _SPLIT_OUTPUT or not shape:
            return REPLICATED
        size = shape[0]
        if self.kind == OpKind.QKV_PROJ and self.linear:
            if index == 0:  # mixed q | k | v channels, each grouped by key head; v as wide as z
                if 1 not in shapes:
                    raise ValueError("a Gated-DeltaNet projection's packed output crosses a cut without z")
                v = math.prod(shapes[1])
                return Split(sizes=((size - v) // 2, (size - v) // 2, v), units=(self.units,) * 3)
            return Split(sizes=(size,), units=(self.units,))  # z, b, a: value heads grouped by key head
        if self.kind in (OpKind.QKV_PROJ, OpKind.QK_NORM, OpKind.ROPE) and index in (1, 2):
            return Split(sizes=(size,), units=(self.kv_heads,))  # k, v
        return Split(sizes=(size,), units=(self.units,))  # q, gate, attention outputs


def of_op(op) -> OpTP:
    """The table's view of an IR `Op` (with its weights' quantization blocks, as stored)."""
    return OpTP(kind=op.kind, units=op.tp_units, kv_heads=op.kv_heads,
                weights=tuple((w.name, tuple(w.shape)) for w in op.weights),
                blocks=tuple(QUANT_BLOCK.get(w.dtype, 1) for w in op.weights))


# ---------------------------------------------------------------- what the consumers ask


_LEGAL: dict[tuple[int, int, str], tuple[object, bool]] = {}
"""legal_tp memo: (id(op), tp, layout) -> (op, legal); the op is kept so its id cannot be reused."""


def _legal_op(op, tp: int, layout: str) -> bool:
    hit = _LEGAL.get((id(op), tp, layout))
    if hit is not None and hit[0] is op:
        return hit[1]
    value = of_op(op).legal(tp, layout)
    if len(_LEGAL) > 1 << 20:
        _LEGAL.clear()
    _LEGAL[(id(op), tp, layout)] = (op, value)
    return value


def legal_tp(ops: Sequence, tp: int, layout: str = "tp") -> bool:
    """Whether one TP group of `tp` can run all of `ops` (IR ops), routed experts held as `layout`
    (memoized per op object: the planner asks for every slot of every template)."""
    return all(_legal_op(op, tp, layout) for op in ops)


def has_experts(ops: Sequence) -> bool:
    """Whether any of `ops` are routed experts (an owner running them chooses their layout)."""
    return any(op.kind in EXPERT_KINDS for op in ops)


def layout_choices(experts: bool, tp: int, attention_dp: bool = False) -> tuple[str, ...]:
    """The layouts of `EXPERT_LAYOUTS` a group of `tp` chooses among: "tp" and "ep" where it runs
    routed experts (`experts`) and `tp` > 1 (at TP 1 they are the same), and "dp" too with
    `attention_dp`; else "tp" alone."""
    if tp <= 1 or not experts:
        return EXPERT_LAYOUTS[:1]
    return EXPERT_LAYOUTS if attention_dp else EXPERT_LAYOUTS[:2]


def expert_layouts(ops: Sequence, tp: int) -> tuple[str, ...]:
    """The `layout_choices` a TP group of `tp` can run `ops` with (legal ones only)."""
    return tuple(layout for layout in layout_choices(has_experts(ops), tp) if legal_tp(ops, tp, layout))


def indivisible(op, layout: str = "tp") -> str:
    """What a TP degree fails to divide in IR op `op` (for one-line errors)."""
    if op is None:
        return "its sharded ops"
    view = of_op(op)
    if view.expert_parallel(layout):
        return f"{op.name}'s {view.experts} experts (expert parallelism)"
    blocked = [b for b in view.blocks if b > 1]
    return (f"{op.name} ({op.kind.value}, {op.tp_units} shardable units"
            + (f", {op.kv_heads} KV heads" if op.kv_heads else "")
            + (f", stored in quantization blocks of {blocked[0]}" if blocked else "") + ")")


def preferred_layout(ops: Sequence, tp: int) -> str | None:
    """The layout a single group uses where nothing else decides (analysis, estimates): "tp" when
    legal (no choice here: the search compares both, `passes/owners.py`), else "ep", else None."""
    layouts = expert_layouts(ops, tp)
    return layouts[0] if layouts else None


def weight_bytes_per_rank(op, tp: int, layout: str = "tp") -> int:
    """Bytes of the op's weights one rank of a TP group of `tp` holds (tied weights included),
    routed experts held as `layout`."""
    view = of_op(op)
    total = 0
    for w in op.weights:
        total += math.ceil(math.prod(view.local_shape(w.name, w.shape, tp, layout)) * DTYPE_SIZE[w.dtype])
    return total


def rank_weight_bytes(ops: Sequence, tp: int, layout: str = "tp") -> int:
    """Bytes of weights one rank running `ops` holds: a weight two ops share (the tied embedding
    and LM head) once, at the larger of the two shares (the runtime views the smaller in it)."""
    per_name: dict[str, float] = {}
    for op in ops:
        view = of_op(op)
        for w in op.weights:
            nbytes = math.ceil(math.prod(view.local_shape(w.name, w.shape, tp, layout)) * DTYPE_SIZE[w.dtype])
            per_name[w.name] = max(per_name.get(w.name, 0), nbytes)
    return int(sum(per_name.values()))


_SHARDS: dict[tuple[int, int, str], tuple[object, float]] = {}
"""compute_shards memo: (id(op), tp, layout) -> (op, shards); the op is kept so its id cannot be reused."""


def compute_shards(op, tp: int, layout: str = "tp") -> float:
    """How many ways the op's weight reads and work divide over a group of `tp`: the full
    weights over one rank's weights for ops with weights, tp for sharded weightless ops
    (routed experts held as `layout`: on average, an expert-parallel rank runs 1 / tp of the
    pairs; "dp": the experts as "ep", every other op's weights whole on each rank: 1). Memoized per
    op object (the planner asks millions of times)."""
    if layout == "dp":
        if op.kind not in EXPERT_KINDS:
            return 1
        layout = "ep"
    if layout != "tp" and op.kind not in EXPERT_KINDS:
        layout = "tp"
    hit = _SHARDS.get((id(op), tp, layout))
    if hit is not None and hit[0] is op:
        return hit[1]
    if tp <= 1 or not rule(op.kind).sharded:
        value = 1
    elif op.weight_bytes:
        value = op.weight_bytes / weight_bytes_per_rank(op, tp, layout)
    else:
        value = tp
    if len(_SHARDS) > 1 << 20:
        _SHARDS.clear()
    _SHARDS[(id(op), tp, layout)] = (op, value)
    return value


def state_shards(op, tp: int) -> int:
    """How many ways the op's per-sequence state divides: its KV heads (or key heads) per rank."""
    if op.state is None or tp <= 1 or not rule(op.kind).sharded:
        return 1
    return max(1, min(tp, op.state.max_shards))


def reduces(op, following=None) -> bool:
    """Whether a TP group all-reduces `op`'s output: a partial sum is reduced, unless the op
    after it (`following`) extends it with its own partial sum (routed experts -> shared expert)."""
    if not rule(op.kind).partial_sum:
        return False
    return not (following is not None and rule(following.kind).extends_partial
                and op.name in {v.split("[")[0] for v in following.inputs})


def allreduce_after(ops: Sequence, index: int, tp: int) -> bool:
    """Whether a group of `tp` all-reduces after op `index` of `ops` (`reduces`)."""
    return tp > 1 and reduces(ops[index], ops[index + 1] if index + 1 < len(ops) else None)


def value_layout(graph, value: str) -> Layout:
    """The layout of IR value `value` ("<op name>" or "<op name>[i]") in a TP group."""
    name, _, index = value.partition("[")
    op = next(o for o in graph.ops if o.name == name)
    shapes = {}
    for cut in graph.cuts:
        for v, s in zip(cut.values, cut.value_shapes):
            head, _, i = v.partition("[")
            if head == name:
                shapes[int(i.rstrip("]")) if i else 0] = s
    return of_op(op).output_layout(int(index.rstrip("]")) if index else 0, shapes)


def check_table() -> None:
    """Every op kind has a rule (a new kind must say how it shards)."""
    missing = [k.value for k in OpKind if k not in TP_TABLE]
    if missing:
        raise ValueError(f"no TP rule for op kind(s) {missing}")


check_table()
