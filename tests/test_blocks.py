"""Partition blocks: expected structure of real models, and properties on random layer patterns."""

import dataclasses
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.passes.trace import build_graph
from opweave.models.config import FULL, SLIDING
from opweave.models.model import build_model
from opweave.models.registry import resolve
from opweave.passes.blocks import blocks_to_json, find_blocks, format_blocks, smallest_period


@functools.cache
def blocks_of(name: str):
    return find_blocks(build_graph(resolve(name).build("meta")))


@pytest.mark.parametrize("name,period,blocks,tail", [
    ("gemma-3-27b", 6, 10, 2),
    ("qwen3-next-80b-a3b", 4, 12, 0),
    ("llama-3.1-8b", 1, 32, 0),
    ("llama-3.1-70b", 1, 80, 0),
    ("qwen3-30b-a3b", 1, 48, 0),
])
@pytest.mark.slow
def test_real_models(name, period, blocks, tail):
    bg = blocks_of(name)
    assert (bg.period, bg.num_blocks, bg.num_tail_layers) == (period, blocks, tail)
    data = blocks_to_json(bg)
    assert (data["period"], data["num_blocks"], data["num_tail_layers"]) == (period, blocks, tail)


def test_ranges_cover_every_op_once():
    bg = blocks_of("gemma-3-27b")
    ranges = [bg.prologue, *bg.blocks, bg.tail, bg.epilogue]
    covered = [i for r in ranges for i in range(r.first, r.last + 1)]
    assert covered == list(range(len(bg.graph.ops)))
    assert bg.pattern == (SLIDING,) * 5 + (FULL,)
    assert (bg.tail.first_layer, bg.tail.last_layer) == (60, 61)
    assert "10 block(s) + 2 tail layer(s)" in format_blocks(bg)


def _periodic(base, length):
    return [base[i % len(base)] for i in range(length)]


@given(base=st.lists(st.sampled_from("ABC"), min_size=1, max_size=7), repeats=st.integers(1, 6),
       extra=st.integers(0, 6))
def test_smallest_period_properties(base, repeats, extra):
    seq = _periodic(base, len(base) * repeats + min(extra, len(base) - 1))
    p = smallest_period(seq)
    # the sequence repeats with period p ...
    assert all(seq[i] == seq[i % p] for i in range(len(seq)))
    # ... p is no longer than the generating pattern, and no shorter period works
    assert p <= len(base)
    assert not any(all(seq[i] == seq[i % q] for i in range(len(seq))) for q in range(1, p))


def test_smallest_period_examples():
    assert smallest_period(list("SSSSSF" * 10 + "SS")) == 6
    assert smallest_period(list("LLLF" * 12)) == 4
    assert smallest_period(list("AAAA")) == 1
    assert smallest_period(list("ABCD")) == 4  # no repetition: the whole model is one block


TINY_GEMMA = dict(model_type="gemma3_text", vocab_size=64, hidden_size=16, intermediate_size=32,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=4,
                  rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=8)


@settings(max_examples=15, deadline=None)
@given(base=st.lists(st.sampled_from([FULL, SLIDING]), min_size=1, max_size=4), repeats=st.integers(1, 3),
       extra=st.integers(0, 3))
@pytest.mark.slow
def test_blocks_of_traced_models_with_random_layer_patterns(base, repeats, extra):
    from opweave.models.hf_config import config_from_hf

    types = _periodic(base, len(base) * repeats + min(extra, len(base) - 1))
    cfg = config_from_hf({**TINY_GEMMA, "num_hidden_layers": len(types), "layer_types": types}, "tiny")
    bg = find_blocks(build_graph(build_model(cfg, "meta")))
    p = smallest_period(types)  # layers differ only by attention type here
    assert bg.period == p
    assert bg.num_blocks == len(types) // p and bg.num_tail_layers == len(types) % p
    assert bg.pattern == tuple(types[:p])
    # every block has the same op kinds in the same order
    kinds = [tuple(op.kind for op in bg.block_ops(b)) for b in range(bg.num_blocks)]
    assert len(set(kinds)) == 1


def test_layers_with_different_mlp_are_different_positions():
    cfg = resolve("qwen3-30b-a3b").cfg
    cfg = dataclasses.replace(cfg, num_layers=4, layer_types=(FULL,) * 4, mlp_types=("dense", "moe") * 2,
                              intermediate_size=6144)
    bg = find_blocks(build_graph(build_model(cfg, "meta")))
    assert (bg.period, bg.num_blocks) == (2, 2)
