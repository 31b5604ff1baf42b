"""Sampling on the device (`opweave.kernels.sampling`): the distribution it draws from, top-p's
nucleus, greedy at temperature 0, the same tokens at any TP split or vocabulary chunking, no host
synchronisation, and a workspace the planner counts."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from opweave.kernels.reference import NON_FINITE_TOKEN
from opweave.kernels import sampling
from opweave.profile.allocated import LiveBytes
from opweave.kernels.sampling import encode, sample
from opweave.runtime.syncguard import NoHostSync
from test_runtime_parts import on_group

V = 48


def words(rows: int, temperature: float, top_p: float, seed0: int = 0) -> torch.Tensor:
    return torch.tensor([encode(temperature, top_p, seed0 + i) for i in range(rows)], dtype=torch.long)


def draws(logits: torch.Tensor, temperature: float, top_p: float, n: int) -> collections.Counter:
    """n samples of one row of logits, each with its own seed (one batched call)."""
    out = sample(logits.expand(n, -1), words(n, temperature, top_p), torch.full((n,), 17))
    return collections.Counter(out.tolist())


def test_temperature_sampling_follows_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 1.5
    n = 6000
    got = draws(logits, 0.7, 1.0, n)
    want = torch.softmax(logits[0] / 0.7, dim=-1)
    tv = 0.5 * sum(abs(got[i] / n - float(want[i])) for i in range(V))
    assert tv < 0.04, tv   # sampling noise alone is ~0.02 here; a wrong temperature or noise gives > 0.1
    # a wrong temperature is detected by the same measure
    flat = torch.softmax(logits[0] / 1.4, dim=-1)
    assert 0.5 * sum(abs(got[i] / n - float(flat[i])) for i in range(V)) > 0.08


def test_top_p_keeps_exactly_the_nucleus():
    torch.manual_seed(1)
    logits = torch.randn(1, V) * 2
    probs = torch.softmax(logits[0], dim=-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[before < 0.8].tolist())
    assert 2 <= len(nucleus) < V // 2
    got = draws(logits, 1.0, 0.8, 4000)
    assert set(got) == nucleus
    # within the nucleus, probabilities renormalised
    mass = sum(float(probs[i]) for i in nucleus)
    for i in nucleus:
        assert got[i] / 4000 == pytest.approx(float(probs[i]) / mass, abs=0.04)


def test_temperature_zero_is_argmax_and_seeds_repeat():
    torch.manual_seed(2)
    logits = torch.randn(6, V)
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1  # a tie: the first index wins, as `argmax`
    greedy = sample(logits, words(6, 0.0, 1.0), torch.arange(6))
    assert greedy.tolist() == logits.argmax(dim=-1).tolist() and int(greedy[3]) == 5
    a = sample(logits, words(6, 1.0, 1.0, seed0=100), torch.arange(6))
    b = sample(logits, words(6, 1.0, 1.0, seed0=100), torch.arange(6))
    assert torch.equal(a, b)
    # other seeds or other positions give other draws (with overwhelming probability at T = 1.5)
    flat = logits / 8
    runs = {tuple(sample(flat, words(6, 1.5, 1.0, seed0=s), torch.arange(6)).tolist()) for s in range(8)}
    assert len(runs) == 8
    moved = {tuple(sample(flat, words(6, 1.5, 1.0), torch.arange(6) + p).tolist()) for p in range(8)}
    assert len(moved) == 8


def test_greedy_rows_skip_the_vocabulary_walk_with_the_same_ids():
    """`walk=False` (the host knows every row is greedy) gives what the whole sampler gives for
    greedy words, EOS bans included, and never enters the walk."""
    torch.manual_seed(4)
    logits = torch.randn(5, V)
    word = torch.tensor([encode(0.0, 1.0, i, ban_until=10 if i % 2 else 0) for i in range(5)], dtype=torch.long)
    banned = torch.tensor([int(logits[1].argmax()), 7])
    want = sample(logits.clone(), word, torch.arange(5), banned=banned)
    calls = []
    original = sampling._chunks
    sampling._chunks = lambda n: calls.append(n) or original(n)
    try:
        got = sample(logits.clone(), word, torch.arange(5), banned=banned, walk=False)
    finally:
        sampling._chunks = original
    assert torch.equal(got, want) and calls == []
    assert int(got[1]) != int(logits[1].argmax())  # row 1 is before its ban_until: its argmax was banned


def test_same_tokens_at_any_tp_split_and_chunking(monkeypatch):
    torch.manual_seed(3)
    rows = 32
    logits = torch.randn(rows, 1, V) * 2
    word = torch.cat([words(rows // 2, 0.9, 1.0), words(rows // 2, 1.2, 0.7, seed0=50)])
    word[0] = torch.tensor(encode(0.0, 1.0, 0))   # a greedy row among the sampled ones
    positions = torch.arange(rows) * 3
    whole = sample(logits[:, -1], word, positions)
    assert int(whole[0]) == int(logits[0, -1].argmax())
    per = V // 3
    split = on_group((0, 1, 2), lambda g: g.sample(logits[..., g.tp_rank * per:(g.tp_rank + 1) * per], word,
                                                     positions))
    for ids in split:
        assert ids.tolist() == whole.tolist()
    monkeypatch.setattr(sampling, "CHUNK", 7)   # the vocabulary walked in uneven chunks
    assert sample(logits[:, -1], word, positions).tolist() == whole.tolist()


def test_non_finite_rows_are_marked_and_the_others_sampled():
    logits = torch.zeros(3, V)
    logits[1, 4] = math.nan
    logits[2, 7] = math.inf
    out = sample(logits, words(3, 1.0, 0.9), torch.arange(3))
    assert out[1] == NON_FINITE_TOKEN and out[2] == NON_FINITE_TOKEN and 0 <= int(out[0]) < V
    greedy = sample(logits, words(3, 0.0, 1.0), torch.arange(3))
    assert greedy[1] == NON_FINITE_TOKEN and greedy[2] == NON_FINITE_TOKEN


def test_sampling_never_synchronises_with_the_host():
    logits, word, position = torch.randn(4, V), words(4, 0.8, 0.9), torch.arange(4)
    with NoHostSync("sampler"):
        sample(logits, word, position)


def test_workspace_is_within_what_the_planner_counts():
    meta = torch.device("meta")
    for rows, vocab in ((8, 1000), (16, 3 * sampling.CHUNK + 5), (4, 100_000)):
        logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device=meta)
        word = torch.zeros(rows, sampling.WORD, dtype=torch.long, device=meta)
        position = torch.zeros(rows, dtype=torch.long, device=meta)
        known = {t.untyped_storage()._cdata for t in (logits, word, position)}
        tracker = LiveBytes(known)
        with tracker:
            sample(logits, word, position)
        bound = sampling.workspace_bytes(rows, vocab)
        assert 0 < tracker.peak <= bound, (rows, vocab, tracker.peak, bound)
        assert tracker.peak > bound / 3, "the bound is far above the measured peak"


def test_the_ban_made_at_start_up_keeps_a_first_sampled_decode_round_free_of_host_data():
    """A server's first sampled round can be a decode round (a one-token prompt): the EOS columns
    the sampler bans are made at start-up (`TPGroup.prepare_ban`), so that round makes no tensor
    from host data; made on first use, they would be one."""
    from opweave.runtime.syncguard import HostSyncError, NoHostSync
    from opweave.runtime.tpgroup import TPGroup

    logits = torch.randn(3, 1, 50)
    word = torch.tensor([encode(0.0, 1.0, 1, ban_until=9), encode(1.0, 1.0, 2), encode(0.7, 0.9, 3, ban_until=9)])
    position = torch.tensor([4, 4, 4])
    fresh = TPGroup((0,), 0)
    with pytest.raises(HostSyncError, match="host data"), NoHostSync():
        fresh.sample(logits.clone(), word, position, eos_ids=(7,))
    ready = TPGroup((0,), 0)
    ready.prepare_ban((7,), 50, "cpu")
    with NoHostSync():
        ids = ready.sample(logits.clone(), word, position, eos_ids=(7,))
    assert ids.shape == (3,) and 7 not in (int(ids[0]), int(ids[2]))
