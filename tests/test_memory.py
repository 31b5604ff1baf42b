"""Memory truth: what the planner counts per GPU (`opweave.cost.memory`) equals what a rank's
modules allocate (`opweave.profile.allocated`, built on the meta device as the worker builds them).

Weights, state and message buffers must agree within 1% on every rank, for every family (the real
configs, on meta) x TP 1/2/4/8 where legal, at a context above Gemma's sliding window (and for
Gemma one below it too), on a plan with two owners (so ranks send and receive). Activations: the planned peak is at least the
peak measured while the rank's generated module runs a prefill-width round on meta, and at most
ACTIVATION_SLACK times it (the planner's per-op formula is an upper bound)."""

from __future__ import annotations

import json
import os

import pytest

from opweave.cli import main
from opweave.compiler.frontend import run_front_end
from opweave.cost.memory import max_rows, slots_per_rank
from opweave.errors import OpWeaveError
from opweave.profile.allocated import pinned_memory

MODELS = {"llama": "llama-3.1-8b", "gemma3": "gemma-3-27b", "qwen3_moe": "qwen3-30b-a3b",
          "qwen3_next": "qwen3-next-80b-a3b"}
WINDOW = 1024  # gemma-3-27b's sliding window
CONTEXTS = (WINDOW // 2, 4 * WINDOW)
ACTIVATION_SLACK = 4.0


@pytest.fixture(scope="module")
def front_ends():
    return {family: run_front_end(name) for family, name in MODELS.items()}


def _two_owner_template(fe) -> str:
    from opweave.passes.templates import build_stages, enumerate_templates

    for t in enumerate_templates(fe.blocks):
        if t.family != "colocated" and build_stages(fe.blocks, t).stages_per_block % 2 == 0:
            return t.name
    raise AssertionError("no template with an even number of stages per block")


def _pinned(fe, tp: int, context: int, activations: bool, ranks=None):
    try:
        return pinned_memory(fe, _two_owner_template(fe), [("h100", tp, 1), ("h100", tp, 2)], batch=8,
                             microbatches=2, context=context, activations=activations, ranks=ranks)
    except OpWeaveError as e:
        if "does not divide" in str(e):
            pytest.skip(f"TP {tp} is not legal here: {e}")
        raise


# both contexts for Gemma (its sliding layers' state stops growing between them); the other
# families' state grows linearly with the context: the longer one alone
CASES = [(family, context) for family in sorted(MODELS) for context in CONTEXTS
         if family == "gemma3" or context == max(CONTEXTS)]


@pytest.mark.parametrize("family,context", CASES)
@pytest.mark.parametrize("tp", (1, 2, 4, 8))
@pytest.mark.slow
def test_allocated_equals_planned(front_ends, family, tp, context):
    ranks = _pinned(front_ends[family], tp, context, activations=False)
    assert len(ranks) == 3 * tp
    for r in ranks:
        for what in ("weights", "state", "buffers"):
            planned, allocated = getattr(r.planned, what), getattr(r.allocated, what)
            assert allocated == pytest.approx(planned, rel=0.01, abs=1), (family, tp, context, r.rank, what)
        assert r.planned.weights > 0
        assert r.kv_pages[0] == r.kv_pages[1]  # the page pools the planner counts, as allocated
    assert any(r.planned.state > 0 for r in ranks)
    assert any(r.kv_pages[0] > 0 for r in ranks)  # every family here has full-attention layers
    leaders = [r for r in ranks if r.rank % tp == 0]
    assert all(r.allocated.buffers > 0 for r in leaders)  # every leader takes cut 0 or the token ids
    if tp > 1:  # the TP ranks take the cuts in turn: some other rank of a group holds buffers too
        assert any(r.allocated.buffers > 0 for r in ranks if r not in leaders)


def test_sliding_window_state_is_capped(front_ends):
    below, above = (_pinned(front_ends["gemma3"], 2, c, activations=False, ranks=[0])[0] for c in CONTEXTS)
    # 8x the context; only the full-attention layers (1 in 6) grow 8x, the sliding ones 2x (to the window)
    assert 2.0 < above.allocated.state / below.allocated.state < 4.0


@pytest.mark.parametrize("family", ("llama", "gemma3", "qwen3_moe", "qwen3_next"))
@pytest.mark.slow
def test_activation_peak_is_bounded_by_the_plan(tiny_checkpoint, family):
    fe = run_front_end(tiny_checkpoint(family))
    # below and above the tiny Gemma's window (8), both chunked; Qwen3-Next's recurrent layers step
    # token by token on meta (slow), at the longer one alone
    contexts = (64,) if family == "qwen3_next" else (16, 64)
    for tp in (1, 2):
        for context in contexts:
            ranks = _pinned(fe, tp, context, activations=True)
            for r in ranks:
                measured, planned = r.allocated.activations, r.planned.activations
                assert measured > 0
                assert measured <= planned <= ACTIVATION_SLACK * measured, (family, tp, context, r.rank)


def test_slots_follow_the_runtime():
    # 10 sequences in 3 microbatches: microbatches of 10 // 3 = 3 rows; 2 replicas: 2 and 1 rows
    assert max_rows(10, 3, 2) == 2 and slots_per_rank(10, 3, 2) == 6
    assert slots_per_rank(64, 1, 1) == 64


@pytest.mark.slow
def test_dump_memory_of_an_artifact(tiny_checkpoint, tmp_path, capsys):
    out = str(tmp_path / "art")
    assert main(["compile", tiny_checkpoint("llama"), "--cluster", "h100x2", "--context", "64", "--tpot-slo", "1s",
                 "-o", out]) == 0
    capsys.readouterr()
    assert main(["dump", out, "--what", "memory"]) == 0
    text = capsys.readouterr().out
    assert "rank 0:" in text and "weights" in text and "alloc/plan" in text and "KV pages" in text
    assert main(["dump", out, "--what", "memory", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"] and {"rank", "owner", "gpu", "tp", "planned", "allocated"} <= set(data["ranks"][0])
    for r in data["ranks"]:
        for what in ("weights", "state", "buffers"):
            assert r["allocated"][what] == pytest.approx(r["planned"][what], rel=0.01, abs=1)
        assert r["allocated"]["activations"] <= r["planned"]["activations"]
    pages = [r["kv_pages"] for r in data["ranks"]]
    assert all(p["planned"] == p["allocated"] and p["page_tokens"] == 16 for p in pages)
    assert any(p["planned"] > 0 for p in pages)  # context 64: 4 pages per slot


def test_dump_memory_refuses_a_bad_artifact(tmp_path, capsys):
    assert main(["dump", str(tmp_path), "--what", "memory"]) == 2
    assert "no plan.json" in capsys.readouterr().err
    (tmp_path / "plan.json").write_text("{not json")
    assert main(["dump", str(tmp_path), "--what", "memory"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def _expert_owners(fe, template: str, tp: int) -> list[tuple]:
    """Two owners of `template` (TP `tp`, 1 and 2 replicas), expert-parallel where they run experts."""
    from opweave.ir.tp import has_experts
    from opweave.passes.space import slot_of
    from opweave.passes.templates import build_stages, template_by_name

    plan = build_stages(fe.blocks, template_by_name(fe.blocks, template))
    owners = []
    for slot, replicas in enumerate((1, 2)):
        ops = [op for s in plan.stages if slot_of(s.index, plan.stages_per_block, 2) == slot
               for op in fe.graph.ops[s.first:s.last + 1]]
        owners.append(("h100", tp, replicas) + (("ep",) if has_experts(ops) else ()))
    assert any(len(o) == 4 for o in owners)
    return owners


@pytest.mark.parametrize("tp", (8,))   # TP 2 expert-parallel ranks: the parity tests and the activation test below
@pytest.mark.slow
def test_expert_parallel_allocated_equals_planned(front_ends, tp):
    """Whole experts per GPU (E / tp of them): the planner counts what the ranks allocate, and
    they hold the sliced layout's share."""
    fe = front_ends["qwen3_moe"]
    template = _two_owner_template(fe)
    owners = _expert_owners(fe, template, tp)
    ranks = pinned_memory(fe, template, owners, batch=8, microbatches=2, context=2048, activations=False)
    sliced = pinned_memory(fe, template, [o[:3] for o in owners], batch=8, microbatches=2, context=2048,
                           activations=False)
    for r, s in zip(ranks, sliced):
        for what in ("weights", "state", "buffers"):
            planned, allocated = getattr(r.planned, what), getattr(r.allocated, what)
            assert allocated == pytest.approx(planned, rel=0.01, abs=1), (tp, r.rank, what)
        assert r.allocated.weights == pytest.approx(s.allocated.weights, rel=0.01)   # the same share


@pytest.mark.parametrize("family", ("qwen3_moe", "gpt_oss"))
@pytest.mark.slow
def test_expert_parallel_activation_peak_is_bounded_by_the_plan(tiny_checkpoint, family):
    fe = run_front_end(tiny_checkpoint(family))
    template = _two_owner_template(fe)
    for r in pinned_memory(fe, template, _expert_owners(fe, template, 2), batch=8, microbatches=2, context=64,
                           activations=True):
        measured, planned = r.allocated.activations, r.planned.activations
        assert 0 < measured <= planned <= ACTIVATION_SLACK * measured, (family, r.rank)


def test_colocated_tp_ranks_allocate_what_is_planned(front_ends):
    """One owner at TP 2: only the leader runs the scheduler and takes the token ids back (the
    other rank holds no token buffers), as the planner counts."""
    for r in pinned_memory(front_ends["llama"], "colocated", [("h100", 2, 1)], batch=8, microbatches=1,
                           context=2048, activations=False):
        for what in ("weights", "state", "buffers"):
            assert getattr(r.allocated, what) == pytest.approx(getattr(r.planned, what), rel=0.01, abs=1), (r.rank, what)


@pytest.mark.parametrize("family", ("llama", "gemma3"))  # full and sliding attention (Qwen3-Next's
@pytest.mark.slow                                          # attention layers page as Llama's do)
def test_a_few_key_blocks_reach_the_whole_contexts_peak(tiny_checkpoint, monkeypatch, family):
    """The measured round's paged attention reads MEASURED_KEY_BLOCKS key blocks per row, not the
    whole context (8 blocks here): the same activation peak. One block alone peaks lower, so the
    attention blocks are what this compares."""
    from opweave.profile import allocated

    fe = run_front_end(tiny_checkpoint(family))

    def peaks(blocks):
        monkeypatch.setattr(allocated, "MEASURED_KEY_BLOCKS", blocks)
        return [r.allocated.activations for r in _pinned(fe, 1, 2048, activations=True)]

    whole = peaks(None)
    assert peaks(allocated.MEASURED_KEY_BLOCKS) == whole
    assert any(one < w for one, w in zip(peaks(1), whole))


@pytest.mark.slow
def test_artifact_memory_measures_each_kind_of_rank_once(tiny_checkpoint, tmp_path):
    """TP peers and the replicas of one owner are measured once (`same_work`), with the figures of
    measuring every rank alone; each rank's buffers are its own."""
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.pinned import pinned_plan
    from opweave.profile.allocated import artifact_memory, unbounded_cluster

    fe = run_front_end(tiny_checkpoint("llama"))
    template, owners = _two_owner_template(fe), [("h100", 2, 1), ("h100", 2, 2)]
    compiled = pinned_plan(fe, unbounded_cluster("h100", 8), template, owners, batch=8, microbatches=2, context=64)
    write_artifact(str(tmp_path / "art"), compiled)
    lines = []
    ranks = artifact_memory(str(tmp_path / "art"), progress=lines.append)
    alone = pinned_memory(fe, template, owners, batch=8, microbatches=2, context=64)
    assert len(ranks) == 6
    figures = [(r.planned, r.allocated, r.kv_pages) for r in ranks]
    assert figures == [(r.planned, r.allocated, r.kv_pages) for r in alone]
    assert sum("building" in line for line in lines) == 2      # one rank of each owner
    assert sum(" as rank " in line for line in lines) == 4     # its TP peer, the other replica's two ranks
