"""Cost signatures of operators: which ops of a graph share one measured figure.

Two ops have the same cost signature when they have the same kind, the same weight shapes, the
same activation bytes per token and the same per-sequence state spec: every layer's `qkv_proj`
of a dense model is one signature, a sliding-window attention and a full attention are two. The
graph hash is the hash of the ordered list of signatures, so it changes when the model's shapes
or dtype change, not when only names do.
"""

from __future__ import annotations

import hashlib

from opweave.ir.graph import Op, OpGraph
from opweave.ir.tp import rule as tp_rule


def op_signature(op: Op) -> str:
    """'qkv_proj|w=64x64,32x64,32x64|act=768B|state=-': kind, weight shapes, activation bytes per
    token (what sizes weightless ops: residual adds, rope, sampling), state spec."""
    weights = ",".join("x".join(str(d) for d in w.shape) for w in op.weights) or "-"
    s = op.state
    state = "-" if s is None else (f"tok{s.bytes_per_token}B/max{s.max_tokens or '-'}"
                                   f"/fixed{s.fixed_bytes}B/shards{s.max_shards}")
    return f"{op.kind.value}|w={weights}|act={op.act_bytes_per_token}B|state={state}"


def graph_signatures(graph: OpGraph) -> list[str]:
    return [op_signature(op) for op in graph.ops]


def graph_hash(graph: OpGraph) -> str:
    """sha256 (hex) of the graph's op signatures in order."""
    return hashlib.sha256("\n".join(graph_signatures(graph)).encode()).hexdigest()


def is_replicated(op: Op) -> bool:
    """Ops every TP rank runs whole (the TP table, `opweave.ir.tp`): one figure for any TP."""
    return not tp_rule(op.kind).sharded
