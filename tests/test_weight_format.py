"""Published weight formats (`quantization_config`): planned as stored, refused when loaded."""

from __future__ import annotations

import json
import os

import pytest

from opweave.compiler.frontend import run_front_end
from opweave.errors import OpWeaveError
from opweave.ir import tp as tp_table
from opweave.models.config import weight_format
from opweave.models.hf_config import config_from_hf
from opweave.models.registry import resolve

GPT_OSS_QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def test_which_tensors_each_format_converts():
    mx = weight_format(GPT_OSS_QUANT, "cfg")
    assert mx.converts("model.layers.3.mlp.experts.gate_up_proj", 3)
    assert not mx.converts("model.layers.3.self_attn.q_proj.weight", 2)        # modules_to_not_convert
    assert not mx.converts("model.layers.3.mlp.experts.down_proj_bias", 2)    # biases never
    fp8 = weight_format(FP8, "cfg")
    assert fp8.converts("model.layers.3.self_attn.kv_b_proj.weight", 2)
    assert fp8.converts("model.layers.3.mlp.gate_proj.weight", 2)
    for key in ("model.layers.3.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
                "model.layers.3.self_attn.kv_a_layernorm.weight"):
        assert not fp8.converts(key, 2), key                                 # router, embeddings, norms
    assert not fp8.converts("model.layers.3.mlp.gate.e_score_correction_bias", 1)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "awq"}, "unsupported quantization_config quant_method 'awq'"),
    (dict(FP8, weight_block_size=[64, 64]), "supported: e4m3 with 128x128 blocks"),
    ("fp8", "unsupported quantization_config quant_method None"),
])
def test_unsupported_formats_are_one_line_errors(quant, message):
    with pytest.raises(OpWeaveError, match=message) as err:
        weight_format(quant, "cfg")
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_published_formats_set_the_planned_bytes():
    """gpt-oss-120b as published: MXFP4 experts (4.25 bits with their scales), the rest bf16 --
    about 65 GB, the size of the published checkpoint; DeepSeek-V3 in fp8 (checked to the byte in
    test_deepseek_v3_parity). The same configs without quantization_config plan bf16."""
    path = os.path.join(os.path.dirname(resolve("gpt-oss-120b").path), "gpt-oss-120b.json")
    with open(path) as f:
        raw = json.load(f)
    published = run_front_end("gpt-oss-120b").graph
    experts = [w for op in published.ops for w in op.weights if w.dtype == "mxfp4"]
    assert experts and all("experts" in w.name for w in experts)
    assert 60e9 < published.weight_bytes < 70e9
    bf16 = config_from_hf({k: v for k, v in raw.items() if k != "quantization_config"}, "gpt-oss-120b")
    assert bf16.weight_format is None
    # the TP table splits the stored bytes like the values: a rank holds a quarter of an MXFP4
    # expert op at TP 4, plus its biases that are not split (0.1%)
    op = next(op for op in published.ops if any(w.dtype == "mxfp4" for w in op.weights))
    assert op.weight_bytes / 4 < tp_table.weight_bytes_per_rank(op, 4) < op.weight_bytes / 4 * 1.01


def test_a_quantized_config_over_dense_weights_loads_them(tiny_checkpoint, tmp_path):
    """A checkpoint whose config names fp8 but whose tensors are dense (no scales) reads them as
    they are: the dequantizing reader only touches tensors stored quantized
    (`tests/test_quantized_checkpoints.py` has the published layouts)."""
    folder = tiny_checkpoint("llama")
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    quantized = tmp_path / "fp8"
    quantized.mkdir()
    raw["quantization_config"] = FP8
    (quantized / "config.json").write_text(json.dumps(raw))
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(folder, name), quantized / name)
    source = resolve(str(quantized))
    assert source.cfg.weight_format.method == "fp8"
    model = source.load()
    assert sum(p.numel() for p in model.parameters()) > 0