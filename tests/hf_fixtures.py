"""Tiny random-weight Hugging Face checkpoints used as parity references.

``make_tiny_checkpoint(family, out_dir, **overrides)`` builds a small float32
transformers model (seeded with ``torch.manual_seed(0)``, so the weights are
deterministic), perturbs the norm weights (and Qwen3-Next's ``dt_bias``) away
from their constant initial values so a wrong norm convention cannot go
unnoticed, gives biases (Qwen2's q/k/v, GPT-OSS's projections and experts' `*_proj_bias`,
zeros at init) the same noise, and saves it with
``save_pretrained`` (safetensors).

``hf_generate`` and ``hf_step_logits`` load such a checkpoint with
``AutoModelForCausalLM`` (float32, eager attention) and give reference logits and
greedy continuations.

Measured float32 rounding noise of these fixtures (float32 vs float64 forward of the
same weights, 36 tokens): about 1e-6 to 3e-6 absolute on logits of magnitude 2-5,
so a from-scratch float32 reimplementation should match to ~1e-5 (use atol 1e-4
to leave margin; Qwen3-Next prefill in transformers uses the chunked delta-rule
algorithm, decode the recurrent one).

transformers is imported inside the functions because it is slow to import.
"""

from __future__ import annotations

import os

import torch

FAMILIES = ("llama", "gemma3", "qwen3_moe", "qwen3_next", "llama2", "mistral", "qwen2", "qwen3", "mixtral",
            "deepseek_v3", "gpt_oss")

# Standard deviation of the noise added to norm weights (and dt_bias, biases) after init.
_NORM_NOISE_STD = 0.1


def _gemma3_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
    ]


def _qwen3_next_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
    ]


def _base_kwargs(family: str) -> dict:
    """Config kwargs for each family, before the caller's overrides."""
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        # Overridden per family below: large enough that greedy decoding is not a constant
        # token, small enough that float32 rounding noise on the logits stays at ~1e-6.
        initializer_range=0.1,
        tie_word_embeddings=False,
        # No end-of-sequence token: greedy generation always runs max_new_tokens steps.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama":
        return dict(
            common,
            num_hidden_layers=3,
            initializer_range=0.1,
            # Not used by llama3 rope (only original_max_position_embeddings is); set like
            # Llama-3.1 so transformers does not warn about original > max.
            max_position_embeddings=131072,
            # Same rope settings as Llama-3.1.
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    if family == "gemma3":
        n = 8
        return dict(
            common,
            num_hidden_layers=n,
            layer_types=_gemma3_layer_types(n),
            sliding_window=8,
            query_pre_attn_scalar=24,
            # Tied embeddings scaled by sqrt(hidden): larger init makes greedy decode constant.
            initializer_range=0.05,
            max_position_embeddings=256,
            hidden_activation="gelu_pytorch_tanh",
            # Tied like the real Gemma 3 checkpoints.
            tie_word_embeddings=True,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            # Like gemma-3-27b: local layers theta 1e4, global layers theta 1e6 with linear scaling x8.
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        )
    if family == "qwen3_moe":
        return dict(
            common,
            num_hidden_layers=3,
            initializer_range=0.15,
            max_position_embeddings=256,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,  # as in Qwen3-30B-A3B
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if family == "qwen3_next":
        n = 5
        return dict(
            common,
            num_hidden_layers=n,
            layer_types=_qwen3_next_layer_types(n),
            # Larger init makes some gated-DeltaNet outputs nearly zero before the gated RMSNorm,
            # which amplifies float32 rounding to ~1e-4 on the logits.
            initializer_range=0.05,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
            },
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=True,  # as in Qwen3-Next-80B-A3B
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    # initializer ranges below: picked among 0.05 / 0.1 / 0.15 / 0.2 so that the 8 greedy tokens of
    # the parity tests' prompt are 7 or 8 different ones (at 0.1, Qwen2 and Mixtral repeat one token)
    llama_like = dict(common, num_hidden_layers=3, max_position_embeddings=256)
    if family == "llama2":  # multi-head attention (as many KV heads as query heads), default rope
        return dict(llama_like, num_key_value_heads=4, initializer_range=0.05,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "mistral":  # a sliding window shorter than the test prompts, on every layer
        return dict(llama_like, sliding_window=8,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":  # q/k/v biases
        return dict(llama_like, use_sliding_window=False, initializer_range=0.15,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3":  # q/k norm
        return dict(llama_like, attention_bias=False, use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "mixtral":  # 8 experts, top-2, experts of intermediate_size
        return dict(llama_like, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=None, initializer_range=0.2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "deepseek_v3":  # MLA with q LoRA, 1 dense + 2 MoE layers, group-limited sigmoid routing
        # head_dim: transformers' rotary embedding reads it as the rope dim (its config sets it so)
        return dict(common, num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, head_dim=8,
                    max_position_embeddings=256, initializer_range=0.1,
                    q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                    # yarn with DeepSeek's mscale / mscale_all_dim (softmax-scale correction), like DeepSeek-V3
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "mscale": 1.0, "mscale_all_dim": 0.8})
    if family == "gpt_oss":  # sinks, sliding/full alternating, biases, yarn (truncate off), clamped SwiGLU experts
        return dict(common, num_hidden_layers=4, sliding_window=8, max_position_embeddings=2048,  # 64 x factor 32
                    layer_types=["sliding_attention", "full_attention"] * 2, attention_bias=True,
                    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, initializer_range=0.1,
                    rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _config_and_model_classes(family: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "llama2": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[family]


def make_tiny_checkpoint(family: str, out_dir: str, **overrides) -> str:
    """Build a tiny deterministic float32 model of ``family``, save it to ``out_dir``, return ``out_dir``.

    ``overrides`` replace entries of the config kwargs (for gemma3/qwen3_next, a new
    ``num_hidden_layers`` without ``layer_types`` regenerates the default pattern).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    config_cls, model_cls = _config_and_model_classes(family)
    max_shard_size = overrides.pop("max_shard_size", None)  # e.g. "40KB": a sharded checkpoint + index

    kwargs = _base_kwargs(family)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        if family == "gemma3":
            kwargs["layer_types"] = _gemma3_layer_types(n)
        elif family == "qwen3_next":
            kwargs["layer_types"] = _qwen3_next_layer_types(n)
    kwargs.update(overrides)

    config = config_cls(**kwargs)
    config._attn_implementation = "eager"

    torch.manual_seed(0)
    model = model_cls(config)
    model = model.to(torch.float32).eval()

    # Make norm weights (stored as w or as the offset in 1 + w, zeros at init for
    # Gemma 3 / Qwen3-Next) and Qwen3-Next's dt_bias non-constant.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name and name.endswith(".weight")) or name.endswith(("dt_bias", ".bias", "_proj_bias")):
                param.add_(torch.randn_like(param) * _NORM_NOISE_STD)
        for name, buf in model.named_buffers():  # DeepSeek-V3's routing bias (zeros at init) shifts the choice
            if name.endswith("e_score_correction_bias"):
                buf.add_(torch.randn_like(buf) * _NORM_NOISE_STD)

    os.makedirs(out_dir, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    return out_dir


# ---------------------------------------------------------------- published quantized formats
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
MXFP4_QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [  # as openai/gpt-oss-120b publishes it
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes; code + 8 is the negative


def fp8_block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 `weight_scale_inv` [ceil(R/128), ceil(C/128)], the float32
    weight they decode to) of a [R, C] matrix: per 128 x 128 block (edge blocks partial), scale =
    amax / 448 (e4m3's largest value)."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    scale = torch.ones(nr, nc)
    for i in range(nr):
        for j in range(nc):
            amax = w[i * block:(i + 1) * block, j * block:(j + 1) * block].abs().max().item()
            scale[i, j] = amax / 448.0 if amax > 0 else 1.0
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    q = (w.float() / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 `_blocks` [..., N, K/32, 16], uint8 `_scales` [..., N, K/32], the float32 matrix they
    decode to) of rows [..., N, K] (K a multiple of 32): per 32 values an e8m0 exponent e with
    amax / 2^e <= 6, each value rounded to the nearest e2m1 value, two per byte, low nibble first."""
    *lead, n, k = w.shape
    x = w.float().reshape(*lead, n, k // 32, 32)
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp_min(1e-30) / 6.0)), torch.full_like(amax, -127.0))
    e = e.clamp(-127, 127)
    y = x / torch.exp2(e).unsqueeze(-1)
    mags = torch.tensor(_FP4)
    code = (y.abs().unsqueeze(-1) - mags).abs().argmin(-1) + 8 * (y < 0).long()  # ties: the smaller magnitude
    decoded = (torch.tensor(_FP4 + tuple(-m for m in _FP4))[code] * torch.exp2(e).unsqueeze(-1))
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (e + 127).to(torch.uint8), decoded.reshape(*lead, n, k)


# the published quantized formats' tiny checkpoints (the `published` fixture): sizes past one block
# where it matters: DeepSeek's dense MLP of 320 rows is 2.5 fp8 blocks (its TP 2 halves cut block 1 in
# two); GPT-OSS's hidden 96 is 3 MXFP4 groups, its expert channels 32 one group (TP 2 halves it), and
# gate_up [E, 96, 64] is not square, so a transposition shows
QUANTIZED_CASES = {"deepseek_v3": ("fp8", {"intermediate_size": 320}),
                   "gpt_oss": ("mxfp4", {"hidden_size": 96})}


def quantize_checkpoint(folder: str, method: str, out_dir: str, twin_dir: str) -> tuple[str, str]:
    """Writes `folder`'s checkpoint in a published quantized format to `out_dir` and the weights that
    decodes to, dense float32 without `quantization_config`, to `twin_dir`; returns both folders.

    method "fp8" (DeepSeek-V3 / Kimi-K2): every matrix OpWeave's `WeightFormat` says is converted
    (not embeddings, LM head, norms, router) as `X.weight` float8_e4m3fn + `X.weight_scale_inv`.
    method "mxfp4" (GPT-OSS): the experts' `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] as
    `P_blocks` / `P_scales` of the transposed matrices ([E, 2I, H/32, 16], [E, H, I/32, 16])."""
    import json

    from safetensors.torch import load_file, save_file

    from opweave.models.config import weight_format

    quant = {"fp8": FP8_QUANT, "mxfp4": MXFP4_QUANT}[method]
    converts = weight_format(quant, "fixture").converts
    tensors = {}
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(folder, name)))
    stored, dense = {}, {}
    for key, w in tensors.items():
        if method == "fp8" and w.ndim == 2 and converts(key, 2):
            stored[key], stored[key + "_scale_inv"], dense[key] = fp8_block_quantize(w)
        elif method == "mxfp4" and key.endswith((".experts.gate_up_proj", ".experts.down_proj")) and converts(key, 3):
            blocks, scales, decoded = mxfp4_quantize(w.transpose(-1, -2))
            stored[key + "_blocks"], stored[key + "_scales"] = blocks, scales
            dense[key] = decoded.transpose(-1, -2).contiguous()
        else:
            stored[key] = dense[key] = w
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    for path, weights, cfg in ((out_dir, stored, dict(config, quantization_config=quant)), (twin_dir, dense, config)):
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    return out_dir, twin_dir


def _load(out_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _generate(model, prompt_ids: list[int], max_new_tokens: int):
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    return model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
        output_scores=True,
    )


@torch.no_grad()
def hf_generate(out_dir: str, prompt_ids: list[int], max_new_tokens: int):
    """Return (prompt_logits [T, V] from one full forward, greedy new token ids)."""
    model = _load(out_dir)
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out = model(input_ids, use_cache=False)
    prompt_logits = out.logits[0].float().clone()
    gen = _generate(model, prompt_ids, max_new_tokens)
    new_ids = gen.sequences[0, len(prompt_ids):].tolist()
    return prompt_logits, new_ids


@torch.no_grad()
def hf_step_logits(out_dir: str, prompt_ids: list[int], max_new_tokens: int) -> torch.Tensor:
    """Return the raw logits of each greedy generation step, shape [max_new_tokens, V].

    Row 0 is the logits at the last prompt position (from the prefill), row i>0 the
    logits of decode step i (the input being the token chosen at step i-1),
    computed with transformers' KV cache / recurrent state.
    """
    model = _load(out_dir)
    gen = _generate(model, prompt_ids, max_new_tokens)
    return torch.cat([step.float() for step in gen.logits], dim=0)


if __name__ == "__main__":  # manual smoke run: python tests/hf_fixtures.py
    import sys
    import tempfile

    families = sys.argv[1:] or list(FAMILIES)
    prompt = [(7 * i + 3) % 200 for i in range(20)]
    for fam in families:
        with tempfile.TemporaryDirectory() as d:
            make_tiny_checkpoint(fam, d)
            logits, new_ids = hf_generate(d, prompt, 12)
            steps = hf_step_logits(d, prompt, 12)
            print(fam, tuple(logits.shape), new_ids)
            print("  step0 vs prompt[-1] max diff", (steps[0] - logits[-1]).abs().max().item())
            print("  step argmax == generated", steps.argmax(-1).tolist() == new_ids)
