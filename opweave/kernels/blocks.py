"""The torch reference kernels' block sizes: their scratch is bounded by these, not the context.

- attention: keys in blocks of `ATTN_KEY_BLOCK` slots (online softmax), so its scores are
  [rows, q_heads, tokens, ATTN_KEY_BLOCK] float32 whatever the context
  (`opweave.kernels.reference.chunk_attention`);
- routed experts (torch path): the selected experts' weights are gathered for
  `MOE_TOKEN_BLOCK` tokens at a time (`reference.moe_experts`);
- routed experts (the grouped Triton kernel, `triton_kernels/moe.py`): the (token, expert)
  pairs of one expert go in blocks of `moe_block_pairs` pairs, each block reading the expert's
  weights once; the cost model charges the same blocks (`opweave.cost.model.expert_reads`).

The planner charges the scratch they bound (`opweave.cost.memory.op_scratch_bytes`);
`tests/test_state_alloc.py` measures a step's peak on the meta device against it.
"""

from __future__ import annotations

ATTN_KEY_BLOCK = 256
"""Keys per attention block (online softmax over the cache and the chunk)."""

MOE_TOKEN_BLOCK = 16
"""Tokens whose selected experts' weights are gathered at once by the torch experts kernel."""

MOE_BLOCK_MIN, MOE_BLOCK_MAX = 16, 128
"""The grouped MoE kernel's blocks: at least 16 pairs (the rows of a `tl.dot`), at most 128."""


def moe_block_pairs(mean_pairs: float) -> int:
    """(token, expert) pairs per block of the grouped MoE kernel when each expert expects
    `mean_pairs` pairs in a step: the power of two at or above the mean plus two standard
    deviations (binomial routing: sqrt(mean)), within [MOE_BLOCK_MIN, MOE_BLOCK_MAX]. So an
    expert's weights are read once per step for up to 128 pairs (as vLLM's fused MoE configurations
    grow BLOCK_SIZE_M with the tokens), and a small step keeps small blocks (less padded compute).
    The kernel knows the shapes only (no host synchronisation): N tokens of k experts over the E
    experts it holds give a mean of N k / E (an expert-parallel shard counts the pairs routed
    elsewhere too, so its blocks are larger)."""
    want = mean_pairs + 2.0 * mean_pairs ** 0.5 if mean_pairs > 0 else 0.0
    block = MOE_BLOCK_MIN
    while block < want and block < MOE_BLOCK_MAX:
        block *= 2
    return block
