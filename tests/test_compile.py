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


def test_artifact_files(artifact):
    names = sorted(os.listdir(artifact))
    ranks = [n for n in names if n.startswith("rank_")]
    assert sorted(set(names) - set(ranks)) == ["gantt.png", "ir.txt", "manifest.json", "model_config.json",
                                               "ops.json", "plan.json", "plan.txt", "trace.json"]
    plan = json.loads((artifact / "plan.json").read_text())
    world = sum(o["tp"] * o["replicas"] for o in plan["owners"])
    assert ranks == sorted([f"rank_{r:02d}.py" for r in range(world)] + [f"rank_{r:02d}.json" for r in range(world)])
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert set(manifest["files"]) == set(names) - {"manifest.json"} and manifest["plan_hash"]
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
                                     "simulator_calls", "seconds"}


def test_dump_plan_of_an_artifact(artifact, capsys, tmp_path):
    assert main(["dump", str(artifact), "--what", "plan"]) == 0
    assert "Plan for llama-3.1-8b on h100x4+l40sx4" in capsys.readouterr().out
    assert main(["dump", str(tmp_path), "--what", "plan"]) == 2
    assert "no plan.json" in capsys.readouterr().err


def test_baseline_templates_never_beat_opweave(tmp_path):
    costs = {}
    for templates in ("all", "colocated", "afd", "cad"):
        out = tmp_path / templates
        code = main(["compile", "gemma-3-27b", "--cluster", "h100x16", "--tpot-slo", "100ms", "--context", "128k",
                     "--quiet", "--templates", templates, "-o", str(out)])
        if code == 0:
            costs[templates] = json.loads((out / "plan.json").read_text())["cost_per_mtok_usd"]
    assert "all" in costs
    assert all(costs["all"] <= c * (1 + 1e-9) for c in costs.values())


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
