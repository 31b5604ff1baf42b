"""Operator kinds, operator classes and tensor-parallel sharding rules shared by models and IR."""

import enum


class OpKind(str, enum.Enum):
    """One kind per operator module (`opweave.models.ops`); the IR names ops by these."""

    # prologue / epilogue
    EMBED = "embed"              # token embedding lookup (Gemma: scaled by sqrt(hidden))
    FINAL_NORM = "final_norm"    # RMSNorm before the LM head
    LM_HEAD = "lm_head"          # hidden -> vocabulary logits
    SAMPLE = "sample"            # greedy argmax over the logits
    # attention half of a layer
    NORM = "norm"                # RMSNorm on the residual stream (input / post-attn / pre-ffn / post-ffn)
    QKV_PROJ = "qkv_proj"        # fused q/k/v (and gate, for gated attention / Gated-DeltaNet) projection
    QK_NORM = "qk_norm"          # per-head RMSNorm on q and k
    ROPE = "rope"                # rotary position embedding on q and k (full or partial)
    ATTN_FULL = "attn_full"      # core attention over the whole context (KV grows with s)
    ATTN_SLIDING = "attn_sliding"  # core attention over the last w tokens (KV capped at w)
    ATTN_LINEAR = "attn_linear"  # Gated-DeltaNet: causal conv + delta-rule recurrence (constant state)
    ATTN_MLA = "attn_mla"        # absorbed multi-head latent attention over the latent cache (DeepSeek-V3)
    O_PROJ = "o_proj"            # output projection, optionally gated by sigmoid(gate)
    RESIDUAL = "residual"        # residual add
    # feed-forward half of a layer
    MLP_GATE_UP = "mlp_gate_up"  # fused gate/up projection of a gated MLP
    ACT = "act"                  # act(gate) * up
    MLP_DOWN = "mlp_down"        # down projection
    MOE_ROUTER = "moe_router"    # router logits -> softmax -> top-k experts and weights
    MOE_EXPERTS = "moe_experts"  # routed expert MLPs, weighted sum
    SHARED_EXPERT = "shared_expert"  # always-on expert, sigmoid-gated, added to the routed output
    MOE_EXPERTS_SWIGLU = "moe_experts_swiglu"  # routed experts with biases, clamped SwiGLU (GPT-OSS)


class OpClass(str, enum.Enum):
    """Roofline class of an operator (summary §3.1, DESIGN.md)."""

    ATTN = "ATTN"    # memory-bound, reads per-sequence state (KV cache or recurrent state)
    GEMM = "GEMM"    # weight-bound at small batch, compute-bound above b*
    LIGHT = "LIGHT"  # elementwise / reductions: small, bandwidth-bound on activations


class TPRule(str, enum.Enum):
    """How an operator shards over a tensor-parallel group of degree t."""

    REPLICATE = "replicate"  # every rank computes the whole op on the whole activation
    COLUMN = "column"        # weight split on its output dim; output stays sharded
    ROW = "row"              # weight split on its input dim; partial sums need an all-reduce
    HEADS = "heads"          # split by attention heads; state split the same way
    VOCAB = "vocab"          # LM head / sampler split on the vocabulary ((max, index) all-gather)
    EXPERT_FFN = "expert_ffn"  # each expert's intermediate dim split; partial sums all-reduced
