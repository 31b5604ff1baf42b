"""Planning for traffic (`passes/traffic.py`): prefill in the rounds or on its own GPUs, TTFT and
TPOT at the planned load, the workload's flags and file, and the pruned search still equal to
exhaustive enumeration with a workload."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_search import SMALL, chosen_templates, hardware, tiny

from opweave.cost.prefill import round_extra_s
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import get_gpu, load_catalog
from opweave.ir.workload import Workload, read_workload, workload_from_flags
from opweave.passes.search import SearchOptions, search
from opweave.passes.space import PlanSpace
from opweave.passes.traffic import LOAD, TrafficModel, md1_wait


def test_erlang_c_wait_for_a_row():
    from opweave.passes.traffic import erlang_c_wait

    assert erlang_c_wait(1, 0.5, 2.0)[0] == pytest.approx(md1_wait(0.5, 2.0)[0])   # one slot: M/D/1
    few, many = erlang_c_wait(8, 6.4, 1.0), erlang_c_wait(256, 204.8, 1.0)
    assert few[0] > many[0] > 0 and few[1] > few[0]   # pooling: at 80% more slots wait less
    assert erlang_c_wait(4, 4.0, 1.0) == (math.inf, math.inf) and erlang_c_wait(4, 0.0, 1.0) == (0.0, 0.0)


def test_md1_wait_is_pollaczek_khinchine_with_a_tail_beyond_it():
    assert md1_wait(0.0, 1.0) == (0.0, 0.0)
    mean, tail = md1_wait(0.5, 2.0)
    assert mean == pytest.approx(0.5 * 2.0 / (2 * 0.5)) and tail > mean
    assert md1_wait(0.9, 1.0)[0] > md1_wait(0.8, 1.0)[0] > md1_wait(0.5, 1.0)[0]
    assert md1_wait(1.0, 1.0) == (math.inf, math.inf)


def test_a_round_gains_more_the_more_prompt_tokens_it_carries():
    graph, _ = tiny()
    gpu = get_gpu("h100", load_catalog())
    hidden = graph.cuts[0].bytes_per_token
    gains = [round_extra_s(graph.ops, gpu, 1, 16, 2048, q, 1024, hidden) for q in (0, 64, 512, 4096)]
    assert gains[0] == 0.0 and 0 < gains[1] < gains[2] < gains[3]
    # a longer prompt's tokens attend more: the same chunk costs more
    assert round_extra_s(graph.ops, gpu, 1, 16, 2048, 512, 8192, hidden) > gains[2]


def _space(cluster, slo, context, **workload):
    graph, blocks = tiny()
    return PlanSpace(graph=graph, blocks=blocks, cluster=cluster, context=context, tpot_slo_s=slo,
                     workload=Workload(**workload))


@settings(max_examples=8, deadline=None)
@given(cluster=hardware(), slo_ms=st.floats(0.1, 2.0), ttft_ms=st.sampled_from([math.inf, 50.0, 5.0]),
       isl=st.sampled_from([32, 200]), mode=st.sampled_from(["auto", "aggregated", "disaggregated"]),
       picks=st.lists(st.integers(0, 15), min_size=1, max_size=2))
@pytest.mark.slow
def test_pruned_search_matches_exhaustive_with_a_workload(cluster, slo_ms, ttft_ms, isl, mode, picks):
    """Prefill only adds time and GPUs to a decode plan, so the decode-only bounds still hold: the
    pruned search finds the exhaustive optimum under traffic, and it meets both SLOs."""
    templates = chosen_templates(picks)
    space = _space(cluster, slo_ms / 1e3, isl + 40, isl=isl, osl=40, ttft_slo_s=ttft_ms / 1e3, prefill=mode)
    exhaustive = search(space, SearchOptions(only_templates=templates, **SMALL, pareto=False, bnb=False))
    pruned = search(space, SearchOptions(only_templates=templates, **SMALL))
    if exhaustive.best is None:
        assert pruned.best is None
        return
    assert pruned.best.cost == pytest.approx(exhaustive.best.cost, rel=1e-9)
    t = pruned.best.traffic
    assert t is not None and t.tpot_s <= slo_ms / 1e3 and t.ttft_s <= ttft_ms / 1e3
    assert mode == "auto" or t.mode == mode
    # under traffic a plan is never cheaper than its decode alone
    assert pruned.best.cost >= pruned.best.sim.cost_per_mtok_usd * (1 - 1e-12)


def test_traffic_costs_more_than_decode_and_a_longer_prompt_costs_more():
    from opweave.hardware.cluster import parse_cluster

    cluster = parse_cluster("h100x4", load_catalog())
    graph, blocks = tiny()
    decode = search(PlanSpace(graph=graph, blocks=blocks, cluster=cluster, context=2048, tpot_slo_s=0.05),
                    SearchOptions(**SMALL))
    costs = {}
    for isl in (256, 1536):
        best = search(_space(cluster, 0.05, 2048, isl=isl, osl=256), SearchOptions(**SMALL)).best
        costs[isl] = best.cost
        assert best.traffic.ttft_s > 0 and best.traffic.load == LOAD
    assert decode.best.cost < costs[256] < costs[1536]


def test_the_aggregated_round_follows_the_flows():
    """At capacity a microbatch takes min(rows / (osl - 1 + R), C / isl) requests per round; the
    share of rounds with a chunk and the mean round follow."""
    from opweave.hardware.cluster import parse_cluster

    cluster = parse_cluster("h100x4", load_catalog())
    space = _space(cluster, 1.0, 2048, isl=1000, osl=100)
    cand = search(space, SearchOptions(**SMALL, templates="colocated")).best
    from opweave.passes.space import Evaluator

    model = TrafficModel(Evaluator(space), space.workload)
    t = model.aggregated(cand, 512)
    schedulers = cand.owners[0].replicas
    rows = cand.batch / cand.microbatches / schedulers
    lam = min(rows / (100 - 1 + 2), 512 / 1000)
    assert t.chunk_share == pytest.approx(lam * 1000 / 512)
    tc = model.chunk_round_s(cand, 512)
    assert tc > cand.sim.tpot_s
    assert t.tpot_s == pytest.approx(t.chunk_share * tc + (1 - t.chunk_share) * cand.sim.tpot_s)
    assert t.tokens_per_s == pytest.approx(schedulers * cand.microbatches * lam / t.tpot_s * 100)
    assert t.tokens_per_s < cand.sim.tokens_per_s


def test_ttft_counts_the_rounds_until_the_host_learns_the_first_token(monkeypatch):
    """The runtime's host learns a token HOST_TOKEN_LAG rounds after the round that sampled it: the
    aggregated TTFT (mean and p99) carries that many rounds at the load."""
    from opweave.hardware.cluster import parse_cluster
    from opweave.ir.plan import HOST_TOKEN_LAG
    from opweave.passes import traffic
    from opweave.passes.space import Evaluator

    cluster = parse_cluster("h100x4", load_catalog())
    space = _space(cluster, 1.0, 2048, isl=1000, osl=100)
    cand = search(space, SearchOptions(**SMALL, templates="colocated")).best
    model = TrafficModel(Evaluator(space), space.workload)
    with_lag = model.aggregated(cand, 512)
    monkeypatch.setattr(traffic, "HOST_TOKEN_LAG", 0)
    without = model.aggregated(cand, 512)
    assert HOST_TOKEN_LAG == 2
    assert with_lag.ttft_s - without.ttft_s == pytest.approx(HOST_TOKEN_LAG * with_lag.tpot_at_load_s)
    assert with_lag.ttft_p99_s - without.ttft_p99_s == pytest.approx(HOST_TOKEN_LAG * with_lag.tpot_at_load_s)


def test_a_tight_ttft_moves_prefill_to_its_own_gpus(tmp_path, capsys):
    """Llama-3.1-70B on 16 H100s, ISL/OSL 1024/1024: without a TTFT target prefill shares the decode
    rounds; at 100 ms (below what a round with a prompt's chunk allows at the load) prefill moves to
    a pool of its own, and plan.json says so."""
    from opweave.cli import main

    modes = {}
    for ttft in (None, "130ms"):
        out = tmp_path / f"a{ttft}"
        args = ["compile", "llama-3.1-70b", "--cluster", "h100x16", "--tpot-slo", "50ms", "--isl", "1024", "--osl",
                "1024", "--templates", "colocated", "-o", str(out), "--quiet", "--format", "json"]
        assert main(args + (["--ttft-slo", ttft] if ttft else [])) == 0
        data = json.loads(capsys.readouterr().out)
        modes[ttft] = data["prefill"]
        assert data["workload"]["isl"] == 1024 and data["ttft_p99_ms"] >= data["ttft_ms"]
        if ttft:
            assert data["ttft_ms"] <= 130
    assert modes[None]["mode"] == "aggregated" and modes[None]["token_budget"] >= 256
    pool = modes["130ms"]["owners"][0]
    assert modes["130ms"]["mode"] == "disaggregated" and pool["gpu"] == "h100" and pool["replicas"] >= 1
    assert pool["prefill_ms"] < 100 and pool["kv_bytes"] > 0


def test_workload_flags_and_files(tmp_path):
    assert workload_from_flags(isl=None, osl=None, path=None, ttft_slo=None, rate=None) is None
    w = workload_from_flags(isl="1k", osl="256", path=None, ttft_slo="250ms", rate="4.5", prefill="aggregated")
    assert (w.isl, w.osl, w.ttft_slo_s, w.rate, w.prefill, w.longest) == (1024, 256, 0.25, 4.5, "aggregated", 1280)
    assert Workload.from_json(json.loads(json.dumps(w.to_json()))) == w
    f = tmp_path / "w.jsonl"
    f.write_text('{"isl": 100, "osl": 10}\n\n{"prompt_tokens": 300, "completion_tokens": 30, "count": 3}\n')
    w = read_workload(str(f))
    assert (w.isl, w.osl, w.max_isl, w.max_osl, w.requests) == (250, 25, 300, 30, 4)
    for text, needle in (('{"isl": 1}\n', "no osl"), ("[1]\n", "expected an object"), ("nope\n", "not JSON"),
                         ('{"isl": -1, "osl": 2}\n', "whole number"), ("", "no requests"),
                         ('{"isl": 1, "osl": 2, "count": 0}\n', "count")):
        f.write_text(text)
        with pytest.raises(OpWeaveError, match=needle):
            read_workload(str(f))
    for kw, needle in ((dict(isl="1k", osl=None), "go together"), (dict(ttft_slo="1s"), "no workload"),
                       (dict(isl="1", osl="1", path="x"), "one of them"), (dict(isl="1", osl="1", rate="-2"), "--rate"),
                       (dict(isl="1", osl="1", ttft_slo="fast"), "bad duration")):
        args = dict(isl=None, osl=None, path=None, ttft_slo=None, rate=None) | kw
        with pytest.raises(OpWeaveError, match=needle):
            workload_from_flags(**args)
    with pytest.raises(OpWeaveError, match="--workload"):
        read_workload(str(tmp_path / "missing.jsonl"))


def test_compile_with_a_workload_file_and_a_rate(tmp_path, capsys):
    from opweave.cli import main

    f = tmp_path / "w.jsonl"
    f.write_text("\n".join(json.dumps({"isl": n, "osl": 64}) for n in (200, 400, 600)) + "\n")
    out = tmp_path / "art"
    assert main(["compile", "llama-3.1-8b", "--cluster", "h100x2", "--tpot-slo", "50ms", "--workload", str(f),
                 "--rate", "2", "-o", str(out), "--quiet", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context"] == 664 and data["isl"] == 400 and data["workload"]["requests"] == 3
    assert data["prefill"]["load"] < LOAD   # 2 requests/s leave one set far below its capacity
    assert data["prefill"]["fleet_sets"] == 1
    assert "workload: prompts of 400 tokens" in (out / "plan.txt").read_text()
    assert main(["compile", "llama-3.1-8b", "--cluster", "h100x2", "--tpot-slo", "50ms", "--context", "1k",
                 "--ttft-slo", "1s", "-o", str(tmp_path / "b")]) == 2
    assert "no workload" in capsys.readouterr().err
    assert main(["compile", "llama-3.1-8b", "--cluster", "h100x2", "--tpot-slo", "50ms", "--isl", "1k", "--osl", "64",
                 "--ttft-slo", "1us", "-o", str(tmp_path / "c")]) == 2
    assert "no plan: best TTFT" in capsys.readouterr().err


@pytest.mark.slow
def test_run_takes_the_plans_token_budget_and_serves_a_disaggregated_plan(tiny_checkpoint, tmp_path, capsys):
    """An aggregated plan's token budget is the runtime's default prefill budget (and the plan runs);
    a disaggregated plan's artifact holds its prefill pool's programs, and `opweave run` starts them
    beside the decode ranks: the same tokens. `--prefill-sets` on an aggregated plan is refused."""
    from opweave.artifact import load_artifact
    from opweave.cli import main
    from opweave.runtime.launch import RunConfig, planned_prefill

    folder = tiny_checkpoint("llama")
    tokens = {}
    for mode in ("aggregated", "disaggregated"):
        out = tmp_path / mode
        assert main(["compile", folder, "--cluster", "cpux2", "--tpot-slo", "10s", "--isl", "24", "--osl", "8",
                     "--prefill", mode, "--templates", "colocated", "-o", str(out), "--quiet"]) == 0
        plan = json.loads((out / "plan.json").read_text())
        assert plan["prefill"]["mode"] == mode
        assert (out / "prefill_rank_00.py").exists() == (mode == "disaggregated")
        capsys.readouterr()
        code = main(["run", str(out), "--weights", folder, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "3",
                     "--json"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        tokens[mode] = json.loads(captured.out)["outputs"][0]["token_ids"]
        if mode == "aggregated":
            from opweave.runtime.scheduler import Request

            cfg = planned_prefill(RunConfig(artifact=str(out), weights="random", device="cpu",
                                            requests=(Request(index=0, prompt=(1, 2), max_new_tokens=1),)),
                                  load_artifact(str(out)))
            assert cfg.prefill_budget == plan["prefill"]["token_budget"]
            assert main(["run", str(out), "--weights", folder, "--prompt-ids", "1,2", "--prefill-sets", "2"]) == 2
            err = capsys.readouterr().err
            assert "--prefill-sets 2: the plan has no prefill GPUs of its own" in err and "Traceback" not in err
    assert tokens["disaggregated"] == tokens["aggregated"] and len(tokens["aggregated"]) == 3


def test_a_workload_sizes_the_kv_pool_and_holds_a_larger_batch():
    """With a workload the pool holds the expected occupancy and its tail, not every slot at the
    full context: never more than the full pool, less for many slots, and a larger batch fits."""
    from opweave.hardware.cluster import parse_cluster
    from opweave.ir.workload import kv_pool_pages
    from opweave.passes.search import memory_batch_limit

    w = Workload(isl=1024, osl=1024)
    assert kv_pool_pages(8, 2048, None, 16) == 8 * 128
    assert kv_pool_pages(1, 2048, w, 16) == 128          # one slot: the longest sequence, capped
    many = kv_pool_pages(256, 2048, w, 16)
    assert 256 * 96 < many < 256 * 128                   # mean 1536 tokens a slot, plus the tail
    assert kv_pool_pages(512, 2048, w, 16) < 2 * many    # the tail grows as the root of the slots
    cluster = parse_cluster("h100x1", load_catalog())
    graph, blocks = tiny()
    assert memory_batch_limit(graph, cluster, 2048, w) > memory_batch_limit(graph, cluster, 2048)


@pytest.mark.slow
def test_workload_plan_allocates_its_planned_kv_pool(tiny_checkpoint, tmp_path, capsys):
    """A plan compiled for a workload: every rank allocates the pool the planner counted (on meta),
    fewer pages than every slot at the full context, and the plan runs."""
    from opweave.cli import main

    folder = tiny_checkpoint("llama")
    out = str(tmp_path / "art")
    assert main(["compile", folder, "--cluster", "h100x2", "--tpot-slo", "1s", "--isl", "24", "--osl", "40",
                 "--context", "256", "--max-batch", "64", "-o", out, "--quiet"]) == 0
    plan = json.loads(open(f"{out}/plan.json").read())
    capsys.readouterr()
    assert main(["dump", out, "--what", "memory", "--format", "json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    for r in ranks:
        assert r["allocated"]["state"] == pytest.approx(r["planned"]["state"], rel=0.01, abs=1)
        assert r["kv_pages"]["planned"] == r["kv_pages"]["allocated"]
    full = plan["batch"] // plan["owners"][0]["replicas"] * 256 // 16
    assert 0 < ranks[0]["kv_pages"]["planned"] < full
    assert main(["run", out, "--weights", folder, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]) == 0


def test_compile_explain_names_the_best_of_each_part_of_the_space(tmp_path, capsys):
    """`--explain`: one row per template family and way of serving prefill, one per GPU type; the
    cheapest row is the compiled plan, and a type with no plan says why."""
    from opweave.cli import main

    args = ["compile", "llama-3.1-8b", "--cluster", "h100x2+l40sx2", "--tpot-slo", "30ms", "--isl", "512", "--osl",
            "128", "--explain", "-o", str(tmp_path / "a"), "--quiet"]
    assert main(args + ["--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["explain"]
    families = {r["family"] for r in rows}
    assert {"colocated", "afd", "cad"} <= families and {r["gpus"] for r in rows} >= {"h100", "l40s"}
    assert {r["prefill"] for r in rows if r["family"] == "colocated"} == {"aggregated", "disaggregated"}
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and chosen[0]["cost_per_mtok_usd"] == pytest.approx(data["predicted"]["cost_per_mtok_usd"])
    assert all(r["plan"] or r["limits"].startswith("no plan:") for r in rows)
    assert all("memory" in r["limits"] for r in rows if r["plan"])
    assert main(args + ["--force"]) == 0
    assert "Plans considered" in capsys.readouterr().out
