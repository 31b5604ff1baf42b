"""The theorems of summary §3 checked numerically on random hardware and models, and the analysis
of real models against hand-computed figures."""

import functools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opweave.cost import analysis as A
from opweave.hardware.catalog import get_gpu, load_catalog
from opweave.ir.trace import build_graph
from opweave.models.registry import resolve

pos = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)


@st.composite
def setups(draw):
    """A GPU (M, B, F) and a model (M_w, W <= M_w, f) at scale-free magnitudes."""
    memory = draw(st.floats(10, 200))
    weights = draw(st.floats(0.01, 0.99)) * memory
    gemm_weights = draw(st.floats(0.5, 1.0)) * weights
    return dict(memory=memory, weights=weights, gemm_weights=gemm_weights, flops_tok=draw(pos),
                bandwidth=draw(pos), flops=draw(pos))


def g_hom(p, state):
    b = A.relaxed_batch(p["memory"], p["weights"], state)
    col = A.colocated_time(b, state, p["gemm_weights"], p["flops_tok"], p["bandwidth"], p["flops"])
    return col / A.hom_time(state, p["flops_tok"], p["bandwidth"], p["flops"]), b


@given(setups(), pos)
def test_g_hom_is_one_when_colocated_batch_reaches_b_star(p, state):
    g, b = g_hom(p, state)
    bstar = A.b_star(p["gemm_weights"], p["flops_tok"], p["bandwidth"], p["flops"])
    if b >= bstar:
        assert g == pytest.approx(1.0, rel=1e-9)
    else:
        assert g > 1.0 - 1e-9


@given(setups(), pos, pos)
def test_g_hom_non_decreasing_in_state_and_bounded(p, s1, s2):
    lo, hi = sorted((s1, s2))
    g_lo, _ = g_hom(p, lo)
    g_hi, _ = g_hom(p, hi)
    assert g_lo <= g_hi * (1 + 1e-9)
    bound = p["memory"] / (p["memory"] - p["weights"])
    assert g_hi <= bound * (1 + 1e-9)


gpu_triples = st.lists(st.tuples(pos, pos, pos), min_size=2, max_size=4)


@given(gpu_triples, pos, pos)
def test_g_het_at_least_one(gpus, state, flops_tok):
    assert A.g_het(state, flops_tok, gpus) >= 1 - 1e-9


@given(gpu_triples, pos, pos, st.floats(1.01, 10), st.floats(1.01, 10))
def test_g_het_one_when_a_type_dominates(gpus, state, flops_tok, byte_edge, flop_edge):
    # make type 0 strictly cheaper per byte and per FLOP than every other type
    c0, b0, f0 = gpus[0]
    gpus = [gpus[0]] + [(c, min(b, c * b0 / (c0 * byte_edge)), min(f, c * f0 / (c0 * flop_edge)))
                        for c, b, f in gpus[1:]]
    assert A.g_het(state, flops_tok, gpus) == pytest.approx(1.0, rel=1e-9)


@given(gpu_triples, pos)
def test_g_het_unimodal_in_kv_traffic(gpus, flops_tok):
    values = [A.g_het(10 ** (k / 8), flops_tok, gpus) for k in range(-48, 49)]
    peak = values.index(max(values))
    tol = 1e-9
    assert all(values[i] <= values[i + 1] * (1 + tol) for i in range(peak))
    assert all(values[i] >= values[i + 1] * (1 - tol) for i in range(peak, len(values) - 1))


# ---------------------------------------------------------------- real models


@functools.cache
def graph(name):
    return build_graph(resolve(name).build("meta"))


def test_gemma3_on_h100_matches_hand_computation():
    h100 = get_gpu("h100", load_catalog())
    g = graph("gemma-3-27b")
    result = A.analyze(g, [h100], [8192, 32768, 131072])
    usable = h100.usable_memory_bytes
    for point in result.points:
        p = point.gpus[0]
        assert p.tp == 1
        assert p.b_max == math.floor((usable - g.weight_bytes) / g.state_bytes(point.context))
        assert p.regime == "memory-bound" and p.b_star > 200
        assert p.g_hom_bound == pytest.approx(usable / (usable - g.weight_bytes))
        assert 1 < p.g_hom <= p.g_hom_bound
    gains = [p.gpus[0].g_hom for p in result.points]
    assert gains == sorted(gains)


def test_qwen3_next_needs_tensor_parallel_weights_and_has_hybrid_note():
    catalog = load_catalog()
    result = A.analyze(graph("qwen3-next-80b-a3b"), [get_gpu("h100", catalog), get_gpu("a100", catalog)],
                       [4096, 131072])
    for point in result.points:
        assert all(p.tp >= 2 for p in point.gpus)  # 159 GB of weights
        assert point.g_het >= 1
    assert "hybrid attention" in result.hybrid_note


def test_per_op_flops_and_bytes_sum_to_model_totals():
    from opweave.cost.model import op_bytes, op_flops

    g = graph("llama-3.1-8b")
    s, b = 4096, 8
    assert sum(op_flops(op, 1, b, s) for op in g.ops) == b * g.flops_per_token(s)
    total = sum(op_bytes(op, 1, b, s) for op in g.ops)
    embed = g.ops[0]
    expected = (g.weight_bytes - embed.weight_bytes + embed.weight_bytes * b / embed.weights[0].shape[0]
                + b * sum(op.act_bytes_per_token for op in g.ops) + b * g.state_bytes(s))
    assert total == pytest.approx(expected)
