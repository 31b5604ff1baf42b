"""A plan with every choice given (template, owners, batching) instead of searched.

Used to check that any split runs and generates the reference tokens, and to reproduce a plan
by hand: `pinned_plan(fe, cluster, "cad", [("h100", 2, 1), ("l40s", 1, 2)], batch=4,
microbatches=2, context=64)`. The owners are (GPU type, TP degree, replicas) per slot, or
(GPU type, TP degree, replicas, expert layout) with layout "tp" (routed experts sliced, the
default) or "ep" (expert parallelism: each GPU of the group holds whole experts).

Each owner is built and checked by the search's own code (`passes/search.py owner_config`: node
size, TP dividing every sharded op, GPUs in the pool, memory per GPU at this batch and context),
the owners together must fit in the cluster, and the plan is placed and made by the pipeline's
steps place and plan (`compiler/pipeline.py`); anything that does not fit is a one-line
`OpWeaveError` naming it.
"""

from __future__ import annotations

import math

from opweave.compiler import pipeline
from opweave.compiler.compile import Compiled
from opweave.compiler.frontend import FrontEnd
from opweave.cost.model import CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.passes.search import Candidate, Counters, PlanSpace, SearchResult, _Evaluator, build_sim_problem, \
    owner_config
from opweave.passes.simulate import simulate
from opweave.passes.templates import build_stages, template_by_name


def pinned_plan(fe: FrontEnd, cluster: Cluster, template: str, owners: list[tuple], batch: int,
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
    if not 1 <= microbatches <= batch or batch % microbatches:
        raise OpWeaveError(f"microbatches {microbatches} must be between 1 and the batch {batch} and divide it")
    configs = tuple(owner_config(ev, plan, k, slot, *owner[:3], batch, microbatches, *owner[3:])
                    for slot, owner in enumerate(owners))
    used: dict[str, int] = {}
    for c in configs:
        used[c.gpu.name] = used.get(c.gpu.name, 0) + c.num_gpus
    for name, n in used.items():
        if n > cluster.count(name):
            raise OpWeaveError(f"the owners need {n} {name} GPUs, the cluster {cluster.spec} has {cluster.count(name)}")
    problem = build_sim_problem(ev, plan, batch, microbatches, configs)
    if problem is None:
        raise OpWeaveError(f"the owners' TP groups do not fit inside the nodes of {cluster.spec}")
    cand = Candidate(stage_plan=plan, batch=batch, microbatches=microbatches, owners=configs,
                     problem=problem, result=simulate(problem))
    st = pipeline.State(model=fe.source.path, source=fe.source, graph=fe.graph, blocks=fe.blocks, cluster=cluster,
                        tpot_slo_s=tpot_slo_s, context=context, cost_model=cost_model, done=["trace", "blocks"],
                        result=SearchResult(best=cand, closest=cand, counters=Counters()))
    pipeline.after_step(st, "search")          # the pinned candidate stands in for the search
    return pipeline.run(st, first="place", last="plan").compiled()
