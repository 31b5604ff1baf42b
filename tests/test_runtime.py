"""Compiled plans run on CPU ranks (gloo) and generate exactly transformers' greedy tokens.

Every family runs under colocated, AFD, CAD and an OpWeave multi-stage template, each with two
GPU types, TP 2 on one owner, several replicas and two microbatches; prompts of different lengths
(one longer than Gemma's sliding window) fill 4 batch slots, so slots are refilled.
"""

import functools
import os

import pytest

from hf_fixtures import hf_generate
from opweave.compiler.compile import write_artifact
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.passes.templates import enumerate_templates
from opweave.runtime.launch import RunConfig, run, run_detailed
from opweave.runtime.scheduler import Request

PROMPTS = [[(7 * i + 3) % 100 for i in range(20)], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [42],
           [60, 61, 62, 63, 64, 65]]
NEW_TOKENS = 6
CONTEXT = 64
LAYERS = {"llama": 3, "gemma3": 8, "qwen3_moe": 3, "qwen3_next": 5}
PLANS = {
    "colocated": [("h100", 2, 2)],
    "afd": [("h100", 1, 1), ("l40s", 2, 1)],
    "cad": [("l40s", 2, 1), ("h100", 1, 2)],
    "opweave": [("h100", 2, 1), ("l40s", 1, 2)],
}


@functools.cache
def reference(folder: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_generate(folder, p, NEW_TOKENS)[1]) for p in PROMPTS)


def general_template(fe) -> str:
    """The first OpWeave template (not a named one) with an even number of stages per block."""
    return next(t.name for t in enumerate_templates(fe.blocks, "all")
                if t.family == "general" and t.num_cuts_per_block % 2 == 0)


def compile_pinned(folder: str, plan: str, out: str) -> None:
    fe = run_front_end(folder)
    template = general_template(fe) if plan == "opweave" else plan
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    compiled = pinned_plan(fe, cluster, template, PLANS[plan], batch=4, microbatches=2, context=CONTEXT)
    write_artifact(out, compiled)


def requests():
    return tuple(Request(index=i, prompt=p, max_new_tokens=NEW_TOKENS) for i, p in enumerate(PROMPTS))


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("family", list(LAYERS))
@pytest.mark.slow
def test_plan_generates_reference_tokens(tiny_checkpoint, tmp_path, monkeypatch, family, plan):
    """Token parity; and every rank runs its decode rounds under `NoHostSync` (OPWEAVE_CHECK_SYNC):
    no round that decodes reads a tensor on the host, so it could be captured in a CUDA graph."""
    folder = tiny_checkpoint(family, num_hidden_layers=LAYERS[family])
    out = str(tmp_path / "art")
    compile_pinned(folder, plan, out)
    monkeypatch.setenv("OPWEAVE_CHECK_SYNC", "1")
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests(),
                                            timeout_s=300))
    assert min(stats["checked_rounds"]) >= NEW_TOKENS - 2, stats["checked_rounds"]  # every rank, several rounds
    assert [r.index for r in outputs] == list(range(len(PROMPTS)))
    assert all(r.error is None for r in outputs)
    assert [tuple(r.output) for r in outputs] == list(reference(folder))


@pytest.mark.slow
def test_interpreter_agrees_with_generated_modules(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3_next", num_hidden_layers=LAYERS["qwen3_next"])
    out = str(tmp_path / "art")
    compile_pinned(folder, "opweave", out)
    interpreted = run(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests(), interpret=True))
    assert [tuple(r.output) for r in interpreted] == list(reference(folder))


@pytest.mark.slow
def test_generated_module_benchmarks_alone(tiny_checkpoint, tmp_path):
    import subprocess
    import sys

    out = str(tmp_path / "art")
    compile_pinned(tiny_checkpoint("llama", num_hidden_layers=3), "cad", out)
    proc = subprocess.run([sys.executable, os.path.join(out, "rank_00.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "ms per decode round" in proc.stdout


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.slow
def test_triton_kernel_path_generates_reference_tokens(tiny_checkpoint, tmp_path, monkeypatch, family):
    """The CUDA path's kernels (Triton, here under TRITON_INTERPRET=1 on CPU) give the same tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("OPWEAVE_KERNELS", "triton")
    folder = tiny_checkpoint(family, num_hidden_layers=LAYERS[family])
    out = str(tmp_path / "art")
    compile_pinned(folder, "afd", out)
    short = tuple(Request(index=i, prompt=p, max_new_tokens=3) for i, p in enumerate(PROMPTS[:2]))
    outputs = run(RunConfig(artifact=out, weights=folder, device="cpu", requests=short, timeout_s=300))
    assert [tuple(r.output) for r in outputs] == [t[:3] for t in reference(folder)[:2]]


@pytest.mark.slow
def test_several_replica_sets_share_the_requests(tiny_checkpoint, tmp_path, capsys):
    from opweave.cli import main
    from opweave.runtime.launch import planned_replica_sets, run_detailed

    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    out = str(tmp_path / "art")
    compile_pinned(folder, "afd", out)
    assert planned_replica_sets(out) >= 2
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests(),
                                            replica_sets=2, timeout_s=300))
    assert [r.index for r in outputs] == list(range(len(PROMPTS)))
    assert [tuple(r.output) for r in outputs] == list(reference(folder))
    assert len(stats["replica_sets"]) == 2 and stats["round_s"] == stats["replica_sets"][0]["round_s"]
    assert main(["run", out, "--weights", folder, "--prompt-ids", "1,2", "--replica-sets", "99"]) == 2
    assert "the plan places" in capsys.readouterr().err
    assert main(["run", out, "--weights", folder, "--prompt-ids", "1,2", "--replica-sets", "two"]) == 2


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
@pytest.mark.slow
def test_chunked_prefill_across_ranks_generates_reference_tokens(tiny_checkpoint, tmp_path, family):
    """The plan's prefill chunk reaches every rank: prompts longer than the chunk (and than Gemma's
    sliding window) are fed over several steps through a CAD split with TP 2 and still give
    transformers' tokens."""
    import dataclasses

    folder = tiny_checkpoint(family, num_hidden_layers=LAYERS[family])
    fe = run_front_end(folder)
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    compiled = pinned_plan(fe, cluster, "cad", PLANS["cad"], batch=4, microbatches=2, context=CONTEXT)
    compiled = dataclasses.replace(compiled, plan=dataclasses.replace(compiled.plan, prefill_chunk=3))
    out = str(tmp_path / "art")
    write_artifact(out, compiled)
    import json

    programs = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.startswith("rank_")
                and f.endswith(".json")]
    assert programs and all(p["prefill_chunk"] == 3 for p in programs)
    outputs = run(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests(), timeout_s=300))
    assert all(r.error is None for r in outputs)
    assert [tuple(r.output) for r in outputs] == list(reference(folder))
