"""Prefill in the cost model: the compute of a prompt, the time to its first token (TTFT) on an idle plan.

`prefill_s` prices `prompts` prompts of `isl` tokens each, computed together as one step on a TP
group of one GPU type, per op with the same catalog as decode (`opweave.cost.model`), where decode's
terms change as a prompt's do:

    math_s    = tokens * mean flops per token / shards / (peak * prefill efficiency)
    weights_s = (weights read once + tokens * activations) / shards / (bandwidth * mem_eff)
    state_s   = prompts * isl * state bytes per token * (1 + attended / (2 * QUERY_BLOCK))
                / state shards / (bandwidth * kv_eff)     (attended: isl, or a window)
    latency   = max(memory, math) + serial_fraction * min(memory, math) + an eager launch

with tokens = prompts * isl, except the LM head and the sampler, which see each prompt's last
token only. A token at position p attends p earlier positions (a sliding window at most its
window), so an attention op's mean flops per token is its flops at the mean of those contexts:
quadratic in `isl` over the prompt. Its keys and values are written once and read again once per
block of `QUERY_BLOCK` queries (flash attention's tiling). TP collectives are decode's, at
`tokens` rows. Prefill runs eagerly (no CUDA graph): every op pays the eager launch.

`GPUSpec.prefill_efficiency` is the share of peak FLOP/s a prefill reaches (the catalog's figure is
fitted to published prefill times, `tests/test_prefill.py` holds the fit to them; an entry without
one uses its `gemm_efficiency`).
"""

from __future__ import annotations

import dataclasses
import math

from opweave.ir.tp import EXPERT_KINDS
from opweave.cost.model import (CostModel, expert_parallel_factors, op_stream_bytes, op_times, overlapped_s, shards,
                                state_shards, transfer_s)
from opweave.hardware.catalog import GPUSpec
from opweave.ir.graph import Op
from opweave.ir.kinds import OpKind

QUERY_BLOCK = 128
"""Queries per block of a prefill attention kernel: each block reads the keys and values before it once."""

LAST_TOKEN_KINDS = (OpKind.LM_HEAD, OpKind.SAMPLE)
"""Ops a prompt feeds only its last token to (the first output's logits and draw)."""

_CONTEXT_SAMPLES = 64


@dataclasses.dataclass(frozen=True)
class PrefillCost:
    """The prefill of `prompts` prompts of `isl` tokens on one TP group: seconds, by term."""

    isl: int
    prompts: int
    total_s: float
    math_s: float
    weights_s: float
    state_s: float
    overheads_s: float
    communication_s: float


def _tokens(op: Op, isl: int, prompts: int) -> int:
    """The tokens a prefill feeds `op`: every prompt token, or each prompt's last one."""
    return prompts if op.kind in LAST_TOKEN_KINDS else prompts * isl


def mean_flops_per_token(op: Op, isl: int) -> float:
    """The op's flops per token averaged over a prompt's positions 1..isl (each attends the positions
    before it and itself, `Op.flops_at`)."""
    if not op.flops_per_context_token or not op.state:
        return float(op.flops_per_token)
    points = [max(1, round((i + 0.5) * isl / _CONTEXT_SAMPLES)) for i in range(_CONTEXT_SAMPLES)]
    return sum(op.flops_at(p) for p in points) / len(points)


def prefill_op_s(op: Op, gpu: GPUSpec, tp: int, isl: int, prompts: int = 1,
                 layout: str = "tp") -> tuple[float, float, float, float]:
    """(weights and activations time, state time, math time, latency) of one op in a prefill."""
    tokens = _tokens(op, isl, prompts)
    weights_s = op_stream_bytes(op, tp, tokens, layout) / gpu.effective_bandwidth
    state_s = 0.0
    if op.state and op.state.bytes_per_token:  # every token's keys written; re-read per query block
        reads = 1.0 + (op.state.tokens_at(isl) / (2 * QUERY_BLOCK) if op.flops_per_context_token else 0.0)
        state_s = (prompts * isl * op.state.bytes_per_token * reads
                   / state_shards(op, tp) / gpu.effective_kv_bandwidth)
    pairs = expert_parallel_factors(op, tp, tokens, layout)[1]
    math_s = pairs * tokens * mean_flops_per_token(op, isl) / shards(op, tp, layout) / gpu.prefill_flops
    latency = overlapped_s(weights_s + state_s, math_s, gpu) + gpu.op_launch_s(False)
    return weights_s, state_s, math_s, latency


@dataclasses.dataclass(frozen=True)
class PrefillStage:
    """One stage of a plan as a prompt crosses it: its ops on one replica of its owner, and what it
    sends the next stage's owner per token (0: the same owner, or the last stage)."""

    ops: tuple[Op, ...]
    gpu: GPUSpec
    tp: int
    layout: str = "tp"
    send_bytes_per_token: float = 0.0
    next_gpu: GPUSpec | None = None
    inter_node: bool = False


def plan_prefill_s(stages: list[PrefillStage], isl: int, hidden_bytes: int = 0,
                   cost_model: CostModel | None = None) -> float:
    """A prompt of `isl` tokens through a plan's stages in order, alone (an idle plan): each stage's
    prefill on its owner, then its output's `isl` tokens over the link to the next owner. The
    compute of the first token's TTFT, without queueing or other requests' rounds."""
    total = 0.0
    for st in stages:
        total += prefill_s(st.ops, st.gpu, st.tp, isl, 1, hidden_bytes, st.layout, cost_model).total_s
        if st.send_bytes_per_token and st.next_gpu is not None:
            total += transfer_s(isl * st.send_bytes_per_token, st.gpu, st.next_gpu, st.inter_node)
    return total


def prefill_s(ops: tuple[Op, ...] | list[Op], gpu: GPUSpec, tp: int, isl: int, prompts: int = 1,
              hidden_bytes: int = 0, layout: str = "tp", cost_model: CostModel | None = None) -> PrefillCost:
    """The prefill of `prompts` prompts of `isl` tokens through `ops` on `tp` GPUs of `gpu` (the
    whole model: the compute part of an idle plan's TTFT)."""
    if isl < 1 or prompts < 1:
        raise ValueError(f"a prefill of {prompts} prompts of {isl} tokens")
    cost_model = cost_model or CostModel()
    weights = state = math = latency = overheads = comm = 0.0
    for i, op in enumerate(ops):
        w, s, m, t = prefill_op_s(op, gpu, tp, isl, prompts, layout)
        weights, state, math, latency = weights + w, state + s, math + m, latency + t
        overheads += gpu.op_launch_s(False)
        comm += cost_model.collectives_s(op, gpu, tp, _tokens(op, isl, prompts), hidden_bytes,
                                         ops[i + 1] if i + 1 < len(ops) else None, layout)
    return PrefillCost(isl=isl, prompts=prompts, total_s=latency + comm, math_s=math, weights_s=weights,
                       state_s=state, overheads_s=overheads, communication_s=comm)


def round_extra_s(ops: tuple[Op, ...] | list[Op], gpu: GPUSpec, tp: int, rows: int, context: int, tokens: int,
                  isl: int, hidden_bytes: int = 0, layout: str = "tp", cost_model: CostModel | None = None) -> float:
    """Seconds a decode round of `rows` rows at `context` gains on `ops` when it also carries
    `tokens` prompt tokens (chunks of prompts of `isl` tokens): the aggregated-prefill round of
    chunked prefill (`passes/traffic.py`).

    Per op, the mixed round's memory (decode's, plus the prompt tokens' activations, the experts
    they add and their keys and values written and read per query block) and math (decode's plus
    the prompt tokens' at the prompt's mean context, at the prefill efficiency) overlap as one op's
    do; the gain is that minus decode's, plus the TP collectives at `rows + tokens` rows and an
    eager launch in place of a graph replay (a round with prompt tokens has no decode graph). The
    LM head and the sampler see a prompt's last token only: `tokens / isl` of them. Under "dp" the
    prompt tokens are spread over the group's GPUs, each its own rows' (`opweave.ir.tp`)."""
    if tokens <= 0:
        return 0.0
    cost_model = cost_model or CostModel()
    if layout == "dp" and tp > 1:  # data-parallel attention: each GPU schedules its own rows, so the group's
        # prompt tokens are spread over its GPUs; the experts see every row and token of the group as "ep"
        return sum(_dp_experts_extra_s(op, gpu, tp, rows, context, tokens, isl, hidden_bytes, cost_model)
                   if op.kind in EXPERT_KINDS else
                   round_extra_s([op], gpu, 1, -(-rows // tp), context, -(-tokens // tp), isl, hidden_bytes, "tp",
                                 cost_model)
                   for op in ops)
    extra = 0.0
    for i, op in enumerate(ops):
        last_only = op.kind in LAST_TOKEN_KINDS
        q = max(1, math.ceil(tokens / isl)) if last_only else tokens
        weights_s, state_s, math_s = op_times(op, gpu, tp, rows, context, layout)
        # never negative: the grouped MoE kernel's block doubles at some batches, and there it reads less
        stream_s = max(0.0, op_stream_bytes(op, tp, rows + q, layout) - op_stream_bytes(op, tp, rows, layout)) \
            / gpu.effective_bandwidth
        kv_s = 0.0
        if op.state and op.state.bytes_per_token and not last_only:
            reads = 1.0 + (op.state.tokens_at(isl) / (2 * QUERY_BLOCK) if op.flops_per_context_token else 0.0)
            kv_s = q * op.state.bytes_per_token * reads / state_shards(op, tp) / gpu.effective_kv_bandwidth
        pairs = expert_parallel_factors(op, tp, rows + q, layout)[1]
        prompt_math_s = pairs * q * mean_flops_per_token(op, isl) / shards(op, tp, layout) / gpu.prefill_flops
        extra += (overlapped_s(weights_s + state_s + stream_s + kv_s, math_s + prompt_math_s, gpu)
                  - overlapped_s(weights_s + state_s, math_s, gpu))
        extra += gpu.op_launch_s(False) - gpu.op_launch_s(cost_model.cuda_graphs)
        following = ops[i + 1] if i + 1 < len(ops) else None
        extra += (cost_model.collectives_s(op, gpu, tp, rows + q, hidden_bytes, following)
                  - cost_model.collectives_s(op, gpu, tp, rows, hidden_bytes, following))
    return extra


def _dp_experts_extra_s(op: Op, gpu: GPUSpec, tp: int, rows: int, context: int, tokens: int, isl: int,
                        hidden_bytes: int, cost_model: CostModel) -> float:
    """`round_extra_s` of a "dp" owner's routed experts: as "ep" over the group's rows and prompt
    tokens, with the group's dispatch (`CostModel.collectives_s`, "dp") in place of the all-reduce."""
    extra = round_extra_s([op], gpu, tp, rows, context, tokens, isl, hidden_bytes, "ep", cost_model)
    for layout, sign in (("ep", -1.0), ("dp", 1.0)):
        extra += sign * (cost_model.collectives_s(op, gpu, tp, rows + tokens, hidden_bytes, None, layout)
                         - cost_model.collectives_s(op, gpu, tp, rows, hidden_bytes, None, layout))
    return extra
