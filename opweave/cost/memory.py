"""The memory accounting: what one GPU of a plan holds, op by op, in four parts.

    weights      its share of every weight of its ops (a weight two of its ops share, once)
    state        slots x per-sequence state of each op / state shards
    activations  the peak bytes one step of the rank's generated code keeps alive
    buffers      the message buffers of its point-to-point transfers (replica leaders only; on
                 the GPU: the transport packs and receives messages on the run device)

Slots per rank = microbatches x the rows of a microbatch its replica serves (the runtime keeps a
state slot for every row of every microbatch: `runtime/worker.py`), with rows the replica's share
of the microbatch (`passes/lower.replica_rows`; the search uses the largest, ceil(m / r)).

Activations. A step feeds `width` tokens per row (1 in decode, up to the prefill chunk in a
prefill). The generated module frees each value after its last use in the step, so a step holds
the residual stream and, at its peak, one op's inputs, outputs and the scratch it allocates inside
its forward (`op_scratch_bytes`, for the key and token blocks of `opweave.kernels.blocks`):
rows x width x (stream + op.act_bytes_per_token / shards) + scratch, for the largest op.

Buffers, which need the plan's transfers, are `opweave.passes.plan_memory`'s.

`memory_per_gpu` (weights + state + activations: what lives on the GPU) is what the planner
checks against a GPU's usable memory; `Footprint` is the
same formula with its per-op sums precomputed, for the search's inner loop; the planned breakdown
of one rank of a compiled plan (what `opweave dump --what memory` shows) is
`opweave.passes.plan_memory.plan_rank_memory`.
"""

from __future__ import annotations

import dataclasses
import math

from opweave.cost.model import shards, state_shards
from opweave.ir.graph import Op
from opweave.ir.kinds import OpKind
from opweave.ir.plan import PAGE_TOKENS, PREFILL_CHUNK
from opweave.ir.tp import EXPERT_KINDS
from opweave.ir.workload import kv_pool_pages
from opweave.kernels.blocks import ATTN_KEY_BLOCK, MOE_TOKEN_BLOCK
from opweave.kernels.sampling import workspace_bytes as sampler_workspace_bytes

SCORE_BYTES = 12
"""Scratch bytes per attention score of a key block (`kernels/blocks.py`): the float32 scores,
their exponentials and the mask."""

ATTN_ACCUMULATORS = 5
"""float32 copies of q-sized tensors the blocked attention keeps (running max, sum, output, q)."""

UPCAST_FACTOR = 2
"""Scratch of a norm, RoPE or activation op per byte of its activations: the float32 copies of
its input it computes in (RMSNorm: x.float(), its square, the scaled copy)."""

UPCAST_KINDS = (OpKind.NORM, OpKind.FINAL_NORM, OpKind.QK_NORM, OpKind.ROPE, OpKind.ACT, OpKind.MOE_ROUTER,
                OpKind.SHARED_EXPERT)
"""Ops that compute in float32 copies of their inputs (the others write their outputs directly)."""

RECURRENT_TEMPORARIES = 6
"""Gated-DeltaNet's per-token update holds this many state-sized float32 temporaries."""

STREAM_COPIES = 3
"""Values a step keeps besides the op at its peak (the residual, the stage's received values and
the full values a TP group gathers to send), in units of the largest activations of one op
(before the LM head)."""

@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes one GPU holds, by category."""

    weights: float = 0.0
    state: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0

    @property
    def on_gpu(self) -> float:
        """What lives in the GPU's memory (the buffers are host memory)."""
        return self.weights + self.state + self.activations

    @property
    def total(self) -> float:
        return self.on_gpu + self.buffers

    def to_json(self) -> dict[str, float]:
        return {"weights": self.weights, "state": self.state, "activations": self.activations,
                "buffers": self.buffers, "on_gpu": self.on_gpu, "total": self.total}


CATEGORIES = ("weights", "state", "activations", "buffers")


def slots_per_rank(batch: int, microbatches: int, replicas: int) -> int:
    """State slots the runtime allocates on a rank of the replica with the most rows."""
    return microbatches * max_rows(batch, microbatches, replicas)


def max_rows(batch: int, microbatches: int, replicas: int) -> int:
    """Rows of a microbatch the largest replica serves (microbatches of batch // n rows)."""
    return math.ceil((batch // microbatches) / replicas)


def weight_bytes(ops, tp: int, layout: str = "tp") -> float:
    """One GPU's share of its ops' weights (routed experts held as `layout`); a weight two ops
    share (tied) counted once."""
    per_weight = {}
    for op in ops:
        for w in op.weights:
            per_weight[w.name] = max(per_weight.get(w.name, 0.0), w.nbytes / shards(op, tp, layout))
    return sum(per_weight.values())


PAGED_KINDS = (OpKind.ATTN_FULL, OpKind.ATTN_MLA)
"""Ops whose state the runtime keeps in KV pages (full attention's keys and values, MLA's latent rows)."""


def redundant_bytes(ops, tp: int, redundant: int) -> float:
    """The weights of `redundant` more experts per GPU of each routed-experts op of `ops` held
    expert-parallel over `tp` GPUs (`opweave.ir.experts`)."""
    if redundant <= 0 or tp <= 1:
        return 0.0
    return sum(redundant * w.nbytes / w.shape[0] for op in ops if op.kind in EXPERT_KINDS for w in op.weights)


def op_state_per_slot(op: Op, tp: int, context: int) -> float:
    """One slot's state of `op` on one GPU: a paged layer's whole pages for `context`
    (`opweave.runtime.pages`), any other state as the op holds it."""
    if op.kind in PAGED_KINDS:
        return op.state.bytes_per_token * -(-context // PAGE_TOKENS) * PAGE_TOKENS / state_shards(op, tp)
    return op.state_bytes(context) / state_shards(op, tp)


def null_page_bytes(op: Op, tp: int) -> float:
    """A paged layer's null page (padding writes there) on one GPU; 0 for other ops."""
    return op.state.bytes_per_token * PAGE_TOKENS / state_shards(op, tp) if op.kind in PAGED_KINDS else 0.0


def state_bytes_per_slot(ops, tp: int, context: int) -> float:
    return sum(op_state_per_slot(op, tp, context) for op in ops)


def state_bytes(ops, tp: int, slots: int, context: int, pages: int | None = None) -> float:
    """One GPU's state for `slots` slots: per slot, and each paged layer's null page; the paged
    layers' pool of `pages` pages (default: every slot at the full context)."""
    full = slots * state_bytes_per_slot(ops, tp, context) + sum(null_page_bytes(op, tp) for op in ops)
    if pages is None:
        return full
    return full + (pages - slots * -(-context // PAGE_TOKENS)) * sum(null_page_bytes(op, tp) for op in ops)


def op_scratch_bytes(op: Op, tp: int, rows: int, width: int, context: int, layout: str = "tp",
                     gather: bool = True) -> float:
    """Bytes an op allocates inside its forward beyond its inputs and outputs (freed on return),
    for the block sizes of `opweave.kernels.blocks` (routed experts held as `layout`; without
    their gathered weights unless `gather`)."""
    n = shards(op, tp, layout)
    if op.kind in (OpKind.ATTN_FULL, OpKind.ATTN_SLIDING):
        heads = op.tp_units / n                                   # query heads on this GPU
        kv = op.state.bytes_per_token / state_shards(op, tp)      # k and v bytes per cached position
        block = min(ATTN_KEY_BLOCK, max(op.state.tokens_at(context), width))
        per_head = op.state.bytes_per_token / (2 * max(1, op.kv_heads or op.state.max_shards))  # head_dim x dtype
        return rows * (heads * width * block * SCORE_BYTES + block * kv * 3
                       + ATTN_ACCUMULATORS * width * heads * per_head * 2)
    if op.kind in (OpKind.MOE_EXPERTS, OpKind.MOE_EXPERTS_SWIGLU):  # the k experts' weights, a block of tokens
        return (expert_gather_bytes(op, tp, rows * width, layout) if gather else 0.0) \
            + rows * width * op.act_bytes_per_token / n
    if op.kind == OpKind.ATTN_MLA:  # latent attention: every query head against the shared latent rows
        heads = op.tp_units / n                                   # query heads on this GPU
        row = op.state.bytes_per_token                            # latent + rope key per position (all ranks)
        block = min(ATTN_KEY_BLOCK, max(op.state.tokens_at(context), width))
        return rows * (heads * width * block * SCORE_BYTES + block * row * 3
                       + (ATTN_ACCUMULATORS * 2 + 1) * width * heads * row)  # + the concatenated [q_abs | q_pe]
    if op.kind == OpKind.ATTN_LINEAR:
        return rows * (RECURRENT_TEMPORARIES * op.state_bytes(context) / state_shards(op, tp)
                       + width * UPCAST_FACTOR * op.act_bytes_per_token / n)
    if op.kind == OpKind.SAMPLE:                                  # the server's sampler walks the vocabulary in chunks
        return sampler_workspace_bytes(rows, op.tp_units // n)
    if op.kind in UPCAST_KINDS:
        return rows * width * UPCAST_FACTOR * op.act_bytes_per_token / n
    return 0.0


def expert_gather_bytes(op: Op, tp: int, tokens: int, layout: str = "tp") -> float:
    """The routed experts' weights the torch path gathers for a block of at most `MOE_TOKEN_BLOCK`
    of `tokens` tokens: k experts' slices each (whole experts when expert-parallel: a pair of
    another rank gathers a clamped one). It stops growing at one block."""
    if op.kind not in (OpKind.MOE_EXPERTS, OpKind.MOE_EXPERTS_SWIGLU):
        return 0.0
    whole = layout == "ep" and tp > 1
    return min(tokens, MOE_TOKEN_BLOCK) * op.active_weight_fraction * op.weight_bytes / (1 if whole else shards(op, tp))


def activation_bytes(ops, tp: int, rows: int, width: int, context: int, layout: str = "tp",
                     gather: bool = True) -> float:
    """Peak bytes of one step of `rows` rows and `width` tokens per row (module docstring): the
    residual stream, and the op with the largest inputs + outputs + scratch (`gather`: with the
    experts' gathered weights)."""
    if rows <= 0 or not ops:
        return 0.0
    stream = STREAM_COPIES * max(op.act_bytes_per_token / shards(op, tp) for op in ops
                                 if op.kind not in (OpKind.LM_HEAD, OpKind.SAMPLE))
    return rows * width * stream + max(rows * width * op.act_bytes_per_token / shards(op, tp)
                                       + op_scratch_bytes(op, tp, rows, width, context, layout, gather)
                                       for op in ops)


_TERMS: dict[tuple, tuple] = {}
"""`_op_terms` memo: (id(op), tp, context, width, layout) -> (op, terms); the op is kept so its id
cannot be reused."""


def _op_terms(op: Op, tp: int, context: int, width: int, layout: str, redundant: int = 0) -> tuple:
    """One op's part of a `Footprint`: ((weight name, bytes per GPU) ..., state bytes per slot, its
    residual-stream bytes per token (0 for the LM head and sampler), its peak bytes at one row
    without gathered expert weights, those gathered weights at one block). Expert-parallel routed
    experts hold `redundant` more experts per GPU (`opweave.ir.experts`)."""
    if layout == "dp" and tp > 1:  # data-parallel attention: experts as "ep", the rest at TP 1 on 1 / tp of the rows
        if op.kind in EXPERT_KINDS:
            return _op_terms(op, tp, context, width, "ep", redundant)
        weights, state, stream, peak, gather, null = _op_terms(op, 1, context, width, "tp")
        return weights, state / tp, stream / tp, peak / tp, gather, null
    key = (id(op), tp, context, width, layout, redundant)
    hit = _TERMS.get(key)
    if hit is not None and hit[0] is op:
        return hit[1]
    n = shards(op, tp)
    weights = tuple((w.name, w.nbytes / shards(op, tp, layout)) for w in op.weights)
    if redundant and layout == "ep" and tp > 1 and op.kind in EXPERT_KINDS and op.weights:
        per = op.weights[0].shape[0] // tp   # E / tp experts, and `redundant` copies of others
        weights = tuple((name, nbytes * (per + redundant) / per) for name, nbytes in weights)
    stream = 0.0 if op.kind in (OpKind.LM_HEAD, OpKind.SAMPLE) else op.act_bytes_per_token / n
    peak = width * op.act_bytes_per_token / n + op_scratch_bytes(op, tp, 1, width, context, layout, gather=False)
    terms = (weights, op_state_per_slot(op, tp, context), stream, peak,
             expert_gather_bytes(op, tp, MOE_TOKEN_BLOCK, layout), null_page_bytes(op, tp))
    if len(_TERMS) > 1 << 20:
        _TERMS.clear()
    _TERMS[key] = (op, terms)
    return terms


def memory_per_gpu(ops, tp: int, slots: int, context: int, rows: int | None = None,
                   width: int = PREFILL_CHUNK, layout: str = "tp") -> float:
    """Bytes one GPU of a TP group running `ops` holds with `slots` state slots and steps of
    `rows` rows (default: all slots in one microbatch) of `width` tokens: weights + state +
    activations (message buffers: `opweave.passes.plan_memory`)."""
    return Footprint.of(ops, tp, context, width, layout).bytes_at(slots, slots if rows is None else rows)


@dataclasses.dataclass(frozen=True, slots=True)
class Footprint:
    """The accounting of one op list on one TP degree, linear in slots and rows: an upper bound
    of `activation_bytes` at any rows (the experts' gathered weights, which stop growing at one
    block of tokens, are a fixed term; the rest is linear in rows)."""

    weights: float
    per_slot: float   # state
    per_row: float    # activations of one row of a step, without the experts' gathered weights
    fixed: float = 0.0  # the largest block of gathered expert weights (`expert_gather_bytes`)
    null_pages: float = 0.0  # each full-attention layer's null page (`null_page_bytes`)
    per_page: float = 0.0    # one KV page of every paged layer (its part of `per_slot`: `context_pages` of them)
    context_pages: int = 0   # pages of one slot at the full context

    @classmethod
    def of(cls, ops, tp: int, context: int, width: int = PREFILL_CHUNK, layout: str = "tp",
           redundant: int = 0) -> Footprint:
        """`weight_bytes`, `state_bytes_per_slot`, `activation_bytes` at one row without the gathered
        expert weights, and those as `fixed`: combined from each op's terms (`_op_terms`, memoized:
        the planner asks for many op lists that share ops)."""
        per_weight: dict[str, float] = {}
        state = stream = peak = fixed = null = 0.0
        for op in ops:
            weights, op_state, op_stream, op_peak, gather, op_null = _op_terms(op, tp, context, width, layout,
                                                                              redundant)
            for name, nbytes in weights:
                if nbytes > per_weight.get(name, -1.0):
                    per_weight[name] = nbytes
            state += op_state
            null += op_null
            stream, peak, fixed = max(stream, op_stream), max(peak, op_peak), max(fixed, gather)
        pages = -(-context // PAGE_TOKENS)
        if not per_weight and not peak:
            return cls(weights=0.0, per_slot=state, per_row=0.0, fixed=0.0, null_pages=null,
                       per_page=null / tp if layout == "dp" and tp > 1 else null,
                       context_pages=pages)
        # under "dp" a page of the owner's pool is one rank's in tp (each holds its own rows' pages)
        page = null / tp if layout == "dp" and tp > 1 else null
        return cls(weights=sum(per_weight.values()), per_slot=state, per_row=width * STREAM_COPIES * stream + peak,
                   fixed=fixed, null_pages=null, per_page=page, context_pages=pages)

    def bytes_at(self, slots: int, rows: int, pages: int | None = None) -> float:
        """Bytes with `slots` state slots, steps of `rows` rows and a KV pool of `pages` pages
        (default: every slot at the full context)."""
        state = slots * self.per_slot
        if pages is not None:
            state += (pages - slots * self.context_pages) * self.per_page
        return self.weights + self.null_pages + state + (self.fixed + rows * self.per_row if rows > 0 else 0.0)

    def bytes(self, batch: int, microbatches: int, replicas: int, workload=None) -> float:
        """A rank of the largest replica of an owner with `replicas` replicas, resident batch
        `batch` in `microbatches` microbatches, its KV pool sized for `workload`
        (`ir.workload.kv_pool_pages`; None: every slot at the full context)."""
        slots = slots_per_rank(batch, microbatches, replicas)
        pages = None if workload is None else kv_pool_pages(slots, self.context_pages * PAGE_TOKENS, workload,
                                                              PAGE_TOKENS)
        return self.bytes_at(slots, max_rows(batch, microbatches, replicas), pages)
