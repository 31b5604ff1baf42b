"""A plan with every choice given (template, owners, batching) instead of searched.

It checks that any split runs and generates the reference tokens, and it reproduces a plan by
hand: `pinned_plan(fe, cluster, "cad", [("h100", 2, 1), ("l40s", 1, 2)], batch=4,
microbatches=2, context=64)`. Each owner is (GPU type, TP degree, replicas), or (GPU type, TP
degree, replicas, expert layout). The layout is "tp" (routed experts sliced, the default) or
"ep" (expert parallelism: each GPU of the group holds whole experts).

The search's own code builds and checks each owner (`passes/space.py owner_config`): node size,
TP dividing every sharded op, GPUs in the pool, memory per GPU at this batch and context. The
owners together must fit in the cluster. The pipeline's steps place and plan
(`compiler/pipeline.py`) then place and make the plan. Anything that does not fit is a
one-line `OpWeaveError` naming it.
"""

from __future__ import annotations

import dataclasses
import math

from opweave.compiler import pipeline
from opweave.compiler.frontend import FrontEnd
from opweave.compiler.inputs import plan_space
from opweave.compiler.pipeline import Compiled
from opweave.compiler.steps import plan_text
from opweave.cost.model import DISPATCH_MODES, CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.ir.plan import PREFILL_CHUNK
from opweave.passes.search import Counters, SearchResult
from opweave.passes.space import Candidate, Evaluator, build_sim_problem, owner_config
from opweave.passes.simulate import simulate
from opweave.passes.templates import build_stages, template_by_name


def pinned_plan(fe: FrontEnd, cluster: Cluster, template: str, owners: list[tuple], batch: int,
                microbatches: int, context: int, tpot_slo_s: float = math.inf,
                cost_model: CostModel = CostModel(), prefill_chunk: int = PREFILL_CHUNK,
                dispatch: str | None = None) -> Compiled:
    """The compile of front end `fe` with the given template, owners and batching (module
    docstring), through step plan. `prefill_chunk` sizes the activations, as in `compile_model`;
    `dispatch` sets every "dp" owner's dispatch mode (default: the cheaper, as the search's)."""
    inputs = dataclasses.replace(fe.inputs, cluster=cluster, context=context, tpot_slo_s=tpot_slo_s,
                                 cost_model=cost_model, prefill_chunk=prefill_chunk)
    ev = Evaluator(plan_space(fe.graph, fe.blocks, inputs))
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
                     problem=problem, sim=simulate(problem))
    pinned = dataclasses.replace(fe, inputs=inputs, result=SearchResult(best=cand, closest=cand, counters=Counters()))
    pinned = pipeline.after_step(pinned, "search")          # the pinned candidate stands in for the search
    compiled = pipeline.run(pinned, first="place", last="plan")
    if dispatch is None:
        return compiled
    if dispatch not in DISPATCH_MODES:
        raise OpWeaveError(f"dispatch {dispatch!r}: one of {', '.join(DISPATCH_MODES)}")
    plan = dataclasses.replace(compiled.plan, owners=tuple(
        dataclasses.replace(o, dispatch=dispatch) if o.dispatch else o for o in compiled.plan.owners))
    return dataclasses.replace(compiled, plan=plan, plan_text=plan_text(plan))
