"""Routed experts of a rank whose attention is data-parallel inside its expert group ("dp").

A "dp" owner of G GPUs runs as G replicas of TP 1 (`passes/lower.as_replicas`): each rank computes
attention, dense layers and shared experts for its own rows, and holds E / G of the routed experts
(`shard.materialize(..., ep=)`). At each MoE layer the group's tokens meet: every rank gathers the
group's hidden states and routing (each member's packed tokens this round, padded to the longest
and all-gathered), runs the pairs routed to its own experts over all of them, and the group sums
the partial outputs (an all-reduce; each rank keeps its own tokens' rows). That is the all-gather
and reduce-scatter the planner prices (`opweave.cost.model.CostModel.op_cost`, layout "dp").

Where the plan says the all-to-all is cheaper (`PlanOwner.dispatch` "alltoall",
`opweave.cost.model.dispatch_mode`), `DispatchExperts` sends each member's tokens to every member
with the pairs routed to that member's experts alone (the others masked, so a member runs its own
pairs only), and the combine sends each member's sums for a sender's tokens back to it, which adds
them: DeepEP's dispatch and combine. Its messages have a fixed size, as DeepEP's low-latency
buffers do: every row of the sender, so no routing count is read on the host (`NoHostSync`) and a
CUDA graph could hold the step. On CPU ranks the rows a member does not need cross too; the planner
prices a kernel that sends the routed rows alone (not built). The exchange is torch.distributed's
all-to-all, or grouped point-to-point sends and receives where the backend has none.

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


FOREIGN = -1
"""The expert id of a pair another member runs (a module drops it: `RoutedExperts.local_ids`)."""


class DispatchExperts(GroupExperts):
    """`op` called on the pairs the group's members route to its experts (all-to-all dispatch and
    combine: the module docstring). `ranks`: the members' global ranks, in group order."""

    def __init__(self, op, group, members, index, counts, ranks: tuple[int, ...], comm=dist):
        super().__init__(op, group, members, index, counts, comm)
        self.ranks = ranks

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        sizes = self.tokens()
        per = self.op.num_local_experts                   # every member holds E / G consecutive experts
        dest = torch.div(ids[0], per, rounding_mode="floor")
        masked = [torch.where(dest == d, ids[0], torch.full_like(ids[0], FOREIGN)) for d in range(len(sizes))]
        got_x = self._exchange([x[0]] * len(sizes), [x.new_empty((n, x.shape[2])) for n in sizes])
        got_w = self._exchange([weights[0]] * len(sizes), [weights.new_empty((n, weights.shape[2])) for n in sizes])
        got_ids = self._exchange(masked, [ids.new_empty((n, ids.shape[2])) for n in sizes])
        out = self.op(torch.cat(got_x)[None], torch.cat(got_w)[None], torch.cat(got_ids)[None])[0]
        sums = self._exchange(list(out.split(sizes)), [out.new_empty((sizes[self.index], out.shape[1]))
                                                       for _ in sizes])
        return torch.stack(sums).sum(0)[None]

    def _exchange(self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor]) -> list[torch.Tensor]:
        """Member d receives outgoing[d]; incoming[s] fills with member s's (all-to-all)."""
        outgoing = [t.contiguous() for t in outgoing]
        if hasattr(self.comm, "all_to_all"):
            try:
                self.comm.all_to_all(incoming, outgoing, group=self.group)
                return incoming
            except RuntimeError:  # a backend without all-to-all: point to point
                self.comm = _PointToPoint(self.comm)
        return _p2p_all_to_all(self.comm, incoming, outgoing, self.ranks, self.index)


class _PointToPoint:
    """A communicator whose all-to-all is emulated (the backend's raised)."""

    def __init__(self, comm):
        self.inner = comm

    def __getattr__(self, name):
        if name == "all_to_all":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _p2p_all_to_all(comm, incoming: list[torch.Tensor], outgoing: list[torch.Tensor], ranks: tuple[int, ...],
                    index: int) -> list[torch.Tensor]:
    """All-to-all as one batch of point-to-point sends and receives (the local piece copied)."""
    incoming[index].copy_(outgoing[index])
    ops = []
    for d, rank in enumerate(ranks):
        if d != index:
            ops.append(comm.P2POp(comm.isend, outgoing[d], rank))
            ops.append(comm.P2POp(comm.irecv, incoming[d], rank))
    for work in comm.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return incoming
