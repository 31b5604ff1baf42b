"""Routed experts of a rank whose attention is data-parallel inside its expert group ("dp").

A "dp" owner of G GPUs runs as G replicas of TP 1 (`passes/lower.as_replicas`): each rank computes
attention, dense layers and shared experts for its own rows, and holds E / G of the routed experts
(`shard.materialize(..., ep=)`). At each MoE layer the group's tokens meet: every rank gathers the
group's hidden states and routing (each member's packed tokens this round, padded to the longest
and all-gathered), runs the pairs routed to its own experts over all of them, and the group sums
the partial outputs (an all-reduce; each rank keeps its own tokens' rows). That is the all-gather
and reduce-scatter the planner prices (`opweave.cost.model.CostModel.op_cost`, layout "dp").

Every member knows every member's tokens this round from the agreed layout (the control word
holds every row of the microbatch), so no size is sent; a member none of whose rows has a token
in a microbatch that runs computes its one padding token, as every replica does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupExperts:
    """`op` (a rank's expert-parallel share of the routed experts) called on the group's tokens."""

    def __init__(self, op, group, members: tuple[tuple[int, int], ...], index: int, counts, comm=dist):
        """`members`: each member's rows (of the microbatch, global), in group order; `index`: this
        rank's place; `counts()`: the current microbatch's tokens per global row (the transport's)."""
        self.op, self.group, self.members, self.index, self.counts, self.comm = op, group, members, index, counts, comm

    def tokens(self) -> list[int]:
        """Each member's packed tokens this round (a padding token for a member with none)."""
        counts = self.counts()
        return [max(1, sum(counts[lo:hi])) for lo, hi in self.members]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        sizes = self.tokens()
        longest = max(sizes)
        gathered = [self._gather(t, sizes, longest) for t in (x, weights, ids)]
        out = self.op(*gathered)
        self.comm.all_reduce(out, group=self.group)
        start = sum(sizes[:self.index])
        return out[:, start:start + sizes[self.index]]

    def _gather(self, t: torch.Tensor, sizes: list[int], longest: int) -> torch.Tensor:
        """`t` [1, tokens, ...] of every member, in group order, as one [1, all tokens, ...]."""
        if t.shape[1] < longest:
            t = torch.cat((t, t.new_zeros((t.shape[0], longest - t.shape[1], *t.shape[2:]))), dim=1)
        parts = [torch.empty_like(t) for _ in sizes]
        self.comm.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    def __getattr__(self, name):
        return getattr(self.op, name)
