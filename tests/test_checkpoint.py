"""Checkpoint loading: sharded safetensors with an index, and reading only the tensors asked for."""

import pytest
import json
import os

import torch
from safetensors.torch import save_file

from hf_fixtures import make_tiny_checkpoint
from opweave.models.checkpoint import CheckpointReader
from opweave.models.model import generate
from opweave.models.registry import resolve

PROMPT = list(range(5, 25))


@pytest.mark.slow
def test_sharded_checkpoint_loads_like_single_file(tmp_path, tiny_checkpoint):
    single = tiny_checkpoint("qwen3_moe", num_hidden_layers=3)
    sharded = make_tiny_checkpoint("qwen3_moe", str(tmp_path / "sharded"), num_hidden_layers=3, max_shard_size="40KB")
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    a_logits, a_tokens = generate(resolve(single).load(), PROMPT, 4)
    b_logits, b_tokens = generate(resolve(sharded).load(), PROMPT, 4)
    torch.testing.assert_close(a_logits, b_logits, atol=1e-5, rtol=0)  # same weights; BLAS may differ in the last bit
    assert a_tokens == b_tokens


def test_reads_only_needed_tensors(tmp_path, tiny_checkpoint, monkeypatch):
    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    # an extra tensor the model does not use (like the MTP weights real Qwen3-Next checkpoints carry)
    save_file({"mtp.layers.0.weight": torch.zeros(4, 4)}, os.path.join(folder, "extra.safetensors"))
    read: list[str] = []
    original = CheckpointReader.get

    def spy(self, key, shape=None):
        read.append(key)
        return original(self, key, shape)

    monkeypatch.setattr(CheckpointReader, "get", spy)
    model = resolve(folder).load()
    expected = {w for m in model.op_modules() for w in m.weight_keys.values()}
    assert set(read) == expected and len(read) == len(expected)

    # one operator reads only its own tensors
    read.clear()
    attn_block = model.layers[1].mixer
    attn_block.qkv.load_weights(CheckpointReader(folder))
    assert sorted(read) == sorted(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
