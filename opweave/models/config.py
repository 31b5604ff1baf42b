"""The model records: `ModelConfig`, one validated description of a decoder-only model, and its
parts (`RopeSpec`, `MoESpec`, `MLASpec`, `LinearAttnSpec`, `WeightFormat`).

`opweave.models.hf_config.config_from_hf` parses a Hugging Face `config.json` (the format of real
checkpoints and of OpWeave's built-in configs) into one.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any

from opweave.errors import OpWeaveError

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma3_text", "gemma3", "qwen3_moe",
                         "qwen3_next", "deepseek_v3", "kimi_k2", "gpt_oss")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_CACHE_DTYPES = ("auto", "fp8")
"""How attention keeps its keys and values: "auto" in the model's dtype; "fp8" in float8 e4m3
(`float8_e4m3fn`, scale 1: vLLM's `--kv-cache-dtype fp8` without calibrated scales), read back
into the model's dtype by the attention kernels: half a bf16 cache's bytes."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RopeSpec:
    """Rotary embedding of one layer type."""

    theta: float
    rope_type: str = "default"          # default | linear | llama3 | yarn
    factor: float = 1.0                 # linear, llama3 and yarn scaling factor
    low_freq_factor: float = 1.0        # llama3 only
    high_freq_factor: float = 4.0       # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    partial_rotary_factor: float = 1.0  # fraction of head_dim that rotates (Qwen3-Next: 0.25)
    beta_fast: float = 32.0             # yarn only: rotations bounding the extrapolated (fast) dims
    beta_slow: float = 1.0              # yarn only: rotations bounding the interpolated (slow) dims
    truncate: bool = True               # yarn only: round the correction range to whole dims
    mscale: float = 0.0                 # yarn only (DeepSeek): 0 when the config names none
    mscale_all_dim: float = 0.0         # yarn only (DeepSeek): 0 when the config names none
    attention_factor: float = 1.0       # scale of cos/sin (yarn: `yarn_attention_factor` unless given)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int              # per expert
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    # DeepSeek-V3 routing (defaults: softmax top-k, one group, unscaled, a sigmoid-gated shared expert)
    scoring: str = "softmax"            # softmax | sigmoid (sigmoid: + e_score_correction_bias for the choice)
    n_group: int = 1                    # experts in n_group groups; a token picks from its topk_group best
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    shared_expert_gated: bool = True    # False: the shared expert is added ungated (DeepSeek's shared_experts)
    # GPT-OSS experts (default: gated SiLU experts, fused [E, 2I, H] with the gate rows first)
    expert_style: str = "silu"          # silu | swiglu_clamped: router and experts with biases, softmax over the
    #                                     top-k router logits, clamped SwiGLU, [E, H, 2I] gate/up interleaved
    swiglu_alpha: float = 1.702         # swiglu_clamped only: sigmoid gain
    swiglu_limit: float = 7.0           # swiglu_clamped only: clamp of gate (above) and up (both sides)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MLASpec:
    """Multi-head latent attention dimensions (DeepSeek-V3, Kimi-K2). Per token and layer the cache
    holds the compressed latent (kv_lora_rank, after kv_a_layernorm) and one shared rope key
    (qk_rope_head_dim), whatever the number of heads."""

    q_lora_rank: int | None             # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True        # the checkpoint's rope dims are interleaved pairs (x0, x1), (x2, x3)…


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinearAttnSpec:
    """Gated-DeltaNet dimensions (Qwen3-Next)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightFormat:
    """How a published checkpoint stores its matrix weights (`quantization_config`): OpWeave plans
    the model as published, so the weight bytes the cost model reads and memory holds are these;
    activations and the KV cache keep the model's dtype. A CPU rank reads such weights dequantized,
    shard by shard (`opweave.models.quantized`); a GPU rank refuses them (block-scaled GEMMs on the
    stored format are not built).

    fp8: e4m3 values with a float32 scale per 128 x 128 block (DeepSeek-V3, Kimi-K2);
    mxfp4: 4-bit values with a one-byte scale per 32 (GPT-OSS's experts).
    Never converted: embeddings, the LM head, norms, routers, biases, attention sinks, latent
    attention's absorbed W_UK / W_UV (held dequantized) and the checkpoint's `modules_to_not_convert`."""

    method: str                               # fp8 | mxfp4
    dtype: str                                # the IR weights' dtype name (`ir.graph.DTYPE_SIZE`)
    not_converted: tuple[str, ...] = ()       # checkpoint key patterns (fnmatch), kept at the model dtype

    def converts(self, key: str, ndim: int) -> bool:
        """Whether checkpoint tensor `key` (of `ndim` dimensions) is stored in this format."""
        if ndim < 2 or _NEVER_CONVERTED.search(key):
            return False
        return not any(fnmatch.fnmatch(key, pat) or fnmatch.fnmatch(key, pat + ".*") for pat in self.not_converted)


# latent attention's absorbed halves of kv_b_proj (`ops_mla`: W_UK, W_UV, multiplied in einsums per
# head) are held at the model's dtype, dequantized on load (as vLLM and SGLang hold them)
_NEVER_CONVERTED = re.compile(
    r"(embed_tokens|lm_head|norm|\.mlp\.gate\.weight$|\.mlp\.router\.|sinks|bias|kv_b_proj\.w_u[kv]$)")


def weight_format(quant: Any, where: str) -> WeightFormat | None:
    """The `WeightFormat` of a config's `quantization_config` (None without one); a one-line
    OpWeaveError for a format OpWeave cannot plan."""
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        fmt, block = quant.get("fmt", "e4m3"), quant.get("weight_block_size")
        if fmt != "e4m3" or list(block or ()) != [128, 128]:
            raise OpWeaveError(f"{where}: quantization_config fp8 with fmt {fmt!r} and weight_block_size {block!r} "
                               "is not supported (supported: e4m3 with 128x128 blocks)")
        return WeightFormat(method="fp8", dtype="float8_e4m3fn")
    if method == "mxfp4":
        keep = quant.get("modules_to_not_convert") or ()
        if not isinstance(keep, (list, tuple)) or not all(isinstance(k, str) for k in keep):
            raise OpWeaveError(f"{where}: quantization_config modules_to_not_convert must be a list of names")
        return WeightFormat(method="mxfp4", dtype="mxfp4", not_converted=tuple(keep))
    raise OpWeaveError(f"{where}: unsupported quantization_config quant_method {method!r} (supported: fp8 with "
                       "128x128 blocks, mxfp4); remove quantization_config to plan the dequantized model")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Everything OpWeave needs to build, trace and cost a model."""

    name: str
    family: str                     # llama | mistral | mixtral | qwen2 | qwen3 | gemma3 | qwen3_moe | qwen3_next | gpt_oss
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
    mla: MLASpec | None = None      # multi-head latent attention (deepseek_v3): head_dim is then the rope dim
    qkv_bias: bool = False          # q/k/v projections carry a bias (Qwen2)
    o_bias: bool = False            # the attention output projection carries a bias (GPT-OSS)
    attn_sinks: bool = False        # attention has a learned per-head sink logit (GPT-OSS)
    max_position_embeddings: int = 131072
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    weight_format: WeightFormat | None = None  # matrix weights as published (`quantization_config`)
    kv_cache_dtype: str = "auto"    # attention's keys and values: `KV_CACHE_DTYPES`

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes of one cached key or value element (`kv_cache_dtype`)."""
        return 1 if self.kv_cache_dtype == "fp8" else self.dtype_bytes

    def with_dtype(self, dtype: str) -> "ModelConfig":
        return dataclasses.replace(self, dtype=dtype)
