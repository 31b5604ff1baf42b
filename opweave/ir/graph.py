"""`OpGraph`: the operator-level IR of one decode step.

An `OpGraph` is the ordered list of operators of one decode step (topological order of the
torch.fx trace), each with its cost facts, plus the legal cut points between operators with the
activation bytes per token that cross each. Cost queries take the context length s:

    state_bytes(s)  per-sequence KV / recurrent state the op reads each step
    flops_at(s)     FLOPs per token
    bytes_at(s)     activation + state bytes per token (weights are per step: `weight_bytes`)

Everything is frozen; `verify()` states the invariants; `format_graph()` prints a table;
`to_json()` / `from_json()` round-trip.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from opweave.ir.facts import StateSpec
from opweave.ir.kinds import OpClass, OpKind, TPRule

OP_CLASS = {
    OpKind.ATTN_FULL: OpClass.ATTN, OpKind.ATTN_SLIDING: OpClass.ATTN, OpKind.ATTN_LINEAR: OpClass.ATTN,
    OpKind.ATTN_MLA: OpClass.ATTN,
    OpKind.QKV_PROJ: OpClass.GEMM, OpKind.O_PROJ: OpClass.GEMM, OpKind.MLP_GATE_UP: OpClass.GEMM,
    OpKind.MLP_DOWN: OpClass.GEMM, OpKind.MOE_ROUTER: OpClass.GEMM, OpKind.MOE_EXPERTS: OpClass.GEMM,
    OpKind.SHARED_EXPERT: OpClass.GEMM, OpKind.LM_HEAD: OpClass.GEMM,
    OpKind.MOE_EXPERTS_SWIGLU: OpClass.GEMM,
}
"""Roofline class per kind; kinds not listed are LIGHT (embedding lookup, norms, rope, adds…)."""

DTYPE_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1,
              # published weight formats (`models.config.WeightFormat`), their scales included:
              "float8_e4m3fn": 1 + 4 / (128 * 128),   # a float32 scale per 128 x 128 block
              "mxfp4": 0.5 + 1 / 32}                  # a one-byte scale per 32 values


class IRError(Exception):
    """An IR invariant does not hold: a bug in OpWeave, not in the user's input."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Weight:
    name: str                 # checkpoint key
    shape: tuple[int, ...]
    dtype: str
    tied: bool = False        # shares storage with another op's weight (tied LM head): counted there

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return math.ceil(self.numel * DTYPE_SIZE[self.dtype])


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    index: int
    name: str                 # module path in the model, e.g. model.layers.3.mixer.attn
    kind: OpKind
    cls: OpClass
    layer: int | None         # None: prologue / epilogue
    inputs: tuple[str, ...]   # value names: "<op name>" or "<op name>[i]" or a graph input
    weights: tuple[Weight, ...] = ()
    active_weight_fraction: float = 1.0
    flops_per_token: int = 0
    flops_per_context_token: int = 0
    act_bytes_per_token: int = 0   # activations read + written per token
    state: StateSpec | None = None
    tp_rule: TPRule = TPRule.REPLICATE
    tp_units: int = 1
    kv_heads: int = 0         # KV heads of the op's k / v tensors (0: none): see opweave.ir.tp

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a device running this op must hold (tied weights included)."""
        return sum(w.nbytes for w in self.weights)

    @property
    def num_parameters(self) -> int:
        """Parameters this op owns (a tied weight is counted under its owner)."""
        return sum(w.numel for w in self.weights if not w.tied)

    @property
    def num_active_parameters(self) -> float:
        return self.num_parameters * self.active_weight_fraction

    def state_bytes(self, context: int) -> int:
        return self.state.bytes_at(context) if self.state else 0

    def flops_at(self, context: int) -> int:
        ctx = self.state.tokens_at(context) if self.state else 0
        return self.flops_per_token + self.flops_per_context_token * ctx

    def bytes_at(self, context: int) -> int:
        return self.act_bytes_per_token + self.state_bytes(context)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CutPoint:
    """A legal stage boundary between op `after` and op `after + 1`."""

    after: int
    bytes_per_token: int      # activations that must cross the cut, per token
    values: tuple[str, ...]   # the live values crossing it
    value_shapes: tuple[tuple[int, ...], ...]  # each value's shape per token (after [batch, tokens])
    reason: str               # residual stream | before core attention | after core attention


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OpGraph:
    model: str
    family: str
    dtype: str
    num_layers: int
    layer_types: tuple[str, ...]
    inputs: tuple[str, ...]          # graph inputs (token ids, positions): metadata, not cut bytes
    ops: tuple[Op, ...]
    cuts: tuple[CutPoint, ...]

    @property
    def num_parameters(self) -> int:
        return sum(op.num_parameters for op in self.ops)

    @property
    def num_active_parameters(self) -> int:
        return round(sum(op.num_active_parameters for op in self.ops))

    @property
    def weight_bytes(self) -> int:
        """Bytes of all distinct weights of the model."""
        return sum(w.nbytes for op in self.ops for w in op.weights if not w.tied)

    def state_bytes(self, context: int) -> int:
        """Per-sequence state (KV cache + recurrent state) at context length s."""
        return sum(op.state_bytes(context) for op in self.ops)

    def flops_per_token(self, context: int) -> int:
        return sum(op.flops_at(context) for op in self.ops)

    def layer_ops(self, layer: int) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.layer == layer)

    def cut_after(self, index: int) -> CutPoint | None:
        for cut in self.cuts:
            if cut.after == index:
                return cut
        return None


def verify(graph: OpGraph) -> OpGraph:
    """Checks the invariants of an OpGraph; returns it unchanged or raises IRError."""
    defined = set(graph.inputs)
    last_layer = -1
    for i, op in enumerate(graph.ops):
        if op.index != i:
            raise IRError(f"op {op.name} has index {op.index}, expected {i}")
        for value in op.inputs:
            if value.split("[")[0] not in defined:
                raise IRError(f"op {op.name} reads {value} before it is defined")
        defined.add(op.name)
        if op.cls != OP_CLASS.get(op.kind, OpClass.LIGHT):
            raise IRError(f"op {op.name}: kind {op.kind.value} must be class {OP_CLASS.get(op.kind, OpClass.LIGHT).value}")
        if op.layer is not None:
            if op.layer < last_layer or op.layer >= graph.num_layers:
                raise IRError(f"op {op.name}: layer {op.layer} out of order")
            last_layer = op.layer
        if (op.state is not None) != (op.cls == OpClass.ATTN):
            raise IRError(f"op {op.name}: only ATTN ops carry per-sequence state")
        if not 0.0 < op.active_weight_fraction <= 1.0:
            raise IRError(f"op {op.name}: active_weight_fraction {op.active_weight_fraction} not in (0, 1]")
    if graph.ops and graph.ops[0].kind != OpKind.EMBED or graph.ops and graph.ops[-1].kind != OpKind.SAMPLE:
        raise IRError("a decode step starts with embed and ends with sample")
    afters = [c.after for c in graph.cuts]
    if afters != sorted(set(afters)) or any(not 0 <= a < len(graph.ops) - 1 for a in afters):
        raise IRError(f"cut points must be distinct, sorted and inside the graph: {afters}")
    names = [w.name for op in graph.ops for w in op.weights if not w.tied]
    if len(names) != len(set(names)):
        raise IRError("a weight is owned by two ops")
    missing = {w.name for op in graph.ops for w in op.weights if w.tied} - set(names)
    if missing:
        raise IRError(f"tied weights without an owner: {sorted(missing)}")
    return graph


# ---------------------------------------------------------------- printing


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def _state_text(state: StateSpec | None) -> str:
    if state is None:
        return "-"
    if state.bytes_per_token:
        cap = f" (<= {state.max_tokens} tok)" if state.max_tokens else ""
        return f"{human_bytes(state.bytes_per_token)}/tok{cap}"
    return f"{human_bytes(state.fixed_bytes)} fixed"


def _flops_text(op: Op) -> str:
    text = human_count(op.flops_per_token) if op.flops_per_token else ""
    if op.flops_per_context_token:
        text = (text + " + " if text else "") + f"{human_count(op.flops_per_context_token)}*s"
    return text or "0"


def format_graph(graph: OpGraph, contexts: tuple[int, ...] = (8192, 32768, 131072)) -> str:
    """A readable table of the ops with totals (what `opweave dump --what ir` prints)."""
    header = ("#", "op", "kind", "class", "layer", "weights", "FLOPs/token", "state/seq", "cut bytes/tok")
    rows = []
    for op in graph.ops:
        cut = graph.cut_after(op.index)
        rows.append((str(op.index), op.name.removeprefix("model."), op.kind.value, op.cls.value,
                     "-" if op.layer is None else str(op.layer), human_bytes(op.weight_bytes) if op.weights else "-",
                     _flops_text(op), _state_text(op.state),
                     f"{human_bytes(cut.bytes_per_token)} ({cut.reason})" if cut else ""))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = [f"OpGraph {graph.model} ({graph.family}, {graph.dtype}, {graph.num_layers} layers, "
             f"{len(graph.ops)} ops, {len(graph.cuts)} legal cuts)"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("")
    lines.append(f"parameters: {graph.num_parameters:,} ({human_count(graph.num_parameters)}), "
                 f"active per token: {graph.num_active_parameters:,} ({human_count(graph.num_active_parameters)})")
    lines.append(f"weight bytes: {human_bytes(graph.weight_bytes)}")
    per_tok = sum(op.state.bytes_per_token for op in graph.ops if op.state)
    fixed = sum(op.state.fixed_bytes for op in graph.ops if op.state)
    lines.append(f"state per sequence: {human_bytes(per_tok)}/token (before window caps) + {human_bytes(fixed)} fixed; "
                 + ", ".join(f"{human_bytes(graph.state_bytes(s))} at s={s}" for s in contexts))
    lines.append("FLOPs per token: " + ", ".join(f"{human_count(graph.flops_per_token(s))} at s={s}" for s in contexts))
    return "\n".join(lines)


# ---------------------------------------------------------------- JSON


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, (OpKind, OpClass, TPRule)):
        return value.value
    return value


def to_json(graph: OpGraph, contexts: tuple[int, ...] = (8192, 32768, 131072)) -> dict[str, Any]:
    """JSON-ready dict: the graph's fields plus derived totals (ignored by `from_json`)."""
    out = _to_plain(graph)
    out["num_parameters"] = graph.num_parameters
    out["num_active_parameters"] = graph.num_active_parameters
    out["weight_bytes"] = graph.weight_bytes
    out["state_bytes_per_token"] = sum(op.state.bytes_per_token for op in graph.ops if op.state)
    out["state_bytes_by_context"] = {str(s): graph.state_bytes(s) for s in contexts}
    return out


def from_json(data: dict[str, Any]) -> OpGraph:
    ops = []
    for o in data["ops"]:
        ops.append(Op(
            index=o["index"], name=o["name"], kind=OpKind(o["kind"]), cls=OpClass(o["cls"]), layer=o["layer"],
            inputs=tuple(o["inputs"]),
            weights=tuple(Weight(name=w["name"], shape=tuple(w["shape"]), dtype=w["dtype"], tied=w["tied"])
                          for w in o["weights"]),
            active_weight_fraction=o["active_weight_fraction"], flops_per_token=o["flops_per_token"],
            flops_per_context_token=o["flops_per_context_token"], act_bytes_per_token=o["act_bytes_per_token"],
            state=StateSpec(**o["state"]) if o["state"] else None, tp_rule=TPRule(o["tp_rule"]), tp_units=o["tp_units"],
            kv_heads=o.get("kv_heads", 0),
        ))
    return OpGraph(
        model=data["model"], family=data["family"], dtype=data["dtype"], num_layers=data["num_layers"],
        layer_types=tuple(data["layer_types"]), inputs=tuple(data["inputs"]), ops=tuple(ops),
        cuts=tuple(CutPoint(after=c["after"], bytes_per_token=c["bytes_per_token"], values=tuple(c["values"]),
                            value_shapes=tuple(tuple(s) for s in c["value_shapes"]), reason=c["reason"])
                   for c in data["cuts"]),
    )
