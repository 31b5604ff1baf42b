"""The planned memory of one rank of a compiled plan: the per-op accounting of `opweave.cost.memory`
(weights, state, activations) over the ops its owner runs, with the plan's replica rows
(`passes/lower.replica_rows`), the values the owner keeps for its later stages instead of sending
them (`passes/carry.held_peak`), and its message buffers.

Buffers. A rank, for the cuts it is the port of (a replica's TP ranks take the cuts in turn; the
token ids come back to TP rank 0, the scheduler), keeps a decode-sized receive buffer for every
receive of a round
(`runtime/message.message_bytes`; reused every round, as a captured graph needs), in a prefill
step the widest receive of each upstream peer, and the messages it sent alive for two rounds
(this round's and the previous one's, until their sends complete); the last stage's token ids
count as sends, the embedding owner's token-id receives as receives.

`plan_rank_memory` is the planned breakdown of one rank of a compiled plan (what `opweave dump
--what memory` shows next to what the rank allocates: `opweave.profile.allocated`).
"""

from __future__ import annotations

from opweave.cost.memory import MemoryBreakdown, activation_bytes, redundant_bytes, state_bytes, weight_bytes
from opweave.ir.graph import Op, OpGraph
from opweave.ir.plan import PAGE_TOKENS, PREFILL_CHUNK
from opweave.ir.workload import Workload, kv_pool_pages
from opweave.passes.carry import held_peak
from opweave.passes.lower import as_replicas, replica_rows
from opweave.runtime.message import message_bytes

SEND_ROUNDS = 2
"""Rounds of sent messages a leader keeps alive (this round's and the previous one's)."""

INDEX_BYTES = 8
"""An int64: a token id sent back to the embedding owner."""


def _overlaps(rows: tuple[int, int], other: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(peer replica, rows exchanged) for each replica of another owner whose rows overlap."""
    out = []
    for j, (lo, hi) in enumerate(other):
        n = min(hi, rows[1]) - max(lo, rows[0])
        if n > 0:
            out.append((j, n))
    return out


def buffer_bytes(plan, owner: int, replica: int, width: int, tp_rank: int = 0) -> float:
    """Message buffers of TP rank `tp_rank` of `replica` of `owner` (module docstring): the cuts
    it is the port of (the cut after stage c is taken by TP rank c mod TP, `passes.lower.port`),
    and the token ids back on TP rank 0 (the scheduler)."""
    tp = plan.owners[owner].tp

    mb = plan.batch // plan.microbatches
    rows = {o.slot: replica_rows(mb, o.replicas) for o in plan.owners}
    mine = rows[owner][replica]
    stages = plan.stages
    first, last = stages[0].owner, stages[-1].owner
    static, wide = 0, {}   # every decode-sized receive; (owner, replica) -> its widest receive
    sent = 0
    for i, st in enumerate(stages):
        if st.owner != owner:
            continue
        if i > 0 and stages[i - 1].owner != owner and (i - 1) % tp == tp_rank:
            prev = stages[i - 1].owner
            per_token = stages[i - 1].out_bytes_per_token
            for j, n in _overlaps(mine, rows[prev]):
                static += plan.microbatches * message_bytes(n, n, per_token)
                if width > 1:
                    wide[(prev, j)] = max(wide.get((prev, j), 0), message_bytes(n, n * width, per_token))
        if i % tp != tp_rank:
            continue
        if i + 1 < len(stages) and stages[i + 1].owner != owner:
            for _, n in _overlaps(mine, rows[stages[i + 1].owner]):
                sent += message_bytes(n, n * width, st.out_bytes_per_token)
        if i + 1 == len(stages):
            sent += sum(n * INDEX_BYTES for j, n in _overlaps(mine, rows[first])
                        if (first, j) != (owner, replica) or tp_rank != 0)
    if owner == first and tp_rank == 0:
        for j, n in _overlaps(mine, rows[last]):
            if (last, j) != (owner, replica) or (len(stages) - 1) % tp != 0:
                static += plan.microbatches * n * INDEX_BYTES
    return static + sum(wide.values()) + SEND_ROUNDS * plan.microbatches * sent


def owner_ops(plan, graph: OpGraph, owner: int) -> list[Op]:
    return [graph.ops[i] for st in plan.stages if st.owner == owner for i in range(st.first_op, st.last_op + 1)]


def kv_pool(plan, graph: OpGraph, owner: int, replica: int) -> int:
    """The KV pages of the pool of a rank of (owner, replica): its slots at the full context, or
    sized for the plan's workload (`ir.workload.kv_pool_pages`) when every owner holding state
    serves exactly one scheduling replica's rows (the runtime's rule, `worker.planned_kv_pages`).
    A "dp" owner's replicas are its lowered TP 1 replicas (`lower.as_replicas`)."""
    plan = as_replicas(plan)
    lo, hi = replica_rows(plan.batch // plan.microbatches, plan.owners[owner].replicas)[replica]
    first = plan.owners[plan.stages[0].owner].replicas
    split = any(plan.owners[st.owner].replicas != first and any(op.state for op in graph.ops[st.first_op:st.last_op + 1])
                for st in plan.stages)
    workload = None if split else Workload.from_json(plan.workload)
    return kv_pool_pages(plan.microbatches * (hi - lo), plan.context, workload, PAGE_TOKENS)


def _dp_rank_memory(plan, graph: OpGraph, owner: int, replica: int, tp_rank: int, width: int) -> MemoryBreakdown:
    """A rank of a "dp" owner of G GPUs: every op but the routed experts whole, at its own rows;
    E / G experts, which see the rows of its expert group."""
    from opweave.ir.tp import EXPERT_KINDS

    g, flat = plan.owners[owner].tp, as_replicas(plan)
    lo, hi = replica_rows(flat.batch // flat.microbatches, flat.owners[owner].replicas)[replica]
    ops = owner_ops(flat, graph, owner)
    dense, experts = [op for op in ops if op.kind not in EXPERT_KINDS], [op for op in ops if op.kind in EXPERT_KINDS]
    return MemoryBreakdown(
        weights=weight_bytes(dense, 1) + weight_bytes(experts, g, "ep") + redundant_bytes(experts, g,
                                                                                        plan.redundant_experts),
        state=state_bytes(ops, 1, flat.microbatches * (hi - lo), flat.context, kv_pool(flat, graph, owner, replica)),
        activations=max(activation_bytes(dense, 1, hi - lo, width, flat.context),
                        activation_bytes(experts, g, g * (hi - lo), width, flat.context, "ep")),
        buffers=buffer_bytes(flat, owner, replica, width, tp_rank))


def plan_rank_memory(plan, graph: OpGraph, owner: int, replica: int, tp_rank: int,
                     width: int = PREFILL_CHUNK) -> MemoryBreakdown:
    """The planned breakdown of the GPU at (owner, replica, TP rank) of a plan (a "dp" owner's
    replicas and ranks as lowered: `lower.as_replicas`)."""
    o = plan.owners[owner]
    if o.experts == "dp" and o.tp > 1:
        return _dp_rank_memory(plan, graph, owner, replica, tp_rank, width)
    lo, hi = replica_rows(plan.batch // plan.microbatches, o.replicas)[replica]
    ops = owner_ops(plan, graph, owner)
    owners = [st.owner for st in plan.stages]
    held = held_peak(graph, [(st.first_op, st.last_op) for st in plan.stages], owners).get(owner, 0) \
        if len(set(owners)) > 1 else 0
    return MemoryBreakdown(
        weights=weight_bytes(ops, o.tp, o.experts)
        + (redundant_bytes(ops, o.tp, plan.redundant_experts) if o.experts == "ep" else 0.0),
        state=state_bytes(ops, o.tp, plan.microbatches * (hi - lo), plan.context, kv_pool(plan, graph, owner, replica)),
        activations=activation_bytes(ops, o.tp, hi - lo, width, plan.context, o.experts)
        + plan.microbatches * (hi - lo) * width * held,
        buffers=buffer_bytes(plan, owner, replica, width, tp_rank))
