"""Multi-head latent attention and DeepSeek-V3's MoE operators (DeepSeek-V3, Kimi-K2).

A latent-attention layer is `RMSNorm` -> `MLAProj` -> `Rope` -> `MLAAttention` -> `MLAOProj` ->
`Residual` (`MLAAttentionBlock`). Notation: H heads, Dn / Dr / Dv the no-rope query-key, rope and
value head sizes, R = kv_lora_rank, Q = q_lora_rank.

Decode runs in the absorbed form. Per token the cache holds only the latent row
[c (R, after kv_a_layernorm) | k_pe (Dr, rotated)], the same for every head. kv_b_proj, the
up-projection of c into each head's no-rope key (W_UK [H, Dn, R]) and value (W_UV [H, Dv, R]),
is never applied to the cache:

    q_abs = q_nope @ W_UK          (MLAProj: the query moved into latent space, [H, R])
    score = scale * (q_abs . c + q_pe . k_pe)      (MLAAttention: reads R + Dr values per position)
    o_lat = sum_s p_s c_s          (MLAAttention, [H, R])
    out   = o_proj(o_lat @ W_UV^T) (MLAOProj)

which is q_nope . (W_UK c) and sum_s p_s (W_UV c_s): the same model as transformers' expanded form.
Prefill chunks use the same absorbed path. The checkpoint's `kv_b_proj.weight`
[H * (Dn + Dv), R] is read by both sides, each taking its rows of every head (`load_weights`);
the IR names the two halves `kv_b_proj.w_uk` and `kv_b_proj.w_uv`, so the table shards each
with its op. With `rope_interleave` (DeepSeek's checkpoints) the rope dims come as interleaved
pairs; `MLAProj` de-interleaves them, after which the rotate-half `Rope` is exactly transformers'
interleaved rotation.

Tensor parallelism (`opweave.ir.tp`): heads split (q_b_proj rows, W_UK, W_UV, o_proj columns);
q_a_proj, kv_a_proj_with_mqa and their norms are replicated, and so is the latent cache: every
rank holds the whole cache of its sequences (`StateSpec.max_shards` 1, one "KV head").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opweave.kernels import cpu as CPUK
from opweave.kernels import paged as PK
from opweave.kernels import reference as K
from opweave.kernels.paged import PagedKV
from opweave.ir.facts import OpFacts, StateSpec
from opweave.ir.kinds import OpKind, TPRule
from opweave.models import ops
from opweave.models.config import ModelConfig
from opweave.models.ops import OpModule, _gemm_facts, kv_torch_dtype, layer_prefix, load_into

LATENT_NORM_EPS = 1e-6
"""q_a_layernorm and kv_a_layernorm use RMSNorm's default epsilon, not the config's (transformers)."""


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) on the last dim: DeepSeek's interleaved
    rope pairs in the rotate-half layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _kv_b_halves(op: OpModule, reader, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [heads, Dn, R], W_UV [heads, Dv, R]) from the checkpoint's kv_b_proj.weight (this
    rank's heads when `reader` is a TP shard reader: the table splits it by heads)."""
    mla = op.cfg.mla
    full = reader.get(op.kv_b_key)
    per_head = full.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    return per_head[:, :mla.qk_nope_head_dim], per_head[:, mla.qk_nope_head_dim:]


class MLAProj(OpModule):
    """Query and latent projections of a latent-attention layer.

    q = q_b_proj(rmsnorm(q_a_proj(x))) (or q_proj(x) without q LoRA) -> per head [q_nope | q_pe];
    [c | k_pe] = kv_a_proj_with_mqa(x), c = rmsnorm(c); q_abs = q_nope @ W_UK.
    Returns (q_abs [B,T,H,R], c [B,T,1,R], k_pe [B,T,1,Dr], q_pe [B,T,H,Dr]) with the rope parts
    in the rotate-half layout (the order of the table's q / k / v / gate outputs)."""

    kind = OpKind.QKV_PROJ
    stored_linear_weights = ("q_a_weight", "q_b_weight", "q_weight", "kv_a_weight")

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        m, h = cfg.mla, cfg.num_heads
        p = layer_prefix(layer) + "self_attn."
        q_out = h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank is not None:
            self._param("q_a_weight", p + "q_a_proj.weight", m.q_lora_rank, cfg.hidden_size)
            self._param("q_a_norm", p + "q_a_layernorm.weight", m.q_lora_rank)
            self._param("q_b_weight", p + "q_b_proj.weight", q_out, m.q_lora_rank)
        else:
            self._param("q_weight", p + "q_proj.weight", q_out, cfg.hidden_size)
        self._param("kv_a_weight", p + "kv_a_proj_with_mqa.weight", m.kv_lora_rank + m.qk_rope_head_dim,
                    cfg.hidden_size)
        self._param("kv_a_norm", p + "kv_a_layernorm.weight", m.kv_lora_rank)
        self._param("w_uk", p + "kv_b_proj.w_uk", h, m.qk_nope_head_dim, m.kv_lora_rank)
        self.kv_b_key = p + "kv_b_proj.weight"

    def load_weights(self, reader) -> None:
        if reader.has(self.weight_keys["w_uk"]):  # a reader that knows the IR's names (random weights)
            return super().load_weights(reader)
        for attr in self.weight_keys:
            if attr != "w_uk":
                self.load_attr(reader, attr)
        load_into(self.w_uk, _kv_b_halves(self, reader, self.cfg.num_heads)[0])

    def forward(self, x: torch.Tensor):
        cfg, m = self.cfg, self.cfg.mla
        b, t, _ = x.shape
        if m.q_lora_rank is not None:
            qa = K.rms_norm(K.linear(x, self.q_a_weight), self.q_a_norm, LATENT_NORM_EPS, False)
            q = K.linear(qa, self.q_b_weight)
        else:
            q = K.linear(x, self.q_weight)
        q = q.view(b, t, cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        ckv = K.linear(x, self.kv_a_weight)
        c = K.rms_norm(ckv[..., :m.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS, False)
        k_pe = ckv[..., m.kv_lora_rank:]
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_abs = torch.einsum("bthd,hdr->bthr", q_nope, self.w_uk)
        return q_abs, c.view(b, t, 1, m.kv_lora_rank), k_pe.reshape(b, t, 1, m.qk_rope_head_dim), q_pe.contiguous()

    def facts(self) -> OpFacts:
        m = self.cfg.mla
        norms = 4 * (m.kv_lora_rank + (m.q_lora_rank or 0))
        return OpFacts(flops_per_token=2 * self.weight_numel() + norms, tp_rule=TPRule.HEADS,
                       tp_units=self.cfg.num_heads, kv_heads=1)


class MLAAttention(OpModule):
    """Absorbed latent attention over the per-slot latent cache (see the module docstring).

    `kv_cache` [B, slots, R + Dr] holds position p at slot p % slots (the whole context). A
    one-token step writes its row, then attends (`mla_decode_attention`); a chunk attends the
    cache and itself (`mla_chunk_attention`), then writes its rows. Padding (position -1) writes
    nothing. Returns [B, T, H * R]."""

    kind = OpKind.ATTN_MLA
    state_attrs = ("kv_cache",)
    paged = True  # in the runtime: pages of latent rows (`allocate_pages`, `opweave.kernels.paged`)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.kv_cache: torch.Tensor | None = None

    @property
    def row(self) -> int:
        """Values one cached position holds: the latent and the rope key."""
        return self.cfg.mla.kv_lora_rank + self.cfg.mla.qk_rope_head_dim

    def allocate_state(self, batch: int, max_len: int, device) -> None:
        self.kv_cache = torch.zeros(batch, max_len, self.row, dtype=kv_torch_dtype(self.cfg), device=device)

    def allocate_pages(self, pages: int, page_tokens: int, device) -> None:
        """The layer's pool of latent rows, `[pages + 1, page_tokens, R + Dr]` (the last: the null page)."""
        self.kv_cache = torch.zeros(pages + 1, page_tokens, self.row, dtype=kv_torch_dtype(self.cfg), device=device)

    def forward(self, q_abs: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, q_pe: torch.Tensor,
                positions: torch.Tensor, kernels=K, state: tuple[torch.Tensor] | None = None) -> torch.Tensor:
        """`kernels`: the backend whose `mla_decode_attention` runs a one-token step (the runtime
        passes Triton's); `state`: (kv_cache,) of these rows, by default the module's own."""
        cfg, rank = self.cfg, self.cfg.mla.kv_lora_rank
        b, t = positions.shape
        q = torch.cat((q_abs, q_pe), dim=-1)
        kv = torch.cat((c, k_pe), dim=-1)[:, :, 0]                                    # [B, T, R + Dr]
        if isinstance(state, PagedKV):
            return _paged_mla(self, q, kv, positions, state, kernels).reshape(b, t, cfg.num_heads * rank)
        cache = self.kv_cache if state is None else state[0]
        if t == 1:
            K.mla_cache_write(cache, kv, positions)
            out = kernels.mla_decode_attention(q[:, 0].contiguous(), cache, positions[:, 0], cfg.attn_scale, rank)
        else:
            out = K.mla_chunk_attention(q, kv, cache, positions, cfg.attn_scale, rank)
            K.mla_cache_write(cache, kv, positions)
        return out.reshape(b, t, cfg.num_heads * rank)

    def facts(self) -> OpFacts:
        c, m = self.cfg, self.cfg.mla
        # per cached position, per head: q.row (R + Dr multiply-adds) and p * c (R)
        return OpFacts(
            flops_per_token=0,
            flops_per_context_token=2 * c.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim),
            state=StateSpec(bytes_per_token=self.row * c.kv_dtype_bytes, max_shards=1),
            tp_rule=TPRule.HEADS, tp_units=c.num_heads, kv_heads=1,
        )


def _paged_mla(op: MLAAttention, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
               state: PagedKV, kernels=PK) -> torch.Tensor:
    """Latent attention over paged latent rows (`opweave.kernels.paged`; `kernels`: the backend
    whose `paged_mla_decode_attention` runs a one-token step, where it has one; elsewhere, and for
    the writes, `opweave.kernels.cpu`: its C kernels on CPU tensors). Returns [B, T, H, R]."""
    cfg, rank = op.cfg, op.cfg.mla.kv_lora_rank
    pages = state.k_pages                                                             # [N, P, R + Dr]
    if positions.shape[1] == 1:
        CPUK.paged_mla_cache_write(pages, state.table, kv, positions)
        decode = getattr(kernels, "paged_mla_decode_attention", CPUK.paged_mla_decode_attention)
        return decode(q[:, 0].contiguous(), pages, state.table, positions[:, 0], cfg.attn_scale, rank,
                      state.span)[:, None]
    out = PK.paged_mla_chunk_attention(q, kv, pages, state.table, positions, cfg.attn_scale, rank,
                                       state.chunk_span)
    CPUK.paged_mla_cache_write(pages, state.table, kv, positions)
    return out


class MLAOProj(OpModule):
    """Value up-projection and output projection: o = o_proj(o_lat @ W_UV^T) per head."""

    kind = OpKind.O_PROJ
    stored_linear_weights = ("weight",)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        m, h = cfg.mla, cfg.num_heads
        p = layer_prefix(layer) + "self_attn."
        self._param("w_uv", p + "kv_b_proj.w_uv", h, m.v_head_dim, m.kv_lora_rank)
        self._param("weight", p + "o_proj.weight", cfg.hidden_size, h * m.v_head_dim)
        self.kv_b_key = p + "kv_b_proj.weight"

    def load_weights(self, reader) -> None:
        if reader.has(self.weight_keys["w_uv"]):
            return super().load_weights(reader)
        self.load_attr(reader, "weight")
        load_into(self.w_uv, _kv_b_halves(self, reader, self.cfg.num_heads)[1])

    def forward(self, o_lat: torch.Tensor) -> torch.Tensor:
        b, t, _ = o_lat.shape
        m = self.cfg.mla
        o = torch.einsum("bthr,hvr->bthv", o_lat.view(b, t, self.cfg.num_heads, m.kv_lora_rank), self.w_uv)
        return K.linear(o.reshape(b, t, -1), self.weight)

    def facts(self) -> OpFacts:
        return _gemm_facts(self, TPRule.ROW, self.cfg.num_heads)


class GroupedRouter(OpModule):
    """DeepSeek-V3's router (`grouped_sigmoid_route`): returns (weights [B,T,k] in model dtype,
    expert ids [B,T,k]). The logits are computed in float32; `e_score_correction_bias` is float32."""

    kind = OpKind.MOE_ROUTER

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        p = layer_prefix(layer) + "mlp.gate."
        self._param("weight", p + "weight", cfg.moe.num_experts, cfg.hidden_size)
        self.score_bias = nn.Parameter(torch.empty(cfg.moe.num_experts, dtype=torch.float32), requires_grad=False)
        self.weight_keys["score_bias"] = p + "e_score_correction_bias"

    def forward(self, x: torch.Tensor):
        m = self.cfg.moe
        logits = F.linear(x.float(), self.weight.float())
        weights, ids = K.grouped_sigmoid_route(logits, self.score_bias, m.top_k, m.n_group, m.topk_group,
                                               m.norm_topk_prob, m.routed_scaling_factor)
        return weights.to(x.dtype), ids

    def facts(self) -> OpFacts:
        e = self.cfg.moe.num_experts
        # logits; sigmoid, bias, group merits and masks, top-k: a few flops per expert
        return OpFacts(flops_per_token=2 * e * self.cfg.hidden_size + 8 * e)


class PlainSharedExpert(OpModule):
    """DeepSeek's shared experts (`mlp.shared_experts.*`, n_shared_experts of them fused into one
    MLP of n x moe_intermediate_size), added ungated to the routed output."""

    kind = OpKind.SHARED_EXPERT
    stored_linear_weights = ("gate_weight", "up_weight", "down_weight")

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        i, h = cfg.moe.shared_expert_intermediate_size, cfg.hidden_size
        p = layer_prefix(layer) + "mlp.shared_experts."
        self._param("gate_weight", p + "gate_proj.weight", i, h)
        self._param("up_weight", p + "up_proj.weight", i, h)
        self._param("down_weight", p + "down_proj.weight", h, i)

    def forward(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        h = K.gated_act(K.linear(x, self.gate_weight), K.linear(x, self.up_weight), self.cfg.hidden_act)
        return routed + K.linear(h, self.down_weight)

    def facts(self) -> OpFacts:
        return _gemm_facts(self, TPRule.EXPERT_FFN, self.cfg.moe.shared_expert_intermediate_size)


class MLAAttentionBlock(nn.Module):
    """norm -> MLAProj -> rope (q_pe, k_pe) -> absorbed latent attention -> W_UV + o_proj -> residual."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        p = layer_prefix(layer)
        self.norm = ops.RMSNorm(cfg, layer, p + "input_layernorm.weight")
        self.qkv = MLAProj(cfg, layer)
        self.rope = ops.Rope(cfg, layer, cfg.rope[cfg.layer_types[layer]])  # head_dim is the rope dim
        self.attn = MLAAttention(cfg, layer)
        self.o_proj = MLAOProj(cfg, layer)
        self.residual = ops.Residual(cfg, layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        proj = self.qkv(self.norm(x))
        pe = self.rope(proj[3], proj[2], positions)
        o = self.attn(proj[0], proj[1], pe[1], pe[0], positions)
        return self.residual(self.o_proj(o), x)
