"""The profiler: measuring a tiny model, the table's file format, interpolation, refusals, and
the cost model's use of measured figures."""

import dataclasses
import json
import os

import pytest
import torch

from opweave.compiler.frontend import run_front_end
from opweave.cost.model import CostModel, intra_bandwidth
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog
from opweave.ir.kinds import OpClass, OpKind
from opweave.profile import OpEntry, ProfileTable, cpu_gpu_spec, interpolate, load_profile, op_signature
from opweave.profile.comm import fit_link
from opweave.profile.measure import profile
from opweave.profile.signature import graph_hash
from opweave.profile.table import FORMAT_VERSION

BATCHES = (1, 2, 4)
CONTEXTS = (16, 64)


@pytest.fixture(scope="module")
def graph():
    return run_front_end("tiny-gemma3", "float32").graph


@pytest.fixture(scope="module")
def measured(graph):
    lines = []
    table = profile("tiny-gemma3", "cpu", batches=BATCHES, contexts=CONTEXTS, tp_degrees=(1, 2),
                    progress=lines.append)
    return table, lines


@pytest.fixture
def table(measured):
    table = measured[0]
    table.reset_counts()
    return table


@pytest.fixture(scope="module")
def saved(measured, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    measured[0].save(str(path))
    return str(path)


# ---------------------------------------------------------------- measuring


@pytest.mark.slow
def test_profile_covers_every_op(table, graph, measured):
    assert table.model == "tiny-gemma3" and table.gpu == "cpu" and table.dtype == "float32"
    assert table.graph_hash == graph_hash(graph)
    assert table.num_threads == 1 and table.device_name and table.torch_version and table.date
    signatures = {op_signature(op) for op in graph.ops}
    assert {e.signature for e in table.entries if e.tp == 1} == signatures
    assert sum(e.num_ops for e in table.entries if e.tp == 1) == len(graph.ops)  # one group per signature
    for e in table.entries:
        assert e.batches == BATCHES and all(x > 0 for row in e.latency_s for x in row)
        is_attn = e.kind in (OpKind.ATTN_FULL.value, OpKind.ATTN_SLIDING.value)
        assert e.contexts == (CONTEXTS if is_attn else ())
    tp2 = {e.kind for e in table.entries if e.tp == 2}
    assert {"qkv_proj", "attn_full", "o_proj", "mlp_gate_up", "mlp_down", "lm_head"} <= tp2
    assert not tp2 & {"embed", "norm", "residual", "final_norm"}  # replicated: measured at TP 1 only
    assert 0 < table.dispatch_s < 1e-3
    assert table.transfer_latency_s > 0 and table.transfer_bandwidth > 0 and len(table.transfer_samples) == 7
    assert table.allreduce_latency_s > 0 and table.allreduce_bandwidth > 0
    assert table.send_host_latency_s > 0 and table.recv_host_latency_s > 0 and len(table.recv_host_samples) == 7
    lines = measured[1]
    assert any(line.startswith("qkv_proj x8 (tp 1") for line in lines) and any("dispatch" in x for x in lines)
    assert any("timed steps of" in line for line in lines)  # ops timed in place, a decode step at a time


def test_rotation_copies_cover_the_cache():
    from opweave.profile.sequence import ROTATE_FACTOR, cache_bytes, rotation_copies

    cpu = torch.device("cpu")
    llc = cache_bytes(cpu)
    assert llc >= 1 << 20
    assert rotation_copies(4 * llc, cpu) == 1                  # one copy already streams past the cache
    assert rotation_copies(llc, cpu) == ROTATE_FACTOR
    assert rotation_copies(1, cpu) == rotation_copies(0, cpu) == 16  # capped


def test_transfer_host_figures(table):
    assert table.transfer_host_s("cpu", "send", 0) == pytest.approx(table.send_host_latency_s)
    big = table.transfer_host_s("cpu", "recv", 1 << 20)
    assert big > table.transfer_host_s("cpu", "recv", 0) > 0
    assert table.transfer_host_s("h100", "send", 1024) is None


def test_every_op_hits_at_tp1_and_sharded_ops_at_tp2(table, graph):
    for op in graph.ops:
        assert table.op_latency(op, "cpu", 1, 2, 64) > 0
        assert table.op_latency(op, "cpu", 2, 2, 64) > 0  # replicated ops reuse their TP-1 figure
    assert table.counts["hit"] == 2 * len(graph.ops) and table.counts["miss"] == 0


# ---------------------------------------------------------------- file format


def test_save_load_round_trip(table, saved, graph):
    loaded = load_profile(saved, graph=graph, device_name="cpu")
    assert loaded == table and loaded.warnings == ()
    assert load_profile(saved, device_name=table.device_name) == table
    with open(saved) as f:
        data = json.load(f)
    assert data["format"] == "opweave-profile" and data["version"] == FORMAT_VERSION


@pytest.mark.parametrize("content, expected", [
    ("{\"format\": \"opweave-profile\", \"version\": 1, \"model\": ", "truncated or not JSON"),
    ("hello", "truncated or not JSON"),
    ("{\"a\": 1}", "not an opweave profile"),
    ("{\"format\": \"opweave-profile\", \"version\": 0}", "format version 0 is not supported"),
    ("{\"format\": \"opweave-profile\", \"version\": 1, \"model\": \"x\"}", "format version 1 is not supported"),
    ("{\"format\": \"opweave-profile\", \"version\": 2, \"model\": \"x\"}", "missing field"),
])
def test_bad_files_are_one_line_errors(tmp_path, content, expected):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(OpWeaveError, match=expected) as err:
        load_profile(str(path))
    assert "\n" not in str(err.value)


def test_truncated_saved_profile(saved, tmp_path):
    text = open(saved).read()
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(OpWeaveError, match="truncated"):
        load_profile(str(path))
    with pytest.raises(OpWeaveError, match="not found"):
        load_profile(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------- refusals


def test_other_device_is_refused(saved):
    with pytest.raises(OpWeaveError, match="not on NVIDIA H100"):
        load_profile(saved, device_name="NVIDIA H100 80GB HBM3")


@pytest.mark.slow
def test_other_model_is_refused_naming_both(saved):
    other = run_front_end("llama-3.1-8b").graph
    with pytest.raises(OpWeaveError, match="profile of tiny-gemma3.*not of llama-3.1-8b"):
        load_profile(saved, graph=other)
    bf16 = run_front_end("tiny-gemma3", "bfloat16").graph  # same shapes, other activation/state bytes
    with pytest.raises(OpWeaveError, match=r"float32.*bfloat16"):
        load_profile(saved, graph=bf16)


def test_partly_matching_model_keeps_matching_ops_and_warns(saved, graph):
    last = graph.ops[-1]
    changed = dataclasses.replace(last, act_bytes_per_token=last.act_bytes_per_token + 4)
    variant = dataclasses.replace(graph, model="tiny-variant", ops=graph.ops[:-1] + (changed,))
    table = load_profile(saved, graph=variant)
    assert len(table.warnings) == 1
    assert "tiny-gemma3" in table.warnings[0] and "tiny-variant" in table.warnings[0]
    assert f"{len(graph.ops) - 1} of {len(graph.ops)} ops" in table.warnings[0]
    assert table.op_latency(changed, "cpu", 1, 1, 16) is None
    assert table.op_latency(graph.ops[0], "cpu", 1, 1, 16) is not None
    assert table.counts["hit"] == 1 and table.counts["miss_signature"] == 1


@pytest.mark.slow
def test_unprofiled_gpu_tp_and_signature_give_none(table, graph):
    qkv = next(op for op in graph.ops if op.kind == OpKind.QKV_PROJ)
    assert table.op_latency(qkv, "h100", 1, 1, 16) is None
    assert table.op_latency(qkv, "cpu", 4, 1, 16) is None
    other = next(op for op in run_front_end("llama-3.1-8b").graph.ops if op.kind == OpKind.QKV_PROJ)
    assert table.op_latency(other, "cpu", 1, 1, 16) is None
    c = table.counts
    assert (c["hit"], c["miss"], c["miss_gpu"], c["miss_tp"], c["miss_signature"]) == (0, 3, 1, 1, 1)
    assert "3 from the roofline" in table.usage_summary()


# ---------------------------------------------------------------- interpolation


def _synthetic(graph, latency=lambda b, s: 1e-5 * b + 1e-7 * s) -> ProfileTable:
    entries = []
    for op in {op_signature(op): op for op in graph.ops}.values():
        contexts = CONTEXTS if op.cls == OpClass.ATTN else ()
        rows = tuple(tuple(latency(b, s) for b in BATCHES) for s in (contexts or (0,)))
        entries.append(OpEntry(signature=op_signature(op), kind=op.kind.value, example=op.name, num_ops=1, tp=1,
                               flops_per_token=op.flops_per_token, weight_bytes=op.weight_bytes, batches=BATCHES,
                               contexts=contexts, latency_s=rows))
    return ProfileTable(model=graph.model, graph_hash=graph_hash(graph), gpu="cpu", device_name="test cpu",
                        dtype=graph.dtype, torch_version="t", opweave_version="o", python_version="p",
                        date="2026-01-01T00:00:00+00:00", num_threads=1, settings={}, entries=tuple(entries),
                        dispatch_s=2e-6, transfer_latency_s=1e-4, transfer_bandwidth=2e9)


def test_interpolation_rule():
    xs, ys = (1, 2, 4), (10.0, 20.0, 24.0)
    assert [interpolate(xs, ys, x) for x in xs] == list(ys)              # exact at measured points
    assert interpolate(xs, ys, 3) == pytest.approx(22.0)                  # linear in between
    assert interpolate(xs, ys, 8) == pytest.approx(24.0 + 2.0 * 4)        # last two points' slope
    assert interpolate(xs, ys, 0.5) == 10.0                               # flat below the grid
    assert interpolate(xs, (10.0, 30.0, 25.0), 16) == 25.0                # a falling tail stays flat
    assert interpolate((4,), (7.0,), 100) == 7.0


def test_op_latency_is_bilinear_on_the_grid(graph):
    table = _synthetic(graph)
    attn = next(op for op in graph.ops if op.kind == OpKind.ATTN_FULL)
    norm = next(op for op in graph.ops if op.kind == OpKind.NORM)
    assert table.op_latency(attn, "cpu", 1, 2, 64) == pytest.approx(2e-5 + 64e-7)
    assert table.op_latency(attn, "cpu", 1, 3, 40) == pytest.approx(3e-5 + 40e-7)
    assert table.op_latency(attn, "cpu", 1, 8, 128) == pytest.approx(8e-5 + 128e-7)  # extrapolated both ways
    assert table.op_latency(norm, "cpu", 1, 3, 99999) == pytest.approx(3e-5)        # context-independent


# ---------------------------------------------------------------- catalog entry and cost model


def test_cpu_gpu_spec_from_measurement(table):
    base = load_catalog()["cpu"]
    spec = cpu_gpu_spec(table, base)
    assert 1e6 < spec.effective_flops < 1e13 and 1e6 < spec.effective_bandwidth < 1e13
    assert spec.mem_efficiency == 1.0 and 0 < spec.gemm_efficiency <= 1.0
    assert table.prefill_flops and spec.prefill_flops == pytest.approx(table.prefill_flops)  # timed at a chunk's rows
    assert max(spec.effective_flops, spec.prefill_flops) == pytest.approx(spec.peak_flops)
    assert spec.launch_overhead == table.dispatch_s
    assert spec.intra_link_latency == table.transfer_latency_s
    assert intra_bandwidth(spec) == pytest.approx(table.transfer_bandwidth)
    assert (spec.price_per_hour, spec.memory_bytes, spec.gpus_per_node) == (
        base.price_per_hour, base.memory_bytes, base.gpus_per_node)
    assert "measured by opweave profile on" in spec.sources["peak_flops"]
    assert spec.sources["price_per_hour"] == base.sources["price_per_hour"]


def test_cpu_gpu_spec_synthetic_figures(graph):
    from opweave.profile.table import table_from_json

    table = _synthetic(graph, latency=lambda b, s: 1e-4 * b)
    spec = cpu_gpu_spec(table, load_catalog()["cpu"])
    largest = max((op for op in graph.ops if op.cls == OpClass.GEMM), key=lambda op: op.flops_per_token)
    assert spec.peak_flops == pytest.approx(4 * largest.flops_per_token / (4e-4 - 2e-6))
    heavy = max((op for op in graph.ops if op.cls == OpClass.GEMM), key=lambda op: op.weight_bytes)
    assert spec.mem_bandwidth == pytest.approx(heavy.weight_bytes / (1e-4 - 2e-6))
    assert spec.gemm_efficiency == 1.0 and spec.prefill_efficiency is None  # no prefill figure: as before

    # a prefill GEMM faster than the decode batch's: the peak is its figure, decode math keeps its rate
    fast = dataclasses.replace(table, prefill_flops=3 * spec.peak_flops)
    both = cpu_gpu_spec(fast, load_catalog()["cpu"])
    assert both.peak_flops == pytest.approx(3 * spec.peak_flops)
    assert both.effective_flops == pytest.approx(spec.effective_flops)
    assert both.prefill_flops == pytest.approx(3 * spec.peak_flops) and both.prefill_efficiency == 1.0
    assert table_from_json(fast.to_json()).prefill_flops == fast.prefill_flops


def test_cost_model_marks_measured_ops(table, graph):
    cpu = cpu_gpu_spec(table, load_catalog()["cpu"])
    model = CostModel(profile=table)
    hidden = 64 * 4
    for op in graph.ops:
        cost = model.op_cost(op, cpu, 1, 2, 64, hidden)
        assert cost.measured and cost.compute_s == table.op_latency(op, "cpu", 1, 2, 64)
    h100 = load_catalog()["h100"]
    assert not model.op_cost(graph.ops[1], h100, 1, 2, 64, hidden).measured
    assert not CostModel().op_cost(graph.ops[1], cpu, 1, 2, 64, hidden).measured


def test_beyond_the_grid_the_edge_figure_scales_with_the_roofline(graph):
    from opweave.cost.model import roofline

    table = _synthetic(graph, latency=lambda b, s: 1e-3)  # flat: a naive extrapolation would stay at 1 ms
    cpu = cpu_gpu_spec(table, load_catalog()["cpu"])
    model = CostModel(profile=table)
    qkv = next(op for op in graph.ops if op.kind == OpKind.QKV_PROJ)
    edge = BATCHES[-1]
    at_edge = model.op_cost(qkv, cpu, 1, edge, 64, 256).compute_s
    assert at_edge == pytest.approx(1e-3) and table.counts["beyond_grid"] == 0
    far = model.op_cost(qkv, cpu, 1, 64 * edge, 64, 256)
    growth = roofline(qkv, cpu, 1, 64 * edge, 64)[2] / roofline(qkv, cpu, 1, edge, 64)[2]
    assert far.measured and far.compute_s == pytest.approx(1e-3 * growth) and growth > 1
    assert table.counts["beyond_grid"] == 1 and "beyond the measured" in table.usage_summary()
    attn = next(op for op in graph.ops if op.kind == OpKind.ATTN_FULL)  # its state grows with the context
    longer = model.op_cost(attn, cpu, 1, 2, 16 * CONTEXTS[-1], 256).compute_s
    assert longer > model.op_cost(attn, cpu, 1, 2, CONTEXTS[-1], 256).compute_s == pytest.approx(1e-3)


def test_tp_collectives_use_the_measured_all_reduce(graph):
    from opweave.cost.model import allreduce_s

    table = dataclasses.replace(_synthetic(graph), allreduce_latency_s=1e-3, allreduce_bandwidth=1e9)
    cpu = cpu_gpu_spec(table, load_catalog()["cpu"])
    model = CostModel(profile=table)
    o_proj = next(op for op in graph.ops if op.kind == OpKind.O_PROJ)  # row-parallel: all-reduce after it
    hidden, batch = 256, 4
    n = batch * hidden
    assert model.op_cost(o_proj, cpu, 2, batch, 64, hidden).comm_s == pytest.approx(1e-3 + n / 1e9)
    assert model.op_cost(o_proj, cpu, 4, batch, 64, hidden).comm_s == pytest.approx(3e-3 + 1.5 * n / 1e9)
    assert model.op_cost(o_proj, cpu, 1, batch, 64, hidden).comm_s == 0.0
    h100 = load_catalog()["h100"]  # not the profiled device: ring figures on the catalog's links
    assert model.op_cost(o_proj, h100, 2, batch, 64, hidden).comm_s == pytest.approx(allreduce_s(n, 2, h100))
    qkv = next(op for op in graph.ops if op.kind == OpKind.QKV_PROJ)  # column-parallel: no collective
    assert model.op_cost(qkv, cpu, 2, batch, 64, hidden).comm_s == 0.0


def test_fit_link_recovers_latency_and_bandwidth():
    samples = [(n, 1e-4 + n / 2e9) for n in (1024, 65536, 1 << 20, 4 << 20)]
    fit = fit_link(samples)
    assert fit.latency_s == pytest.approx(1e-4, rel=1e-6) and fit.bandwidth == pytest.approx(2e9, rel=1e-6)
    flat = fit_link([(1024, 2e-3), (4096, 1e-3)])  # falling times: raw fallbacks
    assert flat.latency_s > 0 and flat.bandwidth > 0


def test_bad_grid_is_refused():
    with pytest.raises(OpWeaveError, match="batches"):
        profile("tiny-gemma3", batches=(0, 1), measure_links=False)
    with pytest.raises(OpWeaveError, match="cpu or cuda"):
        profile("tiny-gemma3", device="tpu", measure_links=False)


def test_planner_charges_transfer_host_time_where_owners_change(graph):
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.cluster import parse_cluster

    fe = run_front_end("tiny-gemma3", "float32")
    base = _synthetic(graph)
    host = dataclasses.replace(base, send_host_latency_s=1e-3, send_host_bandwidth=1e15,
                               recv_host_latency_s=2e-3, recv_host_bandwidth=1e15)
    catalog = load_catalog()
    catalog["cpu"] = cpu_gpu_spec(base, catalog["cpu"])
    cluster = parse_cluster("cpux2", catalog)

    def stages(table, template, owners, n):
        compiled = pinned_plan(fe, cluster, template, owners, batch=2, microbatches=n, context=CONTEXTS[-1],
                               cost_model=CostModel(profile=table))
        return compiled.result.best.problem.stages

    two = [("cpu", 1, 1), ("cpu", 1, 1)]
    for a, b in zip(stages(base, "afd", two, 2), stages(host, "afd", two, 2), strict=True):
        assert b.compute_s - a.compute_s == pytest.approx(3e-3)  # each AFD stage receives from and sends to the other
        assert b.send_s == a.send_s
    one = [("cpu", 1, 1)]
    assert stages(base, "colocated", one, 1) == stages(host, "colocated", one, 1)  # no transfer, no host time
    assert CostModel().transfer_host_s(1024, catalog["cpu"], "send") == 0.0  # roofline: links only


def test_compile_with_a_profile_traces_once(saved, tmp_path, monkeypatch, capsys):
    """`compile --profile` checks the profile against the traced graph, then compiles that graph."""
    import opweave.passes.trace as trace
    from opweave.cli import main

    real, calls = trace.build_graph, []
    monkeypatch.setattr(trace, "build_graph", lambda model: calls.append(model) or real(model))
    argv = ["compile", "tiny-gemma3", "--cluster", "cpux2", "--tpot-slo", "10s", "--context", "64",
            "--profile", saved, "--templates", "colocated", "--quiet", "-o", str(tmp_path / "art")]
    assert main(argv) == 0, capsys.readouterr().err
    assert len(calls) == 1 and (tmp_path / "art" / "plan.json").is_file()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a second core")
@pytest.mark.slow
def test_busy_cores_profile_under_load():
    lines = []
    table = profile("tiny-gemma3", batches=(2,), contexts=(16,), measure_links=False, busy_cores=1,
                    progress=lines.append)
    assert table.settings["busy_cores"] == 1 and any("other core(s)" in line for line in lines)
    assert all(x > 0 for e in table.entries for row in e.latency_s for x in row)
    with pytest.raises(OpWeaveError, match="--busy-cores"):
        profile("tiny-gemma3", batches=(2,), contexts=(16,), measure_links=False, busy_cores=os.cpu_count())
