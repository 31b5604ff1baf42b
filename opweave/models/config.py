"""`ModelConfig`: one validated description of a decoder-only model, parsed from a Hugging Face
`config.json` (the format of real checkpoints and of OpWeave's built-in configs).

Supported `model_type`s: llama (Llama-2 and Llama-3), mistral, mixtral, qwen2, qwen3,
qwen3_moe, gemma3_text (and gemma3 with a `text_config`), qwen3_next. Both the hub's legacy rope
keys (`rope_theta` + `rope_scaling`) and transformers v5's `rope_parameters` are understood.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from opweave.errors import OpWeaveError

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma3_text", "gemma3", "qwen3_moe",
                         "qwen3_next")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RopeSpec:
    """Rotary embedding of one layer type."""

    theta: float
    rope_type: str = "default"          # default | linear | llama3
    factor: float = 1.0                 # linear and llama3 scaling factor
    low_freq_factor: float = 1.0        # llama3 only
    high_freq_factor: float = 4.0       # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only
    partial_rotary_factor: float = 1.0  # fraction of head_dim that rotates (Qwen3-Next: 0.25)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int              # per expert
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinearAttnSpec:
    """Gated-DeltaNet dimensions (Qwen3-Next)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Everything OpWeave needs to build, trace and cost a model."""

    name: str
    family: str                     # llama | mistral | mixtral | qwen2 | qwen3 | gemma3 | qwen3_moe | qwen3_next
    model_type: str                 # as in config.json
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int          # dense MLP intermediate size (0 when every layer is MoE)
    layer_types: tuple[str, ...]    # per layer: full_attention | sliding_attention | linear_attention
    mlp_types: tuple[str, ...]      # per layer: dense | moe
    sliding_window: int | None
    rms_norm_eps: float
    norm_offset: bool               # RMSNorm scales by (1 + w) instead of w (Gemma, Qwen3-Next)
    sandwich_norms: bool            # four norms per layer (Gemma-3)
    embed_scale: bool               # embeddings scaled by sqrt(hidden) (Gemma)
    attn_scale: float               # softmax scale of q·k
    qk_norm: bool
    attn_output_gate: bool          # q_proj also yields a sigmoid gate on the attention output
    hidden_act: str                 # silu | gelu_pytorch_tanh
    tie_word_embeddings: bool
    rope: dict[str, RopeSpec]       # per attention layer type (full / sliding)
    moe: MoESpec | None = None
    linear_attn: LinearAttnSpec | None = None
    qkv_bias: bool = False          # q/k/v projections carry a bias (Qwen2)
    max_position_embeddings: int = 131072
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def with_dtype(self, dtype: str) -> "ModelConfig":
        return dataclasses.replace(self, dtype=dtype)


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


def _rope_spec(params: dict[str, Any], partial: float, where: str) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise OpWeaveError(f"{where}: unsupported rope_type '{rope_type}' (supported: default, linear, llama3)")
    if "rope_theta" not in params:
        raise OpWeaveError(f"{where}: config is missing required field 'rope_theta'")
    return RopeSpec(
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
