"""Shared test set-up: tiny Hugging Face checkpoints (random weights, saved once per session)."""

import os
import random
import sys
import zlib

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU in tests
sys.path.insert(0, os.path.dirname(__file__))

FAMILIES = ("llama", "gemma3", "qwen3_moe", "qwen3_next")


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test starts from random state of its own (a hash of its id): the data it draws does not
    depend on which tests ran before it in its process (the suite runs in parallel workers)."""
    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="session")
def published(tmp_path_factory):
    """published(family) -> (source, quantized, twin) folders: a tiny checkpoint of `family` in its
    published quantized format (`hf_fixtures.QUANTIZED_CASES`) and the dense float32 twin it decodes to."""
    from hf_fixtures import QUANTIZED_CASES, make_tiny_checkpoint, quantize_checkpoint

    made = {}

    def make(family: str) -> tuple[str, str, str]:
        if family not in made:
            method, overrides = QUANTIZED_CASES[family]
            root = tmp_path_factory.mktemp(f"published_{family}")
            source = make_tiny_checkpoint(family, str(root / "source"), **overrides)
            made[family] = (source, *quantize_checkpoint(source, method, str(root / method), str(root / "twin")))
        return made[family]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family, **overrides) -> folder with config.json + model.safetensors."""
    from hf_fixtures import make_tiny_checkpoint

    made = {}

    def make(family: str, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:  # the folder (the model's name) depends on the checkpoint only, not on test order
            suffix = "_".join(f"{k}{v}" for k, v in key[1])
            folder = tmp_path_factory.mktemp(f"tiny_{family}{'_' + suffix if suffix else ''}_", numbered=True)
            made[key] = make_tiny_checkpoint(family, str(folder), **overrides)
        return made[key]

    return make
