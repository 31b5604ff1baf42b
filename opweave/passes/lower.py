"""Lowering: a `Plan` -> one `RankProgram` per rank of one replica set (summary §6).

Ranks are numbered owner by owner, replica by replica, TP rank by TP rank; global rank 0 is the
leader of owner 0's first replica, which runs stage 0 (the embedding) and so schedules requests.
Every microbatch has `microbatch_size` rows; replica j of an owner with r replicas processes the
contiguous rows [floor(j·m/r), floor((j+1)·m/r)). A stage boundary becomes, for each pair
of replicas whose rows overlap, one packed send of the overlapping rows of the cut's live values
from the source replica's leader to the destination replica's leader, which fans them out to its
TP peers. The last stage returns the new token ids to the embedding owner's leaders the same way.
Consecutive stages of one owner (one owner taking every stage of a template) are one stage
program: nothing crosses between them.

What TP does to each op and value comes from the TP table (`opweave.ir.tp`): which launches are
followed by an all-reduce, and the typed layout (`Replicated` / `Split`) of every value crossing a
cut. Lowering reads only the Plan and the OpGraph (no model configuration).
"""

from __future__ import annotations

import dataclasses

from opweave.ir.graph import OpGraph
from opweave.ir.plan import Plan
from opweave.ir.program import Launch, Peer, RankProgram, StageProgram, Transfer
from opweave.ir.tp import allreduce_after, value_layout


def replica_rows(microbatch_size: int, replicas: int) -> list[tuple[int, int]]:
    """Balanced contiguous rows per replica (none empty when replicas <= rows; at most ceil(m / r))."""
    return [(i * microbatch_size // replicas, (i + 1) * microbatch_size // replicas) for i in range(replicas)]


def rank_layout(plan: Plan) -> list[tuple[int, int, int]]:
    """(owner, replica, tp rank) of each global rank of one replica set."""
    return [(o.slot, j, t) for o in plan.owners for j in range(o.replicas) for t in range(o.tp)]


def _leaders(plan: Plan) -> dict[tuple[int, int], int]:
    return {(o, j): rank for rank, (o, j, t) in enumerate(rank_layout(plan)) if t == 0}


def _overlaps(plan: Plan, leaders, other: int, rows: tuple[int, int], mb: int) -> tuple[Peer, ...]:
    peers = []
    for j, (lo, hi) in enumerate(replica_rows(mb, plan.owners[other].replicas)):
        a, b = max(lo, rows[0]), min(hi, rows[1])
        if a < b:
            peers.append(Peer(rank=leaders[(other, j)], lo=a, hi=b))
    return tuple(peers)


def _transfer(graph: OpGraph, cut: int, peers: tuple[Peer, ...]) -> Transfer:
    point = graph.cut_after(cut)
    if point is None:
        raise ValueError(f"plan cuts after op {cut}, which is not a legal cut point")
    return Transfer(cut=cut, values=point.values, shapes=point.value_shapes,
                    layouts=tuple(value_layout(graph, v) for v in point.values), peers=peers)


def lower(plan: Plan, graph: OpGraph, period: int, num_blocks: int, plan_hash: str) -> tuple[RankProgram, ...]:
    """One program per rank of replica set 0."""
    layout = rank_layout(plan)
    leaders = _leaders(plan)
    mb = plan.batch // plan.microbatches
    groups = tuple(tuple(r for r, (o2, j2, _) in enumerate(layout) if (o2, j2) == (o, j))
                   for (o, j) in sorted(leaders, key=leaders.get))
    first_owner, last_owner = plan.stages[0].owner, plan.stages[-1].owner
    programs = []
    for rank, (o, j, t) in enumerate(layout):
        owner = plan.owners[o]
        rows = replica_rows(mb, owner.replicas)[j]
        stages = []
        for i, st in enumerate(plan.stages):
            if st.owner != o:
                continue
            launches = []
            for index in range(st.first_op, st.last_op + 1):
                op = graph.ops[index]
                block = op.layer // period if op.layer is not None and op.layer < num_blocks * period else None
                launches.append(Launch(op=index, name=op.name, kind=op.kind.value, layer=op.layer, block=block,
                                       inputs=op.inputs, output=op.name,
                                       allreduce=allreduce_after(graph.ops, index, owner.tp)))
            prev_owner = plan.stages[i - 1].owner if i > 0 else None
            recv = (_transfer(graph, st.first_op - 1, _overlaps(plan, leaders, prev_owner, rows, mb))
                    if i > 0 and prev_owner != o else None)
            last = i == len(plan.stages) - 1
            send = None
            if not last and plan.stages[i + 1].owner != o:
                send = _transfer(graph, st.last_op, _overlaps(plan, leaders, plan.stages[i + 1].owner, rows, mb))
            returns = _overlaps(plan, leaders, first_owner, rows, mb) if last else ()
            layers = tuple(sorted({graph.ops[x].layer for x in range(st.first_op, st.last_op + 1)
                                   if graph.ops[x].layer is not None}))
            if i > 0 and plan.stages[i - 1].owner == o:  # the owner's previous stage goes straight on
                before = stages.pop()
                stages.append(dataclasses.replace(
                    before, layers=tuple(sorted(set(before.layers) | set(layers))),
                    launches=before.launches + tuple(launches), send=send, returns=returns))
                continue
            stages.append(StageProgram(stage=st.index, block=next((l.block for l in launches if l.block is not None), None), layers=layers, recv=recv,
                                       launches=tuple(launches), send=send, returns=returns))
        scheduler = o == first_owner
        programs.append(RankProgram(
            rank=rank, world_size=len(layout), owner=o, replica=j, tp=owner.tp, tp_rank=t,
            tp_group=groups[[g[0] for g in groups].index(leaders[(o, j)])], tp_groups=groups, rows=rows,
            microbatch_size=mb, num_microbatches=plan.microbatches, scheduler=scheduler,
            scheduler_leaders=tuple(leaders[(first_owner, jj)] for jj in range(plan.owners[first_owner].replicas)),
            token_sources=_overlaps(plan, leaders, last_owner, rows, mb) if scheduler else (),
            stages=tuple(stages), model=plan.model, plan_hash=plan_hash, context=plan.context,
            prefill_chunk=plan.prefill_chunk))
    return tuple(programs)
