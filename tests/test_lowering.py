"""Lowering and codegen: rank programs match the plan (counts of launches, sends and receives),
every send has its receive, and one generated module is checked against a golden copy
(regenerate with OPWEAVE_REGEN_GOLDEN=1)."""

import collections
import json
import os

import pytest

from test_runtime import compile_pinned
from opweave.codegen.render import fused_add_norm
from opweave.compiler.frontend import run_front_end
from opweave.passes.carry import carry
from opweave.ir.plan import plan_from_json
from opweave.ir.program import format_program, program_from_json, program_to_json

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "rank_00_llama_afd.py")


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoint, tmp_path_factory):
    out = {}
    for plan in ("afd", "cad", "opweave"):
        folder = str(tmp_path_factory.mktemp(plan) / "art")
        compile_pinned(tiny_checkpoint("llama", num_hidden_layers=3), plan, folder)
        out[plan] = folder
    return out


def load(folder):
    plan = plan_from_json(json.load(open(os.path.join(folder, "plan.json"))))
    programs = [program_from_json(json.load(open(os.path.join(folder, n))))
                for n in sorted(os.listdir(folder)) if n.startswith("rank_") and n.endswith(".json")]
    return plan, programs


@pytest.mark.parametrize("plan_name", ["afd", "cad", "opweave"])
@pytest.mark.slow
def test_programs_match_the_plan(artifacts, tiny_checkpoint, plan_name):
    plan, programs = load(artifacts[plan_name])
    assert len(programs) == sum(o.tp * o.replicas for o in plan.owners)
    graph = run_front_end(tiny_checkpoint("llama", num_hidden_layers=3)).graph
    sent = carry(graph, [(s.first_op, s.last_op) for s in plan.stages], [s.owner for s in plan.stages]).sent
    for p in programs:
        assert program_from_json(program_to_json(p)) == p
        mine = [s for s in plan.stages if s.owner == p.owner]
        assert [s.stage for s in p.stages] == [s.index for s in mine]
        assert sum(len(s.launches) for s in p.stages) == sum(s.last_op - s.first_op + 1 for s in mine)
        # one receive per stage whose predecessor has another owner; one send per stage but the last
        assert sum(s.recv is not None for s in p.stages) == sum(1 for s in mine if s.index > 0)
        assert sum(s.send is not None for s in p.stages) == sum(1 for s in mine if s.index < plan.num_stages - 1)
        for s in p.stages:  # what crosses a cut is what the carry pass sends (passes/carry.py)
            if s.send is not None:
                end = next(x.index for x in mine if x.last_op == s.launches[-1].op)  # a run's last plan stage
                assert s.send.values == sent[end]
        assert "launch op" in format_program(p)


@pytest.mark.parametrize("plan_name", ["afd", "cad", "opweave"])
def test_every_send_has_its_receive(artifacts, plan_name):
    """Each cut is handled by one port per replica (the group's ranks in turn), and every port's
    sends are its peers' receives; the token ids come back to the schedulers' leaders."""
    _, programs = load(artifacts[plan_name])
    by_rank = {p.rank: p for p in programs}
    sends, recvs = collections.Counter(), collections.Counter()
    for p in programs:
        for s in p.stages:
            if s.send and s.send_port == p.rank:
                for q in s.send.peers:
                    sends[(p.rank, q.rank, s.send.cut, q.lo, q.hi)] += 1
            if s.recv and s.recv_port == p.rank:
                for q in s.recv.peers:
                    recvs[(q.rank, p.rank, s.recv.cut, q.lo, q.hi)] += 1
            for q in (s.returns if s.send_port == p.rank else ()):
                sends[(p.rank, q.rank, "tokens", q.lo, q.hi)] += 1
            for port in (s.recv_port, s.send_port):
                assert port is None or port in p.tp_group
        if p.tp_rank == 0:
            for q in p.token_sources:
                recvs[(q.rank, p.rank, "tokens", q.lo, q.hi)] += 1
    assert sends == recvs and sends
    assert all(by_rank[k[1]].tp_rank == 0 for k in sends if k[2] == "tokens")  # to the schedulers
    ports = {by_rank[k[0]].tp_rank for k in sends} | {by_rank[k[1]].tp_rank for k in sends}
    if any(p.tp > 1 for p in programs):
        assert ports - {0}, "a TP group's other ranks take no cut"


def test_generated_module_lines_name_stage_block_layer_and_op(artifacts):
    _, programs = load(artifacts["cad"])
    fused_total = kept_total = 0
    for p in programs:
        source = open(os.path.join(artifacts["cad"], f"rank_{p.rank:02d}.py")).read()
        compile(source, "rank", "exec")
        calls = [line for line in source.splitlines() if "= self.op" in line or "= rt.sample(" in line
                 or "= rt.add_norm(" in line]
        fused = [line for line in calls if "= rt.add_norm(" in line]  # a residual add and its norm
        assert len(calls) + len(fused) == sum(len(s.launches) for s in p.stages)
        assert len(fused) == sum(fused_add_norm(s, k) for s in p.stages for k in range(len(s.launches)))
        fused_total += len(fused)
        assert all("# stage " in line and " · block " in line and " · layer " in line for line in calls)
        assert source.count("rt.allreduce(") == sum(l.allreduce for s in p.stages for l in s.launches)
        # values kept on this owner between its stages (passes/carry.py): one store and one read-back each
        stores = [line for line in source.splitlines() if "self.held[mb][" in line and "] = v" in line]
        loads = [line for line in source.splitlines() if "= self.held[mb]" in line]
        assert len(stores) == sum(len(s.keeps) for s in p.stages) and all("(not sent)" in x for x in stores)
        assert len(loads) == sum(len(s.takes) for s in p.stages) and all("kept on this owner since" in x for x in loads)
        kept_total += len(stores)
    assert fused_total > 0  # llama: every layer's post-attention residual feeds the pre-FFN norm
    assert kept_total > 0  # CAD: the dense owner keeps the residual across core attention


def test_golden_module(artifacts):
    source = open(os.path.join(artifacts["afd"], "rank_00.py")).read()
    if os.environ.get("OPWEAVE_REGEN_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(source)
    assert source == open(GOLDEN).read(), "generated code changed: review, then OPWEAVE_REGEN_GOLDEN=1"


def test_codegen_is_deterministic(artifacts, tiny_checkpoint, tmp_path):
    again = str(tmp_path / "again")
    compile_pinned(tiny_checkpoint("llama", num_hidden_layers=3), "afd", again)
    for name in os.listdir(artifacts["afd"]):
        if name.endswith((".py", ".json")) and name != "compile-info.json":  # the wall clock, by design
            assert open(os.path.join(again, name)).read() == open(os.path.join(artifacts["afd"], name)).read(), name


def test_dump_ranks(artifacts, capsys):
    from opweave.cli import main

    assert main(["dump", artifacts["cad"], "--what", "ranks"]) == 0
    out = capsys.readouterr().out
    assert out.count("rank ") >= 3 and "recv after op" in out and "return token ids" in out


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    """The README's main job: plan a real model, then compile and run a tiny one on CPU ranks."""
    from opweave.cli import main

    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "Plan for gemma-3-27b on h100x32" in out and "Plan for tiny-gemma3" in out
    assert out.count("-> generated [") == 2
    art = tmp_path / "demo" / "gemma-3-27b"
    with open(art / "plan.json") as f:
        plan = json.load(f)
    ranks = sum(o["tp"] * o["replicas"] for o in plan["owners"])  # one replica set's ranks
    assert os.path.isfile(art / f"rank_{ranks - 1:02d}.py") and not os.path.exists(art / f"rank_{ranks:02d}.py")


def test_one_owner_taking_every_stage_runs_them_as_one(tiny_checkpoint):
    """A one-cut-per-block template on one owner (a plan the search can emit): its consecutive
    stages become one stage program, started once and with nothing sent between them."""
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.passes.lower import lower

    fe = run_front_end(tiny_checkpoint("llama", num_hidden_layers=3))
    compiled = pinned_plan(fe, parse_cluster("h100x8", load_catalog()), "F:pre_attn", [("h100", 2, 1)],
                           batch=2, microbatches=2, context=32)
    assert compiled.plan.num_stages > 1
    programs = lower(compiled.plan, fe.graph, fe.blocks.period, fe.blocks.num_blocks, "h")
    for p in programs:
        (stage,) = p.stages
        assert stage.recv is None and stage.send is None and stage.returns
        assert [l.op for l in stage.launches] == list(range(len(fe.graph.ops)))
