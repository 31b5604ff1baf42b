"""What crosses a cut (`passes/carry.py`): bytes per boundary against hand counts, the rule against
a plain re-implementation, and the kept-value path through lowering, the verifier, codegen and a
multi-rank run with transformers' tokens."""

import dataclasses
import functools
import json
import os
import random

import pytest

from opweave.ir.graph import IRError
from opweave.ir.verify import verify_programs
from opweave.passes.trace import build_graph
from opweave.models.registry import resolve
from opweave.passes.blocks import find_blocks
from opweave.passes.carry import (
    carry, format_carry, held_bytes_per_token, plan_carry, round_robin, send_bytes_per_token, send_values,
    value_bytes_per_token,
)
from opweave.passes.templates import build_stages, enumerate_templates, layer_cut_sites, template_by_name

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "opweave", "models", "configs")
BF16 = 2   # bytes per element


@functools.cache
def blocks_of(name: str):
    return find_blocks(build_graph(resolve(name).build("meta")))


@functools.cache
def stages_of(name: str, template: str):
    bg = blocks_of(name)
    return build_stages(bg, template_by_name(bg, template))


def config(name: str) -> dict:
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        return json.load(f)


def site_after(plan, i: int) -> str:
    """The cut site (pre_attn | post_attn | mid | end) that ends stage i."""
    bg = plan.blocked
    last = plan.stages[i].last
    layer = bg.graph.ops[last].layer
    (site,) = [s for s, cut in layer_cut_sites(bg)[layer].items() if cut.after == last]
    return site


def bytes_by_site(plan, owners) -> dict[str, set[int]]:
    sent = send_bytes_per_token(plan, owners)
    out: dict[str, set[int]] = {}
    for i in range(len(plan.stages) - 1):
        out.setdefault(site_after(plan, i), set()).add(sent[i])
    return out


# ---------------------------------------------------------------- hand counts


@pytest.mark.slow
def test_llama_cad_sends_qkv_to_attention_and_gets_its_output_back():
    # Llama-3.1-8B: hidden 4096, 32 q heads, 8 kv heads, head dim 128, bf16
    cfg = config("llama-3.1-8b")
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4096, 32, 8)
    assert cfg["torch_dtype"] == "bfloat16" and cfg["hidden_size"] // cfg["num_attention_heads"] == 128
    qkv = (32 + 8 + 8) * 128 * BF16     # 12288 B/token to the core-attention owner
    attn_out = 32 * 128 * BF16          # 8192 B/token back
    residual = 4096 * BF16              # 8192 B/token: stays on the owner that reads it next
    plan = stages_of("llama-3.1-8b", "cad")
    owners = round_robin(plan, 2)
    assert bytes_by_site(plan, owners) == {"pre_attn": {12288}, "post_attn": {8192}}
    assert (qkv, attn_out) == (12288, 8192)
    carried = plan_carry(plan, owners)
    for i, stage in enumerate(plan.stages[:-1]):
        cut = plan.blocked.graph.cut_after(stage.last)
        assert carried.sent_bytes_per_token[i] + residual == cut.bytes_per_token   # before: every live value
        (kept,) = carried.kept[i]
        assert kept == "model.embed" or kept.endswith("ffn.residual")              # the residual stream
    assert send_bytes_per_token(plan, owners)[-1] == 0 and send_values(plan, owners)[-1] == ()
    assert sum(carried.sent_bytes_per_token) == 32 * (qkv + attn_out)


def test_llama_afd_carries_the_residual_only():
    plan = stages_of("llama-3.1-8b", "afd")
    owners = round_robin(plan, 2)
    assert bytes_by_site(plan, owners) == {"mid": {4096 * BF16}, "end": {4096 * BF16}}
    for i, values in enumerate(send_values(plan, owners)[:-1]):
        (value,) = values
        assert value.endswith("residual") and plan_carry(plan, owners).kept[i] == ()


@pytest.mark.slow
def test_gemma3_cad_and_afd_against_its_config():
    # Gemma-3-27B (opweave/models/configs/gemma-3-27b.json): hidden 5376, 32 q heads, 16 kv heads,
    # head dim 128, bf16; sliding and global layers have the same q/k/v shapes
    cfg = config("gemma-3-27b")
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
        (5376, 32, 16, 128) and cfg["torch_dtype"] == "bfloat16"
    qkv = (32 + 16 + 16) * 128 * BF16   # 16384 B/token
    attn_out = 32 * 128 * BF16          # 8192 B/token
    residual = 5376 * BF16              # 10752 B/token
    cad = stages_of("gemma-3-27b", "cad")
    assert bytes_by_site(cad, round_robin(cad, 2)) == {"pre_attn": {qkv}, "post_attn": {attn_out}}
    # 62 layers: 62 x (16384 + 8192) = 1,523,712 B/token, against 62 x (26.5 + 18.5) KiB all live
    assert plan_carry(cad, round_robin(cad, 2)).bytes_per_token == 62 * (qkv + attn_out) == 1523712
    assert sum(s.out_bytes_per_token for s in cad.stages) == 62 * (qkv + attn_out + 2 * residual)
    afd = stages_of("gemma-3-27b", "afd")
    assert bytes_by_site(afd, round_robin(afd, 2)) == {"mid": {residual}, "end": {residual}}


def test_gemma3_cad_on_three_owners_moves_the_residual_on():
    """With k = 3 the owner after core attention is a third one: the residual it needs is not
    held there, so it travels with q/k/v and back (the rule's 'passing through B')."""
    cad = stages_of("gemma-3-27b", "cad")
    carried = plan_carry(cad, round_robin(cad, 3))
    assert carried.sent_bytes_per_token[:-1] == tuple(s.out_bytes_per_token for s in cad.stages[:-1])
    assert all(kept == () for kept in carried.kept)


def test_mixed_template_by_site():
    """Gemma-3 with core attention split off the sliding layers and the FFN off the global one:
    per block 5 x (q/k/v out, attention back) + 2 residual crossings, 12 stages, owners i % 2."""
    plan = stages_of("gemma-3-27b", "S:pre_attn+post_attn|F:mid+end")
    assert plan.stages_per_block == 12
    owners = round_robin(plan, 2)
    assert bytes_by_site(plan, owners) == {"pre_attn": {16384}, "post_attn": {8192}, "mid": {10752}, "end": {10752}}
    per_block = 5 * (16384 + 8192) + 2 * 10752                    # 144,384 B/token
    tail = 2 * (16384 + 8192)                                     # layers 60, 61 (sliding)
    assert plan_carry(plan, owners).bytes_per_token == 10 * per_block + tail == 1492992
    kept = plan_carry(plan, owners).kept
    assert {site_after(plan, i) for i, k in enumerate(kept) if k} == {"pre_attn", "post_attn"}


def test_same_owner_boundaries_send_nothing():
    plan = stages_of("llama-3.1-8b", "cad")
    alone = plan_carry(plan, [0] * len(plan.stages))
    assert set(alone.sent) == {()} and set(alone.kept) == {()} and alone.bytes_per_token == 0
    pairs = [(i // 2) % 2 for i in range(len(plan.stages))]   # o0 o0 o1 o1 o0 o0 ...
    carried = plan_carry(plan, pairs)
    for i in range(len(plan.stages) - 1):
        if pairs[i] == pairs[i + 1]:
            assert carried.sent[i] == () and carried.sent_bytes_per_token[i] == 0
        else:
            assert carried.sent[i]


def test_held_bytes_per_owner():
    """What an owner keeps at once for its later stages: under CAD on two owners the dense owner
    keeps one residual (4096 x 2 B for Llama, 5376 x 2 B for Gemma-3), the attention owner nothing;
    on three owners the residual travels, so nobody keeps anything; AFD keeps nothing."""
    cad = stages_of("llama-3.1-8b", "cad")
    assert held_bytes_per_token(cad, round_robin(cad, 2)) == {0: 4096 * BF16, 1: 0}
    afd = stages_of("llama-3.1-8b", "afd")
    assert held_bytes_per_token(afd, round_robin(afd, 2)) == {0: 0, 1: 0}
    gemma = stages_of("gemma-3-27b", "cad")
    assert held_bytes_per_token(gemma, round_robin(gemma, 2)) == {0: 5376 * BF16, 1: 0}
    assert held_bytes_per_token(gemma, round_robin(gemma, 3)) == {0: 0, 1: 0, 2: 0}


# ---------------------------------------------------------------- the rule, re-implemented plainly


def reference_carry(graph, bounds, owners):
    """The rule with no index: scan the ops for the next reader; also check that each stage's
    owner holds every value the stage reads that an earlier stage made, and that no owner is sent
    what it already holds (round-robin owners) or sends what it does not hold."""
    stage_of = {x: i for i, (a, b) in enumerate(bounds) for x in range(a, b + 1)}
    made_by = {op.name: stage_of[op.index] for op in graph.ops}
    holders, sent = {}, []
    for i in range(len(bounds)):
        for x in range(bounds[i][0], bounds[i][1] + 1):
            for v in graph.ops[x].inputs:
                base = v.split("[")[0]
                if base in made_by and made_by[base] < i:
                    assert owners[i] in holders.get(v, {owners[made_by[base]]}), (i, v)
        if i == len(bounds) - 1 or owners[i] == owners[i + 1]:
            sent.append(())
            continue
        cut = graph.cut_after(bounds[i][1])
        out = []
        for v in cut.values:
            have = holders.setdefault(v, {owners[made_by[v.split("[")[0]]]})
            reader = next(x for x in range(bounds[i][1] + 1, len(graph.ops)) if v in graph.ops[x].inputs)
            if owners[stage_of[reader]] not in have:
                assert owners[i] in have
                out.append((v, owners[i + 1] in have))
                have.add(owners[i + 1])
        sent.append(tuple(out))
    return sent


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gemma-3-27b", "qwen3-next-80b-a3b"])
@pytest.mark.slow
def test_rule_matches_plain_reimplementation_on_round_robin_owners(model):
    bg = blocks_of(model)
    templates = enumerate_templates(bg, "all")
    checked = 0
    for t in templates[:: max(1, len(templates) // 24)]:   # an even spread of the family
        plan = build_stages(bg, t)
        for k in (2, 3, 4):
            if plan.stages_per_block % k:
                continue
            owners = round_robin(plan, k)
            expected = reference_carry(bg.graph, [(s.first, s.last) for s in plan.stages], owners)
            assert plan_carry(plan, owners).sent == tuple(tuple(v for v, _ in e) for e in expected), (t.name, k)
            assert not any(again for e in expected for _, again in e), "an owner was sent a value it holds"
            checked += 1
    assert checked >= 8


def test_rule_holds_for_any_owners():
    """Seeded random owner assignments (not round-robin): the rule still gets every value to the
    owner that reads it, and `carry` never finds a sender without the value."""
    rng = random.Random(14)
    for name, template in (("llama-3.1-8b", "cad"), ("gemma-3-27b", "S:pre_attn+post_attn|F:mid+end")):
        plan = stages_of(name, template)
        bounds = [(s.first, s.last) for s in plan.stages]
        for _ in range(20):
            owners = [rng.randrange(3) for _ in plan.stages]
            expected = reference_carry(plan.blocked.graph, bounds, owners)
            assert carry(plan.blocked.graph, bounds, owners).sent == tuple(tuple(v for v, _ in e) for e in expected)


def test_values_are_in_the_model_dtype_so_shapes_give_the_cut_bytes():
    for name in ("llama-3.1-8b", "gemma-3-27b", "qwen3-next-80b-a3b"):
        graph = blocks_of(name).graph
        for cut in graph.cuts:
            assert sum(value_bytes_per_token(graph, s) for s in cut.value_shapes) == cut.bytes_per_token


def test_bad_stages_are_refused():
    plan = stages_of("llama-3.1-8b", "cad")
    graph, bounds = plan.blocked.graph, [(s.first, s.last) for s in plan.stages]
    with pytest.raises(ValueError, match="owners for"):
        carry(graph, bounds, [0])
    with pytest.raises(ValueError, match="tile the graph"):
        carry(graph, [bounds[0]] + bounds[2:], round_robin(plan, 2)[:-1])
    merged = [(0, 1), (2, len(graph.ops) - 1)]   # op 1 is a norm: no legal cut after it
    with pytest.raises(ValueError, match="not a legal cut point"):
        carry(graph, merged, [0, 1])


def test_format_carry_names_what_is_sent_and_kept():
    plan = stages_of("llama-3.1-8b", "cad")
    text = format_carry(plan, round_robin(plan, 2), limit=2)
    assert "send 12 KiB/tok of 20 KiB live" in text and "kept [embed]" in text
    assert "total: 640 KiB/tok sent of 1.12 MiB/tok live (44% stays where it is needed)" in text


def test_memo_answers_per_graph_and_owners():
    plan = stages_of("llama-3.1-8b", "cad")
    assert plan_carry(plan, (0, 1) * 32 + (0,)) is plan_carry(plan, round_robin(plan, 2))
    assert plan_carry(plan, [0] * 65) is not plan_carry(plan, round_robin(plan, 2))
    # same template name and owners, another graph (float32 values: twice the bytes)
    wide = dataclasses.replace(plan.blocked.graph, dtype="float32")
    other = dataclasses.replace(plan, blocked=dataclasses.replace(plan.blocked, graph=wide))
    owners = round_robin(plan, 2)
    assert send_bytes_per_token(other, owners)[0] == 2 * send_bytes_per_token(plan, owners)[0]


# ---------------------------------------------------------------- lowering, verifier, codegen, runtime


def lowered(folder: str, template: str, owners):
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.passes.lower import lower

    fe = run_front_end(folder)
    compiled = pinned_plan(fe, parse_cluster("h100x8+l40sx8", load_catalog()), template, owners, batch=4,
                           microbatches=2, context=64)
    plan = compiled.plan
    return fe, compiled, plan, lower(plan, fe.graph, fe.blocks.period, fe.blocks.num_blocks, "h")


@pytest.mark.slow
def test_lowered_cad_keeps_the_residual_and_receives_only_what_is_sent(tiny_checkpoint):
    """The CAD plan the runtime's parity tests run (TP 2 on the dense owner, 2 attention replicas):
    the dense owner keeps the residual between its stages; receive buffers hold only what is sent."""
    import torch

    from opweave.runtime.transport import Transport
    from test_runtime import PLANS

    fe, _, plan, programs = lowered(tiny_checkpoint("llama", num_hidden_layers=3), "cad", PLANS["cad"])
    carried = carry(fe.graph, [(s.first_op, s.last_op) for s in plan.stages], [s.owner for s in plan.stages])
    verify_programs(programs)
    dense = [p for p in programs if p.owner == plan.stages[0].owner]
    assert len(dense) == 2   # TP 2: both ranks keep their copy
    for p in dense:
        assert p.stages[0].keeps == ("model.embed",) and p.stages[1].takes == ("model.embed",)
        assert all(len(s.keeps) == 1 and s.keeps[0].endswith("ffn.residual") for s in p.stages[1:-1])
    for p in programs:
        for s in p.stages:
            if s.recv is not None:
                assert s.recv.values == carried.sent[s.stage - 1]
        transport = Transport.__new__(Transport)  # its sizing only
        transport.program, transport.dtype, transport.tokens_back = p, getattr(torch, fe.graph.dtype), p.scheduler
        for s in p.stages:
            if s.recv is not None:
                assert transport.per_token_bytes(s.recv) == carried.sent_bytes_per_token[s.stage - 1]


def test_verifier_catches_a_lost_keep_and_an_unread_one(tiny_checkpoint):
    from test_runtime import PLANS

    _, _, _, programs = lowered(tiny_checkpoint("llama", num_hidden_layers=3), "cad", PLANS["cad"])
    p = programs[0]
    no_take = dataclasses.replace(p, stages=(p.stages[0], dataclasses.replace(p.stages[1], takes=())) + p.stages[2:])
    with pytest.raises(IRError, match=r"reads \['model.embed'\], which the stage neither makes, receives nor takes"):
        verify_programs([no_take] + list(programs[1:]))
    no_keep = dataclasses.replace(p, stages=(dataclasses.replace(p.stages[0], keeps=()),) + p.stages[1:])
    with pytest.raises(IRError, match="takes back model.embed, which no earlier stage of the rank kept"):
        verify_programs([no_keep] + list(programs[1:]))
    last = p.stages[-1]
    never_read = dataclasses.replace(last, keeps=(last.launches[0].output,))
    unread = dataclasses.replace(p, stages=p.stages[:-1] + (never_read,))
    with pytest.raises(IRError, match="no later stage of the rank takes back"):
        verify_programs([unread] + list(programs[1:]))


def test_rendered_module_keeps_and_takes_with_provenance(tiny_checkpoint):
    from opweave.codegen.render import render_rank

    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    fe, _, plan, programs = lowered(folder, "cad", [("h100", 1, 1), ("l40s", 1, 1)])
    names = [op.name for op in fe.graph.ops]
    source = render_rank(programs[0], names, "cad", plan.num_stages)
    lines = source.splitlines()
    keep = [l for l in lines if "self.held[mb]['v0'] = v0" in l]
    take = [l for l in lines if "v0 = self.held[mb].pop('v0')" in l]
    assert len(keep) == 1 and "keep model.embed for stage 2 of this owner (not sent)" in keep[0]
    assert len(take) == 1 and "kept on this owner since stage 0 (not sent)" in take[0]
    assert sum("self.held = [{} for _ in range(NUM_MICROBATCHES)]" in l for l in lines) == 1
    assert lines.index(keep[0]) < lines.index(take[0])
    compile(source, "rank_00.py", "exec")
    # a receive of positions only (every value kept) is still one valid statement
    st = programs[0].stages[1]
    bare = dataclasses.replace(programs[0], stages=(programs[0].stages[0], dataclasses.replace(
        st, recv=dataclasses.replace(st.recv, values=(), shapes=(), layouts=()))) + programs[0].stages[2:])
    text = render_rank(bare, names, "cad", plan.num_stages)
    assert "positions, () = rt.recv(2, mb)" in text
    compile(text, "rank_00.py", "exec")


@pytest.mark.slow
def test_interpreter_reads_kept_values_back(tiny_checkpoint, tmp_path):
    """The op-by-op interpreter (the generated modules' second path) keeps and takes back too."""
    from opweave.compiler.compile import write_artifact
    from opweave.runtime.launch import RunConfig, run
    from opweave.runtime.scheduler import Request
    from test_runtime import LAYERS, PLANS, PROMPTS, reference

    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    _, compiled, _, programs = lowered(folder, "cad", PLANS["cad"])
    assert any(s.takes for p in programs for s in p.stages)
    out = str(tmp_path / "art")
    write_artifact(out, compiled)
    short = tuple(Request(index=i, prompt=p, max_new_tokens=3) for i, p in enumerate(PROMPTS[:2]))
    outputs = run(RunConfig(artifact=out, weights=folder, device="cpu", requests=short, interpret=True, timeout_s=300))
    assert [tuple(r.output) for r in outputs] == [t[:3] for t in reference(folder)[:2]]


@pytest.mark.slow
def test_mixed_template_with_kept_values_generates_reference_tokens(tiny_checkpoint, tmp_path):
    """Gemma-3 (8 layers: one block and two tail layers) with core attention off the sliding layers
    and the FFN off the global one, TP 2 on the dense owner and two replicas of the other: the dense
    owner keeps the residual across each attention stage, on gloo ranks, with transformers' tokens."""
    from opweave.compiler.compile import write_artifact
    from opweave.runtime.launch import RunConfig, run
    from test_runtime import LAYERS, reference, requests

    folder = tiny_checkpoint("gemma3", num_hidden_layers=LAYERS["gemma3"])
    _, compiled, plan, programs = lowered(folder, "S:pre_attn+post_attn|F:mid+end", [("h100", 2, 1), ("l40s", 1, 2)])
    # one residual kept across each of the 7 sliding layers' attention, on each of the 2 TP ranks
    assert sum(len(s.keeps) for p in programs for s in p.stages if p.owner == 0) == 7 * 2
    out = str(tmp_path / "art")
    write_artifact(out, compiled)
    outputs = run(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests(), timeout_s=300))
    assert [tuple(r.output) for r in outputs] == list(reference(folder))
