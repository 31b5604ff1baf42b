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


class ExpertCopies:
    """One MoE layer's placement over an expert group that keeps copies (every member's slots,
    `opweave.ir.experts.placement`): which copy runs a pair, the one at the token's place in the
    group modulo the expert's copies, so each copy takes an equal share. Tensor lookups only (no
    host read)."""

    def __init__(self, slots: tuple[tuple[int, ...], ...], experts: int, index: int):
        from opweave.ir.experts import copies_of

        copies = copies_of(slots, experts)
        if any(not c for c in copies):
            raise ValueError("an expert without a copy in its group")
        width = max(len(c) for c in copies)
        self.count = torch.tensor([len(c) for c in copies])
        self.rank = torch.tensor([[r for r, _ in c] + [-1] * (width - len(c)) for c in copies])
        self.slot = torch.tensor([[s for _, s in c] + [-1] * (width - len(c)) for c in copies])
        self.index, self.sentinel = index, len(slots[index])
        mine = torch.full((experts,), self.sentinel)
        mine[list(slots[index])] = torch.arange(len(slots[index]))
        self.mine = mine

    def to(self, device: torch.device) -> ExpertCopies:
        if self.count.device != device:
            for name in ("count", "rank", "slot", "mine"):
                setattr(self, name, getattr(self, name).to(device))
        return self

    def destination(self, ids: torch.Tensor, first: int) -> torch.Tensor:
        """The member that runs each pair of `ids` [tokens, k] (global expert ids) of tokens at
        places first, first + 1, ... of the group."""
        self.to(ids.device)
        places = torch.arange(first, first + ids.shape[0], device=ids.device)[:, None]
        return self.rank[ids, places % self.count[ids]]

    def local(self, ids: torch.Tensor, first: int) -> torch.Tensor:
        """This member's slot for each pair it runs, the sentinel (its slot count) for the rest."""
        return torch.where(self.destination(ids, first) == self.index, self.held(ids),
                           torch.full_like(ids, self.sentinel))

    def held(self, ids: torch.Tensor) -> torch.Tensor:
        """This member's slot of each expert id (the sentinel where it holds none, and for FOREIGN)."""
        self.to(ids.device)
        return torch.where(ids >= 0, self.mine[ids.clamp(min=0)], torch.full_like(ids, self.sentinel))


class CopiedExperts:
    """`op` (a TP group's expert-parallel slots, copies included) on the group's shared tokens:
    each pair's ids become this rank's slot where its copy runs here, the sentinel elsewhere (the
    group's all-reduce then sums the slots' outputs)."""

    def __init__(self, op, copies: ExpertCopies):
        self.op, self.copies = op, copies

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.op(x, weights, self.copies.local(ids[0], 0)[None])

    def __getattr__(self, name):
        return getattr(self.op, name)


class GroupExperts:
    """`op` (a rank's expert-parallel share of the routed experts) called on the group's tokens."""

    def __init__(self, op, group, members: tuple[tuple[int, int], ...], index: int, counts, comm=dist,
                 copies: ExpertCopies | None = None):
        """`members`: each member's rows (of the microbatch, global), in group order; `index`: this
        rank's place; `counts()`: the current microbatch's tokens per global row (the transport's);
        `copies`: the layer's placement where the group keeps copies of experts (None: E / G
        consecutive experts each)."""
        self.op, self.group, self.members, self.index, self.counts, self.comm = op, group, members, index, counts, comm
        self.copies = copies

    def tokens(self) -> list[int]:
        """Each member's packed tokens this round (a padding token for a member with none)."""
        counts = self.counts()
        return [max(1, sum(counts[lo:hi])) for lo, hi in self.members]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        sizes = self.tokens()
        longest = max(sizes)
        gathered = [self._gather(t, sizes, longest) for t in (x, weights, ids)]
        if self.copies is not None:  # this member's copies' pairs, as its slots
            gathered[2] = self.copies.local(gathered[2][0], 0)[None]
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

    def __init__(self, op, group, members, index, counts, ranks: tuple[int, ...], comm=dist,
                 copies: ExpertCopies | None = None, nodes: int = 1):
        """`nodes`: the nodes the group spans (its members split evenly over them, in order): over
        several, the exchange takes two hops (`_two_hops`)."""
        super().__init__(op, group, members, index, counts, comm, copies)
        self.ranks, self.nodes = ranks, nodes

    def _destinations(self, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The member that runs each pair of this member's `ids` [tokens, k]."""
        if self.copies is not None:   # the copy at the token's place in the group
            return self.copies.destination(ids, sum(sizes[:self.index]))
        return torch.div(ids, self.op.num_local_experts, rounding_mode="floor")  # E / G consecutive each

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        sizes = self.tokens()
        dest = self._destinations(ids[0], sizes)
        if self.nodes > 1:
            return self._two_hops(x[0], weights[0], ids[0], dest, sizes)[None]
        masked = [torch.where(dest == d, ids[0], torch.full_like(ids[0], FOREIGN)) for d in range(len(sizes))]
        got_x = self._exchange([x[0]] * len(sizes), [x.new_empty((n, x.shape[2])) for n in sizes])
        got_w = self._exchange([weights[0]] * len(sizes), [weights.new_empty((n, weights.shape[2])) for n in sizes])
        got_ids = torch.cat(self._exchange(masked, [ids.new_empty((n, ids.shape[2])) for n in sizes]))
        if self.copies is not None:   # the pairs sent here, as this member's slots
            got_ids = self.copies.held(got_ids)
        out = self.op(torch.cat(got_x)[None], torch.cat(got_w)[None], got_ids[None])[0]
        sums = self._exchange(list(out.split(sizes)), [out.new_empty((sizes[self.index], out.shape[1]))
                                                       for _ in sizes])
        return torch.stack(sums).sum(0)[None]

    def _two_hops(self, x, weights, ids, dest, sizes: list[int]) -> torch.Tensor:
        """Dispatch and combine over several nodes, as DeepEP's internode kernels: a token crosses
        to each other node it needs once, to the member of its own place there (over the NICs),
        which forwards it to the members of its node that run its pairs (over NVLink); the sums
        come back the same two hops, each adding what it receives."""
        g = len(sizes)
        m = g // self.nodes
        node, place = divmod(self.index, m)
        cross = [b * m + place for b in range(self.nodes)]       # my place on every node
        local = [node * m + j for j in range(m)]                  # my node
        foreign = torch.full_like(ids, FOREIGN)
        # hop 1: to each node, this member's tokens with that node's pairs (and their destinations)
        n1 = [sizes[c] for c in cross]
        x1 = self._among(cross, [x] * self.nodes, [x.new_empty((n, x.shape[1])) for n in n1])
        w1 = self._among(cross, [weights] * self.nodes, [weights.new_empty((n, weights.shape[1])) for n in n1])
        on = [torch.where(torch.div(dest, m, rounding_mode="floor") == b, ids, foreign) for b in range(self.nodes)]
        i1 = self._among(cross, on, [ids.new_empty((n, ids.shape[1])) for n in n1])
        d1 = self._among(cross, [dest] * self.nodes, [dest.new_empty((n, dest.shape[1])) for n in n1])
        bx, bw, bi, bd = (torch.cat(t) for t in (x1, w1, i1, d1))   # this node's share of the tokens
        # hop 2: inside the node, each member the pairs it runs
        n2 = [sum(sizes[b * m + j] for b in range(self.nodes)) for j in range(m)]
        x2 = self._among(local, [bx] * m, [bx.new_empty((n, bx.shape[1])) for n in n2])
        w2 = self._among(local, [bw] * m, [bw.new_empty((n, bw.shape[1])) for n in n2])
        i2 = self._among(local, [torch.where(bd == d, bi, torch.full_like(bi, FOREIGN)) for d in local],
                         [bi.new_empty((n, bi.shape[1])) for n in n2])
        got = torch.cat(i2)
        got = self.copies.held(got) if self.copies is not None else got
        out = self.op(torch.cat(x2)[None], torch.cat(w2)[None], got[None])[0]
        # combine: the node's sums of each forwarded token, then each node's back to the sender
        back = self._among(local, list(out.split(n2)), [out.new_empty((bx.shape[0], out.shape[1])) for _ in local])
        node_sums = torch.stack(back).sum(0)
        sums = self._among(cross, list(node_sums.split(n1)), [out.new_empty((x.shape[0], out.shape[1]))
                                                               for _ in cross])
        return torch.stack(sums).sum(0)

    def _among(self, members: list[int], outgoing: list[torch.Tensor], incoming: list[torch.Tensor]):
        """An all-to-all among some members (group places), by point-to-point sends and receives."""
        return _p2p_all_to_all(self.comm, incoming, [t.contiguous() for t in outgoing],
                               tuple(self.ranks[i] for i in members), members.index(self.index))

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
