"""Colocated decode at given points: TPOT, tokens/s, memory fit and the cost model's terms.

One point is a GPU type, a TP degree, a resident batch and a context length. The whole model runs
on one TP group (one stage, one microbatch), so the step time is the cost model's sum over every
op (`CostModel.op_costs`), and TPOT is that step time: each step makes one token per sequence.

The terms add up to the TPOT:

    tpot = weights + kv_state + math - overlap_hidden + overheads + communication

    weights         streaming weights and activations (bytes / the weight-streaming bandwidth)
    kv_state        reading per-sequence state: KV cache, recurrent state
    math            FLOPs / the achievable FLOP/s
    overlap_hidden  the part of memory and math time that runs at the same time (not paid twice)
    overheads       per-op launch, per-step and per-sequence fixed costs
    communication   tensor-parallel collectives (all-reduces, the sampler's all-gather)

With a prompt length (`isl`), each point also has its TTFT: the prefill of one prompt of `isl`
tokens alone on the point's TP group (`opweave.cost.prefill`; the compute of an idle plan's first
token, no queueing, no other request's prefill).

Routed experts are sliced over the group where that is legal, else held whole by expert
parallelism (`opweave.ir.tp.preferred_layout`). A point that cannot run is reported, not raised:
a TP degree that does not divide the model's sharded ops (in either expert layout) or exceeds a
node has no TPOT; a point whose weights, state and activations exceed
the GPU's usable memory has its TPOT and `fits: false`.
"""

from __future__ import annotations

import dataclasses

from opweave.cost import memory
from opweave.cost.model import CostModel
from opweave.cost.prefill import prefill_s
from opweave.hardware.catalog import GPUSpec
from opweave.ir.graph import OpGraph
from opweave.ir.tp import indivisible, legal_tp, preferred_layout

TERMS = ("weights", "kv_state", "math", "overlap_hidden", "overheads", "communication")
"""The term names of a point, in the order `format_estimate` prints them (milliseconds)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EstimatePoint:
    """One (GPU, TP, batch, context) point of colocated decode."""

    gpu: str
    tp: int
    batch: int
    context: int
    tpot_s: float | None = None          # None: the point cannot run (see `error`)
    memory_bytes: float | None = None    # per GPU: weights + state + activations
    usable_bytes: float = 0.0            # per GPU
    price_per_hour: float = 0.0          # USD per GPU-hour
    terms_s: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None             # why it cannot run, or why it does not fit
    isl: int | None = None               # the prompt length TTFT is for (None: not asked)
    ttft_s: float | None = None          # one prompt of `isl` tokens prefilled alone

    @property
    def fits(self) -> bool:
        return self.tpot_s is not None and self.memory_bytes is not None and self.memory_bytes <= self.usable_bytes

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tpot_s is None else self.batch / self.tpot_s

    @property
    def cost_per_mtok_usd(self) -> float | None:
        """USD per million output tokens on the point's `tp` GPUs."""
        if self.tpot_s is None:
            return None
        return self.tp * self.price_per_hour / 3600.0 / self.tokens_per_s * 1e6


def estimate_point(graph: OpGraph, gpu: GPUSpec, tp: int, batch: int, context: int,
                   cost_model: CostModel | None = None, isl: int | None = None) -> EstimatePoint:
    """The cost model's figures for colocated decode of `graph` at one point (and, with `isl`, the
    TTFT of a prompt of that many tokens)."""
    cost_model = cost_model or CostModel()
    base = EstimatePoint(gpu=gpu.name, tp=tp, batch=batch, context=context,
                         usable_bytes=gpu.usable_memory_bytes, price_per_hour=gpu.price_per_hour, isl=isl)
    why = tp_problem(graph, gpu, tp)
    if why is not None:
        return dataclasses.replace(base, error=why)
    hidden_bytes = graph.cuts[0].bytes_per_token if graph.cuts else 0
    layout = preferred_layout(graph.ops, tp)
    costs = cost_model.op_costs(graph.ops, gpu, tp, batch, context, hidden_bytes, layout)
    terms = dict.fromkeys(TERMS, 0.0)
    for c in costs:
        terms["weights"] += c.weights_s
        terms["kv_state"] += c.state_s
        terms["math"] += c.math_s
        terms["overlap_hidden"] += max(c.weights_s + c.state_s + c.math_s - (c.compute_s - c.overhead_s), 0.0)
        terms["overheads"] += c.overhead_s
        terms["communication"] += c.comm_s
    tpot_s = sum(c.total_s for c in costs)
    ttft_s = None
    if isl is not None:
        ttft_s = prefill_s(graph.ops, gpu, tp, isl, 1, hidden_bytes, layout, cost_model).total_s
    need = memory.memory_per_gpu(graph.ops, tp, batch, context, layout=layout)
    error = None
    if need > gpu.usable_memory_bytes:
        error = (f"does not fit: needs {need / 1e9:.1f} GB per GPU, {gpu.name} has "
                 f"{gpu.usable_memory_bytes / 1e9:.1f} GB usable")
    return dataclasses.replace(base, tpot_s=tpot_s, memory_bytes=need, terms_s=terms, error=error, ttft_s=ttft_s)


def tp_problem(graph: OpGraph, gpu: GPUSpec, tp: int) -> str | None:
    """Why one TP group of `tp` GPUs of `gpu` cannot run the whole model, or None."""
    if tp > gpu.gpus_per_node:
        return f"TP {tp} exceeds the {gpu.name} node size ({gpu.gpus_per_node} GPUs); a TP group stays inside one node"
    if preferred_layout(graph.ops, tp) is not None:
        return None
    bad = next(op for op in graph.ops if not legal_tp([op], tp) and not legal_tp([op], tp, "ep"))
    return f"TP {tp} does not divide {indivisible(bad)}"


def estimate(graph: OpGraph, gpu: GPUSpec, tps: list[int], batches: list[int], contexts: list[int],
             cost_model: CostModel | None = None, isl: int | None = None) -> list[EstimatePoint]:
    """Every (tp, batch, context) point, TP outermost, then batch, then context."""
    return [estimate_point(graph, gpu, tp, b, s, cost_model, isl) for tp in tps for b in batches for s in contexts]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 6)


def estimate_to_json(model: str, points: list[EstimatePoint]) -> dict:
    """`{"model", "points": [{"gpu", "tp", "batch", "context", "tpot_ms", "tokens_per_s", "fits",
    "terms": {<term>_ms}, ...}]}`; a point that cannot run has null figures and an "error"."""
    out = []
    for p in points:
        entry = {"gpu": p.gpu, "tp": p.tp, "batch": p.batch, "context": p.context, "tpot_ms": _ms(p.tpot_s),
                 "tokens_per_s": None if p.tokens_per_s is None else round(p.tokens_per_s, 3),
                 "fits": p.fits,
                 "memory_gb_per_gpu": None if p.memory_bytes is None else round(p.memory_bytes / 1e9, 3),
                 "usable_gb_per_gpu": round(p.usable_bytes / 1e9, 3),
                 "cost_per_mtok_usd": None if p.cost_per_mtok_usd is None else round(p.cost_per_mtok_usd, 4),
                 "terms": {f"{name}_ms": _ms(p.terms_s[name]) for name in TERMS} if p.terms_s else {}}
        if p.isl is not None:
            entry["isl"], entry["ttft_ms"] = p.isl, _ms(p.ttft_s)
        if p.error:
            entry["error"] = p.error
        out.append(entry)
    return {"model": model, "points": out}


def format_estimate(model: str, points: list[EstimatePoint]) -> str:
    """A table, one row per point, then one line per point that cannot run or does not fit."""
    isl = next((p.isl for p in points if p.isl is not None), None)
    header = ("gpu", "tp", "batch", "context", "TPOT ms", "tok/s", "GB/GPU", "fits", "$/Mtok") + tuple(
        f"{t} ms" for t in TERMS) + ((f"TTFT ms (isl {isl})",) if isl is not None else ())
    rows = []
    for p in points:
        figures = [f"{p.tpot_s * 1e3:.3f}", f"{p.tokens_per_s:.1f}", f"{p.memory_bytes / 1e9:.1f}",
                   "yes" if p.fits else "no", f"{p.cost_per_mtok_usd:.3g}"] if p.tpot_s is not None else \
            ["-", "-", "-", "no", "-"]
        terms = [f"{p.terms_s[t] * 1e3:.3f}" for t in TERMS] if p.terms_s else ["-"] * len(TERMS)
        ttft = ([f"{p.ttft_s * 1e3:.1f}" if p.ttft_s is not None else "-"] if isl is not None else [])
        rows.append((p.gpu, str(p.tp), str(p.batch), str(p.context), *figures, *terms, *ttft))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = [f"Colocated decode of {model} (one TP group, one microbatch; "
             "TPOT = weights + kv_state + math - overlap_hidden + overheads + communication)",
             "  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    notes = [f"{p.gpu} tp{p.tp} batch {p.batch} context {p.context}: {p.error}" for p in points if p.error]
    return "\n".join(lines + ([""] + notes if notes else []))
