"""Decoder-only models wired from operator modules, for all supported families.

The families differ only in configuration (`ModelConfig`): which attention each layer uses,
q/k norm, sandwich norms, gated attention output, dense MLP vs MoE (+ shared expert).
`CausalLM.forward` serves both prefill (T > 1) and decode (T = 1); `DecodeStep` is the unit that
`opweave.passes.trace` traces with torch.fx: one token per sequence in, next token ids out.
"""

from __future__ import annotations

import torch
from torch import nn

from opweave.models import ops
from opweave.ir.plan import PREFILL_CHUNK
from opweave.models.config import FULL, LINEAR, SLIDING, ModelConfig


class AttentionBlock(nn.Module):
    """norm -> qkv -> [qk_norm] -> rope -> attention -> o_proj [-> post norm] -> residual."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        p = ops.layer_prefix(layer)
        layer_type = cfg.layer_types[layer]
        self.norm = ops.RMSNorm(cfg, layer, p + "input_layernorm.weight")
        self.qkv = ops.QKVProj(cfg, layer)
        self.qk_norm = ops.QKNorm(cfg, layer) if cfg.qk_norm else None
        self.rope = ops.Rope(cfg, layer, cfg.rope[layer_type])
        window = cfg.sliding_window if layer_type == SLIDING else None
        self.attn = ops.Attention(cfg, layer, window)
        self.o_proj = ops.OProj(cfg, layer, p + "self_attn.o_proj.weight", cfg.num_heads * cfg.head_dim)
        if cfg.attn_sinks or cfg.o_bias:  # GPT-OSS: learned sinks, a biased output projection
            from opweave.models import ops_gpt_oss

            if cfg.attn_sinks:
                self.attn = ops_gpt_oss.SinkAttention(cfg, layer)
            if cfg.o_bias:
                self.o_proj = ops_gpt_oss.BiasedOProj(cfg, layer)
        self.post_norm = (ops.RMSNorm(cfg, layer, p + "post_attention_layernorm.weight")
                          if cfg.sandwich_norms else None)
        self.residual = ops.Residual(cfg, layer)
        self.gated = cfg.attn_output_gate

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.norm(x))
        q, k, v, gate = qkv[0], qkv[1], qkv[2], qkv[3]
        if self.qk_norm is not None:
            qk = self.qk_norm(q, k)
            q, k = qk[0], qk[1]
        qk = self.rope(q, k, positions)
        o = self.attn(qk[0], qk[1], v, positions)
        h = self.o_proj(o, gate) if self.gated else self.o_proj(o)
        if self.post_norm is not None:
            h = self.post_norm(h)
        return self.residual(h, x)


class LinearAttentionBlock(nn.Module):
    """norm -> in_proj (qkvz, ba) -> Gated-DeltaNet -> out_proj -> residual (Qwen3-Next)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        from opweave.models import ops_linear  # Gated-DeltaNet operators

        p = ops.layer_prefix(layer)
        la = cfg.linear_attn
        self.norm = ops.RMSNorm(cfg, layer, p + "input_layernorm.weight")
        self.qkv = ops_linear.LinearQKVProj(cfg, layer)
        self.attn = ops_linear.GatedDeltaNet(cfg, layer)
        self.o_proj = ops.OProj(cfg, layer, p + "linear_attn.out_proj.weight", la.num_value_heads * la.value_head_dim)
        self.residual = ops.Residual(cfg, layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        proj = self.qkv(self.norm(x))
        o = self.attn(proj[0], proj[1], proj[2], proj[3], positions)
        return self.residual(self.o_proj(o), x)


class FeedForwardBlock(nn.Module):
    """[pre norm] -> gated MLP or MoE (+ shared expert) [-> post norm] -> residual."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        p = ops.layer_prefix(layer)
        pre_key = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
        self.norm = ops.RMSNorm(cfg, layer, f"{p}{pre_key}.weight")
        self.is_moe = cfg.mlp_types[layer] == "moe"
        if self.is_moe and cfg.moe.scoring == "sigmoid":  # DeepSeek-V3: grouped sigmoid router, plain shared experts
            from opweave.models import ops_mla

            self.router = ops_mla.GroupedRouter(cfg, layer)
            self.experts = ops.MoEExperts(cfg, layer)
            self.shared = (ops_mla.PlainSharedExpert(cfg, layer) if cfg.moe.shared_expert_intermediate_size
                           else None)
        elif self.is_moe and cfg.moe.expert_style == "swiglu_clamped":  # GPT-OSS: biased router and experts
            from opweave.models import ops_gpt_oss

            self.router = ops_gpt_oss.GptOssRouter(cfg, layer)
            self.experts = ops_gpt_oss.GptOssExperts(cfg, layer)
            self.shared = None
        elif self.is_moe:
            self.router = ops.MoERouter(cfg, layer)
            self.experts = ops.MoEExperts(cfg, layer)
            self.shared = ops.SharedExpert(cfg, layer) if cfg.moe.shared_expert_intermediate_size else None
        else:
            self.gate_up = ops.MLPGateUp(cfg, layer)
            self.act = ops.Act(cfg, layer)
            self.down = ops.MLPDown(cfg, layer)
        self.post_norm = (ops.RMSNorm(cfg, layer, p + "post_feedforward_layernorm.weight")
                          if cfg.sandwich_norms else None)
        self.residual = ops.Residual(cfg, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.is_moe:
            route = self.router(h)
            out = self.experts(h, route[0], route[1])
            if self.shared is not None:
                out = self.shared(h, out)
        else:
            gu = self.gate_up(h)
            out = self.down(self.act(gu[0], gu[1]))
        if self.post_norm is not None:
            out = self.post_norm(out)
        return self.residual(out, x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        if cfg.mla is not None:  # DeepSeek-V3: multi-head latent attention
            from opweave.models.ops_mla import MLAAttentionBlock

            self.mixer = MLAAttentionBlock(cfg, layer)
        elif cfg.layer_types[layer] == LINEAR:
            self.mixer = LinearAttentionBlock(cfg, layer)
        else:
            assert cfg.layer_types[layer] in (FULL, SLIDING)
            self.mixer = AttentionBlock(cfg, layer)
        self.ffn = FeedForwardBlock(cfg, layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.mixer(x, positions))


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head: ids [B,T], positions [B,T] -> logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = ops.Embed(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = ops.FinalNorm(cfg)
        self.lm_head = ops.LMHead(cfg, self.embed)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.final_norm(x))

    def op_modules(self) -> list[ops.OpModule]:
        return [m for m in self.modules() if isinstance(m, ops.OpModule)]

    def allocate_state(self, batch: int, max_len: int, device="cpu") -> None:
        """Allocates KV caches / recurrent state for `batch` slots of up to `max_len` tokens (each
        op exactly its `StateSpec.bytes_at(max_len)` per slot: sliding windows as ring buffers)."""
        for m in self.op_modules():
            m.allocate_state(batch, max_len, device)

    def load_weights(self, reader) -> None:
        for m in self.op_modules():
            m.load_weights(reader)


class DecodeStep(nn.Module):
    """One decode step: token ids [B,1] and positions [B,1] -> next token ids [B] (greedy)."""

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model
        self.sample = ops.Sample(model.cfg)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.sample(self.model(ids, positions))


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> CausalLM:
    """Builds the model with uninitialised weights on `device` ("meta": shapes only, no memory)."""
    with torch.device(device):
        return CausalLM(cfg)


@torch.no_grad()
def generate(model: CausalLM, prompt: list[int], max_new_tokens: int, prefill_chunk: int = PREFILL_CHUNK):
    """Greedy generation for one prompt: prefill in chunks of `prefill_chunk` tokens, then decode steps.

    Returns (logits [T + max_new_tokens - 1, V]: the prompt's, then each decode step's;
    new token ids)."""
    model.allocate_state(1, len(prompt) + max_new_tokens)
    all_logits = []
    for start in range(0, len(prompt), prefill_chunk):
        chunk = prompt[start:start + prefill_chunk]
        all_logits.append(model(torch.tensor([chunk]), torch.arange(start, start + len(chunk))[None])[0])
    tokens = [int(torch.argmax(all_logits[-1][-1]))]
    for i in range(max_new_tokens - 1):
        pos = torch.tensor([[len(prompt) + i]])
        step_logits = model(torch.tensor([[tokens[-1]]]), pos)[0]
        all_logits.append(step_logits)
        tokens.append(int(torch.argmax(step_logits[-1])))
    return torch.cat(all_logits), tokens
