"""Per-op roofline costs, tensor-parallel communication, transfers and memory."""

import functools

import pytest

from opweave.cost import model as C
from opweave.cost.memory import memory_per_gpu
from opweave.hardware.catalog import get_gpu, load_catalog
from opweave.ir.kinds import OpKind
from opweave.passes.trace import build_graph
from opweave.models.registry import resolve


@functools.cache
def graph(name):
    return build_graph(resolve(name).build("meta"))


@functools.cache
def gpu(name):
    return get_gpu(name, load_catalog())


def first(g, kind):
    return next(op for op in g.ops if op.kind == kind)


HIDDEN_BYTES = 4096 * 2


@pytest.mark.slow
def test_gemm_is_weight_bound_at_small_batch_and_compute_bound_at_large():
    g, h100 = graph("llama-3.1-8b"), gpu("h100")
    up = first(g, OpKind.MLP_GATE_UP)
    model = C.CostModel()
    small = model.op_cost(up, h100, 1, 1, 1024, HIDDEN_BYTES)
    assert small.memory_s > small.math_s
    assert small.memory_s == pytest.approx(up.weight_bytes / h100.effective_bandwidth, rel=0.01)
    big = model.op_cost(up, h100, 1, 4096, 1024, HIDDEN_BYTES)
    assert big.math_s > big.memory_s
    assert big.compute_s == pytest.approx(big.math_s + h100.launch_overhead)


def test_attention_is_memory_bound_and_grows_with_context():
    g, h100 = graph("llama-3.1-8b"), gpu("h100")
    attn = first(g, OpKind.ATTN_FULL)
    model = C.CostModel()
    a = model.op_cost(attn, h100, 1, 32, 4096, HIDDEN_BYTES)
    b = model.op_cost(attn, h100, 1, 32, 8192, HIDDEN_BYTES)
    assert a.memory_s > a.math_s and b.memory_s == pytest.approx(2 * a.memory_s, rel=0.01)


def test_tensor_parallel_shards_and_communicates():
    g, h100 = graph("llama-3.1-8b"), gpu("h100")
    down, norm = first(g, OpKind.MLP_DOWN), first(g, OpKind.NORM)
    assert C.op_bytes(down, 4, 8, 0) == pytest.approx(C.op_bytes(down, 1, 8, 0) / 4)
    assert C.op_bytes(norm, 4, 8, 0) == C.op_bytes(norm, 1, 8, 0)  # replicated
    model = C.CostModel()
    assert model.op_cost(down, h100, 1, 8, 0, HIDDEN_BYTES).comm_s == 0
    assert model.op_cost(down, h100, 4, 8, 0, HIDDEN_BYTES).comm_s > 0   # row-parallel: all-reduce
    assert model.op_cost(first(g, OpKind.MLP_GATE_UP), h100, 4, 8, 0, HIDDEN_BYTES).comm_s == 0  # column
    assert C.allreduce_s(1e6, 8, h100) > C.allreduce_s(1e6, 2, h100) > C.allreduce_s(1e6, 1, h100) == 0


def test_kv_state_replicates_beyond_kv_heads():
    attn = first(graph("llama-3.1-8b"), OpKind.ATTN_FULL)  # 8 KV heads
    s = 4096
    assert C.op_bytes(attn, 8, 1, s) < C.op_bytes(attn, 4, 1, s)
    state8 = C.op_bytes(attn, 8, 1, s) - attn.act_bytes_per_token / 8
    state16 = C.op_bytes(attn, 16, 1, s) - attn.act_bytes_per_token / 16
    assert state16 == pytest.approx(state8)


@pytest.mark.slow
def test_moe_weights_read_as_the_grouped_kernel_reads_them():
    experts = first(graph("qwen3-30b-a3b"), OpKind.MOE_EXPERTS)  # 128 experts, top-8
    reads = [C.weight_bytes_read(experts, b) for b in (1, 4, 16, 64, 1024)]
    assert reads == sorted(reads)
    assert reads[0] == pytest.approx(experts.weight_bytes * 8 / 128)
    # up to 16 tokens per expert: each touched expert once (the distinct experts touched)
    assert reads[1] == pytest.approx(experts.weight_bytes * (1 - (1 - 8 / 128) ** 4))
    # 1024 tokens x 8 / 128 = 64 pairs per expert on average: the kernel's blocks of 128 read each
    # expert once, or twice past 128 pairs (a few experts); blocks of 16 would read it 4-5 times
    assert C.moe_block(1024, 8 / 128) == 128
    assert 1.0 * experts.weight_bytes < reads[-1] < 1.05 * experts.weight_bytes
    assert C.expert_reads(1024, 8 / 128, 16) > 4.0


def test_expert_reads_against_enumeration():
    import itertools
    import math

    p, block = 0.3, 2
    for batch in (1, 3, 5):
        exact = sum(math.ceil(sum(hit) / block) * p ** sum(hit) * (1 - p) ** (batch - sum(hit))
                    for hit in itertools.product((0, 1), repeat=batch))
        assert C.expert_reads(batch, p, block) == pytest.approx(exact)
    assert C.expert_reads(40, 1.0, 16) == 3.0
    assert C.expert_reads(40, 1.0) == 1.0  # the kernel's block at 40 pairs an expert: 64


def test_transfers_and_boundaries():
    h100, l40s = gpu("h100"), gpu("l40s")
    nbytes = 1e6
    intra = C.transfer_s(nbytes, h100, h100, inter_node=False)
    inter = C.transfer_s(nbytes, h100, h100, inter_node=True)
    assert 0 < intra < inter
    assert C.transfer_s(nbytes, h100, l40s, inter_node=True) >= inter  # the slower end limits
    assert C.boundary_s(1000, h100, 1000, h100, 1000, 4, False) > C.boundary_s(1000, h100, 1000, h100, 1000, 1, False)
    assert C.transfer_s(0, h100, h100, True) == 0


@pytest.mark.slow
def test_memory_per_gpu_counts_weights_state_and_buffers():
    g = graph("gemma-3-27b")
    one = memory_per_gpu(g.ops, 1, 1, 8192)
    assert one == pytest.approx(g.weight_bytes + g.state_bytes(8192), rel=0.01)
    assert memory_per_gpu(g.ops, 2, 1, 8192) < one
    assert memory_per_gpu(g.ops, 1, 4, 8192, rows=1) - one == pytest.approx(3 * g.state_bytes(8192), rel=0.01)


def test_profile_replaces_roofline_where_it_has_a_figure():
    g, h100 = graph("llama-3.1-8b"), gpu("h100")

    class Table:
        def op_latency(self, op, gpu_name, tp, batch, context):
            return 1e-3 if op.kind == OpKind.ATTN_FULL else None

    model = C.CostModel(profile=Table())
    attn = model.op_cost(first(g, OpKind.ATTN_FULL), h100, 1, 4, 1024, HIDDEN_BYTES)
    assert attn.measured and attn.compute_s == 1e-3
    assert not model.op_cost(first(g, OpKind.O_PROJ), h100, 1, 4, 1024, HIDDEN_BYTES).measured


@pytest.mark.parametrize("batch,experts,top_k,ranks", [(1, 128, 8, 1), (64, 8, 2, 1), (256, 8, 2, 1),
                                                       (100, 64, 6, 1), (256, 64, 8, 4), (4096, 256, 8, 32)])
def test_moe_block_is_the_kernels(batch, experts, top_k, ranks):
    """The block the cost model charges is the one the kernel takes from its shapes (an
    expert-parallel shard holds experts / ranks of them)."""
    pytest.importorskip("triton")
    from opweave.kernels.triton_kernels.moe import moe_block_m

    assert C.moe_block(batch, top_k / experts, ranks) == moe_block_m(batch, top_k, experts // ranks)
