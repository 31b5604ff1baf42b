"""Data-parallel attention inside an expert-parallel group (owner layout "dp", searched by
default, `--no-attention-dp` leaves it out): each GPU of the group runs every op but the routed experts at TP 1 on its own
rows, the routed experts are spread over the GPUs. Its cost and memory terms, the pruned search
equal to exhaustive enumeration with it, the issue's DeepSeek-V3 setting, and such plans on CPU
ranks: each rank a TP 1 replica with its own rows, its routed experts the group's share, the
group's tokens gathered at each MoE layer; token-identical to transformers, memory as planned."""

import functools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.cost.memory import Footprint
from opweave.cost.model import CostModel, alltoall_s, dispatch_costs, dispatch_mode, hit_probability
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import Cluster, Pool
from opweave.ir.tp import EXPERT_KINDS, layout_choices, legal_tp
from opweave.models.hf_config import config_from_hf
from opweave.models.model import build_model
from opweave.passes.blocks import find_blocks
from opweave.passes.search import SearchOptions, search
from opweave.passes.space import PlanSpace
from opweave.passes.trace import build_graph
from test_search import gpu

TINY_MOE = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6, torch_dtype="bfloat16")


@functools.cache
def tiny():
    graph = build_graph(build_model(config_from_hf(TINY_MOE, "tiny-moe"), "meta"))
    return graph, find_blocks(graph)


def test_dp_is_searched_only_with_experts():
    assert layout_choices(True, 4) == ("tp", "ep")
    assert layout_choices(True, 4, attention_dp=True) == ("tp", "ep", "dp")
    assert layout_choices(False, 4, attention_dp=True) == ("tp",)
    assert layout_choices(True, 1, attention_dp=True) == ("tp",)


def test_dp_costs_each_op_on_its_rows_and_the_experts_over_the_group():
    graph, _ = tiny()
    h100 = load_catalog()["h100"]
    cm = CostModel()
    batch, tp, hidden = 64, 4, 256 * 2
    ops = graph.ops
    for i, op in enumerate(ops):
        following = ops[i + 1] if i + 1 < len(ops) else None
        got = cm.op_cost(op, h100, tp, batch, 512, hidden, following, "dp").total_s
        if op.kind in EXPERT_KINDS:  # as "ep", with the cheaper dispatch in place of the all-reduce
            ep = cm.op_cost(op, h100, tp, batch, 512, hidden, None, "ep")
            want = ep.compute_s + min(dispatch_costs(op, h100, tp, batch, hidden).values())
        else:  # at TP 1, a quarter of the rows, no collective
            want = cm.op_cost(op, h100, 1, batch // tp, 512, hidden, following, "tp").total_s
        assert got == pytest.approx(want), op.name
    # every op is legal: the experts divide by 4 and 16, the rest are whole on each GPU
    assert legal_tp(ops, 4, "dp") and legal_tp(ops, 16, "dp") and not legal_tp(ops, 3, "dp")


def test_hit_probability_matches_sampled_routings():
    import random
    rng = random.Random(0)
    for experts, held, k in ((16, 4, 2), (256, 16, 8), (128, 64, 8), (8, 8, 2)):
        hits = sum(any(e < held for e in rng.sample(range(experts), k)) for _ in range(20000)) / 20000
        assert hit_probability(experts, held, k) == pytest.approx(hits, abs=0.015)


def test_dispatch_modes_gather_at_small_groups_and_batches_all_to_all_beyond():
    """The all-to-all sends a token once to each GPU (and node) holding one of its experts, the
    gather moves every token to every GPU: the all-to-all wins where few of the group's GPUs hold
    a token's experts and the bytes outweigh its second launch."""
    graph, _ = tiny()  # 16 experts, top 2
    h200 = load_catalog()["h200"]
    op = next(o for o in graph.ops if o.kind in EXPERT_KINDS)
    hidden = 256 * 2
    assert dispatch_mode(op, h200, 2, 8, hidden) == "gather"
    assert dispatch_mode(op, h200, 16, 16 * 512, hidden) == "alltoall"
    for g in (2, 4, 8, 16):  # never more bytes than the gather: at a huge batch it is never slower
        costs = dispatch_costs(op, h200, g, 1 << 20, hidden)
        assert costs["alltoall"] <= costs["gather"] * 1.001, (g, costs)
    # over two nodes a token crosses the NICs once per node it needs, not once per GPU there
    two_nodes = alltoall_s(hidden, 512, 16, 2, 16, h200)
    assert two_nodes < 2 * alltoall_s(hidden, 512, 16, 2, 8, h200) + 1e-3


def test_dp_memory_holds_whole_attention_weights_and_a_share_of_the_rows():
    graph, _ = tiny()
    tp = 4
    dp = Footprint.of(graph.ops, tp, 512, 128, "dp")
    one = Footprint.of([op for op in graph.ops if op.kind not in EXPERT_KINDS], 1, 512, 128)
    experts = Footprint.of([op for op in graph.ops if op.kind in EXPERT_KINDS], tp, 512, 128, "ep")
    assert dp.weights == pytest.approx(one.weights + experts.weights)
    assert dp.per_slot == pytest.approx(one.per_slot / tp)  # its rows' KV alone
    sliced = Footprint.of(graph.ops, tp, 512, 128, "tp")
    assert dp.per_slot < sliced.per_slot  # 2 KV heads: TP 4 replicates them, dp does not


def _cluster(draw):
    weights = tiny()[0].weight_bytes

    def one(name):
        return gpu(name, bw=draw(st.floats(5e9, 5e10)), flops=draw(st.floats(1e11, 1e13)),
                   mem=weights * draw(st.floats(0.4, 2.0)), price=draw(st.floats(0.5, 5.0)),
                   link=draw(st.floats(1e9, 1e11)), node=draw(st.sampled_from([2, 4])))

    count = draw(st.sampled_from([4, 8]))
    return Cluster(pools=(Pool(gpu=one("fast"), count=count), Pool(gpu=one("cheap"), count=count)),
                   spec=f"fastx{count}+cheapx{count}")


@settings(max_examples=8, deadline=None)
@given(data=st.data(), slo_ms=st.floats(0.05, 2.0), context=st.sampled_from([256, 4096]))
@pytest.mark.slow
def test_pruned_search_with_dp_matches_exhaustive(data, slo_ms, context):
    graph, blocks = tiny()
    cluster = _cluster(data.draw)
    space = PlanSpace(graph=graph, blocks=blocks, cluster=cluster, context=context, tpot_slo_s=slo_ms / 1e3,
                      attention_dp=True)
    grid = dict(batches=(1, 8, 32), microbatches=(1, 2), tp_degrees=(1, 2, 4), replicas=(1, 2), max_owners=2,
                only_templates=("colocated", "afd"), attention_dp=True)
    exhaustive = search(space, SearchOptions(pareto=False, bnb=False, **grid))
    pruned = search(space, SearchOptions(**grid))
    if exhaustive.best is None:
        assert pruned.best is None
        return
    assert pruned.best is not None and pruned.best.cost == pytest.approx(exhaustive.best.cost, rel=1e-9)


def test_deepseek_v3_at_the_issues_setting_gains_from_dp(tmp_path, capsys):
    """DeepSeek-V3 on 16 H200, TPOT <= 50 ms: data-parallel attention over one 16-GPU expert
    group gives at least twice the tokens/s per GPU of the best plan without it (MLA's latent
    cache cannot split by heads: TP 8 replicates it, dp gives each GPU its own rows)."""
    import json

    from opweave.cli import main

    got = {}
    for flag in (["--no-attention-dp"], []):
        out = tmp_path / ("no" if flag else "dp")
        assert main(["compile", "deepseek-v3", "--cluster", "h200x16", "--tpot-slo", "50ms", "--context", "1536",
                     "-o", str(out), "--quiet", "--format", "json"] + flag) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["tpot_ms"] <= 50
        gpus = plan["replica_sets"] * sum(o["tp"] * o["replicas"] for o in plan["owners"])
        got[not flag] = (plan["tokens_per_s"] / gpus, plan)
    assert got[True][0] >= 2 * got[False][0], (got[True][0], got[False][0])
    assert any(o["experts"] == "dp" for o in got[True][1]["owners"])
    assert "(dp: attention data-parallel" in (tmp_path / "dp" / "plan.txt").read_text()
    assert math.isfinite(got[False][0])


def test_dp_prompt_tokens_spread_over_the_groups_gpus():
    """Under "dp" every GPU schedules its own rows: a round's prompt tokens are spread over the
    group for the ops it runs alone, and every token reaches the experts."""
    from opweave.cost.prefill import round_extra_s

    graph, _ = tiny()
    h100 = load_catalog()["h100"]
    tp, rows, tokens = 4, 64, 512
    got = round_extra_s(graph.ops, h100, tp, rows, 512, tokens, 1024, 512, "dp")
    cm = CostModel()

    def dispatch_gain(op, layout):  # the round's extra tokens through the group's dispatch (or all-reduce)
        return cm.collectives_s(op, h100, tp, rows + tokens, 512, None, layout) - cm.collectives_s(
            op, h100, tp, rows, 512, None, layout)

    want = sum(round_extra_s([op], h100, tp, rows, 512, tokens, 1024, 512, "ep") - dispatch_gain(op, "ep")
               + dispatch_gain(op, "dp") if op.kind in EXPERT_KINDS
               else round_extra_s([op], h100, 1, rows // tp, 512, tokens // tp, 1024, 512, "tp")
               for op in graph.ops)
    assert got == pytest.approx(want) and got > 0


@pytest.mark.slow
def test_deepseek_v3_under_traffic_gains_from_dp(tmp_path, capsys):
    """The issue's setting under its workload (ISL/OSL 1024/1024, TTFT <= 5 s, an fp8 KV cache as
    AIConfigurator's plan has): at least twice the tokens/s per GPU of `--no-attention-dp`, each
    GPU of the group prefilling its own rows' prompts beside its decoding rows."""
    import json

    from opweave.cli import main

    got = {}
    for flag in (["--no-attention-dp"], []):
        assert main(["compile", "deepseek-v3", "--cluster", "h200x16", "--tpot-slo", "50ms", "--isl", "1024",
                     "--osl", "1024", "--ttft-slo", "5s", "--kv-cache-dtype", "fp8", "-o", str(tmp_path / str(bool(flag))),
                     "--quiet", "--format", "json"] + flag) == 0
        plan = json.loads(capsys.readouterr().out)
        gpus = plan["replica_sets"] * sum(o["tp"] * o["replicas"] for o in plan["owners"]) + sum(
            o["tp"] * o["replicas"] for o in plan["prefill"].get("owners", []))
        assert plan["tpot_ms"] <= 50 and plan["ttft_ms"] <= 5000
        got[not flag] = plan["tokens_per_s"] / gpus
    assert got[True] >= 2 * got[False], got


# ---------------------------------------------------------------- on CPU ranks
PROMPTS = [[(7 * i + 3) % 100 for i in range(20)], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [42],
           [60, 61, 62, 63, 64, 65]]
RUN_TOKENS = 6


def _dp_artifact(folder: str, out: str, group: int, dispatch: str | None = None) -> str:
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.cluster import parse_cluster

    compiled = pinned_plan(run_front_end(folder), parse_cluster("h100x8+l40sx8", load_catalog()), "colocated",
                           [("h100", group, 1, "dp")], batch=2 * group, microbatches=2, context=64,
                           dispatch=dispatch)
    write_artifact(out, compiled)
    return out


@pytest.mark.parametrize("family,group,dispatch", [("qwen3_moe", 4, "gather"), ("deepseek_v3", 2, "alltoall"),
                                                   ("mixtral", 4, "alltoall"), ("gpt_oss", 2, "gather")])
@pytest.mark.slow
def test_a_dp_plan_generates_reference_tokens(tiny_checkpoint, tmp_path, monkeypatch, family, group, dispatch):
    """Each of the group's ranks schedules its own rows (its own KV pages) and holds E / G experts;
    decode rounds run under NoHostSync (the gathers' and all-to-alls' sizes come from the agreed
    layout), with either dispatch mode."""
    from hf_fixtures import hf_generate
    from opweave.runtime.launch import RunConfig, run_detailed
    from opweave.runtime.scheduler import Request

    folder = tiny_checkpoint(family)
    out = _dp_artifact(folder, str(tmp_path / "art"), group, dispatch)
    monkeypatch.setenv("OPWEAVE_CHECK_SYNC", "1")
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=RUN_TOKENS) for i, p in enumerate(PROMPTS))
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests,
                                            timeout_s=300))
    assert all(r.error is None for r in outputs)
    assert [tuple(r.output) for r in outputs] == [tuple(hf_generate(folder, p, RUN_TOKENS)[1]) for p in PROMPTS]
    assert len(stats["checked_rounds"]) == group and min(stats["checked_rounds"]) >= 1
    with open(f"{out}/rank_01.json") as f:
        assert __import__("json").load(f)["ep_dispatch"] == dispatch


def test_dp_ranks_allocate_their_planned_weights_and_state(tiny_checkpoint, tmp_path):
    """A dp rank holds every op but the routed experts whole, E / G experts and its own rows'
    state: what the plan counts (`opweave dump --what memory`)."""
    from opweave.ir.program import program_from_json
    from opweave.profile.allocated import artifact_memory

    out = _dp_artifact(tiny_checkpoint("qwen3_moe"), str(tmp_path / "art"), 4)
    ranks = artifact_memory(out, activations=False)
    assert len(ranks) == 4 and {r.tp for r in ranks} == {1}
    for r in ranks:
        for what in ("weights", "state"):
            assert getattr(r.allocated, what) == pytest.approx(getattr(r.planned, what), rel=0.01, abs=1), (r, what)
        assert r.kv_pages[0] == r.kv_pages[1] > 0
    with open(tmp_path / "art" / "rank_02.json") as f:
        program = program_from_json(__import__("json").load(f))
    assert program.experts == "dp" and program.ep_group == (0, 1, 2, 3) and program.ep_groups == ((0, 1, 2, 3),)
    assert program.scheduler and program.rows == program.ep_rows[2] and len(program.scheduler_leaders) == 4


class _ScaledExperts:
    """Experts [first, first + count) of 8, expert e scaling a token by e + 1 (the module's foreign
    ids: any id outside the block contributes nothing)."""

    def __init__(self, first: int, count: int):
        self.first_expert, self.num_local_experts = first, count

    def __call__(self, x, weights, ids):
        import torch
        held = (ids >= self.first_expert) & (ids < self.first_expert + self.num_local_experts)
        scale = torch.where(held, weights * (ids + 1), torch.zeros_like(weights)).sum(-1, keepdim=True)
        return x * scale


class _SlotExperts:
    """As `_ScaledExperts`, holding the experts `slots` names and taking slot ids (the sentinel,
    len(slots), contributes nothing)."""

    def __init__(self, slots):
        self.slots = slots

    def __call__(self, x, weights, ids):
        import torch
        table = torch.tensor(list(self.slots) + [-1])
        expert = table[ids]
        scale = torch.where(expert >= 0, weights * (expert + 1), torch.zeros_like(weights)).sum(-1, keepdim=True)
        return x * scale


def _dispatch_member(rank: int, world: int, port: int, queue) -> None:
    import os
    import torch
    import torch.distributed as dist
    from opweave.runtime.dpexperts import DispatchExperts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    class NoAllToAll:  # a backend without all-to-all: the point-to-point emulation runs
        def __getattr__(self, name):
            if name == "all_to_all":
                raise AttributeError(name)
            return getattr(dist, name)

    sizes = [3, 1, 2, 1]
    members = tuple((sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(world))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, n, 4, generator=g) for n in sizes]
    ids = [torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])[None] for n in sizes]
    ws = [torch.rand(1, n, 2, generator=g) for n in sizes]
    from opweave.ir.experts import placement
    from opweave.runtime.dpexperts import ExpertCopies

    slots = placement([0.3, 0.2] + [0.5 / 6] * 6, world, 1)   # one copy per GPU of the hottest experts
    results = []
    for comm in (dist, NoAllToAll()):
        for nodes in (1, 2):   # two nodes of two: the two-hop exchange
            op = DispatchExperts(_ScaledExperts(rank * 2, 2), None, members, rank, lambda: [1] * 7,
                                 tuple(range(world)), comm, nodes=nodes)
            results.append(op(xs[rank], ws[rank], ids[rank]))
            op = DispatchExperts(_SlotExperts(slots[rank]), None, members, rank, lambda: [1] * 7,
                                 tuple(range(world)), comm, ExpertCopies(slots, 8, rank), nodes=nodes)
            results.append(op(xs[rank], ws[rank], ids[rank]))
    expected = _ScaledExperts(0, 8)(xs[rank], ws[rank], ids[rank])
    queue.put((rank, [bool(torch.allclose(r, expected, atol=1e-6)) for r in results]))
    dist.destroy_process_group()


def test_dispatch_and_combine_over_all_to_all_and_point_to_point():
    """Each member sends its tokens with only the receiver's pairs, runs its own experts on what it
    receives, and sums the partial outputs sent back: the whole model's sum, over gloo's
    all-to-all and over its emulation by point-to-point sends, in one hop or two (two nodes of
    two: once to each other node, then forwarded inside it), with and without copies of experts."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dispatch_member, args=(r, 4, port, queue)) for r in range(4)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {r: [True] * 8 for r in range(4)}
