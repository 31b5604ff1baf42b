"""GPT-OSS kernels: sink-aware attention (reference against a naive softmax with the sink as one
more logit, and against transformers' eager attention; Triton split-KV decode against the
reference) and the clamped-SwiGLU experts with biases (reference against transformers'
GptOssExperts; Triton against the reference), under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import pytest
import torch

from opweave.kernels import get_backend
from opweave.ir.kinds import OpKind
from opweave.ir.tp import OpTP

ref = get_backend("torch")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
DTYPES = [torch.float32, torch.float16]


def _naive_sink_attention(q, k, v, q_pos, k_pos, scale, window, sinks):
    """One softmax over every allowed key plus the head's sink logit (value 0); [B, T, Hq, D]."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bthd,blhd->bhtl", q, k) * scale
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
    allowed = (kp >= 0) & (kp <= qp) & ((kp > qp - window) if window else True)
    s = s.masked_fill(~allowed, float("-inf"))
    sink = sinks[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhtl,blhd->bthd", p, v)
    return torch.where((q_pos >= 0)[:, :, None, None], out, 0.0)


def _ring(history, positions, slots):
    """Ring caches holding each row's positions up to `positions[row]` (position p at slot p % slots)."""
    b = history.shape[0]
    k_cache = torch.zeros(b, slots, *history.shape[3:])
    v_cache = torch.zeros_like(k_cache)
    for row in range(b):
        for p in range(max(0, int(positions[row]) - slots + 1), int(positions[row]) + 1):
            k_cache[row, p % slots], v_cache[row, p % slots] = history[row, p, 0], history[row, p, 1]
    return k_cache, v_cache


@pytest.mark.parametrize("window", [None, 6])
def test_decode_attention_with_sinks_is_softmax_with_one_more_logit(window):
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, d, ctx = 4, 6, 2, 8, 30
    history = torch.randn(b, ctx, 2, hkv, d, generator=gen)
    positions = torch.tensor([0, 9, 29, -1])
    slots = window or ctx
    k_cache, v_cache = _ring(history, positions, slots)
    q = torch.randn(b, hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) * 2
    got = ref.decode_attention(q, k_cache, v_cache, positions, 0.35, window, sinks)
    k_pos = torch.arange(ctx).repeat(b, 1)
    want = _naive_sink_attention(q[:, None], history[:, :, 0], history[:, :, 1], positions[:, None], k_pos,
                                 0.35, window, sinks)[:, 0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))  # padding: zeros, sink or not
    plain = ref.decode_attention(q, k_cache, v_cache, positions, 0.35, window)
    assert (got[:3].norm(dim=-1) < plain[:3].norm(dim=-1) + 1e-6).all()  # a sink only takes mass


@pytest.mark.parametrize("window", [None, 5])
def test_chunk_attention_with_sinks(monkeypatch, window):
    monkeypatch.setattr(ref, "ATTN_KEY_BLOCK", 3)  # several key blocks: the sink survives the online softmax
    gen = torch.Generator().manual_seed(1)
    b, t, hq, hkv, d, ctx = 2, 5, 4, 2, 8, 24
    history = torch.randn(b, ctx, 2, hkv, d, generator=gen)
    positions = torch.tensor([[0, 1, 2, 3, 4], [-1, 11, 12, 13, 14]])
    slots = window or ctx
    k_cache, v_cache = _ring(history, torch.tensor([-1, 10]), slots)
    q = torch.randn(b, t, hq, d, generator=gen)
    k = torch.stack([history[r, positions[r].clamp(min=0), 0] for r in range(b)])
    v = torch.stack([history[r, positions[r].clamp(min=0), 1] for r in range(b)])
    sinks = torch.randn(hq, generator=gen)
    got = ref.chunk_attention(q, k, v, k_cache, v_cache, positions, 0.3, window, sinks)
    k_pos = torch.arange(ctx).repeat(b, 1)
    k_pos = torch.where(k_pos <= positions.amax(dim=1, keepdim=True), k_pos, -1)
    want = _naive_sink_attention(q, history[:, :, 0], history[:, :, 1], positions, k_pos, 0.3, window, sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sink_attention_matches_transformers_eager():
    """The transformers eager attention of GPT-OSS (sinks concatenated to the logits) on a causal
    prompt equals `chunk_attention` over an empty cache with the same sinks."""
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    gen = torch.Generator().manual_seed(2)
    b, t, hq, hkv, d = 1, 6, 4, 2, 8
    q, k, v = torch.randn(b, t, hq, d, generator=gen), torch.randn(b, t, hkv, d, generator=gen), \
        torch.randn(b, t, hkv, d, generator=gen)
    sinks = torch.randn(hq, generator=gen)
    holder = torch.nn.Module()
    holder.num_key_value_groups, holder.sinks, holder.training = hq // hkv, sinks, False
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    want, _ = m.eager_attention_forward(holder, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                        scaling=d ** -0.5)
    empty = torch.zeros(b, t, hkv, d)
    got = ref.chunk_attention(q, k, v, empty, empty.clone(), torch.arange(t)[None], d ** -0.5, None, sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture
def tri(monkeypatch):
    pytest.importorskip("triton")
    mod = get_backend("triton")
    monkeypatch.setattr(mod.attention, "ATTN_BLOCK_N", 16)
    monkeypatch.setattr(mod.attention, "ATTN_MIN_SPLIT", 16)  # several KV splits on test-sized caches
    return mod


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.slow
def test_triton_decode_attention_with_sinks(tri, dtype, window):
    gen = torch.Generator().manual_seed(3)
    b, hkv, group, d, slots = 5, 2, 4, 32, 64
    q = torch.randn(b, hkv * group, d, generator=gen).to(dtype)
    k_cache = torch.randn(b + 1, slots, hkv, d, generator=gen).to(dtype)[1:]  # strided rows, as a microbatch's
    v_cache = torch.randn(b + 1, slots, hkv, d, generator=gen).to(dtype)[1:]
    positions = torch.tensor([0, 37, slots - 1, -1, 3 * slots + 10])
    sinks = (torch.randn(hkv * group, generator=gen) * 3).to(dtype)
    got = tri.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, window, sinks)
    want = ref.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, window, sinks)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert not torch.allclose(got, tri.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, window),
                              **TOL[dtype])


def _expert_weights(e, h, i, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, h, 2 * i, generator=gen) * h ** -0.5 * 4).to(dtype)  # some values past the clamp
    gate_up_bias = torch.randn(e, 2 * i, generator=gen).to(dtype)
    down = (torch.randn(e, i, h, generator=gen) * i ** -0.5).to(dtype)
    down_bias = (torch.randn(e, h, generator=gen) * 0.1).to(dtype)
    return gate_up, gate_up_bias, down, down_bias


def test_swiglu_experts_reference_matches_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    e, h, i, k, n = 6, 32, 24, 2, 9
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2)
    experts = m.GptOssExperts(cfg)
    gate_up, gate_up_bias, down, down_bias = _expert_weights(e, h, i, torch.float32)
    with torch.no_grad():
        for p, value in zip((experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                             experts.down_proj_bias), (gate_up, gate_up_bias, down, down_bias)):
            p.copy_(value)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(5)) * 2
    logits = torch.randn(n, e, generator=torch.Generator().manual_seed(6))
    top, ids = torch.topk(logits, k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    want = experts(x, ids, weights)
    got = ref.moe_experts_swiglu(x, weights, ids, gate_up, gate_up_bias, down, down_bias, cfg.swiglu_alpha,
                                 cfg.swiglu_limit)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    gu = x[:, None] @ gate_up[ids[:, 0]] + gate_up_bias[ids[:, 0]][:, None]
    assert (gu[..., ::2] > cfg.swiglu_limit).any()  # the clamp is exercised


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,k,i,h", [(6, 2, 24, 40), (4, 4, 16, 32), (5, 3, 72, 136)])
@pytest.mark.slow
def test_triton_swiglu_experts(tri, dtype, e, k, i, h):
    gate_up, gate_up_bias, down, down_bias = _expert_weights(e, h, i, dtype, seed=e)
    x = torch.randn(7, h, generator=torch.Generator().manual_seed(8)).to(dtype)
    weights, ids = ref.moe_route(torch.randn(7, e, generator=torch.Generator().manual_seed(9)).to(dtype), k, True)
    got = tri.moe_experts_swiglu(x, weights, ids, gate_up, gate_up_bias, down, down_bias, 1.702, 7.0)
    want = ref.moe_experts_swiglu(x, weights, ids, gate_up, gate_up_bias, down, down_bias, 1.702, 7.0)
    # outputs reach ~30 (gate values past the clamp): float16 within two units in the last place of
    # the largest output (the kernel rounds once where the reference rounds after each torch op)
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=2 * 2 ** -10 * float(want.abs().max()), rtol=3e-3)
    torch.testing.assert_close(got, want, **tol)


def test_tp_table_gpt_oss_weights():
    """Sinks split with the heads; gate/up columns in whole (gate, up) pairs; the biases of
    partial-sum ops held whole and added once."""
    e, h, i = 4, 16, 8
    experts = OpTP(kind=OpKind.MOE_EXPERTS_SWIGLU, units=i, kv_heads=0, weights=(
        ("l.mlp.experts.gate_up_proj", (e, h, 2 * i)), ("l.mlp.experts.gate_up_proj_bias", (e, 2 * i)),
        ("l.mlp.experts.down_proj", (e, i, h)), ("l.mlp.experts.down_proj_bias", (e, h))))
    assert experts.legal(2) and experts.legal(4) and not experts.legal(3)
    dim, split = experts.weight_split("l.mlp.experts.gate_up_proj", (e, h, 2 * i))
    assert dim == 2 and split.blocks(2, 1) == ((i, i),)  # rank 1: channels i/2.., as (gate, up) pairs
    assert experts.local_shape("l.mlp.experts.down_proj", (e, i, h), 2) == (e, i // 2, h)
    assert experts.local_shape("l.mlp.experts.down_proj_bias", (e, h), 2) == (e, h)
    assert experts.added_once("l.mlp.experts.down_proj_bias")
    assert not experts.added_once("l.mlp.experts.gate_up_proj_bias")
    o = OpTP(kind=OpKind.O_PROJ, units=4, kv_heads=0, weights=(("self_attn.o_proj.weight", (h, 32)),
                                                               ("self_attn.o_proj.bias", (h,))))
    assert o.added_once("self_attn.o_proj.bias") and o.local_shape("self_attn.o_proj.bias", (h,), 2) == (h,)
    assert o.local_shape("self_attn.o_proj.weight", (h, 32), 2) == (h, 16)
    attn = OpTP(kind=OpKind.ATTN_SLIDING, units=4, kv_heads=2, weights=(("self_attn.sinks", (4,)),))
    assert attn.local_shape("self_attn.sinks", (4,), 2) == (2,)
