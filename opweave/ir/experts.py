"""Where an expert-parallel group's routed experts live: balanced placement with redundant copies.

A group of G GPUs holds a MoE layer's E experts in G x S slots, S = E / G + r: every expert once,
plus G x r redundant copies (r per GPU) of the experts that carry the most load, placed so that the
busiest GPU carries as little as it can (DeepSeek's expert-parallel load balancer does the same:
replicate the hottest, then pack). A pair routed to a copied expert goes to one of its copies,
chosen by the token's place in the group (`replica_of`), so each copy takes an equal share.

The load is each expert's share of the routed pairs: uniform by default, or measured per layer
(`ExpertLoad`, written by `opweave profile --routing`). The planner charges the busiest GPU's share
(`busiest_share`) against the mean; the runtime holds each GPU's slots (`placement`).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
from typing import Sequence

from opweave.errors import OpWeaveError

EXPERT_LOAD_FORMAT = "opweave-expert-load-1"


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertLoad:
    """Measured routing: per MoE layer, how many (token, expert) pairs each expert took."""

    model: str
    counts: dict[int, tuple[int, ...]]   # layer -> pairs per expert
    tokens: int = 0                       # the tokens the counts come from

    def shares(self, layer: int | None, experts: int) -> tuple[float, ...]:
        """Each expert's share of the layer's pairs (uniform where the layer was not measured)."""
        counts = self.counts.get(layer) if layer is not None else None
        if not counts or len(counts) != experts or sum(counts) <= 0:
            return (1.0 / experts,) * experts
        total = sum(counts)
        return tuple(c / total for c in counts)

    def to_json(self) -> dict:
        return {"format": EXPERT_LOAD_FORMAT, "model": self.model, "tokens": self.tokens,
                "counts": {str(k): list(v) for k, v in sorted(self.counts.items())}}

    @classmethod
    def from_json(cls, data: dict, where: str = "expert load") -> ExpertLoad:
        if not isinstance(data, dict) or data.get("format") != EXPERT_LOAD_FORMAT:
            raise OpWeaveError(f"{where}: not an expert-load file ({EXPERT_LOAD_FORMAT}, from opweave profile --routing)")
        try:
            counts = {int(k): tuple(int(c) for c in v) for k, v in data["counts"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise OpWeaveError(f"{where}: 'counts' must map each layer to its experts' pair counts") from None
        if any(c < 0 for v in counts.values() for c in v):
            raise OpWeaveError(f"{where}: a negative pair count")
        return cls(model=str(data.get("model", "")), counts=counts, tokens=int(data.get("tokens", 0)))

    @classmethod
    def load(cls, path: str) -> ExpertLoad:
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise OpWeaveError(f"{path}: {e.strerror}") from None
        except ValueError:
            raise OpWeaveError(f"{path}: not JSON") from None
        return cls.from_json(data, path)


def check_group(experts: int, ranks: int, redundant: int) -> None:
    """Raises a one-line error unless `ranks` GPUs can hold `experts` with `redundant` copies each."""
    if ranks < 1 or experts % ranks:
        raise OpWeaveError(f"{experts} experts do not divide over {ranks} GPUs")
    if redundant < 0 or redundant > experts - experts // ranks:
        raise OpWeaveError(f"{redundant} redundant experts per GPU: between 0 and {experts - experts // ranks}")


def placement(shares: Sequence[float], ranks: int, redundant: int = 0) -> tuple[tuple[int, ...], ...]:
    """Each GPU's experts (global ids, in slot order) for experts of load `shares` over `ranks`
    GPUs with `redundant` extra slots per GPU: without copies, E / G consecutive experts per GPU
    (what an expert-parallel shard holds); with copies, the hottest experts (by load per copy) get
    one more copy each, at most one per GPU, until the G x r extra slots are filled; then each
    expert's copies go to distinct GPUs, the least loaded of those with the most free slots."""
    experts = len(shares)
    check_group(experts, ranks, redundant)
    per = experts // ranks
    if redundant == 0:
        return tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ranks))
    copies = [1] * experts
    heap = [(-shares[e], e) for e in range(experts)]
    heapq.heapify(heap)
    for _ in range(ranks * redundant):   # at most one copy per GPU: a full expert leaves the heap
        _, e = heapq.heappop(heap)
        copies[e] += 1
        if copies[e] < ranks:
            heapq.heappush(heap, (-shares[e] / copies[e], e))
    slots = per + redundant
    held: list[list[int]] = [[] for _ in range(ranks)]
    load = [0.0] * ranks
    # experts with the most copies first (each on distinct GPUs), heaviest first among equals; each
    # copy to a GPU with the most free slots (so every later expert still finds distinct ones), the
    # least loaded of those
    for e in sorted(range(experts), key=lambda e: (-copies[e], -shares[e], e)):
        for _ in range(copies[e]):
            r = min((r for r in range(ranks) if e not in held[r]),
                    key=lambda r: (len(held[r]) - slots, load[r], r))
            held[r].append(e)
            load[r] += shares[e] / copies[e]
    return tuple(tuple(sorted(h)) for h in held)


def copies_of(where: Sequence[Sequence[int]], experts: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """expert -> its copies as (GPU, slot), in GPU order."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(experts)]
    for r, held in enumerate(where):
        for slot, e in enumerate(held):
            out[e].append((r, slot))
    return tuple(tuple(c) for c in out)


def busiest_share(shares: Sequence[float], where: Sequence[Sequence[int]]) -> float:
    """The busiest GPU's share of the pairs over the mean GPU's (>= 1), each expert's pairs split
    evenly over its copies."""
    copies = [0] * len(shares)
    for held in where:
        for e in held:
            copies[e] += 1
    loads = [sum(shares[e] / copies[e] for e in held) for held in where]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
