"""`opweave compile`: the pipeline's drivers and the artifact writer.

    compile_model      pipeline steps trace .. plan (`compiler/pipeline.py`): MODEL -> OpGraph ->
                       blocks -> search -> placement -> Plan
    make_plan          the best candidate, placed, as a Plan (the search's figures and the schedule's inputs)
    write_artifact     steps lower and render, then plan.json, plan.txt, ir.txt, trace.json,
                       gantt.png, rank programs and modules, manifest.json (into a temp folder, then renamed)
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Callable

from opweave.artifact import sha256_text, write_info, write_manifest
from opweave.compiler.frontend import FrontEnd
from opweave.cost.model import CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.ir.graph import format_graph
from opweave.ir.plan import PLAN_FORMAT, Plan, PlanOwner, PlanStage, Predicted, format_plan, plan_to_json
from opweave.ir.program import RankProgram, program_to_json
from opweave.outputs import check_artifact_dir, make_public, remove_tree, replace_folder
from opweave.passes import placement
from opweave.passes.carry import round_robin, send_bytes_per_token
from opweave.passes.lower import lower
from opweave.passes.placement import Placement
from opweave.passes.search import Candidate, SearchOptions, SearchResult, owner_groups, slot_of
from opweave.passes.trace_export import write_schedule
from opweave.models.activation import PREFILL_CHUNK


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A compile up to its plan (`compiler/pipeline.py` steps trace .. plan); `write_artifact`
    runs the remaining steps (lower, render)."""

    front_end: FrontEnd
    result: SearchResult
    plan: Plan
    steps: tuple[str, ...] = ()      # pipeline steps run so far (named in verifier failures)


def place(cand: Candidate, cluster: Cluster) -> Placement:
    """The candidate's replica sets on the cluster's nodes (`passes/placement.py`: first fit,
    TP groups inside a node, cost independent of the cluster's size); one-line error when not
    even one set fits."""
    where = placement.place(owner_groups(cand.owners), cluster)
    if where.num_sets == 0:
        raise OpWeaveError(f"the plan's TP groups do not fit inside the nodes of {cluster.spec}")
    return where


def make_plan(fe: FrontEnd, cluster: Cluster, context: int, tpot_slo_s: float, result: SearchResult,
              where: Placement | None = None, prefill_chunk: int = PREFILL_CHUNK) -> Plan:
    """The Plan of `result.best` placed on `cluster` (`where`, or placed here), with the schedule's
    inputs (stage compute and send times, prices, the return) so it can be simulated again alone."""
    cand = result.best
    where = place(cand, cluster) if where is None else where
    sets = where.num_sets
    set0 = where.replica_set(0)  # what the runtime deploys; set k is where.replica_set(k)
    k = len(cand.owners)
    sim, problem = cand.result, cand.problem
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
                             experts=o.experts)
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
                predicted=predicted, counters=dataclasses.asdict(result.counters), return_s=problem.return_s,
                return_bytes=problem.return_bytes, return_inter_node=problem.return_inter_node,
                prefill_chunk=prefill_chunk)


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
                  warn: Callable[[str], None] | None = None, prefill_chunk: int = PREFILL_CHUNK) -> Compiled:
    """Runs the pipeline's steps trace .. plan (`compiler/pipeline.py`). `prefill_chunk`: prompt
    tokens per row per step at run time, which sizes the planned activations."""
    from opweave.compiler import pipeline

    state = pipeline.State(model=model, cluster=cluster, tpot_slo_s=tpot_slo_s, context=context, options=options,
                           cost_model=cost_model, progress=progress, allow_long_context=allow_long_context, warn=warn,
                           prefill_chunk=prefill_chunk)
    pipeline.run(state, last="plan")
    return state.compiled()


def plan_text(plan: Plan) -> str:
    """plan.json's text (its sha256 is the plan hash every rank program carries)."""
    return json.dumps(plan_to_json(plan), indent=1)


def lower_plan(plan: Plan, fe: FrontEnd, plan_hash: str) -> tuple[RankProgram, ...]:
    """One rank program per rank of replica set 0 (none for a model.py model, which `opweave run`
    cannot load)."""
    if fe.source.kind == "file":
        return ()
    return lower(plan, fe.graph, fe.blocks.period, fe.blocks.num_blocks, plan_hash,
                 fe.blocks.num_head_layers)


def _write(folder: str, name: str, text: str) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        f.write(text)


def _write_rank_programs(folder: str, fe: FrontEnd, programs, modules: dict[str, str]) -> str:
    """Writes model_config.json, ops.json, rank_XX.json and rank_XX.py. Returns the model hash
    ("" for a model.py model, which `opweave run` cannot load)."""
    if fe.source.kind == "file":
        return ""
    config_path = fe.source.path if fe.source.kind == "builtin" else os.path.join(fe.source.path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config_text = f.read()
    _write(folder, "model_config.json", config_text)
    _write(folder, "ops.json", json.dumps([op.name for op in fe.graph.ops], indent=0))
    for program in programs:
        _write(folder, f"rank_{program.rank:02d}.json", json.dumps(program_to_json(program), indent=1))
        _write(folder, f"rank_{program.rank:02d}.py", modules[f"rank_{program.rank:02d}.py"])
    return sha256_text(config_text)


def write_artifact(out_dir: str, compiled: Compiled, *, force: bool = False, sign_key: bytes | None = None) -> None:
    """Runs the pipeline's last steps (lower, render) and writes the artifact into a temporary
    sibling folder, then renames it into place.

    Every file is a function of the plan and the model: identical compiles give identical
    folders, but for compile-info.json (`opweave/artifact.py`). trace.json and gantt.png are drawn
    from the Plan alone (`passes/trace_export.py write_schedule`). `out_dir` must be new, empty or
    a previous artifact; `force` also replaces another folder (`opweave.outputs.check_artifact_dir`:
    never one holding the model). `sign_key` adds manifest.sig. On any error or signal the
    temporary folder is removed and `out_dir` is as before.
    """
    from opweave.compiler import pipeline

    target = check_artifact_dir(out_dir, force=force, inputs=(compiled.front_end.source.path,))
    state = pipeline.State.of(compiled)
    pipeline.run(state, first="lower", last="render")
    try:
        tmp = tempfile.mkdtemp(prefix=".opweave-", dir=os.path.dirname(target))
    except OSError as e:
        raise OpWeaveError(f"-o {out_dir}: cannot write the artifact ({e.strerror})") from None
    try:
        fe = compiled.front_end
        _write(tmp, "plan.json", state.plan_text)
        model_hash = _write_rank_programs(tmp, fe, state.programs, state.modules)
        _write(tmp, "plan.txt", format_plan(compiled.plan) + "\n")
        _write(tmp, "ir.txt", format_graph(fe.graph) + "\n")
        write_schedule(compiled.plan, os.path.join(tmp, "trace.json"), os.path.join(tmp, "gantt.png"))
        write_manifest(tmp, model_hash, sha256_text(state.plan_text), sign_key=sign_key)
        write_info(tmp, compiled.result.seconds)
        make_public(tmp)
        replace_folder(tmp, target)
    except OSError as e:  # disk full, a folder removed meanwhile: one line, nothing left behind
        remove_tree(tmp)
        raise OpWeaveError(f"-o {out_dir}: cannot write the artifact ({e.strerror or e})") from None
    except BaseException:
        remove_tree(tmp)
        raise
