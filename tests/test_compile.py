"""`opweave compile` end to end: the artifact, the plan's contents, and bad input."""

import json
import os

import pytest

from opweave.cli import main
from opweave.ir.plan import plan_from_json, plan_to_json

ARGS = ["llama-3.1-8b", "--cluster", "h100x4+l40sx4", "--tpot-slo", "30ms", "--context", "8k", "--quiet"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "plan"
    assert main(["compile", *ARGS, "-o", str(out), "--format", "json"]) == 0
    return out


@pytest.mark.slow
def test_artifact_files(artifact):
    names = sorted(os.listdir(artifact))
    ranks = [n for n in names if n.startswith("rank_")]
    assert sorted(set(names) - set(ranks)) == ["compile-info.json", "gantt.png", "ir.txt", "manifest.json",
                                               "model_config.json", "ops.json", "plan.json", "plan.txt",
                                               "trace.json"]
    plan = json.loads((artifact / "plan.json").read_text())
    world = sum(o["tp"] * o["replicas"] for o in plan["owners"])
    assert ranks == sorted([f"rank_{r:02d}.py" for r in range(world)] + [f"rank_{r:02d}.json" for r in range(world)])
    manifest = json.loads((artifact / "manifest.json").read_text())
    # compile-info.json (time, host) is outside the manifest: the manifest stays the same between compiles
    assert set(manifest["files"]) == set(names) - {"manifest.json", "compile-info.json"} and manifest["plan_hash"]
    assert json.loads((artifact / "compile-info.json").read_text())["search_seconds"] >= 0
    assert (artifact / "gantt.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((artifact / "trace.json").read_text())
    assert trace["traceEvents"] and all("ph" in e for e in trace["traceEvents"])
    assert "OpGraph llama-3.1-8b" in (artifact / "ir.txt").read_text()
    assert not [n for n in os.listdir(artifact.parent) if n.startswith(".opweave-")]  # no temp folder left


def test_plan_json_contents(artifact):
    data = json.loads((artifact / "plan.json").read_text())
    for key in ("cost_per_mtok_usd", "tpot_ms", "tokens_per_s", "template", "owners", "num_stages", "counters"):
        assert key in data
    assert data["tpot_ms"] <= 30
    plan = plan_from_json(data)
    assert plan_to_json(plan) == data
    # instantiated on the cluster: replica set 0's GPUs used once each, within the cluster; idle ones
    # as runs; every GPU in some replica set or idle
    used = [g for o in plan.owners for replica in o.gpus for g in replica]
    idle = [g for lo, hi in plan.idle_gpus for g in range(lo, hi)]
    assert len(used) == len(set(used)) and all(0 <= g < 8 for g in used) and not set(used) & set(idle)
    assert plan.gpus_used + len(idle) == 8 and plan.gpus_used == len(used) * plan.replica_sets
    for o in plan.owners:
        assert len(o.gpus) == o.replicas and all(len(r) == o.tp for r in o.gpus)
    covered = [i for s in plan.stages for i in range(s.first_op, s.last_op + 1)]
    assert covered == sorted(covered) and covered[0] == 0
    assert set(data["counters"]) >= {"templates", "owner_configs", "frontier_configs", "candidates",
                                     "simulator_calls", "pruned_slo", "pruned_cost", "configs_over_memory"}
    assert "seconds" not in data["counters"]  # wall-clock time would make identical compiles differ
    c = data["counters"]
    assert c["pruned_prefixes"] == c["pruned_root_slo"] + c["pruned_root_cost"] + c["pruned_slo"] + c["pruned_cost"]


def test_dump_plan_of_an_artifact(artifact, capsys, tmp_path):
    assert main(["dump", str(artifact), "--what", "plan"]) == 0
    assert "Plan for llama-3.1-8b on h100x4+l40sx4" in capsys.readouterr().out
    assert main(["dump", str(tmp_path), "--what", "plan"]) == 2
    assert "no plan.json" in capsys.readouterr().err


@pytest.mark.slow
def test_baseline_templates_never_beat_opweave():
    """The search `opweave compile` runs (its artifact writing is tested above), per template family."""
    from opweave.compiler.frontend import run_front_end
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.passes.search import SearchOptions, search
    from opweave.passes.space import PlanSpace

    fe = run_front_end("gemma-3-27b")
    space = PlanSpace(graph=fe.graph, blocks=fe.blocks, cluster=parse_cluster("h100x16", load_catalog()),
                      context=131072, tpot_slo_s=0.1)
    costs = {}
    for templates in ("all", "colocated", "afd", "cad"):
        found = search(space, SearchOptions(templates=templates))
        if found.best is not None:
            costs[templates] = found.best.cost
    assert "all" in costs and len(costs) == 4
    assert all(costs["all"] <= c * (1 + 1e-9) for c in costs.values())


@pytest.mark.slow
def test_recompile_replaces_the_artifact(tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["compile", *ARGS, "-o", str(out), "--templates", "colocated"]) == 0
    assert main(["compile", *ARGS, "-o", str(out), "--templates", "colocated"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["a"]


@pytest.mark.parametrize("args,message", [
    (["--tpot-slo", "fast"], "bad duration 'fast'"),
    (["--context", "12q"], "bad context length '12q'"),
    (["--cluster", "h100x0"], "must be"),
    (["--tpot-slo", "0.01ms"], "best TPOT"),
    (["--cluster", "l4x1", "--context", "128k"], "l4x1 is too small"),
    (["--cluster", "l4x1", "--context", "1m"], "beyond llama-3.1-8b's max_position_embeddings 131072"),
])
@pytest.mark.slow
def test_bad_input(tmp_path, capsys, args, message):
    base = {"--cluster": "h100x4", "--tpot-slo": "30ms", "--context": "8k"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    argv = ["compile", "llama-3.1-8b", "--quiet", "-o", str(tmp_path / "x")]
    for k, v in base.items():
        argv += [k, v]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x").exists()


def test_dump_redraws_the_schedule_from_plan_json_alone(artifact, tmp_path, capsys):
    trace, gantt = tmp_path / "t.json", tmp_path / "g.png"
    assert main(["dump", str(artifact), "--what", "plan", "--trace", str(trace), "--gantt", str(gantt)]) == 0
    assert f"wrote {trace}, {gantt}" in capsys.readouterr().out
    assert trace.read_bytes() == (artifact / "trace.json").read_bytes()
    assert gantt.read_bytes() == (artifact / "gantt.png").read_bytes()
    # the re-simulated schedule gives the plan's predicted figures
    data = json.loads((artifact / "plan.json").read_text())
    other = json.loads(trace.read_text())["otherData"]
    assert other["tpot_s"] * 1e3 == pytest.approx(data["predicted"]["tpot_ms"], rel=1e-12)
    # a plan from before the schedule figures, and flags without --what plan: one line each
    old = {**data, "format": "opweave-plan/2", "return_s": None}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["dump", str(tmp_path / "old.json"), "--what", "plan", "--trace", str(trace)]) == 2
    assert main(["dump", "llama-3.1-8b", "--what", "ir", "--gantt", str(gantt)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "no schedule figures" in err[0] and "go with --what plan" in err[1]


@pytest.fixture(scope="module")
def llama():
    from opweave.compiler.frontend import run_front_end

    return run_front_end("llama-3.1-8b")


@pytest.mark.parametrize("cluster,owners,batch,context,message", [
    ("l40sx8", [("l40s", 1, 1)], 64, 131072, r"owner o0 \(1x l40s tp1\): needs \d+\.\d GB per GPU at batch 64, "
                                             r"context 131072; a l40s has 43.2 GB usable"),
    ("h100x16", [("h100", 16, 1)], 8, 8192, "TP 16 exceeds the h100 node size"),
    ("h100x8", [("h100", 3, 1)], 8, 8192, "TP 3 does not divide"),
    ("h100x4", [("h100", 2, 3)], 8, 8192, "needs 6 GPUs, the cluster has 4 h100"),
    ("h100x4+l40sx4", [("h100", 4, 1), ("l40s", 1, 2)], 2, 8192, "2 replicas x 2 microbatches exceed batch 2"),
    ("h100x4+l40sx4", [("h100", 4, 1), ("h100", 2, 1)], 8, 8192, "the owners need 6 h100 GPUs"),
    ("h100x4", [("a100", 1, 1)], 8, 8192, "has no a100"),
])
@pytest.mark.slow
def test_pinned_plans_are_checked_like_searched_ones(llama, cluster, owners, batch, context, message):
    from opweave.compiler.pinned import pinned_plan
    from opweave.errors import OpWeaveError
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster

    template = "colocated" if len(owners) == 1 else "afd"
    with pytest.raises(OpWeaveError, match=message) as e:
        pinned_plan(llama, parse_cluster(cluster, load_catalog()), template, owners, batch=batch,
                    microbatches=2, context=context)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_pinned_plan_that_fits_matches_the_search(llama):
    """The search's best plan, pinned by hand, is the same plan (same owners' memory and figures)."""
    from opweave.compiler.compile import compile_model
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster

    cluster = parse_cluster("h100x4+l40sx4", load_catalog())
    searched = compile_model("llama-3.1-8b", cluster, 0.03, 8192).plan
    pinned = pinned_plan(llama, cluster, searched.template, [(o.gpu, o.tp, o.replicas) for o in searched.owners],
                         batch=searched.batch, microbatches=searched.microbatches, context=8192, tpot_slo_s=0.03).plan
    assert pinned.owners == searched.owners and pinned.stages == searched.stages
    assert pinned.predicted == searched.predicted
