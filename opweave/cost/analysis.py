"""The analysis of summary §3 and appendices A.1–A.6 on the cost model (derivation: docs/analysis.md).

Two layers.

The scalar closed-form core (`relaxed_batch`, `b_star`, `colocated_time`, `hom_time`, `het_cost`,
`g_het`, and the price-ratio forms `price_crossing`, `g_het_at_price`) takes plain numbers, so the
theorems can be checked on random inputs. In the paper's notation, per device of bandwidth B (the
state read at B_kv), FLOP/s F, usable memory M and price c, a model of M_w weight bytes, W GEMM
weight bytes, f GEMM FLOPs per token and m(s) state bytes per sequence:

    b_rel(s) = (M − M_w) / m(s)              relaxed colocated batch; b_max = floor(b_rel)
    b*       = (W / B) / (f / F)              GEMM compute-bound threshold
    colocated per token    c·[m/B_kv + max(W/(b·B), f/F)]   at b = b_rel
    homogeneous ODS        c·[m/B_kv + f/F]
    heterogeneous ODS      min_a(c_a·m/B_a) + min_g(c_g·f/F_g)
    G_hom = colocated / homogeneous ODS ≤ M / (M − M_w);  G_hom = 1 when b_rel ≥ b*
    G_het = min_k homogeneous_k / heterogeneous ≥ 1;  unimodal in m (and in a price ratio), peak where
            the cheapest homogeneous type changes

`analyze()` feeds that core terms the cost model computes on the IR (`ods_terms`: the same per-op
functions the planner and the simulator call), per GPU type, TP degree and context:

    x  the step's added time per sequence of the memory-bound ops (every op but the GEMMs: ≈ m/B_kv)
    y  the added time per token of the GEMM ops at a batch where they are compute-bound (≈ f/F)
    r  the added time per token of the GEMMs' TP collectives (0 at TP 1): paid at any batch, so the
       closed form adds it to x in the colocated and homogeneous costs and to y on the GEMM side of
       heterogeneous ODS
    w  the GEMM weights each GPU of the group streams per step (W / shards / B)
    weights, state + activations per sequence: the memory accounting (`opweave.cost.memory`)

and reports the cost model's own figures: colocated cost at b_max, with every fixed cost and TP
collective, on the TP degree the colocated baseline would use (the one of `TP_SCAN` with the least
cost per token at its memory-limited batch: `colocated_choice`), and homogeneous ODS as the cost
model's marginal cost per token on the TP degree where it is least (`ods_choice`: ODS spreads the
ops over stages, so the weights need not fit on that group). Theorem 3.1's closed form on the
colocated group's own terms is reported beside them (`*_closed`): it compares one device with
itself, leaves out the fixed costs and takes one max over the whole step instead of one per op.
Its bound M / (M − M_w) bounds that closed form, not the cost model's G_hom (which counts the
fixed costs and the TP collectives, and prices ODS on its own TP degree).

With two or more GPU types, Theorem 3.2's G_het (`g_het_ideal`) prices only the two sides'
marginal work. What a plan of a two-owner split (the planner's CAD or AFD template) pays besides
(the activations crossing the NICs at every boundary, the attention owner's memory full of KV
cache, the GEMM owner's weights streamed at the batches the SLO and the replica ratio allow) is
bounded in `opweave.cost.split`; `g_het` is the least hom-ODS cost over that bound,
`g_het_vs_colocated` the cheapest colocated cost over it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from opweave.cost import memory
from opweave.cost.estimate import estimate_point, tp_problem
from opweave.cost.model import CostModel, shards
from opweave.cost.split import SplitBound, SplitLimits, SplitSpec, best_split, hidden_bytes
from opweave.hardware.catalog import GPUSpec
from opweave.ir.graph import OpGraph
from opweave.ir.kinds import OpClass
from opweave.ir.tp import preferred_layout

NUM_MICROBATCHES_CAD = 2
"""CAD pipelines at least two microbatches so that one computes while the other moves."""

TP_SCAN = (1, 2, 4, 8)
"""TP degrees the analysis scans: the planner's inside one node (`opweave.passes.search.SearchOptions.tp_degrees`
without `WIDE_TP`, the expert-parallel groups of whole nodes, which the analysis does not model)."""

MARGINAL_BATCH = 1 << 14
"""Batch at which `ods_terms` measures the cost model's added time per sequence, (T(2b) − T(b)) / b:
far above every catalog GPU type's GEMM threshold b* (≈ 150–600), so every GEMM op is compute-bound
there and every op's time is linear in the batch; the step's fixed costs cancel in the difference."""

CROSSING_REL_TOL = 0.02
"""The context crossing is bisected (geometrically) to this relative width."""

PER_MTOK = 1e6


# ---------------------------------------------------------------- scalar core


def relaxed_batch(memory: float, weights: float, state: float) -> float:
    """b_rel = (M − M_w) / m: sequences whose state fits beside the weights (may be < 1)."""
    return max(memory - weights, 0.0) / state if state > 0 else math.inf


def b_star(gemm_weight_bytes: float, gemm_flops: float, bandwidth: float, flops: float) -> float:
    """Batch at which GEMM weight loading (W/B) equals GEMM math per batch (b·f/F)."""
    return (gemm_weight_bytes / bandwidth) / (gemm_flops / flops)


def colocated_time(batch: float, state: float, gemm_weight_bytes: float, gemm_flops: float,
                   bandwidth: float, flops: float, kv_bandwidth: float | None = None) -> float:
    """Seconds per token of colocated decode at batch b (one device of bandwidth B, FLOP/s F; the
    state read at `kv_bandwidth`, default B)."""
    kv = bandwidth if kv_bandwidth is None else kv_bandwidth
    return state / kv + max(gemm_weight_bytes / (batch * bandwidth), gemm_flops / flops)


def hom_time(state: float, gemm_flops: float, bandwidth: float, flops: float) -> float:
    """Seconds per token of ideal homogeneous ODS: attention memory-bound, GEMM compute-bound."""
    return state / bandwidth + gemm_flops / flops


def het_cost(state: float, gemm_flops: float, gpus: list[tuple[float, float, float]]) -> float:
    """$ per token of ideal heterogeneous ODS over GPU types given as (price/s, B, F)."""
    return min(c / b for c, b, _ in gpus) * state + min(c / f for c, _, f in gpus) * gemm_flops


def g_het(state: float, gemm_flops: float, gpus: list[tuple[float, float, float]]) -> float:
    """Best homogeneous ODS cost over heterogeneous ODS cost (Theorem 3.2: ≥ 1)."""
    best_hom = min(c * hom_time(state, gemm_flops, b, f) for c, b, f in gpus)
    return best_hom / het_cost(state, gemm_flops, gpus)


def unit_triple(price: float, memory_s: float, gemm_s: float) -> tuple[float, float, float]:
    """A GPU type as the scalar core's (price, B, F) for one sequence (state = 1) and one token
    (gemm_flops = 1): B = 1 / its memory-bound seconds per token, F = 1 / its GEMM seconds per token."""
    return price, (1.0 / memory_s if memory_s > 0 else math.inf), (1.0 / gemm_s if gemm_s > 0 else math.inf)


def price_crossing(first: tuple[float, float], second: tuple[float, float]) -> float:
    """The price ratio (second's price / first's) at which two GPU types' homogeneous-ODS costs are
    equal; each type is (memory-bound, GEMM) GPU-seconds per token. Below it the second type is the
    cheaper homogeneous choice, above it the first."""
    return (first[0] + first[1]) / (second[0] + second[1])


def g_het_at_price(first: tuple[float, float], second: tuple[float, float], ratio: float) -> float:
    """G_het of two GPU types (as in `price_crossing`) when the second costs `ratio` times the first.

    Theorem 3.2 in the price ratio ρ: the best homogeneous cost is min(T1, ρ·T2) and the
    heterogeneous one min(x1, ρ·x2) + min(y1, ρ·y2), concave in ρ; so G_het ≥ 1, rises up to
    `price_crossing` and falls after it."""
    return g_het(1.0, 1.0, [unit_triple(1.0, *first), unit_triple(ratio, *second)])


# ---------------------------------------------------------------- terms from the cost model


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ODSTerms:
    """The closed form's terms for one GPU type, TP degree and context, from the cost model.

    Times are seconds on the TP group (each of its `tp` GPUs is busy that long); bytes are per GPU."""

    tp: int
    memory_s: float       # x: added step time per sequence of every op but the GEMMs (attention, light ops)
    gemm_s: float         # y: added step time per token of the GEMM ops, compute-bound
    comm_s: float         # r: added step time per token of the GEMM ops' TP collectives
    weights_s: float      # w: streaming the GEMM weights once per step
    weight_bytes: float   # what one GPU holds of the weights
    sequence_bytes: float  # one GPU's state of one sequence + one row of step activations
    usable_bytes: float
    price_per_s: float    # of the whole group

    @property
    def b_rel(self) -> float:
        return relaxed_batch(self.usable_bytes, self.weight_bytes, self.sequence_bytes)

    @property
    def b_star(self) -> float:
        return b_star(self.weights_s, self.gemm_s, 1.0, 1.0) if self.gemm_s > 0 else math.inf

    def colocated_cost(self, batch: float) -> float:
        """$ per token of the closed form at `batch` (one max over the step, no fixed costs)."""
        return self.price_per_s * colocated_time(batch, self.memory_s + self.comm_s, self.weights_s, self.gemm_s,
                                                 1.0, 1.0)

    @property
    def hom_cost(self) -> float:
        """$ per token of ideal homogeneous ODS on this group: the cost model's marginal cost."""
        return self.price_per_s * hom_time(self.memory_s + self.comm_s, self.gemm_s, 1.0, 1.0)

    @property
    def gpu_seconds(self) -> tuple[float, float]:
        """(memory-bound side, GEMM side with its collectives) GPU-seconds per token: what
        `price_crossing` and `unit_triple` take."""
        return self.tp * self.memory_s, self.tp * (self.gemm_s + self.comm_s)

    @property
    def g_hom_bound(self) -> float:
        """Theorem 3.1's bound M / (M − M_w) with one GPU's share of the weights."""
        free = self.usable_bytes - self.weight_bytes
        return self.usable_bytes / free if free > 0 else math.inf


def ods_terms(graph: OpGraph, gpu: GPUSpec, tp: int, context: int, cost_model: CostModel | None = None) -> ODSTerms:
    """The closed form's terms for `graph` on a TP group of `tp` GPUs of `gpu` at `context`, from
    `CostModel.op_costs` (the added time per sequence at `MARGINAL_BATCH`), `shards` and the
    effective bandwidth (the GEMM weight stream) and the memory accounting."""
    cost_model = cost_model or CostModel()
    hidden = hidden_bytes(graph)
    layout = preferred_layout(graph.ops, tp) or "tp"
    lo = cost_model.op_costs(graph.ops, gpu, tp, MARGINAL_BATCH, context, hidden, layout)
    hi = cost_model.op_costs(graph.ops, gpu, tp, 2 * MARGINAL_BATCH, context, hidden, layout)
    gemm = [op.cls == OpClass.GEMM for op in graph.ops]
    compute = [(b.compute_s - a.compute_s) / MARGINAL_BATCH for a, b in zip(lo, hi)]
    comm = [(b.comm_s - a.comm_s) / MARGINAL_BATCH for a, b in zip(lo, hi)]
    footprint = memory.Footprint.of(graph.ops, tp, context, layout=layout)
    return ODSTerms(
        tp=tp, memory_s=sum(c + r for c, r, g in zip(compute, comm, gemm) if not g),
        gemm_s=sum(c for c, g in zip(compute, gemm) if g), comm_s=sum(r for r, g in zip(comm, gemm) if g),
        weights_s=sum(op.weight_bytes / shards(op, tp, layout) for op in graph.ops if op.cls == OpClass.GEMM)
        / gpu.effective_bandwidth,
        weight_bytes=footprint.weights + footprint.fixed, sequence_bytes=footprint.per_slot + footprint.per_row,
        usable_bytes=gpu.usable_memory_bytes, price_per_s=tp * gpu.price_per_second)


def scan_tps(graph: OpGraph, gpu: GPUSpec) -> tuple[int, ...]:
    """The degrees of `TP_SCAN` one TP group of `gpu` can run the whole model on (TP 1 always)."""
    return tuple(tp for tp in TP_SCAN if tp_problem(graph, gpu, tp) is None)


# ---------------------------------------------------------------- the analysis


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TPPoint:
    """Colocated decode of the whole model on one TP group, at its memory-limited batch."""

    tp: int
    b_rel: float
    b_max: int
    b_star: float
    cost_colocated: float | None         # $/Mtoken, cost model at b_max (None: not one sequence fits)
    cost_colocated_closed: float | None  # $/Mtoken, closed form at b_rel
    cost_hom_ods: float                  # $/Mtoken, the cost model's marginal cost on this group
    g_hom: float | None                  # cost_colocated / the scan's least cost_hom_ods (ideal ODS, `ods_choice`)
    g_hom_closed: float | None           # cost_colocated_closed / cost_hom_ods: Theorem 3.1 on this group
    g_hom_bound: float
    terms: ODSTerms


def _tp_row(graph: OpGraph, gpu: GPUSpec, tp: int, context: int, cost_model: CostModel) -> TPPoint:
    """One row of the TP scan, without `g_hom` (which needs the whole scan)."""
    terms = ods_terms(graph, gpu, tp, context, cost_model)
    b_rel = terms.b_rel
    b_max = math.floor(b_rel)
    hom = terms.hom_cost * PER_MTOK
    col = estimate_point(graph, gpu, tp, b_max, context, cost_model).cost_per_mtok_usd if b_max >= 1 else None
    closed = terms.colocated_cost(b_rel) * PER_MTOK if b_rel > 0 else None
    return TPPoint(tp=tp, b_rel=b_rel, b_max=b_max, b_star=terms.b_star, cost_colocated=col,
                   cost_colocated_closed=closed, cost_hom_ods=hom, g_hom=None,
                   g_hom_closed=None if closed is None else closed / hom, g_hom_bound=terms.g_hom_bound, terms=terms)


def tp_scan(graph: OpGraph, gpu: GPUSpec, context: int, cost_model: CostModel | None = None) -> tuple[TPPoint, ...]:
    """Colocated decode and ideal homogeneous ODS of `graph` on every degree of `scan_tps`, each
    row's G_hom against the least ODS cost of the scan."""
    cost_model = cost_model or CostModel()
    rows = [_tp_row(graph, gpu, tp, context, cost_model) for tp in scan_tps(graph, gpu)]
    best = min(r.cost_hom_ods for r in rows)
    return tuple(dataclasses.replace(r, g_hom=None if r.cost_colocated is None else r.cost_colocated / best)
                 for r in rows)


def ods_choice(scan: Sequence[TPPoint]) -> TPPoint:
    """The TP degree ideal homogeneous ODS uses: the least marginal cost per token (ties: the
    smaller TP; usually TP 1, which has no all-reduces and replicates nothing). ODS spreads the ops
    over stages, so the whole model's weights need not fit on one such group."""
    return min(scan, key=lambda p: (p.cost_hom_ods, p.tp))


def colocated_choice(scan: Sequence[TPPoint]) -> TPPoint:
    """The TP the colocated baseline would use: least cost per token at its memory-limited batch
    (ties: the smaller TP); when no degree fits one sequence, the one with the most room (b_rel)."""
    feasible = [p for p in scan if p.cost_colocated is not None]
    if feasible:
        return min(feasible, key=lambda p: (p.cost_colocated, p.tp))
    return max(scan, key=lambda p: (p.b_rel, -p.tp))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GPUPoint:
    """One GPU type at one context length: colocated serving on the TP degree it would use (`tp`),
    ideal homogeneous ODS on its own (`ods_tp`)."""

    gpu: str
    tp: int
    ods_tp: int
    b_rel: float
    b_max: int
    b_star: float
    regime: str                    # compute-bound | memory-bound | infeasible (at `tp`)
    cost_colocated: float | None   # $/Mtoken, cost model at b_max
    cost_colocated_closed: float | None  # $/Mtoken, closed form at b_rel
    cost_hom_ods: float            # $/Mtoken, cost model's marginal cost on `ods_tp`
    g_hom: float | None            # cost model: cost_colocated / cost_hom_ods
    g_hom_closed: float | None     # closed form (Theorem 3.1) on the colocated group `tp`
    g_hom_bound: float             # M / (M − M_w) at `tp`
    tp_scan: tuple[TPPoint, ...]
    cad_feasible: bool
    cad_attn_max_s: float          # attention stage, per step, at its largest microbatch
    cad_rest_floor_s: float        # rest-of-model stage, per step, at batch 1 (its fastest)
    cad_reason: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ContextPoint:
    """One context length: every GPU type's point and, with two or more types, heterogeneous ODS
    both ideal (Theorem 3.2) and as a plan of the attention / rest split pays for it (`split`)."""

    context: int
    state_bytes: float
    gpus: tuple[GPUPoint, ...]
    cost_het_ods: float | None = None  # $/Mtoken, Theorem 3.2's ideal (marginal costs only)
    g_het_ideal: float | None = None   # Theorem 3.2: least hom-ODS / cost_het_ods (>= 1)
    het_attention_gpu: str | None = None  # where the ideal puts the memory-bound ops
    het_gemm_gpu: str | None = None
    split: SplitBound | None = None    # the cheapest two-owner split over two types (None: no splits given)
    split_same: SplitBound | None = None  # the cheapest with one type on both owners (homogeneous ODS as a plan)
    cost_split: float | None = None    # $/Mtoken: that bound, never below cost_het_ods (None: no plan fits)
    g_het: float | None = None         # least hom-ODS / cost_split (<= g_het_ideal; None: no plan fits)
    cost_colocated_best: float | None = None  # $/Mtoken, the cheapest type's colocated (cost model at b_max)
    g_het_vs_colocated: float | None = None   # cost_colocated_best / cost_split: at most what the split gains


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Analysis:
    model: str
    gpu_names: tuple[str, ...]
    points: tuple[ContextPoint, ...]
    crossing_context: float | None   # where the best homogeneous GPU type changes (≥ 2 types)
    hybrid_note: str | None          # CAD layer-type imbalance of hybrid-attention models
    limits: SplitLimits = SplitLimits()  # what the split's bound was computed under (its TPOT SLO)
    templates: tuple[str, ...] = ()      # the splits bounded (`SplitSpec.template`)


def _fitting_batch(footprint: memory.Footprint, usable: float, slots_per_row: int) -> int:
    """Most rows of a step whose `slots_per_row` state slots each fit beside the weights."""
    per_row = slots_per_row * footprint.per_slot + footprint.per_row
    return math.floor(max(usable - footprint.weights - footprint.fixed, 0.0) / per_row) if per_row > 0 else 0


def _cad(graph: OpGraph, gpu: GPUSpec, rest: GPUSpec, context: int,
         cost_model: CostModel) -> tuple[bool, float, float, str]:
    """A.6 on the cost model: the attention stage's longest feasible step (one `gpu` holding the
    state of `NUM_MICROBATCHES_CAD` microbatches, at the largest microbatch that fits) against the
    rest-of-model stage's fastest step (batch 1, on the TP degree of `TP_SCAN` that fits its
    weights and is fastest)."""
    attn = [op for op in graph.ops if op.cls == OpClass.ATTN]
    others = [op for op in graph.ops if op.cls != OpClass.ATTN]
    hidden = hidden_bytes(graph)
    per_mb = _fitting_batch(memory.Footprint.of(attn, 1, context), gpu.usable_memory_bytes, NUM_MICROBATCHES_CAD)
    attn_max = cost_model.ops_latency(attn, gpu, 1, per_mb, context, hidden) if per_mb >= 1 else 0.0
    floors = [(cost_model.ops_latency(others, rest, tp, 1, context, hidden, preferred_layout(others, tp) or "tp"), tp)
              for tp in scan_tps(graph, rest)
              if _fitting_batch(memory.Footprint.of(others, tp, context, layout=preferred_layout(others, tp) or "tp"),
                                rest.usable_memory_bytes, 0) >= 1]
    if not floors:
        return False, attn_max, math.inf, f"the rest of the model does not fit on {max(TP_SCAN)}x{rest.name}"
    floor, t_rest = min(floors)
    if per_mb < 1:
        return False, 0.0, floor, f"{NUM_MICROBATCHES_CAD} microbatches of one sequence do not fit on one {gpu.name}"
    if attn_max >= floor:
        return True, attn_max, floor, (f"attention can take up to {attn_max * 1e3:.3g} ms/step "
                                       f"(microbatch {per_mb}) >= rest-of-model floor {floor * 1e3:.3g} ms "
                                       f"on {t_rest}x{rest.name}")
    return False, attn_max, floor, (f"attention takes at most {attn_max * 1e3:.3g} ms/step (microbatch {per_mb}) "
                                    f"< rest-of-model floor {floor * 1e3:.3g} ms on {t_rest}x{rest.name}")


def _tp_scan(graph: OpGraph, gpu: GPUSpec, context: int, cost_model: CostModel,
             memo: dict | None = None) -> tuple[TPPoint, ...]:
    """`tp_scan`, kept per (GPU type, context) in `memo` within one analysis."""
    key = (gpu.name, context)
    if memo is not None and key in memo:
        return memo[key]
    scan = tp_scan(graph, gpu, context, cost_model)
    if memo is not None:
        memo[key] = scan
    return scan


def _gpu_point(graph: OpGraph, gpu: GPUSpec, context: int, cost_model: CostModel, memo: dict) -> GPUPoint:
    scan = _tp_scan(graph, gpu, context, cost_model, memo)
    p, ods = colocated_choice(scan), ods_choice(scan)
    regime = "infeasible" if p.b_max < 1 else ("compute-bound" if p.b_rel >= p.b_star else "memory-bound")
    ok, attn_max, floor, why = _cad(graph, gpu, gpu, context, cost_model)
    return GPUPoint(gpu=gpu.name, tp=p.tp, ods_tp=ods.tp, b_rel=p.b_rel, b_max=p.b_max, b_star=p.b_star,
                    regime=regime, cost_colocated=p.cost_colocated, cost_colocated_closed=p.cost_colocated_closed,
                    cost_hom_ods=ods.cost_hom_ods, g_hom=p.g_hom, g_hom_closed=p.g_hom_closed,
                    g_hom_bound=p.g_hom_bound, tp_scan=scan, cad_feasible=ok, cad_attn_max_s=attn_max,
                    cad_rest_floor_s=floor, cad_reason=why)


def _het(points: Sequence[GPUPoint], gpus: Sequence[GPUSpec]) -> tuple[float, float, str, str]:
    """($ per token of heterogeneous ODS, G_het, memory-bound side's type, GEMM side's type), each
    type on its ODS TP degree."""
    terms = [next(s.terms for s in p.tp_scan if s.tp == p.ods_tp) for p in points]
    triples = [unit_triple(t.price_per_s, t.memory_s, t.gemm_s + t.comm_s) for t in terms]
    attn = min(range(len(terms)), key=lambda i: triples[i][0] / triples[i][1])
    gemm = min(range(len(terms)), key=lambda i: triples[i][0] / triples[i][2])
    return het_cost(1.0, 1.0, triples), g_het(1.0, 1.0, triples), gpus[attn].name, gpus[gemm].name


def _best_hom(graph: OpGraph, gpus: Sequence[GPUSpec], context: int, cost_model: CostModel, memo: dict) -> str:
    """The GPU type with the cheapest homogeneous ODS at `context` (each on its ODS TP degree)."""
    return min(gpus, key=lambda g: ods_choice(_tp_scan(graph, g, context, cost_model, memo)).cost_hom_ods).name


def _crossing(graph: OpGraph, gpus: Sequence[GPUSpec], lo: int, hi: int, cost_model: CostModel,
              memo: dict) -> float | None:
    """Context where the cheapest homogeneous-ODS GPU type changes, by geometric bisection on s
    (None: the same type at both ends)."""
    if len(gpus) < 2:
        return None
    first = _best_hom(graph, gpus, lo, cost_model, memo)
    if first == _best_hom(graph, gpus, hi, cost_model, memo):
        return None
    a, b = float(lo), float(hi)
    while b - a > 1 and b / a > 1 + CROSSING_REL_TOL:
        mid = math.sqrt(a * b)
        a, b = (mid, b) if _best_hom(graph, gpus, round(mid), cost_model, memo) == first else (a, mid)
    return b


def _hybrid_note(graph: OpGraph, context: int) -> str | None:
    per_layer = {}
    for op in graph.ops:
        if op.cls == OpClass.ATTN:
            per_layer[op.kind.value] = op.state_bytes(context)
    if len(per_layer) < 2:
        return None
    hi, lo = max(per_layer, key=per_layer.get), min(per_layer, key=per_layer.get)
    return (f"hybrid attention: at s={context} one {hi} layer reads {per_layer[hi] / per_layer[lo]:.3g}x the state "
            f"of one {lo} layer, so a single rest-of-model CAD stage cannot match both (bubbles)")


def _split_point(point: ContextPoint, graph: OpGraph, gpus: Sequence[GPUSpec], splits: Sequence[SplitSpec],
                 limits: SplitLimits, cost_model: CostModel) -> ContextPoint:
    """`point` with heterogeneous ODS: Theorem 3.2's ideal and the split a plan over two GPU types
    can reach (and, for comparison, the best split on one type).

    The split's bound and the ideal are both lower bounds on what the split costs, so the larger
    is taken (the bound's grid cells can leave it a little under the ideal when nothing binds)."""
    het, gain, attn, gemm = _het(point.gpus, gpus)
    if not splits:
        return dataclasses.replace(point, cost_het_ods=het * PER_MTOK, g_het_ideal=gain, het_attention_gpu=attn,
                                   het_gemm_gpu=gemm)
    memo: dict = {}  # op times, shared by every split and pair
    split = best_split(graph, splits, gpus, point.context, limits, cost_model, mixed=True, memo=memo)
    same = best_split(graph, splits, gpus, point.context, limits, cost_model, mixed=False, memo=memo)
    cost = max(split.cost_per_token, het) * PER_MTOK if split.feasible else None
    best_hom = min(g.cost_hom_ods for g in point.gpus)
    colocated = [g.cost_colocated for g in point.gpus if g.cost_colocated is not None]
    best_col = min(colocated) if colocated else None
    return dataclasses.replace(
        point, cost_het_ods=het * PER_MTOK, g_het_ideal=gain, het_attention_gpu=attn, het_gemm_gpu=gemm, split=split,
        split_same=same,
        cost_split=cost, g_het=None if cost is None else best_hom / cost, cost_colocated_best=best_col,
        g_het_vs_colocated=None if cost is None or best_col is None else best_col / cost)


def analyze(graph: OpGraph, gpus: list[GPUSpec], contexts: list[int], cost_model: CostModel | None = None,
            limits: SplitLimits | None = None, splits: Sequence[SplitSpec] = ()) -> Analysis:
    """The §3 quantities for `graph` on each GPU type at each context length; with two or more
    types, heterogeneous ODS: Theorem 3.2's ideal and, given the planner's two-owner `splits`
    (`SplitSpec`s, e.g. its CAD and AFD templates: `opweave analyze` passes them), what a plan of
    them reaches under `limits` (TPOT SLO, the planner's grid; default: no SLO)."""
    cost_model = cost_model or CostModel()
    limits = limits or SplitLimits(tp_degrees=TP_SCAN)
    memo: dict = {}
    points = []
    for s in contexts:
        per_gpu = tuple(_gpu_point(graph, g, s, cost_model, memo) for g in gpus)
        point = ContextPoint(context=s, state_bytes=float(graph.state_bytes(s)), gpus=per_gpu)
        if len(gpus) >= 2:
            point = _split_point(point, graph, gpus, splits, limits, cost_model)
        points.append(point)
    crossing = _crossing(graph, gpus, min(contexts), max(contexts), cost_model, memo) if contexts else None
    return Analysis(model=graph.model, gpu_names=tuple(g.name for g in gpus), points=tuple(points),
                    crossing_context=crossing, hybrid_note=_hybrid_note(graph, max(contexts)), limits=limits,
                    templates=tuple(spec.template for spec in splits))


# ---------------------------------------------------------------- price sensitivity (Theorem 3.2 in a price ratio)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PriceSweep:
    """G_het of two GPU types as the second's price per GPU-hour is `ratio` × the first's."""

    model: str
    context: int
    first: str
    second: str
    first_tp: int                 # each type's ODS TP degree (`ods_choice`)
    second_tp: int
    ratios: tuple[float, ...]
    g_het: tuple[float, ...]
    best_hom: tuple[str, ...]     # the cheaper homogeneous-ODS type at each ratio
    crossing_ratio: float         # where the best homogeneous type changes: G_het peaks here
    peak_g_het: float             # G_het at the crossing


def price_sweep(graph: OpGraph, context: int, first: GPUSpec, second: GPUSpec, ratios: Sequence[float],
                cost_model: CostModel | None = None) -> PriceSweep:
    """Predicted G_het (`g_het_at_price`) of `first` + `second` at `context` for each price ratio
    second / first (positive), and the crossing ratio where the best homogeneous type changes.

    Each type runs on its ODS TP degree (`ods_choice`; a price scale does not change it), with the
    terms of `ods_terms`. Prices per GPU-hour are taken from `first` only: `second`'s own price does
    not enter."""
    if not ratios or any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"price ratios must be positive and finite, got {list(ratios)}")
    cost_model = cost_model or CostModel()
    one = ods_choice(_tp_scan(graph, first, context, cost_model))
    two = ods_choice(_tp_scan(graph, second, context, cost_model))
    x1, x2 = one.terms.gpu_seconds, two.terms.gpu_seconds
    cross = price_crossing(x1, x2)
    return PriceSweep(model=graph.model, context=context, first=first.name, second=second.name, first_tp=one.tp,
                      second_tp=two.tp, ratios=tuple(ratios), g_het=tuple(g_het_at_price(x1, x2, r) for r in ratios),
                      best_hom=tuple(second.name if r * sum(x2) < sum(x1) else first.name for r in ratios),
                      crossing_ratio=cross, peak_g_het=g_het_at_price(x1, x2, cross))
