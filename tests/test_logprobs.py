"""Log-probabilities: the device kernel (`opweave.kernels.logprobs`) against `log_softmax`, alone
and over a vocabulary split across TP ranks; the scheduler feeding a prompt whose log-probabilities
are asked a token a round; and the server over the real engine, through the `openai` client,
against transformers' log-probabilities (outputs, echoed prompts, chat, streamed)."""

from __future__ import annotations

import math

import pytest
import torch

from opweave.kernels.logprobs import decode, merge, partials, record_width, records
from opweave.kernels.sampling import encode, sample


def _lp(rec: torch.Tensor, top: int):
    return [decode(row, top) for row in rec.tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_records_are_log_softmax_of_the_logits_before_the_ban(dtype):
    rows, vocab, top = 5, 300, 4
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    want = torch.log_softmax(logits.float(), dim=-1)
    word = torch.tensor([encode(0.0, 1.0, 0, ban_until=100)] * rows)  # EOS 7 banned at these positions
    logits[:, 7] = logits.float().max(dim=-1).values.to(dtype) + 1      # ... though it is the argmax
    want = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor([-1, 3, -1, 250, -1])
    columns = torch.tensor([7])
    work = logits.clone()
    rec = records(work, lambda: sample(work, word, torch.full((rows,), 5), banned=columns), target, top)
    assert rec.shape == (rows, record_width(top)) and rec.dtype == torch.long
    ids = rec[:, 0]
    assert not (ids == 7).any()  # the ban held for the draw ...
    for r, (logprob, best) in enumerate(_lp(rec, top)):
        token = int(ids[r]) if target[r] < 0 else int(target[r])
        assert logprob == pytest.approx(float(want[r, token]), abs=1e-5)
        assert best[0][0] == 7  # ... but not for the figures: the model's distribution
        values, indices = want[r].topk(top)
        assert [i for i, _ in best] == indices.tolist()
        assert [v for _, v in best] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.mark.parametrize("tp", [2, 3])
def test_a_split_vocabulary_merges_to_the_whole_ones(tp):
    rows, vocab, top = 4, 90, 5
    logits = torch.randn(rows, vocab)
    ids = logits.argmax(dim=-1)
    target = torch.tensor([-1, 11, 89, -1])
    whole = records(logits.clone(), lambda: ids, target, top)
    width = vocab // tp
    parts = []
    for r in range(tp):
        piece = logits[:, r * width:(r + 1) * width]
        part = partials(piece, torch.where(target < 0, ids, target), top, vocab_offset=r * width)
        parts.append(part)
    split = merge(torch.stack(parts), ids, top)
    assert torch.equal(split[:, 0], whole[:, 0])
    assert torch.equal(split[:, 2:2 + top], whole[:, 2:2 + top])
    a, b = split.view(torch.float64), whole.view(torch.float64)
    assert torch.allclose(a[:, 1], b[:, 1], atol=1e-6) and torch.allclose(a[:, 2 + top:], b[:, 2 + top:], atol=1e-6)


def test_records_read_nothing_from_the_host():
    """In a decode round (captured on a GPU) the records are made on the device alone."""
    from opweave.runtime.syncguard import NoHostSync

    logits = torch.randn(3, 50)
    word = torch.tensor([encode(1.0, 0.9, 1, logprobs=2)] * 3)
    target = torch.tensor([-1, 4, -1])
    with NoHostSync():
        records(logits, lambda: sample(logits, word, torch.zeros(3, dtype=torch.long)), target, 2)


def test_a_prompt_with_logprobs_is_fed_a_token_a_round_with_its_targets():
    from opweave.runtime.scheduler import Request, Scheduler

    word = encode(0.0, 1.0, 0, logprobs=1)
    echo = Request(index=0, prompt=[5, 6, 7, 8], max_new_tokens=2, sampling=word, prompt_logprobs=True)
    plain = Request(index=1, prompt=[1, 2, 3], max_new_tokens=1, sampling=word)
    sched = Scheduler([echo, plain], num_microbatches=1, rows=2, context=64, eos_ids=(), prefill_chunk=16)
    plans = []
    for r in range(6):
        sched.plan_round()
        plans.append(sched.take(r, 0))
    first = [p.rows[0] for p in plans]
    assert [s.tokens for s in first[:4]] == [(5,), (6,), (7,), (8,)]
    assert [s.target for s in first[:4]] == [6, 7, 8, -1]
    assert plans[0].rows[1].tokens == (1, 2, 3)  # the other row prefills whole
    from opweave.runtime.pages import logprobs
    assert logprobs(plans[0].values[0]) and logprobs(plans[0].values[1])  # both rows report some

    def record(token, logprob):
        value = torch.tensor([[0.0, logprob, token, logprob]], dtype=torch.float64).view(torch.long)[0].tolist()
        return [token, value[1], token, value[3]]

    events = []
    sched.on_event = lambda req, token, reason, lp: events.append((req.index, token, lp))
    for r, plan in enumerate(plans):
        recs = [record(s.target if s.target >= 0 else 40 + r, -0.5 - r) if s.request else [0, 0, 0, 0]
                for s in plan.rows]
        sched.learn(r, 0, [rec[0] for rec in recs], recs)
    assert echo.prompt_lp[1].logprob == -0.5 and echo.prompt_lp[3].logprob == -2.5
    assert sorted(echo.prompt_lp) == [1, 2, 3]
    assert echo.output == [43, 44] and plain.output == [40]
    assert [(i, t, lp.logprob) for i, t, lp in events if t is not None][:2] == [(1, 40, -0.5), (0, 43, -3.5)]


def test_token_texts_keep_their_leading_spaces(tmp_path):
    """A SentencePiece-style tokenizer's word mark becomes the token's leading space (each token is
    read after the one before it): the tokens join to the text, the offsets follow, and chat's
    `bytes` are the text's."""
    from opweave.serve.logprobs import Entry, Formatter
    from opweave.serve.tokenizer import Tokenizer
    from serve_fixtures import write_tokenizer

    tok = Tokenizer.from_folder(write_tokenizer(str(tmp_path / "tok")))
    ids = tok.encode("the cat sat on the mat")[1:]  # BOS dropped: a completion's output
    items = [Entry(t, -1.0, ((t, -1.0),)) for t in ids]
    prompt_last = tok.encode("hello")[-1]
    body = Formatter(tok, "completion", 1, previous=prompt_last).body(items)
    assert "".join(body["tokens"]) == tok.decode([prompt_last] + ids)[len(tok.decode([prompt_last])):]
    assert body["tokens"][0].startswith(" ") and body["text_offset"][1] == len(body["tokens"][0])
    assert all(list(top)[0] == t for top, t in zip(body["top_logprobs"], body["tokens"]))
    chat = Formatter(tok, "chat", 1, previous=prompt_last).body(items)["content"]
    assert [c["token"] for c in chat] == body["tokens"] and chat[1]["bytes"] == list(chat[1]["token"].encode())


def test_a_bad_max_logprobs_is_one_line_and_exit_2(tmp_path, capsys):
    from opweave.cli import main

    for bad in ("25", "-2"):
        assert main(["serve", str(tmp_path), "--weights", "random", "--tokenizer", str(tmp_path),
                     "--max-logprobs", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "--max-logprobs must be -1 (none) or 0 to 20" in err


def test_the_cli_default_is_the_kernels_limit():
    from opweave.cli.serving import MAX_LOGPROBS
    from opweave.kernels.logprobs import MAX_TOP_LOGPROBS

    assert MAX_LOGPROBS == MAX_TOP_LOGPROBS


@pytest.mark.slow
def test_served_logprobs_are_transformers_log_softmax(tiny_checkpoint, tmp_path):
    """Over the real engine (CPU ranks of an AFD plan, whose last stage splits the vocabulary over
    two ranks): a greedy completion's logprobs, an echoed prompt's (lm-eval's loglikelihood
    request), chat's and a stream's equal log_softmax of transformers' logits."""
    from opweave.serve.engine import Engine
    from hf_fixtures import hf_generate, hf_step_logits
    from test_runtime import PROMPTS
    from test_serve_api import client, serving, tiny_afd_llama

    folder, tok, art = tiny_afd_llama(tiny_checkpoint, tmp_path)
    prompt, new = PROMPTS[2], 4
    steps = torch.log_softmax(hf_step_logits(folder, prompt, new), dim=-1)
    prompt_lp = torch.log_softmax(hf_generate(folder, prompt, 1)[0], dim=-1)
    with serving(Engine(art, folder, max_queue=16), tok) as url:
        out = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=new, logprobs=3)
        lp = out.choices[0].logprobs
        ids = steps.argmax(dim=-1).tolist()
        assert lp.token_logprobs == pytest.approx([float(steps[i, t]) for i, t in enumerate(ids)], abs=1e-4)
        assert "".join(lp.tokens) == out.choices[0].text  # each token's text in context (its leading space)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        for i, top in enumerate(lp.top_logprobs):
            best = steps[i].topk(3)
            assert list(top.values())[:3] == pytest.approx(best.values.tolist(), abs=1e-4)
        # lm-eval's loglikelihood request: echo, max_tokens 1, logprobs 1, the prompt as a batch of one
        ll = client(url).completions.create(model="tiny", prompt=[prompt], max_tokens=1, logprobs=1, echo=True)
        got = ll.choices[0].logprobs
        assert len(got.token_logprobs) == len(prompt) + 1 and got.token_logprobs[0] is None
        want = [float(prompt_lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert got.token_logprobs[1:len(prompt)] == pytest.approx(want, abs=1e-4)
        assert got.token_logprobs[-1] == pytest.approx(float(steps[0, ids[0]]), abs=1e-4)
        assert got.text_offset[0] == 0 and got.top_logprobs[0] is None
        # chat: logprobs with top_logprobs, the content entries' shape
        chat = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, logprobs=True, top_logprobs=2)
        content = chat.choices[0].logprobs.content
        assert len(content) == 2 and all(len(c.top_logprobs) == 2 for c in content)
        assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 and c.bytes == list(c.token.encode()) for c in content)
        # streamed: the chunks' logprobs are the whole response's
        streamed = []
        for c in client(url).completions.create(model="tiny", prompt=prompt, max_tokens=new, logprobs=0,
                                                 stream=True):
            if c.choices and c.choices[0].logprobs is not None:
                streamed += c.choices[0].logprobs.token_logprobs
        assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
        # a request for more than the server's --max-logprobs is a 400 naming the field
        import openai

        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client(url).completions.create(model="tiny", prompt=prompt, max_tokens=1, logprobs=21)
    assert not math.isnan(lp.token_logprobs[0])
