"""Stage templates: cut sites, the regularity-aware family, and the stages a template makes."""

import functools
import json
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opweave.passes.trace import build_graph
from opweave.models.config import FULL, SLIDING
from opweave.models.hf_config import config_from_hf
from opweave.models.model import build_model
from opweave.models.registry import resolve
from opweave.passes.blocks import find_blocks
from opweave.passes.templates import (
    SITES, Template, build_stages, enumerate_templates, format_stages, layer_cut_sites, signature_groups,
    stages_to_json, template_by_name, template_cuts,
)


@functools.cache
def blocks_of(name: str):
    return find_blocks(build_graph(resolve(name).build("meta")))


@functools.cache
def tiny_gemma(types: tuple[str, ...]):
    cfg = config_from_hf({
        "model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 4,
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 8,
        "num_hidden_layers": len(types), "layer_types": list(types)}, "tiny")
    return find_blocks(build_graph(build_model(cfg, "meta")))


GEMMA_8 = (SLIDING,) * 5 + (FULL,) + (SLIDING,) * 2      # 1 block + 2 tail layers


def check_partition(plan, bg):
    """Stages cover every op exactly once, in order, and end at the template's cuts."""
    covered = [i for s in plan.stages for i in range(s.first, s.last + 1)]
    assert covered == list(range(len(bg.graph.ops)))
    assert [s.index for s in plan.stages] == list(range(len(plan.stages)))
    cuts = template_cuts(bg, plan.template)
    assert [s.last for s in plan.stages[:-1]] == [c.after for c in cuts]
    assert [s.out_bytes_per_token for s in plan.stages] == [c.bytes_per_token for c in cuts] + [0]
    for s in plan.stages[:-1]:
        assert s.out_bytes_per_token == bg.graph.cut_after(s.last).bytes_per_token
    assert [s.has_prologue for s in plan.stages] == [True] + [False] * (len(plan.stages) - 1)
    assert [s.has_epilogue for s in plan.stages] == [False] * (len(plan.stages) - 1) + [True]
    assert all(s.slot == s.index % plan.stages_per_block for s in plan.stages)


def check_slots(plan):
    """Every block's interior stages with the same slot have the same op structure."""
    by_slot = defaultdict(set)
    for s in plan.stages:
        if s.block is not None and not s.has_prologue and not s.has_epilogue:
            by_slot[s.slot].add(s.signature)
    assert all(len(sigs) == 1 for sigs in by_slot.values()), {k: len(v) for k, v in by_slot.items()}


# ---------------------------------------------------------------- sites and family


@pytest.mark.parametrize("name,size,groups", [
    ("gemma-3-27b", 256, ("S", "F")),
    ("qwen3-next-80b-a3b", 256, ("L", "F")),
    ("llama-3.1-8b", 16, ("F",)),
])
@pytest.mark.slow
def test_family_sizes(name, size, groups):
    bg = blocks_of(name)
    family = enumerate_templates(bg)
    assert len(family) == size
    assert tuple(g.label for g in signature_groups(bg)) == groups
    assert all(g.sites == SITES for g in signature_groups(bg))
    assert len({t.sites for t in family}) == size and len({t.name for t in family}) == size
    names = {t.name: t for t in family}
    for named in ("colocated", "afd", "cad"):
        (t,) = enumerate_templates(bg, named)
        assert t.family == named and names[named] == t
        assert template_by_name(bg, named) == t
    assert family[0].name == "colocated"
    keys = [(t.num_cuts_per_block, t.name) for t in family[1:]]
    assert keys == sorted(keys)
    for t in family[::17]:
        assert template_by_name(bg, t.name) == t


def test_sites_per_layer():
    bg = blocks_of("gemma-3-27b")
    sites = layer_cut_sites(bg)
    assert all(set(s) == set(SITES) for s in sites[:-1])
    assert set(sites[-1]) == {"pre_attn", "post_attn", "mid"}   # its end is the epilogue's boundary
    ops = bg.graph.ops
    layer0 = sites[0]
    assert ops[layer0["pre_attn"].after + 1].kind.value == "attn_sliding"
    assert ops[layer0["post_attn"].after].kind.value == "attn_sliding"
    assert ops[layer0["mid"].after].name.endswith("mixer.residual")
    assert ops[layer0["end"].after].name.endswith("ffn.residual")
    embed_cut = bg.graph.cuts[0]
    assert embed_cut.after == bg.prologue.last
    assert all(c.after != embed_cut.after for s in sites for c in s.values())


def test_template_regularity_and_names():
    bg = blocks_of("gemma-3-27b")
    t = template_by_name(bg, "S:pre_attn+post_attn|F:mid+end")
    assert t.family == "general" and t.num_cuts_per_block == 5 * 2 + 2
    assert t.sites[:5] == (frozenset({"pre_attn", "post_attn"}),) * 5 and t.sites[5] == {"mid", "end"}
    assert template_by_name(bg, "S:mid+end|F:mid+end").name == "afd"
    for bad in ("S:attn|F:-", "S:-", "X:-|F:-", "S:-|S:-|F:-", "nope"):
        with pytest.raises(ValueError):
            template_by_name(bg, bad)
    with pytest.raises(ValueError):
        enumerate_templates(bg, "pipeline")
    for t in enumerate_templates(bg):
        assert len(set(t.sites[:5])) == 1     # the five sliding positions share one site set


# ---------------------------------------------------------------- stages


@pytest.mark.parametrize("name", ["gemma-3-27b", "qwen3-next-80b-a3b", "llama-3.1-8b"])
def test_named_templates_partition(name):
    bg = blocks_of(name)
    for family in ("colocated", "afd", "cad"):
        plan = build_stages(bg, template_by_name(bg, family))
        check_partition(plan, bg)
        check_slots(plan)
    (colocated,) = build_stages(bg, template_by_name(bg, "colocated")).stages
    assert (colocated.first, colocated.last, colocated.out_bytes_per_token) == (0, len(bg.graph.ops) - 1, 0)


@pytest.mark.parametrize("name,afd,cad", [
    ("gemma-3-27b", 124, 125), ("qwen3-next-80b-a3b", 96, 97), ("llama-3.1-8b", 64, 65)])
def test_afd_cad_stage_counts(name, afd, cad):
    bg = blocks_of(name)
    assert len(build_stages(bg, template_by_name(bg, "afd")).stages) == afd
    assert len(build_stages(bg, template_by_name(bg, "cad")).stages) == cad


def test_llama_afd_and_cad():
    bg = blocks_of("llama-3.1-8b")
    ops = bg.graph.ops
    afd = build_stages(bg, template_by_name(bg, "afd"))
    assert afd.stages_per_block == 2
    attn_half, ffn_half = afd.stages[2], afd.stages[3]
    assert attn_half.layers == (1,) and ops[attn_half.last].name.endswith("mixer.residual")
    assert ffn_half.layers == (1,) and ops[ffn_half.last].name.endswith("ffn.residual")
    assert afd.stages[-1].layers == (31,) and ops[afd.stages[-1].last].kind.value == "sample"
    cad = build_stages(bg, template_by_name(bg, "cad"))
    kinds = [[op.kind.value for op in ops[s.first:s.last + 1]] for s in cad.stages]
    assert kinds[0][0] == "embed" and kinds[0][-1] == "rope"                     # rest_0 with the embedding
    assert all(k == ["attn_full"] for k in kinds[1::2])                          # attn_0 .. attn_31
    assert kinds[2][0] == "o_proj" and kinds[2][-1] == "rope"                    # o_proj .. next layer's rope
    assert kinds[-1][0] == "o_proj" and kinds[-1][-1] == "sample"                # rest_32 with the head
    assert [s.slot for s in cad.stages[:4]] == [0, 1, 0, 1]
    assert cad.stages[2].layers == (0, 1) and cad.stages[2].block == 1
    assert {s.signature for s in cad.stages[2:-1:2]} == {cad.stages[2].signature}


def test_tiny_gemma_tail():
    bg = tiny_gemma(GEMMA_8)
    assert (bg.period, bg.num_blocks, bg.num_tail_layers) == (6, 1, 2)
    plan = build_stages(bg, template_by_name(bg, "afd"))
    check_partition(plan, bg)
    # block 0: 12 cuts; tail layers 6, 7: mid, end, mid (layer 7's end is the epilogue boundary)
    assert len(plan.stages) == 12 + 3 + 1 and plan.stages_per_block == 12
    assert [s.block for s in plan.stages] == [0] * 12 + [None] * 4
    assert [s.layers for s in plan.stages[12:]] == [(6,), (6,), (7,), (7,)]
    assert [s.slot for s in plan.stages[12:]] == [0, 1, 2, 3]
    # tail stages repeat block positions 0 and 1: same structure as the block's stages of that slot
    assert [s.signature for s in plan.stages[13:15]] == [s.signature for s in plan.stages[1:3]]
    text = format_stages(plan)
    assert "16 stage(s), 12 per block" in text and "tail layers: stage(s) 12, 13, 14, 15" in text
    data = json.loads(json.dumps(stages_to_json(plan)))
    assert data["num_stages"] == 16 and data["template"]["name"] == "afd"
    assert data["stages"][-1]["has_epilogue"] and data["stages"][0]["has_prologue"]


def test_format_and_json_cad_gemma():
    bg = blocks_of("gemma-3-27b")
    plan = build_stages(bg, template_by_name(bg, "cad"))
    text = format_stages(plan)
    assert text.splitlines()[0] == ("Stages of gemma-3-27b with template cad (cad): 125 stage(s), 12 per block")
    assert "slot 11 (stage 11, layer 5, 1 ops" in text and "attn_full" in text
    data = stages_to_json(plan)
    assert data["stages_per_block"] == 12 and len(data["stages"]) == 125
    assert data["template"]["sites"] == [["pre_attn", "post_attn"]] * 6


def test_every_gemma_template_partitions():
    bg = blocks_of("gemma-3-27b")
    seen = set()
    for t in enumerate_templates(bg)[::5]:
        plan = build_stages(bg, t)
        check_partition(plan, bg)
        check_slots(plan)
        seen.add(tuple(s.last for s in plan.stages))
    assert len(seen) == len(enumerate_templates(bg)[::5])       # different templates, different stages


def test_template_must_match_period():
    bg = blocks_of("llama-3.1-8b")
    with pytest.raises(ValueError):
        build_stages(bg, Template(name="x", family="general", sites=(frozenset(),) * 2))


# ---------------------------------------------------------------- random layer patterns


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.lists(st.sampled_from([FULL, SLIDING]), min_size=1, max_size=4), repeats=st.integers(1, 3),
       extra=st.integers(0, 3), data=st.data())
@pytest.mark.slow
def test_random_patterns_and_templates(base, repeats, extra, data):
    types = base * repeats + base[:extra]          # several blocks, sometimes tail layers
    bg = tiny_gemma(tuple(types))
    family = enumerate_templates(bg)
    groups = signature_groups(bg)
    size = 1
    for g in groups:
        size *= 2 ** len(g.sites)
    assert len(family) == size and len({t.sites for t in family}) == size
    assert {"colocated", "afd", "cad"} <= {t.name for t in family}
    for t in data.draw(st.lists(st.sampled_from(family), min_size=1, max_size=4)):
        plan = build_stages(bg, t)
        check_partition(plan, bg)
        check_slots(plan)
        assert plan.stages_per_block == max(t.num_cuts_per_block, 1)
        tail_start = bg.num_blocks * bg.period
        for s in plan.stages:
            end_layer = bg.graph.ops[s.last].layer
            if s.block is not None:
                assert end_layer // bg.period == s.block and end_layer < tail_start
        assert template_by_name(bg, t.name) == t
