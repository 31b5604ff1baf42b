"""Every plan the planner can emit runs: small random plans drawn from the real search space.

For each family a plan is drawn from what the search enumerates: a template of
`enumerate_templates`, a number of owners that divides its stages per block, and per owner a GPU
type (h100 / l40s), a TP degree the TP table allows for the owner's ops (TP > KV heads included:
the tiny configs have 2 KV heads and TP 4 is drawn) and a replica count, then microbatches. The
plan is built with `pinned_plan`, written as an artifact, run on CPU ranks and must generate
transformers' greedy tokens. Worlds stay at most 6 ranks (2-core CI); the draws are derandomized.
Every choice list starts with its richest option (the last templates, most owners, TP 4, two
microbatches, the owners alternating GPU types), so the first, simplest draw is the most demanding
plan; the next ones are random.
"""

import functools

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from hf_fixtures import hf_generate
from opweave.compiler.compile import write_artifact
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.ir.tp import expert_layouts
from opweave.passes.space import slot_of
from opweave.passes.templates import build_stages, enumerate_templates
from opweave.runtime.launch import RunConfig, run
from opweave.runtime.scheduler import Request

LAYERS = {"llama": 2, "gemma3": 2, "qwen3_moe": 2, "qwen3_next": 4}
OVERRIDES = {"qwen3_next": {"linear_num_key_heads": 4, "linear_num_value_heads": 8}}
"""Qwen3-Next's tiny linear layers get 4 key heads so TP 4 (over 2 full-attention KV heads) is legal."""
PROMPTS = [[(5 * i + 2) % 90 for i in range(9)], [3, 1, 4, 1, 5], [27]]
NEW_TOKENS = 3
MAX_RANKS = 6
GPUS = ("h100", "l40s")
BATCH = 4


@functools.cache
def reference(folder: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_generate(folder, p, NEW_TOKENS)[1]) for p in PROMPTS)


def _owner_counts(stage_plan) -> list[int]:
    """Owner counts the search pairs with a stage plan: k divides the stages per block (one owner
    takes every stage only of a one-cut-per-block template), at most 3 on <= 6 ranks."""
    spb = stage_plan.stages_per_block
    return [k for k in (1, 2, 3) if (k == 1 and (len(stage_plan.stages) == 1 or spb == 1))
            or (k > 1 and spb % k == 0)]


@st.composite
def plans(draw, fe):
    """(template name, owners [(gpu, tp, replicas, expert layout)], microbatches) from the search space."""
    plans = [build_stages(fe.blocks, t) for t in enumerate_templates(fe.blocks, "all")]
    plans = [p for p in plans if _owner_counts(p)]
    stage_plan = draw(st.sampled_from(plans[::-1]))
    template, spb = stage_plan.template, stage_plan.stages_per_block
    k = draw(st.sampled_from(_owner_counts(stage_plan)[::-1]))
    microbatches = draw(st.sampled_from((2, 1)))
    owners, ranks = [], 0
    for slot in range(k):
        ops = [op for s in stage_plan.stages if slot_of(s.index, spb, k) == slot
               for op in fe.graph.ops[s.first:s.last + 1]]
        room = MAX_RANKS - ranks - (k - slot - 1)  # leave one rank for each owner still to draw
        tp = draw(st.sampled_from([t for t in (4, 2, 1) if t <= room and expert_layouts(ops, t)]))
        layout = draw(st.sampled_from(expert_layouts(ops, tp)[::-1]))   # routed experts: "ep" first
        replicas = draw(st.sampled_from([r for r in (2, 1) if r * tp <= room and r * microbatches <= BATCH]))
        owners.append((draw(st.sampled_from(GPUS[slot % 2:] + GPUS[:slot % 2])), tp, replicas, layout))
        ranks += tp * replicas
    return template.name, owners, microbatches


@pytest.mark.parametrize("family", list(LAYERS))
@pytest.mark.slow
def test_random_plans_generate_reference_tokens(tiny_checkpoint, tmp_path_factory, family):
    folder = tiny_checkpoint(family, num_hidden_layers=LAYERS[family], **OVERRIDES.get(family, {}))
    fe = run_front_end(folder)
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    expected = list(reference(folder))
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=NEW_TOKENS) for i, p in enumerate(PROMPTS))

    @settings(max_examples=2, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(plans(fe))
    def check(drawn):
        template, owners, microbatches = drawn
        note(f"{family}: {drawn}")
        compiled = pinned_plan(fe, cluster, template, owners, batch=BATCH, microbatches=microbatches, context=32)
        out = str(tmp_path_factory.mktemp("plan") / "art")
        write_artifact(out, compiled)
        outputs = run(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests, timeout_s=300))
        assert [tuple(r.output) for r in outputs] == expected, drawn

    check()
