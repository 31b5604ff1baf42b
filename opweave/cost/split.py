"""What a plan that splits the model over two owners can reach: a lower bound on its cost per
token with the network, memory and the TPOT SLO counted (docs/analysis.md, "What a plan can reach").

Theorem 3.2's heterogeneous cost (`analysis.het_cost`) prices only the two sides' marginal work:
the memory-bound ops at the added time per sequence of the type cheapest for them, the GEMMs
compute-bound on the type cheapest for them. A plan pays more. Its activations cross between the
two owners at every stage boundary, over the links the planner's network model charges
(`model.boundary_s`: latency + rows x bytes / link, one NIC per replica, GPUs of two types never
in one node); the owner running attention holds the KV cache of every sequence it serves, which
caps its rows; the other's GEMMs reach their compute-bound cost only at batches its memory, the
SLO and the replica ratio allow; and every step pays its fixed costs.

The plans bounded: one template (`SplitSpec`: CAD, core attention | the rest; AFD, each layer's
attention half | its FFN half) with two owner slots taking its stages round-robin, as the planner
does: slot 0 of GPU type a, TP t_0, r_0 replicas, slot 1 of type g, TP t_1, r_1 replicas, a
resident batch B in n microbatches. A replica of slot k serves b_k = B / r_k sequences, so the
cost per token is

    (r_0 c_0 + r_1 c_1) tau / B = (c_0 / b_0 + c_1 / b_1) tau          (c_k: a replica's $ per second)

and the TPOT tau (the simulator's cycle time, `passes/simulate.py`) is at least each resource's
work per round and one microbatch's round trip (a replica computes ceil(b / n) rows per microbatch):

    n T_k(b_k / n)                      each owner's ops (`CostModel.op_cost`, summed)
    n L_k(b_k / n)                      each directed link's transfers (`boundary_s`, seen from
                                        one side: the other side's rows at 0)
    T_0(b_0 / n) + T_1(b_1 / n) + sends one microbatch's round trip (each send at least its slower side)

with tau <= the SLO, each slot's memory holding its weights, the state of its b_k sequences and
the activations of b_k / n rows (`memory.Footprint`, as the planner counts it), n in the planner's
microbatch grid, b_k at most its largest batch and b_0 / b_1 within its replica counts (1..8 each
way). Every op time is non-decreasing in its rows, which is what lets a cell be costed at its
lower end.

`split_bound` minimises that cost over the TP degrees, n, and (b_0, b_1) on a grid of rows
(`rows_grid`: every integer to 23, then steps of at most 2^(1/16)): a cell [lo, hi) is costed with
the times at lo and the price per row at hi, or at the most sequences memory holds if fewer (a
replica serving b holds ceil(b) of them), so the minimum is at most what any plan of the template
on those types costs; above 23 rows the cells' width leaves it at most 4.4% below the continuous
optimum, below it at most 1/lo.
What binds is what the bound loses most by (`binds`): each limit in turn is lifted (the network
free, memory unlimited, no SLO, any replica ratio) and a limit that lowers the bound by over 2%
binds; when none does, the cost model's own step costs at the rows the optimum runs do
("bandwidth" when the non-attention side's step there still streams more bytes than it computes,
"compute" otherwise).

Not bounded: the general template family, three owner slots, expert-parallel groups of whole
nodes, profiled host transfer times; the search may find those cheaper (`opweave analyze --plan`
says so when it does).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from opweave.cost import memory
from opweave.cost.model import CostModel, boundary_s
from opweave.hardware.catalog import GPUSpec
from opweave.ir.graph import Op, OpGraph
from opweave.ir.kinds import OpClass
from opweave.ir.tp import preferred_layout

GRID_STEPS_PER_OCTAVE = 16
"""Rows grid resolution: a cell is at most 2^(1/16) = 1.044 wide where integers allow (from 23 rows)."""

BINDING_REL = 0.02
"""A limit binds when lifting it lowers the bound by more than this fraction."""

LIMITS = ("network", "memory", "SLO", "replicas")
"""The limits `binds` tries lifting, in the order it names them on a tie."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SplitLimits:
    """The plan space the bound covers: the TPOT SLO and the planner's grid.

    The defaults mirror `opweave.passes.search.SearchOptions` (microbatches, replicas) and
    `DEFAULT_MAX_BATCH` (tests/test_analyze_honest.py checks that they agree)."""

    tpot_slo_s: float = math.inf
    microbatches: tuple[int, ...] = (1, 2, 4)
    max_rows: int = 4096        # the largest resident batch per replica set, so per replica too
    max_replicas: int = 8       # replicas per owner: b_A / b_G lies within [1 / 8, 8]
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SplitBound:
    """The least cost per token of any plan of the split under `SplitLimits`, and where it is."""

    template: str                    # the split's template (`SplitSpec.template`)
    attention_gpu: str               # the type of the slot running core attention
    rest_gpu: str                    # the other slot's
    cost_per_token: float            # $ per token; inf: no plan of the split fits the limits
    binds: tuple[str, ...]           # what keeps it above the ideal (module docstring)
    attention_tp: int = 0
    rest_tp: int = 0
    attention_rows: int = 0          # sequences per attention-slot replica (the optimum cell's lower end)
    rest_rows: int = 0               # sequences per replica of the other slot
    attention_rows_max: int = 0      # the most its memory holds (at attention_tp, n microbatches)
    microbatches: int = 0
    tpot_s: float = math.inf         # the TPOT lower bound at the optimum
    terms_s: dict[str, float] = dataclasses.field(default_factory=dict)  # what that TPOT is the max of
    network_bytes_per_token: float = 0.0  # both ways, every boundary
    reason: str = ""                 # why no plan fits (cost inf)

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.cost_per_token)

    def describe(self) -> str:
        """e.g. "cad: hbm tp1 | flop tp2" (template: the attention slot | the other)."""
        if not self.attention_tp:
            return f"{self.template}: {self.attention_gpu} | {self.rest_gpu}"
        return f"{self.template}: {self.attention_gpu} tp{self.attention_tp} | {self.rest_gpu} tp{self.rest_tp}"


# ---------------------------------------------------------------- the model's facts


def hidden_bytes(graph: OpGraph) -> int:
    """Bytes per token of the residual stream (the first cut's), what a TP all-reduce sums."""
    return graph.cuts[0].bytes_per_token if graph.cuts else 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SplitSpec:
    """One template's stages on two owner slots, as the planner runs them: each slot's ops in
    token order, and what each slot sends per token at each boundary where the owner changes."""

    template: str                           # e.g. "cad", "afd"
    ops: tuple[tuple[Op, ...], tuple[Op, ...]]
    sends: tuple[Counter, Counter]          # per slot: bytes per token it sends -> boundaries per token
    attention_slot: int                     # the slot running core attention (whose memory holds the KV)

    @classmethod
    def from_stages(cls, template: str, graph: OpGraph, bounds: Sequence[tuple[int, int]], owner_of: Sequence[int],
                    sent_bytes: Sequence[int]) -> SplitSpec:
        """From a template's stages: per stage (first op, last op) inclusive, its slot (0 or 1), and
        the bytes per token sent after it (`passes/carry.py send_bytes_per_token`)."""
        ops: tuple[list, list] = ([], [])
        sends = (Counter(), Counter())
        for (first, last), slot, sent in zip(bounds, owner_of, sent_bytes):
            ops[slot].extend(graph.ops[first:last + 1])
            if sent > 0:
                sends[slot][sent] += 1
        attention = [sum(op.cls == OpClass.ATTN for op in side) for side in ops]
        return cls(template=template, ops=(tuple(ops[0]), tuple(ops[1])), sends=sends,
                   attention_slot=int(attention[1] > attention[0]))

    @property
    def bytes_per_token(self) -> int:
        """What crosses between the owners per token, both ways."""
        return sum(b * n for side in self.sends for b, n in side.items())


_LAYER = re.compile(r"layers\.\d+\.")


def _op_key(op: Op | None) -> tuple | None:
    """Everything of an op the cost model reads, but its place (index, name, layer, inputs)."""
    if op is None:
        return None
    return (op.kind, op.cls, tuple((_LAYER.sub("", w.name), w.shape, w.dtype, w.tied) for w in op.weights),
            op.active_weight_fraction, op.flops_per_token, op.flops_per_context_token, op.act_bytes_per_token,
            op.state, op.tp_rule, op.tp_units, op.kv_heads)


def op_groups(ops: Sequence[Op], cost_model: CostModel) -> list[tuple[Op, Op | None, int, tuple]]:
    """`ops` run in order as (op, the op after it, how many times, their key): equal ops (the same
    layer type's) are costed once. A profiled cost model times ops by name: then nothing groups."""
    out: dict[tuple, list] = {}
    for i, op in enumerate(ops):
        following = ops[i + 1] if i + 1 < len(ops) else None
        if cost_model.profile is not None:
            key = number = (id(op), id(following))
        else:
            key = (_op_key(op), _op_key(following))
            number = _KEYS.setdefault(key, len(_KEYS))
        if key in out:
            out[key][2] += 1
        else:
            out[key] = [op, following, 1, number]
    return [tuple(v) for v in out.values()]


_KEYS: dict[tuple, int] = {}
"""Each group key's number: the memo of op times is keyed by it, not by the long tuple (a few
hundred keys per model)."""


# ---------------------------------------------------------------- one side on one TP degree


@dataclasses.dataclass(kw_only=True, slots=True)
class _Side:
    """One slot's ops on one GPU type and TP degree: step time and memory fit by rows. `memo`
    keeps op times across sides and templates (the same op groups recur)."""

    gpu: GPUSpec
    tp: int
    groups: list
    footprint: memory.Footprint
    context: int
    hidden: int
    layout: str
    cost_model: CostModel
    memo: dict
    times: dict = dataclasses.field(default_factory=dict)

    @property
    def price(self) -> float:
        """$ per second of one replica."""
        return self.tp * self.gpu.price_per_second

    def _cost(self, op: Op, following: Op | None, group: tuple, rows: int):
        key = (group, self.gpu.name, self.tp, self.layout, rows)
        if key not in self.memo:
            self.memo[key] = self.cost_model.op_cost(op, self.gpu, self.tp, rows, self.context, self.hidden,
                                                     following, self.layout)
        return self.memo[key]

    def time(self, rows: int) -> float:
        """Seconds of one step of `rows` rows (`CostModel.op_cost`, summed)."""
        if rows not in self.times:
            self.times[rows] = sum(n * self._cost(op, following, key, rows).total_s
                                   for op, following, n, key in self.groups)
        return self.times[rows]

    def fits(self, slots: int, rows: int) -> bool:
        return self.footprint.bytes_at(slots, rows) <= self.gpu.usable_memory_bytes

    def compute_bound(self, rows: int) -> bool:
        """Whether the step's math outweighs its memory traffic at `rows` (GEMMs compute-bound)."""
        costs = [(n, self._cost(op, following, key, rows)) for op, following, n, key in self.groups]
        return sum(n * c.math_s for n, c in costs) >= sum(n * c.memory_s for n, c in costs)


def _sides(ops: Sequence[Op], gpu: GPUSpec, context: int, graph: OpGraph, limits: SplitLimits,
           cost_model: CostModel, memo: dict) -> list[_Side]:
    """`ops` on each TP degree of `limits` that fits a node and divides them."""
    groups = op_groups(ops, cost_model)
    out = []
    for tp in limits.tp_degrees:
        layout = preferred_layout(ops, tp)
        if tp > gpu.gpus_per_node or layout is None:
            continue
        out.append(_Side(gpu=gpu, tp=tp, groups=groups, footprint=memory.Footprint.of(ops, tp, context, layout=layout),
                         context=context, hidden=hidden_bytes(graph), layout=layout, cost_model=cost_model, memo=memo))
    return out


def rows_grid(max_rows: int) -> list[int]:
    """Every integer up to `max_rows` while the next is at most 2^(1 / GRID_STEPS_PER_OCTAVE) away
    (to 23), then the largest integer within that ratio, up to `max_rows`."""
    step = 2 ** (1 / GRID_STEPS_PER_OCTAVE)
    grid = [1]
    while grid[-1] < max_rows:
        grid.append(min(max_rows, max(grid[-1] + 1, math.floor(grid[-1] * step))))
    return grid


# ---------------------------------------------------------------- the bound


class _Links:
    """The two directed links of a split, seen from one slot's replica (`boundary_s` with the other
    side's rows at 0), per microbatch of `rows` rows, summed over the boundaries; memoized."""

    def __init__(self, sides: tuple[_Side, _Side], sends: tuple[Counter, Counter]):
        self.sides, self.sends = sides, sends
        self.same = sides[0].gpu.name == sides[1].gpu.name
        self.memo: dict = {}

    def _sum(self, crossings: Counter, src: _Side, src_rows: int, dst: _Side, dst_rows: int) -> float:
        # GPUs of two types never share a node; one type's owners may (the faster of both links then)
        nodes = (False, True) if self.same else (True,)
        return min(sum(n * boundary_s(b, src.gpu, src_rows, dst.gpu, dst_rows, dst.tp, inter_node=inter)
                       for b, n in crossings.items()) for inter in nodes)

    def of(self, k: int, rows: int) -> tuple[float, float]:
        """(slot k's link in, its link out): seconds per microbatch of `rows` rows on slot k's replica."""
        if (k, rows) not in self.memo:
            me, other = self.sides[k], self.sides[1 - k]
            self.memo[(k, rows)] = (self._sum(self.sends[1 - k], other, 0, me, rows),
                                    self._sum(self.sends[k], me, rows, other, 0))
        return self.memo[(k, rows)]


@dataclasses.dataclass(frozen=True, slots=True)
class _Optimum:
    cost: float
    sides: tuple = ()
    n: int = 0
    cells: tuple[int, int] = (0, 0)
    terms: dict | None = None


def _capacity(side: _Side, n: int, max_rows: int) -> int:
    """The most sequences one replica of `side` holds with n microbatches (0: not one): its memory
    grows with them, so a bisection finds it."""
    lo, hi = 0, max_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if side.fits(mid, math.ceil(mid / n)) else (lo, mid - 1)
    return lo


def _arrays(side: _Side, k: int, grid: list[int], n: int, links: _Links) -> tuple:
    """Per grid cell [b, next b), for slot k with n microbatches: (the owner's work per round, its
    busier link per round, one microbatch's compute, that microbatch's sends), and the most
    sequences a replica's memory holds."""
    rows = [max(1, math.ceil(b / n)) for b in grid]
    down = [grid[bisect.bisect_right(grid, r) - 1] for r in rows]  # times at a grid row <= it: still a lower bound
    t = np.array([side.time(r) for r in down])
    pairs = [links.of(k, r) for r in down]
    link_in, link_out = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    return n * t, n * np.maximum(link_in, link_out), t, link_in + link_out, _capacity(side, n, grid[-1])


def _tables(first: list[_Side], second: list[_Side], sends: tuple[Counter, Counter], grid: list[int],
            microbatches: Sequence[int]) -> list[tuple]:
    """((slot 0's side, slot 1's side), n, slot 0's arrays, slot 1's arrays) for every combination."""
    out = []
    for s0 in first:
        for s1 in second:
            links = _Links((s0, s1), sends)
            for n in microbatches:
                out.append(((s0, s1), n, _arrays(s0, 0, grid, n, links), _arrays(s1, 1, grid, n, links)))
    return out


def _minimise(tables: list[tuple], grid: list[int], limits: SplitLimits, lift: frozenset = frozenset()) -> _Optimum:
    """The least cost per token over the grid (module docstring) with the limits in `lift` lifted."""
    lo = np.array(grid, dtype=float)
    hi = np.array(grid[1:] + grid[-1:], dtype=float)
    slo = math.inf if "SLO" in lift else limits.tpot_slo_s
    ratio = math.inf if "replicas" in lift else limits.max_replicas
    ratio_ok = (lo[:, None] <= ratio * hi[None, :]) & (lo[None, :] <= ratio * hi[:, None])
    best = _Optimum(cost=math.inf)
    for sides, n, (w0, l0, c0, s0, cap0), (w1, l1, c1, s1, cap1) in tables:
        if "network" in lift:
            l0, s0, l1, s1 = l0 * 0, s0 * 0, l1 * 0, s1 * 0
        if "memory" in lift:
            cap0 = cap1 = math.inf
        trip = c0[:, None] + c1[None, :] + np.maximum(s0[:, None], s1[None, :])
        tau = np.maximum(np.maximum(np.maximum(w0, l0)[:, None], np.maximum(w1, l1)[None, :]), trip)
        ok = (lo <= cap0)[:, None] & (lo <= cap1)[None, :] & ratio_ok & (tau <= slo)
        if not ok.any():
            continue
        # the price per row at the most sequences the cell holds: its upper end, or what memory holds
        top0, top1 = np.minimum(hi, cap0), np.minimum(hi, cap1)
        cost = np.where(ok, (sides[0].price / top0[:, None] + sides[1].price / top1[None, :]) * tau, np.inf)
        i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
        if cost[i, j] < best.cost:
            best = _Optimum(cost=float(cost[i, j]), sides=sides, n=n, cells=(int(i), int(j)), terms={
                "owners_s": (float(w0[i]), float(w1[j])), "links_s": (float(l0[i]), float(l1[j])),
                "round_trip_s": float(trip[i, j])})
    return best


def split_bound(graph: OpGraph, spec: SplitSpec, attention: GPUSpec, rest: GPUSpec, context: int,
                limits: SplitLimits = SplitLimits(), cost_model: CostModel | None = None,
                memo: dict | None = None) -> SplitBound:
    """The least $ per token of any plan of `spec` with its attention slot on `attention` and the
    other on `rest` at `context` under `limits` (module docstring), with what binds. `memo` may
    be shared by calls on one graph and context (op times)."""
    cost_model = cost_model or CostModel()
    memo = {} if memo is None else memo
    a = spec.attention_slot
    gpu = (attention, rest) if a == 0 else (rest, attention)
    base = SplitBound(template=spec.template, attention_gpu=attention.name, rest_gpu=rest.name,
                      cost_per_token=math.inf, binds=(), network_bytes_per_token=spec.bytes_per_token)
    sides = [_sides(spec.ops[k], gpu[k], context, graph, limits, cost_model, memo) for k in (0, 1)]
    if not all(spec.ops) or not all(sides):
        return dataclasses.replace(base, reason="a slot has no ops" if not all(spec.ops)
                                   else "no TP degree within a node divides a slot's ops")
    grid = rows_grid(limits.max_rows)
    tables = _tables(sides[0], sides[1], spec.sends, grid, limits.microbatches)
    best = _minimise(tables, grid, limits)
    lifted = {name: _minimise(tables, grid, limits, frozenset({name})).cost
              for name in LIMITS if not (name == "SLO" and math.isinf(limits.tpot_slo_s))}
    if not math.isfinite(best.cost):
        binds = tuple(n for n in LIMITS if math.isfinite(lifted.get(n, math.inf)))
        why = (f"no plan of the split fits: {' or '.join(binds)} (lifting either alone would let one)" if binds
               else "no plan of the split fits, even with one limit lifted")
        return dataclasses.replace(base, binds=binds, reason=why)
    binds = tuple(sorted((n for n, c in lifted.items() if c < best.cost * (1 - BINDING_REL)),
                         key=lambda n: (lifted[n], LIMITS.index(n))))
    rows = [grid[c] for c in best.cells]
    if not binds:
        other = best.sides[1 - a]
        binds = ("compute" if other.compute_bound(max(1, math.ceil(rows[1 - a] / best.n))) else "bandwidth",)
    att = best.sides[a]
    cap = _capacity(att, best.n, limits.max_rows)
    t = best.terms
    terms = {"attention_s": t["owners_s"][a], "rest_s": t["owners_s"][1 - a], "attention_link_s": t["links_s"][a],
             "rest_link_s": t["links_s"][1 - a], "round_trip_s": t["round_trip_s"]}
    return dataclasses.replace(base, cost_per_token=best.cost, binds=binds, attention_tp=att.tp,
                               rest_tp=best.sides[1 - a].tp, attention_rows=rows[a], rest_rows=rows[1 - a],
                               attention_rows_max=cap, microbatches=best.n, tpot_s=max(terms.values()), terms_s=terms)


def best_split(graph: OpGraph, specs: Sequence[SplitSpec], gpus: Sequence[GPUSpec], context: int,
               limits: SplitLimits = SplitLimits(), cost_model: CostModel | None = None,
               mixed: bool = True, memo: dict | None = None) -> SplitBound:
    """`split_bound` over `specs` and the ordered pairs of `gpus` of two types (`mixed`:
    heterogeneous ODS) or of one type on both slots: the cheapest. `memo`: as `split_bound`'s."""
    memo = {} if memo is None else memo
    bounds = [split_bound(graph, spec, a, g, context, limits, cost_model, memo) for spec in specs
              for a in gpus for g in gpus if (a.name != g.name) == mixed]
    if not bounds:
        raise ValueError(f"best_split(mixed={mixed}) needs a split and {'two GPU types' if mixed else 'a GPU type'}")
    return min(bounds, key=lambda b: b.cost_per_token)
