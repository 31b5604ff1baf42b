"""The per-sequence state of a rank's stateful operators, one view per microbatch.

A stateful operator (attention's KV cache, Gated-DeltaNet's conv and recurrent state: the ops of
class ATTN, `opweave.ir.graph`) keeps its state batch-major, one slot per sequence. A rank
serves `num_microbatches` microbatches of `rows` rows each, so the state is allocated once for
all of them (`OpModule.allocate_state`, exactly what the planner counts) and each microbatch
works on its own rows: a view `[mb * rows, (mb + 1) * rows)` of every state tensor, made once
here. The generated code passes the microbatch's view to the operator (`state=`); nothing is set
on the modules while a round runs.

A view is a tuple of tensors in the module's `state_attrs` order (attention: k cache, v cache;
Gated-DeltaNet: conv state, recurrent state), or, for a full-attention layer (`paged`), a
`PagedKV`: the layer's page pools, the microbatch's rows of the rank's block table and the host's
tokens per slot. Those layers share one `PagePool` (`opweave.runtime.pages`) and one device table
`[slots, W]` int32; `apply_round` replays a round's agreed tokens and page events into the pool
and writes the changed slots' tables to the device, between rounds.
"""

from __future__ import annotations

import torch
from torch import nn

from opweave.kernels.paged import PagedKV
from opweave.runtime.pages import PagePool, decode, held_tokens

StateView = tuple[torch.Tensor, ...] | PagedKV


class RankState:
    """Views of the state of already allocated operator modules, per op and microbatch."""

    def __init__(self, modules: dict[int, nn.Module], rows: int, num_microbatches: int,
                 context: int | None = None, device=None, pages: int | None = None):
        """`context`: the planned context, which sizes the block table of the modules that keep
        pages (`allocate`); without it every module holds its state per slot. `pages`: the pool's
        pages (default: every slot at the full context, `PagePool.for_context`)."""
        self.rows, self.num_microbatches = rows, num_microbatches
        slots = rows * num_microbatches
        paged = any(getattr(m, "state_attrs", ()) and getattr(m, "paged", False) for m in modules.values())
        self.pool = pool = PagePool.for_context(slots, context, pages=pages) if paged and context is not None else None
        self.table = None
        if pool is not None:
            self.table = torch.full((slots, pool.width), pool.null, dtype=torch.int32, device=device)
        self._views: dict[int, tuple[StateView, ...]] = {}
        for i, m in modules.items():
            attrs = getattr(m, "state_attrs", ())
            if not attrs:
                continue
            full = [getattr(m, a) for a in attrs]
            if pool is not None and getattr(m, "paged", False):
                for a, t in zip(attrs, full):
                    if t is None or t.shape[0] != pool.pages + 1:
                        got = "nothing" if t is None else f"{t.shape[0]} pages"
                        raise ValueError(f"op {i}: state {a} holds {got}, not {pool.pages} + 1")
                # keys and values (MLA: its one pool of latent rows as both); on CUDA a decode step,
                # which a graph may capture, reads the whole table (the kernels stop at each row's
                # position), elsewhere and in prefill chunks the pages the rows hold
                self._views[i] = tuple(PagedKV(full[0], full[-1], self.table[mb * rows:(mb + 1) * rows],
                                               pool.lengths, mb * rows, whole=self.table.device.type == "cuda")
                                       for mb in range(num_microbatches))
                continue
            for a, t in zip(attrs, full):
                if t is None or t.shape[0] != slots:
                    got = "nothing" if t is None else f"{t.shape[0]} slots"
                    raise ValueError(f"op {i}: state {a} holds {got}, not {num_microbatches} x {rows} rows")
            self._views[i] = tuple(tuple(t[mb * rows:(mb + 1) * rows] for t in full)
                                   for mb in range(num_microbatches))

    @classmethod
    def allocate(cls, modules: dict[int, nn.Module], rows: int, num_microbatches: int, context: int,
                 device, pages: int | None = None) -> "RankState":
        """Allocates every module's state for all microbatches' rows at `context` (the pages of the
        full-attention layers: `pages`, default every slot at the full context,
        `PagePool.for_context`), then the views."""
        slots = num_microbatches * rows
        pool = PagePool.for_context(slots, context, pages=pages)
        for m in modules.values():
            if getattr(m, "paged", False):
                m.allocate_pages(pool.pages, pool.page_tokens, device)
            else:
                m.allocate_state(slots, context, device)
        return cls(modules, rows, num_microbatches, context, device, pages=pages)

    def apply_round(self, values: tuple[tuple[int, ...], ...], lo: int) -> None:
        """Between rounds: a round's control-word values (per microbatch, per global row: tokens
        and page event, `opweave.runtime.pages.encode`) for this rank's rows [lo, lo + rows), into
        the pool; the changed slots' tables to the device."""
        if self.pool is None:
            return
        for mb, row_values in enumerate(values):
            self.pool.apply_rows([(mb * self.rows + r, held_tokens(row_values[lo + r]), decode(row_values[lo + r])[1])
                                  for r in range(self.rows) if row_values[lo + r]])
        changed = self.pool.take_changed()
        if changed:
            slots = torch.tensor([s for s, _ in changed], dtype=torch.long)
            rows = torch.tensor([t for _, t in changed], dtype=torch.int32)
            if self.table.device.type == "cuda":  # pinned, asynchronous: the stream orders it after the last round
                slots, rows = slots.pin_memory(), rows.pin_memory()
                self._staged = (slots, rows)  # kept until the copy has surely run (the next round's staging)
                self.table.index_copy_(0, slots.to(self.table.device, non_blocking=True),
                                       rows.to(self.table.device, non_blocking=True))
            else:
                self.table[slots] = rows

    @property
    def ops(self) -> tuple[int, ...]:
        """The stateful operators (OpGraph indices)."""
        return tuple(self._views)

    def views(self, op: int) -> tuple[StateView, ...]:
        """The state of operator `op`, one view per microbatch (index it by microbatch)."""
        try:
            return self._views[op]
        except KeyError:
            raise KeyError(f"op {op} holds no per-sequence state on this rank") from None

    def view(self, op: int, mb: int) -> StateView:
        return self.views(op)[mb]
