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
import tempfile
from typing import Callable

from opweave.compiler.frontend import FrontEnd, run_front_end
from opweave.cost.model import CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.ir.graph import format_graph
from opweave.ir.plan import PLAN_FORMAT, Plan, PlanOwner, PlanStage, Predicted, format_plan, plan_to_json
from opweave.passes import placement
from opweave.passes.placement import Placement
from opweave.passes.search import Candidate, PlanSpace, SearchOptions, SearchResult, search, slot_of
from opweave.codegen.render import render_rank
from opweave.ir.program import program_to_json
from opweave.passes.lower import lower
from opweave.passes.trace_export import chrome_trace, gantt_png
from opweave.outputs import check_artifact_dir, make_public, remove_tree, replace_folder
from opweave.runtime.manifest import sha256_text, write_manifest


@dataclasses.dataclass(frozen=True)
class Compiled:
    front_end: FrontEnd
    result: SearchResult
    plan: Plan


def place(cand: Candidate, cluster: Cluster) -> Placement:
    """The candidate's replica sets on the cluster's nodes (`passes/placement.py`: first fit,
    TP groups inside a node, cost independent of the cluster's size)."""
    return placement.place(tuple(placement.Group(gpu=o.gpu.name, tp=o.tp, replicas=o.replicas)
                                 for o in cand.owners), cluster)


def make_plan(fe: FrontEnd, cluster: Cluster, context: int, tpot_slo_s: float, result: SearchResult) -> Plan:
    cand = result.best
    where = place(cand, cluster)
    sets = where.num_sets
    if sets == 0:
        raise OpWeaveError(f"the plan's TP groups do not fit inside the nodes of {cluster.spec}")
    set0 = where.replica_set(0)  # what the runtime deploys; set k is where.replica_set(k)
    k = len(cand.owners)
    sim = cand.result
    stages = tuple(PlanStage(index=s.index, first_op=s.first, last_op=s.last,
                             owner=slot_of(s.index, cand.stage_plan.stages_per_block, k), slot=s.slot,
                             label=cand.problem.stages[s.index].label, out_bytes_per_token=s.out_bytes_per_token)
                   for s in cand.stage_plan.stages)
    owners = tuple(PlanOwner(slot=o.slot, gpu=o.gpu.name, tp=o.tp, replicas=o.replicas,
                             memory_per_gpu_bytes=o.memory_per_gpu, occupancy=sim.owners[i].occupancy,
                             bubble_ms=sim.owners[i].bubble_s * 1e3, gpus=set0[i])
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
                batch=cand.batch, microbatches=cand.microbatches, replica_sets=sets, idle_gpus=where.idle,
                predicted=predicted, counters=dataclasses.asdict(result.counters))


def check_context(fe: FrontEnd, context: int, allow_long_context: bool,
                  warn: Callable[[str], None] | None) -> None:
    """Refuses a context beyond the model's `max_position_embeddings` (the positions it was
    trained for: past them its output is not to be trusted, and nothing at run time would say so),
    unless `allow_long_context`, which turns the refusal into a warning through `warn` (default:
    Python's `warnings.warn`)."""
    limit = fe.source.cfg.max_position_embeddings
    if context <= limit:
        return
    what = f"--context {context} is beyond {fe.graph.model}'s max_position_embeddings {limit}"
    if not allow_long_context:
        raise OpWeaveError(f"{what} (the positions it was trained for); pass --allow-long-context to plan it anyway")
    message = f"{what}: its output past {limit} tokens is not to be trusted"
    if warn is None:
        import warnings

        warnings.warn(message, stacklevel=3)
    else:
        warn(message)


def compile_model(model: str, cluster: Cluster, tpot_slo_s: float, context: int,
                  options: SearchOptions = SearchOptions(), cost_model: CostModel = CostModel(),
                  progress: Callable[[str], None] | None = None, allow_long_context: bool = False,
                  warn: Callable[[str], None] | None = None) -> Compiled:
    fe = run_front_end(model)                                            # trace + partition blocks
    check_context(fe, context, allow_long_context, warn)                 # within the trained positions
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
    with open(config_path, encoding="utf-8") as f:
        config_text = f.read()
    with open(os.path.join(folder, "model_config.json"), "w", encoding="utf-8") as f:
        f.write(config_text)
    op_names = [op.name for op in fe.graph.ops]
    with open(os.path.join(folder, "ops.json"), "w", encoding="utf-8") as f:
        json.dump(op_names, f, indent=0)
    programs = lower(compiled.plan, fe.graph, fe.source.cfg, fe.blocks.period, fe.blocks.num_blocks, plan_hash)
    for program in programs:
        with open(os.path.join(folder, f"rank_{program.rank:02d}.json"), "w", encoding="utf-8") as f:
            json.dump(program_to_json(program), f, indent=1)
        with open(os.path.join(folder, f"rank_{program.rank:02d}.py"), "w", encoding="utf-8") as f:
            f.write(render_rank(program, op_names, compiled.plan.template, compiled.plan.num_stages))
    return sha256_text(config_text)


def write_artifact(out_dir: str, compiled: Compiled, *, force: bool = False, sign_key: bytes | None = None) -> None:
    """Writes the artifact into a temporary sibling folder, then renames it into place.

    `out_dir` must be new, empty or a previous artifact; `force` also replaces another folder
    (`opweave.outputs.check_artifact_dir`: never one holding the model). `sign_key` adds
    manifest.sig. On any error or signal the temporary folder is removed and `out_dir` is as before.
    """
    target = check_artifact_dir(out_dir, force=force, inputs=(compiled.front_end.source.path,))
    try:
        tmp = tempfile.mkdtemp(prefix=".opweave-", dir=os.path.dirname(target))
    except OSError as e:
        raise OpWeaveError(f"-o {out_dir}: cannot write the artifact ({e.strerror})") from None
    try:
        cand = compiled.result.best
        plan_text = json.dumps(plan_to_json(compiled.plan), indent=1)
        with open(os.path.join(tmp, "plan.json"), "w", encoding="utf-8") as f:
            f.write(plan_text)
        model_hash = _write_rank_programs(tmp, compiled, sha256_text(plan_text))
        with open(os.path.join(tmp, "plan.txt"), "w", encoding="utf-8") as f:
            f.write(format_plan(compiled.plan) + "\n")
        with open(os.path.join(tmp, "ir.txt"), "w", encoding="utf-8") as f:
            f.write(format_graph(compiled.front_end.graph) + "\n")
        with open(os.path.join(tmp, "trace.json"), "w", encoding="utf-8") as f:
            json.dump(chrome_trace(cand.problem, cand.result), f)
        gantt_png(cand.problem, cand.result, os.path.join(tmp, "gantt.png"))
        write_manifest(tmp, model_hash, sha256_text(plan_text), sign_key=sign_key)
        make_public(tmp)
        replace_folder(tmp, target)
    except OSError as e:  # disk full, a folder removed meanwhile: one line, nothing left behind
        remove_tree(tmp)
        raise OpWeaveError(f"-o {out_dir}: cannot write the artifact ({e.strerror or e})") from None
    except BaseException:
        remove_tree(tmp)
        raise
