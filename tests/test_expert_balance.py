"""Balanced experts (`opweave.ir.experts`): placement with redundant copies, the busiest GPU's
share of measured routing in the cost model, their memory, the search over the copies per GPU,
and `opweave profile --routing` measuring a checkpoint's expert load."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.cost.memory import Footprint
from opweave.cost.model import CostModel
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog
from opweave.ir.experts import ExpertLoad, busiest_share, copies_of, placement
from opweave.ir.tp import EXPERT_KINDS
from test_attention_dp import tiny


@settings(max_examples=60, deadline=None)
@given(ranks=st.sampled_from([1, 2, 4, 8]), per=st.integers(1, 6), redundant=st.integers(0, 3),
       seed=st.integers(0, 1000))
def test_placement_holds_every_expert_in_equal_slots(ranks, per, redundant, seed):
    import random
    experts = ranks * per
    redundant = min(redundant, experts - per)
    rng = random.Random(seed)
    shares = [rng.random() ** 3 for _ in range(experts)]
    where = placement(shares, ranks, redundant)
    assert len(where) == ranks and all(len(h) == per + redundant for h in where)
    assert all(len(set(h)) == len(h) for h in where)           # never two copies on one GPU
    copies = copies_of(where, experts)
    assert all(len(c) >= 1 for c in copies) and sum(len(c) for c in copies) == ranks * (per + redundant)
    assert busiest_share(shares, where) >= 1 - 1e-9
    if redundant == 0:
        assert where == tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ranks))


def test_copies_of_the_hot_experts_balance_a_skewed_load():
    shares = [0.4, 0.2] + [0.4 / 14] * 14       # two hot experts of 16
    uniform = [1 / 16] * 16
    assert busiest_share(uniform, placement(uniform, 4, 0)) == pytest.approx(1.0)
    assert busiest_share(uniform, placement(uniform, 4, 1)) == pytest.approx(1.0)
    skew = [busiest_share(shares, placement(shares, 4, r)) for r in (0, 1, 2)]
    assert skew[0] > 2.0 and skew[1] < skew[0] and skew[2] <= skew[1] and skew[2] < 1.5, skew


def _skewed(graph):
    op = next(o for o in graph.ops if o.kind in EXPERT_KINDS)
    e = op.weights[0].shape[0]
    counts = tuple(100 if i < 2 else 5 for i in range(e))
    return ExpertLoad(model="tiny", counts={o.layer: counts for o in graph.ops if o.kind in EXPERT_KINDS}), op


def test_cost_charges_the_busiest_gpu_of_a_measured_load_and_copies_relieve_it():
    graph, _ = tiny()
    load, op = _skewed(graph)
    h100 = load_catalog()["h100"]
    batch = 4096  # many pairs per expert: the math of the busiest GPU sets the time

    def cost(**kw):
        return CostModel(**kw).op_cost(op, h100, 4, batch, 512, 512, None, "ep").math_s

    assert cost(expert_load=load) > 2 * cost()
    assert cost(expert_load=load, redundant_experts=2) < cost(expert_load=load)
    reads, pairs = CostModel(redundant_experts=1).balance(op, 4, "ep")
    assert (reads, pairs) == (pytest.approx(5 / 4), pytest.approx(1.0))  # 4 + 1 experts read, uniform pairs
    assert CostModel(expert_load=load).balance(op, 4, "tp") == (1.0, 1.0)


def test_copies_count_in_memory():
    graph, _ = tiny()
    ops = [o for o in graph.ops if o.kind in EXPERT_KINDS]
    base = Footprint.of(ops, 4, 512, layout="ep").weights
    one = Footprint.of(ops, 4, 512, layout="ep", redundant=1).weights
    per_expert = sum(w.nbytes / w.shape[0] for o in ops for w in o.weights)
    assert one - base == pytest.approx(per_expert)
    assert Footprint.of(ops, 4, 512, layout="dp", redundant=1).weights == pytest.approx(one)


@settings(max_examples=6, deadline=None)
@given(data=st.data(), slo_ms=st.floats(0.05, 2.0), redundant=st.sampled_from([1, 2]))
def test_pruned_search_with_copies_matches_exhaustive(data, slo_ms, redundant):
    from opweave.passes.search import SearchOptions, search
    from opweave.passes.space import PlanSpace
    from test_attention_dp import _cluster

    graph, blocks = tiny()
    load, _ = _skewed(graph)
    cm = CostModel(expert_load=load, redundant_experts=redundant)
    space = PlanSpace(graph=graph, blocks=blocks, cluster=_cluster(data.draw), context=512,
                      tpot_slo_s=slo_ms / 1e3, cost_model=cm, attention_dp=True)
    grid = dict(batches=(1, 8, 32), microbatches=(1, 2), tp_degrees=(1, 2, 4), replicas=(1, 2), max_owners=2,
                only_templates=("colocated", "afd"), attention_dp=True)
    exhaustive = search(space, SearchOptions(pareto=False, bnb=False, **grid))
    pruned = search(space, SearchOptions(**grid))
    assert (pruned.best is None) == (exhaustive.best is None)
    if exhaustive.best is not None:
        assert pruned.best.cost == pytest.approx(exhaustive.best.cost, rel=1e-9)


def test_expert_load_files_are_checked(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "x"}))
    with pytest.raises(OpWeaveError, match="not an expert-load file"):
        ExpertLoad.load(str(bad))
    bad.write_text(json.dumps({"format": "opweave-expert-load-1", "counts": {"0": [1, -2]}}))
    with pytest.raises(OpWeaveError, match="negative"):
        ExpertLoad.load(str(bad))
    with pytest.raises(OpWeaveError, match="divide"):
        placement([0.5, 0.5, 0.0], 2, 0)


@pytest.mark.slow
def test_profile_routing_then_compile_with_copies(tiny_checkpoint, tmp_path, capsys):
    """`opweave profile --routing` counts the checkpoint's routed pairs; `compile --expert-load
    --redundant-experts 0,1` plans with them, and a plan holding copies is refused at run time."""
    from opweave.cli import main

    folder = tiny_checkpoint("qwen3_moe")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [(5 * i + j) % 90 + 1 for j in range(12)]}) + "\n"
                               for i in range(6)))
    load_path = tmp_path / "load.json"
    assert main(["profile", "--model", folder, "--routing", str(prompts), "-o", str(load_path), "--quiet"]) == 0
    load = ExpertLoad.load(str(load_path))
    cfg = json.load(open(f"{folder}/config.json"))
    assert len(load.counts) == cfg["num_hidden_layers"] and load.tokens == 6 * 13
    assert all(sum(c) == load.tokens * cfg["num_experts_per_tok"] for c in load.counts.values())
    out = tmp_path / "art"
    assert main(["compile", folder, "--cluster", "h100x8", "--tpot-slo", "50ms", "--context", "256",
                 "--expert-load", str(load_path), "--redundant-experts", "0,1", "-o", str(out), "--quiet"]) == 0
    plan = json.load(open(out / "plan.json"))
    assert plan["redundant_experts"] in (0, 1)
    assert main(["compile", folder, "--cluster", "h100x8", "--tpot-slo", "50ms", "--context", "256",
                 "--redundant-experts", "x", "-o", str(tmp_path / "b"), "--quiet"]) == 2
    assert "--redundant-experts must list" in capsys.readouterr().err


# ---------------------------------------------------------------- copies on CPU ranks
PROMPTS = [[(7 * i + 3) % 100 for i in range(20)], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11], [42]]
RUN_TOKENS = 5


def _copies_artifact(folder: str, out: str, owner: tuple, dispatch: str | None, per_node: int = 8) -> str:
    """A pinned plan whose expert group keeps one copy per GPU of the hottest experts of a skewed
    load (experts 0 and 1 take most pairs), so copies run pairs on several GPUs; nodes of
    `per_node` H100s."""
    import dataclasses
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.cluster import parse_cluster

    fe = run_front_end(folder)
    experts = json.load(open(f"{folder}/config.json")).get("num_experts") or 8
    counts = tuple(100 if e < 2 else 5 for e in range(experts))
    load = ExpertLoad(model="tiny", counts={op.layer: counts for op in fe.graph.ops if op.kind in EXPERT_KINDS})
    catalog = load_catalog()
    catalog["h100"] = dataclasses.replace(catalog["h100"], gpus_per_node=per_node)
    compiled = pinned_plan(fe, parse_cluster("h100x8", catalog), "colocated", [owner],
                           batch=2 * owner[1], microbatches=2, context=64,
                           cost_model=CostModel(expert_load=load, redundant_experts=1), dispatch=dispatch)
    write_artifact(out, compiled)
    return out


@pytest.mark.parametrize("family,owner,dispatch,per_node", [
    ("qwen3_moe", ("h100", 4, 1, "dp"), "alltoall", 2), ("deepseek_v3", ("h100", 2, 1, "dp"), "gather", 8),
    ("mixtral", ("h100", 2, 1, "ep"), None, 8)])
@pytest.mark.slow
def test_a_plan_with_copies_generates_reference_tokens(tiny_checkpoint, tmp_path, monkeypatch, family, owner,
                                                      dispatch, per_node):
    """Each GPU holds E / G experts plus one copy of a hot one; a pair of a copied expert runs on
    the copy at its token's place in the group: the outputs are transformers' (NoHostSync), and
    each rank allocates the weights the plan counts, copies included. Qwen3-MoE's group of 4 spans
    two nodes of 2: its all-to-all takes two hops (to the other node, then inside it)."""
    from hf_fixtures import hf_generate
    from opweave.ir.program import program_from_json
    from opweave.profile.allocated import artifact_memory
    from opweave.runtime.launch import RunConfig, run_detailed
    from opweave.runtime.scheduler import Request

    folder = tiny_checkpoint(family)
    out = _copies_artifact(folder, str(tmp_path / "art"), owner, dispatch, per_node)
    plan = json.load(open(f"{out}/plan.json"))
    assert plan["redundant_experts"] == 1
    assert plan["owners"][0]["group_nodes"] == (owner[1] // per_node if owner[3] == "dp" and owner[1] > per_node
                                                else 1)
    slots = plan["owners"][0]["expert_slots"]
    assert slots and all(len({e for gpu in s for e in gpu}) < sum(len(gpu) for gpu in s) for _, s in slots)
    with open(f"{out}/rank_01.json") as f:
        program = program_from_json(json.load(f))
    assert program.ep_slots and all(len(s[1]) == len(s[0]) for _, s in program.ep_slots)
    monkeypatch.setenv("OPWEAVE_CHECK_SYNC", "1")
    requests = tuple(Request(index=i, prompt=p, max_new_tokens=RUN_TOKENS) for i, p in enumerate(PROMPTS))
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=requests,
                                            timeout_s=300))
    assert all(r.error is None for r in outputs)
    assert [tuple(r.output) for r in outputs] == [tuple(hf_generate(folder, p, RUN_TOKENS)[1]) for p in PROMPTS]
    assert min(stats["checked_rounds"]) >= 1
    for r in artifact_memory(out, activations=False):
        assert r.allocated.weights == pytest.approx(r.planned.weights, rel=0.01, abs=1), r
