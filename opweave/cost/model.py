"""The cost model: one set of per-op cost functions for the analysis, the planner and the simulator.

Per op, on a device group of `tp` GPUs of one type, at resident batch b and context s (summary
§3.1, A.1, B.3, with the terms measured decode needs: docs/calibration.md):

    weights_s = (weights read at batch b / shards + b * activations / shards) / (bandwidth * mem_eff)
    state_s   = b * state_bytes(s) / state shards / (bandwidth * kv_eff)
    math_s    = b * flops_at(s) / shards / (peak * gemm_eff)
    memory_s  = weights_s + state_s
    latency   = max(memory_s, math_s) + serial_fraction * min(memory_s, math_s) + launch overhead

with `shards` and the state's shards from the TP table (`opweave.ir.tp`): the full weights over
one rank's for sharded ops (so replicated KV heads and norm weights count), 1 for replicated ones
(the embedding too); the state divides by its KV heads at most. Weights read at batch b are all
of them for dense ops, b rows of the embedding, and for routed experts what the grouped kernel
reads: each expert's weights once per block of (token, expert) pairs (the kernel's block, which
grows with the pairs an expert expects: once per step for up to 128, `moe_block`), in
expectation over uniform routing (`expert_reads`); expert-parallel experts (each GPU holds
E / tp whole experts) take the busiest GPU's reads and pairs (`ep_imbalance`). The launch
overhead is per op, the figure
under CUDA-graph replay unless `CostModel(cuda_graphs=False)`. The embedding op, which begins a
step, also carries the step's fixed costs: `step_overhead + b * sequence_overhead`.

Ops whose output the table names a partial sum pay a ring all-reduce (routed experts followed by
a shared expert: one, after the shared expert); every TP collective pays `collective_latency`
besides the ring's hops; a stage boundary pays latency + max(bytes a replica sends / its link, bytes a replica receives /
its link), intra-node only when placement puts every pair of replicas that exchange rows in one
node (`opweave.passes.placement.transfer_locality`).

A profiled table (`CostModel(profile=...)`) replaces the analytic latency op by op where it has
a figure (beyond its measured grid: the figure at the grid's edge, scaled by the analytic
latency's growth); the analytic model covers the rest. A profile may also give the host time of
each side of a stage boundary (`transfer_host_s`), which the planner adds to the stage's compute.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import Protocol

from opweave.hardware.catalog import GPUSpec
from opweave.ir.experts import ExpertLoad, busiest_share
from opweave.ir.experts import placement as expert_placement
from opweave.ir.graph import Op
from opweave.ir import tp as tp_table
from opweave.ir.kinds import OpKind
from opweave.kernels.blocks import moe_block_pairs

ALLREDUCE_RULES = tuple(kind for kind, r in tp_table.TP_TABLE.items() if r.partial_sum)
"""Op kinds whose output is a partial sum over the TP group (from the TP table, `opweave.ir.tp`)."""

INTRA_LINK_EFFICIENCY = 0.4
"""Achieved / line rate inside a node: NCCL send/recv between two H100s plateaus near 180 GB/s
of NVLink's 450 GB/s (refdata efficiency.nccl_and_network.H100_pair_sendrecv_busbw, NVIDIA/nccl-tests#268)."""

INTER_LINK_EFFICIENCY = 0.94
"""Achieved / line rate between nodes: 46-48 GB/s NCCL bus bandwidth per 400 Gb/s (50 GB/s) NDR NIC
(refdata efficiency.nccl_and_network.NDR400_per_NIC_busbw, NVIDIA/nccl-tests#290)."""

class OpProfile(Protocol):
    """A measured latency table (see the profiler); None where it has no figure.

    Only `op_latency` is required. `opweave.profile.ProfileTable` also has the optional methods
    the cost model uses when present: `grid_limits(op, gpu, tp)` and `count_beyond_grid()`
    (scaling beyond the measured grid), `collective_s(gpu, tp, nbytes)` (measured TP
    collectives) and `transfer_host_s(gpu, side, nbytes)` (host time of a transfer side)."""

    def op_latency(self, op: Op, gpu: str, tp: int, batch: int, context: int) -> float | None: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OpCost:
    """Latency of one op on one device group, split into its terms (seconds)."""

    compute_s: float        # memory and math time with their overlap + launch and step overheads
    memory_s: float         # bytes / effective bandwidth (= weights_s + state_s)
    math_s: float           # flops / effective FLOP/s
    comm_s: float           # tensor-parallel all-reduce after the op
    measured: bool = False  # compute_s came from a profile
    weights_s: float = 0.0  # the part of memory_s that streams weights and activations
    state_s: float = 0.0    # the part of memory_s that reads per-sequence state (KV cache, recurrent)
    overhead_s: float = 0.0  # the part of compute_s that is launch and step overhead

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def shards(op: Op, tp: int, layout: str = "tp") -> float:
    """How many ways the op's weights and work divide over a TP group of `tp` GPUs (the TP
    table's: full weight bytes over one rank's, so replicated KV heads and norm weights count;
    routed experts held as `layout`, `opweave.ir.tp.EXPERT_LAYOUTS`)."""
    return tp_table.compute_shards(op, tp, layout)


def moe_block(batch: int, probability: float, ranks: int = 1) -> int:
    """The (token, expert) pairs per block the grouped MoE kernel takes for a step of `batch`
    tokens that each route to an expert with `probability` (`opweave.kernels.blocks.moe_block_pairs`
    of the kernel's mean, batch x top_k / the experts it holds: an expert-parallel shard of
    `ranks` holds 1 / ranks of them, `moe_block_m` in `opweave/kernels/triton_kernels/moe.py`)."""
    return moe_block_pairs(batch * probability * ranks)


@functools.lru_cache(maxsize=4096)
def _reads_moments(batch: int, probability: float, block: int) -> tuple[float, float]:
    """(mean, variance) of ceil(n / block), n ~ Binomial(batch, probability): one expert's reads."""
    if probability <= 0.0 or batch <= 0:
        return 0.0, 0.0
    if probability >= 1.0:
        return float(math.ceil(batch / block)), 0.0
    log_p, log_q = math.log(probability), math.log1p(-probability)
    m1 = m2 = 0.0
    for n in range(1, batch + 1):
        pmf = math.exp(math.lgamma(batch + 1) - math.lgamma(n + 1) - math.lgamma(batch - n + 1) + n * log_p
                       + (batch - n) * log_q)
        r = math.ceil(n / block)
        m1 += r * pmf
        m2 += r * r * pmf
    return m1, max(0.0, m2 - m1 * m1)


def expert_reads(batch: int, probability: float, block: int | None = None) -> float:
    """Expected times one expert's weights are read in a step of `batch` tokens that each route
    to it with `probability`: E[ceil(n / block)], n ~ Binomial(batch, probability), in blocks of
    `block` pairs (default: the kernel's, `moe_block`)."""
    return _reads_moments(batch, probability, block or moe_block(batch, probability))[0]


def expected_max_normal(ranks: int) -> float:
    """E[max of `ranks` standard normals], Blom's approximation Phi^-1((n - 0.375) / (n + 0.25))
    (within 5% of the exact value for n = 2..64)."""
    if ranks <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))


@functools.lru_cache(maxsize=4096)
def ep_imbalance(batch: int, experts: int, top_k: int, ranks: int) -> tuple[float, float]:
    """(weight reads, pairs) of the busiest rank of an expert-parallel group over the group's
    mean (>= 1): `ranks` GPUs each hold experts / ranks whole experts, and a step of `batch`
    tokens routes each to `top_k` of the `experts` uniformly. The busiest rank sets the op's time.

    Per rank, the reads (sum over its experts of ceil(pairs / block), the kernel's block on a
    shard, `moe_block`) and the pairs are
    taken as normal with the mean and variance of independent experts (routing is without
    replacement within a token, so the true spread is a little smaller), and the busiest rank as
    the mean plus `expected_max_normal(ranks)` standard deviations, capped at every one of its
    experts read for every block of the batch (checked against sampled routings in
    tests/test_expert_parallel_cost.py)."""
    if ranks <= 1 or batch <= 0 or experts <= 0:
        return 1.0, 1.0
    per_rank = experts / ranks
    p = top_k / experts
    block = moe_block(batch, p, ranks)
    mean, var = _reads_moments(batch, p, block)
    z = expected_max_normal(ranks)
    reads_mean = per_rank * mean
    reads_max = min(reads_mean + z * math.sqrt(per_rank * var), per_rank * math.ceil(batch / block))
    pairs_mean = batch * top_k / ranks
    pairs_max = min(pairs_mean + z * math.sqrt(batch * top_k * (1 / ranks) * (1 - 1 / ranks)), batch * min(top_k, per_rank))
    return (max(1.0, reads_max / reads_mean) if reads_mean > 0 else 1.0,
            max(1.0, pairs_max / pairs_mean) if pairs_mean > 0 else 1.0)


def expert_parallel_factors(op: Op, tp: int, batch: int, layout: str,
                            balance: tuple[float, float] = (1.0, 1.0)) -> tuple[float, float]:
    """`ep_imbalance` of `op` held as `layout` on `tp` GPUs, times `balance` (the placement's:
    `CostModel.balance`); (1, 1) unless expert-parallel experts."""
    if layout != "ep" or tp <= 1 or op.kind not in tp_table.EXPERT_KINDS or not op.weights:
        return 1.0, 1.0
    experts = op.weights[0].shape[0]
    reads, pairs = ep_imbalance(batch, experts, max(1, round(op.active_weight_fraction * experts)), tp)
    return reads * balance[0], pairs * balance[1]


def weight_bytes_read(op: Op, batch: int, ranks: int = 1) -> float:
    """Weight bytes one step reads at resident batch `batch` (whole group, before sharding;
    routed experts over an expert-parallel group of `ranks`: in the blocks its shards take)."""
    if op.kind == OpKind.EMBED:
        rows = op.weights[0].shape[0] if op.weights else 1
        return op.weight_bytes * min(batch, rows) / rows
    if op.active_weight_fraction < 1.0:  # routed experts: each expert once per block of pairs
        p = op.active_weight_fraction
        return op.weight_bytes * expert_reads(batch, p, moe_block(batch, p, ranks))
    return float(op.weight_bytes)


def state_shards(op: Op, tp: int) -> int:
    """How many ways the op's per-sequence state divides (KV heads beyond which it is replicated)."""
    return tp_table.state_shards(op, tp)


def op_stream_bytes(op: Op, tp: int, batch: int, layout: str = "tp",
                    balance: tuple[float, float] = (1.0, 1.0)) -> float:
    """Weight and activation bytes one GPU of the group moves for this op in one step (the
    busiest GPU's, for expert-parallel experts: `ep_imbalance`)."""
    n = shards(op, tp, layout)
    reads, pairs = expert_parallel_factors(op, tp, batch, layout, balance)
    ranks = tp if layout == "ep" and op.kind in tp_table.EXPERT_KINDS else 1  # the kernel's block on a shard
    return reads * weight_bytes_read(op, batch, ranks) / n + pairs * batch * op.act_bytes_per_token / n


def op_state_bytes(op: Op, tp: int, batch: int, context: int) -> float:
    """Per-sequence state bytes (KV cache, recurrent state) one GPU of the group reads in one step."""
    return batch * op.state_bytes(context) / state_shards(op, tp)


def op_bytes(op: Op, tp: int, batch: int, context: int, layout: str = "tp") -> float:
    """Bytes one GPU of the group moves for this op in one step."""
    return op_stream_bytes(op, tp, batch, layout) + op_state_bytes(op, tp, batch, context)


def op_flops(op: Op, tp: int, batch: int, context: int, layout: str = "tp",
             balance: tuple[float, float] = (1.0, 1.0)) -> float:
    return (expert_parallel_factors(op, tp, batch, layout, balance)[1] * batch * op.flops_at(context)
            / shards(op, tp, layout))


def allreduce_s(nbytes: float, tp: int, gpu: GPUSpec) -> float:
    """All-reduce of `nbytes` over `tp` GPUs: the collective's fixed cost, then a ring inside the
    node, 2 (m - 1) hops of the link's latency and the ring's share of the bytes (m = the GPUs of
    the group in one node). A group of whole nodes (`spans_nodes`) reduces hierarchically: the
    node's ring reduce-scatters, each GPU all-reduces its 1/m of the bytes with its peers of the
    other nodes over its own NIC (a ring of 2 (nodes - 1) hops), and the node's ring all-gathers."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    m = min(tp, gpu.gpus_per_node)
    steps = 2 * (m - 1)
    total = gpu.collective_latency + steps * gpu.intra_link_latency + steps / m * nbytes / intra_bandwidth(gpu)
    nodes = tp // m
    if nodes > 1:
        hops = 2 * (nodes - 1)
        total += hops * gpu.inter_link_latency + hops / nodes * (nbytes / m) / inter_bandwidth(gpu)
    return total


def allgather_s(nbytes_per_rank: float, tp: int, gpu: GPUSpec) -> float:
    """Ring all-gather: every rank ends with all `tp` pieces of `nbytes_per_rank` (over whole
    nodes: the node's ring, then each GPU's node-sized piece from the other nodes over its NIC)."""
    if tp <= 1 or nbytes_per_rank <= 0:
        return 0.0
    m = min(tp, gpu.gpus_per_node)
    total = gpu.collective_latency + (m - 1) * (gpu.intra_link_latency + nbytes_per_rank / intra_bandwidth(gpu))
    nodes = tp // m
    if nodes > 1:
        total += (nodes - 1) * (gpu.inter_link_latency + m * nbytes_per_rank / inter_bandwidth(gpu))
    return total


DISPATCH_MODES = ("gather", "alltoall")
"""How a "dp" owner's routed tokens meet their experts (`dispatch_s`): every GPU gathers the group's
tokens and the group reduce-scatters the sums, or each token goes only to the GPUs holding its
experts and their sums come back (all-to-all dispatch and combine)."""


def hit_probability(experts: int, held: float, top_k: int) -> float:
    """Probability that a token routed to `top_k` distinct experts of `experts`, uniformly, picks at
    least one of the `held` experts of one GPU (or node): 1 - C(E - held, k) / C(E, k)."""
    if held >= experts or top_k <= 0:
        return 1.0 if top_k > 0 else 0.0
    miss, others = 1.0, experts - held
    for i in range(top_k):
        if others - i <= 0:
            return 1.0
        miss *= (others - i) / (experts - i)
    return 1.0 - miss


def alltoall_s(nbytes_per_token: float, tokens: float, experts: int, top_k: int, ranks: int, gpu: GPUSpec) -> float:
    """All-to-all dispatch of `tokens` tokens per GPU of an expert-parallel group of `ranks` GPUs
    (E / ranks experts each) to the GPUs of their `top_k` experts, and the combine that brings each
    GPU's partial sum back: twice the one-way time. A token crosses to each GPU (and node) holding
    any of its experts once (its sum over them comes back once), as DeepEP's kernels send it.

    One way, inside a node of m GPUs: the token's copies to the other m - 1 GPUs it hits; over
    several nodes, first one copy per other node it hits over the GPU's NIC (to the GPU of the same
    place there), which forwards it to the GPUs of its node that hold its experts over NVLink: each
    GPU's NVLink carries the copies of its own tokens and the forwarded ones of every other node."""
    if ranks <= 1 or tokens <= 0:
        return 0.0
    m = min(ranks, gpu.gpus_per_node)
    nodes = ranks // m
    per_gpu = tokens * nbytes_per_token
    q_rank = hit_probability(experts, experts / ranks, top_k)
    one_way = gpu.collective_latency
    if m > 1:
        one_way += gpu.intra_link_latency + per_gpu * q_rank * (m - 1) * nodes / intra_bandwidth(gpu)
    if nodes > 1:
        q_node = hit_probability(experts, experts / nodes, top_k)
        one_way += gpu.inter_link_latency + per_gpu * q_node * (nodes - 1) / inter_bandwidth(gpu)
    return 2 * one_way


def dispatch_costs(op: Op, gpu: GPUSpec, ranks: int, batch: int, hidden_bytes: int) -> dict[str, float]:
    """Each dispatch mode's seconds (`DISPATCH_MODES`) for the routed experts `op` of a "dp" owner
    of `ranks` GPUs holding `batch` rows between them: the gather's all-reduce of the group's
    tokens (all-gather and reduce-scatter move its bytes), or `alltoall_s` of each GPU's rows."""
    experts = op.weights[0].shape[0] if op.weights else 1
    top_k = max(1, round(op.active_weight_fraction * experts))
    return {"gather": allreduce_s(batch * hidden_bytes, ranks, gpu),
            "alltoall": alltoall_s(hidden_bytes, -(-batch // ranks), experts, top_k, ranks, gpu)}


def dispatch_mode(op: Op, gpu: GPUSpec, ranks: int, batch: int, hidden_bytes: int) -> str:
    """The cheaper dispatch mode (the gather on a tie): the one the planner charges and the
    runtime runs (`PlanOwner.dispatch`)."""
    costs = dispatch_costs(op, gpu, ranks, batch, hidden_bytes)
    return min(DISPATCH_MODES, key=lambda mode: costs[mode])


def dispatch_s(op: Op, gpu: GPUSpec, ranks: int, batch: int, hidden_bytes: int) -> float:
    """Seconds of the cheaper dispatch mode (`dispatch_mode`)."""
    return min(dispatch_costs(op, gpu, ranks, batch, hidden_bytes).values()) if ranks > 1 else 0.0


def spans_nodes(tp: int, gpu: GPUSpec) -> bool:
    """Whether a TP group of `tp` GPUs of `gpu` takes several whole nodes (expert-parallel groups
    may: `opweave.passes.search.WIDE_TP`)."""
    return tp > gpu.gpus_per_node


@functools.lru_cache(maxsize=4096)
def _balance(load: ExpertLoad | None, layer: int | None, experts: int, ranks: int, redundant: int) -> tuple[float, float]:
    if experts % ranks or redundant > experts - experts // ranks:
        return 1.0, 1.0   # not a legal group (the TP table refuses it)
    shares = load.shares(layer, experts) if load is not None else (1.0 / experts,) * experts
    where = expert_placement(shares, ranks, redundant)
    per = experts // ranks
    return (per + redundant) / per, busiest_share(shares, where)


SAMPLE_CANDIDATE_BYTES = 16
"""A vocab-split greedy sample gathers one (max logit, index) pair per token from each rank."""


def needs_allreduce(op: Op, following: Op | None = None) -> bool:
    """Whether the group all-reduces the op's output (TP table): a partial sum, unless `following`
    extends it first (routed experts, then the shared expert)."""
    return tp_table.reduces(op, following)


def allreduce_bytes(op: Op, batch: int, hidden_bytes: int, following: Op | None = None) -> float:
    return batch * hidden_bytes if needs_allreduce(op, following) else 0.0


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-op latency, communication and memory on a catalog of GPU types."""

    profile: OpProfile | None = None
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (the runtime on CUDA); False: eager launches
    expert_load: ExpertLoad | None = None  # measured routing (`opweave profile --routing`); None: uniform
    redundant_experts: int = 0  # extra expert slots per GPU of an expert-parallel group (`opweave.ir.experts`)

    def balance(self, op: Op, tp: int, layout: str) -> tuple[float, float]:
        """(weight reads, pairs) of the busiest GPU of an expert-parallel group of `tp` over what
        uniform routing on E / tp experts each gives: the placement's (`opweave.ir.experts`) for
        the measured load of the op's layer and `redundant_experts` copies per GPU. A GPU with r
        copies reads r more experts' weights; (1, 1) for uniform load without copies."""
        if layout != "ep" or tp <= 1 or op.kind not in tp_table.EXPERT_KINDS or not op.weights:
            return 1.0, 1.0
        if self.expert_load is None and not self.redundant_experts:
            return 1.0, 1.0
        return _balance(self.expert_load, op.layer, op.weights[0].shape[0], tp, self.redundant_experts)

    def op_cost(self, op: Op, gpu: GPUSpec, tp: int, batch: int, context: int, hidden_bytes: int,
                following: Op | None = None, layout: str = "tp") -> OpCost:
        """The op's cost; `following` is the op after it in the stage (a shared expert after
        routed experts takes their all-reduce: `needs_allreduce`); routed experts held as `layout`.
        Under "dp" (data-parallel attention inside the expert group, `opweave.ir.tp`) an op other
        than the routed experts runs at TP 1 on its rank's rows (1 / tp of `batch`), and the routed
        experts as "ep" over all of them, with the gather and reduce-scatter of the layer's tokens
        (or the all-to-all dispatch and combine where cheaper, `dispatch_s`; a shared expert after
        them runs on its own rows, so nothing fuses)."""
        if layout == "dp" and tp > 1:
            if op.kind in tp_table.EXPERT_KINDS:
                cost = self.op_cost(op, gpu, tp, batch, context, hidden_bytes, None, "ep")
                return dataclasses.replace(cost, comm_s=self.collectives_s(op, gpu, tp, batch, hidden_bytes, None, "dp"))
            return self.op_cost(op, gpu, 1, -(-batch // tp), context, hidden_bytes, following, "tp")
        weights_s, state_s, math_s = op_times(op, gpu, tp, batch, context, layout, self.balance(op, tp, layout))
        memory_s = weights_s + state_s
        overhead_s = gpu.op_launch_s(self.cuda_graphs) + step_cost_s(op, gpu, batch)
        compute_s = overlapped_s(memory_s, math_s, gpu) + overhead_s
        measured = False
        if self.profile is not None:
            if expert_parallel_factors(op, tp, batch, layout) == (1.0, 1.0):
                figure = self._measured(op, gpu, tp, batch, context, compute_s)
            else:  # profiles time sliced experts: the busiest expert-parallel GPU's share of that
                sliced = roofline(op, gpu, tp, batch, context, self.cuda_graphs)[2]
                figure = self._measured(op, gpu, tp, batch, context, sliced)
                figure = None if figure is None else figure * (compute_s - step_cost_s(op, gpu, batch)) / sliced
            if figure is not None:  # the profile times the op alone: the step's costs stay
                compute_s, measured = figure + step_cost_s(op, gpu, batch), True
        comm_s = self.collectives_s(op, gpu, tp, batch, hidden_bytes, following)
        return OpCost(compute_s=compute_s, memory_s=memory_s, math_s=math_s, comm_s=comm_s, measured=measured,
                      weights_s=weights_s, state_s=state_s, overhead_s=overhead_s)

    def collectives_s(self, op: Op, gpu: GPUSpec, tp: int, batch: int, hidden_bytes: int,
                      following: Op | None = None, layout: str = "tp") -> float:
        """The op's TP collectives (TP table): an all-reduce of a partial sum, the sampler's
        all-gather of (max logit, index) per token. Measured (the profile's all-reduce fit) where
        the profile covers `gpu`, else ring figures on the catalog's links. A "dp" owner's routed
        experts take the cheaper dispatch (`dispatch_s`) of its group's `batch` rows instead."""
        if layout == "dp":  # every other op runs at TP 1 on the GPU's own rows
            return dispatch_s(op, gpu, tp, batch, hidden_bytes) if op.kind in tp_table.EXPERT_KINDS else 0.0
        gathers = tp_table.rule(op.kind).gathers
        reduce_bytes = allreduce_bytes(op, batch, hidden_bytes, following)
        measured = getattr(self.profile, "collective_s", None) if self.profile is not None else None
        if measured is not None and 1 < tp <= gpu.gpus_per_node and measured(gpu.name, tp, 0.0) is not None:
            comm = measured(gpu.name, tp, reduce_bytes) if reduce_bytes > 0 else 0.0
            return comm + (measured(gpu.name, tp, batch * SAMPLE_CANDIDATE_BYTES) if gathers else 0.0)
        comm = allreduce_s(reduce_bytes, tp, gpu)
        return comm + (allgather_s(batch * SAMPLE_CANDIDATE_BYTES, tp, gpu) if gathers else 0.0)

    def _measured(self, op: Op, gpu: GPUSpec, tp: int, batch: int, context: int, roof_s: float) -> float | None:
        """The profile's figure; beyond its grid, the figure at the grid's edge times the roofline's
        growth from there (never less than the edge: the roofline is monotone)."""
        limits = getattr(self.profile, "grid_limits", lambda *a: None)(op, gpu.name, tp)
        if limits is None:
            return self.profile.op_latency(op, gpu.name, tp, batch, context)
        b0 = min(batch, limits[0])
        c0 = context if limits[1] is None else min(context, limits[1])
        figure = self.profile.op_latency(op, gpu.name, tp, b0, c0)
        if figure is None or (b0, c0) == (batch, context):
            return figure
        self.profile.count_beyond_grid()
        return figure * max(1.0, roof_s / roofline(op, gpu, tp, b0, c0, self.cuda_graphs)[2])

    def transfer_host_s(self, nbytes: float, gpu: GPUSpec, side: str) -> float:
        """Time one side of a stage boundary ("send" or "recv") spends on its own compute stream.

        Measured where the profile has the figure (on CPU ranks the runtime's packing, posting and
        unpacking of a message run on the rank's only core, about 0.3 ms a side on a 2-core VM);
        0 otherwise: on GPUs a send or receive is an enqueued NCCL kernel, and the link time is
        `boundary_s` on the link, which overlaps compute."""
        if self.profile is None or nbytes <= 0:
            return 0.0
        figure = getattr(self.profile, "transfer_host_s", lambda *a: None)(gpu.name, side, nbytes)
        return figure or 0.0

    @property
    def charges_host(self) -> bool:
        """Whether `transfer_host_s` can be non-zero (a profile with host figures)."""
        return self.profile is not None and hasattr(self.profile, "transfer_host_s")

    def op_costs(self, ops: tuple[Op, ...] | list[Op], gpu: GPUSpec, tp: int, batch: int, context: int,
                 hidden_bytes: int, layout: str = "tp") -> list[OpCost]:
        """The cost of each op of a stage run in order (each op sees the next: all-reduce fusion)."""
        return [self.op_cost(op, gpu, tp, batch, context, hidden_bytes, ops[i + 1] if i + 1 < len(ops) else None,
                             layout)
                for i, op in enumerate(ops)]

    def ops_latency(self, ops: tuple[Op, ...] | list[Op], gpu: GPUSpec, tp: int, batch: int, context: int,
                    hidden_bytes: int, layout: str = "tp") -> float:
        return sum(c.total_s for c in self.op_costs(ops, gpu, tp, batch, context, hidden_bytes, layout))


def op_times(op: Op, gpu: GPUSpec, tp: int, batch: int, context: int,
             layout: str = "tp", balance: tuple[float, float] = (1.0, 1.0)) -> tuple[float, float, float]:
    """(weight and activation streaming time, state reading time, math time) of one op, seconds
    (routed experts held as `layout`: the busiest GPU's)."""
    return (op_stream_bytes(op, tp, batch, layout, balance) / gpu.effective_bandwidth,
            op_state_bytes(op, tp, batch, context) / gpu.effective_kv_bandwidth,
            op_flops(op, tp, batch, context, layout, balance) / gpu.effective_flops)


def overlapped_s(memory_s: float, math_s: float, gpu: GPUSpec) -> float:
    """Memory and math of one op run partly at once: the larger, plus `serial_fraction` of the
    smaller (0: a pure roofline maximum; 1: one after the other)."""
    return max(memory_s, math_s) + gpu.serial_fraction * min(memory_s, math_s)


def step_cost_s(op: Op, gpu: GPUSpec, batch: int) -> float:
    """The step's fixed costs, carried by the op that begins a step (the embedding): per step and
    per sequence of the batch."""
    if op.kind != OpKind.EMBED:
        return 0.0
    return gpu.step_overhead + batch * gpu.sequence_overhead


def roofline(op: Op, gpu: GPUSpec, tp: int, batch: int, context: int,
             cuda_graphs: bool = True) -> tuple[float, float, float]:
    """(memory time, math time, latency) of one op, seconds: the analytic model without a profile
    and without its collectives."""
    weights_s, state_s, math_s = op_times(op, gpu, tp, batch, context)
    memory_s = weights_s + state_s
    latency = overlapped_s(memory_s, math_s, gpu) + gpu.op_launch_s(cuda_graphs) + step_cost_s(op, gpu, batch)
    return memory_s, math_s, latency


def intra_bandwidth(gpu: GPUSpec) -> float:
    return gpu.intra_link_bandwidth * INTRA_LINK_EFFICIENCY


def inter_bandwidth(gpu: GPUSpec) -> float:
    return gpu.inter_link_bandwidth * INTER_LINK_EFFICIENCY


def link_bandwidth(gpu: GPUSpec, inter_node: bool) -> float:
    """Achieved point-to-point bandwidth of one GPU's link: its NIC share between nodes, NVLink
    (or PCIe) inside a node."""
    return inter_bandwidth(gpu) if inter_node else intra_bandwidth(gpu)


def link_latency(src: GPUSpec, dst: GPUSpec, inter_node: bool) -> float:
    """Small-message latency of a transfer: the slower end's NIC between nodes, the node's link inside."""
    if inter_node:
        return max(src.inter_link_latency, dst.inter_link_latency)
    return max(src.intra_link_latency, dst.intra_link_latency)


def transfer_s(sent: float, src: GPUSpec, dst: GPUSpec, inter_node: bool, received: float | None = None) -> float:
    """One transfer step between two owners, seen from one replica of each (the network model,
    docs/simulator.md): a sending replica pushes `sent` bytes through its link while a receiving
    replica takes `received` bytes (default `sent`: one replica to one replica) through its own,
    so the step takes latency + max(sent / sender's link, received / receiver's link). Fan-out (one
    replica feeding several) and fan-in (several feeding one) enter through the two byte counts.

    GPUs of different types are never in one node, so their transfers are inter-node."""
    received = sent if received is None else received
    if sent <= 0 and received <= 0:
        return 0.0
    inter = inter_node or src.name != dst.name
    return link_latency(src, dst, inter) + max(sent / link_bandwidth(src, inter), received / link_bandwidth(dst, inter))


def boundary_s(per_token: float, src: GPUSpec, src_rows: int, dst: GPUSpec, dst_rows: int, dst_tp: int,
               inter_node: bool) -> float:
    """A stage boundary carrying `per_token` bytes per sequence from an owner whose replicas each
    hold `src_rows` sequences of the microbatch to one whose replicas each hold `dst_rows`: every
    sending replica sends its rows, every receiving replica takes its rows (from one or several
    senders, `transfer_s`), and the receiving replica's port hands them to its TP peers over the
    node's link (summary §6.2)."""
    if per_token <= 0:
        return 0.0
    received = per_token * dst_rows
    if dst_tp <= 1:
        fanout = 0.0
    elif spans_nodes(dst_tp, dst):  # the port's node, then one copy to each other node over the NICs
        fanout = dst.intra_link_latency + received / intra_bandwidth(dst) \
            + dst.inter_link_latency + received / inter_bandwidth(dst)
    else:
        fanout = dst.intra_link_latency + received / intra_bandwidth(dst)
    return transfer_s(per_token * src_rows, src, dst, inter_node, received) + fanout
