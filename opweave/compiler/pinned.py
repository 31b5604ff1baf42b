"""A plan with every choice given (template, owners, batching) instead of searched.

Used to check that any split runs and generates the reference tokens, and to reproduce a plan
by hand: `pinned_plan(fe, cluster, "cad", [("h100", 2, 1), ("l40s", 1, 2)], batch=4,
microbatches=2, context=64)`. The owners are (GPU type, TP degree, replicas) per slot.
"""

from __future__ import annotations

import math

from opweave.compiler.compile import Compiled, make_plan
from opweave.compiler.frontend import FrontEnd
from opweave.cost.model import CostModel, memory_per_gpu
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.passes.owners import OwnerConfig, microbatch_share
from opweave.passes.search import (Candidate, Counters, PlanSpace, SearchResult, _Evaluator, build_sim_problem,
                                   slot_of)
from opweave.passes.simulate import simulate
from opweave.passes.templates import build_stages, template_by_name


def pinned_plan(fe: FrontEnd, cluster: Cluster, template: str, owners: list[tuple[str, int, int]], batch: int,
                microbatches: int, context: int, tpot_slo_s: float = math.inf,
                cost_model: CostModel = CostModel()) -> Compiled:
    space = PlanSpace(graph=fe.graph, blocks=fe.blocks, cluster=cluster, context=context, tpot_slo_s=tpot_slo_s,
                      cost_model=cost_model)
    ev = _Evaluator(space)
    plan = build_stages(fe.blocks, template_by_name(fe.blocks, template))
    k = len(owners)
    if (k > 1 and plan.stages_per_block % k) or (k == 1 and len(plan.stages) > 1 and plan.stages_per_block > 1):
        raise OpWeaveError(f"template {template} has {plan.stages_per_block} stages per block: "
                           f"{k} owner(s) cannot take them round-robin")
    configs = []
    sigs = ev.sig_ids(plan)
    for slot, (gpu_name, tp, replicas) in enumerate(owners):
        pool_index = next((i for i, p in enumerate(cluster.pools) if p.gpu.name == gpu_name), None)
        if pool_index is None:
            raise OpWeaveError(f"the cluster has no {gpu_name}")
        gpu = cluster.pools[pool_index].gpu
        stages = [s for s in plan.stages if slot_of(s.index, plan.stages_per_block, k) == slot]
        ops = [op for s in stages for op in fe.graph.ops[s.first:s.last + 1]]
        share = microbatch_share(batch, microbatches, replicas)
        configs.append(OwnerConfig(
            slot=slot, gpu=gpu, tp=tp, replicas=replicas, share=share,
            latencies=tuple(ev.latency(sigs[s.index], pool_index, tp, share)
                            + ev.host_s(plan, k, s.index, pool_index, share) for s in stages),
            memory_per_gpu=memory_per_gpu(ops, tp, math.ceil(batch / replicas), context)))
    problem = build_sim_problem(ev, plan, batch, microbatches, tuple(configs))
    cand = Candidate(stage_plan=plan, batch=batch, microbatches=microbatches, owners=tuple(configs),
                     problem=problem, result=simulate(problem))
    result = SearchResult(best=cand, closest=cand, counters=Counters())
    return Compiled(front_end=fe, result=result, plan=make_plan(fe, cluster, context, tpot_slo_s, result))
