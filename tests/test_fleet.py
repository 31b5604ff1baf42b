"""Fleets: further plans on the GPUs the first leaves idle, with the idle GPUs accounted for."""

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.hardware.cluster import Cluster, Pool
from opweave.passes.fleet import _leftover, format_fleet, fleet_to_json, plan_fleet
from opweave.passes.placement import Group, place
from opweave.passes.search import SearchOptions
from opweave.passes.space import PlanSpace

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_search import SMALL, gpu, tiny  # noqa: E402


def _space(cluster, slo=1.0, context=2048):
    graph, blocks = tiny()
    return PlanSpace(graph=graph, blocks=blocks, cluster=cluster, context=context, tpot_slo_s=slo)


def test_second_member_takes_the_pool_the_first_leaves():
    graph, _ = tiny()
    cheap = gpu("cheap", 2e10, 1e12, graph.weight_bytes * 4, 0.5)
    dear = gpu("dear", 2e10, 1e12, graph.weight_bytes * 4, 5.0)      # same speed, 10x the price
    cluster = Cluster(pools=(Pool(gpu=dear, count=4), Pool(gpu=cheap, count=4)), spec="dearx4+cheapx4")
    options = SearchOptions(only_templates=("colocated",), **SMALL)
    fleet = plan_fleet(_space(cluster), options)
    assert len(fleet.members) == 2
    first, second = fleet.members
    assert set(first.gpus) == {"cheap"} and set(second.gpus) == {"dear"}
    assert second.cluster.canonical_spec == "dearx4"
    assert first.best.cost < second.best.cost
    used = sum(n for m in fleet.members for n in m.gpus.values())
    assert used + sum(fleet.idle.values()) == cluster.total_gpus
    assert fleet.tokens_per_s == first.tokens_per_s + second.tokens_per_s
    text = format_fleet(fleet)
    assert "dearx4" in text and "idle GPUs" in text
    assert fleet_to_json(fleet)["members"][1]["cluster"] == "dearx4"


def test_leftover_counts_whole_nodes_and_the_largest_piece():
    graph, _ = tiny()
    g = gpu("g", 2e10, 1e12, graph.weight_bytes * 4, 1.0, node=8)
    # sets of tp2 + tp4 on nodes of 8, 8, 4: set 0 fills node 0's first 6, set 1 takes node 0's last 2 and
    # node 1's first 4, set 2 node 1's next 2 and all of node 2; set 3 finds no 4 free in one node
    cluster = Cluster(pools=(Pool(gpu=g, count=20),), spec="gx20")
    where = place((Group(gpu="g", tp=2, replicas=1), Group(gpu="g", tp=4, replicas=1)), cluster)
    assert where.num_sets == 3 and where.idle == ((14, 16),)
    assert _leftover(cluster, where) == ({"g": 2}, {"g": 0})
    # one replica of tp4 per set on nodes of 8 and 6: node 0 holds 2 sets, node 1 one set and 2 idle
    six = Cluster(pools=(Pool(gpu=gpu("g", 2e10, 1e12, 1e9, 1.0, node=8), count=14),), spec="gx14")
    where = place((Group(gpu="g", tp=4, replicas=1),), six)
    assert where.num_sets == 3 and _leftover(six, where) == ({"g": 2}, {"g": 0})
    # sets of 3 x tp4 on 3 nodes of 8: 2 sets take all 24 GPUs, nothing is left
    wide = Cluster(pools=(Pool(gpu=gpu("g", 2e10, 1e12, 1e9, 1.0, node=8), count=24),), spec="gx24")
    where = place((Group(gpu="g", tp=4, replicas=3),), wide)
    assert where.num_sets == 2 and _leftover(wide, where) == ({"g": 0}, {"g": 0})


@settings(max_examples=8, deadline=None)
@given(counts=st.tuples(st.integers(1, 12), st.integers(1, 12)), prices=st.tuples(st.floats(0.5, 5), st.floats(0.5, 5)))
def test_fleet_never_uses_more_gpus_than_the_cluster(counts, prices):
    graph, _ = tiny()
    a = gpu("a", 2e10, 1e12, graph.weight_bytes * 2, prices[0], node=4)
    b = gpu("b", 1e10, 4e12, graph.weight_bytes * 2, prices[1], node=8)
    cluster = Cluster(pools=(Pool(gpu=a, count=counts[0]), Pool(gpu=b, count=counts[1])), spec="x")
    fleet = plan_fleet(_space(cluster), SearchOptions(only_templates=("colocated", "afd"), **SMALL))
    for name, total in (("a", counts[0]), ("b", counts[1])):
        used = sum(m.gpus.get(name, 0) for m in fleet.members)
        assert used + fleet.idle.get(name, 0) == total
