"""Expert parallelism in the planner: the layout's legality (quantization blocks), the busiest
rank's cost against sampled routings, Pareto pruning the dominated layout without changing the
optimum, and plans that hold experts whole where slicing cannot split them."""

import dataclasses
import functools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.compiler.frontend import run_front_end
from opweave.cost.model import (CostModel, allreduce_s, ep_imbalance, expected_max_normal,
                                inter_bandwidth, intra_bandwidth, moe_block, spans_nodes)
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import Cluster, Pool, parse_cluster
from opweave.ir.kinds import OpKind
from opweave.ir.tp import expert_layouts, legal_tp, of_op
from opweave.passes.trace import build_graph
from opweave.models.hf_config import config_from_hf
from opweave.models.model import build_model
from opweave.passes.blocks import find_blocks
from opweave.passes.placement import Group, place, transfer_locality, verify_placement
from opweave.passes.search import SearchOptions, search
from opweave.passes.space import PlanSpace, fits_group
from test_search import gpu

TINY_MOE = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=256,
                moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                rope_theta=1e6, torch_dtype="bfloat16")


@functools.cache
def tiny_moe():
    graph = build_graph(build_model(config_from_hf(TINY_MOE, "tiny-moe"), "meta"))
    return graph, find_blocks(graph)


def sampled_imbalance(batch, experts, top_k, ranks, trials, rng):
    """(E[busiest rank's reads] / E[a rank's reads], the same for pairs) over uniform routings."""
    per = experts // ranks
    reads_max = reads_all = pairs_max = pairs_all = 0.0
    for _ in range(trials):
        counts = [0] * experts
        for _ in range(batch):
            for e in rng.sample(range(experts), top_k):
                counts[e] += 1
        block = moe_block(batch, top_k / experts, ranks)  # the kernel's, on a shard of `per` experts
        reads = [sum(math.ceil(c / block) for c in counts[r * per:(r + 1) * per]) for r in range(ranks)]
        pairs = [sum(counts[r * per:(r + 1) * per]) for r in range(ranks)]
        reads_max, reads_all = reads_max + max(reads), reads_all + sum(reads) / ranks
        pairs_max, pairs_all = pairs_max + max(pairs), pairs_all + sum(pairs) / ranks
    return reads_max / reads_all, pairs_max / pairs_all


@pytest.mark.parametrize("batch,experts,top_k,ranks", [(1, 128, 4, 8), (16, 128, 4, 4), (64, 32, 4, 8),
                                                       (256, 256, 8, 8), (512, 64, 2, 2)])
def test_busiest_rank_matches_sampled_routings(batch, experts, top_k, ranks):
    reads, pairs = ep_imbalance(batch, experts, top_k, ranks)
    want_reads, want_pairs = sampled_imbalance(batch, experts, top_k, ranks, 300, random.Random(batch + ranks))
    assert reads >= 1.0 and pairs >= 1.0
    assert reads == pytest.approx(want_reads, rel=0.12)
    assert pairs == pytest.approx(want_pairs, rel=0.12)


def test_expected_max_normal_is_close_to_the_exact_values():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=0.05)   # exact: 0.5642
    assert expected_max_normal(8) == pytest.approx(1.4236, rel=0.05)


@pytest.mark.slow
def test_quantization_blocks_decide_which_layout_is_legal():
    """gpt-oss's expert down projection is stored in mxfp4 blocks of 32 along its 2880 channels:
    TP 2 slices whole blocks (1440 = 45 x 32), TP 4 and 8 would cut them; expert parallelism holds
    whole experts. DeepSeek-V3's fp8 128 x 128 blocks split evenly up to TP 8 (the per-head
    view of kv_b_proj is stored [heads x 256, 512])."""
    oss = run_front_end("gpt-oss-20b").graph
    experts = next(op for op in oss.ops if op.kind == OpKind.MOE_EXPERTS_SWIGLU)
    assert not legal_tp([experts], 4) and legal_tp([experts], 4, "ep") and legal_tp([experts], 2)
    assert {tp: expert_layouts(oss.ops, tp) for tp in (1, 2, 4, 8)} == {
        1: ("tp",), 2: ("tp", "ep"), 4: ("ep",), 8: ("ep",)}
    ds = run_front_end("deepseek-v3").graph
    assert expert_layouts(ds.ops, 8) == ("tp", "ep")
    assert of_op(experts).experts == 32 and not legal_tp([experts], 64, "ep")   # 32 experts


@pytest.mark.slow
def test_expert_parallel_costs_no_less_than_slicing():
    """Qwen3-30B-A3B (128 experts, top 8) on 4 H100s: at batch 1 the busiest of 4 expert-parallel
    GPUs reads 1.7x the sliced share of weights; by batch 64 the excess is a few percent."""
    graph = run_front_end("qwen3-30b-a3b").graph
    experts = [op for op in graph.ops if op.kind == OpKind.MOE_EXPERTS][:1]
    h100 = load_catalog()["h100"]
    cm = CostModel()
    ratio = {}
    for batch in (1, 8, 64, 512):
        sliced = cm.op_costs(experts, h100, 4, batch, 1024, 4096)[0]
        whole = cm.op_costs(experts, h100, 4, batch, 1024, 4096, "ep")[0]
        assert whole.total_s >= sliced.total_s and whole.comm_s == sliced.comm_s   # the same all-reduce
        ratio[batch] = whole.weights_s / sliced.weights_s
    assert ratio[1] > 1.5 and ratio[1] > ratio[8] > ratio[64] and ratio[64] < 1.1 and ratio[512] < 1.1


def _moe_cluster(draw):
    graph, _ = tiny_moe()

    def one(name):
        return gpu(name, bw=draw(st.floats(5e9, 5e10)), flops=draw(st.floats(1e11, 1e13)),
                   mem=graph.weight_bytes * draw(st.floats(0.4, 3.0)), price=draw(st.floats(0.5, 5.0)),
                   link=draw(st.floats(1e9, 1e11)), node=draw(st.sampled_from([2, 4])))

    return Cluster(pools=(Pool(gpu=one("fast"), count=4), Pool(gpu=one("cheap"), count=4)), spec="fastx4+cheapx4")


GRID = dict(batches=(1, 8, 32), microbatches=(1, 2), tp_degrees=(1, 2, 4), replicas=(1, 2), max_owners=2,
            only_templates=("colocated", "afd", "cad"))


@settings(max_examples=8, deadline=None)
@given(data=st.data(), slo_ms=st.floats(0.05, 2.0), context=st.sampled_from([256, 4096]))
def test_pruned_search_with_expert_layouts_matches_exhaustive(data, slo_ms, context):
    cluster = _moe_cluster(data.draw)
    graph, blocks = tiny_moe()
    space = PlanSpace(graph=graph, blocks=blocks, cluster=cluster, context=context, tpot_slo_s=slo_ms / 1e3)
    exhaustive = search(space, SearchOptions(**GRID, pareto=False, bnb=False))
    for flags in (dict(pareto=True, bnb=True), dict(pareto=True, bnb=False)):
        pruned = search(space, SearchOptions(**GRID, **flags))
        assert (pruned.best is None) == (exhaustive.best is None), flags
        if exhaustive.best is not None:
            assert pruned.best.cost == pytest.approx(exhaustive.best.cost, rel=1e-9), flags


def test_pareto_drops_the_dominated_layout():
    """Both layouts fit every TP > 1 configuration of a slot with experts; Pareto keeps the
    sliced one of each shape (equal cost and rows, no slower), so it prunes and the optimum stays
    (data-parallel attention, a third layout, left out: `tests/test_attention_dp.py`)."""
    graph, blocks = tiny_moe()
    cluster = Cluster(pools=(Pool(gpu=gpu("g", 2e10, 2e12, graph.weight_bytes * 8, 1.0), count=8),), spec="gx8")
    space = PlanSpace(graph=graph, blocks=blocks, cluster=cluster, context=1024, tpot_slo_s=0.05,
                      attention_dp=False)
    on = search(space, SearchOptions(**GRID))
    off = search(space, SearchOptions(**GRID, pareto=False))
    assert on.counters.frontier_configs < on.counters.owner_configs
    assert off.counters.frontier_configs == off.counters.owner_configs
    assert on.best.cost == pytest.approx(off.best.cost, rel=1e-12)
    assert on.counters.simulator_calls <= off.counters.simulator_calls
    assert all(o.experts == "tp" for o in on.best.owners)


@pytest.mark.slow
def test_planner_holds_experts_whole_where_slicing_cannot_split_them():
    """gpt-oss-20b at TP 4 on H100s: the mxfp4 blocks forbid sliced experts, so the plan is
    expert-parallel, and the error for a pinned sliced owner says why."""
    fe = run_front_end("gpt-oss-20b")
    cluster = parse_cluster("h100x8", load_catalog())
    space = PlanSpace(graph=fe.graph, blocks=fe.blocks, cluster=cluster, context=8192, tpot_slo_s=0.05,
                      attention_dp=False)  # the TP group's two layouts alone ("dp" holds them whole too)
    found = search(space, SearchOptions(templates="colocated", batches=(64,), microbatches=(1,), tp_degrees=(4,),
                                        replicas=(1,), attention_dp=False))
    assert found.best is not None and [(o.tp, o.experts) for o in found.best.owners] == [(4, "ep")]
    assert "ep" in found.best.owners[0].describe()


# ---------------------------------------------------------------- expert-parallel groups of whole nodes


def test_allreduce_over_whole_nodes_is_hierarchical():
    """16 GPUs on 2 nodes of 8: the node's ring reduce-scatters and all-gathers over NVLink, each
    GPU all-reduces its eighth with its peer of the other node over its NIC."""
    h100 = load_catalog()["h100"]
    nbytes = 8e6
    intra = intra_bandwidth(h100)
    want = h100.collective_latency + 14 * h100.intra_link_latency + 14 / 8 * nbytes / intra \
        + 2 * h100.inter_link_latency + 2 / 2 * (nbytes / 8) / inter_bandwidth(h100)
    assert allreduce_s(nbytes, 16, h100) == pytest.approx(want, rel=1e-12)
    assert allreduce_s(nbytes, 8, h100) < allreduce_s(nbytes, 16, h100) < allreduce_s(nbytes, 32, h100)
    assert spans_nodes(16, h100) and not spans_nodes(8, h100)


def test_placement_gives_a_wide_group_whole_nodes():
    cluster = parse_cluster("h100x44", load_catalog())   # 5 full nodes and one of 4
    where = verify_placement(place((Group(gpu="h100", tp=1, replicas=4), Group(gpu="h100", tp=16, replicas=1)),
                                   cluster), cluster)
    assert where.num_sets == 2                            # 2 x (4 + 16) GPUs; the third set has no 2 full nodes
    first, wide = where.replica_set(0)
    assert first == ((0,), (1,), (2,), (3,)) and wide == (tuple(range(8, 24)),)
    assert where.replica_set(1)[1] == (tuple(range(24, 40)),)
    assert transfer_locality(where, cluster, 8) == {(0, 1): False, (1, 0): False}
    assert fits_group(16, cluster.pools[0].gpu, 44, "ep") and not fits_group(16, cluster.pools[0].gpu, 44, "tp")
    assert not fits_group(12, cluster.pools[0].gpu, 44, "ep")   # not a whole number of nodes


@pytest.mark.slow
def test_deepseek_v3_fits_h100s_with_experts_spread_over_two_nodes():
    """673 GB of fp8 weights do not fit one node of 8 H100s (80 GB each); an expert-parallel
    FFN owner over two nodes holds them, beside data-parallel attention (TP 1 replicas, each
    with its own sequences' latent cache) on the third."""
    fe = run_front_end("deepseek-v3")
    cluster = parse_cluster("h100x24", load_catalog())
    space = PlanSpace(graph=fe.graph, blocks=fe.blocks, cluster=cluster, context=8192, tpot_slo_s=0.05)
    narrow = search(space, SearchOptions(templates="afd", batches=(256,), microbatches=(2,), tp_degrees=(1, 2, 4, 8)))
    assert narrow.best is None
    found = search(space, SearchOptions(templates="afd", batches=(256,), microbatches=(2,)))
    (attn, attn_replicas, _), ffn = [(o.tp, o.replicas, o.experts) for o in found.best.owners]
    # data-parallel attention on one node; the experts over 16 GPUs, their tokens all-reduced ("ep") or, now
    # cheaper over two nodes, dispatched to them all-to-all ("dp": each GPU's share of the rows)
    assert attn == 1 and 1 < attn_replicas <= 8 and ffn[:2] == (16, 1) and ffn[2] in ("ep", "dp")
    assert found.best.problem.stages[0].inter_node or found.best.problem.stages[1].inter_node


@pytest.mark.parametrize("family", ("qwen3_moe",))
@pytest.mark.slow
def test_wide_expert_group_generates_reference_tokens(tiny_checkpoint, tmp_path, family):
    """An expert-parallel FFN owner of 4 ranks on nodes of 2 (two whole nodes) on gloo CPU ranks
    generates transformers' tokens."""
    from hf_fixtures import hf_generate
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.pinned import pinned_plan
    from opweave.runtime.launch import RunConfig, run
    from opweave.runtime.scheduler import Request

    folder = tiny_checkpoint(family)
    catalog = load_catalog()
    catalog = {**catalog, "h100": dataclasses.replace(catalog["h100"], gpus_per_node=2)}
    cluster = parse_cluster("h100x6", catalog)
    compiled = pinned_plan(run_front_end(folder), cluster, "afd", [("h100", 1, 1), ("h100", 4, 1, "ep")],
                           batch=2, microbatches=2, context=32)
    assert compiled.plan.owners[1].gpus == ((2, 3, 4, 5),) and compiled.plan.stages[0].send_inter_node
    out = str(tmp_path / "art")
    write_artifact(out, compiled)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    outputs = run(RunConfig(artifact=out, weights=folder, device="cpu", timeout_s=300,
                            requests=tuple(Request(index=i, prompt=p, max_new_tokens=4) for i, p in enumerate(prompts))))
    assert [tuple(r.output) for r in outputs] == [tuple(hf_generate(folder, p, 4)[1]) for p in prompts]
