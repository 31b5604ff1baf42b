"""Owners (device-group types) and their configurations (summary §4, B.2–B.4, §5.2).

A stage plan's stages map round-robin onto k owner slots: stage i -> slot (i mod stages_per_block)
mod k, with k dividing stages_per_block so every block maps the same way. An owner configuration
is (GPU type, TP degree, replicas) for one slot; given the replica set's resident batch B and its
microbatch count n, each replica holds B / r sequences and processes ceil(B / (n·r)) of every
microbatch. A configuration carries its per-occurrence latency vector (one entry per stage of the
slot, in token order), its cost rate and its memory per GPU.

Network-safe Pareto frontiers (§5.2): configuration A dominates B only if no complete plan can
prefer B. The simulator's TPOT is monotone in every stage and transfer duration (fixed-order
max-plus schedule), so A dominates B when
  - A's latency vector is <= B's element-wise and A's cost rate is <= B's,
  - A's transfers are never slower: A's GPU type has link bandwidths >= and latencies <= B's,
    and A's replicas each send and receive no more (per-replica microbatch share <= B's),
  - A's TP groups are B's: the same GPU type, TP degree and replica count. Which transfers stay
    inside a node comes from placing every owner of the plan (`placement.transfer_locality`), and
    first fit places owner after owner: another group shape moves every owner placed after it,
    which changes the locality of pairs this slot is not part of, and the number of replica sets
    that fit. No per-slot comparison can see that, so configurations of different shapes are
    never compared (a random search found plans where a node-filling configuration's shape let
    a later owner sit beside each of its replicas).
The owner dimension that varies at a fixed shape is the routed experts' layout (sliced "tp" or
expert-parallel "ep", `opweave.ir.tp`): the two configurations of one shape take the same GPUs,
cost the same and send the same rows, so the one whose stages are no faster is dropped. Memory
is not compared: every configuration built already fits, and no other owner depends on it. With
uniform routing an expert-parallel GPU reads its whole experts in the grouped kernel's blocks (larger
on a shard, which counts the pairs routed elsewhere, `opweave.cost.model.moe_block`) plus the
busiest GPU's excess (`opweave.cost.model.ep_imbalance`), so either configuration may be the faster;
the "ep" one also survives where the sliced one is illegal (a TP split that would cut a quantization
block, `opweave.ir.tp.QUANT_BLOCK`).
Comparing GPU types stays unsound for the reason above: changing a slot's GPU type moves the
owners placed after it too.
Ties (equal in every respect) keep the first in enumeration order.
"""

from __future__ import annotations

import dataclasses
import math

from opweave.hardware.catalog import GPUSpec


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OwnerConfig:
    slot: int
    gpu: GPUSpec
    tp: int
    replicas: int
    share: int                     # sequences of each microbatch one replica processes (and sends on)
    latencies: tuple[float, ...]   # per occurrence of the slot's stages, one microbatch on one replica
    memory_per_gpu: float
    experts: str = "tp"            # routed experts' layout (`opweave.ir.tp.EXPERT_LAYOUTS`)
    # derived once (the search reads them millions of times)
    num_gpus: int = dataclasses.field(init=False)
    cost_per_hour: float = dataclasses.field(init=False)
    busy_s: float = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "num_gpus", self.replicas * self.tp)
        object.__setattr__(self, "cost_per_hour", self.num_gpus * self.gpu.price_per_hour)
        object.__setattr__(self, "busy_s", sum(self.latencies))

    def key(self) -> tuple:
        return (self.gpu.name, self.tp, self.replicas, self.experts)

    def describe(self) -> str:
        return f"{self.replicas}x {self.gpu.name} tp{self.tp}" + ("" if self.experts == "tp" else f" {self.experts}")


def microbatch_share(batch: int, microbatches: int, replicas: int) -> int:
    """Sequences one replica processes of one microbatch."""
    return max(1, math.ceil(batch / (microbatches * replicas)))


def _links_no_worse(a: GPUSpec, b: GPUSpec) -> bool:
    return (a.inter_link_bandwidth >= b.inter_link_bandwidth and a.inter_link_latency <= b.inter_link_latency
            and a.intra_link_bandwidth >= b.intra_link_bandwidth and a.intra_link_latency <= b.intra_link_latency)


def dominates(a: OwnerConfig, b: OwnerConfig) -> bool:
    """True when `a` can replace `b` in every complete plan without making it worse (module docstring)."""
    if (a.gpu.name, a.tp, a.replicas) != (b.gpu.name, b.tp, b.replicas) or a.cost_per_hour > b.cost_per_hour:
        return False
    if len(a.latencies) != len(b.latencies) or any(x > y for x, y in zip(a.latencies, b.latencies)):
        return False
    return _links_no_worse(a.gpu, b.gpu) and a.share <= b.share


def pareto_frontier(configs: list[OwnerConfig]) -> list[OwnerConfig]:
    """The configurations no other configuration dominates (first of equal ones kept), in input order.

    Only configurations of one shape (GPU type, TP degree, replicas) are compared (`dominates`),
    so each is compared with the others of its shape alone: linear in the configurations."""
    shapes: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        shapes.setdefault((c.gpu.name, c.tp, c.replicas), []).append(i)
    dropped = set()
    for members in shapes.values():
        if len(members) < 2:
            continue
        for i in members:
            c = configs[i]
            for j in members:
                if i == j:
                    continue
                d = configs[j]
                if not dominates(d, c):
                    continue
                if i < j and dominates(c, d):  # equal in every respect: keep the first
                    continue
                dropped.add(i)
                break
    return [c for i, c in enumerate(configs) if i not in dropped]
