"""Lowering: a `Plan` -> one `RankProgram` per rank of one replica set (summary §6).

Ranks are numbered owner by owner, replica by replica, TP rank by TP rank; global rank 0 is the
leader of owner 0's first replica, which runs stage 0 (the embedding) and so schedules requests.
Every microbatch has `microbatch_size` rows; replica j of an owner with r replicas processes the
contiguous rows [floor(j·m/r), floor((j+1)·m/r)). A stage boundary becomes, for each pair
of replicas whose rows overlap, one packed send of the overlapping rows of the values the carry
pass sends there (`passes/carry.py`: the cut's live values that the owner of their next reader
does not hold yet) from the source replica's port to the destination replica's port, which fans
them out to its TP peers. The cut's other live values stay on the owners that hold them: an
owner keeps such a value per microbatch (`StageProgram.keeps`, every TP rank its own copy) and
reads it back in its later stage program (`StageProgram.takes`; `passes/carry.held_values`); a
replica's rows are the same in all its owner's stages, so the kept rows are the ones it reads.
A replica's port for the cut after plan stage c is rank c mod TP of its group (`port`): the TP
ranks take the cuts in turn, so a replica's transfers spread over its GPUs' links. The last
stage returns the new token ids to the embedding owner's leaders (TP rank 0: the scheduler).
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
from opweave.passes.carry import carry, held_values


def replica_rows(microbatch_size: int, replicas: int) -> list[tuple[int, int]]:
    """Balanced contiguous rows per replica (none empty when replicas <= rows; at most ceil(m / r))."""
    return [(i * microbatch_size // replicas, (i + 1) * microbatch_size // replicas) for i in range(replicas)]


def rank_layout(plan: Plan) -> list[tuple[int, int, int]]:
    """(owner, replica, tp rank) of each global rank of one replica set."""
    return [(o.slot, j, t) for o in plan.owners for j in range(o.replicas) for t in range(o.tp)]


def _leaders(plan: Plan) -> dict[tuple[int, int], int]:
    return {(o, j): rank for rank, (o, j, t) in enumerate(rank_layout(plan)) if t == 0}


def port(plan: Plan, leaders, owner: int, replica: int, cut: int) -> int:
    """The rank of replica `replica` of `owner` that handles the cut after plan stage `cut`."""
    return leaders[(owner, replica)] + cut % plan.owners[owner].tp


def _overlaps(plan: Plan, leaders, other: int, rows: tuple[int, int], mb: int, cut: int | None = None
              ) -> tuple[Peer, ...]:
    """Replicas of `other` whose rows overlap `rows`: their port for `cut` (their leader when None)."""
    peers = []
    for j, (lo, hi) in enumerate(replica_rows(mb, plan.owners[other].replicas)):
        a, b = max(lo, rows[0]), min(hi, rows[1])
        if a < b:
            rank = leaders[(other, j)] if cut is None else port(plan, leaders, other, j, cut)
            peers.append(Peer(rank=rank, lo=a, hi=b))
    return tuple(peers)


def _transfer(graph: OpGraph, cut: int, values: tuple[str, ...], peers: tuple[Peer, ...]) -> Transfer:
    """The transfer of `values` (live at the cut after op `cut`, in the cut's order) to or from `peers`."""
    point = graph.cut_after(cut)
    if point is None:
        raise ValueError(f"plan cuts after op {cut}, which is not a legal cut point")
    shape = dict(zip(point.values, point.value_shapes))
    return Transfer(cut=cut, values=values, shapes=tuple(shape[v] for v in values),
                    layouts=tuple(value_layout(graph, v) for v in values), peers=peers)


def as_replicas(plan: Plan) -> Plan:
    """`plan` with each owner whose attention is data-parallel inside its expert group ("dp", tp
    G, r replicas) as r x G replicas of TP 1, each with its own rows: what its ranks run, but for
    the routed experts (`expert_groups`)."""
    if not any(o.experts == "dp" for o in plan.owners):
        return plan
    owners = tuple(dataclasses.replace(o, tp=1, replicas=o.replicas * o.tp,
                                       gpus=tuple((g,) for replica in o.gpus for g in replica))
                   if o.experts == "dp" else o for o in plan.owners)
    return dataclasses.replace(plan, owners=owners)


def expert_groups(plan: Plan) -> dict[tuple[int, int], tuple[int, ...]]:
    """(owner, replica of `as_replicas(plan)`) -> the ranks of its expert group, for "dp" owners
    (`plan` as compiled: G consecutive replicas make one group)."""
    flat = as_replicas(plan)
    leaders = _leaders(flat)
    out = {}
    for o in plan.owners:
        if o.experts != "dp":
            continue
        for j in range(o.replicas * o.tp):
            g = j // o.tp
            out[(o.slot, j)] = tuple(leaders[(o.slot, g * o.tp + k)] for k in range(o.tp))
    return out


def lower(plan: Plan, graph: OpGraph, period: int, num_blocks: int, plan_hash: str,
          num_head_layers: int = 0) -> tuple[RankProgram, ...]:
    """One program per rank of replica set 0."""
    ep = expert_groups(plan)
    ep_groups = tuple(sorted(set(ep.values())))
    dispatch = {o.slot: (o.dispatch or "gather") for o in plan.owners if o.experts == "dp"}
    nodes = {o.slot: o.group_nodes for o in plan.owners if o.experts == "dp"}
    plan = as_replicas(plan)
    layout = rank_layout(plan)
    leaders = _leaders(plan)
    mb = plan.batch // plan.microbatches
    groups = tuple(tuple(r for r, (o2, j2, _) in enumerate(layout) if (o2, j2) == (o, j))
                   for (o, j) in sorted(leaders, key=leaders.get))
    first_owner, last_owner = plan.stages[0].owner, plan.stages[-1].owner
    bounds, owner_of = [(s.first_op, s.last_op) for s in plan.stages], [s.owner for s in plan.stages]
    carried = carry(graph, bounds, owner_of)      # what crosses each cut
    held = held_values(graph, bounds, owner_of, carried)  # what each owner keeps between its stage programs
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
                # partition block of the op's layer (None: head and tail layers, prologue, epilogue)
                block = ((op.layer - num_head_layers) // period
                         if op.layer is not None and 0 <= op.layer - num_head_layers < num_blocks * period else None)
                launches.append(Launch(op=index, name=op.name, kind=op.kind.value, layer=op.layer, block=block,
                                       inputs=op.inputs, output=op.name,
                                       allreduce=allreduce_after(graph.ops, index, owner.tp)))
            prev_owner = plan.stages[i - 1].owner if i > 0 else None
            recv = (_transfer(graph, st.first_op - 1, carried.sent[i - 1],
                              _overlaps(plan, leaders, prev_owner, rows, mb, i - 1))
                    if i > 0 and prev_owner != o else None)
            last = i == len(plan.stages) - 1
            send = None
            if not last and plan.stages[i + 1].owner != o:
                send = _transfer(graph, st.last_op, carried.sent[i],
                                 _overlaps(plan, leaders, plan.stages[i + 1].owner, rows, mb, i))
            returns = _overlaps(plan, leaders, first_owner, rows, mb) if last else ()
            recv_port = port(plan, leaders, o, j, i - 1) if recv is not None else None
            send_port = port(plan, leaders, o, j, i) if send is not None or returns else None
            layers = tuple(sorted({graph.ops[x].layer for x in range(st.first_op, st.last_op + 1)
                                   if graph.ops[x].layer is not None}))
            if i > 0 and plan.stages[i - 1].owner == o:  # the owner's previous stage goes straight on
                before = stages.pop()
                stages.append(dataclasses.replace(
                    before, layers=tuple(sorted(set(before.layers) | set(layers))),
                    launches=before.launches + tuple(launches), send=send, returns=returns, send_port=send_port))
                continue
            keeps, takes = held[i]
            block = next((l.block for l in launches if l.block is not None), None)
            stages.append(StageProgram(stage=st.index, block=block, layers=layers, recv=recv, launches=tuple(launches),
                                       send=send, returns=returns, recv_port=recv_port, send_port=send_port,
                                       keeps=keeps, takes=takes))
        scheduler = o == first_owner
        programs.append(RankProgram(
            rank=rank, world_size=len(layout), owner=o, replica=j, tp=owner.tp, tp_rank=t,
            tp_group=groups[[g[0] for g in groups].index(leaders[(o, j)])], tp_groups=groups, rows=rows,
            microbatch_size=mb, num_microbatches=plan.microbatches, scheduler=scheduler,
            scheduler_leaders=tuple(leaders[(first_owner, jj)] for jj in range(plan.owners[first_owner].replicas)),
            token_sources=_overlaps(plan, leaders, last_owner, rows, mb, len(plan.stages) - 1) if scheduler else (),
            stages=tuple(stages), model=plan.model, plan_hash=plan_hash, context=plan.context,
            prefill_chunk=plan.prefill_chunk, experts=owner.experts, kv_cache_dtype=plan.kv_cache_dtype,
            ep_group=ep.get((o, j), ()), ep_groups=ep_groups, ep_dispatch=dispatch.get(o, ""),
            ep_slots=owner.expert_slots, ep_nodes=nodes.get(o, 1),
            ep_rows=tuple(replica_rows(mb, owner.replicas)[(j // len(ep[(o, j)])) * len(ep[(o, j)]) + k]
                          for k in range(len(ep[(o, j)]))) if (o, j) in ep else ()))
    return tuple(programs)
