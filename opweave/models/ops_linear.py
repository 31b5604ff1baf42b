"""Gated-DeltaNet operators (the linear-attention layers of Qwen3-Next).

A linear-attention layer is `LinearQKVProj` -> `GatedDeltaNet` -> `OProj` (see
`opweave.models.model.LinearAttentionBlock`). Notation: Hk / Dk key heads and head size, Hv / Dv
value heads and head size (Hv is a multiple of Hk; r = Hv / Hk value heads share one key head),
K the causal-conv kernel size, C = 2*Hk*Dk + Hv*Dv the conv channels (q, k and v together).

Per sequence the layer keeps constant-size state: the last K-1 conv inputs [C, K-1] (model dtype)
and one recurrent matrix S [Dk, Dv] per value head (float32). `positions` [B, T] drive it:
position 0 starts a new sequence in that slot (state reset), position < 0 is padding (state kept).
Both are applied with `torch.where`, so the ops never branch on tensor values and also run on the
meta device. Numerics follow transformers' torch fallback (the recurrence in float32); the math
is the kernel library's torch reference (`causal_conv_step`, `gdn_step`, `gated_rms_norm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opweave.kernels import reference as K
from opweave.ir.facts import OpFacts, StateSpec
from opweave.ir.kinds import OpKind, TPRule
from opweave.models.config import ModelConfig
from opweave.models.ops import OpModule, _gemm_facts, layer_prefix, torch_dtype

# flops charged for one elementwise transcendental (exp / sigmoid / silu / softplus / rsqrt)
_TRANSCENDENTAL_FLOPS = 4


class LinearQKVProj(OpModule):
    """Input projections of a Gated-DeltaNet layer (`in_proj_qkvz` and `in_proj_ba`).

    The checkpoint groups the output rows by key head: for each of the Hk key heads,
    in_proj_qkvz holds [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] and in_proj_ba holds [b (r) | a (r)].
    forward regroups them by kind and returns
    (mixed_qkv [B,T,C] = [all q | all k | all v], z [B,T,Hv,Dv], b [B,T,Hv], a [B,T,Hv])."""

    kind = OpKind.QKV_PROJ

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        la = cfg.linear_attn
        self.r = la.num_value_heads // la.num_key_heads
        p = layer_prefix(layer) + "linear_attn."
        qkvz_rows = 2 * la.num_key_heads * la.key_head_dim + 2 * la.num_value_heads * la.value_head_dim
        self._param("qkvz_weight", p + "in_proj_qkvz.weight", qkvz_rows, cfg.hidden_size)
        self._param("ba_weight", p + "in_proj_ba.weight", 2 * la.num_value_heads, cfg.hidden_size)

    def forward(self, x: torch.Tensor):
        la, r = self.cfg.linear_attn, self.r
        bsz, t, _ = x.shape
        hk, dk, hv, dv = la.num_key_heads, la.key_head_dim, la.num_value_heads, la.value_head_dim
        qkvz = F.linear(x, self.qkvz_weight).view(bsz, t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = F.linear(x, self.ba_weight).view(bsz, t, hk, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        # within a key head group the r value heads are consecutive, so flattening keeps their order
        mixed_qkv = torch.cat((q.reshape(bsz, t, hk * dk), k.reshape(bsz, t, hk * dk),
                               v.reshape(bsz, t, hv * dv)), dim=-1)
        return mixed_qkv, z.reshape(bsz, t, hv, dv), b.reshape(bsz, t, hv), a.reshape(bsz, t, hv)

    def facts(self) -> OpFacts:
        return _gemm_facts(self, TPRule.HEADS, self.cfg.linear_attn.num_key_heads)


class GatedDeltaNet(OpModule):
    """Causal depthwise conv + gated delta-rule recurrence + gated RMSNorm.

    Per token t (per value head; q, k come from the key head the value head belongs to):
        u_t      = silu(sum_j w[:, j] * x_{t-K+1+j})        causal depthwise conv over the last K inputs
        q, k, v  = split(u_t);  q <- l2norm(q) / sqrt(Dk);  k <- l2norm(k)
        beta     = sigmoid(b_t)                              write strength in (0, 1)
        g        = -exp(A_log) * softplus(a_t + dt_bias)     log of the decay, <= 0
        S        = exp(g) * S                                decay the memory
        S        = S + k (beta * (v - S^T k))^T              delta rule: correct what S predicts for k
        o_t      = S^T q
        out_t    = rmsnorm(o_t) * norm_w * silu(z_t)         per value head over Dv
    Returns out [B, T, Hv*Dv] in model dtype.
    """

    kind = OpKind.ATTN_LINEAR

    state_attrs = ("conv_state", "recurrent_state")

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        la = cfg.linear_attn
        self.hk, self.dk = la.num_key_heads, la.key_head_dim
        self.hv, self.dv = la.num_value_heads, la.value_head_dim
        self.kernel = la.conv_kernel_dim
        self.key_dim = self.hk * self.dk
        self.conv_dim = 2 * self.key_dim + self.hv * self.dv
        p = layer_prefix(layer) + "linear_attn."
        self._param("conv_weight", p + "conv1d.weight", self.conv_dim, 1, self.kernel)
        self._param("A_log", p + "A_log", self.hv)
        self._param("dt_bias", p + "dt_bias", self.hv)
        # the gated norm scales by w (not 1 + w like Qwen3-Next's residual-stream RMSNorm)
        self._param("norm_weight", p + "norm.weight", self.dv)
        self.conv_state: torch.Tensor | None = None       # [B, C, K-1], model dtype
        self.recurrent_state: torch.Tensor | None = None  # [B, Hv, Dk, Dv], float32

    def allocate_state(self, batch: int, max_len: int, device) -> None:
        self.conv_state = torch.zeros(batch, self.conv_dim, self.kernel - 1,
                                      dtype=torch_dtype(self.cfg), device=device)
        self.recurrent_state = torch.zeros(batch, self.hv, self.dk, self.dv, dtype=torch.float32, device=device)

    def forward(self, mixed_qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                positions: torch.Tensor, kernels=K,
                state: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`kernels`: the backend whose `gdn_step` runs the recurrence (the runtime passes Triton's).
        `state`: the (conv state, recurrent state) of these rows, updated in place (the runtime
        passes a microbatch's view); by default the module's own."""
        bsz, t_len, _ = mixed_qkv.shape
        conv_w = self.conv_weight[:, 0, :]                                           # [C, K]
        beta = torch.sigmoid(b).float()                                              # [B, T, Hv]
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        conv_slots, recurrent_slots = (self.conv_state, self.recurrent_state) if state is None else state
        conv, s = conv_slots, recurrent_slots
        outs = []
        for t in range(t_len):  # token by token: the same code serves prefill and decode
            pos = positions[:, t]
            u, conv = K.causal_conv_step(mixed_qkv[:, t], conv, conv_w, pos)
            q, k, v = torch.split(u, [self.key_dim, self.key_dim, self.hv * self.dv], dim=-1)
            o, s = kernels.gdn_step(q.reshape(bsz, self.hk, self.dk), k.reshape(bsz, self.hk, self.dk),
                                    v.reshape(bsz, self.hv, self.dv), log_decay[:, t], beta[:, t], s, pos)
            outs.append(o)
        conv_slots.copy_(conv)
        recurrent_slots.copy_(s)
        o = torch.stack(outs, dim=1)                                                 # [B, T, Hv, Dv]
        h = K.gated_rms_norm(o, self.norm_weight, z, self.cfg.rms_norm_eps)
        return h.reshape(bsz, t_len, self.hv * self.dv)

    def facts(self) -> OpFacts:
        c, f = self.conv_dim, _TRANSCENDENTAL_FLOPS
        hk, dk, hv, dv = self.hk, self.dk, self.hv, self.dv
        conv = 2 * self.kernel * c + f * c                 # depthwise conv (mul + add per tap) + silu
        qk_norm = 2 * hk * (3 * dk + f) + hk * dk          # l2norm of q and k, q scaled by 1/sqrt(Dk)
        gates = hv * (2 * f + 4)                           # sigmoid(b); -exp(A_log) * softplus(a + dt) -> exp
        # per value head: decay S (DkDv), S^T k (2DkDv), delta (2Dv), rank-1 update (2DkDv), S^T q (2DkDv)
        recurrence = hv * (7 * dk * dv + 2 * dv)
        norm = hv * (3 * dv + f) + hv * dv * (2 + f)       # rmsnorm over Dv, * w, * silu(z)
        state_bytes = c * (self.kernel - 1) * self.cfg.dtype_bytes + hv * dk * dv * 4
        return OpFacts(flops_per_token=conv + qk_norm + gates + recurrence + norm,
                       state=StateSpec(fixed_bytes=state_bytes, max_shards=hk),
                       tp_rule=TPRule.HEADS, tp_units=hk)
