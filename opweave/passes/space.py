"""The plan space and its evaluator: what a plan is made for (`PlanSpace`), one owner slot's
configuration (`SlotChoice`) built and checked as the search and pinned plans build it
(`owner_config`; the search's grid of them and its branch-and-bound: `passes/search.py`), the
stage latencies and memory footprints behind it (`Evaluator`, memoized per plan space), and a
complete plan as the schedule simulator sees it (`build_sim_problem`, `Candidate`).
"""

from __future__ import annotations

import dataclasses
import math

from opweave.cost.memory import Footprint, max_rows
from opweave.cost.model import CostModel, boundary_s, transfer_s
from opweave.errors import OpWeaveError
from opweave.hardware.cluster import Cluster
from opweave.ir.graph import OpGraph
from opweave.ir.plan import PREFILL_CHUNK
from opweave.ir.workload import Workload
from opweave.ir.tp import EXPERT_LAYOUTS, has_experts, indivisible, layout_choices, legal_tp
from opweave.passes.blocks import BlockedGraph
from opweave.passes.carry import held_bytes_per_token, round_robin, send_bytes_per_token
from opweave.passes.owners import OwnerConfig, microbatch_share
from opweave.passes.placement import Group, place, transfer_locality
from opweave.passes.simulate import SimOwner, SimProblem, SimResult, SimStage
from opweave.passes.templates import StagePlan

TOKEN_ID_BYTES = 8
"""Bytes per sequence handed back from the last stage to the embedding owner (an int64 token id)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanSpace:
    """What to plan for."""

    graph: OpGraph
    blocks: BlockedGraph
    cluster: Cluster
    context: int
    tpot_slo_s: float
    cost_model: CostModel = CostModel()
    prefill_chunk: int = PREFILL_CHUNK  # tokens per row per prefill step: sizes the activations
    workload: Workload | None = None    # the traffic (`passes/traffic.py`); None: decode alone
    attention_dp: bool = True           # also search data-parallel attention inside expert groups ("dp")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SlotChoice:
    """What the grid chooses for one owner slot: a GPU pool (index into the cluster's pools), a TP
    degree, a replica count, and the routed experts' layout ("tp" sliced, "ep" expert-parallel)."""

    pool: int
    tp: int
    replicas: int
    layout: str = "tp"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A complete plan of the space: stages, batching and owners, the simulator's problem and what
    the simulator made of it (`sim`)."""

    stage_plan: StagePlan
    batch: int
    microbatches: int
    owners: tuple[OwnerConfig, ...]
    problem: SimProblem
    sim: SimResult
    sets: int = 1                   # replica sets of these owners that fit on the cluster
    traffic: object = None          # `passes.traffic.Traffic` under a workload: how prefill is served

    @property
    def cluster_tokens_per_s(self) -> float:
        if self.traffic is not None:
            return self.traffic.sets * self.traffic.tokens_per_s
        return self.sets * self.sim.tokens_per_s

    @property
    def cost(self) -> float:
        return self.sim.cost_per_mtok_usd if self.traffic is None else self.traffic.cost_per_mtok_usd

    @property
    def tpot_s(self) -> float:
        return self.sim.tpot_s if self.traffic is None else self.traffic.tpot_s


class Evaluator:
    """Stage latencies and memory footprints for one plan space.

    Stage signatures are interned to small ints once per stage plan, and GPU types are named by
    their pool index, so the hot caches hash small tuples."""

    def __init__(self, space: PlanSpace):
        self.space = space
        self.hidden_bytes = space.graph.cuts[0].bytes_per_token if space.graph.cuts else 0
        self._sig_ids: dict[tuple, int] = {}
        self._sig_stage: list = []                       # sig id -> a representative stage
        self._sig_experts: list[bool] = []               # sig id -> whether the stage runs routed experts
        self._latency: dict[tuple[int, int, int, int], float] = {}
        self._footprint: dict[tuple, tuple[float, float] | None] = {}
        self._stage_sigs: dict[str, tuple[int, ...]] = {}
        self._slots: dict[tuple[str, int, int], tuple[list, tuple[int, ...], list]] = {}
        self._slot_keys: dict[tuple[str, int, int], tuple] = {}
        self._vectors: dict[tuple, tuple[float, ...]] = {}
        self._labels: dict[tuple[int, int, int], str] = {}
        self._slot_experts: dict[tuple[str, int, int], bool] = {}
        self._placements: dict[tuple[Group, ...], object] = {}
        self._locality: dict[tuple, dict[tuple[int, int], bool] | None] = {}
        self._sent: dict[tuple[str, int], tuple[int, ...]] = {}
        self._held: dict[tuple[str, int], dict[int, int]] = {}

    def locality(self, owners: tuple[OwnerConfig, ...], rows: int) -> dict[tuple[int, int], bool] | None:
        """`placement.transfer_locality` of the owners' replica sets on the cluster (memoized), or
        None when not one replica set fits in the cluster's nodes."""
        groups = owner_groups(owners)
        key = (groups, rows)
        if key not in self._locality:
            if groups not in self._placements:
                self._placements[groups] = place(groups, self.space.cluster)
            where = self._placements[groups]
            self._locality[key] = transfer_locality(where, self.space.cluster, rows) if where.num_sets else None
        return self._locality[key]

    def held_bytes(self, stage_plan: StagePlan, k: int) -> dict[int, int]:
        """Per slot: bytes per token it keeps for its later stages (`carry.held_bytes_per_token`)."""
        key = (stage_plan.template.name, k)
        if key not in self._held:
            self._held[key] = held_bytes_per_token(stage_plan, round_robin(stage_plan, k)) if k > 1 else {0: 0}
        return self._held[key]

    def sets(self, owners: tuple[OwnerConfig, ...]) -> int:
        """Replica sets of the owners that fit on the cluster (after `locality` placed them)."""
        return self._placements[owner_groups(owners)].num_sets

    def send_bytes(self, stage_plan: StagePlan, k: int) -> tuple[int, ...]:
        """Bytes per sequence each stage sends to the next stage's owner with `k` owner slots: only
        what that side needs (`passes/carry.py`: a value an owner already holds is not moved)."""
        key = (stage_plan.template.name, k)
        if key not in self._sent:
            self._sent[key] = send_bytes_per_token(stage_plan, round_robin(stage_plan, k))
        return self._sent[key]

    def sig_ids(self, stage_plan: StagePlan) -> tuple[int, ...]:
        name = stage_plan.template.name
        if name not in self._stage_sigs:
            ids = []
            for st in stage_plan.stages:
                if st.signature not in self._sig_ids:
                    self._sig_ids[st.signature] = len(self._sig_stage)
                    self._sig_stage.append(st)
                    self._sig_experts.append(has_experts(self.space.graph.ops[st.first:st.last + 1]))
                ids.append(self._sig_ids[st.signature])
            self._stage_sigs[name] = tuple(ids)
        return self._stage_sigs[name]

    def latency(self, sig: int, pool: int, tp: int, share: int, layout: str = "tp") -> float:
        """One occurrence of stage signature `sig` on one replica (routed experts held as `layout`)."""
        if layout != "tp" and (tp <= 1 or (layout == "ep" and not self._sig_experts[sig])):
            layout = "tp"  # ("dp" stays: a stage without experts still runs on its own rows)
        key = (sig, pool, tp, share, layout)
        value = self._latency.get(key)
        if value is None:
            st = self._sig_stage[sig]
            value = self.space.cost_model.ops_latency(
                self.space.graph.ops[st.first:st.last + 1], self.space.cluster.pools[pool].gpu, tp, share,
                self.space.context, self.hidden_bytes, layout)
            self._latency[key] = value
        return value

    def latencies(self, stage_plan: StagePlan, k: int, slot: int, pool: int, tp: int, share: int,
                  layout: str) -> tuple[float, ...]:
        """A slot's latency vector (one entry per occurrence of its stages, in token order) on one
        replica of (pool, tp, layout) processing `share` rows: what an `OwnerConfig` carries
        (memoized: batches and replica counts with the same share reuse it)."""
        key = (stage_plan.template.name, k, slot, pool, tp, share, layout)
        hit = self._vectors.get(key)
        if hit is None:
            stages, sigs, _ = self.slot(stage_plan, k, slot)
            by_sig = {sig: self.latency(sig, pool, tp, share, layout) for sig in set(sigs)}
            if self.space.cost_model.charges_host:
                hit = tuple(by_sig[sig] + self.host_s(stage_plan, k, s.index, pool, share)
                            for s, sig in zip(stages, sigs))
            else:
                hit = tuple(by_sig[sig] for sig in sigs)
            self._vectors[key] = hit
        return hit

    def label(self, stage) -> str:
        """`_label` of a stage (memoized: every simulated plan labels its stages)."""
        key = (stage.index, stage.first, stage.last)
        hit = self._labels.get(key)
        if hit is None:
            hit = self._labels[key] = _label(self.space.graph, stage)
        return hit

    def sig_experts(self, sig: int) -> bool:
        """Whether stage signature `sig` runs routed experts."""
        return self._sig_experts[sig]

    def floor_latency(self, sig: int, pool: int, tp: int, share: int) -> float:
        """The least `latency` of `sig` over the expert layouts (a bound: legality not checked)."""
        lat = self.latency(sig, pool, tp, share)
        if tp > 1 and self._sig_experts[sig]:
            lat = min(lat, self.latency(sig, pool, tp, share, "ep"))
        if tp > 1 and self.space.attention_dp:  # any stage of a slot with experts may run on its own rows
            lat = min(lat, self.latency(sig, pool, tp, share, "dp"))
        return lat

    def host_s(self, stage_plan: StagePlan, k: int, index: int, pool: int, share: int) -> float:
        """Host time of stage `index`'s transfers on its own stream (`CostModel.transfer_host_s`):
        taking in its inputs when another owner sends them (stage 0: the token ids), and sending
        its outputs when another owner takes them (the last stage: the token ids back)."""
        cm = self.space.cost_model
        if not cm.charges_host:
            return 0.0
        stages, spb = stage_plan.stages, stage_plan.stages_per_block
        n, me, gpu = len(stages), slot_of(index, spb, k), self.space.cluster.pools[pool].gpu
        total = 0.0
        if slot_of((index - 1) % n, spb, k) != me:
            per_token = self.send_bytes(stage_plan, k)[index - 1] if index > 0 else TOKEN_ID_BYTES
            total += cm.transfer_host_s(per_token * share, gpu, "recv")
        if slot_of((index + 1) % n, spb, k) != me:
            per_token = self.send_bytes(stage_plan, k)[index] if index + 1 < n else TOKEN_ID_BYTES
            total += cm.transfer_host_s(per_token * share, gpu, "send")
        return total

    def slot(self, stage_plan: StagePlan, k: int, slot: int) -> tuple[list, tuple[int, ...], list]:
        """(stages, their signature ids, their ops) of one owner slot."""
        key = (stage_plan.template.name, k, slot)
        if key not in self._slots:
            ids = self.sig_ids(stage_plan)
            stages = [s for s in stage_plan.stages if slot_of(s.index, stage_plan.stages_per_block, k) == slot]
            ops = [op for s in stages for op in self.space.graph.ops[s.first:s.last + 1]]
            self._slots[key] = (stages, tuple(ids[s.index] for s in stages), ops)
            # what the memory accounting depends on: the slot's op ranges (templates share them)
            self._slot_keys[key] = tuple((s.first, s.last) for s in stages)
            self._slot_experts[key] = has_experts(ops)
        return self._slots[key]

    def slot_key(self, stage_plan: StagePlan, k: int, slot: int) -> tuple:
        """The slot's op ranges: the key of its memory accounting (`footprint`)."""
        self.slot(stage_plan, k, slot)
        return self._slot_keys[(stage_plan.template.name, k, slot)]

    def footprint(self, key: tuple, ops, tp: int, layout: str = "tp") -> Footprint | None:
        """The memory accounting (`opweave.cost.memory`) of a GPU of a TP group of `tp` running
        `ops`, routed experts held as `layout`; None when that group cannot split every sharded op."""
        full = key + (tp, layout)
        if full not in self._footprint:
            if not legal_tp(ops, tp, layout):
                self._footprint[full] = None
            else:
                self._footprint[full] = Footprint.of(ops, tp, self.space.context, self.space.prefill_chunk, layout,
                                                     self.space.cost_model.redundant_experts)
        return self._footprint[full]

    def layouts(self, stage_plan: StagePlan, k: int, slot: int, tp: int) -> tuple[str, ...]:
        """The expert layouts a slot chooses among at TP `tp`: both where it runs routed experts
        (and tp > 1), else "tp" alone."""
        self.slot(stage_plan, k, slot)
        return layout_choices(self._slot_experts[(stage_plan.template.name, k, slot)], tp, self.space.attention_dp)


def slot_of(stage_index: int, stages_per_block: int, k: int) -> int:
    return (stage_index % stages_per_block) % k


def fits_group(tp: int, gpu, count: int, layout: str) -> bool:
    """Whether a TP group of `tp` GPUs of type `gpu` can exist in a pool of `count`: inside one
    node, or for expert-parallel experts (`layout` "ep" or "dp") a whole number of nodes
    (`search.WIDE_TP`)."""
    if tp > count:
        return False
    if tp <= gpu.gpus_per_node:
        return True
    return layout in ("ep", "dp") and tp % gpu.gpus_per_node == 0


def _tp_misfit(ev: Evaluator, stage_plan: StagePlan, k: int, slot: int, pool: int, tp: int,
               layout: str = "tp") -> str | None:
    """Why no configuration of `slot` on pool `pool` can use TP `tp` with expert layout `layout`
    (a `Counters` field of `passes/search.py`), or None."""
    p = ev.space.cluster.pools[pool]
    if not fits_group(tp, p.gpu, p.count, layout):
        return "configs_over_node"
    if ev.footprint(ev.slot_key(stage_plan, k, slot), ev.slot(stage_plan, k, slot)[2], tp, layout) is None:
        return "configs_tp_indivisible"
    return None


def _replica_misfit(ev: Evaluator, choice: SlotChoice, batch: int, n: int, memory: float) -> str | None:
    """Why `choice.replicas` TP groups of `choice.tp` holding `memory` bytes per GPU do not fit (a
    `Counters` field), or None."""
    p = ev.space.cluster.pools[choice.pool]
    if choice.replicas * choice.tp > p.count or choice.replicas * n > batch:
        return "configs_over_pool"
    if memory > p.gpu.usable_memory_bytes:
        return "configs_over_memory"
    return None


def _config(ev: Evaluator, stage_plan: StagePlan, k: int, slot: int, choice: SlotChoice, batch: int, n: int,
            memory: float) -> OwnerConfig:
    share = microbatch_share(batch, n, choice.replicas)
    latencies = ev.latencies(stage_plan, k, slot, choice.pool, choice.tp, share, choice.layout)
    return OwnerConfig(slot=slot, gpu=ev.space.cluster.pools[choice.pool].gpu, tp=choice.tp, replicas=choice.replicas,
                       share=share, latencies=latencies, memory_per_gpu=memory, experts=choice.layout)


def _memory(ev: Evaluator, stage_plan: StagePlan, k: int, slot: int, choice: SlotChoice, batch: int, n: int,
            full_context: bool = False) -> float:
    """Bytes per GPU of `slot` as `choice`: weights, the state of n x (its replica's rows) slots
    (the KV pool sized for the space's workload, `ir.workload.kv_pool_pages`, unless
    `full_context` or there is none: every slot at the full context), one step's activations
    (`opweave.cost.memory.Footprint`; TP must divide), and the values the slot keeps for its later
    stages instead of sending them (`carry.held_bytes_per_token`), for every microbatch of a
    prefill-wide step."""
    held = ev.held_bytes(stage_plan, k)[slot] * max_rows(batch, n, choice.replicas) * ev.space.prefill_chunk * n
    ops = ev.slot(stage_plan, k, slot)[2]
    footprint = ev.footprint(ev.slot_key(stage_plan, k, slot), ops, choice.tp, choice.layout)
    return footprint.bytes(batch, n, choice.replicas, None if full_context else ev.space.workload) + held


def split_pool_owners(owners: tuple[OwnerConfig, ...], stage_plan: StagePlan, holds_state) -> list[int]:
    """Owners holding state for rows that are not exactly one scheduling replica's (their replicas
    differ from stage 0's owner's, `runtime.worker.split_pools`): their KV pools cannot follow the
    scheduler's and stay at the full context. `holds_state(slot)`: whether the slot's ops hold state."""
    k = len(owners)
    first = owners[slot_of(0, stage_plan.stages_per_block, k)].replicas
    return [i for i, o in enumerate(owners) if o.replicas != first and holds_state(i)]


def full_context_owners(ev: Evaluator, stage_plan: StagePlan, batch: int, n: int,
                        owners: tuple[OwnerConfig, ...]) -> tuple[OwnerConfig, ...] | None:
    """`owners`, or when some pools are split (`split_pool_owners`) every owner holding state at
    its full-context memory, as the runtime then keeps it; None when one of them no longer fits (a
    workload-sized pool is only for plans whose pools all follow the scheduler's)."""
    if ev.space.workload is None:
        return owners
    k = len(owners)
    holds = [any(op.state for op in ev.slot(stage_plan, k, i)[2]) for i in range(k)]
    if not split_pool_owners(owners, stage_plan, holds.__getitem__):
        return owners
    pools = {p.gpu.name: i for i, p in enumerate(ev.space.cluster.pools)}
    out = list(owners)
    for i in (i for i in range(k) if holds[i]):   # the runtime then keeps every pool at the full context
        o = owners[i]
        choice = SlotChoice(pool=pools[o.gpu.name], tp=o.tp, replicas=o.replicas, layout=o.experts)
        memory = _memory(ev, stage_plan, k, i, choice, batch, n, full_context=True)
        if memory > o.gpu.usable_memory_bytes:
            return None
        out[i] = dataclasses.replace(o, memory_per_gpu=memory)
    return tuple(out)


def owner_configs(ev: Evaluator, stage_plan: StagePlan, k: int, slot: int, batch: int, n: int,
                  tp_degrees: tuple[int, ...], replicas: tuple[int, ...]
                  ) -> tuple[list[OwnerConfig], dict[str, int]]:
    """Every configuration of `slot` on the grid (each pool x `tp_degrees` x each expert layout of
    `Evaluator.layouts` x `replicas`) that fits (node, TP divisibility, pool, memory), and how
    many did not, by reason (`Counters` fields)."""
    out, misfits = [], {}
    for pool in range(len(ev.space.cluster.pools)):
        for tp in tp_degrees:
            for layout in ev.layouts(stage_plan, k, slot, tp):
                why = _tp_misfit(ev, stage_plan, k, slot, pool, tp, layout)
                if why is not None:
                    misfits[why] = misfits.get(why, 0) + 1
                    continue
                for r in replicas:
                    choice = SlotChoice(pool=pool, tp=tp, replicas=r, layout=layout)
                    mem = _memory(ev, stage_plan, k, slot, choice, batch, n)
                    why = _replica_misfit(ev, choice, batch, n, mem)
                    if why is not None:
                        misfits[why] = misfits.get(why, 0) + 1
                        continue
                    out.append(_config(ev, stage_plan, k, slot, choice, batch, n, mem))
    return out, misfits


def owner_config(ev: Evaluator, stage_plan: StagePlan, k: int, slot: int, gpu: str, tp: int, replicas: int,
                 batch: int, n: int, layout: str = "tp") -> OwnerConfig:
    """The configuration (GPU type `gpu`, TP `tp`, `replicas`, expert layout `layout`) of `slot`,
    built and checked as the search does; a one-line `OpWeaveError` naming what does not fit
    (pinned plans)."""
    pools = ev.space.cluster.pools
    pool = next((i for i, p in enumerate(pools) if p.gpu.name == gpu), None)
    what = f"owner o{slot} ({replicas}x {gpu} tp{tp}{'' if layout == 'tp' else ' ' + layout})"
    if layout not in EXPERT_LAYOUTS:
        raise OpWeaveError(f"{what}: expert layout {layout!r} is not one of {', '.join(EXPERT_LAYOUTS)}")
    if pool is None:
        raise OpWeaveError(f"{what}: the cluster {ev.space.cluster.spec} has no {gpu}")
    if tp < 1 or replicas < 1:
        raise OpWeaveError(f"{what}: TP and replicas must be at least 1")
    p = pools[pool]
    if layout in ("ep", "dp") and not has_experts(ev.slot(stage_plan, k, slot)[2]):
        raise OpWeaveError(f"{what}: expert parallelism needs routed experts; this owner runs none")
    why = _tp_misfit(ev, stage_plan, k, slot, pool, tp, layout)
    if why == "configs_over_node":
        raise OpWeaveError(f"{what}: TP {tp} exceeds the {gpu} node size ({p.gpu.gpus_per_node} GPUs) "
                           f"or the pool ({p.count} GPUs); a TP group stays inside one node, except an "
                           "expert-parallel one of whole nodes")
    if why == "configs_tp_indivisible":
        _, _, ops = ev.slot(stage_plan, k, slot)
        bad = next((op for op in ops if not legal_tp([op], tp, layout)), None)
        raise OpWeaveError(f"{what}: TP {tp} does not divide {indivisible(bad, layout)}")
    choice = SlotChoice(pool=pool, tp=tp, replicas=replicas, layout=layout)
    mem = _memory(ev, stage_plan, k, slot, choice, batch, n)
    why = _replica_misfit(ev, choice, batch, n, mem)
    if why == "configs_over_pool":
        if replicas * n > batch:
            raise OpWeaveError(f"{what}: {replicas} replicas x {n} microbatches exceed batch {batch} "
                               "(a replica would get no sequence)")
        raise OpWeaveError(f"{what}: needs {replicas * tp} GPUs, the cluster has {p.count} {gpu}")
    if why == "configs_over_memory":
        raise OpWeaveError(f"{what}: needs {mem / 1e9:.1f} GB per GPU at batch {batch}, context "
                           f"{ev.space.context}; a {gpu} has {p.gpu.usable_memory_bytes / 1e9:.1f} GB usable")
    return _config(ev, stage_plan, k, slot, choice, batch, n, mem)


def owner_groups(owners: tuple[OwnerConfig, ...]) -> tuple[Group, ...]:
    """What placement needs of a plan's owners: per owner, its replicas' TP groups."""
    return tuple(Group(gpu=o.gpu.name, tp=o.tp, replicas=o.replicas) for o in owners)


def build_sim_problem(ev: Evaluator, stage_plan: StagePlan, batch: int, n: int,
                      owners: tuple[OwnerConfig, ...]) -> SimProblem | None:
    """The simulator's view of a complete plan, with every transfer costed where placement puts it
    (`placement.transfer_locality`); None when not one replica set of the owners can be placed."""
    k = len(owners)
    mb = math.ceil(batch / n)
    local = ev.locality(owners, mb)
    if local is None:
        return None
    slots = [slot_of(s.index, stage_plan.stages_per_block, k) for s in stage_plan.stages]
    sent = ev.send_bytes(stage_plan, k)
    per_slot_index = [0] * k
    stages = []
    for i, s in enumerate(stage_plan.stages):
        o = owners[slots[i]]
        compute = o.latencies[per_slot_index[slots[i]]]
        per_slot_index[slots[i]] += 1
        send_s = send_bytes = 0.0
        intra = False
        if i + 1 < len(stage_plan.stages) and slots[i + 1] != slots[i] and sent[i] > 0:
            dst = owners[slots[i + 1]]
            intra = local[(slots[i], slots[i + 1])]
            send_s = boundary_s(sent[i], o.gpu, o.share, dst.gpu, dst.share, dst.tp, inter_node=not intra)
            send_bytes = sent[i] * mb
        stages.append(SimStage(owner=slots[i], compute_s=compute, send_s=send_s, send_bytes=send_bytes,
                               inter_node=send_s > 0 and not intra, label=ev.label(s)))
    last, first = owners[slots[-1]], owners[slots[0]]
    return_s = return_bytes = 0.0
    intra = False
    if slots[-1] != slots[0]:
        intra = local[(slots[-1], slots[0])]
        return_s = transfer_s(TOKEN_ID_BYTES * last.share, last.gpu, first.gpu, inter_node=not intra,
                              received=TOKEN_ID_BYTES * first.share)
        return_bytes = TOKEN_ID_BYTES * mb
    sim_owners = tuple(SimOwner(name=f"o{o.slot} {o.describe()}", replicas=o.replicas, gpus_per_replica=o.tp,
                                price_per_hour=o.gpu.price_per_hour, memory_per_gpu=o.memory_per_gpu)
                       for o in owners)
    return SimProblem(owners=sim_owners, stages=tuple(stages), return_s=return_s, batch=batch,
                      num_microbatches=n, return_bytes=return_bytes, return_inter_node=return_s > 0 and not intra)


def _label(graph: OpGraph, stage) -> str:
    a, b = graph.ops[stage.first], graph.ops[stage.last]
    layers = f"L{a.layer}" if a.layer == b.layer else f"L{a.layer}-{b.layer}"
    return f"s{stage.index} {layers} {a.kind.value}..{b.kind.value}"
