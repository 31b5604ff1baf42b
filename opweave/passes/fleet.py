"""Fleets: plans side by side on a cluster that one plan cannot fill (summary §5, "objectives").

One plan's replica sets take the GPUs they need, as many sets as fit (`placement.place`); on a
mixed cluster the best plan often uses one pool only, or both in a ratio the pools do not have,
and the rest of the cluster sits idle. A fleet plans again on what is left, with the same
objective, SLO and grid, until no plan fits or `max_plans` is reached:

    member 1: the search on the whole cluster
    member k: the search on the GPUs members 1..k-1 left idle, as a cluster

What is left is counted in whole idle nodes per GPU type, plus the largest idle piece of a node of
that type as one more (smaller) node: exactly what a cluster spec can describe and what the next
member's placement can use without moving the earlier members. Other idle pieces of nodes stay
idle and are reported with the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from opweave.hardware.cluster import Cluster, Pool
from opweave.passes.placement import Placement, place
from opweave.passes.search import SearchOptions, SearchResult, search
from opweave.passes.space import Candidate, PlanSpace, owner_groups

MAX_PLANS = 4
"""Members a fleet gets at most (a mixed cluster rarely needs more than one per GPU type)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FleetMember:
    cluster: Cluster               # the GPUs this member was planned on
    best: Candidate
    sets: int                      # replica sets placed
    gpus: dict[str, int]           # GPUs it takes, per type

    @property
    def tokens_per_s(self) -> float:
        return self.sets * self.best.sim.tokens_per_s

    @property
    def cost_per_hour(self) -> float:
        return self.sets * self.best.sim.cost_per_hour


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fleet:
    cluster: Cluster
    members: tuple[FleetMember, ...]
    idle: dict[str, int]           # GPUs no member uses, per type
    stop: str                      # why no further member

    @property
    def tokens_per_s(self) -> float:
        return sum(m.tokens_per_s for m in self.members)

    @property
    def cost_per_hour(self) -> float:
        return sum(m.cost_per_hour for m in self.members)

    @property
    def cost_per_mtok_usd(self) -> float:
        return self.cost_per_hour / 3600.0 / self.tokens_per_s * 1e6 if self.tokens_per_s else float("inf")


def _leftover(cluster: Cluster, where: Placement) -> tuple[dict[str, int], dict[str, int]]:
    """(GPUs per type a next member can use, GPUs per type idle for good): whole idle nodes plus
    the largest idle piece of a node, per type (module docstring)."""
    idle_by_node: dict[tuple[str, int], int] = {}
    for lo, hi in where.idle:
        for layout in cluster.layouts():
            a, b = max(lo, layout.first_gpu) - layout.first_gpu, min(hi, layout.first_gpu + layout.count) - layout.first_gpu
            for node in range(a // layout.per_node, -(-b // layout.per_node)) if a < b else ():
                start = node * layout.per_node
                n = min(b, start + layout.per_node) - max(a, start)
                key = (layout.gpu_name, node)
                idle_by_node[key] = idle_by_node.get(key, 0) + n
    usable: dict[str, int] = {}
    stranded: dict[str, int] = {}
    for layout in cluster.layouts():
        name = layout.gpu_name
        whole = [n for n in range(layout.num_nodes) if idle_by_node.get((name, n), 0) == layout.node_size(n)
                 and layout.node_size(n) == layout.per_node]
        pieces = sorted((idle_by_node[(name, n)] for n in range(layout.num_nodes)
                         if (name, n) in idle_by_node and n not in whole), reverse=True)
        usable[name] = len(whole) * layout.per_node + (pieces[0] if pieces else 0)
        stranded[name] = sum(pieces[1:])
    return usable, stranded


def _sub_cluster(cluster: Cluster, counts: dict[str, int]) -> Cluster | None:
    pools = tuple(Pool(gpu=p.gpu, count=counts[p.gpu.name]) for p in cluster.pools if counts.get(p.gpu.name, 0) > 0)
    if not pools:
        return None
    sub = Cluster(pools=pools, spec="")
    return dataclasses.replace(sub, spec=sub.canonical_spec)


def plan_fleet(space: PlanSpace, options: SearchOptions = SearchOptions(), first: SearchResult | None = None,
               max_plans: int = MAX_PLANS, progress: Callable[[str], None] | None = None) -> Fleet:
    """Members planned one after another on what the earlier ones leave (module docstring).

    `first`: the search result on the whole cluster when the caller has it (not searched again)."""
    cluster, members, stranded = space.cluster, [], {p.gpu.name: 0 for p in space.cluster.pools}
    current: Cluster | None = cluster
    stop = f"{max_plans} plans (the most a fleet gets)"
    while current is not None and len(members) < max_plans:
        sub = dataclasses.replace(space, cluster=current)
        result = first if (first is not None and not members) else search(sub, options)
        if result.best is None:
            stop = f"no plan on the {current.canonical_spec} left: {result.reason}"
            break
        where = place(owner_groups(result.best.owners), current)
        used: dict[str, int] = {}
        for o in result.best.owners:
            used[o.gpu.name] = used.get(o.gpu.name, 0) + o.num_gpus * where.num_sets
        members.append(FleetMember(cluster=current, best=result.best, sets=where.num_sets, gpus=used))
        if progress:
            progress(f"fleet member {len(members)} on {current.canonical_spec}: {where.num_sets} set(s), "
                     f"{members[-1].tokens_per_s:,.0f} tokens/s")
        usable, lost = _leftover(current, where)
        for name, n in lost.items():
            stranded[name] = stranded.get(name, 0) + n
        current = _sub_cluster(current, usable)
        if current is None:
            stop = "every GPU is used"
    idle = dict(stranded)
    if current is not None:
        for p in current.pools:
            idle[p.gpu.name] = idle.get(p.gpu.name, 0) + p.count
    return Fleet(cluster=cluster, members=tuple(members), idle={k: v for k, v in idle.items() if v}, stop=stop)


def format_fleet(fleet: Fleet) -> str:
    """The fleet as a table: each member's owners, sets, GPUs, tokens/s and cost; idle GPUs."""
    lines = [f"fleet on {fleet.cluster.canonical_spec}: {len(fleet.members)} plan(s), "
             f"{fleet.tokens_per_s:,.0f} tokens/s, ${fleet.cost_per_hour:,.1f}/h, ${fleet.cost_per_mtok_usd:.4g}/Mtoken",
             "  #  planned on           template               owners (per set)                     sets  GPUs"
             "          tokens/s    $/Mtoken  TPOT"]
    for i, m in enumerate(fleet.members, 1):
        owners = " + ".join(o.describe() for o in m.best.owners)
        gpus = "+".join(f"{name}x{n}" for name, n in m.gpus.items())
        lines.append(f"  {i:<2} {m.cluster.canonical_spec:<20} {m.best.stage_plan.template.name[:22]:<22} "
                     f"{owners[:36]:<36} {m.sets:>4}  {gpus:<12} {m.tokens_per_s:>10,.0f}  "
                     f"{m.best.cost:>9.4g}  {m.best.tpot_s * 1e3:.3g} ms")
    idle = ", ".join(f"{n} {name}" for name, n in fleet.idle.items()) or "none"
    lines.append(f"  idle GPUs: {idle} ({fleet.stop})")
    return "\n".join(lines)


def fleet_to_json(fleet: Fleet) -> dict:
    return {"cluster": fleet.cluster.canonical_spec, "tokens_per_s": fleet.tokens_per_s,
            "cost_per_hour_usd": fleet.cost_per_hour, "cost_per_mtok_usd": fleet.cost_per_mtok_usd,
            "idle_gpus": fleet.idle, "stop": fleet.stop,
            "members": [{"cluster": m.cluster.canonical_spec, "template": m.best.stage_plan.template.name,
                         "owners": [{"gpu": o.gpu.name, "tp": o.tp, "replicas": o.replicas, "experts": o.experts}
                                    for o in m.best.owners],
                         "batch": m.best.batch, "microbatches": m.best.microbatches, "sets": m.sets, "gpus": m.gpus,
                         "tpot_ms": m.best.tpot_s * 1e3, "tokens_per_s": m.tokens_per_s,
                         "cost_per_mtok_usd": m.best.cost} for m in fleet.members]}
