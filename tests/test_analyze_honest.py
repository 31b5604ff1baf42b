"""`opweave analyze` says what its figures are (docs/analysis.md): the closed form's bound is named
for what it bounds and never shown exceeded without a reason; G_het counts what a plan of the
split pays (the network, memory, the TPOT SLO), so it bounds the plans the search finds and drops
when the NICs slow down; `--plan` prints the search's gain beside it."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import re

import pytest

from opweave.cli import main
from opweave.cli.costs import planner_splits
from opweave.compiler.compile import compile_model
from opweave.compiler.frontend import run_front_end
from opweave.compiler.pinned import pinned_plan
from opweave.cost import analysis as A
from opweave.cost.model import CostModel
from opweave.cost.report import ABOVE_BOUND_NOTE, SearchedPlan, compare_plan, format_analysis
from opweave.cost.split import SplitLimits, best_split, op_groups, rows_grid, split_bound
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import get_gpu, load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.passes.search import DEFAULT_MAX_BATCH, SearchOptions

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "analysis.md")
SLO = 0.1


@functools.cache
def front_end(model: str):
    return run_front_end(model)


def trade_catalog_file(tmp_path) -> str:
    """The catalog of docs/analysis.md's two made-up GPU types that trade bandwidth for compute
    (the docs' YAML block, so the docs' example is what is tested)."""
    text = open(DOC).read()
    block = re.search(r"```yaml\n(# trade\.yaml.*?)```", text, re.S)
    assert block, "docs/analysis.md has no trade.yaml block"
    path = tmp_path / "trade.yaml"
    path.write_text(block.group(1))
    return str(path)


@pytest.fixture
def trade(tmp_path):
    path = trade_catalog_file(tmp_path)
    return path, load_catalog(path)


def with_nic(gpu, bandwidth: float):
    return dataclasses.replace(gpu, inter_link_bandwidth=bandwidth, network=None)


def het(model: str, gpus, contexts, slo: float = SLO) -> A.Analysis:
    fe = front_end(model)
    return A.analyze(fe.graph, list(gpus), list(contexts), limits=SplitLimits(tpot_slo_s=slo),
                     splits=planner_splits(fe))


def _table(text: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the table whose header line starts with `first_header`."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(first_header))
    header = re.split(r"\s{2,}", lines[i].strip())
    rows = []
    for line in lines[i + 2:]:
        if not re.match(r"\d+k?\s", line):  # rows start with a context; notes with "8k: "
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return header, rows


def _value(cell: str) -> float:
    return float(cell.rstrip("*").lstrip("$"))


# ---------------------------------------------------------------- the closed form's bound


@pytest.mark.slow
def test_the_bound_column_is_the_closed_forms_and_never_exceeded_without_a_reason():
    fe = front_end("gemma-3-27b")
    text = format_analysis(A.analyze(fe.graph, [get_gpu("h100", load_catalog())], [8192, 131072]))
    for first in ("context  state/seq", "context  gpu   tp"):
        header, rows = _table(text, first)
        assert "bound" not in header and "bound(closed)" in header
        g, c, b = header.index("G_hom"), header.index("closed"), header.index("bound(closed)")
        assert b == c + 1  # beside the figure it bounds
        marked = 0
        for row in rows:
            assert _value(row[c]) <= _value(row[b]) + 1e-9  # Theorem 3.1: the closed form under its bound
            above = _value(row[g]) > _value(row[b])
            assert row[g].endswith("*") == above, row  # G_hom above it is marked, and only then
            marked += above
        assert marked  # Gemma-3-27B on H100 has such rows (1.38 vs 1.28 at 8k, TP 4)
    assert ABOVE_BOUND_NOTE in text and "fixed costs" in ABOVE_BOUND_NOTE


# ---------------------------------------------------------------- G_het with the network and memory


@pytest.mark.slow
def test_g_het_counts_the_network_and_memory_and_drops_with_the_nic(trade):
    _, catalog = trade
    fast = [catalog["bw-gpu"], catalog["flop-gpu"]]
    slow = [with_nic(g, g.inter_link_bandwidth / 20) for g in fast]
    one, two = (het("llama-3.1-8b", gpus, [2048, 8192]) for gpus in (fast, slow))
    for p, q in zip(one.points, two.points):
        for point in (p, q):
            assert point.cost_split >= point.cost_het_ods * (1 - 1e-9)  # never below Theorem 3.2's ideal
            assert point.g_het <= point.g_het_ideal + 1e-9
            assert point.g_het == pytest.approx(min(g.cost_hom_ods for g in point.gpus) / point.cost_split)
            assert point.split.attention_gpu != point.split.rest_gpu and point.split.feasible
        assert p.g_het_ideal == pytest.approx(q.g_het_ideal)  # the ideal does not see the NICs
        assert q.g_het < p.g_het * 0.98 and "network" in q.split.binds
    assert one.points[0].g_het_ideal > 1.9 and one.points[0].g_het < 1.5  # the ideal promises far more


@pytest.mark.slow
def test_where_disaggregation_loses_the_printed_gain_is_at_most_one_and_says_what_binds(capsys):
    # H100 + L40S (400 Gb/s per 8-GPU node): every split across the two types costs more than colocated
    assert main(["analyze", "llama-3.1-8b", "--gpus", "h100,l40s", "--context", "8k", "--tpot-slo", "100ms"]) == 0
    header, rows = _table(capsys.readouterr().out, "context  attention on")
    (row,) = rows
    assert _value(row[header.index("vs colocated")]) <= 1 and _value(row[header.index("G_het")]) <= 1
    assert _value(row[header.index("G_het ideal")]) >= 1  # what Theorem 3.2 alone would have said
    binds = row[header.index("binds")]
    assert binds != "-" and set(binds.split(", ")) <= {"network", "memory", "SLO", "replicas", "bandwidth", "compute"}


@pytest.mark.slow
def test_the_bound_is_below_every_plan_of_its_split(trade):
    """The bound covers the search: the best plan of each two-owner template the search finds on the
    cluster costs at least the bound's least split of that template (either type on either owner),
    and so does every pinned plan of it."""
    _, catalog = trade
    fe = front_end("llama-3.1-8b")
    gpus = [catalog["bw-gpu"], catalog["flop-gpu"]]
    cluster = parse_cluster("bw-gpux32+flop-gpux32", catalog)
    limits = SplitLimits(tpot_slo_s=SLO)
    specs = {s.template: s for s in planner_splits(fe)}
    for name, spec in specs.items():
        least = min((best_split(fe.graph, [spec], gpus, 2048, limits, mixed=m) for m in (True, False)),
                    key=lambda b: b.cost_per_token)
        plan = compile_model("llama-3.1-8b", cluster, SLO, 2048, SearchOptions(templates=name), front_end=fe).plan
        assert plan.predicted.cost_per_mtok_usd >= least.cost_per_token * 1e6 * (1 - 1e-9), name
        assert plan.predicted.cost_per_mtok_usd <= least.cost_per_token * 1e6 * 1.5  # and not far off
    rng = random.Random(7)
    bounds: dict = {}
    checked = 0
    while checked < 8:
        name = rng.choice(sorted(specs))
        spec = specs[name]
        att, other = rng.choice([("bw-gpu", "flop-gpu"), ("flop-gpu", "bw-gpu"), ("bw-gpu", "bw-gpu")])
        types = [other, other]
        types[spec.attention_slot] = att
        owners = [(types[k], rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8])) for k in (0, 1)]
        n = rng.choice([1, 2, 4])
        try:
            plan = pinned_plan(fe, cluster, name, owners, batch=n * rng.choice([8, 32, 128, 512]), microbatches=n,
                               context=2048).plan
        except OpWeaveError:
            continue  # does not fit
        if (name, att, other) not in bounds:
            bounds[(name, att, other)] = split_bound(fe.graph, spec, catalog[att], catalog[other], 2048)
        assert plan.predicted.cost_per_mtok_usd >= bounds[(name, att, other)].cost_per_token * 1e6 * (1 - 1e-9)
        checked += 1


# ---------------------------------------------------------------- what the bound is made of


def test_split_limits_are_the_search_grid():
    grid, limits = SearchOptions(), SplitLimits()
    assert limits.microbatches == grid.microbatches and limits.max_replicas == max(grid.replicas)
    assert limits.max_rows == DEFAULT_MAX_BATCH and limits.tp_degrees == A.TP_SCAN
    rows = rows_grid(4096)
    assert rows[:23] == list(range(1, 24)) and rows[-1] == 4096 and rows == sorted(set(rows))
    assert all(b / a <= 2 ** (1 / 16) for a, b in zip(rows[22:], rows[23:]))  # the bound's slack above 23 rows
    assert len(rows) < 200


@pytest.mark.slow
def test_equal_ops_are_costed_once_for_the_same_sum():
    fe = front_end("llama-3.1-8b")
    gpu = get_gpu("h100", load_catalog())
    model = CostModel()
    for spec in planner_splits(fe):
        assert sum(op.cls.value == "ATTN" for op in spec.ops[spec.attention_slot]) == fe.graph.num_layers
        for ops in spec.ops:
            groups = op_groups(ops, model)
            assert len(groups) < len(ops) / 4
            for tp, rows in ((1, 1), (2, 37), (4, 1024)):
                grouped = sum(n * model.op_cost(op, gpu, tp, rows, 8192, 8192, following).total_s
                              for op, following, n, _ in groups)
                assert grouped == pytest.approx(model.ops_latency(ops, gpu, tp, rows, 8192, 8192), rel=1e-9)


# ---------------------------------------------------------------- --plan


def _point(trade_catalog):
    return het("llama-3.1-8b", [trade_catalog["bw-gpu"], trade_catalog["flop-gpu"]], [2048]).points[0]


@pytest.mark.slow
def test_a_searched_gain_above_the_bound_says_why(trade):
    _, catalog = trade
    p = _point(catalog)
    col = 1.0  # $/Mtoken of the searched colocated plan
    bound = col / p.cost_split
    one_type = SearchedPlan(context=2048, cost=col / (2 * max(1.0, bound)), plan="afd: bw-gpu tp1 x1 + bw-gpu tp1 x2",
                            gpu_types=("bw-gpu",), colocated_cost=col)
    c = compare_plan(p, one_type, ("cad", "afd"))
    assert c["gain"] > c["bound"] == pytest.approx(bound)
    assert "above the bound" in c["verdict"] and "bw-gpu alone" in c["verdict"]
    two_types = dataclasses.replace(one_type, plan="general: ...", gpu_types=("bw-gpu", "flop-gpu"))
    verdict = compare_plan(p, two_types, ("cad", "afd"))["verdict"]
    assert "above the bound" in verdict and "not a two-owner cad or afd split" in verdict
    close = dataclasses.replace(two_types, cost=col / (max(1.0, bound) * 0.95))
    assert compare_plan(p, close, ("cad", "afd"))["verdict"].startswith("within 20%")


@pytest.mark.slow
def test_plan_prints_the_searched_gain_beside_the_bound(trade, capsys):
    path, _ = trade
    assert main(["analyze", "tiny-gemma3", "--catalog", path, "--gpus", "bw-gpu,flop-gpu", "--context", "256",
                 "--tpot-slo", "50ms", "--plan"]) == 0
    out = capsys.readouterr().out
    header, rows = _table(out, "context  best plan")
    (row,) = rows
    gain, bound = _value(row[header.index("gain")]), _value(row[header.index("bound")])
    assert gain >= 1 and row[header.index("colocated plan")].startswith("colocated: ")
    searched = out[out.index("Searched plans"):]
    verdict = next(line for line in searched.splitlines() if line.startswith("256: "))
    assert ("within 20%" in verdict) == (abs(max(1.0, bound) - gain) <= 0.2 * gain)
    if gain > max(1.0, bound):
        assert "above the bound" in verdict
    if bound < 1:
        assert "cannot beat colocated" in verdict


@pytest.mark.parametrize("args,message", [
    (["--plan", "--gpus", "h100,l40s"], "--plan needs --tpot-slo"),
    (["--plan", "--gpus", "h100", "--tpot-slo", "50ms"], "give two GPU types"),
    (["--cluster", "h100x8+l40sx8", "--gpus", "h100,a100"], "other GPU types than --cluster"),
])
def test_plan_input_errors_are_one_line(args, message, capsys):
    assert main(["analyze", "tiny-gemma3", "--context", "256", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]

