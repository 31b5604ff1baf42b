"""`opweave compile`: front end -> plan search -> placement on the cluster -> artifact folder.

    run_front_end      MODEL -> OpGraph -> partition blocks
    search             templates x owners x batching, Pareto + branch-and-bound, simulator-judged
    place              replica sets on the cluster's physical GPUs (TP groups inside one node)
    write_artifact     plan.json, ir.txt, trace.json, gantt.png (into a temp folder, then renamed)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Callable

from opweave.compiler.frontend import FrontEnd, run_front_end
from opweave.cost.model import CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.ir.graph import format_graph
from opweave.ir.plan import PLAN_FORMAT, Plan, PlanOwner, PlanStage, Predicted, format_plan, plan_to_json
from opweave.passes.search import Candidate, PlanSpace, SearchOptions, SearchResult, search, slot_of
from opweave.codegen.render import render_rank
from opweave.ir.program import program_to_json
from opweave.passes.lower import lower
from opweave.passes.trace_export import chrome_trace, gantt_png
from opweave.runtime.manifest import sha256_text, write_manifest


@dataclasses.dataclass(frozen=True)
class Compiled:
    front_end: FrontEnd
    result: SearchResult
    plan: Plan


def place(cand: Candidate, cluster: Cluster) -> tuple[int, list[list[list[tuple[int, ...]]]], tuple[int, ...]]:
    """Replica sets that fit and the GPUs of each (owner, replica); TP groups stay inside a node.

    Returns (number of sets, gpus[owner][set][replica] -> global indices, idle global indices)."""
    free: dict[str, list[list[int]]] = {}  # gpu type -> nodes -> free global indices
    for g in cluster.physical_gpus():
        nodes = free.setdefault(g.gpu_name, [])
        while len(nodes) <= g.node_index:
            nodes.append([])
        nodes[g.node_index].append(g.global_index)
    gpus: list[list[list[tuple[int, ...]]]] = [[] for _ in cand.owners]
    sets = 0
    while True:
        trial = {name: [list(n) for n in nodes] for name, nodes in free.items()}
        taken: list[list[tuple[int, ...]]] = []
        ok = True
        for o in cand.owners:
            replicas = []
            for _ in range(o.replicas):
                node = next((n for n in trial.get(o.gpu.name, []) if len(n) >= o.tp), None)
                if node is None:
                    ok = False
                    break
                replicas.append(tuple(node[:o.tp]))
                del node[:o.tp]
            if not ok:
                break
            taken.append(replicas)
        if not ok:
            break
        free = trial
        for i, replicas in enumerate(taken):
            gpus[i].append(replicas)
        sets += 1
    idle = tuple(sorted(i for nodes in free.values() for n in nodes for i in n))
    return sets, gpus, idle


def make_plan(fe: FrontEnd, cluster: Cluster, context: int, tpot_slo_s: float, result: SearchResult) -> Plan:
    cand = result.best
    sets, gpus, idle = place(cand, cluster)
    if sets == 0:
        raise OpWeaveError(f"the plan's TP groups do not fit inside the nodes of {cluster.spec}")
    k = len(cand.owners)
    sim = cand.result
    stages = tuple(PlanStage(index=s.index, first_op=s.first, last_op=s.last,
                             owner=slot_of(s.index, cand.stage_plan.stages_per_block, k), slot=s.slot,
                             label=cand.problem.stages[s.index].label, out_bytes_per_token=s.out_bytes_per_token)
                   for s in cand.stage_plan.stages)
    owners = tuple(PlanOwner(slot=o.slot, gpu=o.gpu.name, tp=o.tp, replicas=o.replicas,
                             memory_per_gpu_bytes=o.memory_per_gpu, occupancy=sim.owners[i].occupancy,
                             bubble_ms=sim.owners[i].bubble_s * 1e3, gpus=tuple(tuple(r) for r in gpus[i]))
                   for i, o in enumerate(cand.owners))
    predicted = Predicted(
        tpot_ms=sim.tpot_s * 1e3, tokens_per_s=sim.tokens_per_s * sets, tokens_per_s_per_set=sim.tokens_per_s,
        cost_per_mtok_usd=sim.cost_per_mtok_usd, cost_per_hour_usd=sim.cost_per_hour * sets,
        bytes_per_token_intra=sim.bytes_per_token_intra_node, bytes_per_token_inter=sim.bytes_per_token_inter_node,
        mean_occupancy=sum(o.occupancy for o in sim.owners) / len(sim.owners))
    template = cand.stage_plan.template
    return Plan(format=PLAN_FORMAT, model=fe.graph.model, cluster=cluster.spec, context=context,
                tpot_slo_ms=tpot_slo_s * 1e3, template=template.name, template_family=template.family,
                template_sites=tuple(tuple(sorted(s)) for s in template.sites), num_stages=len(stages),
                stages_per_block=cand.stage_plan.stages_per_block, stages=stages, owners=owners,
                batch=cand.batch, microbatches=cand.microbatches, replica_sets=sets, idle_gpus=idle,
                predicted=predicted, counters=dataclasses.asdict(result.counters))


def compile_model(model: str, cluster: Cluster, tpot_slo_s: float, context: int,
                  options: SearchOptions = SearchOptions(), cost_model: CostModel = CostModel(),
                  progress: Callable[[str], None] | None = None) -> Compiled:
    fe = run_front_end(model)                                            # trace + partition blocks
    space = PlanSpace(graph=fe.graph, blocks=fe.blocks, cluster=cluster, context=context,
                      tpot_slo_s=tpot_slo_s, cost_model=cost_model)
    result = search(space, options, progress)                            # templates x owners x batching
    if result.best is None:
        raise OpWeaveError(f"no plan: {result.reason}")
    return Compiled(front_end=fe, result=result, plan=make_plan(fe, cluster, context, tpot_slo_s, result))


def _write_rank_programs(folder: str, compiled: Compiled, plan_hash: str) -> str:
    """Lowers the plan and writes model_config.json, ops.json, rank_XX.json and rank_XX.py.
    Returns the model hash ("" for a model.py model, which `opweave run` cannot load)."""
    fe = compiled.front_end
    if fe.source.kind == "file":
        return ""
    config_path = fe.source.path if fe.source.kind == "builtin" else os.path.join(fe.source.path, "config.json")
    with open(config_path) as f:
        config_text = f.read()
    with open(os.path.join(folder, "model_config.json"), "w") as f:
        f.write(config_text)
    op_names = [op.name for op in fe.graph.ops]
    with open(os.path.join(folder, "ops.json"), "w") as f:
        json.dump(op_names, f, indent=0)
    programs = lower(compiled.plan, fe.graph, fe.source.cfg, fe.blocks.period, fe.blocks.num_blocks, plan_hash)
    for program in programs:
        with open(os.path.join(folder, f"rank_{program.rank:02d}.json"), "w") as f:
            json.dump(program_to_json(program), f, indent=1)
        with open(os.path.join(folder, f"rank_{program.rank:02d}.py"), "w") as f:
            f.write(render_rank(program, op_names, compiled.plan.template, compiled.plan.num_stages))
    return sha256_text(config_text)


def write_artifact(out_dir: str, compiled: Compiled) -> None:
    """Writes the artifact into a temporary sibling folder, then renames it into place."""
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    if not os.path.isdir(parent):
        raise OpWeaveError(f"-o {out_dir}: folder {parent} does not exist")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise OpWeaveError(f"-o {out_dir}: exists and is not a folder")
    tmp = tempfile.mkdtemp(prefix=".opweave-", dir=parent)
    try:
        cand = compiled.result.best
        plan_text = json.dumps(plan_to_json(compiled.plan), indent=1)
        with open(os.path.join(tmp, "plan.json"), "w") as f:
            f.write(plan_text)
        model_hash = _write_rank_programs(tmp, compiled, sha256_text(plan_text))
        with open(os.path.join(tmp, "plan.txt"), "w") as f:
            f.write(format_plan(compiled.plan) + "\n")
        with open(os.path.join(tmp, "ir.txt"), "w") as f:
            f.write(format_graph(compiled.front_end.graph) + "\n")
        with open(os.path.join(tmp, "trace.json"), "w") as f:
            json.dump(chrome_trace(cand.problem, cand.result), f)
        gantt_png(cand.problem, cand.result, os.path.join(tmp, "gantt.png"))
        write_manifest(tmp, model_hash, sha256_text(plan_text))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp and temp files are private; the artifact is not
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        if os.path.isdir(out_dir):
            old = tempfile.mkdtemp(prefix=".opweave-old-", dir=parent)
            os.rename(out_dir, os.path.join(old, "prev"))
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
