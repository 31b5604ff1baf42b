"""Placement: a plan's replica sets on the cluster's nodes, first fit, node by node.

The rule: replica sets are placed one after another while a whole set fits. Within a set, owners
go in plan order and each owner's replicas in order; a replica (a TP group of `tp` GPUs, which
stays inside one node) takes the first `tp` free GPUs of the first node of its GPU type with `tp`
free; a group of several whole nodes (expert-parallel owners, `opweave.passes.search.WIDE_TP`)
takes the next untouched full nodes. GPUs no set takes are idle.

Note: cost. Groups are taken from the front of a node, so a node's free GPUs are always its last
ones and its state is one number (GPUs taken); nodes no group has reached are fresh, and a node
with fewer free GPUs than its type's smallest group is closed for good. The open nodes, counted
from the first fresh node, are all the next set depends on. Every set puts its smallest group of
a type into that type's first open node (or a fresh one), so the first open node closes within a
few sets, the open window stays short and its state soon repeats; from then on, as long as the
pools' full-size nodes last, every `period` sets repeat the same placement shifted by a fixed
number of nodes per pool. `place` simulates until the state repeats, jumps over as many whole
periods as every pool has nodes for, and simulates the rest: the work depends on the plan's
shape, not on the number of GPUs or nodes (`h100x1000000` places as fast as `h100x16`). Only
idle gaps inside closed nodes (a node size that a group size does not divide, e.g. TP 4 on a
6-GPU node) are listed one run per node, so at worst the idle list grows with the nodes.
Only replica set 0 is kept as GPU lists in the plan (what the runtime deploys); any set's GPUs
come from `Placement.replica_set(k)`, and idle GPUs are kept as runs of global indices.
"""

from __future__ import annotations

import dataclasses

from opweave.hardware.cluster import Cluster, PoolLayout
from opweave.passes.lower import replica_rows


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """What one owner needs per replica set: `replicas` TP groups of `tp` GPUs of type `gpu`."""

    gpu: str
    tp: int
    replicas: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Jump:
    """Sets `start` .. `start + repeats * period - 1` repeat sets `start - period` .. `start - 1`,
    shifted by `shift[pool]` nodes per period."""

    start: int
    period: int
    repeats: int
    shift: dict[str, int]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where every replica set sits (see the module docstring for the representation)."""

    groups: tuple[Group, ...]
    layouts: dict[str, PoolLayout]    # GPU type -> its pool's layout
    placed: tuple[tuple[int, ...], ...]  # sets simulated: first GPU of every replica, groups in order
    jump: _Jump | None
    idle: tuple[tuple[int, int], ...]  # runs [lo, hi) of global GPU indices no set takes

    @property
    def num_sets(self) -> int:
        return len(self.placed) + (self.jump.repeats * self.jump.period if self.jump else 0)

    @property
    def gpus_per_set(self) -> int:
        return sum(g.tp * g.replicas for g in self.groups)

    @property
    def num_idle(self) -> int:
        return sum(hi - lo for lo, hi in self.idle)

    def replica_set(self, k: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Set `k`'s GPUs: [group][replica] -> global GPU indices."""
        if not 0 <= k < self.num_sets:
            raise IndexError(f"replica set {k} of {self.num_sets}")
        j = self.jump
        if j is None or k < j.start:
            starts, shift = self.placed[k], None
        elif k < j.start + j.repeats * j.period:
            i = k - j.start
            starts, shift = self.placed[j.start - j.period + i % j.period], (i // j.period + 1)
        else:
            starts, shift = self.placed[k - j.repeats * j.period], None
        out, it = [], iter(starts)
        for g in self.groups:
            offset = 0 if shift is None else shift * j.shift[g.gpu] * self.layouts[g.gpu].per_node
            firsts = [next(it) + offset for _ in range(g.replicas)]
            out.append(tuple(tuple(range(first, first + g.tp)) for first in firsts))
        return tuple(out)


class _Pool:
    """First-fit state of one GPU type: the fresh frontier and the open nodes (pool-local)."""

    def __init__(self, layout: PoolLayout, min_tp: int):
        self.layout, self.min_tp = layout, min_tp
        self.fresh = 0                       # nodes >= fresh are untouched
        self.open: list[list[int]] = []      # [node, GPUs taken] of touched nodes with room, in node order
        self.closed_idle: list[tuple[int, int]] = []  # idle runs of closed nodes, global indices

    def take(self, tp: int) -> int | None:
        """The first GPU of a group of `tp` on the first node with room, or None. A group larger
        than a node (a whole number of them, expert-parallel owners) takes the next fresh full
        nodes."""
        if tp > self.layout.per_node:
            nodes = tp // self.layout.per_node
            if tp % self.layout.per_node or self.fresh + nodes > self.layout.num_full_nodes:
                return None
            first = self.layout.gpu(self.fresh, 0)
            self.fresh += nodes
            return first
        for entry in self.open:
            node, taken = entry
            if self.layout.node_size(node) - taken >= tp:
                entry[1] += tp
                return self.layout.gpu(node, taken)
        while self.fresh < self.layout.num_nodes:
            node = self.fresh
            self.fresh += 1
            fits = self.layout.node_size(node) >= tp  # only a pool's last, partial node can be too small
            self.open.append([node, tp if fits else 0])
            if fits:
                return self.layout.gpu(node, 0)
        return None

    def close(self) -> None:
        """Drops the nodes no group of this type fits in any more (their free GPUs stay idle)."""
        keep = []
        for node, taken in self.open:
            size = self.layout.node_size(node)
            if size - taken >= self.min_tp:
                keep.append([node, taken])
            elif taken < size:
                self.closed_idle.append((self.layout.gpu(node, taken), self.layout.gpu(node, size)))
        self.open = keep

    def snapshot(self) -> tuple:
        return self.fresh, [list(e) for e in self.open], len(self.closed_idle)

    def restore(self, snap: tuple) -> None:
        self.fresh, self.open = snap[0], snap[1]
        del self.closed_idle[snap[2]:]

    def signature(self) -> tuple:
        """The open nodes relative to the frontier: all the next set's placement depends on."""
        return tuple((node - self.fresh, taken) for node, taken in self.open)

    def advance(self, nodes: int, runs: list[tuple[int, int]], times: int) -> None:
        """Moves the state `times` x `nodes` nodes on, as if the period that left `runs` idle in
        closed nodes had run `times` more times."""
        step = nodes * self.layout.per_node
        self.closed_idle += [(lo + t * step, hi + t * step) for t in range(1, times + 1) for lo, hi in runs]
        self.fresh += times * nodes
        self.open = [[node + times * nodes, taken] for node, taken in self.open]

    def idle(self) -> list[tuple[int, int]]:
        runs = list(self.closed_idle)
        runs += [(self.layout.gpu(n, t), self.layout.gpu(n, self.layout.node_size(n)))
                 for n, t in self.open if t < self.layout.node_size(n)]
        if self.fresh < self.layout.num_nodes:
            runs.append((self.layout.gpu(self.fresh, 0), self.layout.first_gpu + self.layout.count))
        return runs


def _place_set(pools: dict[str, _Pool], order: list[tuple[str, int]]) -> tuple[int, ...] | None:
    """One replica set (first GPU of each group, in `order`), or None with the state unchanged."""
    snaps = {name: p.snapshot() for name, p in pools.items()}
    starts = []
    for name, tp in order:
        start = pools[name].take(tp)
        if start is None:
            for n, p in pools.items():
                p.restore(snaps[n])
            return None
        starts.append(start)
    for p in pools.values():
        p.close()
    return tuple(starts)


def _jump(pools: dict[str, _Pool], seen: tuple[int, dict[str, int], dict[str, int]], placed: int) -> _Jump:
    """Skips the whole periods every pool's full-size nodes hold, from a state first seen after
    `seen[0]` sets (with frontiers `seen[1]` and closed-run counts `seen[2]`)."""
    then, fresh_then, runs_then = seen
    shift = {name: p.fresh - fresh_then[name] for name, p in pools.items()}
    repeats = min((p.layout.num_full_nodes - p.fresh) // shift[name] for name, p in pools.items())
    repeats = max(repeats, 0)
    for name, p in pools.items():
        p.advance(shift[name], p.closed_idle[runs_then[name]:], repeats)
    return _Jump(start=placed, period=placed - then, repeats=repeats, shift=shift)


def _merge(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(runs):
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def place(groups: tuple[Group, ...], cluster: Cluster) -> Placement:
    """Every replica set of `groups` that fits on `cluster` (first fit; module docstring).

    Each used pool's state only moves forward, and the state repeats within a number of sets
    bounded by the plan's shape (module docstring), so the cost does not grow with the cluster."""
    layouts = {layout.gpu_name: layout for layout in cluster.layouts()}
    used = {g.gpu for g in groups}
    if not groups or any(g.replicas < 1 or g.tp < 1 for g in groups) or not used <= set(layouts):
        raise ValueError(f"groups {groups} are not a plan's owners on {cluster.spec}")
    pools = {name: _Pool(layout, min(g.tp for g in groups if g.gpu == name))
             for name, layout in layouts.items() if name in used}
    order = [(g.gpu, g.tp) for g in groups for _ in range(g.replicas)]
    placed: list[tuple[int, ...]] = []
    seen: dict[tuple, tuple[int, dict[str, int], dict[str, int]]] = {}
    jump = None
    while (starts := _place_set(pools, order)) is not None:
        placed.append(starts)
        if jump is None:
            key = tuple(p.signature() for p in pools.values())
            if key in seen:
                jump = _jump(pools, seen[key], len(placed))
            else:
                seen[key] = (len(placed), {n: p.fresh for n, p in pools.items()},
                             {n: len(p.closed_idle) for n, p in pools.items()})
    idle = [run for p in pools.values() for run in p.idle()]
    idle += [(layout.first_gpu, layout.first_gpu + layout.count) for name, layout in layouts.items() if name not in used]
    return Placement(groups=tuple(groups), layouts=layouts, placed=tuple(placed), jump=jump, idle=_merge(idle))


def format_placement(where: Placement) -> str:
    """Readable placement (`OPWEAVE_DEBUG_DIR` dump): replica sets, set 0's GPUs, the idle runs."""
    lines = [f"placement: {where.num_sets:,} replica set(s) of {where.gpus_per_set} GPUs, {where.num_idle:,} idle"]
    if where.jump is not None:
        j = where.jump
        lines.append(f"  sets {j.start}..{j.start + j.repeats * j.period - 1} repeat the {j.period} before them, "
                     f"shifted by {dict(sorted(j.shift.items()))} nodes per period")
    if where.num_sets:
        for g, replicas in zip(where.groups, where.replica_set(0)):
            lines.append(f"  {g.replicas}x {g.gpu} tp{g.tp}: " + " ".join(f"[{r[0]}..{r[-1]}]" for r in replicas))
    lines.append("  idle: " + (" ".join(f"[{lo}..{hi - 1}]" for lo, hi in where.idle) or "none"))
    return "\n".join(lines)


def verify_placement(where: Placement, cluster) -> Placement:
    """Checks a placement's invariants on `cluster`; returns it or raises `IRError`: in the first
    and last replica sets every TP group sits inside one node of its GPU type (or fills whole
    nodes of it), and no GPU is taken twice or also listed idle."""
    from opweave.ir.graph import IRError

    idle = [(lo, hi) for lo, hi in where.idle]
    taken: dict[int, str] = {}
    for k in sorted({0, where.num_sets - 1} - {-1}):
        for g, replicas in zip(where.groups, where.replica_set(k)):
            for j, gpus in enumerate(replicas):
                nodes = {cluster.locate(x).node_index for x in gpus}
                kinds = {cluster.pools[cluster.locate(x).pool_index].gpu.name for x in gpus}
                here = f"set {k} {g.gpu} tp{g.tp} replica {j}"
                per_node = where.layouts[g.gpu].per_node
                whole = g.tp > per_node and g.tp % per_node == 0 and len(nodes) == g.tp // per_node \
                    and all(cluster.locate(x).local_index == i % per_node for i, x in enumerate(gpus))
                if (len(nodes) != 1 and not whole) or kinds != {g.gpu}:
                    raise IRError(f"{here} spans nodes {sorted(nodes)} of types {sorted(kinds)}")
                for x in gpus:
                    if x in taken:
                        raise IRError(f"GPU {x} is taken by {taken[x]} and by {here}")
                    if any(lo <= x < hi for lo, hi in idle):
                        raise IRError(f"GPU {x} of {here} is also listed idle")
                    taken[x] = here
    return where


def simulated_sets(where: Placement) -> range | list[int]:
    """Indices of the replica sets `place` simulated; the others repeat one of them shifted by whole
    nodes of every pool, so which GPUs share a node is the same."""
    j = where.jump
    if j is None:
        return range(where.num_sets)
    return list(range(j.start)) + list(range(j.start + j.repeats * j.period, where.num_sets))


def transfer_locality(where: Placement, cluster: Cluster, rows: int) -> dict[tuple[int, int], bool]:
    """For every pair of owners (groups) (a, b), True when every transfer between them is inside a
    node: in every replica set, each replica of `a` and each replica of `b` whose microbatch rows
    overlap (a microbatch of `rows` sequences, split as the lowering splits it) sit in one node.
    A replica's TP group inside one node is located by any of its GPUs (the port of any cut); one
    of several whole nodes is in no single node, so its transfers cross nodes. Pairs of different
    GPU types are never inside a node. Empty when no set is placed."""
    groups = where.groups
    splits = [replica_rows(rows, g.replicas) for g in groups]
    pairs = [(a, b) for a in range(len(groups)) for b in range(len(groups))
             if a != b and groups[a].gpu == groups[b].gpu]
    out = {(a, b): False for a in range(len(groups)) for b in range(len(groups)) if a != b}
    if where.num_sets == 0:
        return {}
    for a, b in pairs:
        out[(a, b)] = True
    for k in simulated_sets(where):
        nodes = [[cluster.locate(gpus[0]).node_index if len(gpus) <= where.layouts[g.gpu].per_node else (-1 - a, j)
                  for j, gpus in enumerate(replicas)]
                 for a, (g, replicas) in enumerate(zip(groups, where.replica_set(k)))]
        for a, b in pairs:
            if not out[(a, b)]:
                continue
            for ja, (lo_a, hi_a) in enumerate(splits[a]):
                for jb, (lo_b, hi_b) in enumerate(splits[b]):
                    if max(lo_a, lo_b) < min(hi_a, hi_b) and nodes[a][ja] != nodes[b][jb]:
                        out[(a, b)] = False
                        break
                if not out[(a, b)]:
                    break
    return out
