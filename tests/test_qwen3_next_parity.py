"""Qwen3-Next parity with transformers: Gated-DeltaNet layers, gated full attention with partial
rotary, (1 + w) RMSNorm, q/k norm and MoE with a shared expert, through OpWeave's generic model.

A tiny random float32 checkpoint is saved with transformers' save_pretrained and loaded through
`opweave.models.registry.resolve(path).load()`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

try:
    from hf_fixtures import hf_generate, hf_step_logits, make_tiny_checkpoint
except ImportError:  # tests/ imported as a package
    from tests.hf_fixtures import hf_generate, hf_step_logits, make_tiny_checkpoint

from opweave.ir.kinds import OpKind, TPRule
from opweave.models.model import DecodeStep, build_model, generate
from opweave.models.ops_linear import GatedDeltaNet, LinearQKVProj
from opweave.models.registry import resolve

PROMPT = [(7 * i + 3) % 200 for i in range(20)]
NEW_TOKENS = 8
ATOL = RTOL = 1e-4  # float32: transformers' chunked prefill vs OpWeave's token-by-token recurrence


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_next", str(tmp_path_factory.mktemp("qwen3_next")))


@pytest.fixture(scope="module")
def hf_ref(ckpt):
    prompt_logits, new_ids = hf_generate(ckpt, PROMPT, NEW_TOKENS)
    steps = hf_step_logits(ckpt, PROMPT, NEW_TOKENS)
    return prompt_logits, new_ids, steps


@pytest.fixture(scope="module")
def model(ckpt):
    return resolve(ckpt).load()


def _linear_ops(model):
    return [m for m in model.op_modules() if isinstance(m, GatedDeltaNet)]


def test_config_exercises_every_qwen3_next_feature(model):
    cfg = model.cfg
    assert cfg.family == "qwen3_next" and cfg.dtype == "float32"
    assert "linear_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.norm_offset
    assert cfg.rope["full_attention"].partial_rotary_factor == 0.25
    assert cfg.moe.shared_expert_intermediate_size > 0
    assert cfg.linear_attn.num_value_heads > cfg.linear_attn.num_key_heads  # grouped value heads


@pytest.mark.slow
def test_prompt_and_decode_logits_match_transformers(model, hf_ref):
    hf_prompt, _, hf_steps = hf_ref
    logits, _ = generate(model, PROMPT, NEW_TOKENS)
    t = len(PROMPT)
    assert logits.shape == (t + NEW_TOKENS - 1, model.cfg.vocab_size)
    # prefill (one forward over the prompt) against transformers' uncached forward
    torch.testing.assert_close(logits[:t], hf_prompt, atol=ATOL, rtol=RTOL)
    # last prompt position + each decode step against transformers' cached generation
    torch.testing.assert_close(logits[t - 1:], hf_steps, atol=ATOL, rtol=RTOL)


def test_greedy_tokens_match_transformers(model, hf_ref):
    _, hf_ids, _ = hf_ref
    _, tokens = generate(model, PROMPT, NEW_TOKENS)
    assert tokens == hf_ids
    assert len(set(tokens)) > 1, "greedy output is constant: the random model is too degenerate to test"


def test_linear_attention_layer_matches_transformers(ckpt, model):
    """One Gated-DeltaNet layer (in_proj -> conv/recurrence/gated norm -> out_proj) on random inputs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    layer = model.cfg.layer_types.index("linear_attention")
    block = model.layers[layer].mixer
    torch.manual_seed(1)
    x = torch.randn(2, 20, model.cfg.hidden_size)
    with torch.no_grad():
        ref = hf.model.layers[layer].linear_attn(x)
        block.attn.allocate_state(2, 32, "cpu")
        pos = torch.arange(20).expand(2, 20)
        ours = block.o_proj(block.attn(*block.qkv(x), pos))
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        # the same tokens fed in two steps carry the conv and recurrent state across the split
        block.attn.allocate_state(2, 32, "cpu")
        first = block.o_proj(block.attn(*block.qkv(x[:, :13]), pos[:, :13]))
        second = block.o_proj(block.attn(*block.qkv(x[:, 13:]), pos[:, 13:]))
        torch.testing.assert_close(torch.cat((first, second), dim=1), ours, atol=1e-6, rtol=1e-6)


def _states(model, row):
    return [(m.conv_state[row].clone(), m.recurrent_state[row].clone()) for m in _linear_ops(model)]


@torch.no_grad()
def test_padding_keeps_state_and_slots_are_reusable(model):
    a, b, c = PROMPT[:12], PROMPT[5:13], PROMPT[3:17]
    ref_a, tok_a = generate(model, a, 2)
    ref_b, tok_b = generate(model, b, 2)
    ref_c, _ = generate(model, c, 1)

    model.allocate_state(2, 32)
    # batched prefill: row 1 is shorter, its tail is padding (position -1)
    ids = torch.tensor([a, b + [0] * (len(a) - len(b))])
    pos = torch.tensor([list(range(len(a))), list(range(len(b))) + [-1] * (len(a) - len(b))])
    out = model(ids, pos)
    torch.testing.assert_close(out[0], ref_a[:len(a)], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :len(b)], ref_b[:len(b)], atol=1e-5, rtol=1e-5)

    # decode step for row 0 only: row 1 is padding and its linear-attention state must not move
    before_1, before_0 = _states(model, 1), _states(model, 0)
    out = model(torch.tensor([[tok_a[0]], [0]]), torch.tensor([[len(a)], [-1]]))
    for (conv, rec), (conv_after, rec_after) in zip(before_1, _states(model, 1)):
        assert torch.equal(conv, conv_after) and torch.equal(rec, rec_after)
    assert all(not torch.equal(r0, r1) for (_, r0), (_, r1) in zip(before_0, _states(model, 0)))
    torch.testing.assert_close(out[0, 0], ref_a[len(a)], atol=1e-5, rtol=1e-5)

    # now row 1 continues where it stopped, row 0 pads
    out = model(torch.tensor([[0], [tok_b[0]]]), torch.tensor([[-1], [len(b)]]))
    torch.testing.assert_close(out[1, 0], ref_b[len(b)], atol=1e-5, rtol=1e-5)

    # position 0 starts a new sequence in slot 0: its old state is discarded
    out = model(torch.tensor([c, [0] * len(c)]), torch.tensor([list(range(len(c))), [-1] * len(c)]))
    torch.testing.assert_close(out[0], ref_c[:len(c)], atol=1e-5, rtol=1e-5)


def test_linear_ops_run_on_meta_and_state_facts(ckpt):
    cfg = resolve(ckpt).cfg
    la = cfg.linear_attn
    model = build_model(cfg, "meta")
    model.allocate_state(3, 16, "meta")
    step = DecodeStep(model)
    next_ids = step(torch.zeros(3, 1, dtype=torch.long, device="meta"),
                    torch.tensor([[4], [-1], [0]], device="meta"))
    assert next_ids.shape == (3,) and next_ids.device.type == "meta"

    qkv, attn = model.layers[0].mixer.qkv, model.layers[0].mixer.attn
    assert isinstance(qkv, LinearQKVProj) and qkv.kind == OpKind.QKV_PROJ
    assert attn.kind == OpKind.ATTN_LINEAR
    x = torch.empty(3, 5, cfg.hidden_size, device="meta")
    mixed, z, b, a = qkv(x)
    conv_dim = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    assert mixed.shape == (3, 5, conv_dim)
    assert z.shape == (3, 5, la.num_value_heads, la.value_head_dim)
    assert b.shape == a.shape == (3, 5, la.num_value_heads)
    o = attn(mixed, z, b, a, torch.zeros(3, 5, dtype=torch.long, device="meta"))
    assert o.shape == (3, 5, la.num_value_heads * la.value_head_dim) and o.device.type == "meta"
    assert attn.conv_state.shape == (3, conv_dim, la.conv_kernel_dim - 1)
    assert attn.recurrent_state.shape == (3, la.num_value_heads, la.key_head_dim, la.value_head_dim)
    assert attn.recurrent_state.dtype == torch.float32

    facts = attn.facts()
    state_bytes = (conv_dim * (la.conv_kernel_dim - 1) * cfg.dtype_bytes
                   + la.num_value_heads * la.key_head_dim * la.value_head_dim * 4)
    assert facts.state.fixed_bytes == state_bytes and facts.state.bytes_per_token == 0
    assert facts.tp_rule == TPRule.HEADS and facts.tp_units == la.num_key_heads
    assert facts.flops_per_token > 7 * la.num_value_heads * la.key_head_dim * la.value_head_dim
    qkv_facts = qkv.facts()
    assert qkv_facts.tp_rule == TPRule.HEADS and qkv_facts.tp_units == la.num_key_heads
    assert qkv_facts.flops_per_token == 2 * qkv.weight_numel()


def test_decode_step_traces_into_the_ir(ckpt):
    from opweave.passes.trace import build_graph

    cfg = resolve(ckpt).cfg
    graph = build_graph(build_model(cfg, "meta"))
    linear = [op for op in graph.ops if op.kind == OpKind.ATTN_LINEAR]
    assert len(linear) == cfg.layer_types.count("linear_attention")
    assert all(op.state is not None and op.state.fixed_bytes > 0 for op in linear)
