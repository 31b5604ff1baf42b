"""`opweave dump` end to end, and bad input: one line on stderr, exit code 2, no traceback."""

import json
import os
import subprocess
import sys

import pytest

from opweave.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opweave", *args], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_dump_blocks_json_for_qwen3_next():
    out = run_cli("dump", "qwen3-next-80b-a3b", "--what", "blocks", "--format", "json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["period"], data["num_blocks"], data["num_tail_layers"]) == (4, 12, 0)


@pytest.mark.slow
def test_dump_ir_text_and_json(capsys):
    assert main(["dump", "gemma-3-27b", "--what", "blocks"]) == 0
    assert "period 6 layer(s), 10 block(s) + 2 tail layer(s)" in capsys.readouterr().out
    assert main(["dump", "qwen3-30b-a3b", "--what", "ir", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_parameters"] > data["num_active_parameters"] > 0
    assert main(["dump", "llama-3.1-8b"]) == 0
    text = capsys.readouterr().out
    assert "attn_full" in text and "cut bytes/tok" in text


def test_dump_checkpoint_folder_and_model_py(tiny_checkpoint, capsys):
    assert main(["dump", tiny_checkpoint("gemma3", num_hidden_layers=8), "--what", "blocks", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["period"], data["num_blocks"], data["num_tail_layers"]) == (6, 1, 2)
    assert main(["dump", os.path.join(ROOT, "examples", "tiny_gemma3.py"), "--what", "blocks"]) == 0
    assert "period 6 layer(s), 2 block(s)" in capsys.readouterr().out


def _write(path, text):
    path.write_text(text)
    return str(path)


def _bad_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    _write(unsupported / "config.json", json.dumps({"model_type": "gpt2"}))
    missing = tmp_path / "missing"
    missing.mkdir()
    cfg = json.load(open(os.path.join(ROOT, "opweave", "models", "configs", "llama-3.1-8b.json")))
    del cfg["num_attention_heads"]
    _write(missing / "config.json", json.dumps(cfg))
    broken = tmp_path / "broken"
    broken.mkdir()
    _write(broken / "config.json", "{not json")
    return {
        "unknown name": (["nosuchmodel"], "unknown model 'nosuchmodel' (known: "),
        "folder without config.json": ([str(tmp_path / "empty")], "no config.json"),
        "unsupported model_type": ([str(unsupported)], "unsupported model_type 'gpt2'"),
        "missing field": ([str(missing)], "missing required field 'num_attention_heads'"),
        "invalid json": ([str(broken)], "not valid JSON"),
        "model.py without build_model": ([_write(tmp_path / "a.py", "x = 1\n")], "defines no build_model()"),
        "model.py building something else": (
            [_write(tmp_path / "b.py", "import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n")],
            "not an opweave CausalLM"),
        "model.py not traceable": ([_write(tmp_path / "c.py", UNTRACEABLE)], "not traceable with torch.fx"),
        "model.py that raises": ([_write(tmp_path / "d.py", "def build_model():\n    raise ValueError('boom')\n")],
                                 "build_model() failed (ValueError: boom)"),
        "missing model.py": ([str(tmp_path / "none.py")], "no such file"),
        "bad flag": (["llama-3.1-8b", "--what", "kernels"], "invalid choice"),
    }


UNTRACEABLE = '''
import torch
from opweave.models.model import CausalLM
from opweave.models.registry import resolve

class Weird(CausalLM):
    def forward(self, ids, positions):
        if ids.sum() > 0:  # data-dependent control flow
            return super().forward(ids, positions)
        return super().forward(ids, positions)

def build_model():
    with torch.device("meta"):
        return Weird(resolve("llama-3.1-8b").cfg)
'''


@pytest.mark.parametrize("case", ["unknown name", "folder without config.json", "unsupported model_type",
                                  "missing field", "invalid json", "model.py without build_model",
                                  "model.py building something else", "model.py not traceable",
                                  "model.py that raises", "missing model.py", "bad flag"])
@pytest.mark.slow
def test_bad_input_is_one_line_exit_2(tmp_path, case):
    args, message = _bad_inputs(tmp_path)[case]
    out = run_cli("dump", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("opweave: error: ") and message in lines[0], lines[0]
    assert out.stdout == ""


@pytest.mark.slow
def test_analyze_json_carries_the_named_quantities(capsys, tmp_path):
    plot = tmp_path / "g.png"
    assert main(["analyze", "qwen3-next-80b-a3b", "--gpus", "h100,a100", "--context", "4k..128k",
                 "--format", "json", "--plot", str(plot)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["context"] for p in data["points"]] == [4096 * 2 ** i for i in range(6)]
    for p in data["points"]:
        for key in ("context", "b_max", "b_star", "g_hom", "g_hom_bound", "g_het"):
            assert key in p
        assert set(p["gpus"]) == {"h100", "a100"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.iterdir()) == [plot]  # no temporary file left behind


@pytest.mark.slow
def test_analyze_text(capsys):
    assert main(["analyze", "gemma-3-27b", "--gpus", "h100", "--context", "1k..128k"]) == 0
    out = capsys.readouterr().out
    assert "memory-bound" in out and "128k" in out and "CAD on h100" in out


@pytest.mark.parametrize("args,message", [
    (["--gpus", "h10"], "unknown GPU type 'h10'"),
    (["--gpus", "h100,h100"], "lists a GPU type twice"),
    (["--context", "1k..x"], "bad context length 'x'"),
    (["--context", "8k..1k"], "start above end"),
    (["--context", "0"], "positive whole number"),
    (["--plot", "/nonexistent/dir/g.png"], "does not exist"),
])
def test_analyze_bad_input(capsys, args, message):
    assert main(["analyze", "llama-3.1-8b", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_analyze_catalog_override_changes_prices(capsys, tmp_path):
    override = tmp_path / "prices.yaml"
    override.write_text("h100:\n  price_per_hour: 2.0\n")
    assert main(["analyze", "llama-3.1-8b", "--context", "8k", "--format", "json"]) == 0
    default = json.loads(capsys.readouterr().out)["points"][0]["cost_hom_ods_per_mtok"]
    assert main(["analyze", "llama-3.1-8b", "--context", "8k", "--format", "json", "--catalog", str(override)]) == 0
    cheap = json.loads(capsys.readouterr().out)["points"][0]["cost_hom_ods_per_mtok"]
    from opweave.hardware.catalog import get_gpu, load_catalog
    assert cheap == pytest.approx(default * 2.0 / get_gpu("h100", load_catalog()).price_per_hour)
