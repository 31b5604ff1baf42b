"""The per-sequence state of a rank's stateful operators, one view per microbatch.

A stateful operator (attention's KV cache, Gated-DeltaNet's conv and recurrent state: the ops of
class ATTN, `opweave.ir.graph`) keeps its state batch-major, one slot per sequence. A rank
serves `num_microbatches` microbatches of `rows` rows each, so the state is allocated once for
all of them (`OpModule.allocate_state`, exactly what the planner counts) and each microbatch
works on its own rows: a view `[mb * rows, (mb + 1) * rows)` of every state tensor, made once
here. The generated code passes the microbatch's view to the operator (`state=`); nothing is set
on the modules while a round runs.

A view is a tuple of tensors in the module's `state_attrs` order (attention: k cache, v cache;
Gated-DeltaNet: conv state, recurrent state).
"""

from __future__ import annotations

import torch
from torch import nn

StateView = tuple[torch.Tensor, ...]


class RankState:
    """Views of the state of already allocated operator modules, per op and microbatch."""

    def __init__(self, modules: dict[int, nn.Module], rows: int, num_microbatches: int):
        self.rows, self.num_microbatches = rows, num_microbatches
        self._views: dict[int, tuple[StateView, ...]] = {}
        for i, m in modules.items():
            attrs = getattr(m, "state_attrs", ())
            if not attrs:
                continue
            full = [getattr(m, a) for a in attrs]
            for a, t in zip(attrs, full):
                if t is None or t.shape[0] != rows * num_microbatches:
                    got = "nothing" if t is None else f"{t.shape[0]} slots"
                    raise ValueError(f"op {i}: state {a} holds {got}, not {num_microbatches} x {rows} rows")
            self._views[i] = tuple(tuple(t[mb * rows:(mb + 1) * rows] for t in full)
                                   for mb in range(num_microbatches))

    @classmethod
    def allocate(cls, modules: dict[int, nn.Module], rows: int, num_microbatches: int, context: int,
                 device) -> "RankState":
        """Allocates every module's state for all microbatches' rows at `context`, then the views."""
        for m in modules.values():
            m.allocate_state(num_microbatches * rows, context, device)
        return cls(modules, rows, num_microbatches)

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
