"""Measured traces of a run (`opweave run --trace`) and the bytes of a transfer."""

import json

import pytest

from opweave.cli import main
from opweave.ir.program import program_from_json
from opweave.runtime.launch import RunConfig, run_detailed
from opweave.runtime.scheduler import Request
from opweave.runtime.timeline import KINDS, Span, chrome_trace, from_rows, other_device, per_round, write_trace
from test_runtime import LAYERS, compile_pinned, reference


def test_per_round_medians():
    spans = [Span("compute", r, 1, 0, 0.0, 0.010 + r * 1e-3) for r in range(3)]
    spans += [Span("wait", r, 1, 0, 0.0, 0.002) for r in range(3)]
    figures = per_round(spans)
    assert set(figures) == set(KINDS)
    assert figures["compute"] == pytest.approx(0.011) and figures["wait"] == pytest.approx(0.002)
    assert figures["send"] == 0.0
    assert per_round(spans, range(2, 3))["compute"] == pytest.approx(0.012)


@pytest.mark.slow
def test_traced_run_accounts_for_every_stage_and_keeps_tokens(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    out = str(tmp_path / "art")
    compile_pinned(folder, "afd", out)
    prompts = [[5, 6, 7], [42], [9, 8, 7, 6], [60, 61]]
    reqs = tuple(Request(index=i, prompt=p, max_new_tokens=4) for i, p in enumerate(prompts))
    outputs, stats = run_detailed(RunConfig(artifact=out, weights=folder, device="cpu", requests=reqs, trace=True))
    assert all(r.error is None for r in outputs)
    rounds = len(stats["round_s"])
    world = len(stats["spans"])
    assert world == 3  # AFD here: one h100 rank, an l40s TP-2 group
    for rank, rows in stats["spans"].items():
        spans, busy = from_rows(rows), 0
        with open(f"{out}/rank_{int(rank):02d}.json") as f:
            program = program_from_json(json.load(f))
        for r in range(rounds):
            mine = [s for s in spans if s.round == r]
            computed = {(s.stage, s.microbatch) for s in mine if s.kind == "compute"}
            ran = {mb for _, mb in computed}  # a microbatch with no token this round is skipped whole
            assert computed == {(st.stage, mb) for st in program.stages for mb in ran}
            busy += bool(ran)
            assert sum(s.kind == "sync" for s in mine) == 1
        assert busy >= 4  # 4 outputs per request: a round each (the prefill samples the first)
        assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(spans, spans[1:]))  # one stream, in order
        assert all(s.dur_s >= 0 for s in spans)
    trace = chrome_trace({int(r): from_rows(rows) for r, rows in stats["spans"].items()})
    assert {e["pid"] for e in trace["traceEvents"]} == set(range(world))


@pytest.mark.slow
def test_run_trace_flag_writes_a_chrome_trace(tiny_checkpoint, tmp_path, capsys):
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    out = str(tmp_path / "art")
    compile_pinned(folder, "cad", out)
    path = tmp_path / "measured.json"
    assert main(["run", out, "--weights", folder, "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
                 "--trace", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["outputs"][0]["token_ids"] == list(reference(folder)[1])
    assert "trace:" in captured.err and "rank 0:" in captured.err
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("cat") == "compute" for e in events) and any(e.get("cat") == "wait" for e in events)
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1"} <= names and any(n.startswith("simulated o") for n in names)
    assert "simulated schedule beside it" in captured.err and "TPOT: predicted" in captured.err
    # a plan for GPUs, run on CPU ranks: the two TPOTs are not compared as if they were one machine's
    assert "the prediction is for l40s+h100; these ranks ran on this machine's CPU" in captured.err
    assert "predicted/measured" not in captured.err
    assert main(["run", out, "--weights", folder, "--prompt-ids", "1", "--trace", str(tmp_path / "no" / "t.json")]) == 2


def test_predicted_tpot_is_compared_only_on_the_device_it_is_for(tiny_checkpoint, tmp_path):
    """The TPOT line of `run --trace`: a percentage when the ranks ran on the kind of device the plan
    is for, otherwise a note naming both (CPU ranks of a plan for h100 and l40s)."""
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    out = str(tmp_path / "art")
    compile_pinned(folder, "afd", out)
    stats = {"spans": {0: [(kind, r, 0, 0, r + 0.0, r + 0.5) for r in range(8) for kind in ("compute",)]},
             "round_s": [0.5] * 8}
    on_cpu = "\n".join(write_trace(stats, str(tmp_path / "cpu.json"), out, device="cpu"))
    assert "TPOT: predicted" in on_cpu and "predicted/measured" not in on_cpu
    assert "the prediction is for h100+l40s; these ranks ran on this machine's CPU" in on_cpu
    on_cuda = "\n".join(write_trace(stats, str(tmp_path / "cuda.json"), out, device="cuda"))
    assert "predicted/measured - 1 = " in on_cuda and "prediction is for" not in on_cuda
    assert other_device(("cpu",), "cpu") is None and other_device(("h100",), None) is None
    assert "ran on CUDA devices" in other_device(("cpu",), "cuda")
