"""`compile --explain`: the best plan of each family the search considers, side by side, and what
bounds it, so a user sees why the chosen plan won.

Rows: for each template family (colocated; AFD, CAD and the other operator cuts), and under a
workload for each way of serving prefill (aggregated, disaggregated), the best plan on the whole
cluster; and on a cluster of several GPU types, the best plan on each type alone. Each is one
search of the compile's space restricted to that family, prefill mode or pool
(`passes/search.py`), so each row is the optimum of its part of the space. A row names its plan,
its cost per token, tokens/s per GPU, TPOT and TTFT, and how close it is to each limit (memory per
GPU, the TPOT and TTFT targets); a part of the space with no plan says why.
"""

from __future__ import annotations

import dataclasses
import math

from opweave.compiler.inputs import Inputs, plan_space
from opweave.hardware.cluster import Cluster
from opweave.ir.graph import OpGraph
from opweave.passes.blocks import BlockedGraph
from opweave.passes.search import search
from opweave.passes.templates import enumerate_templates

BINDING = 0.9
"""A limit is named as binding when the plan uses at least this share of it."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    family: str
    prefill: str                  # "decode only", "aggregated" or "disaggregated"
    gpus: str                     # the GPU types it may use
    plan: str = ""                # its owners, batch and prefill arrangement ("" when none)
    cost_per_mtok_usd: float = math.inf
    tokens_per_s_per_gpu: float = 0.0
    tpot_ms: float = math.nan
    ttft_ms: float = math.nan
    limits: str = ""              # how close it is to each limit, or why there is no plan
    chosen: bool = False          # the cheapest row (the compile's plan under the cost objective)


def _families(blocks: BlockedGraph) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for t in enumerate_templates(blocks, "all"):
        out.setdefault("operator cuts" if t.family == "general" else t.family, []).append(t.name)
    return {name: tuple(names) for name, names in out.items()}


def _row(family: str, prefill: str, gpus: str, result, space) -> Row:
    best = result.best
    if best is None:
        return Row(family=family, prefill=prefill, gpus=gpus, limits=f"no plan: {result.reason}")
    owners = " + ".join(o.describe() for o in best.owners)
    t = best.traffic
    how = "" if t is None else f"; {t.describe()}"
    gpu_count = sum(o.num_gpus for o in best.owners) + (t.pool.num_gpus / t.pool.sets if t is not None and t.pool else 0)
    per_set = best.sim.tokens_per_s if t is None else t.tokens_per_s
    shares = [("memory", max(o.memory_per_gpu / o.gpu.usable_memory_bytes for o in best.owners), "")]
    if math.isfinite(space.tpot_slo_s):
        shares.append(("TPOT", best.tpot_s / space.tpot_slo_s, " of SLO"))
    if t is not None and math.isfinite(space.workload.ttft_slo_s):
        shares.append(("TTFT", t.ttft_s / space.workload.ttft_slo_s, " of SLO"))
    text = ", ".join(f"{name} {share:.0%}{what}" for name, share, what in shares)
    if best.sim.bytes_per_token_inter_node > 0:
        text += f", {best.sim.bytes_per_token_inter_node / 1e3:,.0f} kB/token inter-node"
    binding = [name for name, share, _ in shares if share >= BINDING]
    return Row(family=family, prefill=prefill, gpus=gpus,
               plan=f"{best.stage_plan.template.name}: {owners}, batch {best.batch}{how}",
               cost_per_mtok_usd=best.cost, tokens_per_s_per_gpu=per_set / gpu_count, tpot_ms=best.tpot_s * 1e3,
               ttft_ms=math.nan if t is None else t.ttft_s * 1e3,
               limits=text + (f" (bound by {', '.join(binding)})" if binding else ""))


@dataclasses.dataclass(frozen=True, slots=True)
class Explanation:
    rows: tuple[Row, ...]

    def text(self) -> str:
        return format_explain(list(self.rows))

    def to_json(self) -> list[dict]:
        return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in dataclasses.asdict(r).items()} for r in self.rows]


def explain(inputs: Inputs, graph: OpGraph, blocks: BlockedGraph, progress=None) -> Explanation:
    """The rows of the module docstring for the compile of `inputs`, the cheapest marked
    (`progress`: one line per search)."""
    families = _families(blocks)
    workload = inputs.workload
    modes = [None] if workload is None else ["aggregated", "disaggregated"]
    rows = []
    cluster = inputs.cluster
    everything = "+".join(p.gpu.name for p in cluster.pools)
    for family, names in families.items():
        for mode in modes:
            changed = {} if mode is None else {"workload": dataclasses.replace(workload, prefill=mode)}
            space = plan_space(graph, blocks, inputs, **changed)
            options = dataclasses.replace(inputs.options, templates="all", only_templates=names)
            if progress:
                progress(f"explain: {family}, {mode or 'decode only'}")
            rows.append(_row(family, mode or "decode only", everything, search(space, options), space))
    if len(cluster.pools) > 1:
        for pool in cluster.pools:
            alone = Cluster(pools=(pool,), spec=f"{pool.gpu.name}x{pool.count}")
            space = plan_space(graph, blocks, inputs, cluster=alone)
            if progress:
                progress(f"explain: {pool.gpu.name} alone")
            rows.append(_row("any", "any" if workload is not None else "decode only", pool.gpu.name,
                             search(space, inputs.options), space))
    best = min((r for r in rows if r.plan), key=lambda r: r.cost_per_mtok_usd, default=None)
    return Explanation(tuple(dataclasses.replace(r, chosen=True) if r is best else r for r in rows))


def format_explain(rows: list[Row]) -> str:
    header = ("", "family", "prefill", "GPUs", "$/Mtok", "tok/s/GPU", "TPOT ms", "TTFT ms", "plan; limits")
    table = []
    for r in rows:
        table.append(("*" if r.chosen else "", r.family, r.prefill, r.gpus,
                      f"{r.cost_per_mtok_usd:.4g}" if r.plan else "-", f"{r.tokens_per_s_per_gpu:,.0f}" if r.plan else "-",
                      f"{r.tpot_ms:.3g}" if r.plan else "-", f"{r.ttft_ms:.4g}" if math.isfinite(r.ttft_ms) else "-",
                      f"{r.plan}; {r.limits}" if r.plan else r.limits))
    widths = [max(len(x[i]) for x in table + [header]) for i in range(len(header) - 1)]
    lines = ["Plans considered (the best of each part of the space; * the cheapest):"]
    for x in [header] + table:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(x[:-1], widths)) + "  " + x[-1])
    return "\n".join(lines)

