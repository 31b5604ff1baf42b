"""The prefill cost model (`opweave.cost.prefill`) and TTFT in `opweave estimate`."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from opweave.compiler.frontend import run_front_end
from opweave.cost.prefill import prefill_op_s, prefill_s
from opweave.hardware.catalog import get_gpu, load_catalog
from opweave.ir.kinds import OpKind

PUBLISHED = {  # LLM-Inference-Bench (github.com/argonne-lcf/LLM-Inference-Bench): its one prefill time per
    # GPU and engine, Llama-3-8B, 1024 input tokens, batch 16, TP 1, FP16 (seconds)
    ("h100", "vllm"): 0.4257, ("h100", "trtllm"): 0.4054,
    ("a100", "vllm"): 1.0420, ("a100", "trtllm"): 1.0501,
}


@pytest.fixture(scope="module")
def llama8b():
    graph = run_front_end("llama-3.1-8b").graph
    return graph, graph.cuts[0].bytes_per_token


def test_the_catalog_prefill_efficiency_reproduces_the_published_prefill_times(llama8b):
    """The catalog's `prefill_efficiency` of h100 and a100 is the fit to the published times:
    within 3% of each engine's."""
    graph, hidden = llama8b
    catalog = load_catalog()
    for (gpu, engine), seconds in PUBLISHED.items():
        spec = get_gpu(gpu, catalog)
        assert spec.prefill_efficiency is not None and spec.sources.get("prefill_efficiency")
        got = prefill_s(graph.ops, spec, 1, 1024, 16, hidden).total_s
        assert got == pytest.approx(seconds, rel=0.03), (gpu, engine, got)


def test_longer_prompts_cost_more_and_attention_grows_quadratically(llama8b):
    graph, hidden = llama8b
    gpu = get_gpu("h100", load_catalog())
    times = [prefill_s(graph.ops, gpu, 1, isl, 1, hidden).total_s for isl in (512, 1024, 2048, 8192)]
    assert times == sorted(times) and times[-1] > 16 * times[0] * 0.9  # GEMMs linear, attention more
    attn = next(op for op in graph.ops if op.kind == OpKind.ATTN_FULL)
    math = [prefill_op_s(attn, gpu, 1, isl)[2] for isl in (1024, 2048, 4096)]
    assert math[1] / math[0] == pytest.approx(4, rel=0.05) and math[2] / math[1] == pytest.approx(4, rel=0.05)
    gemm = next(op for op in graph.ops if op.kind == OpKind.MLP_DOWN)
    assert prefill_op_s(gemm, gpu, 1, 2048)[2] == pytest.approx(2 * prefill_op_s(gemm, gpu, 1, 1024)[2])


def test_the_lm_head_sees_each_prompts_last_token_only(llama8b):
    graph, _ = llama8b
    gpu = get_gpu("h100", load_catalog())
    head = next(op for op in graph.ops if op.kind == OpKind.LM_HEAD)
    assert prefill_op_s(head, gpu, 1, 4096)[2] == pytest.approx(prefill_op_s(head, gpu, 1, 16)[2])
    assert prefill_op_s(head, gpu, 1, 64, prompts=8)[2] == pytest.approx(8 * prefill_op_s(head, gpu, 1, 64)[2])


def test_tp_divides_the_math_and_the_efficiency_sets_the_flops(llama8b):
    graph, hidden = llama8b
    gpu = get_gpu("h100", load_catalog())
    one = prefill_s(graph.ops, gpu, 1, 2048, 1, hidden)
    two = prefill_s(graph.ops, gpu, 2, 2048, 1, hidden)
    assert two.math_s == pytest.approx(one.math_s / 2, rel=0.02) and two.communication_s > 0 == one.communication_s
    slow = prefill_s(graph.ops, dataclasses.replace(gpu, prefill_efficiency=gpu.prefill_efficiency / 2), 1, 2048, 1,
                     hidden)
    assert slow.math_s == pytest.approx(2 * one.math_s)
    with pytest.raises(ValueError):
        prefill_s(graph.ops, gpu, 1, 0)


def test_estimate_reports_ttft_for_an_isl(capsys):
    from opweave.cli import main

    assert main(["estimate", "llama-3.1-8b", "--gpu", "h100", "--batch", "1,16", "--isl", "1k", "--format",
                 "json"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["isl"] for p in points] == [1024, 1024]
    assert points[0]["ttft_ms"] == points[1]["ttft_ms"] and 15 < points[0]["ttft_ms"] < 60
    assert main(["estimate", "llama-3.1-8b", "--gpu", "h100"]) == 0
    assert "TTFT" not in capsys.readouterr().out
    assert main(["estimate", "llama-3.1-8b", "--gpu", "h100", "--isl", "8k"]) == 0
    assert "TTFT ms (isl 8192)" in capsys.readouterr().out
    assert main(["estimate", "llama-3.1-8b", "--gpu", "h100", "--isl", "0"]) == 2
    assert "--isl" in capsys.readouterr().err


def test_compile_with_a_workload_carries_its_ttft_and_derives_the_context(tmp_path, capsys):
    """`compile --isl --osl`: the plan records the workload and the TTFT of one prompt through its
    stages (longer prompts, longer TTFT), the context is isl + osl unless given, and plan.json reads
    back; half a workload or no context at all is a one-line error."""
    from opweave.cli import main
    from opweave.ir.plan import plan_from_json

    ttft, cost = {}, {}
    for isl in (512, 4096):
        out = tmp_path / f"art{isl}"
        assert main(["compile", "llama-3.1-8b", "--cluster", "h100x2", "--tpot-slo", "50ms", "--isl", str(isl),
                     "--osl", "256", "--templates", "colocated", "-o", str(out), "--quiet", "--format", "json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert (data["isl"], data["osl"], data["context"]) == (isl, 256, isl + 256)
        plan = plan_from_json(json.loads((out / "plan.json").read_text()))
        assert (plan.isl, plan.osl) == (isl, 256) and plan.ttft_ms == data["ttft_ms"] > 0
        assert plan.ttft_p99_ms > plan.ttft_ms > plan.ttft_idle_ms > 0 and plan.prefill["mode"] == "aggregated"
        assert "workload: prompts of" in (out / "plan.txt").read_text()
        ttft[isl], cost[isl] = plan.ttft_idle_ms, plan.predicted.cost_per_mtok_usd
    assert ttft[4096] > 2 * ttft[512]  # 8x the tokens (the longer context may take another TP degree)
    assert cost[4096] > cost[512]      # a longer prompt costs more per output token
    assert main(["compile", "llama-3.1-8b", "--cluster", "h100x2", "--tpot-slo", "50ms", "--isl", "512",
                 "-o", str(tmp_path / "x")]) == 2
    assert "--isl and --osl go together" in capsys.readouterr().err
    assert main(["compile", "llama-3.1-8b", "--cluster", "h100x2", "--tpot-slo", "50ms", "-o", str(tmp_path / "y")]) == 2
    assert "--context is required" in capsys.readouterr().err
    assert main(["compile", "llama-3.1-8b", "--cluster", "h100x2", "--tpot-slo", "50ms", "--isl", "4k", "--osl", "1k",
                 "--context", "2k", "-o", str(tmp_path / "z")]) == 2
    assert "exceeds --context" in capsys.readouterr().err


def test_calibrate_fits_the_prefill_efficiency_to_prefill_rows(tmp_path, capsys):
    """`opweave calibrate` of a file of prefill rows: the published LLM-Inference-Bench prefills
    give back the catalog's efficiencies; twice the times give about half; bad rows are one line."""
    from opweave.cli import main

    data = os.path.join(os.path.dirname(__file__), "..", "bench", "data", "prefill-measurements.csv")
    out = tmp_path / "cat.json"
    assert main(["calibrate", data, "-o", str(out), "--format", "json"]) == 0
    fits = {f["gpu"]: f for f in json.loads(capsys.readouterr().out)["prefill"]}
    catalog = load_catalog()
    for name in ("h100", "a100"):
        assert fits[name]["efficiency"] == pytest.approx(catalog[name].prefill_efficiency, rel=0.02)
        assert all(abs(r["after_ms"] / r["measured_ms"] - 1) < 0.05 for r in fits[name]["rows"])
    assert json.loads(out.read_text())["h100"]["prefill_efficiency"] == pytest.approx(fits["h100"]["efficiency"])
    slow = tmp_path / "slow.csv"
    slow.write_text("gpu,model,tp,batch,isl,ttft_ms\nh100,llama-3.1-8b,1,16,1024,830\nh100,llama-3.1-8b,1,4,2048,500\n")
    assert main(["calibrate", str(slow), "-o", str(tmp_path / "slow.json"), "--format", "json"]) == 0
    (fit,) = json.loads(capsys.readouterr().out)["prefill"]
    assert fit["efficiency"] < 0.7 * catalog["h100"].prefill_efficiency
    for text, needle in (("gpu,model,tp,batch,prefill_ms\nh100,llama-3.1-8b,1,1,5\n", "missing column"),
                         ("gpu,model,tp,batch,isl,prefill_ms\nh100,llama-3.1-8b,0,1,8,5\n", "line 2: tp"),
                         ("gpu,model,tp,batch,isl,prefill_ms\nh100,llama-3.1-8b,1,1,8,-5\n", "positive"),
                         ("gpu,model,tp,batch,isl,prefill_ms\n", "no measurements")):
        bad = tmp_path / "bad.csv"
        bad.write_text(text)
        assert main(["calibrate", str(bad), "-o", str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
