"""Latent-attention (MLA) kernels: the absorbed torch reference against the expanded formula
(keys and values up-projected per head, as transformers computes them), DeepSeek's grouped router
against transformers' router, and the Triton decode kernel against the reference under
TRITON_INTERPRET=1 (float32 1e-5, float16 2e-3, as tests/test_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from opweave.kernels import get_backend

ref = get_backend("torch")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, pos, scale):
    """Naive MLA of one query per sequence: k_h = [W_UK_h c | k_pe], v_h = W_UV_h c, over positions <= pos."""
    k_nope = torch.einsum("hdr,blr->blhd", w_uk, c)
    keys = torch.cat((k_nope, k_pe[:, :, None].expand(-1, -1, w_uk.shape[0], -1)), dim=-1)
    values = torch.einsum("hvr,blr->blhv", w_uv, c)
    s = torch.einsum("bhd,blhd->bhl", torch.cat((q_nope, q_pe), dim=-1), keys) * scale
    mask = torch.arange(c.shape[1])[None, :] <= pos[:, None]
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhl,blhv->bhv", p, values)


def test_absorbed_reference_is_the_expanded_attention():
    g = torch.Generator().manual_seed(0)
    b, h, dn, dr, dv, r, slots = 2, 4, 8, 4, 6, 16, 11
    q_nope, q_pe = torch.randn(b, h, dn, generator=g), torch.randn(b, h, dr, generator=g)
    c, k_pe = torch.randn(b, slots, r, generator=g), torch.randn(b, slots, dr, generator=g)
    w_uk, w_uv = torch.randn(h, dn, r, generator=g) * 0.3, torch.randn(h, dv, r, generator=g) * 0.3
    pos = torch.tensor([10, 4])
    q = torch.cat((torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_pe), dim=-1)
    o_lat = ref.mla_decode_attention(q, torch.cat((c, k_pe), dim=-1), pos, 0.3, r)
    ours = torch.einsum("bhr,hvr->bhv", o_lat, w_uv)
    torch.testing.assert_close(ours, _expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, pos, 0.3), atol=1e-5, rtol=1e-5)


def test_chunk_then_decode_equals_decode_all():
    """A prefill chunk over the cache + itself, then the cache written, then one decode step:
    the same as decoding every position (the ring writes and causal masks agree)."""
    g = torch.Generator().manual_seed(1)
    b, h, r, p, t = 2, 3, 16, 4, 7
    q = torch.randn(b, t + 1, h, r + p, generator=g)
    kv = torch.randn(b, t + 1, r + p, generator=g)
    pos = torch.arange(t + 1).repeat(b, 1)
    pos[1, 5:t] = -1   # padding inside the chunk of row 1
    cache = torch.zeros(b, 16, r + p)
    chunk = ref.mla_chunk_attention(q[:, :t], kv[:, :t], cache, pos[:, :t], 0.25, r)
    ref.mla_cache_write(cache, kv[:, :t], pos[:, :t])
    ref.mla_cache_write(cache, kv[:, t:], pos[:, t:])
    step = ref.mla_decode_attention(q[:, t], cache, pos[:, t], 0.25, r)
    one = torch.zeros(b, 16, r + p)
    for i in range(t + 1):
        ref.mla_cache_write(one, kv[:, i:i + 1], pos[:, i:i + 1])
        if i < t:
            out = ref.mla_decode_attention(q[:, i], one, pos[:, i], 0.25, r)
            valid = pos[:, i] >= 0
            torch.testing.assert_close(chunk[valid, i], out[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step, ref.mla_decode_attention(q[:, t], one, pos[:, t], 0.25, r))


@pytest.mark.parametrize("groups,topk_group", [(1, 1), (4, 2)])
def test_grouped_router_is_transformers(groups, topk_group):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=groups,
                           topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    x = torch.randn(10, 16, generator=g)
    _, hf_w, hf_ids = router(x)
    w, ids = ref.grouped_sigmoid_route(x @ router.weight.T, router.e_score_correction_bias, 3, groups, topk_group,
                                       True, 2.5)
    order, hf_order = ids.sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(w.gather(-1, order.indices), hf_w.gather(-1, hf_order.indices), atol=1e-6, rtol=1e-6)


@pytest.fixture
def tri(monkeypatch):
    pytest.importorskip("triton")
    mod = get_backend("triton")
    monkeypatch.setattr(mod.attention, "ATTN_BLOCK_N", 16)   # several cache blocks on short test caches
    monkeypatch.setattr(mod.attention, "ATTN_MIN_SPLIT", 16)  # and several splits: the merge is exercised
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,rank,rope", [(4, 32, 8), (20, 64, 16)])
@pytest.mark.slow
def test_mla_decode_triton(tri, dtype, heads, rank, rope):
    g = torch.Generator().manual_seed(3)
    b, slots = 3, 45
    q = torch.randn(b, heads, rank + rope, generator=g).to(dtype)
    cache = torch.randn(b, slots, rank + rope, generator=g).to(dtype)
    pos = torch.tensor([44, 60, -1])  # the whole ring, a wrapped ring, padding
    want = ref.mla_decode_attention(q, cache, pos, 0.15, rank)
    got = tri.mla_decode_attention(q, cache, pos, 0.15, rank)
    assert got.shape == (b, heads, rank) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert got[2].abs().sum() == 0  # a padding row gets zeros
