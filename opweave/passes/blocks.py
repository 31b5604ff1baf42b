"""Partition blocks (summary §4, B.1): the smallest repeating layer-aligned pattern of a model.

Each layer gets a structural signature (its ops' kinds, classes, weight shapes and state specs,
with the layer index left out), so finding the block is a comparison of hashable tuples. The
period p is the smallest p such that signature[i] == signature[i mod p] for every layer i: the
model is k = L // p whole blocks followed by L mod p tail layers that repeat the block's first
positions. The prologue (embedding) and epilogue (final norm, LM head, sampling) are explicit.

Gemma-3-27B: p = 6 (5 sliding + 1 full), 10 blocks + 2 tail layers.
Qwen3-Next-80B-A3B: p = 4 (3 linear + 1 full), 12 blocks. Llama: p = 1.

Head layers. A model may open with dense-MLP layers before layers that are all MoE
(DeepSeek-V3's `first_k_dense_replace`): those h layers are head layers when h + p(h) < p(0), p(h)
the smallest period of layers h..L-1, and the blocks start after them. DeepSeek-V3 gets h = 3,
p = 1 (58 one-layer MoE blocks) instead of one 61-layer block; every other model keeps h = 0
(dense layers between MoE layers, or attention patterns, stay inside the blocks). Head layers
are never cut: they join the first stage, with the prologue (`passes/templates.py`), as tail
layers follow the last block.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Sequence

from opweave.ir.graph import Op, OpGraph
from opweave.ir.kinds import OpKind


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OpRange:
    """Contiguous ops [first, last] (inclusive) covering layers [first_layer, last_layer]."""

    first: int
    last: int
    first_layer: int | None = None
    last_layer: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BlockedGraph:
    graph: OpGraph
    period: int                      # layers per partition block
    num_blocks: int
    num_tail_layers: int
    pattern: tuple[str, ...]         # layer type at each block position
    prologue: OpRange
    blocks: tuple[OpRange, ...]
    tail: OpRange | None
    epilogue: OpRange
    num_head_layers: int = 0         # layers before the first block (never cut: they join the first stage)
    head: OpRange | None = None      # their ops

    @property
    def first_block_layer(self) -> int:
        """The layer block 0 starts at (the number of head layers)."""
        return self.num_head_layers

    def block_position(self, layer: int) -> int | None:
        """The block position (0..period-1) of `layer`; None for a head layer."""
        return None if layer < self.num_head_layers else (layer - self.num_head_layers) % self.period

    def block_ops(self, block: int) -> tuple[Op, ...]:
        r = self.blocks[block]
        return self.graph.ops[r.first:r.last + 1]


def layer_signature(ops: Sequence[Op]) -> tuple[Hashable, ...]:
    """What makes two layers interchangeable for planning (names and layer index left out)."""
    return tuple(
        (op.kind, op.cls, tuple(w.shape for w in op.weights), op.state, op.flops_per_token,
         op.flops_per_context_token, op.act_bytes_per_token, op.tp_rule, op.tp_units)
        for op in ops)


def smallest_period(signatures: Sequence[Hashable]) -> int:
    """Smallest p >= 1 with signatures[i] == signatures[i % p] for all i (p = len if none shorter)."""
    n = len(signatures)
    for p in range(1, n + 1):
        if all(signatures[i] == signatures[i % p] for i in range(p, n)):
            return p
    return max(n, 1)


def dense_head(layers: Sequence[Sequence[Op]]) -> int:
    """The leading layers with a dense MLP when no later layer has one (all MoE), else 0."""
    dense = [any(op.kind == OpKind.MLP_GATE_UP for op in ops) for ops in layers]
    h = next((i for i, d in enumerate(dense) if not d), len(dense))
    return h if 0 < h < len(dense) and not any(dense[h:]) else 0


def head_and_period(signatures: Sequence[Hashable], head: int) -> tuple[int, int]:
    """(h, p): `head` and the period of the layers after it when that makes h + p smaller than the
    period of all layers, else (0, that period)."""
    whole = smallest_period(signatures)
    if head:
        p = smallest_period(signatures[head:])
        if head + p < whole:
            return head, p
    return 0, whole


def _range(ops: Sequence[Op]) -> OpRange:
    layers = [op.layer for op in ops if op.layer is not None]
    return OpRange(first=ops[0].index, last=ops[-1].index,
                   first_layer=min(layers) if layers else None, last_layer=max(layers) if layers else None)


def find_blocks(graph: OpGraph) -> BlockedGraph:
    """The partition-block structure of `graph` (a pure function of the IR)."""
    layers = [graph.layer_ops(i) for i in range(graph.num_layers)]
    if not layers or any(not ops for ops in layers):
        raise ValueError(f"{graph.model}: every layer must have ops")
    head, period = head_and_period([layer_signature(ops) for ops in layers], dense_head(layers))
    num_blocks = (graph.num_layers - head) // period
    num_tail = (graph.num_layers - head) % period
    first_layer_op = layers[0][0].index
    last_layer_op = layers[-1][-1].index
    blocks = tuple(_range([op for i in range(head + b * period, head + (b + 1) * period) for op in layers[i]])
                   for b in range(num_blocks))
    tail_start = head + num_blocks * period
    tail = _range([op for i in range(tail_start, graph.num_layers) for op in layers[i]]) if num_tail else None
    return BlockedGraph(
        graph=graph, period=period, num_blocks=num_blocks, num_tail_layers=num_tail,
        pattern=graph.layer_types[head:head + period],
        prologue=_range(graph.ops[:first_layer_op]),
        blocks=blocks, tail=tail,
        epilogue=_range(graph.ops[last_layer_op + 1:]),
        num_head_layers=head,
        head=_range([op for i in range(head) for op in layers[i]]) if head else None,
    )


_SHORT = {"full_attention": "F", "sliding_attention": "S", "linear_attention": "L"}


def _kinds(ops: Sequence[Op]) -> str:
    return " ".join(op.kind.value for op in ops)


def format_blocks(bg: BlockedGraph) -> str:
    """Readable block structure (what `opweave dump --what blocks` prints)."""
    g = bg.graph
    lines = [f"Partition blocks of {g.model}: period {bg.period} layer(s), {bg.num_blocks} block(s) "
             f"+ {bg.num_tail_layers} tail layer(s), {g.num_layers} layers"
             + (f" ({bg.num_head_layers} head layer(s) first)" if bg.num_head_layers else ""),
             f"  pattern: {' '.join(_SHORT.get(t, t) for t in bg.pattern)}   "
             f"(F full attention, S sliding window, L linear attention)",
             f"  prologue: ops {bg.prologue.first}..{bg.prologue.last}: {_kinds(g.ops[bg.prologue.first:bg.prologue.last + 1])}"]
    if bg.head:
        lines.append(f"  head: layers 0-{bg.num_head_layers - 1}, ops {bg.head.first}..{bg.head.last} "
                     f"(joins the first stage)")
    block0 = bg.block_ops(0) if bg.blocks else ()
    lines.append(f"  block template ({len(block0)} ops):")
    for pos in range(bg.period):
        ops = [op for op in block0 if op.layer == bg.num_head_layers + pos]
        lines.append(f"    position {pos} [{bg.pattern[pos]}]: {_kinds(ops)}")
    shown = range(len(bg.blocks)) if len(bg.blocks) <= 6 else [0, 1, 2, len(bg.blocks) - 1]
    for b in shown:
        r = bg.blocks[b]
        if b == len(bg.blocks) - 1 and len(bg.blocks) > 6:
            lines.append(f"  ... ({len(bg.blocks) - 4} more blocks of {len(block0)} ops)")
        lines.append(f"  block {b}: layers {r.first_layer}-{r.last_layer}, ops {r.first}..{r.last}")
    if bg.tail:
        lines.append(f"  tail: layers {bg.tail.first_layer}-{bg.tail.last_layer}, ops {bg.tail.first}..{bg.tail.last} "
                     f"(= block positions 0-{bg.num_tail_layers - 1})")
    lines.append(f"  epilogue: ops {bg.epilogue.first}..{bg.epilogue.last}: "
                 f"{_kinds(g.ops[bg.epilogue.first:bg.epilogue.last + 1])}")
    return "\n".join(lines)


def blocks_to_json(bg: BlockedGraph) -> dict[str, Any]:
    def rng(r: OpRange | None):
        return None if r is None else dataclasses.asdict(r)

    return {
        "model": bg.graph.model,
        "num_layers": bg.graph.num_layers,
        "period": bg.period,
        "num_blocks": bg.num_blocks,
        "num_tail_layers": bg.num_tail_layers,
        "pattern": list(bg.pattern),
        "prologue": rng(bg.prologue),
        "blocks": [rng(r) for r in bg.blocks],
        "tail": rng(bg.tail),
        "epilogue": rng(bg.epilogue),
        "num_head_layers": bg.num_head_layers,
        "head": rng(bg.head),
    }
