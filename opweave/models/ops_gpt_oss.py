"""GPT-OSS operator modules: attention with learned sinks, the biased output projection, the
biased top-k router and the clamped-SwiGLU experts with biases.

Checkpoint keys and math follow transformers' `modeling_gpt_oss`:
  - `self_attn.sinks` [Hq]: one extra logit per head in the softmax, with a zero value;
  - `self_attn.o_proj.bias` [H]; q/k/v biases are `ops.QKVProj`'s (`qkv_bias`);
  - `mlp.router.weight` [E, H] and `mlp.router.bias` [E]: the k largest logits, softmaxed;
  - `mlp.experts.gate_up_proj` [E, H, 2I] (gate at even, up at odd columns), `gate_up_proj_bias`
    [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H].
Under tensor parallelism (`opweave.ir.tp`) the sinks split with the heads, the interleaved
gate/up columns in blocks of whole (gate, up) pairs, and the biases of the partial-sum ops
(o_proj, the experts' down projection) are held whole and added by the group's first rank only.
Under expert parallelism a rank holds a block of whole experts, each with its own biases.

MXFP4-quantised checkpoints (`*_blocks` / `*_scales` expert tensors, as published) load
dequantised: `CheckpointReader` serves `gate_up_proj_blocks` / `_scales` as the dense
`gate_up_proj` [E, H, 2I] (`opweave.models.quantized.dequantize_mxfp4`), a TP or EP shard reading
only its rows and scale groups; the module holds the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opweave.kernels import reference as K
from opweave.kernels.paged import PagedKV
from opweave.errors import OpWeaveError
from opweave.ir.facts import OpFacts
from opweave.ir.kinds import OpKind, TPRule
from opweave.models.config import SLIDING, ModelConfig
from opweave.models.ops import Attention, MoERouter, OpModule, OProj, RoutedExperts, layer_prefix, paged_attention


class SinkAttention(Attention):
    """`ops.Attention` whose softmax has a learned per-head sink logit (`self_attn.sinks`); the
    window (sliding layers) follows from the layer type, so a TP shard rebuilds from (cfg, layer)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        window = cfg.sliding_window if cfg.layer_types[layer] == SLIDING else None
        super().__init__(cfg, layer, window)
        self._param("sinks", layer_prefix(layer) + "self_attn.sinks", cfg.num_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                state: tuple[torch.Tensor, torch.Tensor] | PagedKV | None = None):
        if isinstance(state, PagedKV):
            return paged_attention(self, q, k, v, positions, state)
        c = self.cfg
        b, t = positions.shape
        k_cache, v_cache = (self.k_cache, self.v_cache) if state is None else state
        if t == 1:
            K.cache_write(k_cache, v_cache, k, v, positions)
            out = K.decode_attention(q[:, 0], k_cache, v_cache, positions[:, 0], c.attn_scale, self.window,
                                     self.sinks)
        else:
            out = K.chunk_attention(q, k, v, k_cache, v_cache, positions, c.attn_scale, self.window, self.sinks)
            K.cache_write(k_cache, v_cache, k, v, positions)
        return out.reshape(b, t, c.num_heads * c.head_dim)

    def facts(self) -> OpFacts:
        # a sink is one more exp per head and token: nothing beside the 4 * D FLOPs per cached
        # position; its Hq logits are counted as weights (read once per step)
        return super().facts()


class BiasedOProj(OProj):
    """Attention output projection with a bias (`self_attn.o_proj.bias`)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        p = layer_prefix(layer) + "self_attn."
        super().__init__(cfg, layer, p + "o_proj.weight", cfg.num_heads * cfg.head_dim)
        self._param("bias", p + "o_proj.bias", cfg.hidden_size)

    def forward(self, o: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return K.linear(o, self.weight, self.bias)

    def facts(self) -> OpFacts:
        return OpFacts(flops_per_token=2 * self.weight.numel() + self.bias.numel(), tp_rule=TPRule.ROW,
                       tp_units=self.weight.shape[1])


class GptOssRouter(MoERouter):
    """Router with a bias: the k largest of `x W^T + b`, softmaxed over those k (the same as
    `reference.moe_route` with renormalisation: a softmax over all experts restricted to the k).

    Returns (weights [B,T,k] in model dtype, expert ids [B,T,k])."""

    def __init__(self, cfg: ModelConfig, layer: int):
        OpModule.__init__(self, cfg, layer)
        p = layer_prefix(layer) + "mlp.router."
        self._param("weight", p + "weight", cfg.moe.num_experts, cfg.hidden_size)
        self._param("bias", p + "bias", cfg.moe.num_experts)

    def forward(self, x: torch.Tensor):
        weights, ids = K.moe_route(F.linear(x, self.weight, self.bias), self.cfg.moe.top_k, True)
        return weights.to(x.dtype), ids

    def facts(self) -> OpFacts:
        e = self.cfg.moe.num_experts
        return OpFacts(flops_per_token=2 * self.weight.numel() + e + 4 * e)


class GptOssExperts(RoutedExperts):
    """Routed experts with biases and the clamped SwiGLU (`reference.moe_experts_swiglu`), stored
    as in the checkpoint: `gate_up` [E, H, 2I] interleaved, `gate_up_bias` [E, 2I], `down` [E, I, H],
    `down_bias` [E, H] (E: the experts held, `RoutedExperts`)."""

    kind = OpKind.MOE_EXPERTS_SWIGLU
    stored_methods = ("mxfp4",)  # the published checkpoints' experts, held as stored on the Triton path

    def __init__(self, cfg: ModelConfig, layer: int, experts: tuple[int, int] | None = None,
                 slots: tuple[int, ...] | None = None):
        super().__init__(cfg, layer, experts, slots)
        m, p = cfg.moe, layer_prefix(layer) + "mlp.experts."
        e, h, i = self.num_local_experts, cfg.hidden_size, m.intermediate_size
        self.prefix = p
        self._param("gate_up", p + "gate_up_proj", e, h, 2 * i)
        self._param("gate_up_bias", p + "gate_up_proj_bias", e, 2 * i)
        self._param("down", p + "down_proj", e, i, h)
        self._param("down_bias", p + "down_proj_bias", e, h)

    def load_weights(self, reader) -> None:
        key = self.weight_keys["gate_up"]
        if not reader.has(key) and reader.has(key + "_blocks"):  # `CheckpointReader` serves `key` itself
            raise OpWeaveError(f"{self.cfg.name}: '{key}' is stored MXFP4-quantised ({key}_blocks/_scales) and "
                               f"this weight reader does not dequantise it (opweave.models.checkpoint does)")
        super().load_weights(reader)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_swiglu(K, self, x, weights, ids)

    def facts(self) -> OpFacts:
        m = self.cfg.moe
        active = m.top_k / m.num_experts
        # per selected expert: 2 FLOPs per matrix weight, one per bias, ~10 per channel of the
        # clamped SwiGLU (two clamps, sigmoid, three products, the + 1)
        e, h, i = self.num_local_experts, self.cfg.hidden_size, m.intermediate_size
        matrices, biases = e * h * 2 * i + e * i * h, e * 2 * i + e * h
        flops = active * (2 * matrices + biases) + m.top_k * 10 * m.intermediate_size
        return OpFacts(flops_per_token=int(flops), tp_rule=TPRule.EXPERT_FFN, tp_units=m.intermediate_size,
                       active_weight_fraction=active)


def experts_swiglu(k, op: GptOssExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`op`'s experts on kernel backend `k`: from its dense weights, or from its MXFP4 blocks and
    scales where it holds them as stored (`OpModule.hold_stored`)."""
    m = op.cfg.moe
    if op.stored == "mxfp4":
        return k.moe_experts_swiglu_mxfp4(x, weights, op.local_ids(ids), op.gate_up_values, op.gate_up_scales,
                                          op.gate_up_bias, op.down_values, op.down_scales, op.down_bias,
                                          m.swiglu_alpha, m.swiglu_limit)
    return k.moe_experts_swiglu(x, weights, op.local_ids(ids), op.gate_up, op.gate_up_bias, op.down, op.down_bias,
                                m.swiglu_alpha, m.swiglu_limit)
