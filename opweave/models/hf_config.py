"""Hugging Face `config.json` → `ModelConfig` (`config_from_hf`), one parser per family.

Supported `model_type`s: llama (Llama-2 and Llama-3), mistral, mixtral, qwen2, qwen3,
qwen3_moe, gemma3_text (and gemma3 with a `text_config`), qwen3_next, deepseek_v3 (and Kimi-K2's
kimi_k2), gpt_oss. Both the hub's legacy rope keys (`rope_theta` + `rope_scaling`) and
transformers v5's `rope_parameters` are understood.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from opweave.errors import OpWeaveError
from opweave.models.config import (DTYPE_BYTES, FULL, LAYER_TYPES, LINEAR, SLIDING, SUPPORTED_MODEL_TYPES, LinearAttnSpec,
                                   MLASpec, ModelConfig, MoESpec, RopeSpec, weight_format)


class _Fields:
    """Reads a config dict; a missing required field is a one-line error that names it."""

    def __init__(self, raw: dict[str, Any], where: str):
        self.raw = raw
        self.where = where

    def req(self, key: str) -> Any:
        if key not in self.raw or self.raw[key] is None:
            raise OpWeaveError(f"{self.where}: config is missing required field '{key}'")
        return self.raw[key]

    def get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        return default if value is None else value


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float = 0.0, mscale_all_dim: float = 0.0) -> float:
    """The scale YaRN puts on cos/sin (so on q·k twice): yarn_mscale(factor), or with both of
    DeepSeek's `mscale` and `mscale_all_dim` the ratio of the two corrections."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_fields(params: dict[str, Any], where: str) -> dict[str, Any]:
    """The yarn-only RopeSpec fields; `original_max_position_embeddings` is required."""
    if params.get("original_max_position_embeddings") is None:
        raise OpWeaveError(f"{where}: yarn rope needs 'original_max_position_embeddings'")
    if params.get("factor") is None:
        raise OpWeaveError(f"{where}: yarn rope needs 'factor'")
    factor = float(params["factor"])
    mscale, mscale_all = float(params.get("mscale") or 0.0), float(params.get("mscale_all_dim") or 0.0)
    given = params.get("attention_factor")
    return dict(
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        mscale=mscale, mscale_all_dim=mscale_all,
        attention_factor=float(given) if given is not None else yarn_attention_factor(factor, mscale, mscale_all),
    )


def _rope_spec(params: dict[str, Any], partial: float, where: str) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise OpWeaveError(f"{where}: unsupported rope_type '{rope_type}' (supported: default, linear, llama3, yarn)")
    if "rope_theta" not in params:
        raise OpWeaveError(f"{where}: config is missing required field 'rope_theta'")
    return RopeSpec(
        **(_yarn_fields(params, where) if rope_type == "yarn" else {}),
        theta=float(params["rope_theta"]),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        partial_rotary_factor=float(params.get("partial_rotary_factor", partial)),
    )


def _rope_params(f: _Fields, layer_type: str, legacy_theta_key: str = "rope_theta",
                 default_theta: float | None = None) -> dict[str, Any]:
    """Rope parameters of one layer type from either config layout; `default_theta`: the
    family's default when the config names no theta (Llama-2 checkpoints omit it)."""
    params = f.raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        if layer_type in params and isinstance(params[layer_type], dict):
            return dict(params[layer_type])
        if "rope_theta" in params or "rope_type" in params:
            return dict(params)
    out = dict(f.raw.get("rope_scaling") or {})
    if default_theta is not None and f.raw.get(legacy_theta_key) is None:
        out["rope_theta"] = default_theta
    else:
        out["rope_theta"] = f.req(legacy_theta_key)
    return out


def _layer_types(f: _Fields, n: int, default_rule) -> tuple[str, ...]:
    types = f.raw.get("layer_types")
    if types is None:
        types = [default_rule(i) for i in range(n)]
    types = tuple(types)
    if len(types) != n:
        raise OpWeaveError(f"{f.where}: layer_types has {len(types)} entries for {n} layers")
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise OpWeaveError(f"{f.where}: unsupported layer type '{bad[0]}' (supported: {', '.join(LAYER_TYPES)})")
    return types


def _dtype(f: _Fields) -> str:
    dtype = f.raw.get("torch_dtype") or f.raw.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise OpWeaveError(f"{f.where}: unsupported dtype '{dtype}' (supported: {', '.join(DTYPE_BYTES)})")
    return dtype


def _eos(f: _Fields) -> tuple[int, ...]:
    eos = f.raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _common(f: _Fields, name: str) -> dict[str, Any]:
    num_heads = int(f.req("num_attention_heads"))
    hidden = int(f.req("hidden_size"))
    head_dim = int(f.get("head_dim", hidden // num_heads))
    return dict(
        name=name,
        model_type=f.raw["model_type"],
        vocab_size=int(f.req("vocab_size")),
        hidden_size=hidden,
        num_layers=int(f.req("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(f.get("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(f.get("max_position_embeddings", 131072)),
        dtype=_dtype(f),
        eos_token_ids=_eos(f),
    )


def _llama(f: _Fields, name: str) -> ModelConfig:
    c = _common(f, name)
    n = c["num_layers"]
    if f.get("attention_bias", False) or f.get("mlp_bias", False):
        raise OpWeaveError(f"{f.where}: attention_bias / mlp_bias are not supported")
    return ModelConfig(
        family="llama", **c,
        intermediate_size=int(f.req("intermediate_size")),
        layer_types=(FULL,) * n, mlp_types=("dense",) * n, sliding_window=None,
        norm_offset=False, sandwich_norms=False, embed_scale=False,
        attn_scale=c["head_dim"] ** -0.5, qk_norm=False, attn_output_gate=False,
        hidden_act=f.get("hidden_act", "silu"),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        rope={FULL: _rope_spec(_rope_params(f, FULL, default_theta=10000.0), 1.0, f.where)},
    )


def _gemma3(f: _Fields, name: str) -> ModelConfig:
    if f.raw.get("model_type") == "gemma3":  # multimodal wrapper: use its text part
        text = dict(f.req("text_config"))
        text.setdefault("model_type", "gemma3_text")
        text.setdefault("torch_dtype", f.raw.get("torch_dtype"))
        f = _Fields(text, f.where)
    c = _common(f, name)
    n = c["num_layers"]
    pattern = int(f.get("sliding_window_pattern", f.get("_sliding_window_pattern", 6)))
    types = _layer_types(f, n, lambda i: FULL if (i + 1) % pattern == 0 else SLIDING)
    params = f.raw.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        rope = {t: _rope_spec(dict(params[t]), 1.0, f.where) for t in (FULL, SLIDING)}
    else:  # hub layout: rope_theta + rope_scaling for global layers, rope_local_base_freq for local
        rope = {
            FULL: _rope_spec(_rope_params(f, FULL), 1.0, f.where),
            SLIDING: RopeSpec(theta=float(f.get("rope_local_base_freq", 10000.0))),
        }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f.raw.get(key) is not None:
            raise OpWeaveError(f"{f.where}: {key} is not supported")
    return ModelConfig(
        family="gemma3", **c,
        intermediate_size=int(f.req("intermediate_size")),
        layer_types=types, mlp_types=("dense",) * n,
        sliding_window=int(f.req("sliding_window")),
        norm_offset=True, sandwich_norms=True, embed_scale=True,
        attn_scale=float(f.get("query_pre_attn_scalar", c["head_dim"])) ** -0.5,
        qk_norm=True, attn_output_gate=False,
        hidden_act=f.get("hidden_activation", f.get("hidden_act", "gelu_pytorch_tanh")),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", True)),
        rope=rope,
    )


def _moe_spec(f: _Fields, shared: int = 0) -> MoESpec:
    if f.raw.get("num_experts") is None and f.raw.get("num_local_experts") is not None:
        f = _Fields({**f.raw, "num_experts": f.raw["num_local_experts"]}, f.where)  # transformers' alias
    return MoESpec(
        num_experts=int(f.req("num_experts")),
        top_k=int(f.req("num_experts_per_tok")),
        intermediate_size=int(f.req("moe_intermediate_size")),
        norm_topk_prob=bool(f.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=shared,
    )


def _mlp_types(f: _Fields, n: int) -> tuple[str, ...]:
    step = int(f.get("decoder_sparse_step", 1))
    only = set(f.get("mlp_only_layers", []))
    return tuple("moe" if i not in only and step > 0 and (i + 1) % step == 0 else "dense" for i in range(n))


def _qwen3_moe(f: _Fields, name: str) -> ModelConfig:
    c = _common(f, name)
    n = c["num_layers"]
    if f.get("attention_bias", False) or f.get("use_sliding_window", False):
        raise OpWeaveError(f"{f.where}: attention_bias / use_sliding_window are not supported")
    return ModelConfig(
        family="qwen3_moe", **c,
        intermediate_size=int(f.get("intermediate_size", 0)),
        layer_types=(FULL,) * n, mlp_types=_mlp_types(f, n), sliding_window=None,
        norm_offset=False, sandwich_norms=False, embed_scale=False,
        attn_scale=c["head_dim"] ** -0.5, qk_norm=True, attn_output_gate=False,
        hidden_act=f.get("hidden_act", "silu"),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        rope={FULL: _rope_spec(_rope_params(f, FULL), 1.0, f.where)},
        moe=_moe_spec(f),
    )


def _llama_like(f: _Fields, name: str, family: str, types: tuple[str, ...], window: int | None,
                default_theta: float, **flags: Any) -> ModelConfig:
    """A Llama-shaped model (pre-norms, GQA attention, gated SiLU MLP) with the family's `flags`
    (qk_norm, qkv_bias, moe, ...); every attention layer type uses the same rope, of theta
    `default_theta` when the config names none (transformers' default for the family)."""
    c = _common(f, name)
    n = c["num_layers"]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise OpWeaveError(f"{f.where}: 'sliding_window' must be a positive integer or null, got {window!r}")
    if window is None:  # layers marked sliding without a window attend to everything
        types = tuple(FULL if t == SLIDING else t for t in types)
    if LINEAR in types:
        raise OpWeaveError(f"{f.where}: layer type 'linear_attention' is not supported by model_type "
                           f"'{c['model_type']}'")
    moe = flags.pop("moe", None)
    rope = _rope_spec(_rope_params(f, FULL, default_theta=default_theta), 1.0, f.where)
    return ModelConfig(
        family=family, **c,
        intermediate_size=0 if moe else int(f.req("intermediate_size")),
        layer_types=types, mlp_types=("moe" if moe else "dense",) * n,
        sliding_window=window if window is not None and SLIDING in types else None,
        norm_offset=False, sandwich_norms=False, embed_scale=False,
        attn_scale=c["head_dim"] ** -0.5, attn_output_gate=False,
        hidden_act=f.get("hidden_act", "silu"),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        rope={t: rope for t in (FULL, SLIDING) if t == FULL or t in types}, moe=moe,
        **{"qk_norm": False, **flags},
    )


def _mistral(f: _Fields, name: str) -> ModelConfig:
    """Mistral: Llama's layers with one sliding window (`sliding_window`, or none) on every layer."""
    window = f.raw.get("sliding_window")
    n = int(f.req("num_hidden_layers"))
    return _llama_like(f, name, "mistral", (SLIDING if window else FULL,) * n, window, 10000.0)


def _mixtral(f: _Fields, name: str) -> ModelConfig:
    """Mixtral: Mistral's attention; every FFN a top-k MoE of `num_local_experts` gated SiLU experts
    of `intermediate_size` (softmax over all experts, the k weights renormalised)."""
    window = f.raw.get("sliding_window")
    n = int(f.req("num_hidden_layers"))
    moe = MoESpec(num_experts=int(f.req("num_local_experts")), top_k=int(f.req("num_experts_per_tok")),
                  intermediate_size=int(f.req("intermediate_size")), norm_topk_prob=True)
    return _llama_like(f, name, "mixtral", (SLIDING if window else FULL,) * n, window, 1000000.0, moe=moe)


def _qwen_windows(f: _Fields) -> tuple[tuple[str, ...], int | None]:
    """Qwen2/Qwen3 layer types: with `use_sliding_window`, layers from `max_window_layers` on
    attend within `sliding_window` (or as `layer_types` lists); otherwise every layer is full."""
    n = int(f.req("num_hidden_layers"))
    window = f.raw.get("sliding_window") if f.get("use_sliding_window", False) else None
    start = int(f.get("max_window_layers", 28))
    return _layer_types(f, n, lambda i: SLIDING if window is not None and i >= start else FULL), window


def _qwen2(f: _Fields, name: str) -> ModelConfig:
    """Qwen2 / Qwen2.5: Llama's layers with a bias on the q, k and v projections."""
    types, window = _qwen_windows(f)
    return _llama_like(f, name, "qwen2", types, window, 10000.0, qkv_bias=True)


def _qwen3(f: _Fields, name: str) -> ModelConfig:
    """Qwen3 dense: Llama's layers with a per-head RMSNorm of q and k before the rotary embedding."""
    if f.get("attention_bias", False):
        raise OpWeaveError(f"{f.where}: attention_bias is not supported")
    types, window = _qwen_windows(f)
    return _llama_like(f, name, "qwen3", types, window, 10000.0, qk_norm=True)


def _qwen3_next(f: _Fields, name: str) -> ModelConfig:
    c = _common(f, name)
    n = c["num_layers"]
    interval = int(f.get("full_attention_interval", 4))
    types = _layer_types(f, n, lambda i: FULL if (i + 1) % interval == 0 else LINEAR)
    return ModelConfig(
        family="qwen3_next", **c,
        intermediate_size=int(f.get("intermediate_size", 0)),
        layer_types=types, mlp_types=_mlp_types(f, n), sliding_window=None,
        norm_offset=True, sandwich_norms=False, embed_scale=False,
        attn_scale=c["head_dim"] ** -0.5, qk_norm=True, attn_output_gate=True,
        hidden_act=f.get("hidden_act", "silu"),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        rope={FULL: _rope_spec(_rope_params(f, FULL), float(f.get("partial_rotary_factor", 0.25)), f.where)},
        moe=_moe_spec(f, shared=int(f.get("shared_expert_intermediate_size", 0))),
        linear_attn=LinearAttnSpec(
            num_key_heads=int(f.req("linear_num_key_heads")),
            num_value_heads=int(f.req("linear_num_value_heads")),
            key_head_dim=int(f.req("linear_key_head_dim")),
            value_head_dim=int(f.req("linear_value_head_dim")),
            conv_kernel_dim=int(f.get("linear_conv_kernel_dim", 4)),
        ),
    )


def _deepseek_mlp_types(f: _Fields, n: int) -> tuple[str, ...]:
    """DeepSeek's MoE layers: from `first_k_dense_replace` on, every `moe_layer_freq`-th layer
    (layer i with i % freq == 0), when the config names routed experts."""
    first = int(f.get("first_k_dense_replace", 0))
    freq = int(f.get("moe_layer_freq", 1))
    routed = f.raw.get("n_routed_experts")
    if freq <= 0:
        raise OpWeaveError(f"{f.where}: 'moe_layer_freq' must be positive, got {freq}")
    return tuple("moe" if routed and i >= first and i % freq == 0 else "dense" for i in range(n))


def mla_softmax_scale(mla: MLASpec, params: dict[str, Any]) -> float:
    """DeepSeek's softmax scale: (qk_nope + qk_rope)^-0.5, times yarn_mscale(factor,
    mscale_all_dim)^2 when a scaled rope names `mscale_all_dim` (transformers' yarn_apply_mscale)."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    rope_type = params.get("rope_type", params.get("type", "default"))
    all_dim = float(params.get("mscale_all_dim") or 0.0)
    if rope_type != "default" and all_dim:
        factor = float(params.get("factor", 1.0))
        m = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


def _deepseek_v3(f: _Fields, name: str) -> ModelConfig:
    """DeepSeek-V3 / Kimi-K2: multi-head latent attention (q LoRA, compressed KV, decoupled rope
    key), `first_k_dense_replace` dense layers, then MoE layers of sigmoid-scored, group-limited
    top-k routed experts (scaled by `routed_scaling_factor`) plus ungated shared experts."""
    if f.get("attention_bias", False):
        raise OpWeaveError(f"{f.where}: attention_bias is not supported")
    scoring = f.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise OpWeaveError(f"{f.where}: scoring_func '{scoring}' is not supported (supported: sigmoid)")
    c = _common(f, name)
    n = c["num_layers"]
    q_lora = f.raw.get("q_lora_rank")
    mla = MLASpec(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(f.req("kv_lora_rank")),
                  qk_nope_head_dim=int(f.req("qk_nope_head_dim")), qk_rope_head_dim=int(f.req("qk_rope_head_dim")),
                  v_head_dim=int(f.req("v_head_dim")), rope_interleave=bool(f.get("rope_interleave", True)))
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
        value = getattr(mla, key)
        if value is not None and value <= 0:
            raise OpWeaveError(f"{f.where}: '{key}' must be positive, got {value}")
    if mla.qk_rope_head_dim % 2:
        raise OpWeaveError(f"{f.where}: 'qk_rope_head_dim' must be even, got {mla.qk_rope_head_dim}")
    mlp_types = _deepseek_mlp_types(f, n)
    moe = None
    if "moe" in mlp_types:
        routed, groups = int(f.req("n_routed_experts")), int(f.get("n_group", 1))
        topk_group = int(f.get("topk_group", 1))
        if groups <= 0 or routed % groups or not 1 <= topk_group <= groups:
            raise OpWeaveError(f"{f.where}: n_group ({groups}) must divide n_routed_experts ({routed}) and "
                               f"topk_group ({topk_group}) be between 1 and n_group")
        if routed // groups < 2 and groups > 1:
            raise OpWeaveError(f"{f.where}: group-limited routing needs at least 2 experts per group")
        moe = MoESpec(num_experts=routed, top_k=int(f.req("num_experts_per_tok")),
                      intermediate_size=int(f.req("moe_intermediate_size")),
                      norm_topk_prob=bool(f.get("norm_topk_prob", True)),
                      shared_expert_intermediate_size=int(f.req("moe_intermediate_size")) * int(
                          f.get("n_shared_experts", 0)),
                      scoring="sigmoid", n_group=groups, topk_group=topk_group,
                      routed_scaling_factor=float(f.get("routed_scaling_factor", 1.0)), shared_expert_gated=False)
    params = _rope_params(f, FULL)
    c.update(num_kv_heads=1, head_dim=mla.qk_rope_head_dim)  # one latent "KV head"; rope acts on the rope dims
    return ModelConfig(
        family="deepseek_v3", **c,
        intermediate_size=int(f.get("intermediate_size", 0)),
        layer_types=(FULL,) * n, mlp_types=mlp_types, sliding_window=None,
        norm_offset=False, sandwich_norms=False, embed_scale=False,
        attn_scale=mla_softmax_scale(mla, params), qk_norm=False, attn_output_gate=False,
        hidden_act=f.get("hidden_act", "silu"),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        rope={FULL: _rope_spec(params, 1.0, f.where)}, moe=moe, mla=mla,
    )


GPT_OSS_SLIDING_WINDOW = 128  # transformers' GptOssConfig default (the published configs say 128 too)


def _gpt_oss_moe(f: _Fields) -> MoESpec:
    """GPT-OSS experts: `num_local_experts` clamped-SwiGLU experts of `intermediate_size`."""
    top_k = f.raw.get("num_experts_per_tok", f.raw.get("experts_per_token"))
    if top_k is None:
        raise OpWeaveError(f"{f.where}: config is missing required field 'num_experts_per_tok'")
    return MoESpec(num_experts=int(f.req("num_local_experts")), top_k=int(top_k),
                   intermediate_size=int(f.req("intermediate_size")), norm_topk_prob=True,
                   expert_style="swiglu_clamped", swiglu_alpha=float(f.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(f.get("swiglu_limit", 7.0)))


def _gpt_oss(f: _Fields, name: str) -> ModelConfig:
    """GPT-OSS: alternating sliding (128) / full attention with learned sinks and biased q/k/v/o
    projections, YaRN rope, every FFN a top-k MoE of clamped-SwiGLU experts with biases."""
    c = _common(f, name)
    c["rms_norm_eps"] = float(f.get("rms_norm_eps", 1e-5))  # GptOssConfig's default
    n = c["num_layers"]
    types = _layer_types(f, n, lambda i: SLIDING if i % 2 == 0 else FULL)
    if LINEAR in types:
        raise OpWeaveError(f"{f.where}: layer type 'linear_attention' is not supported by model_type 'gpt_oss'")
    window = f.get("sliding_window", GPT_OSS_SLIDING_WINDOW)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise OpWeaveError(f"{f.where}: 'sliding_window' must be a positive integer, got {window!r}")
    rope = _rope_spec(_rope_params(f, FULL, default_theta=150000.0), 1.0, f.where)
    bias = bool(f.get("attention_bias", True))
    return ModelConfig(
        family="gpt_oss", **c,
        intermediate_size=0,
        layer_types=types, mlp_types=("moe",) * n,
        sliding_window=window if SLIDING in types else None,
        norm_offset=False, sandwich_norms=False, embed_scale=False,
        attn_scale=c["head_dim"] ** -0.5, qk_norm=False, attn_output_gate=False,
        hidden_act="silu",
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        rope={t: rope for t in (FULL, SLIDING) if t in types},
        moe=_gpt_oss_moe(f), qkv_bias=bias, o_bias=bias, attn_sinks=True,
    )


_PARSERS = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3_text": _gemma3,
    "gemma3": _gemma3,
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen3_next,
    "deepseek_v3": _deepseek_v3,
    "kimi_k2": _deepseek_v3,   # Kimi-K2: DeepSeek-V3's architecture under its own model_type
    "gpt_oss": _gpt_oss,
}


def config_from_hf(raw: dict[str, Any], name: str, where: str | None = None) -> ModelConfig:
    """Parses a Hugging Face `config.json` dict into a `ModelConfig`.

    Args:
        raw: the parsed config.json.
        name: the model's display name.
        where: what to call the source in error messages (default: `name`).
    Raises:
        OpWeaveError: unsupported model_type, a missing field (named), or unsupported features.
    """
    where = where or name
    if not isinstance(raw, dict):
        raise OpWeaveError(f"{where}: config.json does not hold a JSON object")
    model_type = raw.get("model_type")
    if model_type is None:
        raise OpWeaveError(f"{where}: config is missing required field 'model_type'")
    if model_type not in _PARSERS:
        raise OpWeaveError(
            f"{where}: unsupported model_type '{model_type}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    cfg = _PARSERS[model_type](_Fields(raw, where), name)
    cfg = dataclasses.replace(cfg, weight_format=weight_format(raw.get("quantization_config"), where))
    _check(cfg, where)
    return cfg


def _check(cfg: ModelConfig, where: str) -> None:
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    for key in positive:
        if getattr(cfg, key) <= 0:
            raise OpWeaveError(f"{where}: '{key}' must be positive, got {getattr(cfg, key)}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise OpWeaveError(f"{where}: num_attention_heads ({cfg.num_heads}) is not a multiple of "
                           f"num_key_value_heads ({cfg.num_kv_heads})")
    if "dense" in cfg.mlp_types and cfg.intermediate_size <= 0:
        raise OpWeaveError(f"{where}: config is missing required field 'intermediate_size'")
    if cfg.moe and not 1 <= cfg.moe.top_k <= cfg.moe.num_experts:
        raise OpWeaveError(f"{where}: num_experts_per_tok ({cfg.moe.top_k}) must be between 1 and the number "
                           f"of experts ({cfg.moe.num_experts})")
    if cfg.hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise OpWeaveError(f"{where}: unsupported activation '{cfg.hidden_act}' (supported: silu, gelu_pytorch_tanh)")
