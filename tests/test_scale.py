"""Scale: cluster parsing and placement cost does not grow with the number of GPUs, absurd counts
are refused in one line, and placement matches the per-GPU first fit it replaced (brute force on
seeded random small clusters, and hand-computed cases)."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.cli import main
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import MAX_CLUSTER_GPUS, Cluster, Pool, parse_cluster
from opweave.passes.placement import Group, place

CATALOG = load_catalog()


def reference_place(groups, cluster):
    """The per-GPU first fit placement used to be: one free list per node, copied per replica set;
    a group larger than a node (whole nodes) takes the first run of full, untouched nodes after
    every node any group has taken from. Returns (sets, gpus[set][group][replica] -> indices,
    idle indices)."""
    free, per_node = {}, {}
    for g in cluster.physical_gpus():
        nodes = free.setdefault(g.gpu_name, [])
        while len(nodes) <= g.node_index:
            nodes.append([])
        nodes[g.node_index].append(g.global_index)
    for p in cluster.pools:
        per_node[p.gpu.name] = p.gpu.gpus_per_node
    touched = {name: -1 for name in free}
    sets = []
    while True:
        trial = {name: [list(n) for n in nodes] for name, nodes in free.items()}
        reach = dict(touched)
        taken = []
        for o in groups:
            replicas = []
            for _ in range(o.replicas):
                nodes = trial.get(o.gpu, [])
                got = None
                if o.tp > per_node[o.gpu]:
                    need = o.tp // per_node[o.gpu]
                    if o.tp % per_node[o.gpu] == 0:
                        start = next((s for s in range(reach[o.gpu] + 1, len(nodes) - need + 1)
                                      if all(len(nodes[s + i]) == per_node[o.gpu] for i in range(need))), None)
                        if start is not None:
                            got = tuple(x for i in range(need) for x in nodes[start + i])
                            for i in range(need):
                                nodes[start + i].clear()
                            reach[o.gpu] = start + need - 1
                else:
                    index = next((i for i, n in enumerate(nodes) if len(n) >= o.tp), None)
                    if index is not None:
                        got = tuple(nodes[index][:o.tp])
                        del nodes[index][:o.tp]
                        reach[o.gpu] = max(reach[o.gpu], index)
                if got is None:
                    idle = sorted(i for nodes in free.values() for n in nodes for i in n)
                    return len(sets), sets, idle
                replicas.append(got)
            taken.append(tuple(replicas))
        free, touched = trial, reach
        sets.append(tuple(taken))


def assert_same_as_reference(groups, cluster):
    fast = place(groups, cluster)
    num_sets, sets, idle = reference_place(groups, cluster)
    assert fast.num_sets == num_sets
    assert [fast.replica_set(k) for k in range(num_sets)] == sets
    assert [i for lo, hi in fast.idle for i in range(lo, hi)] == idle
    assert fast.num_idle + num_sets * fast.gpus_per_set == cluster.total_gpus
    return fast


def _cluster(pools):
    """pools: [(catalog name, count, gpus_per_node)] -> Cluster (node size overridden per pool)."""
    return Cluster(pools=tuple(Pool(gpu=dataclasses.replace(CATALOG[name], gpus_per_node=per_node), count=count)
                               for name, count, per_node in pools), spec="test")


@st.composite
def instances(draw):
    names = draw(st.lists(st.sampled_from(["h100", "l40s", "a100"]), min_size=1, max_size=3, unique=True))
    pools = [(n, draw(st.integers(1, 150)), draw(st.integers(1, 8))) for n in names]
    groups = tuple(Group(gpu=draw(st.sampled_from(names)), tp=draw(st.sampled_from([1, 2, 3, 4, 8])),
                         replicas=draw(st.integers(1, 4))) for _ in range(draw(st.integers(1, 3))))
    return _cluster(pools), groups


@settings(max_examples=300, deadline=None, derandomize=True)
@given(instances())
@pytest.mark.slow
def test_placement_matches_the_per_gpu_first_fit(instance):
    cluster, groups = instance
    assert_same_as_reference(groups, cluster)


@pytest.mark.parametrize("spec, groups", [
    ("h100x300", [("h100", 2, 3)]),
    ("h100x403+l40sx297", [("h100", 4, 1), ("l40s", 2, 3), ("h100", 1, 3)]),
    ("h100x1000+l40sx640", [("l40s", 8, 1), ("h100", 1, 5), ("h100", 2, 2)]),
])
def test_long_pools_repeat_and_still_match(spec, groups):
    """Clusters long enough for the periodic jump (module docstring of passes/placement.py)."""
    fast = assert_same_as_reference(tuple(Group(gpu=g, tp=t, replicas=r) for g, t, r in groups),
                                    parse_cluster(spec, CATALOG))
    assert fast.jump is not None and fast.jump.repeats > 0 and len(fast.placed) < fast.num_sets


def test_hand_computed_placements():
    # 3 pairs per set on nodes of 8: set 1 finishes node 0 and starts node 1; 4 GPUs left over.
    p = place((Group(gpu="h100", tp=2, replicas=3),), parse_cluster("h100x16", CATALOG))
    assert p.num_sets == 2 and p.idle == ((12, 16),)
    assert p.replica_set(0) == (((0, 1), (2, 3), (4, 5)),) and p.replica_set(1) == (((6, 7), (8, 9), (10, 11)),)
    # nodes of 8 + 4: set 0 = TP4 on node 0 and two singles after it; set 1's TP4 needs node 1,
    # its singles fill node 0; a third TP4 has no node.
    p = place((Group(gpu="h100", tp=4, replicas=1), Group(gpu="h100", tp=1, replicas=2)),
              parse_cluster("h100x12", CATALOG))
    assert [p.replica_set(k) for k in range(p.num_sets)] == [(((0, 1, 2, 3),), ((4,), (5,))),
                                                             (((8, 9, 10, 11),), ((6,), (7,)))]
    assert p.idle == ()
    # an unused pool is idle as a whole; the used one keeps its partial node's rest
    p = place((Group(gpu="l40s", tp=2, replicas=1),), parse_cluster("h100x8+l40sx5", CATALOG))
    assert p.num_sets == 2 and p.replica_set(1) == (((10, 11),),) and p.idle == ((0, 8), (12, 13))


def _calls(fn):
    """(fn(), the number of function calls it made): the work done, counted by cProfile. Unlike a
    wall-clock bound it does not depend on how loaded the machine is; a per-GPU loop over a
    million GPUs makes millions of calls."""
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        out = fn()
    finally:
        profile.disable()
    return out, sum(entry.callcount for entry in profile.getstats())


def test_a_million_gpus_parse_and_place_fast():
    _, calls = _calls(_parse_and_place_a_million_gpus)
    assert calls < 30_000, calls  # about 3,000; the per-GPU version made a call per GPU or more


def _parse_and_place_a_million_gpus():
    cluster = parse_cluster("h100x1000000", CATALOG)
    mixed = parse_cluster("h100x999999+l40sx9000000", CATALOG)
    for c, groups in ((cluster, (Group(gpu="h100", tp=2, replicas=3),)),
                      (cluster, (Group(gpu="h100", tp=1, replicas=8), Group(gpu="h100", tp=2, replicas=1))),
                      (mixed, (Group(gpu="h100", tp=4, replicas=1), Group(gpu="l40s", tp=2, replicas=3),
                               Group(gpu="h100", tp=1, replicas=3)))):
        p = place(groups, c)
        assert p.num_idle + p.num_sets * p.gpus_per_set == c.total_gpus
        last = [g for group in p.replica_set(p.num_sets - 1) for r in group for g in r]
        assert len(set(last)) == p.gpus_per_set and all(0 <= g < c.total_gpus for g in last)
    assert cluster.locate(999_999).node_index == 124_999 and cluster.num_nodes == 125_000


@pytest.mark.parametrize("spec", ["h100x100000000000000", "h100x" + "9" * 5000, f"h100x{MAX_CLUSTER_GPUS + 1}",
                                  f"h100x{MAX_CLUSTER_GPUS // 2 + 1}+l40sx{MAX_CLUSTER_GPUS // 2}"])
def test_absurd_counts_are_refused_in_one_line(spec):
    def refuse():
        with pytest.raises(OpWeaveError, match="10,000,000") as info:
            parse_cluster(spec, CATALOG)
        return info

    info, calls = _calls(refuse)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300
    assert calls < 1_000, calls  # refused before any per-GPU work (about 40-120 calls)
    assert parse_cluster(f"h100x{MAX_CLUSTER_GPUS}", CATALOG).total_gpus == MAX_CLUSTER_GPUS


def test_absurd_counts_in_a_cluster_file_and_the_cli(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"pools": [{"gpu": "h100", "count": 10 ** 30}]}))
    with pytest.raises(OpWeaveError, match="more than the 10,000,000"):
        parse_cluster(str(path), CATALOG)
    code = main(["compile", "llama-3.1-8b", "--cluster", "h100x100000000000000", "--tpot-slo", "50ms",
                 "--context", "8k", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("opweave: error:") and err.count("\n") == 1 and "10,000,000" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_million_gpu_plan_compiles_in_the_time_of_an_eight_gpu_one():
    from opweave.compiler.compile import compile_model
    from opweave.ir.plan import plan_from_json, plan_to_json

    calls, plans = {}, {}
    for spec in ("h100x8", "h100x1000000"):
        compiled, calls[spec] = _calls(lambda: compile_model("llama-3.1-8b", parse_cluster(spec, CATALOG), 0.05, 8192))
        plans[spec] = compiled.plan
    big = plans["h100x1000000"]
    assert big.gpus_used + big.num_idle_gpus == 1_000_000 and big.replica_sets > 10_000
    text = json.dumps(plan_to_json(big), indent=1)
    assert len(text) < 100_000 and plan_from_json(json.loads(text)) == big  # set 0's GPUs, idle as runs
    assert calls["h100x1000000"] < 3 * calls["h100x8"], calls  # the same work, not a million times it (~1.7x)
    # a format-1 plan (every set's GPUs, idle GPUs one by one) still reads, as set 0 and runs
    small = plan_to_json(plans["h100x8"])
    old = {**small, "format": "opweave-plan/1", "idle_gpus": [g for lo, hi in small["idle_gpus"] for g in range(lo, hi)],
           "owners": [{**o, "gpus": [o["gpus"], [[90 + i] for i in range(len(o["gpus"]))]]} for o in small["owners"]]}
    assert plan_from_json(old) == plans["h100x8"]
