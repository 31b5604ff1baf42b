"""The theorems of summary §3 checked numerically on random hardware and models, and the analysis
of real models against hand-computed figures."""

import functools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opweave.cost import analysis as A
from opweave.cost.estimate import estimate_point
from opweave.hardware.catalog import get_gpu, load_catalog
from opweave.ir.kinds import OpClass
from opweave.passes.trace import build_graph
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


# ---------------------------------------------------------------- Theorem 3.2 in a price ratio


gpu_seconds = st.tuples(pos, pos)  # (memory-bound side, GEMM side) GPU-seconds per token of one type


@given(gpu_seconds, gpu_seconds, pos)
def test_g_het_at_price_is_the_scalar_core_on_prices(first, second, ratio):
    # the same two types given to the scalar core as (price/s, B, F) for a state of m bytes and f FLOPs
    m, f, c = 3.0, 7.0, 0.5
    triples = [(c, m / first[0], f / first[1]), (c * ratio, m / second[0], f / second[1])]
    assert A.g_het_at_price(first, second, ratio) == pytest.approx(A.g_het(m, f, triples), rel=1e-9)
    assert A.g_het_at_price(first, second, ratio) >= 1 - 1e-9


@given(gpu_seconds, gpu_seconds)
def test_g_het_peaks_at_the_price_crossing(first, second):
    cross = A.price_crossing(first, second)
    # the homogeneous costs are equal there, and the cheaper type swaps across it
    assert sum(first) == pytest.approx(cross * sum(second), rel=1e-9)
    assert 0.99 * cross * sum(second) < sum(first) < 1.01 * cross * sum(second)
    ratios = sorted([cross * 2 ** (k / 4) for k in range(-24, 25)])
    values = [A.g_het_at_price(first, second, r) for r in ratios]
    peak = A.g_het_at_price(first, second, cross)
    tol = 1e-9
    assert all(v <= peak * (1 + tol) for v in values)
    middle = ratios.index(cross)
    assert all(values[i] <= values[i + 1] * (1 + tol) for i in range(middle))
    assert all(values[i] >= values[i + 1] * (1 - tol) for i in range(middle, len(values) - 1))


@given(gpu_seconds, st.floats(1.01, 10), st.floats(1.01, 10), pos)
def test_g_het_at_price_is_one_when_a_type_dominates_at_that_price(first, byte_edge, flop_edge, ratio):
    # the second type, at `ratio`, is cheaper per byte and per FLOP than the first: nothing to mix
    second = (first[0] / (byte_edge * ratio), first[1] / (flop_edge * ratio))
    assert A.g_het_at_price(first, second, ratio) == pytest.approx(1.0, rel=1e-9)


# ---------------------------------------------------------------- real models


@functools.cache
def graph(name):
    return build_graph(resolve(name).build("meta"))


def test_tp_scan_is_the_planners():
    from opweave.passes.search import WIDE_TP, SearchOptions

    assert A.TP_SCAN + WIDE_TP == SearchOptions().tp_degrees


@pytest.mark.slow
def test_marginal_batch_is_compute_bound_for_every_gemm_on_every_catalog_gpu():
    from opweave.cost.model import op_times

    g = graph("gemma-3-27b")
    gemms = [op for op in g.ops if op.cls == OpClass.GEMM]
    for gpu in load_catalog().values():
        for op in gemms:
            weights_s, _, math_s = op_times(op, gpu, 1, A.MARGINAL_BATCH, 8192)
            assert math_s > weights_s, (gpu.name, op.name)


@pytest.fixture(scope="module")
def gemma_h100():
    h100 = get_gpu("h100", load_catalog())
    return h100, A.analyze(graph("gemma-3-27b"), [h100], [8192, 32768, 131072])


@pytest.mark.slow
def test_gemma3_colocated_tp_is_the_cheapest_at_its_memory_limited_batch(gemma_h100):
    h100, result = gemma_h100
    g = graph("gemma-3-27b")
    for point in result.points:
        p = point.gpus[0]
        assert [t.tp for t in p.tp_scan] == [1, 2, 4, 8]
        for t in p.tp_scan:  # b_max is the largest batch the estimate says fits, its cost the estimate's
            assert estimate_point(g, h100, t.tp, t.b_max, point.context).fits
            assert not estimate_point(g, h100, t.tp, t.b_max + 1, point.context).fits
            assert t.cost_colocated == pytest.approx(
                estimate_point(g, h100, t.tp, t.b_max, point.context).cost_per_mtok_usd, rel=1e-12)
        chosen = min(p.tp_scan, key=lambda t: t.cost_colocated)
        assert p.tp == chosen.tp and p.cost_colocated == chosen.cost_colocated
        ods = min(p.tp_scan, key=lambda t: t.cost_hom_ods)  # TP 1: no all-reduces, nothing replicated
        assert p.ods_tp == ods.tp == 1 and p.cost_hom_ods == ods.cost_hom_ods
        assert p.g_hom == pytest.approx(p.cost_colocated / p.cost_hom_ods) == chosen.g_hom
        # TP 1 is memory-starved (b_max 14, 5, 1): the baseline really runs on a larger group
        assert p.tp >= 4 and p.tp_scan[0].b_max <= 14
        usable = h100.usable_memory_bytes
        assert p.tp_scan[0].g_hom_bound == pytest.approx(usable / (usable - g.weight_bytes))
        assert p.g_hom_bound == pytest.approx(usable / (usable - chosen.terms.weight_bytes)) and p.g_hom_bound < 1.3


def test_gemma3_closed_form_under_the_cost_model_and_within_theorem_3_1(gemma_h100):
    _, result = gemma_h100
    for point in result.points:
        for t in point.gpus[0].tp_scan:
            assert t.b_rel >= t.b_max >= 1
            assert t.cost_hom_ods <= t.cost_colocated_closed * (1 + 1e-9)
            assert t.cost_colocated_closed <= t.cost_colocated * (1 + 1e-9)  # no fixed costs, one max per step
            assert 1 - 1e-9 <= t.g_hom_closed <= t.g_hom_bound
            if t.b_rel >= t.b_star:
                assert t.g_hom_closed == pytest.approx(1.0, rel=1e-9)
            else:
                assert t.g_hom_closed > 1
    for tp in range(4):  # Theorem 3.1: on one group, G_hom grows with the context
        gains = [p.gpus[0].tp_scan[tp].g_hom_closed for p in result.points]
        assert gains == sorted(gains)


@pytest.mark.slow
def test_hom_ods_is_the_cost_models_marginal_cost():
    h100 = get_gpu("h100", load_catalog())
    g = graph("llama-3.1-8b")
    t = next(t for t in A.tp_scan(g, h100, 8192) if t.tp == 2)
    big = [estimate_point(g, h100, 2, b, 8192) for b in (4096, 8192)]
    added = (big[1].tpot_s - big[0].tpot_s) / 4096  # step time (TPOT) per added sequence
    assert t.cost_hom_ods == pytest.approx(2 * h100.price_per_second * added * 1e6, rel=1e-6)
    assert t.cost_hom_ods < big[1].cost_per_mtok_usd  # the fixed costs are amortised away


@pytest.mark.slow
def test_qwen3_next_needs_tensor_parallel_weights_and_has_hybrid_note():
    catalog = load_catalog()
    result = A.analyze(graph("qwen3-next-80b-a3b"), [get_gpu("h100", catalog), get_gpu("a100", catalog)],
                       [4096, 8192])
    for point in result.points:
        for p in point.gpus:
            assert p.tp >= 2 and p.tp_scan[0].b_max == 0  # 159 GB of weights
        assert point.g_het_ideal >= 1 - 1e-9  # Theorem 3.2 (no split given: no bound)
        assert point.split is None and point.g_het is None
    assert "hybrid attention" in result.hybrid_note


@pytest.mark.slow
def test_price_sweep_agrees_with_the_analysis_and_peaks_at_its_crossing():
    catalog = load_catalog()
    h100, l40s = get_gpu("h100", catalog), get_gpu("l40s", catalog)
    g, s = graph("qwen3-32b"), 8192
    actual = l40s.price_per_hour / h100.price_per_hour
    sweep = A.price_sweep(g, s, h100, l40s, [0.05, 0.1, actual, 0.5, 1.0, 2.0])
    point = A.analyze(g, [h100, l40s], [s]).points[0]
    assert (sweep.first_tp, sweep.second_tp) == tuple(p.ods_tp for p in point.gpus)
    assert sweep.g_het[2] == pytest.approx(point.g_het_ideal, rel=1e-9)
    assert 0.1 < sweep.crossing_ratio < 0.5 and sweep.peak_g_het > 1.01  # the two types trade off there
    assert all(1 - 1e-9 <= v <= sweep.peak_g_het for v in sweep.g_het)
    assert [b for r, b in zip(sweep.ratios, sweep.best_hom)] == [
        "l40s" if r < sweep.crossing_ratio else "h100" for r in sweep.ratios]
    with pytest.raises(ValueError, match="positive"):
        A.price_sweep(g, s, h100, l40s, [1.0, 0.0])


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
