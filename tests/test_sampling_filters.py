"""The sampler's filters (`opweave.kernels.sampling`): top_k, top_p, min_p and the EOS ban
against a reference that sorts the whole vocabulary, and a property test over everything the
server accepts (underflowing top_p and temperature, ties, infinities, NaNs): it never raises and
never returns an id outside the vocabulary."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from opweave.kernels.reference import NON_FINITE_TOKEN
from opweave.kernels import sampling
from opweave.kernels.sampling import MAX_TOP_K, ban_columns, encode, sample
from opweave.runtime.syncguard import NoHostSync
from test_runtime_parts import on_group

V = 40


def kept(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float) -> set[int]:
    """The tokens a filtered draw may give, by sorting the whole row (the reference)."""
    scaled = logits.double() / temperature
    order = scaled.argsort(descending=True, stable=True).tolist()
    k = top_k if 0 < top_k < len(order) else len(order)
    top = order[:k]
    probs = torch.softmax(scaled[top], dim=-1).tolist()
    nucleus, mass = [], 0.0
    for i, p in zip(top, probs):
        if mass >= top_p and nucleus:
            break
        nucleus.append(i)
        mass += p
    cut = float(scaled[order[0]]) + (math.log(min_p) if min_p > 0 else -math.inf)
    return {i for i in nucleus if float(scaled[i]) >= cut}


def draws(logits: torch.Tensor, n: int, **params) -> collections.Counter:
    word = torch.tensor([encode(seed=s, **params) for s in range(n)], dtype=torch.long)
    return collections.Counter(sample(logits.expand(n, -1).clone(), word, torch.full((n,), 11)).tolist())


def test_each_filter_keeps_exactly_the_reference_set():
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 2
    for params in (dict(top_k=5), dict(top_k=1), dict(min_p=0.1), dict(top_p=0.6, top_k=8),
                   dict(top_p=0.9, min_p=0.05, top_k=12), dict(top_p=0.3)):
        full = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0) | params
        want = kept(logits[0], **full)
        assert 1 <= len(want) < V
        got = draws(logits, 3000, **full)
        assert set(got) == want, params


def test_top_k_renormalises_before_top_p():
    # Masses 0.5 / 0.3 / 0.2 beside tiny ones: top_p 0.55 keeps the first two over the whole
    # vocabulary (0.5 before the second < 0.55), the first alone over top_k 2 (0.625 before the second).
    logits = torch.full((1, V), -30.0)
    logits[0, :3] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert kept(logits[0], 1.0, 0.55, 0, 0.0) == {0, 1}
    assert kept(logits[0], 1.0, 0.55, 2, 0.0) == {0}
    assert set(draws(logits, 400, temperature=1.0, top_p=0.55)) == {0, 1}
    assert set(draws(logits, 400, temperature=1.0, top_p=0.55, top_k=2)) == {0}


def test_underflowing_top_p_keeps_the_top_token():
    logits = torch.randn(1, V)
    for top_p in (4e-7, 1e-9, 1e-300):
        for temperature in (1.0, 0.0, 1e-9):
            assert set(draws(logits, 50, temperature=temperature, top_p=top_p)) == {int(logits.argmax())}


def test_min_tokens_bans_eos_until_its_position_greedy_and_sampled():
    logits = torch.zeros(4, V)
    logits[:, 7] = 10.0                           # EOS is the greedy choice
    eos = ban_columns((7, 99), 0, V, "cpu")       # 99 is outside this slice
    assert eos.tolist() == [7]
    word = torch.tensor([encode(0.0, 1.0, 0, ban_until=20), encode(0.0, 1.0, 0, ban_until=20),
                         encode(1.0, 1.0, 3, ban_until=20), encode(0.0, 1.0, 0)], dtype=torch.long)
    position = torch.tensor([19, 20, 5, 5])
    out = sample(logits.clone(), word, position, banned=eos).tolist()
    assert out[0] != 7 and out[1] == 7 and out[2] != 7 and out[3] == 7
    with NoHostSync("ban"):
        sample(logits.clone(), word, position, banned=eos)


def test_filters_and_ban_give_the_same_tokens_at_any_tp_split():
    torch.manual_seed(5)
    rows, per = 12, V // 2
    logits = torch.randn(rows, 1, V) * 2
    word = torch.tensor([encode(0.0 if r % 4 == 0 else 0.8, 0.7 + 0.02 * r, 100 + r, top_k=r % 6,
                                min_p=0.01 * (r % 3), ban_until=30 if r % 2 else 0) for r in range(rows)],
                        dtype=torch.long)
    logits[:, 0, 25] = 9.0                        # an EOS id in the second rank's slice
    positions = torch.arange(rows)
    whole = sample(logits[:, -1].clone(), word, positions, banned=ban_columns((25,), 0, V, "cpu"))
    split = on_group((0, 1), lambda g: g.sample(logits[..., g.tp_rank * per:(g.tp_rank + 1) * per].clone(),
                                                word, positions, eos_ids=(25,)))
    for ids in split:
        assert ids.tolist() == whole.tolist()
    assert all(t != 25 for r, t in enumerate(whole.tolist()) if r % 2)


def test_encode_refuses_what_the_server_never_sends():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0), dict(top_k=-1)):
        args = dict(temperature=1.0, top_p=1.0, seed=0) | bad
        try:
            encode(**args)
        except ValueError:
            continue
        raise AssertionError(f"encode accepted {bad}")


logit_values = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 5.0, 5.0, -math.inf, math.inf, math.nan, 3.4e38, -3.4e38]),
                         st.floats(-50, 50))


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(data=st.data(), vocab=st.integers(1, 48), rows=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_any_accepted_parameters_give_a_token_in_the_vocabulary(data, vocab, rows, dtype):
    logits = torch.tensor(data.draw(st.lists(st.lists(logit_values, min_size=vocab, max_size=vocab),
                                             min_size=rows, max_size=rows)), dtype=torch.float32).to(dtype)
    params = [dict(temperature=data.draw(st.one_of(st.just(0.0), st.floats(1e-12, 2.0), st.sampled_from([4e-7, 1e-9]))),
                   top_p=data.draw(st.one_of(st.floats(1e-12, 1.0), st.sampled_from([4e-7, 1e-9, 1.0]))),
                   seed=data.draw(st.integers(0, 2 ** 64)),
                   top_k=data.draw(st.one_of(st.just(0), st.integers(1, MAX_TOP_K), st.integers(vocab, 10 ** 6))),
                   min_p=data.draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0), st.just(1e-9))),
                   ban_until=data.draw(st.integers(0, 50)))
              for _ in range(rows)]
    word = torch.tensor([encode(**p) for p in params], dtype=torch.long)
    position = torch.tensor(data.draw(st.lists(st.integers(0, 60), min_size=rows, max_size=rows)))
    eos = data.draw(st.lists(st.integers(0, vocab - 1), max_size=3))
    finite = torch.isfinite(logits.float()).all(dim=-1).tolist()
    out = sample(logits.clone(), word, position, banned=ban_columns(eos, 0, vocab, "cpu")).tolist()
    for r, token in enumerate(out):
        if not finite[r]:
            assert token == NON_FINITE_TOKEN
            continue
        assert 0 <= token < vocab
        if params[r]["temperature"] * sampling.SCALE < 0.5:   # greedy: the first maximum after the ban
            banned = logits[r].clone()
            if position[r] < params[r]["ban_until"] and eos:
                banned[eos] = torch.finfo(dtype).min
            assert token == int(torch.argmax(banned.float()))


def test_a_rank_refuses_a_malformed_word_for_that_request_only():
    from opweave.kernels.sampling import bad_word

    assert bad_word(encode(1.0, 4e-7, 5, top_k=3, min_p=1e-9, ban_until=9)) is None
    assert bad_word((1, 2, 3)) and bad_word(encode(1.0, 1.0, 0)[:2] + (0, 0, 0, 0))
    assert bad_word((0, 0, 10 ** 7, 0, 0, 0)) and bad_word((0, -1, 1, 0, 0, 0))


def test_the_ban_keeps_a_non_finite_row_reported():
    logits = torch.tensor([[0.0, 0.0, -math.inf], [0.0, 1.0, 2.0]])
    word = torch.tensor([encode(0.0, 1.0, 0, ban_until=9)] * 2, dtype=torch.long)
    out = sample(logits, word, torch.tensor([0, 0]), banned=ban_columns((2,), 0, 3, "cpu")).tolist()
    assert out == [NON_FINITE_TOKEN, 1]
