"""`opweave compile`: the drivers of the pipeline and the artifact writer.

    compile_model      steps trace .. plan (`compiler/pipeline.py`): MODEL -> OpGraph -> blocks ->
                       search -> placement -> Plan
    write_artifact     steps lower and render, then plan.json, plan.txt, ir.txt, trace.json,
                       gantt.png, rank programs and modules, manifest.json (into a temp folder, then renamed)

Both return or take the compile's record, `Compiled` (`compiler/pipeline.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Callable

from opweave.artifact import sha256_text, write_info, write_manifest
from opweave.compiler import pipeline
from opweave.compiler.frontend import FrontEnd
from opweave.compiler.inputs import Inputs
from opweave.compiler.pipeline import Compiled
from opweave.cost.model import CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.ir.graph import format_graph
from opweave.ir.plan import PREFILL_CHUNK, format_plan
from opweave.ir.program import program_to_json
from opweave.ir.workload import Workload
from opweave.outputs import check_artifact_dir, remove_tree, replace_folder, set_artifact_modes
from opweave.passes.search import SearchOptions
from opweave.passes.trace_export import write_schedule


def compile_model(model: str, cluster: Cluster, tpot_slo_s: float, context: int,
                  options: SearchOptions = SearchOptions(), cost_model: CostModel = CostModel(),
                  progress: Callable[[str], None] | None = None, allow_long_context: bool = False,
                  warn: Callable[[str], None] | None = None, prefill_chunk: int = PREFILL_CHUNK,
                  front_end: FrontEnd | None = None, workload: Workload | None = None,
                  kv_cache_dtype: str = "auto") -> Compiled:
    """Runs the pipeline's steps trace .. plan (`compiler/pipeline.py`).

    `prefill_chunk`: prompt tokens per row per step at run time, which sizes the planned
    activations. `front_end`: `model`'s front end (`run_front_end`) when the caller has it already;
    the compile then starts at the search and does not trace again. `workload`: the traffic to
    plan for (`ir/workload.py`: prompt and output tokens, TTFT SLO, rate, prefill mode; the plan
    then carries its prefill arrangement, TTFT and TPOT under it); None plans decode alone.
    `kv_cache_dtype`: "fp8" keeps attention's keys and values in float8 e4m3 (half a bf16 cache's
    bytes, `ModelConfig.kv_cache_dtype`); every GPU type of the cluster must support it.
    """
    from opweave.kernels.targets import fp8_kv_supported
    from opweave.models.config import KV_CACHE_DTYPES

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise OpWeaveError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8":
        lacking = sorted({p.gpu.name for p in cluster.pools if not fp8_kv_supported(p.gpu.name)})
        if lacking:
            raise OpWeaveError(f"--kv-cache-dtype fp8 needs float8 conversions (compute capability 8.9 or later: "
                               f"L40S, L4, H100, H200, B200); {', '.join(lacking)} cannot keep an fp8 KV cache")
    if front_end is not None and front_end.inputs.kv_cache_dtype != kv_cache_dtype:
        raise ValueError(f"front_end traced with kv_cache_dtype {front_end.inputs.kv_cache_dtype!r}, "
                         f"not {kv_cache_dtype!r}")
    inputs = Inputs(model=model, dtype=None if front_end is None else front_end.inputs.dtype, cluster=cluster,
                    kv_cache_dtype=kv_cache_dtype,
                    tpot_slo_s=tpot_slo_s, context=context, prefill_chunk=prefill_chunk, workload=workload,
                    options=options,
                    cost_model=cost_model, allow_long_context=allow_long_context, progress=progress, warn=warn)
    if front_end is None:
        return pipeline.run(Compiled(inputs=inputs), last="plan")
    if front_end.steps != ("trace", "blocks"):
        raise ValueError(f"front_end: a record after trace and blocks, not after {', '.join(front_end.steps)}")
    return pipeline.run(dataclasses.replace(front_end, inputs=inputs), first="search", last="plan")


def _write(folder: str, name: str, text: str) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        f.write(text)


def _write_rank_programs(folder: str, c: Compiled) -> str:
    """Writes model_config.json, ops.json, rank_XX.json and rank_XX.py. Returns the model hash
    ("" for a model.py model, which `opweave run` cannot load)."""
    if c.source.kind == "file":
        return ""
    config_path = c.source.path if c.source.kind == "builtin" else os.path.join(c.source.path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config_text = f.read()
    _write(folder, "model_config.json", config_text)
    _write(folder, "ops.json", json.dumps([op.name for op in c.graph.ops], indent=0))
    for program in c.programs:
        _write(folder, f"rank_{program.rank:02d}.json", json.dumps(program_to_json(program), indent=1))
        _write(folder, f"rank_{program.rank:02d}.py", c.modules[f"rank_{program.rank:02d}.py"])
    return sha256_text(config_text)


PREFILL_ROWS = 4
"""Rows of a prefill set's colocated program (prompts it prefills at once, one microbatch)."""


def prefill_pool(done: Compiled) -> Compiled | None:
    """A disaggregated plan's prefill pool as a program of its own: the colocated plan of one TP
    group of the pool's GPUs (plan.json "prefill" owners), at the plan's context, lowered and
    rendered; its ranks are the artifact's `prefill_rank_XX` files (`opweave.runtime.pd`). None
    for any other plan or a model.py model."""
    from opweave.compiler.pinned import pinned_plan

    pre = done.plan.prefill
    if not pre or pre.get("mode") != "disaggregated" or done.source.kind == "file":
        return None
    owner = pre["owners"][0]
    last = None
    for rows in (PREFILL_ROWS, 1):  # fewer rows where four do not fit the pool's memory
        try:
            pool = pinned_plan(done, done.inputs.cluster, "colocated", [(owner["gpu"], owner["tp"], 1)], batch=rows,
                               microbatches=1, context=done.inputs.context, prefill_chunk=done.inputs.prefill_chunk)
            break
        except OpWeaveError as e:
            last = e
    else:
        raise OpWeaveError(f"the prefill pool ({owner['gpu']} tp{owner['tp']}) cannot hold one prompt's program: {last}")
    return pipeline.run(pool, first="lower", last="render")


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
    target = check_artifact_dir(out_dir, force=force, inputs=(compiled.source.path,))
    done = pipeline.run(compiled, first="lower", last="render")
    pool = prefill_pool(done)
    if compiled.inputs.progress is not None:
        compiled.inputs.progress("writing the artifact (plan, rank modules, trace.json, gantt.png, manifest)")
    try:
        tmp = tempfile.mkdtemp(prefix=".opweave-", dir=os.path.dirname(target))
    except OSError as e:
        raise OpWeaveError(f"-o {out_dir}: cannot write the artifact ({e.strerror})") from None
    try:
        _write(tmp, "plan.json", done.plan_text)
        model_hash = _write_rank_programs(tmp, done)
        if pool is not None:  # a disaggregated plan's prefill ranks
            _write(tmp, "prefill_plan.json", pool.plan_text)
            for program in pool.programs:
                _write(tmp, f"prefill_rank_{program.rank:02d}.json", json.dumps(program_to_json(program), indent=1))
                _write(tmp, f"prefill_rank_{program.rank:02d}.py", pool.modules[f"rank_{program.rank:02d}.py"])
        _write(tmp, "plan.txt", format_plan(done.plan) + "\n")
        _write(tmp, "ir.txt", format_graph(done.graph) + "\n")
        write_schedule(done.plan, os.path.join(tmp, "trace.json"), os.path.join(tmp, "gantt.png"))
        write_manifest(tmp, model_hash, sha256_text(done.plan_text), sign_key=sign_key)
        write_info(tmp, done.result.seconds)
        set_artifact_modes(tmp, private=sign_key is not None)
        replace_folder(tmp, target)
    except OSError as e:  # disk full, a folder removed meanwhile: one line, nothing left behind
        remove_tree(tmp)
        raise OpWeaveError(f"-o {out_dir}: cannot write the artifact ({e.strerror or e})") from None
    except BaseException:
        remove_tree(tmp)
        raise
