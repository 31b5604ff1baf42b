"""DeepSeek-V3 family (also Kimi-K2): multi-head latent attention in the absorbed form, YaRN with
DeepSeek's mscale, sigmoid group-limited routing with a correction bias, routed scaling, plain
shared experts and `first_k_dense_replace` dense head layers.

A tiny random float32 checkpoint (`hf_fixtures`: 3 layers, 1 dense + 2 MoE, 8 experts in 2 groups,
q LoRA, interleaved rope) is saved with transformers' save_pretrained; OpWeave must match
transformers' logits and greedy tokens in one process and through compiled plans of every
template family on CPU ranks, with TP 2. The built-in configs must reproduce the published
parameter counts, and the IR must state MLA's real decode traffic.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_fixtures import hf_generate, hf_step_logits
from opweave.compiler.compile import write_artifact
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.ir import tp as tp_table
from opweave.ir.kinds import OpClass, OpKind
from opweave.passes.trace import build_graph
from opweave.models.hf_config import config_from_hf
from opweave.models.model import DecodeStep, build_model, generate
from opweave.models.registry import resolve
from opweave.passes.blocks import find_blocks
from opweave.passes.templates import build_stages, layer_cut_sites, template_by_name
from opweave.runtime.launch import RunConfig, run_detailed
from opweave.runtime.scheduler import Request

PROMPT = [(7 * i + 3) % 100 for i in range(20)]
NEW_TOKENS = 8
ATOL = 1e-4

TINY = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=5, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, n_shared_experts=2, routed_scaling_factor=2.5, rope_theta=1e4,
            torch_dtype="bfloat16")


@functools.cache
def graph_of(name: str):
    return build_graph(resolve(name).build("meta"))


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("deepseek_v3")


# ---------------------------------------------------------------- config


def test_config_parses_every_deepseek_feature(ckpt):
    cfg = resolve(ckpt).cfg
    assert cfg.family == "deepseek_v3" and cfg.mla.q_lora_rank == 48 and cfg.mla.rope_interleave
    assert cfg.mlp_types == ("dense", "moe", "moe") and cfg.num_kv_heads == 1 and cfg.head_dim == 8
    m = cfg.moe
    assert (m.scoring, m.n_group, m.topk_group, m.routed_scaling_factor, m.shared_expert_gated) == \
        ("sigmoid", 2, 1, 2.5, False)
    assert m.shared_expert_intermediate_size == 32
    rope = cfg.rope["full_attention"]
    assert rope.rope_type == "yarn" and rope.mscale_all_dim == 0.8
    # softmax scale: (16 + 8)^-0.5 * (0.1 * 0.8 * ln 4 + 1)^2 (transformers' yarn_apply_mscale)
    assert cfg.attn_scale == pytest.approx(24 ** -0.5 * (0.08 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)


def test_moe_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    assert config_from_hf(TINY, "t").mlp_types == ("dense", "dense", "moe", "moe", "moe")
    assert config_from_hf({**TINY, "moe_layer_freq": 2}, "t").mlp_types == ("dense", "dense", "moe", "dense", "moe")
    no_lora = config_from_hf({**TINY, "q_lora_rank": None}, "t")
    assert no_lora.mla.q_lora_rank is None
    kinds = [op.kind for op in build_graph(build_model(no_lora)).ops]
    assert kinds.count(OpKind.ATTN_MLA) == 5


@pytest.mark.parametrize("change,message", [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(8\)"),
    ({"topk_group": 5}, r"topk_group \(5\) be between 1 and n_group"),
    ({"kv_lora_rank": None}, "missing required field 'kv_lora_rank'"),
    ({"qk_rope_head_dim": 5}, "'qk_rope_head_dim' must be even"),
    ({"attention_bias": True}, "attention_bias is not supported"),
    ({"moe_layer_freq": 0}, "'moe_layer_freq' must be positive"),
])
def test_bad_configs_are_one_line_errors(change, message):
    with pytest.raises(OpWeaveError, match=message):
        config_from_hf({**TINY, **change}, "t")


# ---------------------------------------------------------------- one process vs transformers


def test_logits_and_tokens_match_transformers(ckpt):
    model = resolve(ckpt).load()
    logits, tokens = generate(model, PROMPT, NEW_TOKENS)
    ref_prompt, ref_tokens = hf_generate(ckpt, PROMPT, NEW_TOKENS)
    torch.testing.assert_close(logits[:len(PROMPT)], ref_prompt, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[len(PROMPT) - 1:], hf_step_logits(ckpt, PROMPT, NEW_TOKENS), atol=ATOL, rtol=0)
    assert tokens == ref_tokens and len(set(tokens)) > 2

    # the traced unit: a prefill, then one DecodeStep per token (greedy sampler included)
    step = DecodeStep(model)
    model.allocate_state(1, len(PROMPT) + NEW_TOKENS)
    with torch.no_grad():
        out = [int(step(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])[0])]
        for i in range(NEW_TOKENS - 1):
            out.append(int(step(torch.tensor([[out[-1]]]), torch.tensor([[len(PROMPT) + i]]))[0]))
    assert out == ref_tokens


@torch.no_grad()
def test_latent_cache_and_padding(ckpt):
    """Two prompts of different lengths in one batch (padding at position -1) decode as if alone,
    and the cache rows hold exactly the latent + rope key per position."""
    model = resolve(ckpt).load()
    short = PROMPT[:9]
    _, alone_long = generate(model, PROMPT, 3)
    _, alone_short = generate(model, short, 3)
    model.allocate_state(2, len(PROMPT) + 3)
    attn = model.layers[0].mixer.attn
    assert attn.kv_cache.shape == (2, len(PROMPT) + 3, 32 + 8)
    ids = torch.tensor([PROMPT, short + [0] * (len(PROMPT) - len(short))])
    pos = torch.arange(len(PROMPT)).repeat(2, 1)
    pos[1, len(short):] = -1
    logits = model(ids, pos)
    assert attn.kv_cache[1, len(short):].abs().sum() == 0  # padding wrote nothing
    nxt = torch.stack([logits[0, len(PROMPT) - 1].argmax(), logits[1, len(short) - 1].argmax()])
    got = [[int(nxt[0])], [int(nxt[1])]]
    lengths = torch.tensor([len(PROMPT), len(short)])
    for step in range(2):
        nxt = model(nxt[:, None], (lengths + step)[:, None])[:, -1].argmax(-1)
        got[0].append(int(nxt[0]))
        got[1].append(int(nxt[1]))
    assert got == [alone_long, alone_short]


# ---------------------------------------------------------------- IR facts, TP semantics, blocks


@pytest.mark.slow
def test_mla_facts_state_the_latent_traffic():
    """Per token of context a layer reads (kv_lora_rank + rope dim) x 2 bytes, once for all heads;
    FLOPs per context token are the absorbed form's 2H(2R + Dr)."""
    g = graph_of("deepseek-v3")
    attn = [op for op in g.ops if op.kind == OpKind.ATTN_MLA]
    assert len(attn) == 61 and all(op.cls == OpClass.ATTN for op in attn)
    op = attn[0]
    assert op.state.bytes_per_token == (512 + 64) * 2 and op.weights == ()
    assert op.flops_per_context_token == 2 * 128 * (2 * 512 + 64)
    assert g.state_bytes(1) == 61 * 1152  # 70,272 bytes per token for the whole model
    # TP shards the query heads, never the latent cache: every rank reads all of it
    assert tp_table.state_shards(op, 8) == 1 and tp_table.compute_shards(op, 8) == 8
    qkv = next(o for o in g.ops if o.kind == OpKind.QKV_PROJ)
    per_rank = tp_table.weight_bytes_per_rank(qkv, 8)
    replicated = sum(w.nbytes for w in qkv.weights if "q_b_proj" not in w.name and "w_uk" not in w.name)
    assert per_rank == replicated + (qkv.weight_bytes - replicated) // 8
    o_proj = next(o for o in g.ops if o.kind == OpKind.O_PROJ)
    assert tp_table.weight_bytes_per_rank(o_proj, 8) * 8 == o_proj.weight_bytes


@pytest.mark.slow
def test_dense_head_layers_join_the_first_stage():
    bg = find_blocks(graph_of("deepseek-v3"))
    assert (bg.num_head_layers, bg.period, bg.num_blocks, bg.num_tail_layers) == (3, 1, 58, 0)
    assert bg.head.first == 1 and bg.blocks[0].first_layer == 3
    assert [s for s in layer_cut_sites(bg)[:3]] == [{}, {}, {}]  # head layers are never cut
    # two cuts in each of the 58 blocks (AFD: the last layer has no `end` cut), none before layer 3
    for name, stages in (("afd", 2 * 58), ("cad", 2 * 58 + 1)):
        plan = build_stages(bg, template_by_name(bg, name))
        assert plan.stages[0].has_prologue and plan.stages[0].layers[:4] == (0, 1, 2, 3)
        assert len(plan.stages) == stages and plan.stages[-1].has_epilogue
    assert (find_blocks(graph_of("kimi-k2")).num_head_layers, find_blocks(graph_of("kimi-k2")).period) == (1, 1)


# ---------------------------------------------------------------- built-in configs


def test_builtin_configs_reproduce_the_published_parameter_counts():
    """DeepSeek-V3: 671B total / 37B activated (its model card; the hub's 685B adds the 14B
    multi-token-prediction module, not built here). Kimi-K2: 1T total / 32B activated (its model
    card, to the digit printed). Both counts include the embedding and the LM head."""
    ds, kimi = graph_of("deepseek-v3"), graph_of("kimi-k2")
    assert ds.num_parameters == 671_026_419_200 and abs(ds.num_active_parameters - 37e9) < 1e9
    assert abs(kimi.num_parameters - 1.0e12) < 0.05e12 and abs(kimi.num_active_parameters - 32e9) < 1e9
    # as published (quantization_config): the matrices in fp8 with a float32 scale per 128 x 128
    # block; embeddings, LM head, norms and routers in bf16; the routing biases in float32
    fp8 = sum(w.numel for op in ds.ops for w in op.weights if w.dtype == "float8_e4m3fn")
    assert fp8 / ds.num_parameters > 0.99
    expected = fp8 * (1 + 4 / 128 ** 2) + 2 * (ds.num_parameters - fp8) + 2 * 58 * 256
    assert abs(ds.weight_bytes - expected) <= sum(len(op.weights) for op in ds.ops)  # one byte of rounding each
    assert 670e9 < ds.weight_bytes < 675e9   # the hub's fp8 files: ~688 GB with the 14B MTP module


# ---------------------------------------------------------------- compiled plans on CPU ranks

PROMPTS = [PROMPT, [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [42]]
RUN_TOKENS = 5
PLANS = [
    ("colocated", [("h100", 2, 1)]),                      # TP 2: heads split, latent cache replicated
    ("afd", [("h100", 2, 1), ("l40s", 2, 1, "ep")]),      # MLA on a TP 2 attention owner, experts EP 2
    ("cad", [("l40s", 1, 1), ("h100", 2, 1)]),            # core latent attention apart, the rest TP 2
    ("F:post_attn+mid", [("h100", 1, 1), ("l40s", 2, 1)]),  # mixed: W_UV + o_proj with the FFN, experts TP 2
]


@functools.cache
def reference(folder: str):
    return tuple(tuple(hf_generate(folder, p, RUN_TOKENS)[1]) for p in PROMPTS)


def _run(folder, tmp_path, template, owners, tokens=RUN_TOKENS, prompts=PROMPTS):
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    compiled = pinned_plan(run_front_end(folder), cluster, template, owners, batch=4, microbatches=2, context=64)
    out = str(tmp_path / "art")
    write_artifact(out, compiled)
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=tokens) for i, p in enumerate(prompts))
    outputs, _ = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests, timeout_s=300))
    assert all(r.error is None for r in outputs)
    return [tuple(r.output) for r in outputs]


@pytest.mark.parametrize("template,owners", PLANS, ids=[p[0] for p in PLANS])
@pytest.mark.slow
def test_plan_generates_reference_tokens(ckpt, tmp_path, monkeypatch, template, owners):
    monkeypatch.setenv("OPWEAVE_CHECK_SYNC", "1")
    assert _run(ckpt, tmp_path, template, owners) == list(reference(ckpt))


@pytest.mark.slow
def test_triton_mla_kernel_path_generates_reference_tokens(ckpt, tmp_path, monkeypatch):
    """The CUDA path (Triton's `mla_decode_attention`, here under TRITON_INTERPRET=1) on a TP 2 owner."""
    pytest.importorskip("triton")
    monkeypatch.setenv("OPWEAVE_KERNELS", "triton")
    got = _run(ckpt, tmp_path, "colocated", [("h100", 2, 1)], tokens=3, prompts=PROMPTS[:2])
    assert got == [t[:3] for t in reference(ckpt)[:2]]


@pytest.mark.slow
def test_paged_latent_cache_reuses_prefixes(ckpt, tmp_path):
    """MLA's latent rows in pages: prompts sharing their first 36 tokens start on the cached pages
    of earlier ones (at least two pages found) and keep transformers' greedy tokens."""
    shared = [(7 * i) % 60 + 3 for i in range(36)]
    prompts = [shared + [5], shared + [6, 7], shared + [5], shared + [8], shared + [6, 7, 9], shared[:30]]
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    compiled = pinned_plan(run_front_end(ckpt), cluster, "colocated", [("h100", 2, 1)], batch=4, microbatches=2,
                           context=64)
    out = str(tmp_path / "art")
    write_artifact(out, compiled)
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=3) for i, p in enumerate(prompts))
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=ckpt, device="cpu", requests=requests,
                                            timeout_s=300))
    assert [r.output for r in outputs] == [hf_generate(ckpt, p, 3)[1] for p in prompts]
    assert stats["prefix_cache"]["hit"] >= 32
