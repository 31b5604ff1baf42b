"""A decode plan under traffic (summary §5.3 with the workload): prompts arrive, are prefilled, and
leave after their outputs. Two ways to serve prefill, priced for every complete plan the search
reaches (`search._leaf`):

Aggregated (chunked prefill in the decode rounds, the runtime's scheduler): each scheduler (one per
replica of the embedding's owner, r0 of them) gives each microbatch's round its decoding rows and
at most `C` prompt tokens (the token budget, `TOKEN_BUDGETS` that the planned activations hold).
A round with a chunk is re-simulated with every stage's compute grown by
`cost.prefill.round_extra_s` at the prompt tokens each replica of its owner gets (r0 C / r of
them) and its sends sized by rows + tokens: T_C; a round without one is the decode plan's T_0.
With m rows per microbatch and scheduler, a request holds a row for R = ceil(isl / C) prefill
rounds and osl - 1 decode rounds, so at capacity a scheduler's microbatch takes

    lam = min(m / (osl - 1 + R), C / isl)   requests per round,

a share f = lam * isl / C of its rounds carries a chunk, the mean round is
T = f * T_C + (1 - f) * T_0 (the TPOT the SLO is checked against; its p99, at the planned load,
is the round carrying the 99th percentile of Poisson(rho lam R) chunks, at most a full budget, the
round interpolated between T_0 and T_C), and one replica
set gives r0 * n * lam * osl / T output tokens/s. TTFT at the planned load rho (`LOAD`, or what
`--rate` leaves) is half a round, plus the M/D/1 wait for the budget (utilisation rho * f, service
isl / C rounds' budget) and the Erlang C wait for a free row (the scheduler's rows held
osl - 1 + R rounds each), plus the R rounds of the request's own chunks, each carrying its chunk and
the others' mean prompt tokens (rho * lam * isl), the round interpolated between T_0 and T_C, plus
the `HOST_TOKEN_LAG` rounds (at the load) after which the host learns the first token.

Disaggregated: the decode plan decodes only (T_0), and x TP groups of one GPU type of the cluster
prefill prompts one at a time (`cost.prefill.prefill_s` at batch 1, as AIConfigurator's
disaggregated mode) and send each request's KV state over the NICs (`cost.model.transfer_s`, layer
group by layer group, so the prompt waits only for the last group). As the runtime serves it
(`opweave.runtime.pd`), a decode row is reserved when the request is admitted and held through its
prefill and transfer, the `HOST_TOKEN_LAG` prefill rounds after which the prefill set learns the
first token, `IMPORT_ROUNDS` decode rounds (the import step is planned two rounds ahead, then
runs) and osl - 1 decode rounds: the decode plan's capacity in requests/s is its rows over that
time, and its tokens/s that rate times osl. x is the fewest groups whose TTFT (the M/D/1 wait,
the prefill and the last group's transfer, the lag rounds at the prefill groups' utilisation, and
the Erlang C wait for a decode row) meets the TTFT SLO at the planned load and that keep up with
the decode plan at capacity; their GPUs join the set's price.

Both are exact over their own grid: a mode's cost is never below the decode plan's (a row gives at
most one token per round, rounds only grow, prefill GPUs only add), so the search's decode-only
bounds stay lower bounds and pruned search still equals exhaustive enumeration.
"""

from __future__ import annotations

import dataclasses
import math

from opweave.cost.memory import Footprint
from opweave.cost.model import boundary_s, transfer_s
from opweave.cost.prefill import prefill_s, round_extra_s
from opweave.hardware.catalog import GPUSpec
from opweave.ir.plan import HOST_TOKEN_LAG

IMPORT_ROUNDS = 3
"""Decode rounds a disaggregated request's row spends on its import: the import step is planned
two rounds ahead of the round that runs it (`opweave.runtime.scheduler`), then runs (idle)."""
from opweave.ir.tp import legal_tp
from opweave.ir.workload import Workload
from opweave.passes.simulate import simulate
from opweave.passes.space import Candidate, Evaluator, fits_group

LOAD = 0.8
"""The share of a plan's request capacity it is planned to run at without `--rate` (TTFT is
queueing: at capacity it has no bound)."""

TOKEN_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
"""Prompt tokens per round and microbatch the aggregated mode tries (vLLM's and SGLang's chunked
prefill defaults lie in this range); each at most what the planned activations hold."""

TAIL = 0.01
"""The tail the p99 figures stand for."""

COST_TOLERANCE = 0.02
"""Among the options meeting both SLOs, those within this share of the cheapest one's cost are
taken as equal, and the one with the shortest worst round (p99 TPOT) is chosen: a larger token
budget buys a little throughput with long stalls of every decoding row."""

MAX_PREFILL_GROUPS = 64
"""The most prefill TP groups a prefill pool has."""

MAX_SHARING_SETS = 8
"""The most decode replica sets one prefill pool serves together (y of xPyD)."""

_SIM_ROUNDS = 4


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrefillPool:
    """The prefill GPUs of `sets` replica sets (disaggregated): `replicas` TP groups of `tp` `gpu`s
    that prefill for all of them (x prefill groups for y decode sets, as xPyD)."""

    gpu: GPUSpec
    tp: int
    replicas: int
    sets: int                 # the decode replica sets they serve together
    prefill_s: float          # one prompt's prefill on one group
    kv_bytes: float           # what one prompt sends to the decode owners
    kv_transfer_s: float      # that transfer over the NICs, all of it
    memory_per_gpu: float

    @property
    def num_gpus(self) -> int:
        return self.tp * self.replicas

    def describe(self) -> str:
        return f"{self.replicas}x {self.gpu.name} tp{self.tp}" + (f" per {self.sets} sets" if self.sets > 1 else "")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    """One way of serving a plan's prefill, priced (module docstring). Rates are one replica set's."""

    mode: str                     # "aggregated" | "disaggregated"
    token_budget: int = 0         # aggregated: prompt tokens per round and microbatch
    pool: PrefillPool | None = None
    requests_per_s: float         # at capacity
    tokens_per_s: float           # output tokens/s at capacity
    cost_per_hour: float          # the set, with its prefill GPUs
    tpot_s: float                 # mean round at capacity
    tpot_p99_s: float
    ttft_s: float                 # mean at the planned load
    ttft_p99_s: float
    tpot_at_load_s: float         # the mean round at the planned load (fewer rounds carry a chunk)
    load: float                   # the planned load (share of capacity)
    chunk_share: float = 0.0      # aggregated: share of rounds with a chunk at capacity
    sets: int = 1                 # replica sets (with their prefill groups) the cluster holds

    @property
    def cost_per_mtok_usd(self) -> float:
        return self.cost_per_hour / 3600.0 / self.tokens_per_s * 1e6 if self.tokens_per_s > 0 else math.inf

    def describe(self) -> str:
        if self.mode == "aggregated":
            return f"aggregated, token budget {self.token_budget}"
        return f"disaggregated on {self.pool.describe()}"


def md1_wait(utilisation: float, service_s: float) -> tuple[float, float]:
    """(mean, p99) wait of an M/D/1 queue at `utilisation` with deterministic service `service_s`:
    the Pollaczek-Khinchine mean rho S / (2 (1 - rho)), and the exponential tail
    P(W > t) = rho exp(-rho t / mean) at `TAIL`. Infinite at utilisation >= 1."""
    if utilisation <= 0:
        return 0.0, 0.0
    if utilisation >= 1:
        return math.inf, math.inf
    mean = utilisation * service_s / (2 * (1 - utilisation))
    tail = mean / utilisation * math.log(utilisation / TAIL) if utilisation > TAIL else 0.0
    return mean, tail


def poisson_quantile(mean: float, q: float) -> int:
    """The least k with P(N <= k) >= q for N ~ Poisson(mean)."""
    k, term = 0, math.exp(-mean)
    total = term
    while total < q and k < 1 << 16:
        k += 1
        term *= mean / k
        total += term
    return k


def erlang_c_wait(servers: int, offered: float, service_s: float) -> tuple[float, float]:
    """(mean, p99) wait for one of `servers` slots at `offered` load (arrival rate x holding time,
    in slots) with holding time `service_s`: Erlang C's M/M/c probability of waiting C, mean
    C S / (c - a) and tail P(W > t) = C exp(-(c - a) t / S) at `TAIL`, each halved for a holding
    time that is fixed rather than exponential (M/D/c is about half M/M/c, as M/D/1 is exactly
    half M/M/1). Infinite at offered >= servers."""
    if offered <= 0 or servers < 1:
        return 0.0, 0.0
    if offered >= servers:
        return math.inf, math.inf
    blocking = 1.0                     # Erlang B by its recursion (stable for thousands of slots)
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    rho = offered / servers
    waits = blocking / (1 - rho * (1 - blocking))
    rate = (servers - offered) / service_s
    return waits / rate / 2, (math.log(waits / TAIL) / rate / 2 if waits > TAIL else 0.0)


def schedulers_per_replica(owner) -> int:
    """Schedulers one replica of the embedding's owner runs: one, or one per GPU when its attention
    is data-parallel inside the expert group ("dp": each GPU prefills and decodes its own rows)."""
    return owner.tp if owner.experts == "dp" else 1


class TrafficModel:
    """Prices the plans of one plan space under its workload (memoized per space)."""

    def __init__(self, ev: Evaluator, workload: Workload, tp_degrees: tuple[int, ...] = (1, 2, 4, 8)):
        self.ev, self.workload, self.tp_degrees = ev, workload, tp_degrees
        self.space = ev.space
        self._extra: dict[tuple, float] = {}
        self._pools: list[tuple[int, int, float, float]] | None = None

    # ---- aggregated
    def _stage_extra(self, stage, owner, tokens: int) -> float:
        key = (stage.first, stage.last, owner.gpu.name, owner.tp, owner.share, owner.experts, tokens)
        hit = self._extra.get(key)
        if hit is None:
            ops = self.space.graph.ops[stage.first:stage.last + 1]
            hit = self._extra[key] = round_extra_s(ops, owner.gpu, owner.tp, owner.share, self.space.context, tokens,
                                                   self.workload.isl, self.ev.hidden_bytes, owner.experts,
                                                   self.space.cost_model)
        return hit

    def chunk_round_s(self, cand: Candidate, budget: int) -> float:
        """The steady-state round of `cand` when every microbatch carries `budget` prompt tokens."""
        problem, owners = cand.problem, cand.owners
        sent = self.ev.send_bytes(cand.stage_plan, len(owners))
        stages = []
        for i, (st, sim_st) in enumerate(zip(cand.stage_plan.stages, problem.stages)):
            o = owners[sim_st.owner]
            tokens = self._tokens(cand, o, budget)
            compute = sim_st.compute_s + self._stage_extra(st, o, tokens)
            send = sim_st.send_s
            if send > 0:
                dst = owners[problem.stages[i + 1].owner]
                send = boundary_s(sent[i], o.gpu, o.share + tokens, dst.gpu, dst.share + self._tokens(cand, dst, budget),
                                  dst.tp, inter_node=sim_st.inter_node)
            stages.append(dataclasses.replace(sim_st, compute_s=compute, send_s=send))
        wide = dataclasses.replace(problem, stages=tuple(stages), rounds=_SIM_ROUNDS)
        return simulate(wide, keep_records=False).tpot_s

    @staticmethod
    def _tokens(cand: Candidate, owner, budget: int) -> int:
        """Prompt tokens one replica of `owner` computes in a round where every scheduler (one per
        replica of stage 0's owner, one per GPU of it under "dp") spends `budget`."""
        first = cand.owners[cand.problem.stages[0].owner]
        return math.ceil(budget * first.replicas * schedulers_per_replica(first) / owner.replicas)

    def budgets(self, cand: Candidate) -> tuple[int, ...]:
        """The token budgets the candidate's planned activations hold (each owner's replica holds
        its rows x the plan's prefill chunk; the runtime checks the same bound)."""
        first = cand.owners[cand.problem.stages[0].owner]
        per = first.replicas * schedulers_per_replica(first)
        bound = min(o.share * o.replicas // per for o in cand.owners) * self.space.prefill_chunk
        bound = max(1, bound)
        return tuple(b for b in TOKEN_BUDGETS if b <= bound) or (bound,)

    def aggregated(self, cand: Candidate, budget: int) -> Traffic:
        w, sim = self.workload, cand.sim
        first = cand.owners[cand.problem.stages[0].owner]
        schedulers = first.replicas * schedulers_per_replica(first)
        rows = cand.batch / cand.microbatches / schedulers
        rounds = math.ceil(w.isl / budget)
        lam = min(rows / (w.osl - 1 + rounds), budget / w.isl)   # requests per round, microbatch and scheduler
        share = lam * w.isl / budget
        t0, tc = sim.tpot_s, self.chunk_round_s(cand, budget)
        mean = share * tc + (1 - share) * t0
        requests = schedulers * cand.microbatches * lam / mean
        load = self._load(requests, cand.sets)
        wait, wait99 = md1_wait(load * share, w.isl / budget * tc)
        # the request's own rounds carry its chunk and the others' mean prompt tokens, the round
        # growing linearly from T_0 (none) to T_C (a full budget)
        carried = min(budget, min(budget, w.isl) + load * lam * w.isl)
        own = rounds * (t0 + (tc - t0) * carried / budget) + mean / 2
        # a row of the scheduler's microbatches first: each held osl - 1 + R rounds
        slots = round(rows * cand.microbatches)
        held = (w.osl - 1 + rounds) * mean
        row, row99 = erlang_c_wait(slots, load * lam * cand.microbatches / mean * held, held)
        wait, wait99 = wait + row, wait99 + row99
        # the p99 round at the load: its chunks arrive as Poisson(rho lam R) per round
        chunks = poisson_quantile(load * lam * rounds, 1 - TAIL)
        p99 = t0 + (tc - t0) * min(budget, chunks * min(budget, w.isl)) / budget
        # the host learns the first token HOST_TOKEN_LAG rounds after the round that sampled it
        at_load = load * share * tc + (1 - load * share) * t0
        own += HOST_TOKEN_LAG * at_load
        return Traffic(mode="aggregated", token_budget=budget, requests_per_s=requests,
                       tokens_per_s=requests * w.osl, cost_per_hour=sim.cost_per_hour, tpot_s=mean,
                       tpot_p99_s=p99, ttft_s=own + wait, ttft_p99_s=own + wait99,
                       tpot_at_load_s=at_load, load=load, chunk_share=share, sets=cand.sets)

    # ---- disaggregated
    def prefill_groups(self) -> list[tuple[int, int, float, float]]:
        """(pool, TP, one prompt's prefill seconds, memory per GPU) of every TP group of the grid
        that can prefill the whole model alone (memoized)."""
        if self._pools is None:
            graph, isl = self.space.graph, self.workload.max_isl
            self._pools = []
            for p, pool in enumerate(self.space.cluster.pools):
                for tp in sorted(set(self.tp_degrees)):
                    if not fits_group(tp, pool.gpu, pool.count, "tp") or not legal_tp(graph.ops, tp, "tp"):
                        continue
                    memory = Footprint.of(graph.ops, tp, isl, isl, "tp").bytes(1, 1, 1)
                    if memory > pool.gpu.usable_memory_bytes:
                        continue
                    seconds = prefill_s(graph.ops, pool.gpu, tp, self.workload.isl, 1, self.ev.hidden_bytes, "tp",
                                        self.space.cost_model).total_s
                    self._pools.append((p, tp, seconds, memory))
        return self._pools

    def disaggregated(self, cand: Candidate) -> list[Traffic]:
        """The cheapest prefill pool of each (GPU type, TP) that keeps up with `cand` and meets the
        TTFT SLO, or its fewest-groups try when none does (its TTFT then says by how much)."""
        w, sim, space = self.workload, cand.sim, self.space
        decoding = (w.osl - 1 + IMPORT_ROUNDS) * sim.tpot_s  # a row's decode rounds, the import's included
        used: dict[str, int] = {}
        for o in cand.owners:
            used[o.gpu.name] = used.get(o.gpu.name, 0) + o.num_gpus
        kv = space.graph.state_bytes(w.isl)
        blocks = max(1, self.space.blocks.num_blocks)
        out = []
        for p, tp, seconds, memory in self.prefill_groups():
            pool = space.cluster.pools[p]
            move = max(transfer_s(kv / tp, pool.gpu, o.gpu, inter_node=True) for o in cand.owners)
            service, tail = max(seconds, move), move / blocks
            held = decoding + seconds + tail + HOST_TOKEN_LAG * seconds  # a decode row's time per request
            requests = cand.batch / held
            load = self._load(requests, cand.sets)
            row, row99 = erlang_c_wait(cand.batch, load * requests * held, held)
            alone = seconds + tail + row   # with the wait for a decode row
            best = None
            for y in range(1, MAX_SHARING_SETS + 1):
                found = self._groups(y, requests * y, load, service, alone, used, pool, tp, cand.sets)
                if found is None:
                    continue
                x, wait, wait99, sets = found
                lag = HOST_TOKEN_LAG * seconds * min(1.0, load * requests * y * service / x)  # rounds at load
                wait, wait99 = wait + row + lag, wait99 + row99 + lag
                price = sim.cost_per_hour + x * tp * pool.gpu.price_per_hour / y
                meets = seconds + tail + wait <= w.ttft_slo_s
                key = (not meets, price, y)
                if best is None or key < best[0]:
                    group = PrefillPool(gpu=pool.gpu, tp=tp, replicas=x, sets=y, prefill_s=seconds, kv_bytes=kv,
                                        kv_transfer_s=move, memory_per_gpu=memory)
                    best = (key, Traffic(mode="disaggregated", pool=group, requests_per_s=requests,
                                         tokens_per_s=requests * w.osl, cost_per_hour=price,
                                         tpot_s=sim.tpot_s, tpot_p99_s=sim.tpot_s, tpot_at_load_s=sim.tpot_s,
                                         ttft_s=seconds + tail + wait,
                                         ttft_p99_s=seconds + tail + wait99, load=load, sets=sets))
            if best is not None:
                out.append(best[1])
        return out

    def _groups(self, y: int, requests: float, load: float, service: float, alone: float, used: dict[str, int],
                pool, tp: int, decode_sets: int) -> tuple[int, float, float, int] | None:
        """(x, mean wait, p99 wait, replica sets that fit) of the fewest prefill groups of `tp`
        GPUs of `pool` that take `requests` prompts/s of `y` decode sets at capacity and meet the
        TTFT SLO at `load` (or the most the cluster leaves, when none does); None when not even
        the groups that keep up fit beside the y sets."""
        counts = {q.gpu.name: q.count for q in self.space.cluster.pools}
        need = {name: y * n for name, n in used.items()}
        free = counts[pool.gpu.name] - need.get(pool.gpu.name, 0)
        if any(counts[name] < n for name, n in need.items()) or free < tp:
            return None
        fewest = math.floor(requests * service) + 1   # at capacity: below full utilisation
        found = None
        for x in range(fewest, min(MAX_PREFILL_GROUPS, free // tp) + 1):
            wait, wait99 = md1_wait(load * requests * service / x, service)
            found = (x, wait, wait99)
            if alone + wait <= self.workload.ttft_slo_s:
                break
        if found is None:
            return None
        x = found[0]
        need[pool.gpu.name] = need.get(pool.gpu.name, 0) + x * tp
        units = min(counts[name] // n for name, n in need.items())
        return (*found, max(1, min(decode_sets, units * y)))

    # ---- both
    def _load(self, requests_per_s: float, sets: int) -> float:
        """The planned load: `LOAD`, or with `--rate` the share of capacity the rate leaves each of
        the fewest replica sets that take it at `LOAD` at most."""
        if self.workload.rate is None or requests_per_s <= 0:
            return LOAD
        fleet = math.ceil(self.workload.rate / (LOAD * requests_per_s))
        return self.workload.rate / (fleet * requests_per_s)

    def options(self, cand: Candidate) -> list[Traffic]:
        """Every way the workload allows of serving the candidate's prefill (`Workload.prefill`)."""
        out = []
        if self.workload.prefill in ("auto", "aggregated"):
            out += [self.aggregated(cand, b) for b in self.budgets(cand)]
        if self.workload.prefill in ("auto", "disaggregated"):
            out += self.disaggregated(cand)
        return out

    def meets(self, t: Traffic) -> bool:
        return t.tpot_s <= self.space.tpot_slo_s and t.ttft_s <= self.workload.ttft_slo_s

    def best(self, cand: Candidate) -> tuple[Traffic | None, Traffic | None]:
        """(the option meeting both SLOs that `COST_TOLERANCE` picks, the option with the lowest
        TTFT) of `cand`; ties keep the first (aggregated before disaggregated, smaller budgets first)."""
        options = self.options(cand)
        fastest = min(options, key=lambda t: t.ttft_s, default=None)
        meeting = [t for t in options if self.meets(t)]
        if not meeting:
            return None, fastest
        cheapest = min(t.cost_per_mtok_usd for t in meeting)
        near = [t for t in meeting if t.cost_per_mtok_usd <= cheapest * (1 + COST_TOLERANCE)]
        return min(near, key=lambda t: (t.tpot_p99_s, t.cost_per_mtok_usd)), fastest
