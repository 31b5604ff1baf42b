"""vLLM's extra endpoints (/tokenize, /detokenize, /version, /ping) and `echo` on completions, over the fake engine.

A live uvicorn server runs in a thread over `serve_fixtures.FakeEngine` and the offline tokenizer, as in
tests/test_serve_api.py. Expected ids come from the tokenizer and its chat template directly, and
expected completion texts from the fake's tokens, independently of the server's code.
"""

from __future__ import annotations

import contextlib
import json

import pytest

from serve_fixtures import FakeEngine, write_tokenizer

# The `serve` extra and the `openai` client (both in the `test` extra).
for _module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module)
openai = pytest.importorskip("openai")

from test_serve_api import PROMPT, client, expected, http, serving  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from opweave.serve.tokenizer import Tokenizer

    return Tokenizer.from_folder(write_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@pytest.fixture
def server(tokenizer):
    engine = FakeEngine()
    with serving(engine, tokenizer) as url:
        yield engine, url


@pytest.fixture(scope="module")
def shared(tokenizer):
    """One server for the refused requests (none of them reaches the engine)."""
    engine = FakeEngine()
    with serving(engine, tokenizer) as url:
        yield engine, url


def post(url: str, path: str, body, headers=None):
    return http(url, "POST", path, json.dumps(body).encode(), headers)


# ---------------------------------------------------------------- /tokenize and /detokenize
def test_tokenize_prompt_is_what_completions_submit(server, tokenizer):
    engine, url = server
    status, _, out = post(url, "/tokenize", {"prompt": PROMPT})
    ids = tokenizer.encode(PROMPT)
    assert status == 200 and out == {"count": len(ids), "max_model_len": engine.context, "tokens": ids}
    client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert engine.submitted[0][0] == ids
    status, _, out = post(url, "/tokenize", {"model": "tiny", "prompt": PROMPT, "add_special_tokens": False,
                                             "return_token_strs": True})
    plain = tokenizer.hf.encode(PROMPT, add_special_tokens=False)
    assert status == 200 and out["tokens"] == plain == ids[1:] and out["count"] == len(plain)
    assert out["token_strs"] == tokenizer.hf.convert_ids_to_tokens(plain)
    assert "".join(out["token_strs"]).replace("▁", " ").strip() == PROMPT


def test_tokenize_messages_is_what_chat_submits(server, tokenizer):
    engine, url = server
    status, _, out = post(url, "/tokenize", {"model": "tiny", "messages": MESSAGES, "return_token_strs": True})
    ids = tokenizer.encode_chat(MESSAGES)
    assert status == 200 and out["tokens"] == ids and out["count"] == len(ids)
    assert out["max_model_len"] == engine.context and out["token_strs"][-1] == "<|assistant|>"
    client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert engine.submitted[0][0] == ids
    # without the generation prompt: the template's text without the assistant's turn
    status, _, out = post(url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    text = tokenizer.hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert status == 200 and out["tokens"] == tokenizer.hf.encode(text, add_special_tokens=False) == ids[:-1]
    # add_special_tokens puts the tokenizer's BOS in front of the template's own
    status, _, out = post(url, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True})
    assert status == 200 and out["tokens"] == [tokenizer.hf.bos_token_id, *ids]
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    assert post(url, "/tokenize", {"messages": parts})[2]["tokens"] == ids


def test_tokenize_messages_without_a_chat_template_is_400(tmp_path):
    from opweave.serve.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(write_tokenizer(str(tmp_path), chat_template=None))
    with serving(FakeEngine(), tok) as url:
        status, _, err = post(url, "/tokenize", {"messages": MESSAGES})
        assert status == 400 and err["error"]["param"] == "messages" and "no chat template" in err["error"]["message"]
        assert post(url, "/tokenize", {"prompt": "hi"})[2]["tokens"] == tok.encode("hi")


def test_detokenize_round_trips(server, tokenizer):
    _, url = server
    plain = tokenizer.hf.encode(PROMPT, add_special_tokens=False)
    status, _, out = post(url, "/detokenize", {"model": "tiny", "tokens": plain})
    assert status == 200 and out == {"prompt": PROMPT}
    ids = post(url, "/tokenize", {"prompt": PROMPT})[2]["tokens"]                 # with BOS
    text = post(url, "/detokenize", {"tokens": ids})[2]["prompt"]
    assert text == tokenizer.hf.decode(ids, skip_special_tokens=False) and text.startswith("<s>")
    assert post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})[2]["tokens"] == ids
    assert post(url, "/detokenize", {"tokens": []})[2] == {"prompt": ""}


# ---------------------------------------------------------------- refused requests
BAD = [
    ("tokenize: other model", "/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("tokenize: model not a string", "/tokenize", {"model": 3, "prompt": "hi"}, 400, "model"),
    ("tokenize: nothing to tokenize", "/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("tokenize: prompt a number", "/tokenize", {"prompt": 5}, 400, "prompt"),
    ("tokenize: prompt token ids", "/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("tokenize: prompt and messages", "/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "messages"),
    ("tokenize: generation prompt on text", "/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 400,
     "add_generation_prompt"),
    ("tokenize: add_special_tokens a string", "/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400,
     "add_special_tokens"),
    ("tokenize: return_token_strs a number", "/tokenize", {"prompt": "hi", "return_token_strs": 1}, 400,
     "return_token_strs"),
    ("tokenize: unknown field", "/tokenize", {"prompt": "hi", "max_tokens": 3}, 400, "max_tokens"),
    ("tokenize: empty messages", "/tokenize", {"messages": []}, 400, "messages"),
    ("tokenize: message without role", "/tokenize", {"messages": [{"content": "x"}]}, 400, "messages[0]"),
    ("tokenize: image part", "/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0]"),
    ("tokenize: add_generation_prompt a string", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": "no"},
     400, "add_generation_prompt"),
    ("detokenize: other model", "/detokenize", {"model": "gpt-4", "tokens": [7]}, 404, "model"),
    ("detokenize: no tokens", "/detokenize", {"model": "tiny"}, 400, "tokens"),
    ("detokenize: id past the vocabulary", "/detokenize", {"tokens": [7, FakeEngine.vocab_size]}, 400, "tokens"),
    ("detokenize: negative id", "/detokenize", {"tokens": [7, -1]}, 400, "tokens"),
    ("detokenize: a string", "/detokenize", {"tokens": "7 8"}, 400, "tokens"),
    ("detokenize: fractional id", "/detokenize", {"tokens": [7.5]}, 400, "tokens"),
    ("detokenize: boolean id", "/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("detokenize: unknown field", "/detokenize", {"tokens": [7], "skip_special_tokens": True}, 400,
     "skip_special_tokens"),
    ("logprobs on a server without them", "/v1/completions",
     {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 1}, 400, "logprobs"),
    ("logprobs past 20", "/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("logprobs a string", "/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": "1"}, 400, "logprobs"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {"model": "tiny", "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat logprobs a number", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "logprobs": 1}, 400,
     "logprobs"),
    ("chat top_logprobs on a server without them", "/v1/chat/completions",
     {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 3}, 400, "top_logprobs"),
    ("echo a string", "/v1/completions", {"model": "tiny", "prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("echo on chat", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("what,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_json_errors(shared, what, path, body, status, param):
    engine, url = shared
    got, _, err = post(url, path, body)
    assert got == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert err["error"]["param"] == param and err["error"]["message"] and "\n" not in err["error"]["message"]
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 404:
        assert err["error"]["code"] == "model_not_found"
    if what == "logprobs on a server without them":  # the fake engine serves none (--max-logprobs -1)
        assert "--max-logprobs" in err["error"]["message"]
    assert engine.submitted == {}


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_malformed_json_is_400(shared, path):
    for raw in (b"{not json", b"[1, 2]", b""):
        status, _, err = http(shared[1], "POST", path, raw)
        assert status == 400 and err["error"]["type"] == "invalid_request_error", err


# ---------------------------------------------------------------- /version and /ping
def test_version(server):
    import importlib.metadata

    import opweave

    status, _, out = http(server[1], "GET", "/version")
    assert status == 200 and out == {"version": opweave.__version__}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # installed: the same version
        assert out["version"] == importlib.metadata.version("opweave")


def test_ping_follows_health(server):
    engine, url = server
    for method in ("GET", "POST"):
        status, _, out = http(url, method, "/ping")
        assert status == 200 and out == {"status": "ok"}
    assert post(url, "/ping", {"anything": 1})[0] == 200
    engine.fail("rank 1 died")
    for method in ("GET", "POST"):
        status, _, err = http(url, method, "/ping")
        assert status == 503 and err["error"]["type"] == "server_error" and "rank 1 died" in err["error"]["message"]
    assert http(url, "GET", "/health")[0] == 503


# ---------------------------------------------------------------- echo
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_prepends_the_prompt(server, tokenizer, stream, as_ids):
    """Through the official client: the prompt's text (a token-id prompt decoded, BOS included) comes first."""
    engine, url = server
    ids = tokenizer.encode(PROMPT)
    prompt, shown = (ids, tokenizer.hf.decode(ids, skip_special_tokens=False)) if as_ids else (PROMPT, PROMPT)
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    out = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=6, echo=True, **options)
    want = shown + expected(tokenizer, ids, 6)
    if stream:
        chunks = list(out)
        assert chunks[0].choices[0].text == shown                        # the prompt is the first chunk
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        usage = chunks[-1].usage
    else:
        assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
        usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 6)  # the echo is not counted
    assert engine.submitted[0][0] == ids
    assert shown.startswith("<s>") == as_ids


def test_echo_is_not_cut_by_a_stop_string(server, tokenizer):
    """Stop strings match the generated text only: a prompt holding one is echoed whole."""
    _, url = server
    prompt = "The quick brown fox jumps over the lazy dog."
    full = expected(tokenizer, tokenizer.encode(prompt), 40)
    out = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=["jumps"], echo=True)
    assert out.choices[0].text == prompt + full[:full.index("jumps")]
    assert out.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- access
def test_api_key_applies_to_the_new_paths(tokenizer):
    key = {"Authorization": "Bearer s3cret-key"}
    with serving(FakeEngine(), tokenizer, api_key="s3cret-key") as url:
        for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [7]}),
                                   ("GET", "/version", None)):
            raw = None if body is None else json.dumps(body).encode()
            status, _, err = http(url, method, path, raw)
            assert status == 401 and err["error"]["code"] == "invalid_api_key", (path, err)
            assert http(url, method, path, raw, {"Authorization": "Bearer wrong"})[0] == 401
            assert http(url, method, path, raw, key)[0] == 200, path
        assert http(url, "GET", "/health")[0] == 200                     # still open, as before
        for method in ("GET", "POST"):  # a load balancer's probe, open as /health (and as in vLLM)
            assert http(url, method, "/ping")[0] == 200
        out = openai.OpenAI(base_url=url + "/v1", api_key="s3cret-key", max_retries=0).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, echo=True)
        assert out.choices[0].text.startswith(PROMPT)
