"""Activation memory of one step: the block sizes the operators obey and the formula of its peak.

A step feeds each row of a microbatch at most `PREFILL_CHUNK` tokens (a prompt longer than that
is prefilled over several steps, see `opweave.runtime.scheduler`), and the operators process their
largest intermediates in blocks whose size does not depend on the context:

- attention: keys in blocks of `ATTN_KEY_BLOCK` slots (online softmax), so its scores are
  [rows, q_heads, tokens, ATTN_KEY_BLOCK] float32 whatever the context
  (`opweave.codegen.kernels.reference.chunk_attention`);
- routed experts (torch path): the selected experts' weights are gathered for
  `MOE_TOKEN_BLOCK` tokens at a time (`reference.moe_experts`).

`step_activation_bytes(cfg, rows, tokens, context, tp)` is the peak of the transient tensors one
step allocates on one rank (weights and per-sequence state excluded: those are counted by the
planner from the weights and `StateSpec`s). It is an upper bound of the torch path, which the
Triton path stays below (its attention and experts keep their blocks in registers); the planner
charges it once per rank, since a rank runs its steps one after another.
`tests/test_state_alloc.py` measures the peak on the meta device and checks the bound.
"""

from __future__ import annotations

import dataclasses

PREFILL_CHUNK = 128
"""Default tokens per row per step (a planned figure carried by each rank program). 128 tokens of
a row keep a prefill step's GEMMs efficient (rows x 128 tokens are well past the memory-bound
regime of a decode step) while a step mixing prefill and decode rows stays a few decode steps long."""

ATTN_KEY_BLOCK = 256
"""Keys per attention block (online softmax over the cache and the chunk)."""

MOE_TOKEN_BLOCK = 16
"""Tokens whose selected experts' weights are gathered at once by the torch experts kernel."""

_F32 = 4


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
    """Peak transient bytes of one step on one rank, by the op family that dominates."""

    stream: int          # residual stream values alive across every op
    attention: int       # softmax attention (largest over full / sliding layers)
    linear_attention: int  # Gated-DeltaNet (0 without)
    ffn: int             # dense MLP or MoE (+ shared expert)
    lm_head: int         # logits of every position of the step and the sampler's float copy

    @property
    def peak(self) -> int:
        return self.stream + max(self.attention, self.linear_attention, self.ffn, self.lm_head)


def _div(n: int, tp: int) -> int:
    return max(1, -(-n // tp))


def step_activation_bytes(cfg, rows: int, tokens: int, context: int, tp: int = 1) -> ActivationBytes:
    """Peak transient activation bytes of one step of `rows` sequences x `tokens` tokens each
    (tokens <= PREFILL_CHUNK for a prefill step, 1 for decode) at planned `context`, per rank of a
    TP group of `tp` (heads, intermediate sizes and vocabulary split by tp; KV heads replicated
    when tp exceeds them).

    Args:
        cfg: the model's (unsharded) `ModelConfig`.
    """
    b = cfg.dtype_bytes
    n = rows * tokens
    h = cfg.hidden_size
    stream = 3 * n * h * b

    # attention: q/k/v (projection and rotated copies), per key block the float32 scores, their
    # exponentials and mask, a float32 copy of the value block, the float32 accumulators
    hq, hkv, d = _div(cfg.num_heads, tp), _div(cfg.num_kv_heads, tp), cfg.head_dim
    windows = [context]
    if cfg.sliding_window:
        windows.append(min(context, cfg.sliding_window))
    attention = 0
    for slots in windows:
        block = min(ATTN_KEY_BLOCK, max(slots, tokens))
        qkv = 2 * n * (hq + 2 * hkv) * d * b * (2 if cfg.attn_output_gate else 1)
        scores = 3 * rows * hq * tokens * block * _F32
        kv_block = rows * hkv * block * d * (2 * b + _F32)
        acc = 3 * n * hq * d * _F32 + n * hq * d * b
        attention = max(attention, qkv + scores + kv_block + acc)

    linear = 0
    if cfg.linear_attn:
        la = cfg.linear_attn
        hk, hv = _div(la.num_key_heads, tp), _div(la.num_value_heads, tp)
        conv = 2 * hk * la.key_head_dim + hv * la.value_head_dim
        proj = n * (2 * conv + 4 * hv) * b                               # mixed qkv, z, b, a
        per_token = (4 * rows * hv * la.key_head_dim * la.value_head_dim * _F32  # S and its products
                     + 2 * rows * conv * la.conv_kernel_dim * _F32)            # conv window
        outs = n * hv * la.value_head_dim * (_F32 + 2 * b)
        linear = proj + per_token + outs

    if cfg.moe:
        m = cfg.moe
        inter = _div(m.intermediate_size, tp)
        block = min(n, MOE_TOKEN_BLOCK)
        router = 2 * n * m.num_experts * _F32
        gathered = block * m.top_k * (2 * inter * h * b + 3 * inter * b + 2 * h * b)
        shared = 3 * n * _div(m.shared_expert_intermediate_size, tp) * b if m.shared_expert_intermediate_size else 0
        ffn = router + gathered + 2 * n * h * b + shared
    else:
        ffn = 3 * n * _div(cfg.intermediate_size, tp) * b + n * h * b

    vocab = _div(cfg.vocab_size, tp)
    lm_head = n * vocab * b + rows * vocab * _F32
    return ActivationBytes(stream=stream, attention=attention, linear_attention=linear, ffn=ffn,
                           lm_head=lm_head)
