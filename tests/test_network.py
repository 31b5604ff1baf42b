"""The network model: a transfer costs what both ends can move (fan-out, fan-in), inside a node only
where placement puts every pair of replicas that exchange rows in one node, and the planner's
simulated boundaries agree with `place()` (and with the lowered program's transfers)."""

import json
import math
import os

import pytest

from opweave.cost import model as C
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.passes.placement import Group, place, transfer_locality

CATALOG = load_catalog()
H100, A100 = CATALOG["h100"], CATALOG["a100"]


def test_fan_out_is_limited_by_the_sender_and_each_receiver_separately():
    """1 H100 replica feeding 8 A100 replicas: the H100 pushes all rows through its NIC, each A100
    takes an eighth through its own; the step is the slower of the two, not all rows through the
    slower NIC."""
    per_token, rows = 8192, 64
    got = C.boundary_s(per_token, H100, rows, A100, rows // 8, 1, inter_node=True)
    send = per_token * rows / (H100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)
    recv = per_token * rows / 8 / (A100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)
    latency = max(H100.inter_link_latency, A100.inter_link_latency)
    assert got == pytest.approx(latency + max(send, recv))
    old = latency + per_token * rows / (min(H100.inter_link_bandwidth, A100.inter_link_bandwidth)
                                        * C.INTER_LINK_EFFICIENCY)
    assert got < old  # all rows through the slower NIC: what fan-out does not do


def test_fan_in_is_limited_by_the_receiver_taking_every_sender_rows():
    """8 A100 replicas feeding 1 H100 replica: each sends an eighth, the H100 receives all of them."""
    per_token, rows = 8192, 64
    got = C.boundary_s(per_token, A100, rows // 8, H100, rows, 1, inter_node=True)
    recv = per_token * rows / (H100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)
    send = per_token * rows / 8 / (A100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)
    assert got == pytest.approx(max(H100.inter_link_latency, A100.inter_link_latency) + max(send, recv))
    # the receiver's whole share counts: more than one sender's piece over the receiver's link
    assert got > per_token * rows / 8 / (H100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)


def test_receiver_tp_fans_out_inside_its_node():
    plain = C.boundary_s(4096, H100, 16, H100, 16, 1, inter_node=False)
    fanned = C.boundary_s(4096, H100, 16, H100, 16, 4, inter_node=False)
    assert fanned == pytest.approx(plain + H100.intra_link_latency + 4096 * 16 / C.intra_bandwidth(H100))


def test_intra_node_is_cheaper_and_types_never_share_a_node():
    assert C.transfer_s(1e6, H100, H100, inter_node=False) < C.transfer_s(1e6, H100, H100, inter_node=True)
    assert C.transfer_s(1e6, H100, A100, inter_node=False) == C.transfer_s(1e6, H100, A100, inter_node=True)
    assert C.transfer_s(0, H100, H100, inter_node=True) == 0.0


def _local(spec, groups, rows):
    cluster = parse_cluster(spec, CATALOG)
    return transfer_locality(place(tuple(groups), cluster), cluster, rows)


def test_locality_follows_placement():
    two_tp4 = [Group(gpu="h100", tp=4, replicas=1), Group(gpu="h100", tp=4, replicas=1)]
    assert _local("h100x8", two_tp4, 8) == {(0, 1): True, (1, 0): True}
    assert _local("h100x64", two_tp4, 8) == {(0, 1): True, (1, 0): True}   # every set fills one node
    # 6 GPUs per set on 8-GPU nodes: set 1's TP4 group lands on the next node
    six = [Group(gpu="h100", tp=2, replicas=1), Group(gpu="h100", tp=4, replicas=1)]
    assert _local("h100x16", six, 8)[(0, 1)] is False
    assert _local("h100x8", six, 8)[(0, 1)] is True                        # one set only: inside node 0
    mixed = [Group(gpu="h100", tp=1, replicas=1), Group(gpu="a100", tp=1, replicas=8)]
    assert _local("h100x8+a100x8", mixed, 8) == {(0, 1): False, (1, 0): False}


def test_locality_looks_only_at_replicas_that_exchange_rows():
    """Replicas of two owners matched row for row (2 and 2) each sit with their partner even
    when the owners as a whole span two nodes."""
    groups = [Group(gpu="h100", tp=4, replicas=2), Group(gpu="h100", tp=4, replicas=2)]
    # set 0: owner 0's replicas take node 0, owner 1's node 1: partners on different nodes
    assert _local("h100x16", groups, 8)[(0, 1)] is False
    small = [Group(gpu="h100", tp=2, replicas=2), Group(gpu="h100", tp=2, replicas=2)]
    assert _local("h100x8", small, 8)[(0, 1)] is True


# ---------------------------------------------------------------- placement and cost agree, through the lowering


def lowered_crossings(compiled, cluster) -> tuple[dict[int, bool], bool]:
    """What the deployed plan really does: per stage that sends, whether any of its sends in any
    replica set crosses nodes, and the same for the token ids' return; from the lowered rank
    programs (ports and peers) and every replica set `place()` puts on the cluster."""
    from opweave.compiler.steps import rank_programs
    from opweave.passes.lower import rank_layout
    from opweave.passes.placement import simulated_sets

    plan = compiled.plan
    groups = tuple(Group(gpu=o.gpu, tp=o.tp, replicas=o.replicas) for o in plan.owners)
    where = place(groups, cluster)
    programs = rank_programs(plan, compiled.source, compiled.graph, compiled.blocks, "0" * 64)
    layout = rank_layout(plan)
    sends: dict[int, bool] = {}
    ret = False
    for k in simulated_sets(where):
        gpus = where.replica_set(k)

        def node(rank):
            o, j, t = layout[rank]
            return cluster.locate(gpus[o][j][t]).node_index

        for prog in programs:
            for sp in prog.stages:
                if sp.send is not None:
                    crossed = any(node(prog.rank) != node(p.rank) for p in sp.send.peers)
                    sends[sp.stage] = sends.get(sp.stage, False) or crossed
                ret = ret or any(node(prog.rank) != node(p.rank) for p in sp.returns)
    return sends, ret


def assert_placement_agrees(compiled, cluster):
    plan = compiled.plan
    sends, ret = lowered_crossings(compiled, cluster)
    for s in plan.stages:
        if s.index in sends:
            assert s.send_s > 0, f"stage {s.index} sends at run time but is charged no transfer"
            assert s.send_inter_node == sends[s.index], (s.index, s.send_inter_node, sends[s.index])
        else:
            assert s.send_s == 0, f"stage {s.index} is charged a transfer the runtime does not make"
    if plan.return_s > 0:
        assert plan.return_inter_node == ret


@pytest.mark.parametrize("spec,owners,template", [
    ("h100x8", [("h100", 4, 1), ("h100", 4, 1)], "afd"),                 # one node: every hop inside it
    ("h100x16", [("h100", 2, 1), ("h100", 4, 1)], "afd"),                # 6 GPUs per set: set 1 straddles
    ("h100x16", [("h100", 1, 2), ("h100", 2, 2)], "cad"),                # 6 per set, replicas matched
    ("h100x16+a100x16", [("a100", 2, 4), ("h100", 1, 1)], "afd"),        # two types: always between nodes
    ("h100x24", [("h100", 2, 1), ("h100", 1, 4), ("h100", 2, 1)], "F:pre_attn+post_attn+mid"),
])
@pytest.mark.slow
def test_place_and_cost_agree_on_hand_plans(spec, owners, template):
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan

    fe = run_front_end("llama-3.1-8b")
    cluster = parse_cluster(spec, CATALOG)
    compiled = pinned_plan(fe, cluster, template, owners, batch=16, microbatches=2, context=8192)
    assert_placement_agrees(compiled, cluster)


PAPER_PLANS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "bench", "results", "paper_eval_plans.json")


@pytest.mark.slow
def test_place_and_cost_agree_on_every_plan_of_the_paper_grid():
    """Every plan bench/paper_eval.py found (OpWeave and the baselines, every setting of the §7 grid):
    replayed on its cluster, lowered, and each boundary's transfers compared with what the plan
    charges (intra- or inter-node)."""
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan

    with open(PAPER_PLANS, encoding="utf-8") as f:
        plans = json.load(f)
    assert len(plans) >= 36
    split = [p for p in plans if len(p["owners"]) > 1]   # one owner: no boundary to place
    assert len(split) >= 36
    models = {}
    flags = set()
    for p in split:
        model = p["model"]
        if model not in models:
            models[model] = run_front_end(model)
        cluster = parse_cluster(p["cluster"], CATALOG)
        compiled = pinned_plan(models[model], cluster, p["template"], [tuple(o) for o in p["owners"]],
                               batch=p["batch"], microbatches=p["microbatches"], context=p["context"])
        assert compiled.plan.predicted.cost_per_mtok_usd == pytest.approx(p["cost_per_mtok_usd"], rel=1e-9)
        assert_placement_agrees(compiled, cluster)
        flags |= {s.send_inter_node for s in compiled.plan.stages if s.send_s > 0}
    assert flags == {True, False}   # the grid has boundaries inside nodes and between them