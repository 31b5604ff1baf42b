"""The bodies of the compile's steps, one function per step.

Each function takes the IRs it reads as keyword arguments and returns the IRs it makes. The
argument names are the fields of the compile's record. `compiler/pipeline.py` holds the table
that names what each step reads and makes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from opweave.artifact import sha256_text
from opweave.compiler.inputs import Inputs, plan_space
from opweave.cost.model import dispatch_mode
from opweave.cost.prefill import PrefillStage, plan_prefill_s
from opweave.errors import OpWeaveError
from opweave.ir.graph import OpGraph
from opweave.ir.plan import PLAN_FORMAT, Plan, PlanOwner, PlanStage, Predicted, gpu_runs, plan_to_json
from opweave.ir.experts import placement as expert_placement
from opweave.ir.program import RankProgram
from opweave.ir.tp import EXPERT_KINDS
from opweave.models.registry import ModelSource
from opweave.passes import placement as placement_pass
from opweave.passes.blocks import BlockedGraph
from opweave.passes.carry import round_robin, send_bytes_per_token
from opweave.passes.lower import lower
from opweave.passes.placement import Placement
from opweave.passes.search import SearchResult, search
from opweave.passes.space import owner_groups, slot_of


def trace_model(inputs: Inputs) -> tuple[ModelSource, OpGraph]:
    """Step trace: resolves MODEL (name, checkpoint folder or model.py) and traces its decode
    step with torch.fx on the meta device (`passes/trace.py`)."""
    from opweave.models.registry import resolve
    from opweave.passes.trace import build_graph

    source = resolve(inputs.model)
    return source, build_graph(source.build("meta", inputs.dtype, inputs.kv_cache_dtype))


def check_context(source: ModelSource, graph: OpGraph, context: int, allow_long_context: bool,
                  warn: Callable[[str], None] | None) -> None:
    """Refuses a context beyond the model's `max_position_embeddings`.

    Those are the positions it was trained for. Past them its output is not to be trusted, and
    nothing at run time would say so. `allow_long_context` turns the refusal into a warning
    through `warn` (default: Python's `warnings.warn`).
    """
    limit = source.cfg.max_position_embeddings
    if context <= limit:
        return
    what = f"--context {context} is beyond {graph.model}'s max_position_embeddings {limit}"
    if not allow_long_context:
        raise OpWeaveError(f"{what} (the positions it was trained for); pass --allow-long-context to plan it anyway")
    message = f"{what}: its output past {limit} tokens is not to be trusted"
    if warn is None:
        import warnings

        warnings.warn(message, stacklevel=3)
    else:
        warn(message)


def search_plans(inputs: Inputs, source: ModelSource, graph: OpGraph,
                 blocks: BlockedGraph) -> tuple[SearchResult, Inputs]:
    """Step search: templates x owners x batching over the plan space (`passes/search.py`), once
    per count of redundant experts per GPU (`SearchOptions.redundant_experts`: the cost model's
    balance and memory follow it), keeping the cheapest; the inputs come back with the chosen
    count in their cost model. A context past the trained positions, or a space with no plan, is
    a one-line error."""
    check_context(source, graph, inputs.context, inputs.allow_long_context, inputs.warn)
    best = None
    for r in inputs.options.redundant_experts:
        tried = dataclasses.replace(inputs, cost_model=dataclasses.replace(inputs.cost_model, redundant_experts=r))
        result = search(plan_space(graph, blocks, tried), inputs.options, inputs.progress)
        if best is None or (result.best is not None and (best[0].best is None or result.best.cost < best[0].best.cost)):
            best = (result, tried)
    result, inputs = best
    if result.best is None:
        raise OpWeaveError(f"no plan: {result.reason}")
    return result, inputs


def place_best(inputs: Inputs, result: SearchResult) -> Placement:
    """Step place: the best candidate's replica sets on the cluster's nodes (`passes/placement.py`:
    first fit, TP groups inside a node). A one-line error when not even one set fits."""
    where = placement_pass.place(owner_groups(result.best.owners), inputs.cluster)
    if where.num_sets == 0:
        raise OpWeaveError(f"the plan's TP groups do not fit inside the nodes of {inputs.cluster.spec}")
    return where


def make_plan(inputs: Inputs, graph: OpGraph, result: SearchResult, placement: Placement) -> Plan:
    """Step plan: the best candidate, placed, as a Plan. It carries the search's figures and the
    schedule's inputs (stage compute and send times, prices, the return), so it can be simulated
    again alone."""
    cand, cluster, where = result.best, inputs.cluster, placement
    sets = where.num_sets
    set0 = where.replica_set(0)  # what the runtime deploys; set k is where.replica_set(k)
    k = len(cand.owners)
    sim, problem = cand.sim, cand.problem
    sent = send_bytes_per_token(cand.stage_plan, round_robin(cand.stage_plan, k))
    stages = tuple(PlanStage(index=s.index, first_op=s.first, last_op=s.last,
                             owner=slot_of(s.index, cand.stage_plan.stages_per_block, k), slot=s.slot,
                             label=problem.stages[s.index].label, out_bytes_per_token=sent[s.index],
                             compute_s=problem.stages[s.index].compute_s, send_s=problem.stages[s.index].send_s,
                             send_bytes=problem.stages[s.index].send_bytes,
                             send_inter_node=problem.stages[s.index].inter_node)
                   for s in cand.stage_plan.stages)
    owners = tuple(PlanOwner(slot=o.slot, gpu=o.gpu.name, tp=o.tp, replicas=o.replicas,
                             memory_per_gpu_bytes=o.memory_per_gpu, occupancy=sim.owners[i].occupancy,
                             bubble_ms=sim.owners[i].bubble_s * 1e3, gpus=set0[i], price_per_hour=o.gpu.price_per_hour,
                             experts=o.experts, dispatch=_dispatch(inputs, graph, cand, i),
                             expert_slots=_expert_slots(inputs, graph, cand, i),
                             group_nodes=max(1, o.tp // o.gpu.gpus_per_node) if o.experts == "dp" else 1)
                   for i, o in enumerate(cand.owners))
    traffic = cand.traffic
    per_set = sim.tokens_per_s if traffic is None else traffic.tokens_per_s
    rate = sim.cost_per_hour if traffic is None else traffic.cost_per_hour
    idle = where.idle
    if traffic is not None and traffic.sets < sets:   # the prefill groups take the GPUs of the sets past them
        idle = gpu_runs({g for lo, hi in where.idle for g in range(lo, hi)}
                        | {g for k in range(traffic.sets, sets) for group in where.replica_set(k)
                           for replica in group for g in replica})
        sets = traffic.sets
    predicted = Predicted(
        tpot_ms=cand.tpot_s * 1e3, tokens_per_s=per_set * sets, tokens_per_s_per_set=per_set,
        cost_per_mtok_usd=cand.cost, cost_per_hour_usd=rate * sets,
        bytes_per_token_intra=sim.bytes_per_token_intra_node, bytes_per_token_inter=sim.bytes_per_token_inter_node,
        mean_occupancy=sum(o.occupancy for o in sim.owners) / len(sim.owners))
    template = cand.stage_plan.template
    idle_ms = None if inputs.isl is None else _ttft_s(inputs, graph, cand, stages) * 1e3
    return Plan(format=PLAN_FORMAT, model=graph.model, cluster=cluster.spec, context=inputs.context,
                tpot_slo_ms=inputs.tpot_slo_s * 1e3, template=template.name, template_family=template.family,
                template_sites=tuple(tuple(sorted(s)) for s in template.sites), num_stages=len(stages),
                stages_per_block=cand.stage_plan.stages_per_block, stages=stages, owners=owners,
                batch=cand.batch, microbatches=cand.microbatches, replica_sets=sets, idle_gpus=idle,
                predicted=predicted, counters=dataclasses.asdict(result.counters), return_s=problem.return_s,
                return_bytes=problem.return_bytes, return_inter_node=problem.return_inter_node,
                prefill_chunk=inputs.prefill_chunk, kv_cache_dtype=inputs.kv_cache_dtype, isl=inputs.isl, osl=inputs.osl, ttft_idle_ms=idle_ms,
                redundant_experts=_redundant(cand, inputs),
                workload=None if inputs.workload is None else inputs.workload.to_json(),
                **_traffic_fields(inputs, traffic))


def _redundant(cand, inputs: Inputs) -> int:
    """The redundant experts per GPU the plan's expert-parallel owners hold (0 without any)."""
    wide = any(o.experts in ("ep", "dp") and o.tp > 1 for o in cand.owners)
    return inputs.cost_model.redundant_experts if wide else 0


def _owner_experts(graph: OpGraph, cand, slot: int) -> list:
    """The routed-experts ops of the candidate's owner `slot`, in graph order."""
    k = len(cand.owners)
    return [op for s in cand.stage_plan.stages if slot_of(s.index, cand.stage_plan.stages_per_block, k) == slot
            for op in graph.ops[s.first:s.last + 1] if op.kind in EXPERT_KINDS]


def _expert_slots(inputs: Inputs, graph: OpGraph, cand, slot: int) -> tuple:
    """Per MoE layer of an expert-parallel owner holding copies, each GPU's experts
    (`ir.experts.placement` of the layer's load, as the cost model charged); () otherwise."""
    o, cm = cand.owners[slot], inputs.cost_model
    if o.experts not in ("ep", "dp") or o.tp <= 1 or not cm.redundant_experts:
        return ()
    out = []
    for op in _owner_experts(graph, cand, slot):
        experts = op.weights[0].shape[0]
        shares = cm.expert_load.shares(op.layer, experts) if cm.expert_load is not None else (1 / experts,) * experts
        out.append((op.layer, expert_placement(shares, o.tp, cm.redundant_experts)))
    return tuple(out)


def _dispatch(inputs: Inputs, graph: OpGraph, cand, slot: int) -> str:
    """A "dp" owner's dispatch mode at its planned rows (`cost.model.dispatch_mode`, what the
    search charged); "" for other owners."""
    o = cand.owners[slot]
    if o.experts != "dp" or o.tp <= 1:
        return ""
    ops = _owner_experts(graph, cand, slot)
    if not ops:
        return ""
    hidden = graph.cuts[0].bytes_per_token if graph.cuts else 0
    return dispatch_mode(ops[0], o.gpu, o.tp, o.share, hidden)


def _traffic_fields(inputs: Inputs, traffic) -> dict:
    """plan.json's figures of the way the plan serves prefill (`passes/traffic.py`)."""
    if traffic is None:
        return {}
    prefill = {"mode": traffic.mode, "load": traffic.load, "requests_per_s": traffic.requests_per_s,
               "sets": traffic.sets, "tpot_at_load_ms": traffic.tpot_at_load_s * 1e3}
    rate = inputs.workload.rate
    if rate is not None:   # the replica sets that take the rate, each at `load` (`TrafficModel._load`)
        prefill["fleet_sets"] = round(rate / (traffic.load * traffic.requests_per_s))
    if traffic.mode == "aggregated":
        prefill.update(token_budget=traffic.token_budget, chunk_share=traffic.chunk_share)
    else:
        p = traffic.pool
        prefill["owners"] = [{"gpu": p.gpu.name, "tp": p.tp, "replicas": p.replicas, "for_sets": p.sets,
                              "prefill_ms": p.prefill_s * 1e3,
                              "kv_bytes": p.kv_bytes, "kv_transfer_ms": p.kv_transfer_s * 1e3,
                              "memory_per_gpu_bytes": p.memory_per_gpu, "price_per_hour": p.gpu.price_per_hour}]
    return {"ttft_ms": traffic.ttft_s * 1e3, "ttft_p99_ms": traffic.ttft_p99_s * 1e3,
            "tpot_p99_ms": traffic.tpot_p99_s * 1e3, "prefill": prefill}


def _ttft_s(inputs: Inputs, graph: OpGraph, cand, stages: tuple[PlanStage, ...]) -> float:
    """One prompt of `inputs.isl` tokens through the candidate's stages alone (`cost.prefill`)."""
    crossing = []
    for j, st in enumerate(stages):
        o = cand.owners[st.owner]
        nxt = stages[j + 1].owner if j + 1 < len(stages) else st.owner
        crossing.append(PrefillStage(ops=tuple(graph.ops[st.first_op:st.last_op + 1]), gpu=o.gpu, tp=o.tp,
                                     layout=o.experts,
                                     send_bytes_per_token=st.out_bytes_per_token if nxt != st.owner else 0.0,
                                     next_gpu=cand.owners[nxt].gpu, inter_node=bool(st.send_inter_node)))
    hidden = graph.cuts[0].bytes_per_token if graph.cuts else 0
    return plan_prefill_s(crossing, inputs.isl, hidden, inputs.cost_model)


def plan_text(plan: Plan) -> str:
    """plan.json's text. Its sha256 is the plan hash every rank program carries."""
    return json.dumps(plan_to_json(plan), indent=1)


def rank_programs(plan: Plan, source: ModelSource, graph: OpGraph, blocks: BlockedGraph,
                  plan_hash: str) -> tuple[RankProgram, ...]:
    """One rank program per rank of replica set 0 (`passes/lower.py`). None for a model.py
    model, which `opweave run` cannot load."""
    if source.kind == "file":
        return ()
    return lower(plan, graph, blocks.period, blocks.num_blocks, plan_hash, blocks.num_head_layers)


def lower_plan(source: ModelSource, graph: OpGraph, blocks: BlockedGraph,
               plan: Plan) -> tuple[str, tuple[RankProgram, ...]]:
    """Step lower: plan.json's text and the rank programs, which carry its hash."""
    text = plan_text(plan)
    return text, rank_programs(plan, source, graph, blocks, sha256_text(text))


def render_modules(graph: OpGraph, plan: Plan, programs: tuple[RankProgram, ...]) -> dict[str, str]:
    """Step render: each rank program as a Python module, `rank_XX.py` (`codegen/render.py`)."""
    from opweave.codegen.render import render_rank

    names = [op.name for op in graph.ops]
    return {f"rank_{p.rank:02d}.py": render_rank(p, names, plan.template, plan.num_stages) for p in programs}
