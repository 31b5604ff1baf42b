"""The compile pipeline: numbered, lazily formatted dumps per step, and a verifier per IR that
catches a corrupted IR and names the step."""

import dataclasses

import pytest

from opweave.compiler import pipeline
from opweave.compiler.compile import write_artifact
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.ir.graph import IRError
from opweave.ir.plan import verify_plan
from opweave.ir.program import Peer
from opweave.ir.verify import verify_blocks, verify_modules, verify_programs
from opweave.passes.placement import Group, place, verify_placement

MODEL = "tiny-gemma3"
CLUSTER = parse_cluster("h100x4+l40sx4", load_catalog())
OWNERS = [("h100", 1, 2), ("l40s", 2, 1)]  # AFD: attention on 2 H100 replicas, FFN on an L40S TP pair


@pytest.fixture(scope="module")
def fe():
    return run_front_end(MODEL)


@pytest.fixture(scope="module")
def compiled(fe):
    return pinned_plan(fe, CLUSTER, "afd", OWNERS, batch=4, microbatches=2, context=64)


@pytest.fixture(scope="module")
def lowered(compiled):
    return pipeline.run(compiled, first="lower", last="render")


def test_every_step_dumps_a_numbered_file_and_verifies(tmp_path, monkeypatch, fe):
    from opweave.compiler.compile import compile_model
    from opweave.passes.search import SearchOptions

    debug = tmp_path / "debug"
    monkeypatch.setenv("OPWEAVE_DEBUG_DIR", str(debug))
    monkeypatch.setenv("OPWEAVE_VERIFY", "1")
    compiled = compile_model(MODEL, CLUSTER, 0.05, 64, SearchOptions(templates="afd", batches=(4, 8)))
    write_artifact(str(tmp_path / "art"), compiled)
    names = sorted(p.name for p in debug.iterdir())
    assert names == [f"{i + 1:02d}_{name}.txt" for i, name in enumerate(pipeline.NAMES)]
    assert names == ["01_trace.txt", "02_blocks.txt", "03_search.txt", "04_place.txt", "05_plan.txt",
                     "06_lower.txt", "07_render.txt"]
    text = {n.split("_", 1)[1][:-4]: (debug / n).read_text() for n in names}
    assert f"OpGraph {MODEL}" in text["trace"]
    assert "pruned:" in text["search"] and "over memory" in text["search"] and "best: afd" in text["search"]
    assert "replica set(s)" in text["place"]
    assert f"Plan for {MODEL}" in text["plan"] and '"stages"' in text["plan"]
    assert "rank 0/" in text["lower"] and "send" in text["lower"]
    assert "# ==== rank_00.py" in text["render"]
    assert compiled.steps == ("trace", "blocks", "search", "place", "plan")


def test_dumps_are_formatted_only_when_asked(monkeypatch, compiled):
    def boom(st):
        raise AssertionError("formatted without OPWEAVE_DEBUG_DIR")

    monkeypatch.delenv("OPWEAVE_DEBUG_DIR", raising=False)
    monkeypatch.setattr(pipeline, "STEPS", tuple(dataclasses.replace(s, printer=boom) for s in pipeline.STEPS))
    done = pipeline.run(compiled, first="lower", last="render")
    assert done.modules and done.steps[-2:] == ("lower", "render")


def test_a_failed_verifier_names_the_step_and_those_before(monkeypatch, compiled):
    steps = list(pipeline.STEPS)
    i = pipeline.NAMES.index("lower")
    real = steps[i].run

    def lower_and_drop_a_receive(**irs):  # a bug in lowering: the first receive loses its peers
        text, programs = real(**irs)
        progs = list(programs)
        for r, p in enumerate(progs):
            for k, s in enumerate(p.stages):
                if s.recv is not None and p.rank == p.leader:
                    stages = list(p.stages)
                    stages[k] = dataclasses.replace(s, recv=dataclasses.replace(s.recv, peers=()))
                    progs[r] = dataclasses.replace(p, stages=tuple(stages))
                    return text, tuple(progs)
        return text, programs

    steps[i] = dataclasses.replace(steps[i], run=lower_and_drop_a_receive)
    monkeypatch.setattr(pipeline, "STEPS", tuple(steps))
    monkeypatch.setenv("OPWEAVE_VERIFY", "1")
    with pytest.raises(IRError, match=r"verify failed after step 'lower' \(trace, blocks, search, place, plan, "
                                      r"lower\): (message 0 from rank \d+ to rank \d+: sent|rank \d+ sends)"):
        pipeline.run(compiled, first="lower", last="render")
    monkeypatch.setenv("OPWEAVE_VERIFY", "0")  # the same bug goes unnoticed without the flag
    pipeline.run(compiled, first="lower", last="lower")


def test_an_exception_in_a_step_names_the_step_and_those_before(monkeypatch, fe):
    from opweave.compiler.compile import compile_model
    from opweave.errors import OpWeaveError
    from opweave.passes.search import SearchOptions

    steps = list(pipeline.STEPS)
    i = pipeline.NAMES.index("search")

    def broken_search(**irs):  # a bug in a pass, not a verifier's IRError
        return {}["no such key"]

    steps[i] = dataclasses.replace(steps[i], run=broken_search)
    monkeypatch.setattr(pipeline, "STEPS", tuple(steps))
    with pytest.raises(pipeline.StepError, match=r"^step 'search' failed \(after trace, blocks\): "
                                                 r"KeyError: 'no such key'$") as e:
        compile_model(MODEL, CLUSTER, 0.05, 64, SearchOptions(templates="afd", batches=(4,)), front_end=fe)
    assert isinstance(e.value.__cause__, KeyError) and e.value.step == "search"
    assert e.value.before == ("trace", "blocks")

    def refusing_search(**irs):  # a user error stays one line and unchanged
        raise OpWeaveError("no plan: nothing fits")

    steps[i] = dataclasses.replace(steps[i], run=refusing_search)
    monkeypatch.setattr(pipeline, "STEPS", tuple(steps))
    with pytest.raises(OpWeaveError, match=r"^no plan: nothing fits$"):
        compile_model(MODEL, CLUSTER, 0.05, 64, front_end=fe)
    first = dataclasses.replace(steps[0], run=lambda inputs: 1 / 0)
    monkeypatch.setattr(pipeline, "STEPS", (first,) + tuple(steps[1:]))
    with pytest.raises(pipeline.StepError, match=r"^step 'trace' failed \(the first step\): ZeroDivisionError"):
        run_front_end(MODEL)


def test_plan_verifier_catches_a_dropped_op_and_shared_gpus(compiled, fe):
    plan = compiled.plan
    assert verify_plan(plan, len(fe.graph.ops)) is plan
    s1 = plan.stages[1]
    dropped = dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(s1, first_op=s1.first_op + 1))
                                  + plan.stages[2:])
    with pytest.raises(IRError, match="stage 1 covers ops .* leaves ops out"):
        verify_plan(dropped)
    short = dataclasses.replace(plan, stages=plan.stages[:-1], num_stages=plan.num_stages - 1)
    with pytest.raises(IRError, match=f"cover ops 0..{plan.stages[-2].last_op} of {len(fe.graph.ops)}"):
        verify_plan(short, len(fe.graph.ops))
    o0, o1 = plan.owners
    overlapping = dataclasses.replace(plan, owners=(o0, dataclasses.replace(o1, gpus=((o0.gpus[0][0], 99),))))
    with pytest.raises(IRError, match=f"GPU {o0.gpus[0][0]} belongs to o0 replica 0 and to o1 replica 0"):
        verify_plan(overlapping)


def test_program_verifier_catches_a_lost_receive_and_a_byte_mismatch(lowered):
    programs = lowered.programs
    assert verify_programs(programs) is programs
    sender = next(p for p in programs if p.rank == p.leader and any(s.send for s in p.stages))
    k = next(k for k, s in enumerate(sender.stages) if s.send)
    send = sender.stages[k].send

    def with_send(new):
        stages = list(sender.stages)
        stages[k] = dataclasses.replace(stages[k], send=new)
        progs = list(programs)
        progs[sender.rank] = dataclasses.replace(sender, stages=tuple(stages))
        return progs

    wider = tuple((shape[0] + 1,) + tuple(shape[1:]) if shape else (2,) for shape in send.shapes)
    with pytest.raises(IRError, match=f"from rank {sender.rank} to rank {send.peers[0].rank}: sent .* received"):
        verify_programs(with_send(dataclasses.replace(send, shapes=wider)))
    extra = Peer(rank=sender.rank, lo=0, hi=1)  # a send to itself nobody receives
    with pytest.raises(IRError, match="which has no matching receive"):
        verify_programs(with_send(dataclasses.replace(send, peers=send.peers + (extra,))))
    assert verify_modules(lowered.modules, programs) is lowered.modules
    broken = {**lowered.modules, "rank_00.py": lowered.modules["rank_00.py"] + "\n)"}
    with pytest.raises(IRError, match="rank_00.py is not valid Python"):
        verify_modules(broken, programs)


def test_block_and_placement_verifiers(fe):
    bg = fe.blocks
    assert verify_blocks(bg) is bg
    b0 = bg.blocks[0]
    gap = dataclasses.replace(bg, blocks=(dataclasses.replace(b0, last=b0.last - 1),) + bg.blocks[1:])
    with pytest.raises(IRError, match="do not tile the graph"):
        verify_blocks(gap)
    where = place((Group(gpu="h100", tp=2, replicas=1), Group(gpu="l40s", tp=2, replicas=1)), CLUSTER)
    assert verify_placement(where, CLUSTER) is where
    clash = dataclasses.replace(where, placed=((where.placed[0][0], where.placed[0][0]),) + where.placed[1:])
    with pytest.raises(IRError, match="spans nodes|taken by"):
        verify_placement(clash, CLUSTER)
