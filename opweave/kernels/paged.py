"""Torch reference kernels for a paged KV cache: attention and writes through a block table.

A rank's full-attention layers keep their keys and values in one pool of fixed-size pages per
layer, `[pages + 1, P, Hkv, D]` (P tokens a page; the last page is the *null page*, never given to
a sequence): position p of the sequence in row b lies in page `table[b, p // P]` at slot `p % P`.
A table entry no position reaches yet holds the null page. Padding (position < 0) writes into the
null page, so a write never needs the host to pick its tokens; nothing ever reads the null page
unmasked, because a key counts only when its position is one the row has written (0 <= kp <= the
newest cached position).

`span` is how many table entries (pages) to read per row: the rows' longest sequence in pages when
the host knows it (the CPU path: reading costs what the rows hold, not the context), or the whole
table (a captured CUDA graph reads up to each row's own position in the Triton kernels,
`triton_kernels.paged`). Keys are attended in blocks of whole pages, about `ATTN_KEY_BLOCK`
tokens, with the same online softmax as the ring-buffer kernels (`reference._attend`).

Pages are gathered per block (`index_select` of the block's pages): the scratch is one block of
keys and values per row, bounded by the block size, never the context.
"""

from __future__ import annotations

import torch

from opweave.kernels.blocks import ATTN_KEY_BLOCK
from opweave.kernels.reference import _attend, to_cache


def _page_blocks(k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, span: int,
                 newest: torch.Tensor):
    """(keys [B, L, Hkv, D], values, key positions [B, L]) of each row's first `span` pages, in
    blocks of whole pages; positions past a row's `newest` cached one are -1 (masked)."""
    b, width = table.shape
    page = k_pages.shape[1]
    per_block = max(1, ATTN_KEY_BLOCK // page)
    span = min(span, width)
    for start in range(0, span, per_block):
        stop = min(start + per_block, span)
        ids = table[:, start:stop].reshape(-1).long()
        keys = k_pages.index_select(0, ids).view(b, (stop - start) * page, *k_pages.shape[2:])
        vals = v_pages.index_select(0, ids).view(b, (stop - start) * page, *v_pages.shape[2:])
        pos = torch.arange(start * page, stop * page, device=table.device).expand(b, -1)
        yield keys, vals, torch.where(pos <= newest[:, None], pos, -1)


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                           positions: torch.Tensor, scale: float, span: int,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one query token per row over its paged cache (GQA).

    Row b attends its positions 0..positions[b] (already written, this token's included); a row of
    padding (negative position) gets zeros.

    Args:
        q: [B, Hq, D]; k_pages, v_pages: [N, P, Hkv, D]; table: [B, W] int page ids.
        positions: [B] int; span: table entries to read per row (positions[b] < span * P).
        sinks: optional [Hq] sink logits (see `reference.decode_attention`).
    Returns:
        [B, Hq, D] in q's dtype.
    """
    out = _attend(q[:, None], positions[:, None], _page_blocks(k_pages, v_pages, table, span, positions),
                  scale, None, sinks)
    return out[:, 0]


def paged_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                          v_pages: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, scale: float,
                          span: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a chunk of T tokens per row over its paged cache and the chunk itself.

    The cache holds the positions before the chunk's first valid one (a prefix shared with other
    rows included; write the chunk afterwards with `paged_cache_write`), and the chunk's own keys
    are attended causally.

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; pages and table as in `paged_decode_attention`.
        positions: [B, T] int, -1 for padding; span: table entries holding the cached positions.
    Returns:
        [B, T, Hq, D] in q's dtype (zeros for padding).
    """
    t = positions.shape[1]
    first = torch.where(positions >= 0, positions, torch.iinfo(positions.dtype).max).amin(dim=1)
    cached = first - 1

    def blocks():
        yield from _page_blocks(k_pages, v_pages, table, span, cached)
        for start in range(0, t, ATTN_KEY_BLOCK):
            stop = min(start + ATTN_KEY_BLOCK, t)
            yield k[:, start:stop], v[:, start:stop], positions[:, start:stop]

    return _attend(q, positions, blocks(), scale, None, sinks)


def paged_cache_write(k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, positions: torch.Tensor) -> None:
    """Writes a step's keys and values into their pages, in place: position p of row b goes to page
    `table[b, p // P]`, slot `p % P`; padding (position < 0) goes to the null page (the pool's last),
    which nothing reads. No host synchronisation, no data-dependent shapes.

    Args:
        k_pages, v_pages: [N, P, Hkv, D]; table: [B, W] int; k, v: [B, T, Hkv, D]; positions: [B, T] int.
    """
    b, t = positions.shape
    page = k_pages.shape[1]
    null = k_pages.shape[0] - 1
    valid = positions >= 0
    pos = positions.clamp(min=0)
    entry = torch.gather(table.long(), 1, torch.div(pos, page, rounding_mode="floor").clamp(max=table.shape[1] - 1))
    pages = torch.where(valid, entry, null)
    slots = torch.where(valid, torch.remainder(pos, page), 0)
    k_pages[pages, slots] = to_cache(k, k_pages.dtype)  # an fp8 pool saturates at +-448
    v_pages[pages, slots] = to_cache(v, v_pages.dtype)



def paged_mla_decode_attention(q: torch.Tensor, kv_pages: torch.Tensor, table: torch.Tensor,
                               positions: torch.Tensor, scale: float, rank: int, span: int) -> torch.Tensor:
    """Absorbed latent attention (`reference.mla_decode_attention`) of one query token per row over
    its paged latent rows: every head attends the same rows, `[latent (rank) | rope key]`, the key
    the whole row and the value its latent part.

    Args:
        q: [B, H, rank + P]; kv_pages: [N, page, rank + P]; table: [B, W]; positions: [B] int.
    Returns:
        [B, H, rank] in q's dtype.
    """
    pool = kv_pages[:, :, None, :]
    return paged_decode_attention(q, pool, pool, table, positions, scale, span)[..., :rank]


def paged_mla_chunk_attention(q: torch.Tensor, kv: torch.Tensor, kv_pages: torch.Tensor, table: torch.Tensor,
                              positions: torch.Tensor, scale: float, rank: int, span: int) -> torch.Tensor:
    """`paged_mla_decode_attention` for a chunk: q [B, T, H, rank + P], the chunk's rows kv
    [B, T, rank + P] attended causally after the row's cached ones. Returns [B, T, H, rank]."""
    pool, rows = kv_pages[:, :, None, :], kv[:, :, None, :]
    return paged_chunk_attention(q, rows, rows, pool, pool, table, positions, scale, span)[..., :rank]


def paged_mla_cache_write(kv_pages: torch.Tensor, table: torch.Tensor, kv: torch.Tensor,
                          positions: torch.Tensor) -> None:
    """Writes a step's latent rows kv [B, T, rank + P] into their pages (`paged_cache_write`)."""
    pool, rows = kv_pages[:, :, None, :], kv[:, :, None, :]
    paged_cache_write(pool, pool, table, rows, rows, positions)  # one pool as both: the same rows twice


class PagedKV:
    """One full-attention layer's paged cache as an operator sees it for some rows: the layer's
    pools, the rows' block tables (a view of the rank's table, `[rows, W]`) and how many pages to
    read (`span`): from `lengths`, the host's tokens per slot after this round's writes (slot
    `base + r` is row r here), or the whole table without them (a captured CUDA graph: the Triton
    kernels stop at each row's own position). `rows(lo, hi)`: the same for rows [lo, hi)."""

    __slots__ = ("k_pages", "v_pages", "table", "lengths", "base", "whole")

    def __init__(self, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                 lengths: list[int] | None = None, base: int = 0, whole: bool = False):
        """`whole`: decode steps read the whole table (they may be captured in a CUDA graph);
        prefill chunks, never captured, still read only the pages `lengths` says the rows hold."""
        self.k_pages, self.v_pages, self.table, self.lengths, self.base = k_pages, v_pages, table, lengths, base
        self.whole = whole

    @property
    def span(self) -> int:
        """Table entries a decode step reads."""
        return self.table.shape[1] if self.whole else self.chunk_span

    @property
    def chunk_span(self) -> int:
        """Table entries a prefill chunk reads: the rows' longest sequence in pages (the host's count)."""
        if self.lengths is None:
            return self.table.shape[1]
        longest = max(self.lengths[self.base:self.base + self.table.shape[0]], default=0)
        return max(1, -(-longest // self.k_pages.shape[1]))

    def first_chunk(self, tokens: int) -> bool:
        """Whether these rows are one row whose chunk of `tokens` tokens is all it holds (the host's
        count; nothing cached before it): its attention is causal attention within the chunk."""
        return (self.lengths is not None and self.table.shape[0] == 1
                and self.lengths[self.base] == tokens)

    def rows(self, lo: int, hi: int) -> "PagedKV":
        return PagedKV(self.k_pages, self.v_pages, self.table[lo:hi], self.lengths, self.base + lo, self.whole)
