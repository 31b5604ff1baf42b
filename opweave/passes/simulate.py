"""Schedule simulator (summary §4 "Communication-aware latency model", B.3, B.5).

Simulates one replica set of a pipelined operator-disaggregated decode plan for `rounds` decode
steps and measures the steady-state time per output token (TPOT), throughput and cost per token.

Model:
- Resources: one compute stream per owner (its replicas are symmetric and each processes
  1/replicas of every microbatch, so one representative replica is simulated), and one link per
  directed owner pair (src -> dst), shared by every stage-to-stage send and by the return of the
  token ids (last stage's owner -> stage 0's owner). A link may join an owner to itself (a
  hand-back on one owner that still costs time).
- Tasks, for round j, microbatch m, stage i: compute(j, m, i) on the owner's stream; then, if
  send_s > 0, send(j, m, i) on its link; compute(j, m, i + 1) starts after that. After the last
  stage, return(j, m) (if return_s > 0) must finish before compute(j + 1, m, 0).
- Overlap: a stream computes one task at a time, a link carries one transfer at a time, a transfer
  starts after the compute that produced it; compute overlaps with transfers on links.

Note: the order of tasks on every resource is FIXED, sorted by (round j, stage i, microbatch m),
and a task starts at max(resource free time, finish of its dependencies). No task is picked by
ready time. This makes every finish time a max-plus expression (max and + of durations) and hence
monotone non-decreasing in every compute_s / send_s / return_s, which the planner's Pareto pruning
relies on. Every dependency and every resource edge goes forward in (j, i, kind, m) with kind
compute < send/return, so one sweep in that order evaluates the schedule exactly: it is the
event loop with (time, seq, kind) tie-breaking collapsed into its topological order, with no
event queue and no per-event objects. Cost: O(max(rounds, n) * stages * microbatches) with
n = owners + links + microbatches (the state size, see below).

TPOT is the exact steady-state period of that schedule: the round map (free times of every stream
and link, ready time of every microbatch) is max-plus linear, and its cycle time, computed by
Karp's formula from as many rounds as the state has entries, is the time between consecutive
tokens of every microbatch (on average over a period) once the schedule is periodic. It is
monotone in every duration and at least every resource's busy time per round (occupancy <= 1).
The finite-round measure, the mean over microbatches of finish(last round) - finish(previous
round) at the last stage, is kept as `tpot_simulated_s`: it equals tpot_s once the transient is
over, but in a transient it can drop when a duration grows (random search found 1 case in
20,000), which Pareto pruning cannot afford. Cost per token (B.5) is the replica set's cost
rate divided by its throughput, tokens_per_s = batch / tpot_s.
"""

from __future__ import annotations

import dataclasses

KIND_COMPUTE = "compute"
KIND_SEND = "send"
KIND_RETURN = "return"
SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MTOK = 1e6


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimOwner:
    name: str                  # e.g. "o1 h100 tp2 x3"
    replicas: int              # each replica processes 1/replicas of every microbatch, in parallel
    gpus_per_replica: int      # = TP degree
    price_per_hour: float      # USD per GPU-hour of its GPU type
    memory_per_gpu: float      # bytes (reported only)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimStage:
    owner: int                 # index into SimProblem.owners
    compute_s: float           # one microbatch on one replica (TP collectives included)
    send_s: float              # move the output to the next stage's owner; must be 0 on the last stage
    send_bytes: float          # bytes per microbatch of that transfer (all replicas together)
    inter_node: bool           # that transfer crosses nodes
    label: str                 # e.g. "s12 b1 L7 attn_full..o_proj" for traces


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimProblem:
    owners: tuple[SimOwner, ...]
    stages: tuple[SimStage, ...]   # token order; after the last stage the token ids go to stage 0
    return_s: float                # hand-back last stage -> stage 0's owner (0 if same owner)
    batch: int                     # resident sequences of the whole replica set
    num_microbatches: int          # microbatches flowing through the pipeline
    rounds: int = 4                # decode steps recorded (trace, tpot_simulated_s); >= 2
    return_bytes: float = 0.0      # bytes per microbatch of the hand-back (statistics only)
    return_inter_node: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    """One executed task. Links are named "o<src>->o<dst>", streams "o<owner>"."""

    kind: str                  # KIND_COMPUTE | KIND_SEND | KIND_RETURN
    owner: int                 # the stream's owner, or the link's source owner
    dst_owner: int             # the link's destination owner (= owner for compute)
    round: int
    microbatch: int
    stage: int                 # the stage computed, or whose output is sent / returned
    start_s: float
    end_s: float

    @property
    def resource(self) -> str:
        if self.kind == KIND_COMPUTE:
            return f"o{self.owner}"
        return f"o{self.owner}->o{self.dst_owner}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OwnerStats:
    name: str
    busy_s: float              # compute per token round: sum of its stages' compute_s * microbatches
    occupancy: float           # busy_s / tpot_s (<= 1 in steady state)
    bubble_s: float            # tpot_s - busy_s
    memory_per_gpu: float      # bytes
    gpus: int                  # replicas * gpus_per_replica


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LinkStats:
    src: int
    dst: int
    busy_s: float              # transfer time per token round (sends and return)
    occupancy: float           # busy_s / tpot_s


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    tpot_s: float                          # steady-state time per output token (cycle time)
    tokens_per_s: float
    cost_per_hour: float
    cost_per_mtok_usd: float
    owners: tuple[OwnerStats, ...]
    links: tuple[LinkStats, ...]           # in first-use order
    bytes_per_token_intra_node: float
    bytes_per_token_inter_node: float
    num_stages: int
    owner_changes_per_token: int           # stage boundaries (return included) that change owner
    tpot_simulated_s: float                # mean last-stage gap of the last two recorded rounds
    records: tuple[tuple, ...]             # executed tasks, see `intervals()`

    def intervals(self) -> tuple[Interval, ...]:
        """Executed tasks by (round, stage, compute before send/return, microbatch).

        Built on demand from `records` (kind, owner, dst_owner, round, microbatch, stage, start_s,
        end_s): the planner calls simulate() thousands of times and never needs them.
        """
        return tuple(Interval(kind=r[0], owner=r[1], dst_owner=r[2], round=r[3], microbatch=r[4],
                              stage=r[5], start_s=r[6], end_s=r[7]) for r in self.records)


def validate(problem: SimProblem) -> None:
    """Raise ValueError on an ill-formed problem (a planner bug, not a user error)."""
    p = problem
    if not p.owners or not p.stages:
        raise ValueError("simulate: need at least one owner and one stage")
    if p.num_microbatches < 1 or p.batch < p.num_microbatches:
        raise ValueError(f"simulate: need 1 <= num_microbatches ({p.num_microbatches}) <= batch ({p.batch})")
    if p.rounds < 2:
        raise ValueError(f"simulate: need rounds >= 2 to measure a steady state, got {p.rounds}")
    for k, o in enumerate(p.owners):
        if o.replicas < 1 or o.gpus_per_replica < 1 or o.price_per_hour < 0:
            raise ValueError(f"simulate: owner {k} ({o.name}) has replicas/gpus < 1 or a negative price")
    durations = [p.return_s]
    for i, s in enumerate(p.stages):
        if not 0 <= s.owner < len(p.owners):
            raise ValueError(f"simulate: stage {i} ({s.label}) owner {s.owner} out of range")
        if min(s.compute_s, s.send_s, s.send_bytes) < 0:
            raise ValueError(f"simulate: stage {i} ({s.label}) has a negative duration or size")
        durations += (s.compute_s, s.send_s)
    last = p.stages[-1]
    if last.send_s or last.send_bytes:
        raise ValueError("simulate: the last stage's send must be 0; use SimProblem.return_s")
    if p.return_s < 0 or p.return_bytes < 0:
        raise ValueError("simulate: negative return_s or return_bytes")
    if sum(durations) <= 0:
        raise ValueError("simulate: every duration is 0, TPOT would be 0")


def simulate(problem: SimProblem, keep_records: bool = True) -> SimResult:
    """Simulate the fixed-order schedule of `problem` and measure its steady state.

    Args:
        problem: owners, stages in token order, microbatching and rounds (see SimProblem).
        keep_records: record the executed tasks (the planner, which simulates thousands of
            candidates and never draws them, passes False; every figure is the same).
    Returns:
        SimResult with TPOT, throughput, cost, per-owner and per-link statistics and the
        executed tasks of the first `problem.rounds` rounds (none without `keep_records`).
    Raises:
        ValueError: the problem is ill-formed (see `validate`).
    """
    validate(problem)
    stages, n_mb = problem.stages, problem.num_microbatches
    n_stages = len(stages)
    links: dict[tuple[int, int], int] = {}     # (src, dst) -> link index, first-use order
    link_busy: list[float] = []

    def link(src: int, dst: int, dur: float) -> int:
        k = links.setdefault((src, dst), len(links))
        if k == len(link_busy):
            link_busy.append(0.0)
        link_busy[k] += dur * n_mb
        return k

    # per stage: (owner, compute_s, link or -1, send_s, destination owner)
    plan = [(s.owner, s.compute_s, link(s.owner, stages[i + 1].owner, s.send_s) if s.send_s > 0 else -1,
             s.send_s, stages[(i + 1) % n_stages].owner) for i, s in enumerate(stages)]
    ret = (link(stages[-1].owner, stages[0].owner, problem.return_s) if problem.return_s > 0 else -1,
           problem.return_s, stages[-1].owner, stages[0].owner)
    used = sorted({s.owner for s in stages})

    stream_free = [0.0] * len(problem.owners)
    link_free = [0.0] * len(links)
    ready = [0.0] * n_mb                      # stage 0 of the next round may start
    states = [[0.0] * (len(used) + len(links) + n_mb)]
    last_done: list[list[float]] = []         # per round: finish of the last stage per microbatch
    records: list[tuple] = []
    n_rounds = max(problem.rounds, len(states[0]))   # Karp needs as many rounds as state entries
    for j in range(n_rounds):
        record = records.append if keep_records and j < problem.rounds else None
        done, ready = _round(j, plan, ret, ready, stream_free, link_free, record)
        last_done.append(done)
        states.append([stream_free[o] for o in used] + link_free + ready)

    r = problem.rounds
    gap = sum(b - a for a, b in zip(last_done[r - 2], last_done[r - 1])) / n_mb
    return _result(problem, _cycle_time(states), gap, links, link_busy, tuple(records))


def _round(j: int, plan: list[tuple], ret: tuple, ready: list[float], stream_free: list[float],
           link_free: list[float], record) -> tuple[list[float], list[float]]:
    """One decode round in (stage, kind, microbatch) order, updating the free times in place.

    Returns (finish of the last stage's compute, token ids ready at stage 0) per microbatch.
    `record`, when not None, receives (kind, owner, dst_owner, round, microbatch, stage, start, end).
    """
    arrive = ready
    for i, (o, c, k, d, dst) in enumerate(plan):
        done = _serve(KIND_COMPUTE, o, c, arrive, stream_free, o, o, j, i, record)
        arrive = _serve(KIND_SEND, k, d, done, link_free, o, dst, j, i, record) if k >= 0 else done
    k, d, src, dst = ret
    if k < 0:
        return arrive, arrive
    return arrive, _serve(KIND_RETURN, k, d, arrive, link_free, src, dst, j, len(plan) - 1, record)


def _serve(kind: str, k: int, dur: float, produced: list[float], free_at: list[float],
           src: int, dst: int, j: int, i: int, record) -> list[float]:
    """Resource k (a compute stream or a link) runs every microbatch's task of `dur`, in
    microbatch order, each once its input is ready; returns their finish times."""
    free = free_at[k]
    out = produced[:]
    for m, t in enumerate(produced):
        start = t if t > free else free
        free = out[m] = start + dur
        if record:
            record((kind, src, dst, j, m, i, start, free))
    free_at[k] = free
    return out


def _cycle_time(states: list[list[float]]) -> float:
    """Max-plus cycle time (the exact steady-state period) by Karp's formula.

    states[k] is the state after k rounds from states[0] = 0 (every resource's free time and
    every microbatch's ready time). The round map is max-plus linear, x(k+1) = A x(k), so
    states[k][v] is the heaviest k-edge walk of A ending at v, and with n state entries
    lambda = max_v min_{k<n} (states[n][v] - states[k][v]) / (n - k) (Karp 1978, all vertices
    as sources). lambda is monotone in every duration, unlike a finite-round difference.
    """
    n = len(states[0])
    final = states[n]
    return max(min((final[v] - states[k][v]) / (n - k) for k in range(n)) for v in range(n))


def _result(problem: SimProblem, tpot: float, gap: float, links: dict[tuple[int, int], int],
            link_busy: list[float], records: tuple[tuple, ...]) -> SimResult:
    """Statistics of a simulated schedule (one method sums all the per-token cost terms)."""
    n_mb, stages = problem.num_microbatches, problem.stages
    busy = [0.0] * len(problem.owners)
    for s in stages:
        busy[s.owner] += s.compute_s * n_mb
    owners = tuple(OwnerStats(name=o.name, busy_s=b, occupancy=b / tpot, bubble_s=tpot - b,
                              memory_per_gpu=o.memory_per_gpu, gpus=o.replicas * o.gpus_per_replica)
                   for o, b in zip(problem.owners, busy))
    link_stats = tuple(LinkStats(src=src, dst=dst, busy_s=link_busy[k], occupancy=link_busy[k] / tpot)
                       for (src, dst), k in links.items())
    moved = [(s.send_bytes, s.inter_node) for s in stages] + [(problem.return_bytes, problem.return_inter_node)]
    per_token = n_mb / problem.batch
    inter = sum(b for b, x in moved if x) * per_token
    intra = sum(b for b, x in moved if not x) * per_token
    n = len(stages)
    changes = sum(stages[i].owner != stages[(i + 1) % n].owner for i in range(n))
    cost_per_hour = sum(o.replicas * o.gpus_per_replica * o.price_per_hour for o in problem.owners)
    tokens_per_s = problem.batch / tpot
    return SimResult(
        tpot_s=tpot, tokens_per_s=tokens_per_s, cost_per_hour=cost_per_hour,
        cost_per_mtok_usd=cost_per_hour / SECONDS_PER_HOUR / tokens_per_s * TOKENS_PER_MTOK,
        owners=owners, links=link_stats, bytes_per_token_intra_node=intra,
        bytes_per_token_inter_node=inter, num_stages=n, owner_changes_per_token=changes,
        tpot_simulated_s=gap, records=records)
