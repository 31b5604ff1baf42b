"""Packed rounds (`opweave.runtime.layout`): the layout's arithmetic, the scheduler's prefill
budget, and the packed operators against the padded batch they replace, on real families."""

from __future__ import annotations

import pytest
import torch

from opweave.ir.kinds import OpKind
from opweave.models.model import DecodeStep
from opweave.models.registry import resolve
from opweave.runtime.layout import Layout, Packed, Segment
from opweave.runtime.scheduler import Request, Scheduler

from local_loop import unpack


def test_layout_segments_offsets_and_last_tokens():
    layout = Layout((1, 1, 0, 3, 1, 0, 0, 1, 1))
    assert layout.offsets == (0, 1, 2, 2, 5, 6, 6, 6, 7, 8)
    assert layout.tokens == layout.real == 8
    assert layout.segments == (Segment(0, 2, 0, 2), Segment(3, 1, 2, 3), Segment(4, 1, 5, 1), Segment(7, 2, 6, 2))
    assert layout.last_rows == (0, 1, 0, 4, 5, 0, 0, 6, 7)
    assert layout.tokens_of(3, 5) == (2, 6) and layout.tokens_of(5, 7) == (6, 6)
    assert not layout.decode_only and Layout((1, 0, 1)).decode_only
    pad = Layout((0, 0), pad=True)  # the microbatch runs, these rows have nothing: one padding token
    assert pad.tokens == 1 and pad.real == 0 and pad.segments == (Segment(0, 1, 0, 1),)


def test_the_lm_head_projects_the_live_rows_only_on_the_cpu():
    """Idle rows' logits are zeros, not computed; each live row's are its last token's, exactly
    what the projection of every row gives it; a padding round (no live row) projects its row."""
    calls = []

    def head(x):
        calls.append(x.shape[0])
        return x @ weight.t()

    weight = torch.randn(11, 6)
    layout = Layout((1, 0, 3, 0, 1))
    x = torch.randn(1, layout.tokens, 6)
    out = Packed(head, lambda: layout, last=True)(x)
    assert calls == [3] and out.shape == (5, 1, 11)
    want = x[0, [0, 3, 4]] @ weight.t()
    assert torch.equal(out[[0, 2, 4], 0], want) and not out[[1, 3]].any()
    assert Layout((1, 1)).live == (0, 1) and Packed(head, lambda: Layout((1, 1)), last=True)(x[:, :2]).shape[0] == 2
    pad = Layout((0, 0), pad=True)
    assert Packed(head, lambda: pad, last=True)(x[:, :1]).shape == (2, 1, 11) and calls[-2:] == [2, 2]


def test_a_prepared_layouts_lm_head_makes_no_tensor_from_host_data():
    """A decode layout never seen before (rows ended in an odd pattern): `prepare`, between rounds,
    makes every index the LM head reads, so the round under `NoHostSync` makes none (made in the
    round, they would be a synchronising host copy on a GPU)."""
    from opweave.runtime.syncguard import HostSyncError, NoHostSync

    weight = torch.randn(11, 6)
    x = torch.randn(1, 3, 6)
    fresh = Layout((1, 0, 1, 0, 0, 1, 0))
    with pytest.raises(HostSyncError, match="host data"), NoHostSync():
        Packed(lambda h: h @ weight.t(), lambda: fresh, last=True)(x)
    prepared = Layout((0, 1, 1, 0, 0, 0, 1))
    prepared.prepare(torch.device("cpu"))
    with NoHostSync():
        out = Packed(lambda h: h @ weight.t(), lambda: prepared, last=True)(x)
    assert torch.equal(out[[1, 2, 6], 0], x[0] @ weight.t())


def _requests(prompts, n=3):
    return [Request(index=i, prompt=list(p), max_new_tokens=n) for i, p in enumerate(prompts)]


def test_prefill_budget_decode_first_then_chunks_in_admission_order():
    sched = Scheduler(_requests([[1] * 10, [2] * 3, [3] * 6]), num_microbatches=1, rows=4, context=64, eos_ids=(),
                      prefill_chunk=8)
    assert sched.plan() == ((8, 0, 0, 0),)  # the first admitted takes the whole budget; the others wait
    assert sched.plan() == ((2, 3, 3, 0),)  # its last 2, then the next in admission order
    (counts,) = sched.plan()
    assert counts == (1, 1, 3, 0)  # two rows decode, the third finishes its prompt
    plans = [sched.take(r, 0) for r in range(3)]
    assert [s.output for s in plans[1].rows[:3]] == [True, True, False]  # a chunk that is not the last: no output
    assert plans[2].rows[0].decode and plans[2].rows[2].tokens == (3, 3, 3)
    for plan in plans:  # every round: decode rows one token each, at most `prefill_chunk` prompt tokens
        assert sum(len(s.tokens) for s in plan.rows) <= 8
        assert plan.counts == tuple(0 if s.idle else len(s.tokens) or 1 for s in plan.rows)


def test_a_waiting_row_can_be_cancelled():
    sched = Scheduler(_requests([[1] * 8, [2] * 4]), num_microbatches=1, rows=2, context=64, eos_ids=(),
                      prefill_chunk=8)
    assert sched.plan() == ((8, 0),)
    sched.cancel(1)  # admitted, waiting for the budget
    assert sched.plan() == ((1, 0),) and [r.finish_reason for r in sched.done] == ["cancelled"]


def _patch_packed(model, layout_of):
    """Runs `model`'s stateful ops and LM head as a packed round does (`Packed`), in place."""
    for m in model.op_modules():
        if getattr(m, "state_attrs", ()) or m.kind == OpKind.LM_HEAD:
            forward, attrs = m.forward, m.state_attrs

            def packed(*args, state=None, _f=forward, _m=m, _attrs=attrs):
                wrapped = Packed(_f, layout_of, last=_m.kind == OpKind.LM_HEAD)
                if _m.kind == OpKind.LM_HEAD:
                    return wrapped(*args)
                return wrapped(*args, state=tuple(getattr(_m, a) for a in _attrs))

            m.forward = packed


# rounds of (prompt chunk lengths or "d" for decode, None idle) per row: mixed, ragged, a padding round
ROUNDS = [
    (5, None, 3, 2),
    ("d", 4, "d", "d"),
    ("d", "d", None, "d"),
    ("d", 2, 1, None),
    (None, "d", "d", "d"),
    (None, None, None, None),
    ("d", "d", "d", 6),
]


@pytest.mark.parametrize("family,layers", [("llama", 2), ("gemma3", 8), ("qwen3_next", 5), ("deepseek_v3", 2),
                                           ("gpt_oss", 4)])
def test_packed_round_equals_the_padded_batch(tiny_checkpoint, family, layers):
    """The same rounds computed packed (stateful ops per segment, the LM head on last tokens) and
    padded (every row at the round's widest chunk, left-padded with position -1): the same
    logits for every live row, and the same state."""
    folder = tiny_checkpoint(family, num_hidden_layers=layers)
    padded, packed = resolve(folder).load(), resolve(folder).load()
    rows, context = 4, 32
    for m in (padded, packed):
        m.allocate_state(rows, context)
    current: list[Layout] = []
    _patch_packed(packed, lambda: current[0])
    gen = torch.Generator().manual_seed(0)
    position = [0] * rows
    last = torch.randint(3, 60, (rows,), generator=gen)
    with torch.no_grad():
        for plan in ROUNDS:
            counts = tuple(0 if p is None else 1 if p == "d" else p for p in plan)
            layout = Layout(counts, pad=not any(counts))
            ids, positions = [], []
            for r, p in enumerate(plan):
                if p is None:
                    continue
                n = 1 if p == "d" else p
                ids += [int(last[r])] if p == "d" else torch.randint(3, 60, (n,), generator=gen).tolist()
                positions += range(position[r], position[r] + n)
                position[r] += n
            if layout.pad:
                ids, positions = [0], [-1]
            ids, positions = torch.tensor([ids]), torch.tensor([positions])
            current[:] = [layout]
            got = packed(ids, positions)  # [rows, 1, V]: each row's last token
            want = padded(*unpack(ids, positions, Layout(counts)))[:, -1]
            live = [r for r, c in enumerate(counts) if c]
            torch.testing.assert_close(got[live, 0], want[live], rtol=1e-4, atol=1e-4)
            last = want.argmax(-1)
    for a, b in zip(padded.op_modules(), packed.op_modules()):
        for attr in getattr(a, "state_attrs", ()):
            torch.testing.assert_close(getattr(b, attr), getattr(a, attr), rtol=1e-4, atol=1e-4)


def test_decode_step_still_takes_padded_batches(tiny_checkpoint):
    """The plain `DecodeStep` (references, the planner's tracing) keeps its [rows, width] form."""
    model = resolve(tiny_checkpoint("llama", num_hidden_layers=2)).load()
    model.allocate_state(2, 16)
    out = DecodeStep(model)(torch.tensor([[0, 5], [6, 7]]), torch.tensor([[-1, 0], [0, 1]]))
    assert out.shape == (2,)


def _drive_packed(sched, model, rows: int, arrivals: dict, cancels: dict, current: list) -> None:
    """The runtime's loop in one process with packed rounds: plans two rounds ahead, adds and
    cancels requests between rounds, learns tokens two rounds late."""
    from opweave.runtime.inputs import RowInputs

    inputs = RowInputs(rows, 1, torch.device("cpu"))
    tokens = torch.zeros(rows, dtype=torch.long)
    sampled = {}
    agreed = [sched.plan()[0], sched.plan()[0]]  # the layouts every rank agrees two rounds ahead
    r = 0
    while sched.active or any(k >= r for k in arrivals):
        for req in arrivals.pop(r, []):
            sched.add(req)
        for index in cancels.pop(r, []):
            sched.cancel(index)
        plan = sched.take(r, 0)
        layout = Layout(agreed[r])  # a request cancelled since: its agreed tokens are padding
        if layout.tokens:
            inputs.prepare(0, plan, layout)
            ids, positions = inputs.ids(0, tokens)
            current[:] = [layout]
            tokens = model(ids, positions)[:, 0].argmax(-1)  # each row's greedy next token
        sampled[r] = tokens.tolist()
        if r >= 2:
            sched.learn(r - 2, 0, sampled.pop(r - 2))
        agreed.append(sched.plan()[0])
        r += 1
        assert r < 500, "the scheduler never finished"


@pytest.fixture(scope="module")
def packed_llama(tmp_path_factory):
    from hf_fixtures import make_tiny_checkpoint

    folder = make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("packed_llama")), num_hidden_layers=2)
    return folder


def test_arrivals_and_cancellations_keep_every_requests_tokens(packed_llama):
    """Requests arriving at random rounds into few rows, prompts prefilled under a small budget
    beside decoding rows, some cancelled mid-way: every request that ends by itself has
    transformers' greedy tokens, a cancelled one a prefix of them."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from test_state_alloc import _hf_tokens

    request = st.tuples(st.lists(st.integers(3, 200), min_size=1, max_size=12), st.integers(1, 5),
                        st.integers(0, 6), st.one_of(st.none(), st.integers(0, 8)))

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(reqs=st.lists(request, min_size=1, max_size=6), rows=st.integers(1, 3), chunk=st.integers(1, 8))
    def check(reqs, rows, chunk):
        model = resolve(packed_llama).load()
        context = 24
        model.allocate_state(rows, context)
        current: list[Layout] = []
        _patch_packed(model, lambda: current[0])
        arrivals, cancels, made = {}, {}, []
        for i, (prompt, n, at, cancel) in enumerate(reqs):
            req = Request(index=i, prompt=prompt, max_new_tokens=n)
            made.append(req)
            arrivals.setdefault(at, []).append(req)
            if cancel is not None:
                cancels.setdefault(at + cancel, []).append(i)
        sched = Scheduler([], num_microbatches=1, rows=rows, context=context, eos_ids=(), prefill_chunk=chunk)
        with torch.no_grad():
            _drive_packed(sched, model, rows, arrivals, cancels, current)
        for req in made:
            want = _hf_tokens(packed_llama, tuple(req.prompt), req.max_new_tokens)
            assert req.finish_reason in ("length", "cancelled"), (req.index, req.finish_reason, req.error)
            if req.finish_reason == "length":
                assert req.output == want, (req.index, req.prompt)
            else:
                assert req.output == want[:len(req.output)], (req.index, req.prompt)

    check()


def test_prefill_budget_flag(tiny_checkpoint, tmp_path, capsys):
    """`--prefill-budget` sets the scheduler's budget; beyond the plan's memory (rows x chunk) it
    is refused before any rank starts, in one line."""
    import json

    from opweave.cli import main
    from hf_fixtures import hf_generate
    from test_runtime import compile_pinned

    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path / "art")
    compile_pinned(folder, "colocated", art)  # batch 4 in 2 microbatches: 2 rows x 128 tokens
    prompt = [5, 6, 7, 8, 9, 10, 11]
    assert main(["run", art, "--weights", folder, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                 "3", "--prefill-budget", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outputs"][0]["token_ids"] == hf_generate(folder, prompt, 3)[1]  # a 7-token prompt over 4 rounds
    capsys.readouterr()
    assert main(["run", art, "--weights", folder, "--prompt-ids", "5,6", "--prefill-budget", "257"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["opweave: error: --prefill-budget 257 exceeds what the plan's memory holds: 2 rows x its "
                   "prefill chunk of 128 = 256 prompt tokens per microbatch (compile with a larger --prefill-chunk)"]
    assert main(["run", art, "--weights", folder, "--prompt-ids", "5,6", "--prefill-budget", "0"]) == 2
    assert "--prefill-budget" in capsys.readouterr().err
