"""Cost facts an operator module states about itself (the IR copies them onto each `Op`)."""

from __future__ import annotations

import dataclasses

from opweave.ir.kinds import TPRule


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StateSpec:
    """Per-sequence state of an operator as a function of context length s.

    bytes(s) = fixed_bytes + bytes_per_token * min(s, max_tokens)   (max_tokens None: uncapped)

    Full attention: bytes_per_token > 0, uncapped. Sliding window: capped at the window.
    Linear attention (Gated-DeltaNet): fixed_bytes only (conv window + recurrent matrix).
    """

    bytes_per_token: int = 0
    max_tokens: int | None = None
    fixed_bytes: int = 0
    max_shards: int = 1   # tensor parallelism splits the state at most this many ways (KV heads);
    #                       beyond it the state is replicated

    def bytes_at(self, context: int) -> int:
        tokens = context if self.max_tokens is None else min(context, self.max_tokens)
        return self.fixed_bytes + self.bytes_per_token * tokens

    def tokens_at(self, context: int) -> int:
        """Context tokens the op attends to at context length s."""
        return context if self.max_tokens is None else min(context, self.max_tokens)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OpFacts:
    """What an operator module knows about its own cost (independent of batch and hardware).

    FLOPs per token at context s = flops_per_token + flops_per_context_token * state.tokens_at(s).
    """

    flops_per_token: int
    flops_per_context_token: int = 0
    state: StateSpec | None = None
    tp_rule: TPRule = TPRule.REPLICATE
    tp_units: int = 1                 # legal TP degrees divide this (heads, experts' intermediate…)
    kv_heads: int = 0                 # KV heads of the op's k / v (0: none); TP may replicate them
    active_weight_fraction: float = 1.0  # share of the op's weights one token reads (MoE: k / E)
