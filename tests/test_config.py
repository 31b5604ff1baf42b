"""Built-in configs agree with transformers' configuration classes and with the reference data."""

import json
import os

import pytest

from opweave.errors import OpWeaveError
from opweave.models.config import FULL, LINEAR, SLIDING
from opweave.models.hf_config import config_from_hf
from opweave.models.registry import CONFIG_DIR, builtin_names, resolve

REFDATA = os.path.join(os.path.dirname(__file__), "..", "bench", "data", "reference-figures.json")


def _hf_config(name: str):
    import transformers

    raw = json.load(open(os.path.join(CONFIG_DIR, name + ".json")))
    cls = {"llama": transformers.LlamaConfig, "gemma3_text": transformers.Gemma3TextConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "qwen3_next": transformers.Qwen3NextConfig,
           "mistral": transformers.MistralConfig, "mixtral": transformers.MixtralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gpt_oss": transformers.GptOssConfig,
           "deepseek_v3": transformers.DeepseekV3Config, "kimi_k2": transformers.DeepseekV3Config}[raw["model_type"]]
    if raw["model_type"] == "kimi_k2":  # Kimi-K2: DeepSeek-V3's config class under its own model_type
        raw = {k: v for k, v in raw.items() if k != "model_type"}
    return cls(**{k: v for k, v in raw.items() if not k.startswith("_")})


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_config_matches_transformers(name):
    ours = resolve(name).cfg
    hf = _hf_config(name)
    assert ours.num_layers == hf.num_hidden_layers
    assert ours.hidden_size == hf.hidden_size
    assert ours.num_heads == hf.num_attention_heads
    # latent attention: one shared latent "KV head" (transformers keeps num_key_value_heads = heads)
    assert ours.num_kv_heads == (1 if ours.mla else hf.num_key_value_heads)
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.vocab_size == hf.vocab_size
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    # Mistral and Mixtral list no layer types: their one window (if any) applies to every layer
    every = SLIDING if getattr(hf, "sliding_window", None) else FULL
    hf_types = tuple(getattr(hf, "layer_types", None) or (every,) * hf.num_hidden_layers)
    assert ours.layer_types == hf_types
    if ours.moe:
        assert ours.moe.num_experts == (getattr(hf, "num_experts", None) or hf.n_routed_experts)
        assert ours.moe.top_k == hf.num_experts_per_tok
        assert ours.moe.intermediate_size == getattr(hf, "moe_intermediate_size", hf.intermediate_size)
    rope = hf.rope_parameters
    for layer_type, spec in ours.rope.items():
        params = rope[layer_type] if layer_type in rope else rope
        assert spec.theta == params["rope_theta"]
        assert spec.rope_type == params.get("rope_type", "default")


def test_real_model_structure():
    gemma = resolve("gemma-3-27b").cfg
    assert gemma.layer_types.count(FULL) == 10 and gemma.layer_types.count(SLIDING) == 52
    assert gemma.attn_scale == pytest.approx(168 ** -0.5)
    assert gemma.rope[FULL].rope_type == "linear" and gemma.rope[FULL].factor == 8.0
    assert gemma.rope[SLIDING].theta == 10000.0
    nxt = resolve("qwen3-next-80b-a3b").cfg
    assert nxt.layer_types.count(FULL) == 12 and nxt.layer_types.count(LINEAR) == 36
    assert nxt.rope[FULL].partial_rotary_factor == 0.25 and nxt.attn_output_gate


def test_builtin_configs_agree_with_refdata():
    ref = json.load(open(REFDATA))["models"]
    g, gr = resolve("gemma-3-27b").cfg, ref["gemma-3-27b-it_text"]
    for ours, key in ((g.num_layers, "num_hidden_layers"), (g.hidden_size, "hidden_size"),
                      (g.intermediate_size, "intermediate_size"), (g.sliding_window, "sliding_window"),
                      (g.vocab_size, "vocab_size")):
        assert ours == gr[key]["value"], key
    for name, key in (("llama-3.1-8b", "Llama-3.1-8B"), ("llama-3.1-70b", "Llama-3.1-70B"),
                      ("qwen3-30b-a3b", "Qwen3-30B-A3B")):
        c, values = resolve(name).cfg, ref[key]["values"]["value"]
        assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
            values["num_hidden_layers"], values["hidden_size"], values["num_attention_heads"],
            values["num_key_value_heads"], values["vocab_size"])


def test_missing_field_is_named():
    raw = json.load(open(os.path.join(CONFIG_DIR, "llama-3.1-8b.json")))
    del raw["hidden_size"]
    with pytest.raises(OpWeaveError, match="missing required field 'hidden_size'"):
        config_from_hf(raw, "x")


def test_unsupported_model_type_lists_supported():
    with pytest.raises(OpWeaveError, match="unsupported model_type 'gpt2'.*llama"):
        config_from_hf({"model_type": "gpt2"}, "x")


def test_hub_and_v5_rope_layouts_agree():
    legacy = json.load(open(os.path.join(CONFIG_DIR, "llama-3.1-8b.json")))
    v5 = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**legacy["rope_scaling"], "rope_theta": legacy["rope_theta"]}
    assert config_from_hf(legacy, "a").rope == config_from_hf(v5, "a").rope
