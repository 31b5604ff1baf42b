"""`opweave estimate`: colocated decode points, their terms, per-point problems, bad arguments."""

import json

import pytest

from opweave.cli import main
from opweave.compiler.frontend import run_front_end
from opweave.cost import memory
from opweave.cost.estimate import TERMS, estimate, estimate_point
from opweave.cost.model import CostModel
from opweave.hardware.catalog import load_catalog


@pytest.fixture(scope="module")
def graph():
    return run_front_end("llama-3.1-8b").graph


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _sum_terms(terms: dict[str, float]) -> float:
    return (terms["weights"] + terms["kv_state"] + terms["math"] - terms["overlap_hidden"] + terms["overheads"]
            + terms["communication"])


@pytest.mark.parametrize("gpu,tp,batch,context", [("h100", 1, 1, 1536), ("a100", 2, 64, 3072),
                                                   ("l40s", 4, 16, 32768), ("h100", 8, 128, 1024)])
@pytest.mark.slow
def test_terms_add_up_to_the_planners_step_time(graph, catalog, gpu, tp, batch, context):
    spec = catalog[gpu]
    point = estimate_point(graph, spec, tp, batch, context)
    hidden = graph.cuts[0].bytes_per_token
    assert point.tpot_s == pytest.approx(CostModel().ops_latency(graph.ops, spec, tp, batch, context, hidden))
    assert _sum_terms(point.terms_s) == pytest.approx(point.tpot_s, rel=1e-9)
    assert all(point.terms_s[t] >= 0 for t in TERMS)
    assert point.terms_s["communication"] > 0 if tp > 1 else point.terms_s["communication"] == 0
    assert point.tokens_per_s == pytest.approx(batch / point.tpot_s)
    assert point.memory_bytes == pytest.approx(memory.memory_per_gpu(graph.ops, tp, batch, context))


def test_tpot_grows_with_batch_and_context_and_state_term_with_both(graph, catalog):
    pts = {(p.batch, p.context): p for p in estimate(graph, catalog["h100"], [1], [1, 16, 64], [1024, 8192])}
    for b in (1, 16, 64):
        assert pts[(b, 8192)].tpot_s > pts[(b, 1024)].tpot_s
    for s in (1024, 8192):
        assert pts[(64, s)].tpot_s > pts[(16, s)].tpot_s > pts[(1, s)].tpot_s
    # KV bytes are linear in batch x context: 64 x 8192 reads 64 x 8 times 1 x 1024
    assert pts[(64, 8192)].terms_s["kv_state"] == pytest.approx(64 * 8 * pts[(1, 1024)].terms_s["kv_state"],
                                                                rel=1e-6)
    # weight streaming barely depends on the batch (activations only)
    assert pts[(64, 1024)].terms_s["weights"] < 1.1 * pts[(1, 1024)].terms_s["weights"]


def test_points_that_cannot_run_are_reported_not_raised(graph, catalog):
    points = estimate(graph, catalog["h100"], [3, 16, 1], [1, 512], [1024, 131072])
    bad_tp = [p for p in points if p.tp == 3]
    assert bad_tp and all(p.tpot_s is None and not p.fits and "does not divide" in p.error for p in bad_tp)
    over_node = [p for p in points if p.tp == 16]
    assert over_node and all("node size" in p.error and p.tpot_s is None for p in over_node)
    big = next(p for p in points if (p.tp, p.batch, p.context) == (1, 512, 131072))
    assert big.tpot_s > 0 and not big.fits and big.error.startswith("does not fit: needs")
    small = next(p for p in points if (p.tp, p.batch, p.context) == (1, 1, 1024))
    assert small.fits and small.error is None


@pytest.mark.slow
def test_cli_json_has_the_documented_shape(capsys):
    assert main(["estimate", "llama-3.1-8b", "--gpu", "H100_SXM_80GB", "--tp", "1,3", "--batch", "1,16",
                 "--context", "1536,32k", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["points"]) == 8
    for p in data["points"]:
        assert {"gpu", "tp", "batch", "context", "tpot_ms", "tokens_per_s", "fits", "terms"} <= set(p)
        assert p["gpu"] == "h100"
        if p["tp"] == 3:
            assert p["tpot_ms"] is None and p["fits"] is False and "does not divide" in p["error"]
        else:
            assert p["tpot_ms"] > 0 and set(p["terms"]) == {f"{t}_ms" for t in TERMS}
            assert p["tokens_per_s"] == pytest.approx(p["batch"] / p["tpot_ms"] * 1e3, rel=1e-3)
    assert [p["context"] for p in data["points"][:2]] == [1536, 32768]


def test_cli_text_lists_each_problem_point(capsys):
    assert main(["estimate", "llama-3.1-8b", "--gpu", "a100", "--tp", "3", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "a100 tp3 batch 64 context 1536: TP 3 does not divide" in out


@pytest.mark.slow
def test_cli_catalog_override_changes_the_estimate(tmp_path, capsys):
    override = tmp_path / "slow.json"
    override.write_text(json.dumps({"h100": {"mem_bandwidth": 1.0e12}}))
    args = ["estimate", "llama-3.1-8b", "--gpu", "h100", "--format", "json"]
    assert main(args) == 0
    fast = json.loads(capsys.readouterr().out)["points"][0]["tpot_ms"]
    assert main(args + ["--catalog", str(override)]) == 0
    slow = json.loads(capsys.readouterr().out)["points"][0]["tpot_ms"]
    assert slow > 2.5 * fast
    assert main(args + ["--catalog", "roofline"]) == 0  # the ideal bound: no fixed costs, copy-kernel bandwidth
    ideal = json.loads(capsys.readouterr().out)["points"][0]
    assert ideal["tpot_ms"] < 0.8 * fast and ideal["terms"]["communication_ms"] == 0
    assert main(args + ["--eager"]) == 0  # ops launched one by one cost more than a replayed graph
    assert json.loads(capsys.readouterr().out)["points"][0]["tpot_ms"] > fast


@pytest.mark.parametrize("args,message", [
    (["--gpu", "h100", "--batch", "0"], "--batch must list positive whole numbers"),
    (["--gpu", "h100", "--batch", "1,x"], "--batch must be comma-separated whole numbers"),
    (["--gpu", "h100", "--tp", ""], "--tp must list positive whole numbers"),
    (["--gpu", "h100", "--context", "12q"], "bad context length '12q'"),
    (["--gpu", "h10"], "unknown GPU type 'h10'"),
    (["--batch", "1"], "the following arguments are required: --gpu"),
    (["--gpu", "h100", "--catalog", "missing.json"], "catalog override file 'missing.json' not found"),
])
def test_bad_arguments_are_one_line_exit_2(capsys, args, message):
    assert main(["estimate", "llama-3.1-8b", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unknown_model_is_one_line_exit_2(capsys):
    assert main(["estimate", "no-such-model", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opweave: error:") and err.count("\n") == 1


@pytest.mark.slow
def test_moe_weights_term_follows_the_grouped_kernel(catalog):
    """Routed experts: few distinct experts at batch 1, each expert read once per block of the
    grouped kernel beyond (its block grows with the pairs an expert expects, up to 128)."""
    moe = run_front_end("qwen3-30b-a3b").graph
    small, big = (estimate_point(moe, catalog["h100"], 1, b, 1024) for b in (1, 512))
    assert _sum_terms(small.terms_s) == pytest.approx(small.tpot_s, rel=1e-9)
    experts = sum(op.weight_bytes for op in moe.ops if op.active_weight_fraction < 1)
    h100 = catalog["h100"]
    # batch 512 x top-8 / 128 = 32 pairs per expert: blocks of 64, so each expert's weights are read
    # about once (blocks of 16 would read them about twice)
    from opweave.cost.model import moe_block

    assert moe_block(512, 8 / 128) == 64
    grown = (big.terms_s["weights"] - small.terms_s["weights"]) * h100.effective_bandwidth
    assert 0.95 * experts < grown < 1.1 * experts
