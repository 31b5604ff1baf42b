"""`Plan`: the chosen serving plan, instantiated on a cluster (what `opweave compile` writes).

A plan names its template (the cut sites per block position), its stages (op ranges along the
token path, each with its owner slot), its owners (GPU type, TP degree, replicas, and the
physical GPUs of every replica of replica set 0), how many replica sets fit on the cluster, the
idle GPUs (as runs of global indices), the batching (resident batch of one replica set,
microbatches), the simulator's predicted figures, and the schedule's inputs: each stage's compute
and send time, each owner's price, the token-id return (so the schedule can be simulated again
from plan.json alone: `passes/trace_export.py problem_from_plan`). JSON round-trips through
`plan_to_json` / `plan_from_json`. Nothing in a plan depends on the wall clock or the host: the
same inputs give the same plan, byte for byte (the search's time goes to compile-info.json).

Note: the plan stays small whatever the cluster's size. It lists the GPUs of replica set 0 only:
that is what the runtime deploys (`--torchrun` commands; local runs use the first devices), and
every set's GPUs follow from the cluster and the owners (`passes/placement.py`,
`Placement.replica_set(k)`). Format 1 listed every set and every idle GPU (a million-GPU cluster
made a plan of tens of megabytes); `plan_from_json` still reads it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from opweave.ir.workload import KV_TAIL_Z, Workload, kv_pool_pages
from opweave.units import counted

PREFILL_CHUNK = 128
"""Default prefill budget (a planned figure carried by each rank program): at most this many prompt
tokens per round and microbatch, beside the decoding rows' one token each; a longer prompt is
prefilled over several rounds, and several short ones share a round (`opweave.runtime.scheduler`).
128 tokens keep a prefill step's GEMMs efficient (well past the memory-bound regime of a decode
step) while a round mixing prefill and decode stays a few decode steps long, so a new request
delays the decoding rows by at most its own chunk's compute. The planner's memory bound is wider:
rows x 128 tokens per microbatch (`passes/plan_memory.py`)."""

PAGE_TOKENS = 16  # positions per KV page of a full-attention layer (`opweave.runtime.pages`)

HOST_TOKEN_LAG = 2
"""Rounds after the round that samples a token until the host learns it: the runtime copies each
round's sampled ids to the host without waiting for them (`opweave.runtime.inputs.TokenCopies`),
so the ids sampled in round r reach the scheduler, and the server's streams, at the end of round
r + 2. A request's first token reaches its client two rounds after its last prompt chunk; the
traffic model adds them to TTFT (`passes/traffic.py`)."""

PLAN_FORMAT = "opweave-plan/3"
_OLD_FORMAT = "opweave-plan/1"  # every replica set's GPUs, idle GPUs one by one
_NO_SCHEDULE_FORMAT = "opweave-plan/2"  # as 3, without the schedule's inputs (they read as None)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanStage:
    index: int
    first_op: int
    last_op: int
    owner: int
    slot: int
    label: str
    out_bytes_per_token: int
    compute_s: float | None = None   # one microbatch on one replica of the owner (TP collectives included)
    send_s: float | None = None      # its output to the next stage's owner (0: same owner, or last stage)
    send_bytes: float | None = None  # bytes per microbatch of that send (all replicas together)
    send_inter_node: bool | None = None


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
    price_per_hour: float | None = None  # USD per GPU-hour of its GPU type (the catalog's, when compiled)
    experts: str = "tp"             # routed experts' layout: "tp" (sliced), "ep" (whole, E / tp per GPU) or "dp"
                                    # (as "ep", every other op data-parallel on the GPUs: `opweave.ir.tp`)
    dispatch: str = ""              # "dp": how routed tokens meet their experts, "gather" or "alltoall"
                                    # (`opweave.cost.model.dispatch_mode`); "" for other layouts
    group_nodes: int = 1            # "dp": the nodes its expert group spans (its GPUs split evenly over them)
    expert_slots: tuple = ()        # with redundant experts: per MoE layer (layer, each GPU's experts in
                                    # slot order), `opweave.ir.experts.placement`; () without copies


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
    counters: dict[str, float]       # the search's (passes/search.py Counters): deterministic
    return_s: float | None = None    # new token ids, last stage's owner -> stage 0's owner (0: same)
    return_bytes: float | None = None
    return_inter_node: bool | None = None
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per round and microbatch (the planned activations: rows x this)
    kv_cache_dtype: str = "auto"        # attention's keys and values: the model's dtype, or "fp8" (e4m3)
    isl: int | None = None           # the workload's prompt tokens (compile --isl), None: decode only
    osl: int | None = None           # its output tokens (compile --osl)
    ttft_ms: float | None = None     # mean TTFT at the planned load (`passes/traffic.py`)
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None  # the p99 round at the planned load (aggregated: one with its chunks)
    ttft_idle_ms: float | None = None  # one prompt through the stages alone, on an idle plan (`cost.prefill`)
    prefill: dict | None = None      # {"mode": "aggregated", "token_budget": C} | {"mode": "disaggregated", "owners": [...]}
    workload: dict | None = None     # `ir.workload.Workload.to_json`: what the plan was made for
    redundant_experts: int = 0       # extra expert slots per GPU of its expert-parallel owners (`ir.experts`)

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


def gpu_runs(indices) -> tuple[tuple[int, int], ...]:
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
    return {**data, "format": PLAN_FORMAT, "owners": owners, "idle_gpus": gpu_runs(data["idle_gpus"])}


def plan_from_json(data: dict[str, Any]) -> Plan:
    if isinstance(data, dict) and data.get("format") == _OLD_FORMAT:
        data = _from_old_format(data)
    if isinstance(data, dict) and data.get("format") == _NO_SCHEDULE_FORMAT:
        data = {**data, "format": PLAN_FORMAT}
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        fmt = data.get("format") if isinstance(data, dict) else None
        raise ValueError(f"not an {PLAN_FORMAT} plan (format {fmt!r})")
    return Plan(
        format=data["format"], model=data["model"], cluster=data["cluster"], context=data["context"],
        tpot_slo_ms=data["tpot_slo_ms"], template=data["template"], template_family=data["template_family"],
        template_sites=_tuples(data["template_sites"]), num_stages=data["num_stages"],
        stages_per_block=data["stages_per_block"],
        stages=tuple(PlanStage(**s) for s in data["stages"]),
        owners=tuple(PlanOwner(**{**o, "gpus": _tuples(o["gpus"]), "expert_slots": _tuples(o.get("expert_slots", []))})
                     for o in data["owners"]),
        batch=data["batch"], microbatches=data["microbatches"], replica_sets=data["replica_sets"],
        idle_gpus=_tuples(data["idle_gpus"]), predicted=Predicted(**data["predicted"]), counters=dict(data["counters"]),
        return_s=data.get("return_s"), return_bytes=data.get("return_bytes"),
        return_inter_node=data.get("return_inter_node"), prefill_chunk=data.get("prefill_chunk", PREFILL_CHUNK),
        kv_cache_dtype=data.get("kv_cache_dtype", "auto"),
        isl=data.get("isl"), osl=data.get("osl"), ttft_ms=data.get("ttft_ms"), ttft_p99_ms=data.get("ttft_p99_ms"),
        tpot_p99_ms=data.get("tpot_p99_ms"), ttft_idle_ms=data.get("ttft_idle_ms"), prefill=data.get("prefill"),
        workload=data.get("workload"), redundant_experts=data.get("redundant_experts", 0),
    )


def format_plan(plan: Plan, search_seconds: float | None = None) -> str:
    """The summary `opweave compile` prints (plan.txt: without the search's time, which is not
    deterministic; the command line gives `search_seconds`)."""
    p = plan.predicted
    kv = ", KV cache in fp8 (e4m3)" if plan.kv_cache_dtype == "fp8" else ""
    lines = [f"Plan for {plan.model} on {plan.cluster} at context {plan.context} (TPOT SLO {plan.tpot_slo_ms:g} ms{kv})",
             f"  template {plan.template} ({plan.template_family}): {plan.num_stages} "
             f"stage{'s' * (plan.num_stages != 1)} per token, "
             f"{plan.stages_per_block} per block",
             f"  batch {plan.batch} per replica set in {plan.microbatches} microbatch(es); "
             f"{plan.replica_sets:,} replica set(s) fit, {plan.gpus_used:,} GPUs used, {plan.num_idle_gpus:,} idle"]
    header = ("owner", "gpu", "tp", "replicas", "GPUs/set", "mem/GPU", "occupancy", "bubble")
    rows = [(f"o{o.slot}", o.gpu, str(o.tp) if o.experts == "tp" else f"{o.tp} {o.experts}", str(o.replicas),
             str(o.tp * o.replicas),
             f"{o.memory_per_gpu_bytes / 1e9:.1f} GB", f"{o.occupancy:.0%}", f"{o.bubble_ms:.2f} ms")
            for o in plan.owners]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    modes = sorted({o.dispatch or "gather" for o in plan.owners if o.experts == "dp"})
    if modes:
        how = {"gather": "the group's tokens gathered at each MoE layer and the sums reduce-scattered",
               "alltoall": "each token sent to the GPUs of its experts and their sums sent back (all-to-all)"}
        lines.append("  (dp: attention data-parallel on the group's GPUs, each its own rows; routed experts spread "
                     "over them, " + "; or ".join(how[m] for m in modes) + ")")
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"  predicted: TPOT {p.tpot_ms:.3g} ms, {p.tokens_per_s:,.0f} tokens/s, "
                 f"${p.cost_per_mtok_usd:.4g} per Mtoken, ${p.cost_per_hour_usd:.4g}/h, "
                 f"occupancy {p.mean_occupancy:.0%}, {p.bytes_per_token_inter / 1e3:.3g} kB/token inter-node")
    if plan.isl is not None:
        lines += format_traffic(plan)
    c = plan.counters
    lines.append(f"  search: {counted(c.get('templates', 0), 'template')}, "
                 f"{counted(c.get('owner_configs', 0), 'owner config')} "
                 f"({c.get('frontier_configs', 0):.0f} on frontiers), {c.get('candidates', 0):.0f} candidates, "
                 f"{c.get('simulator_calls', 0):.0f} simulator calls"
                 + (f", {search_seconds:.2f} s" if search_seconds is not None else ""))
    return "\n".join(lines)


def format_traffic(plan: Plan) -> list[str]:
    """plan.txt's lines on the workload and how prefill is served."""
    w = plan.workload or {}
    rate = f", {w['rate']:g} requests/s" if w.get("rate") else ""
    slo = f", TTFT SLO {w['ttft_slo_ms']:g} ms" if w.get("ttft_slo_ms") else ""
    lines = [f"  workload: prompts of {plan.isl:,} tokens, {plan.osl:,} output tokens (mean){rate}{slo}"]
    pre = plan.prefill
    if pre is None:
        return lines
    if pre["mode"] == "aggregated":
        how = (f"aggregated: chunks of at most {pre['token_budget']:,} prompt tokens per round and microbatch "
               f"beside the decoding rows, {pre['chunk_share']:.0%} of rounds carry one")
    else:
        o = pre["owners"][0]
        groups = f"{o['replicas']}x {o['gpu']} tp{o['tp']} for {o['for_sets']} replica set(s)"
        how = (f"disaggregated: {groups} prefill each prompt in {o['prefill_ms']:.3g} ms and send "
               f"its KV state ({o['kv_bytes'] / 1e6:.3g} MB, {o['kv_transfer_ms']:.3g} ms) to the decode owners; "
               f"the prefill GPUs are among those listed idle (prefill_rank_XX: `opweave run` and `serve` "
               f"start them, --prefill-sets)")
    lines.append(f"  prefill {how}")
    first = plan.owners[plan.stages[0].owner]
    slots = plan.microbatches * -(-plan.batch // (plan.microbatches * first.replicas))
    pages, full = (kv_pool_pages(slots, plan.context, Workload.from_json(w), PAGE_TOKENS) if w else 0,
                   kv_pool_pages(slots, plan.context, None, PAGE_TOKENS))
    if w and pages < full:
        lines.append(f"  KV pool: {pages:,} pages of {PAGE_TOKENS} tokens per rank of o{first.slot}'s largest replica "
                     f"({full:,} at the full context): the mean occupancy + {KV_TAIL_Z:g} sigma and one longest "
                     f"sequence (about {_overflow(KV_TAIL_Z):.2%} of rounds preempt a request)")
    if "fleet_sets" in pre:
        lines.append(f"  {w['rate']:g} requests/s take {pre['fleet_sets']} replica set(s) of this plan, each at "
                     f"{pre['load']:.0%} of its capacity")
    lines.append(f"  under traffic at {pre['load']:.0%} of capacity ({pre['requests_per_s']:.3g} requests/s per set): "
                 f"TTFT {plan.ttft_ms:.4g} ms (p99 {plan.ttft_p99_ms:.4g}), TPOT {plan.predicted.tpot_ms:.3g} ms "
                 f"(p99 round {plan.tpot_p99_ms:.3g}); one prompt alone on an idle plan: {plan.ttft_idle_ms:.4g} ms")
    return lines


def _overflow(z: float) -> float:
    """The normal tail beyond `z` standard deviations."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def verify_plan(plan: Plan, num_ops: int | None = None) -> Plan:
    """Checks a plan's invariants; returns it unchanged or raises `IRError`.

    The stages cover ops 0 .. num_ops - 1 exactly once and in order (each starts right after the
    previous one), their owners exist, every owner runs some stage and has `replicas` TP groups of
    `tp` GPUs, and no GPU of replica set 0 belongs to two owners, two replicas, or the idle runs.
    """
    from opweave.ir.graph import IRError
    from opweave.ir.tp import EXPERT_LAYOUTS

    if plan.num_stages != len(plan.stages) or not plan.stages:
        raise IRError(f"plan lists {len(plan.stages)} stages, num_stages says {plan.num_stages}")
    nxt = 0
    for i, s in enumerate(plan.stages):
        if s.index != i:
            raise IRError(f"stage {i} has index {s.index}")
        if s.first_op != nxt or s.last_op < s.first_op:
            what = "leaves ops out" if s.first_op > nxt else "repeats or reorders ops"
            raise IRError(f"stage {i} covers ops {s.first_op}..{s.last_op} after op {nxt - 1}: it {what}")
        if not 0 <= s.owner < len(plan.owners):
            raise IRError(f"stage {i} has owner o{s.owner}, the plan has {len(plan.owners)} owners")
        nxt = s.last_op + 1
    if num_ops is not None and nxt != num_ops:
        raise IRError(f"the stages cover ops 0..{nxt - 1} of {num_ops}")
    idle = {g for lo, hi in plan.idle_gpus for g in range(lo, hi)}
    seen: dict[int, str] = {}
    for k, o in enumerate(plan.owners):
        if o.slot != k:
            raise IRError(f"owner {k} has slot {o.slot}")
        if not any(s.owner == k for s in plan.stages):
            raise IRError(f"owner o{k} runs no stage")
        if o.experts not in EXPERT_LAYOUTS:
            raise IRError(f"owner o{o.slot}: expert layout {o.experts!r} is not one of {EXPERT_LAYOUTS}")
        if len(o.gpus) != o.replicas or any(len(r) != o.tp for r in o.gpus):
            raise IRError(f"owner o{k} lists {[len(r) for r in o.gpus]} GPUs per replica, "
                          f"expected {o.replicas} of {o.tp}")
        for j, replica in enumerate(o.gpus):
            for g in replica:
                here = f"o{k} replica {j}"
                if g in seen:
                    raise IRError(f"GPU {g} belongs to {seen[g]} and to {here}")
                if g in idle:
                    raise IRError(f"GPU {g} of {here} is also listed idle")
                seen[g] = here
    if plan.batch < plan.microbatches or plan.microbatches < 1:
        raise IRError(f"batch {plan.batch} in {plan.microbatches} microbatches")
    return plan
