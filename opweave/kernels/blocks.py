"""The torch reference kernels' block sizes: their scratch is bounded by these, not the context.

- attention: keys in blocks of `ATTN_KEY_BLOCK` slots (online softmax), so its scores are
  [rows, q_heads, tokens, ATTN_KEY_BLOCK] float32 whatever the context
  (`opweave.kernels.reference.chunk_attention`);
- routed experts (torch path): the selected experts' weights are gathered for
  `MOE_TOKEN_BLOCK` tokens at a time (`reference.moe_experts`).

The planner charges the scratch they bound (`opweave.cost.memory.op_scratch_bytes`);
`tests/test_state_alloc.py` measures a step's peak on the meta device against it.
"""

from __future__ import annotations

ATTN_KEY_BLOCK = 256
"""Keys per attention block (online softmax over the cache and the chunk)."""

MOE_TOKEN_BLOCK = 16
"""Tokens whose selected experts' weights are gathered at once by the torch experts kernel."""
