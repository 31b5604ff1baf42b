"""YaRN rotary embeddings: inverse frequencies and the cos/sin attention factor against
transformers' `ROPE_INIT_FUNCTIONS["yarn"]`, the Rope operator against transformers' rotation,
and the Triton rope kernel (under TRITON_INTERPRET=1) against the torch reference."""

from __future__ import annotations

import math

import pytest
import torch

from opweave.kernels import get_backend
from opweave.errors import OpWeaveError
from opweave.models import ops
from opweave.models.config import FULL
from opweave.models.hf_config import config_from_hf, yarn_attention_factor

transformers = pytest.importorskip("transformers")

# (rope parameters, head_dim, partial rotary): GPT-OSS's (truncate false), DeepSeek-V3's (mscale
# and mscale_all_dim, truncate by default), a partial-rotary one with an explicit attention factor
CASES = [
    (dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
          original_max_position_embeddings=4096), 64, 1.0),
    (dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
          mscale_all_dim=1.0, original_max_position_embeddings=4096), 64, 1.0),
    (dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=0.707, mscale_all_dim=1.0,
          original_max_position_embeddings=4096), 128, 1.0),
    (dict(rope_type="yarn", rope_theta=1e6, factor=4.0, attention_factor=1.25,
          original_max_position_embeddings=32768), 128, 0.5),
]


def _raw(params: dict, head_dim: int, partial: float) -> dict:
    return dict(model_type="llama", vocab_size=64, hidden_size=4 * head_dim, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, intermediate_size=32,
                rope_parameters={**params, "partial_rotary_factor": partial}, max_position_embeddings=131072,
                torch_dtype="float32")


def _hf_yarn(params: dict, head_dim: int, partial: float):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                     max_position_embeddings=131072,
                     rope_parameters={**params, "partial_rotary_factor": partial})
    return ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")


@pytest.mark.parametrize("params,head_dim,partial", CASES)
def test_yarn_matches_transformers(params, head_dim, partial):
    spec = config_from_hf(_raw(params, head_dim, partial), "yarn").rope[FULL]
    assert spec.rope_type == "yarn"
    inv_freq, factor = _hf_yarn(params, head_dim, partial)
    ours = ops.rope_inv_freq(spec, head_dim)
    assert ours.shape == inv_freq.shape == (int(head_dim * partial) // 2,)
    torch.testing.assert_close(ours, inv_freq.float(), rtol=1e-6, atol=0)
    assert spec.attention_factor == pytest.approx(factor, rel=1e-12)
    if "attention_factor" not in params:  # the default one is YaRN's 0.1 ln(s) + 1 (or DeepSeek's ratio)
        assert spec.attention_factor == pytest.approx(
            yarn_attention_factor(params["factor"], params.get("mscale", 0), params.get("mscale_all_dim", 0)))


def test_yarn_stretches_only_the_slow_dims():
    spec = config_from_hf(_raw(CASES[0][0], 64, 1.0), "yarn").rope[FULL]
    base = 1.0 / (spec.theta ** (torch.arange(0, 64, 2).float() / 64))
    ours = ops.rope_inv_freq(spec, 64)
    assert torch.equal(ours[:4], base[:4])                                    # fast dims kept
    torch.testing.assert_close(ours[-4:], base[-4:] / spec.factor)           # slow dims interpolated
    assert spec.attention_factor == pytest.approx(0.1 * math.log(32.0) + 1)


def test_rope_op_matches_transformers_rotation():
    """The Rope operator (cos/sin scaled by the attention factor) against the rotation
    transformers' GPT-OSS attention applies, at positions up to 100k."""
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    params, head_dim, _ = CASES[0]
    cfg = config_from_hf(_raw(params, head_dim, 1.0), "yarn")
    rope = ops.Rope(cfg, 0, cfg.rope[FULL])
    hf_cfg = transformers.GptOssConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=head_dim, num_hidden_layers=2,
                                       rope_parameters={**params})
    emb = m.GptOssRotaryEmbedding(hf_cfg)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 4, head_dim, generator=gen), torch.randn(2, 3, 2, head_dim, generator=gen)
    positions = torch.tensor([[0, 5, 4095], [4096, 50_000, 100_000]])
    cos, sin = emb(q, positions)
    hq, hk = m.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    oq, ok = rope(q, k, positions)
    torch.testing.assert_close(oq, hq.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ok, hk.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_rope_attention_factor(dtype):
    pytest.importorskip("triton")
    tri, ref = get_backend("triton"), get_backend("torch")
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 32, generator=gen).to(dtype)
    k = torch.randn(3, 2, 32, generator=gen).to(dtype)
    pos = torch.tensor([0, 7, 3000])
    inv = 1.0 / (1e4 ** (torch.arange(0, 32, 2).float() / 32))
    want = ref.rope(q, k, pos, inv, 32, 1.3466)
    got = tri.rope(q, k, pos, inv, 32, 1.3466)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    assert not torch.allclose(want[0].float(), ref.rope(q, k, pos, inv, 32)[0].float(), atol=1e-2)


def test_yarn_config_errors():
    bad = dict(CASES[0][0])
    del bad["original_max_position_embeddings"]
    with pytest.raises(OpWeaveError, match="original_max_position_embeddings"):
        config_from_hf(_raw(bad, 64, 1.0), "yarn")
    bad = dict(CASES[0][0], rope_type="longrope")
    with pytest.raises(OpWeaveError, match="unsupported rope_type 'longrope'"):
        config_from_hf(_raw(bad, 64, 1.0), "yarn")
