"""Plan search (summary §5.2, §5.3, C.1): stage templates x owners x batching, judged by the simulator.

Search state, outermost first:
    template t (regularity-aware family, or one named template)      -> StagePlan (stages, slots)
    k owner slots (k divides stages per block; 1 only for colocated)
    resident batch B of one replica set, microbatches n (n <= B)
    per slot o = 0..k-1: an owner configuration (GPU type, TP degree, replicas, and for a slot
                         with routed experts their layout, sliced "tp" or expert-parallel "ep")
                                                                                  <- DFS level o

Reductions, each switchable for ablation:
  1. Pareto (`pareto`): per slot, drop configurations another one dominates (owners.py).
  2. Branch-and-bound (`bnb`): DFS over the frontier product; a prefix is cut when its optimistic
     TPOT (sum of stage latencies along one microbatch's path, the cheapest unassigned choices,
     the least possible transfer latency) exceeds the SLO, or its optimistic cost (cheapest
     completion's cost rate x that TPOT / B) cannot beat the incumbent. Both bounds are below the
     simulated figures, so the search stays exact over its grid.
  3. The schedule simulator judges every surviving complete plan.
With neither reduction every configuration product is simulated (the exhaustive reference).
Complexity: sum over (t, k, B, n) of prod_o |frontier_o| simulator calls in the worst case.
Deterministic: fixed enumeration order; ties broken by that order.
The plan space, its evaluator and the owner configurations of one slot: `passes/space.py`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

from opweave.hardware.cluster import Cluster
from opweave.ir.graph import OpGraph
from opweave.passes.owners import OwnerConfig, microbatch_share, pareto_frontier
from opweave.passes.simulate import simulate
from opweave.units import counted
from opweave.passes.space import Candidate, Evaluator, PlanSpace, build_sim_problem, fits_group, \
    full_context_owners, owner_configs, slot_of
from opweave.passes.templates import StagePlan, build_stages, enumerate_templates
from opweave.passes.traffic import TrafficModel

OBJECTIVES = ("cost", "throughput")
"""cost: the least $/Mtoken of one replica set (what a fleet of copies costs per token);
throughput: the most tokens/s on the given cluster (replica sets that fit x tokens/s of one), ties
broken by cost. Both subject to the TPOT SLO and memory."""

DEFAULT_MAX_BATCH = 4096
"""The batch grid's default ceiling per replica set (`--max-batch` raises or lowers it): above the
compute-bound threshold of a dense model's GEMMs on every catalog GPU type (b* ~ 150-300 tokens per
GEMM call, so 4096 leaves room for microbatches and replicas), and as far as the grid can go
while planning a §7 setting stays well under a minute on a 2-core machine."""


WIDE_TP = (16, 32)
"""Group sizes above a node that the default grid tries for owners running routed experts,
expert-parallel only (whole nodes; the all-reduce is hierarchical: `cost.model.allreduce_s`):
models whose experts do not fit one node (DeepSeek-V3 on H100s) or serve cheaper spread wider."""


def batch_grid(limit: int) -> tuple[int, ...]:
    """Powers of two and their midpoints (1, 2, 3, 4, 6, 8, 12, 16, 24 ...) up to `limit`."""
    out, p = [], 1
    while p <= limit:
        out.append(p)
        if p >= 2 and p + p // 2 <= limit:
            out.append(p + p // 2)
        p *= 2
    return tuple(out)


def memory_batch_limit(graph: OpGraph, cluster: Cluster, context: int, workload=None) -> int:
    """The most sequences one replica set could hold: every GPU of the cluster holding one copy of
    the weights' share and the rest in per-sequence state, with a workload at its mean tokens in
    flight (an upper bound: no plan fits more; a workload-sized pool holds more than the mean)."""
    usable = sum(p.count * p.gpu.usable_memory_bytes for p in cluster.pools)
    state = graph.state_bytes(context if workload is None else min(context, workload.isl + workload.osl // 2))
    if state <= 0:
        return 1 << 30
    return max(1, int((usable - graph.weight_bytes) // state))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SearchOptions:
    """The plan grid, the objective and the reductions. Allowed values: templates in
    all|colocated|afd|cad; objective in cost|throughput (`OBJECTIVES`)."""

    templates: str = "all"
    only_templates: tuple[str, ...] | None = None   # restrict to these template names (tests, users)
    batches: tuple[int, ...] | None = None          # None: `batch_grid` up to what fits (and max_batch)
    max_batch: int = DEFAULT_MAX_BATCH              # the auto grid's ceiling (the memory limit may be lower)
    microbatches: tuple[int, ...] = (1, 2, 4)
    tp_degrees: tuple[int, ...] = (1, 2, 4, 8) + WIDE_TP
    replicas: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    max_owners: int = 3
    objective: str = "cost"                         # cost: least $/Mtoken; throughput: most tokens/s on the cluster
    pareto: bool = True
    bnb: bool = True
    attention_dp: bool = True  # also search data-parallel attention inside expert groups (owner layout "dp")
    redundant_experts: tuple[int, ...] = (0,)  # extra expert slots per GPU of expert-parallel groups to try


@dataclasses.dataclass
class Counters:
    """What the search looked at and why it dropped the rest. Deterministic (no wall-clock time:
    it goes in the plan, whose hash must not change between identical compiles)."""

    templates: int = 0
    stage_plans: int = 0           # (template, k, B, n) combinations looked at
    owner_configs: int = 0         # memory-feasible owner configurations built
    frontier_configs: int = 0      # of which survive the Pareto reduction
    candidates: int = 0            # complete plans reached
    simulator_calls: int = 0
    pruned_prefixes: int = 0       # cut by the bounds: pruned_root_* + pruned_slo + pruned_cost
    pruned_root_slo: int = 0       # (template, B, n) skipped before building owners: TPOT bound > SLO
    pruned_root_cost: int = 0      # ... cost bound >= the incumbent's cost
    pruned_slo: int = 0            # DFS prefixes cut: optimistic TPOT > SLO (or >= the fastest so far)
    pruned_cost: int = 0           # DFS prefixes cut: optimistic cost >= the incumbent's
    over_capacity: int = 0         # prefixes needing more GPUs of a type than the cluster has
    unplaceable: int = 0           # complete plans whose TP groups do not fit in the cluster's nodes
    traffic_priced: int = 0        # complete plans priced under the workload (`passes/traffic.py`)
    over_ttft: int = 0             # ... of which no way of serving prefill meets the SLOs
    configs_over_node: int = 0     # (GPU type, TP) with TP above the node size or the pool
    configs_tp_indivisible: int = 0  # (GPU type, TP) where TP does not divide a sharded op
    configs_over_pool: int = 0     # replicas x TP above the pool, or more replicas than sequences
    configs_over_memory: int = 0   # owner configurations over the GPU's usable memory


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    best: Candidate | None          # cheapest plan meeting the SLO
    closest: Candidate | None       # lowest TPOT among plans that fit (for "no plan meets the SLO")
    counters: Counters
    reason: str = ""                # why there is no plan, when `best` is None
    seconds: float = 0.0            # wall-clock time of the search (not in the plan: compile-info.json)


def _gpus_by_type(owners) -> dict[str, int]:
    """GPUs one replica set of `owners` takes, per GPU type."""
    used: dict[str, int] = {}
    for c in owners:
        used[c.gpu.name] = used.get(c.gpu.name, 0) + c.num_gpus
    return used


class _Search:
    def __init__(self, space: PlanSpace, options: SearchOptions, progress: Callable[[str], None] | None,
                 fastest: bool = False):
        self.space, self.options, self.progress = space, options, progress
        self.fastest = fastest  # objective: lowest TPOT instead of lowest cost (names the closest plan)
        self.ev = Evaluator(space)
        self.counters = Counters()
        self.best: Candidate | None = None
        self.closest: Candidate | None = None
        self.min_link_latency = min(min(p.gpu.inter_link_latency, p.gpu.intra_link_latency)
                                    for p in space.cluster.pools)
        self.fits_anywhere = False
        self.min_gpus_needed = math.inf
        self._crossings: dict[tuple[str, int], int] = {}
        self._floors: dict[tuple[int, int, int], tuple[float, float, float]] = {}
        self._counts = {p.gpu.name: p.count for p in space.cluster.pools}
        self.traffic = None if space.workload is None else TrafficModel(self.ev, space.workload, options.tp_degrees)
        self.closest_ttft = None   # under a workload: the prefill option with the lowest TTFT seen
        self.batches = options.batches if options.batches is not None else batch_grid(
            min(options.max_batch, memory_batch_limit(space.graph, space.cluster, space.context, space.workload)))

    # ---- bounds
    def _bound(self, stage_plan: StagePlan, k: int, batch: int, n: int, chosen: list[OwnerConfig]
               ) -> tuple[float, float, float]:
        """Optimistic (TPOT, $/Mtok) of any completion of `chosen` (C.1).

        TPOT >= one microbatch's round trip (every stage once, plus the least link latency at each
        owner change), and TPOT >= n x each owner's work per microbatch (the simulator's TPOT is the
        steady-state period, at least every stream's load per round)."""
        busy = [chosen[o].busy_s if o < len(chosen) else self._min_busy[o] for o in range(k)]
        path = sum(busy) + self._crossings[(stage_plan.template.name, k)] * self.min_link_latency
        tpot = max(path, n * max(busy))
        rate = sum(c.cost_per_hour for c in chosen) + sum(self._min_rate[len(chosen):])
        cost_time = sum(c.cost_per_hour * n * c.busy_s for c in chosen) + sum(self._min_cost_time[len(chosen):])
        cost = max(rate * tpot, cost_time) / 3600.0 / batch * 1e6
        if self.options.objective != "throughput":
            return tpot, cost, math.inf
        gpu_time = sum(c.num_gpus * n * c.busy_s for c in chosen) + sum(self._min_gpu_time[len(chosen):])
        return tpot, cost, self._tokens_bound(batch, tpot, gpu_time, chosen)

    def _tokens_bound(self, batch: int, tpot: float, gpu_time: float, chosen: list[OwnerConfig]) -> float:
        """Most tokens/s on the cluster any completion could reach: sets x batch / TPOT with sets at
        most `_sets_bound`, and at most (all GPUs / GPUs per set) x batch / TPOT <= all GPUs x batch
        / (GPUs x TPOT) <= all GPUs x batch / sum over owners of GPUs x n x busy (TPOT >= n x busy
        of every owner)."""
        sets = self._sets_bound(chosen)
        if chosen:   # every set also takes at least the smallest configuration of each slot left
            rest = sum(self._min_gpus[len(chosen):]) if len(chosen) < len(self._min_gpus) else 0
            sets = min(sets, self.space.cluster.total_gpus // (sum(c.num_gpus for c in chosen) + rest))
        by_sets = sets * batch / tpot if tpot > 0 else math.inf
        by_gpus = self.space.cluster.total_gpus * batch / gpu_time if gpu_time > 0 else math.inf
        return min(by_sets, by_gpus)

    def _prune(self, tpot_lb: float, cost_lb: float, tokens_ub: float) -> str | None:
        """Which bound cuts: "slo" (TPOT; when searching the fastest plan, no faster than the best
        so far), "cost" (the objective's bound: cost, or for throughput the most tokens/s any
        completion could reach, `_tokens_bound`), or None."""
        if self.fastest:
            return "slo" if self.best is not None and tpot_lb >= self.best.tpot_s else None
        if tpot_lb > self.space.tpot_slo_s:
            return "slo"
        if self.best is None:
            return None
        if self.options.objective == "throughput":
            return "cost" if tokens_ub < self.best.cluster_tokens_per_s else None
        return "cost" if cost_lb >= self.best.cost else None

    def _sets_bound(self, chosen: list[OwnerConfig]) -> float:
        """Replica sets any completion of `chosen` can place: no more than each GPU type's pool
        holds of the GPUs the chosen owners already take per set."""
        return min((self._counts[name] // n for name, n in _gpus_by_type(chosen).items()), default=math.inf)

    def _capacity_ok(self, chosen: list[OwnerConfig]) -> bool:
        return all(n <= self._counts[name] for name, n in _gpus_by_type(chosen).items())

    # ---- leaves
    def _leaf(self, stage_plan: StagePlan, batch: int, n: int, chosen: list[OwnerConfig]) -> None:
        self.counters.candidates += 1
        owners = full_context_owners(self.ev, stage_plan, batch, n, tuple(chosen))
        if owners is None:
            self.counters.configs_over_memory += 1
            return
        problem = build_sim_problem(self.ev, stage_plan, batch, n, owners)
        if problem is None:
            self.counters.unplaceable += 1
            return
        self.counters.simulator_calls += 1
        sim = simulate(problem, keep_records=False)
        cand = Candidate(stage_plan=stage_plan, batch=batch, microbatches=n, owners=owners, problem=problem, sim=sim,
                         sets=self.ev.sets(owners))
        if self.closest is None or sim.tpot_s < self.closest.tpot_s:
            self.closest = cand
        if self.traffic is not None and not self.fastest:
            if sim.tpot_s > self.space.tpot_slo_s or (self.best is not None and not self._better(cand, self.best)):
                return   # under traffic it only gets slower and dearer (`passes/traffic.py`)
            self.counters.traffic_priced += 1
            traffic, fastest = self.traffic.best(cand)
            if fastest is not None and (self.closest_ttft is None or fastest.ttft_s < self.closest_ttft[1].ttft_s):
                self.closest_ttft = (cand, fastest)
            if traffic is None:
                self.counters.over_ttft += 1
                return
            cand = dataclasses.replace(cand, traffic=traffic)
        if self.fastest:
            if self.best is None or sim.tpot_s < self.best.tpot_s:
                self.best = cand
        elif sim.tpot_s <= self.space.tpot_slo_s and (self.best is None or self._better(cand, self.best)):
            self.best = cand

    def _better(self, a: Candidate, b: Candidate) -> bool:
        if self.options.objective == "throughput":
            ta, tb = a.cluster_tokens_per_s, b.cluster_tokens_per_s
            return ta > tb or (ta == tb and a.cost < b.cost)
        return a.cost < b.cost

    def _dfs(self, stage_plan, k, batch, n, frontiers, chosen):
        if not self._capacity_ok(chosen):
            self.counters.over_capacity += 1
            return
        if self.options.bnb:
            why = self._prune(*self._bound(stage_plan, k, batch, n, chosen))
            if why:
                self.counters.pruned_prefixes += 1
                if why == "slo":
                    self.counters.pruned_slo += 1
                else:
                    self.counters.pruned_cost += 1
                if len(chosen) == k:
                    self.counters.candidates += 1
                return
        if len(chosen) == k:
            self._leaf(stage_plan, batch, n, chosen)
            return
        limit, costly = self._level_cuts(stage_plan, k, batch, n, chosen)
        leaf = len(chosen) + 1 == k
        for config in frontiers[len(chosen)]:
            if config.busy_s > limit:   # its TPOT bound exceeds the SLO: cut without building the prefix
                self.counters.pruned_prefixes += 1
                self.counters.pruned_slo += 1
                self.counters.candidates += leaf
                continue
            if costly is not None and costly(config):   # its cost bound cannot beat the incumbent
                self.counters.pruned_prefixes += 1
                self.counters.pruned_cost += 1
                self.counters.candidates += leaf
                continue
            self._dfs(stage_plan, k, batch, n, frontiers, chosen + [config])

    def _level_cuts(self, stage_plan: StagePlan, k: int, batch: int, n: int, chosen: list[OwnerConfig]):
        """What `_bound` would cut among the next slot's configurations, from the prefix's sums:
        (the most work per microbatch a configuration may have before the TPOT bound exceeds the
        SLO, a test `config -> bool` whether the cost bound reaches the incumbent's cost, or None).
        TPOT >= the round trip (the other slots' work, the least link latency at each crossing, and
        this one's) and >= n x any slot's work; cost as `_bound`. Both carry a relative margin of
        1e-9 so that rounding never cuts a configuration `_bound` keeps. No cuts without
        branch-and-bound or when searching for the fastest plan; no cost cut without an incumbent
        or for the throughput objective."""
        if not self.options.bnb or self.fastest:
            return math.inf, None
        level = len(chosen)
        others = [chosen[o].busy_s if o < level else self._min_busy[o] for o in range(k) if o != level]
        path = sum(others) + self._crossings[(stage_plan.template.name, k)] * self.min_link_latency
        widest = n * max(others) if others else 0.0
        slo = self.space.tpot_slo_s
        if not math.isfinite(slo):
            limit = math.inf
        elif widest > slo:   # (then `_bound` has cut this prefix already)
            limit = -math.inf
        else:
            limit = min(slo - path, slo / n) * (1 + 1e-9) + 1e-15
        if self.best is None or self.options.objective != "cost":
            return limit, None
        rate = sum(c.cost_per_hour for c in chosen) + sum(self._min_rate[level + 1:])
        cost_time = sum(c.cost_per_hour * n * c.busy_s for c in chosen) + sum(self._min_cost_time[level + 1:])

        def costly(config: OwnerConfig) -> bool:
            incumbent = self.best.cost * 3600.0 * batch / 1e6 * (1 + 1e-9)
            tpot = max(path + config.busy_s, widest, n * config.busy_s)
            return max((rate + config.cost_per_hour) * tpot,
                       cost_time + config.cost_per_hour * n * config.busy_s) >= incumbent
        return limit, costly

    # ---- outer loops
    def run(self) -> SearchResult:
        start = time.perf_counter()
        templates = enumerate_templates(self.space.blocks, self.options.templates)
        if self.options.only_templates is not None:
            templates = tuple(t for t in templates if t.name in self.options.only_templates)
        self.counters.templates = len(templates)
        for ti, template in enumerate(templates):
            stage_plan = build_stages(self.space.blocks, template)
            for batch in (self.batches if self.options.objective != "throughput" else self.batches[::-1]):
                for n in self.options.microbatches:
                    if n > batch or batch % n:  # microbatches of equal rows (the lowering)
                        continue
                    if self.options.bnb:
                        why = self._prune(*self._root_bound(stage_plan, batch, n))
                        if why:
                            self.counters.pruned_prefixes += 1
                            if why == "slo":
                                self.counters.pruned_root_slo += 1
                            else:
                                self.counters.pruned_root_cost += 1
                            continue
                    for k in self._owner_counts(stage_plan):
                        if k > 1 or n == 1:
                            self._plan(stage_plan, k, batch, n)
            if self.progress and (ti + 1) % 16 == 0:
                best = f"${self.best.cost:.4g}/Mtok" if self.best else "none yet"
                self.progress(f"templates {ti + 1}/{len(templates)}, simulator calls "
                              f"{self.counters.simulator_calls}, best {best}")
        return SearchResult(best=self.best, closest=self.closest, counters=self.counters,
                            reason="" if self.best else self._reason(), seconds=time.perf_counter() - start)

    def _root_bound(self, stage_plan: StagePlan, batch: int, n: int) -> tuple[float, float, float]:
        """Optimistic (TPOT, $/Mtok) of any plan with this stage plan, batch and microbatch count,
        whatever its owners: each stage at its fastest, and at its cheapest GPU-time
        (rate x TPOT >= sum over owners of rate_o x n x busy_o, since TPOT >= n x busy_o)."""
        counts: dict[int, int] = {}
        for sig in self.ev.sig_ids(stage_plan):
            counts[sig] = counts.get(sig, 0) + 1
        tpot = cost_time = gpu_time = 0.0
        for sig, count in counts.items():
            best_lat, best_ct, best_gt = self._stage_floor(sig, batch, n)
            tpot += count * best_lat
            cost_time += count * best_ct
            gpu_time += count * best_gt
        return tpot, cost_time / 3600.0 / batch * 1e6, self._tokens_bound(batch, tpot, gpu_time, [])

    def _stage_floor(self, sig: int, batch: int, n: int) -> tuple[float, float, float]:
        """One stage signature's least latency, least cost-time and least GPU-time over every owner
        configuration of the grid (memoized: templates share stage signatures)."""
        key = (sig, batch, n)
        floor = self._floors.get(key)
        if floor is None:
            best_lat = best_ct = best_gt = math.inf
            for p, pool in enumerate(self.space.cluster.pools):
                for tp in self.options.tp_degrees:
                    if not fits_group(tp, pool.gpu, pool.count, "ep" if self.ev.sig_experts(sig) else "tp"):
                        continue
                    for r in self.options.replicas:
                        if r * tp > pool.count or r * n > batch:
                            continue
                        lat = self.ev.floor_latency(sig, p, tp, microbatch_share(batch, n, r))
                        best_lat = min(best_lat, lat)
                        best_ct = min(best_ct, r * tp * pool.gpu.price_per_hour * n * lat)
                        best_gt = min(best_gt, r * tp * n * lat)
            floor = self._floors[key] = (best_lat, best_ct, best_gt)
        return floor

    def _owner_counts(self, stage_plan: StagePlan) -> list[int]:
        if stage_plan.stages_per_block <= 1 and len(stage_plan.stages) == 1:
            return [1]
        return [k for k in range(2, self.options.max_owners + 1) if stage_plan.stages_per_block % k == 0]

    def _plan(self, stage_plan: StagePlan, k: int, batch: int, n: int) -> None:
        self.counters.stage_plans += 1
        slots = []
        for slot in range(k):
            configs, misfits = owner_configs(self.ev, stage_plan, k, slot, batch, n, self.options.tp_degrees,
                                             self.options.replicas)
            for why, count in misfits.items():   # the `Counters` fields of what did not fit
                setattr(self.counters, why, getattr(self.counters, why) + count)
            self.counters.owner_configs += len(configs)
            if not configs:   # no plan here: nothing went through Pareto either
                self.counters.frontier_configs += sum(len(c) for c in slots)
                return
            slots.append(configs)
        frontiers = []
        for configs in slots:
            if self.options.pareto and self.traffic is None:   # (prefill may prefer a dominated layout)
                configs = pareto_frontier(configs)
            self.counters.frontier_configs += len(configs)
            frontiers.append(configs)
        self.fits_anywhere = True
        self.min_gpus_needed = min(self.min_gpus_needed, sum(min(c.num_gpus for c in f) for f in frontiers))
        key = (stage_plan.template.name, k)
        if key not in self._crossings:
            m = len(stage_plan.stages)
            sent = self.ev.send_bytes(stage_plan, k)
            # owner changes that move bytes (a boundary whose values all stay put costs nothing),
            # and the token ids' return
            self._crossings[key] = sum(1 for i in range(m) if slot_of(i, stage_plan.stages_per_block, k)
                                       != slot_of((i + 1) % m, stage_plan.stages_per_block, k)
                                       and (i == m - 1 or sent[i] > 0))
        self._min_busy = [min(c.busy_s for c in f) for f in frontiers]
        self._min_rate = [min(c.cost_per_hour for c in f) for f in frontiers]
        self._min_cost_time = [min(c.cost_per_hour * n * c.busy_s for c in f) for f in frontiers]
        self._min_gpu_time = [min(c.num_gpus * n * c.busy_s for c in f) for f in frontiers]
        self._min_gpus = [min(c.num_gpus for c in f) for f in frontiers]
        self._dfs(stage_plan, k, batch, n, frontiers, [])

    def _reason(self) -> str:
        if not self.fits_anywhere:
            return (f"{self.space.graph.model} does not fit on {self.space.cluster.spec} at context "
                    f"{self.space.context} (weights {self.space.graph.weight_bytes / 1e9:.1f} GB, state "
                    f"{self.space.graph.state_bytes(self.space.context) / 1e9:.2f} GB per sequence)")
        if self.closest is None:
            return (f"{self.space.cluster.spec} is too small for {self.space.graph.model} at context "
                    f"{self.space.context}: the smallest plan that fits in memory needs {self.min_gpus_needed} GPUs "
                    f"(of the pools' types), placed together")
        if self.closest_ttft is not None and self.closest.tpot_s <= self.space.tpot_slo_s:
            c, t = self.closest_ttft
            owners = " + ".join(o.describe() for o in c.owners)
            return (f"best TTFT {t.ttft_s * 1e3:.4g} ms > SLO {self.space.workload.ttft_slo_s * 1e3:g} ms "
                    f"(or its TPOT {t.tpot_s * 1e3:.3g} ms > SLO) with {owners} ({c.stage_plan.template.name}, "
                    f"batch {c.batch}, prefill {t.describe()})")
        c = self.closest
        owners = " + ".join(o.describe() for o in c.owners)
        return (f"best TPOT {c.tpot_s * 1e3:.3g} ms > SLO {self.space.tpot_slo_s * 1e3:g} ms "
                f"with {owners} ({c.stage_plan.template.name}, batch {c.batch})")


def search(space: PlanSpace, options: SearchOptions = SearchOptions(),
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """The cheapest plan over the grid that meets the TPOT SLO and fits in memory and in the cluster."""
    run = _Search(space, options, progress)
    result = run.run()
    if result.best is None and math.isfinite(space.tpot_slo_s):
        # no plan meets the SLO: search again for the lowest TPOT, to name the closest plan
        fastest = _Search(dataclasses.replace(space, tpot_slo_s=math.inf), options, None, fastest=True)
        fastest.run()
        run.closest, run.fits_anywhere = fastest.best, fastest.fits_anywhere
        run.min_gpus_needed = fastest.min_gpus_needed
        result = dataclasses.replace(result, closest=fastest.best, reason=run._reason())
    return result


def format_search(result: SearchResult) -> str:
    """The search's summary (`OPWEAVE_DEBUG_DIR` dump): what it looked at, what it dropped and why,
    and the plan it chose."""
    c = result.counters
    lines = [f"search: {counted(c.templates, 'template')}, {c.stage_plans} (template, owners, batch, microbatches) "
             "combinations",
             f"  owner configurations: {c.owner_configs} fit, {c.frontier_configs} on Pareto frontiers; dropped: "
             f"{c.configs_over_node} TP above node or pool, {c.configs_tp_indivisible} TP not dividing a sharded op, "
             f"{c.configs_over_pool} replicas above pool or batch, {c.configs_over_memory} over memory",
             f"  pruned: {c.pruned_root_slo} combinations by the TPOT bound and {c.pruned_root_cost} by the cost bound "
             f"before building owners; {c.pruned_slo} prefixes by the TPOT bound, {c.pruned_cost} by the cost bound, "
             f"{c.over_capacity} over the cluster's GPUs, {c.unplaceable} not placeable in its nodes",
             f"  {c.candidates} complete plans, {c.simulator_calls} simulator calls"]
    for what, cand in (("best", result.best), ("closest", result.closest)):
        if cand is None:
            continue
        owners = " + ".join(o.describe() for o in cand.owners)
        lines.append(f"  {what}: {cand.stage_plan.template.name} batch {cand.batch} in {cand.microbatches} "
                     f"microbatch(es) on {owners}: TPOT {cand.tpot_s * 1e3:.4g} ms, ${cand.cost:.4g}/Mtok")
        if result.best is result.closest:
            break
    if result.reason:
        lines.append(f"  no plan: {result.reason}")
    return "\n".join(lines)
