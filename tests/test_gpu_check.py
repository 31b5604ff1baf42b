"""bench/gpu_check.py in --cpu-smoke mode: every part reports, none fails, and a failing part is one
FAIL line while the other parts still run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
PARTS = ["env", "kernels", "attention", "memory", "run", "tpot", "graph", "quant", "stored"]

pytest.importorskip("triton")


def _smoke(tmp_path, *extra):
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=3600, cwd=ROOT)  # a hang guard, no budget
    return proc, out


@pytest.mark.slow
def test_cpu_smoke_runs_every_part(tmp_path):
    proc, out = _smoke(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert list(report["parts"]) == PARTS
    status = {name: part["status"] for name, part in report["parts"].items()}
    assert "FAIL" not in status.values(), status
    # the CPU-capable parts ran; the CUDA-only ones say why they did not
    assert {n for n, s in status.items() if s == "PASS"} == {"env", "kernels", "memory", "run", "tpot", "quant"}
    assert report["parts"]["tpot"]["figures"]["predicted_tpot_ms"] > 0
    assert "CUDA" in report["parts"]["attention"]["summary"] and "CUDA" in report["parts"]["stored"]["summary"]
    kernels = report["parts"]["kernels"]["figures"]
    assert {c["kernel"] for c in kernels["cases"]} >= {"rms_norm", "rope", "decode_attention", "gdn_step",
                                                       "gated_act", "moe_route", "moe_experts", "argmax"}
    assert all(c["ok"] for c in kernels["cases"])
    assert report["parts"]["env"]["figures"]["copy_gbps"] > 0
    assert report["parts"]["run"]["figures"]["cpu_tokens"][0]
    lines = [ln for ln in proc.stdout.splitlines() if ln.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert len(lines) == len(PARTS)


@pytest.mark.slow
def test_a_failing_part_is_one_fail_line_and_the_rest_runs(tmp_path):
    proc, out = _smoke(tmp_path, "--parts", "env,kernels,attention", "--fail-part", "kernels")
    assert proc.returncode == 1
    report = json.loads(out.read_text())
    status = {name: part["status"] for name, part in report["parts"].items()}
    assert status == {"env": "PASS", "kernels": "FAIL", "attention": "SKIP"}
    fail_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL ")]
    assert fail_lines == ["FAIL kernels: RuntimeError: failure injected into part kernels (--fail-part)"]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_judge_rejects_a_wrong_kernel_output():
    """The bf16 judge fails an output farther from the fp32 oracle than the bf16 reference is."""
    import torch
    gpu_check = _gpu_check_module()
    oracle = torch.randn(64, 128)
    ref = oracle.to(torch.bfloat16)
    assert gpu_check._judge("rms_norm", torch.bfloat16, ref.clone(), ref, oracle)["ok"]
    wrong = (oracle * 1.05).to(torch.bfloat16)
    assert not gpu_check._judge("rms_norm", torch.bfloat16, wrong, ref, oracle)["ok"]
    assert not gpu_check._judge("rms_norm", torch.float32, oracle + 1e-2, oracle, oracle)["ok"]
    assert not gpu_check._judge("argmax", torch.float32, torch.tensor([1, 2]), torch.tensor([1, 3]),
                                torch.tensor([1, 3]))["ok"]


def test_unknown_part_is_a_one_line_error(tmp_path):
    proc, _ = _smoke(tmp_path, "--parts", "nope")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: unknown part(s) nope (known: env, kernels, attention, "
                                                "memory, run, tpot, graph, quant, stored)"]


def _gpu_check_module():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


@pytest.mark.slow
def test_attention_bench_logic_on_cpu():
    """The attention part's measurement (Triton under the interpreter vs SDPA) at tiny sizes."""
    import torch
    summary, fig = _gpu_check_module().attention_bench("cpu", [(2, 48), (1, 64)], copy=10.0, dtype=torch.float32,
                                                        hq=4, hkv=2, d=16, repeats=1)
    assert [(c["batch"], c["context"]) for c in fig["cases"]] == [(2, 48), (1, 64)]
    case = fig["cases"][1]
    assert case["kv_bytes"] == 2 * 64 * 2 * 16 * 4
    assert case["triton_ms"] > 0 and case["sdpa_ms"] > 0 and case["target"] == "<= 1.5x SDPA"
    assert summary.count("GB/s") == 3
    assert all(c["max_abs_diff_vs_sdpa"] < 1e-4 for c in fig["cases"])


def test_round_times_parses_the_standalone_module_line():
    """The graph part reads the figures of `python3 ART/rank_XX.py` (opweave.runtime.standalone)."""
    gpu_check = _gpu_check_module()
    cpu = "rank_00 on cpu: 116 ops, 1 microbatch(es) of 4 rows: median 5.500 ms per decode round over 20 rounds"
    assert gpu_check.round_times(cpu) == (5.5, None)
    assert gpu_check.round_times(cpu.replace("on cpu", "on cuda") + "; as a CUDA graph 0.125 ms") == (5.5, 0.125)
    with pytest.raises(RuntimeError, match="unexpected output"):
        gpu_check.round_times("Traceback (most recent call last):")
