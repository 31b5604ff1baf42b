"""The closed-form analysis of summary §3 and appendices A.1–A.6 (derivation: docs/analysis.md).

Notation, per GPU type (effective figures: catalog peak × efficiency factor):
    c  price per GPU-second            B  memory bandwidth        F  GEMM FLOP/s
    (the state m is read at the KV/state bandwidth, weights W stream at B: `GPUSpec`)
    M  usable memory per GPU            t  TP degree the weights need (smallest power of 2 with t·M > M_w)
Per model (from the IR): M_w all weight bytes, W GEMM weight bytes (what a step reads at large
batch), f GEMM FLOPs per token, m(s) per-sequence state bytes at context s.

    b_rel(s) = (t·M − M_w) / m(s)            relaxed colocated batch; b_max = floor(b_rel)
    b*       = (W / B) / (f / F)              GEMM compute-bound threshold
    colocated per token    c·[m/B + max(W/(b·B), f/F)]   at b = b_rel
    homogeneous ODS        c·[m/B + f/F]                  (attention memory-bound, GEMM compute-bound)
    heterogeneous ODS      min_a(c_a/B_a)·m + min_g(c_g/F_g)·f
    G_hom = colocated / homogeneous ODS ≤ t·M / (t·M − M_w);  G_hom = 1 when b_rel ≥ b*
    G_het = min_k homogeneous_k / heterogeneous ≥ 1;  unimodal in m, peak where the k's cross

The scalar core (`colocated_cost`, `hom_cost`, `het_cost`, `g_hom`, `g_het`) takes plain numbers
so the theorems can be checked on random inputs; `analyze()` feeds it the IR and the catalog.
"""

from __future__ import annotations

import dataclasses
import math

from opweave.hardware.catalog import GPUSpec
from opweave.ir.graph import OpGraph
from opweave.ir.kinds import OpClass

NUM_MICROBATCHES_CAD = 2
"""CAD pipelines at least two microbatches so that one computes while the other moves."""

MAX_TP = 64


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
    best_hom = min(c * hom_time(state, gemm_flops, b, f) for c, b, f in gpus)
    return best_hom / het_cost(state, gemm_flops, gpus)


# ---------------------------------------------------------------- model terms from the IR


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelTerms:
    weight_bytes: float        # M_w
    gemm_weight_bytes: float   # W
    gemm_flops: float          # f, per token
    num_layers: int

    @staticmethod
    def of(graph: OpGraph) -> "ModelTerms":
        gemm = [op for op in graph.ops if op.cls == OpClass.GEMM]
        return ModelTerms(weight_bytes=graph.weight_bytes, gemm_weight_bytes=sum(op.weight_bytes for op in gemm),
                          gemm_flops=sum(op.flops_per_token for op in gemm), num_layers=graph.num_layers)


def weights_tp(gpu: GPUSpec, weight_bytes: float) -> int:
    """Smallest power-of-two group whose usable memory exceeds the weights."""
    t = 1
    while t * gpu.usable_memory_bytes <= weight_bytes and t < MAX_TP:
        t *= 2
    return t


# ---------------------------------------------------------------- the analysis


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GPUPoint:
    """One GPU type at one context length."""

    gpu: str
    tp: int
    b_rel: float
    b_max: int
    b_star: float
    regime: str                    # compute-bound | memory-bound | infeasible
    cost_colocated: float | None   # $/Mtoken at b_rel (None: not even one sequence fits)
    cost_colocated_int: float | None  # $/Mtoken at the integer b_max
    cost_hom_ods: float
    g_hom: float | None
    g_hom_bound: float
    cad_feasible: bool
    cad_attn_max_s: float          # attention stage, per step, at its largest microbatch
    cad_rest_floor_s: float        # rest-of-model stage, per step, weight-loading floor
    cad_reason: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ContextPoint:
    context: int
    state_bytes: float
    gpus: tuple[GPUPoint, ...]
    cost_het_ods: float | None = None  # $/Mtoken (two or more GPU types)
    g_het: float | None = None
    het_attention_gpu: str | None = None
    het_gemm_gpu: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Analysis:
    model: str
    gpu_names: tuple[str, ...]
    points: tuple[ContextPoint, ...]
    crossing_context: float | None   # where the best homogeneous GPU type changes (≥ 2 types)
    hybrid_note: str | None          # CAD layer-type imbalance of hybrid-attention models


PER_MTOK = 1e6


def _cad(gpu: GPUSpec, rest: GPUSpec, terms: ModelTerms, state: float) -> tuple[bool, float, float, str]:
    """A.6: the attention stage's longest feasible latency vs the rest-of-model weight floor."""
    per_mb = math.floor(gpu.usable_memory_bytes / (NUM_MICROBATCHES_CAD * state)) if state > 0 else 0
    attn_max = per_mb * state / gpu.effective_kv_bandwidth
    t_rest = weights_tp(rest, terms.weight_bytes)
    floor = terms.gemm_weight_bytes / (t_rest * rest.effective_bandwidth)
    if per_mb < 1:
        return False, 0.0, floor, f"{NUM_MICROBATCHES_CAD} microbatches of one sequence do not fit on one {gpu.name}"
    if attn_max >= floor:
        return True, attn_max, floor, (f"attention can take up to {attn_max * 1e3:.3g} ms/step "
                                       f"(microbatch {per_mb}) >= weight floor {floor * 1e3:.3g} ms")
    return False, attn_max, floor, (f"attention takes at most {attn_max * 1e3:.3g} ms/step (microbatch {per_mb}) "
                                    f"< rest-of-model weight floor {floor * 1e3:.3g} ms on {t_rest}x{rest.name}")


def _gpu_point(gpu: GPUSpec, terms: ModelTerms, state: float) -> GPUPoint:
    t = weights_tp(gpu, terms.weight_bytes)
    mem, bw, fl, price = t * gpu.usable_memory_bytes, t * gpu.effective_bandwidth, t * gpu.effective_flops, \
        t * gpu.price_per_second
    bw_kv = t * gpu.effective_kv_bandwidth
    b_rel = relaxed_batch(mem, terms.weight_bytes, state)
    bstar = b_star(terms.gemm_weight_bytes, terms.gemm_flops, bw, fl)
    hom = price * hom_time(state, terms.gemm_flops, bw_kv, fl)
    bound = mem / (mem - terms.weight_bytes) if mem > terms.weight_bytes else math.inf
    col = col_int = g = None
    b_max = math.floor(b_rel) if math.isfinite(b_rel) else 10**9
    if b_rel > 0:
        col = price * colocated_time(b_rel, state, terms.gemm_weight_bytes, terms.gemm_flops, bw, fl, bw_kv)
        g = col / hom
    if b_max >= 1:
        col_int = price * colocated_time(b_max, state, terms.gemm_weight_bytes, terms.gemm_flops, bw, fl, bw_kv)
    regime = "infeasible" if b_max < 1 else ("compute-bound" if b_rel >= bstar else "memory-bound")
    ok, attn_max, floor, why = _cad(gpu, gpu, terms, state)
    return GPUPoint(gpu=gpu.name, tp=t, b_rel=b_rel, b_max=b_max, b_star=bstar, regime=regime,
                    cost_colocated=None if col is None else col * PER_MTOK,
                    cost_colocated_int=None if col_int is None else col_int * PER_MTOK,
                    cost_hom_ods=hom * PER_MTOK, g_hom=g, g_hom_bound=bound, cad_feasible=ok,
                    cad_attn_max_s=attn_max, cad_rest_floor_s=floor, cad_reason=why)


def _triples(gpus: list[GPUSpec]) -> list[tuple[float, float, float]]:
    return [(g.price_per_second, g.effective_kv_bandwidth, g.effective_flops) for g in gpus]


def _crossing(graph: OpGraph, terms: ModelTerms, gpus: list[GPUSpec], lo: int, hi: int) -> float | None:
    """Context where the cheapest homogeneous-ODS GPU type changes, by bisection on s (None: none)."""
    def best(s: float) -> str:
        m = graph.state_bytes(int(s))
        return min(gpus, key=lambda g: g.price_per_second * hom_time(m, terms.gemm_flops, g.effective_kv_bandwidth,
                                                                   g.effective_flops)).name
    if len(gpus) < 2 or best(lo) == best(hi):
        return None
    a, b = float(lo), float(hi)
    while b - a > 1:
        mid = (a + b) / 2
        a, b = (mid, b) if best(mid) == best(lo) else (a, mid)
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


def analyze(graph: OpGraph, gpus: list[GPUSpec], contexts: list[int]) -> Analysis:
    """The §3 quantities for `graph` on each GPU type at each context length."""
    terms = ModelTerms.of(graph)
    points = []
    for s in contexts:
        state = float(graph.state_bytes(s))
        per_gpu = tuple(_gpu_point(g, terms, state) for g in gpus)
        point = ContextPoint(context=s, state_bytes=state, gpus=per_gpu)
        if len(gpus) >= 2:
            triples = _triples(gpus)
            attn = min(gpus, key=lambda g: g.price_per_second / g.effective_kv_bandwidth)
            gemm = min(gpus, key=lambda g: g.price_per_second / g.effective_flops)
            point = dataclasses.replace(point, cost_het_ods=het_cost(state, terms.gemm_flops, triples) * PER_MTOK,
                                        g_het=g_het(state, terms.gemm_flops, triples),
                                        het_attention_gpu=attn.name, het_gemm_gpu=gemm.name)
        points.append(point)
    crossing = _crossing(graph, terms, gpus, min(contexts), max(contexts)) if contexts else None
    return Analysis(model=graph.model, gpu_names=tuple(g.name for g in gpus), points=tuple(points),
                    crossing_context=crossing, hybrid_note=_hybrid_note(graph, max(contexts)))
