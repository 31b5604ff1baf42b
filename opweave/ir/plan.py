"""`Plan`: the chosen serving plan, instantiated on a cluster (what `opweave compile` writes).

A plan names its template (the cut sites per block position), its stages (op ranges along the
token path, each with its owner slot), its owners (GPU type, TP degree, replicas, and the
physical GPUs of every replica of replica set 0), how many replica sets fit on the cluster, the
idle GPUs (as runs of global indices), the batching (resident batch of one replica set,
microbatches) and the simulator's predicted figures. JSON round-trips through `plan_to_json` /
`plan_from_json`.

Note: the plan stays small whatever the cluster's size. It lists the GPUs of replica set 0 only:
that is what the runtime deploys (`--torchrun` commands; local runs use the first devices), and
every set's GPUs follow from the cluster and the owners (`passes/placement.py`,
`Placement.replica_set(k)`). Format 1 listed every set and every idle GPU (a million-GPU cluster
made a plan of tens of megabytes); `plan_from_json` still reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PLAN_FORMAT = "opweave-plan/2"
_OLD_FORMAT = "opweave-plan/1"  # every replica set's GPUs, idle GPUs one by one


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanStage:
    index: int
    first_op: int
    last_op: int
    owner: int
    slot: int
    label: str
    out_bytes_per_token: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanOwner:
    slot: int
    gpu: str
    tp: int
    replicas: int
    memory_per_gpu_bytes: float
    occupancy: float
    bubble_ms: float
    gpus: tuple[tuple[int, ...], ...]  # [replica] -> global GPU indices, in replica set 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Predicted:
    tpot_ms: float
    tokens_per_s: float             # whole deployment (every replica set)
    tokens_per_s_per_set: float
    cost_per_mtok_usd: float
    cost_per_hour_usd: float        # whole deployment
    bytes_per_token_intra: float
    bytes_per_token_inter: float
    mean_occupancy: float


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    format: str
    model: str
    cluster: str
    context: int
    tpot_slo_ms: float
    template: str
    template_family: str
    template_sites: tuple[tuple[str, ...], ...]
    num_stages: int
    stages_per_block: int
    stages: tuple[PlanStage, ...]
    owners: tuple[PlanOwner, ...]
    batch: int                       # resident sequences per replica set
    microbatches: int
    replica_sets: int
    idle_gpus: tuple[tuple[int, int], ...]  # runs [lo, hi) of global GPU indices no replica set uses
    predicted: Predicted
    counters: dict[str, float]

    @property
    def gpus_per_set(self) -> int:
        return sum(o.tp * o.replicas for o in self.owners)

    @property
    def gpus_used(self) -> int:
        return self.gpus_per_set * self.replica_sets

    @property
    def num_idle_gpus(self) -> int:
        return sum(hi - lo for lo, hi in self.idle_gpus)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan's fields plus headline figures at top level (ignored by `plan_from_json`)."""
    out = _plain(plan)
    out.update(cost_per_mtok_usd=plan.predicted.cost_per_mtok_usd, tpot_ms=plan.predicted.tpot_ms,
               tokens_per_s=plan.predicted.tokens_per_s)
    return out


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _runs(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted indices -> runs [lo, hi) of consecutive ones."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((lo, hi) for lo, hi in runs)


def _from_old_format(data: dict[str, Any]) -> dict[str, Any]:
    """A format-1 plan as format 2: replica set 0's GPUs, idle GPUs as runs."""
    owners = [{**o, "gpus": o["gpus"][0]} for o in data["owners"]]
    return {**data, "format": PLAN_FORMAT, "owners": owners, "idle_gpus": _runs(data["idle_gpus"])}


def plan_from_json(data: dict[str, Any]) -> Plan:
    if isinstance(data, dict) and data.get("format") == _OLD_FORMAT:
        data = _from_old_format(data)
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        fmt = data.get("format") if isinstance(data, dict) else None
        raise ValueError(f"not an {PLAN_FORMAT} plan (format {fmt!r})")
    return Plan(
        format=data["format"], model=data["model"], cluster=data["cluster"], context=data["context"],
        tpot_slo_ms=data["tpot_slo_ms"], template=data["template"], template_family=data["template_family"],
        template_sites=_tuples(data["template_sites"]), num_stages=data["num_stages"],
        stages_per_block=data["stages_per_block"],
        stages=tuple(PlanStage(**s) for s in data["stages"]),
        owners=tuple(PlanOwner(**{**o, "gpus": _tuples(o["gpus"])}) for o in data["owners"]),
        batch=data["batch"], microbatches=data["microbatches"], replica_sets=data["replica_sets"],
        idle_gpus=_tuples(data["idle_gpus"]), predicted=Predicted(**data["predicted"]), counters=dict(data["counters"]),
    )


def format_plan(plan: Plan) -> str:
    """The summary `opweave compile` prints."""
    p = plan.predicted
    lines = [f"Plan for {plan.model} on {plan.cluster} at context {plan.context} (TPOT SLO {plan.tpot_slo_ms:g} ms)",
             f"  template {plan.template} ({plan.template_family}): {plan.num_stages} stages per token, "
             f"{plan.stages_per_block} per block",
             f"  batch {plan.batch} per replica set in {plan.microbatches} microbatch(es); "
             f"{plan.replica_sets:,} replica set(s) fit, {plan.gpus_used:,} GPUs used, {plan.num_idle_gpus:,} idle"]
    header = ("owner", "gpu", "tp", "replicas", "GPUs/set", "mem/GPU", "occupancy", "bubble")
    rows = [(f"o{o.slot}", o.gpu, str(o.tp), str(o.replicas), str(o.tp * o.replicas),
             f"{o.memory_per_gpu_bytes / 1e9:.1f} GB", f"{o.occupancy:.0%}", f"{o.bubble_ms:.2f} ms")
            for o in plan.owners]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"  predicted: TPOT {p.tpot_ms:.3g} ms, {p.tokens_per_s:,.0f} tokens/s, "
                 f"${p.cost_per_mtok_usd:.4g} per Mtoken, ${p.cost_per_hour_usd:.4g}/h, "
                 f"occupancy {p.mean_occupancy:.0%}, {p.bytes_per_token_inter / 1e3:.3g} kB/token inter-node")
    c = plan.counters
    lines.append(f"  search: {c.get('templates', 0):.0f} templates, {c.get('owner_configs', 0):.0f} owner configs "
                 f"({c.get('frontier_configs', 0):.0f} on frontiers), {c.get('candidates', 0):.0f} candidates, "
                 f"{c.get('simulator_calls', 0):.0f} simulator calls, {c.get('seconds', 0):.2f} s")
    return "\n".join(lines)
