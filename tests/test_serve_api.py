"""The OpenAI-compatible HTTP front end (opweave.serve.app) against a fake engine, through the official client.

A live uvicorn server runs in a thread on a free port over `serve_fixtures.FakeEngine` (the engine's
interface, deterministic tokens: a reply repeats its prompt) and a real tokenizer built offline.
Expected texts are decoded from the fake's tokens with the same tokenizer, independently of the
server's streaming detokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time

import pytest

from serve_fixtures import FakeEngine, wait_until, write_tokenizer

# The `serve` extra and the `openai` client (both in the `test` extra).
for _module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module)
openai = pytest.importorskip("openai")

PROMPT = "Hello world, how are you today?"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from opweave.serve.tokenizer import Tokenizer

    return Tokenizer.from_folder(write_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@contextlib.contextmanager
def serving(engine, tokenizer, name="tiny", **app_kwargs):
    """A live server over `engine` in a thread, serving it as `name` (`app_kwargs` go to
    `make_app`); yields its base URL."""
    import uvicorn

    from opweave.serve.app import make_app

    engine.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(engine, tokenizer, name, **app_kwargs), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop(timeout_s=5)
        sock.close()


@pytest.fixture
def server(tokenizer):
    engine = FakeEngine()
    with serving(engine, tokenizer) as url:
        yield engine, url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def expected(tokenizer, prompt_ids, n):
    return tokenizer.decode(FakeEngine.reply(prompt_ids, n))


def http(url: str, method: str, path: str, body: bytes | None = None, headers=None):
    """(status, headers, parsed JSON or text) of one plain HTTP request."""
    import http.client
    from urllib.parse import urlsplit

    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=20)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    try:
        return resp.status, dict(resp.getheaders()), json.loads(raw)
    except ValueError:
        return resp.status, dict(resp.getheaders()), raw


# ---------------------------------------------------------------- happy paths
def test_completion_text_and_usage(server, tokenizer):
    engine, url = server
    out = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, seed=7)
    ids = tokenizer.encode(PROMPT)
    assert engine.submitted[0][0] == ids and engine.submitted[0][1].max_tokens == 12
    assert out.choices[0].text == expected(tokenizer, ids, 12)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(ids), 12,
                                                                                              len(ids) + 12)
    assert out.model == "tiny" and out.object == "text_completion"


def test_completion_token_ids_streamed_matches_whole(server, tokenizer):
    _, url = server
    ids = tokenizer.encode("One two three four five six seven")
    whole = client(url).completions.create(model="tiny", prompt=ids, max_tokens=20)
    chunks = list(client(url).completions.create(model="tiny", prompt=ids, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text == expected(tokenizer, ids, 20)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == len(ids)
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 5  # streamed, not in one piece


def test_chat_uses_template_streaming_and_not(server, tokenizer):
    engine, url = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    out = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=9)
    prompt = engine.submitted[0][0]
    assert prompt == tokenizer.encode_chat(messages)
    assert tokenizer.hf.convert_ids_to_tokens(prompt)[-1] == "<|assistant|>"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected(tokenizer, prompt, 9)
    assert out.usage.completion_tokens == 9 and out.usage.prompt_tokens == len(prompt)
    stream = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=9, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_eos_finishes_stop_and_is_not_text(tokenizer):
    engine = FakeEngine(eos_after=5)
    with serving(engine, tokenizer) as url:
        out = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=30)
    ids = tokenizer.encode(PROMPT)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == expected(tokenizer, ids, 5)
    assert out.usage.completion_tokens == 6  # the EOS token counts, as it was generated


def test_stop_token_ids_end_without_text(server, tokenizer):
    _, url = server
    ids = tokenizer.encode("One two three four five")
    reply = FakeEngine.reply(ids, 20)
    stop_id = reply[3]
    out = client(url).completions.create(model="tiny", prompt=ids, max_tokens=20,
                                         extra_body={"stop_token_ids": [stop_id]})
    k = reply.index(stop_id)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == k + 1
    assert out.choices[0].text == tokenizer.decode(reply[:k])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_and_cancels(server, tokenizer, stream):
    engine, url = server
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(prompt)
    full = expected(tokenizer, ids, 40)
    stop = "jumps"
    out = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=["zzz", stop],
                                         stream=stream)
    if stream:
        chunks = list(out)
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert text == full[:full.index(stop)] and finish == "stop"
    assert wait_until(lambda: engine.finished.get(0) == "cancelled")  # the engine stopped generating
    assert 0 in engine.cancelled


def test_models_health_metrics(server, tokenizer):
    engine, url = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert http(url, "GET", "/health")[0] == 200
    status, _, err = http(url, "GET", "/v1/nothing")
    assert status == 404 and err["error"]["type"] == "not_found_error"
    client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    status, headers, text = http(url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["opweave_generation_tokens_total"]) == 4
    assert float(lines['opweave_requests_total{finish_reason="length"}']) == 1
    assert float(lines["opweave_time_to_first_token_seconds_count"]) == 1
    assert float(lines["opweave_time_per_output_token_seconds_count"]) == 1
    assert float(lines["opweave_prompt_tokens_total"]) == len(tokenizer.encode(PROMPT))
    assert float(lines["opweave_generation_tokens_per_second"]) > 0
    for name in ("opweave_requests_running", "opweave_requests_waiting", "opweave_queue_rejections_total",
                 'opweave_round_seconds{quantile="0.5",rank="0",replica_set="0"}'):
        assert name in lines


def test_64_concurrent_streams(tokenizer):
    engine = FakeEngine(max_batch=16, round_s=0.001)
    prompts = [" ".join(["fox", "dog", "one", "two", "three"][: 1 + i % 5]) + f" {i}" for i in range(64)]

    async def one(c, i):
        n = 5 + i % 13
        text, finish = "", None
        stream = await c.completions.create(model="tiny", prompt=prompts[i], max_tokens=n, stream=True,
                                            stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return n, text, finish, usage

    async def all_of(url):
        # closed inside the loop: a client collected after `asyncio.run` ends schedules its close on
        # the closed loop, which asyncio logs at ERROR during whatever test runs next
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    with serving(engine, tokenizer) as url:
        results = asyncio.run(all_of(url))
        assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
    for i, (n, text, finish, usage) in enumerate(results):
        assert usage.completion_tokens == n and finish == "length", i
        assert text == expected(tokenizer, tokenizer.encode(prompts[i]), n), i


# ---------------------------------------------------------------- bad requests
BAD = [
    ("unknown model", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("missing prompt", {"model": "tiny", "max_tokens": 3}, 400, "prompt"),
    ("missing model", {"prompt": "hi"}, 400, "model"),
    ("negative max_tokens", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("fractional max_tokens", {"model": "tiny", "prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("string max_tokens", {"model": "tiny", "prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("temperature too high", {"model": "tiny", "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("negative temperature", {"model": "tiny", "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("string temperature", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("top_p above one", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n above its limit", {"model": "tiny", "prompt": "hi", "n": 65}, 400, "n"),
    ("n zero", {"model": "tiny", "prompt": "hi", "n": 0}, 400, "n"),
    ("best_of beside n", {"model": "tiny", "prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ("prompt too long", {"model": "tiny", "prompt": list(range(10, 74))}, 400, "prompt"),
    ("output past context", {"model": "tiny", "prompt": "hi", "max_tokens": 64}, 400, "max_tokens"),
    ("empty token list", {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("bad stop", {"model": "tiny", "prompt": "hi", "stop": 3}, 400, "stop"),
    ("top_p zero", {"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("unknown field", {"model": "tiny", "prompt": "hi", "top_a": 0.1}, 400, "top_a"),
    ("logit_bias", {"model": "tiny", "prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("presence_penalty", {"model": "tiny", "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("repetition_penalty", {"model": "tiny", "prompt": "hi", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("top_k fractional", {"model": "tiny", "prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ("top_k between 64 and the vocabulary", {"model": "tiny", "prompt": "hi", "top_k": 100}, 400, "top_k"),
    ("min_p above one", {"model": "tiny", "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("min_tokens over max_tokens", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens"),
    ("ignore_eos a string", {"model": "tiny", "prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("user a number", {"model": "tiny", "prompt": "hi", "user": 5}, 400, "user"),
]


@pytest.mark.parametrize("what,body,status,param", BAD, ids=[b[0] for b in BAD])
@pytest.mark.slow
def test_bad_completion_requests(server, what, body, status, param):
    engine, url = server
    got, _, err = http(url, "POST", "/v1/completions", json.dumps(body).encode())
    assert got == status, err
    assert err["error"]["param"] == param and err["error"]["message"] and "\n" not in err["error"]["message"]
    assert err["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert engine.submitted == {}


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_malformed_json(server, raw):
    engine, url = server
    for path in ("/v1/completions", "/v1/chat/completions"):
        got, _, err = http(url, "POST", path, raw)
        assert got == 400 and err["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"content": "no role"}]}, "messages[0]"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "messages[0]"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x " * 80}]}, "messages"),
])
@pytest.mark.slow
def test_bad_chat_requests(server, body, param):
    engine, url = server
    got, _, err = http(url, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert got == 400 and err["error"]["param"] == param, err
    assert engine.submitted == {}


def test_client_raises_on_bad_request_and_others_still_run(server, tokenizer):
    _, url = server
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(url).completions.create(model="tiny", prompt="hi", temperature=3.0)
    with pytest.raises(openai.NotFoundError):
        client(url).chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    out = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    assert out.choices[0].text == expected(tokenizer, tokenizer.encode(PROMPT), 3)


def test_no_chat_template_is_400(tmp_path):
    from opweave.serve.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(write_tokenizer(str(tmp_path), chat_template=None))
    engine = FakeEngine()
    with serving(engine, tok) as url:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert client(url).completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_tokenizer_folder_without_tokenizer(tmp_path):
    from opweave.errors import OpWeaveError
    from opweave.serve.tokenizer import Tokenizer

    with pytest.raises(OpWeaveError, match="no tokenizer.json"):
        Tokenizer.from_folder(str(tmp_path))


# ---------------------------------------------------------------- load and faults
def test_n_choices_that_do_not_all_fit_the_queue_are_429_and_leave_nothing_queued(tokenizer):
    """`n` choices are n requests of the engine: when the queue holds fewer, the response is a 429
    and the choices already queued are cancelled (nothing is left half-submitted)."""
    engine = FakeEngine(max_queue=2)
    with serving(engine, tokenizer) as url:
        engine.pause()
        status, _, err = http(url, "POST", "/v1/completions",
                              json.dumps({"model": "tiny", "prompt": "hi", "n": 3}).encode())
        assert status == 429 and err["error"]["type"] == "rate_limit_error"
        assert sorted(engine.cancelled) == sorted(engine.submitted) and len(engine.submitted) == 2
        engine.resume()
        whole = client(url).completions.create(model="tiny", prompt="hi", max_tokens=2, n=2)
        assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 4


def test_queue_full_is_429_with_retry_after(tokenizer):
    engine = FakeEngine(max_queue=2)
    with serving(engine, tokenizer) as url:
        engine.pause()
        held = [client(url).completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True)
                for _ in range(2)]
        assert wait_until(lambda: engine.stats()["waiting"] == 2)
        status, headers, err = http(url, "POST", "/v1/completions",
                                    json.dumps({"model": "tiny", "prompt": "hi"}).encode())
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert err["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client(url).completions.create(model="tiny", prompt="hi")
        engine.resume()
        for stream in held:  # the waiting ones were not disturbed
            assert [c.choices[0].finish_reason for c in stream][-1] == "length"
        assert "opweave_queue_rejections_total 2.0" in http(url, "GET", "/metrics")[2]


def test_stream_disconnect_cancels(tokenizer):
    engine = FakeEngine(round_s=0.01)
    with serving(engine, tokenizer) as url:
        stream = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=60 - 10, stream=True)
        for i, _ in zip(range(3), stream):
            pass
        stream.close()
        assert wait_until(lambda: engine.finished.get(0) == "cancelled")
        assert engine.stats()["running"] == 0


def test_non_streaming_disconnect_cancels(tokenizer):
    engine = FakeEngine()
    with serving(engine, tokenizer) as url:
        engine.pause()
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 5}).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_until(lambda: len(engine.submitted) == 1)
        assert wait_until(lambda: engine.cancelled == [0])
        engine.resume()
        assert wait_until(lambda: engine.finished.get(0) == "cancelled")


def test_engine_failure_mid_request(tokenizer):
    engine = FakeEngine(round_s=0.01)
    with serving(engine, tokenizer) as url:
        stream = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=50, stream=True)
        got = []
        with pytest.raises(openai.APIError, match="request id"):  # the detail is in the log only
            for chunk in stream:
                got.append(chunk)
                if len(got) == 2:
                    engine.fail("rank 1 died")
        status, _, err = http(url, "GET", "/health")
        assert status == 503 and "rank 1 died" in err["error"]["message"]
        with pytest.raises(openai.InternalServerError):
            client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=5)


def test_engine_failure_non_streaming_is_500(tokenizer):
    engine = FakeEngine()
    with serving(engine, tokenizer) as url:
        engine.pause()
        result = {}

        def call():
            result["r"] = http(url, "POST", "/v1/completions",
                               json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 5}).encode())

        t = threading.Thread(target=call)
        t.start()
        assert wait_until(lambda: len(engine.submitted) == 1)
        engine.fail("rank 2 exited with status 1")
        t.join(10)
        status, _, err = result["r"]
        assert status == 500 and "request id" in err["error"]["message"]  # the detail is in the log only
        assert err["error"]["type"] == "server_error"


def test_run_server_exits_1_when_engine_dies(tokenizer):
    from opweave.serve.app import run_server

    engine = FakeEngine()
    engine.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = {}
    t = threading.Thread(target=lambda: code.setdefault("rc", run_server(engine, tokenizer, "tiny", "127.0.0.1", port,
                                                                         log_level="warning")))
    t.start()
    assert wait_until(lambda: http_ok(f"http://127.0.0.1:{port}"), timeout=10)
    engine.fail("rank 0 died")
    t.join(10)
    assert code["rc"] == 1 and not t.is_alive()


def http_ok(url: str) -> bool:
    try:
        return http(url, "GET", "/health")[0] == 200
    except OSError:
        return False


def test_text_stream_bytes_and_stop_across_tokens():
    """Byte-level tokens: no half character is ever sent; a stop string split over tokens still matches."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from opweave.serve.tokenizer import TextStream, Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = RawTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))  # a token per byte
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw))
    text = "héllo wörld ✓ done, déjà vu"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters take several tokens
    stream = TextStream(tok)
    pieces = [stream.add(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    stream = TextStream(tok, stop=("déjà",))
    pieces = [stream.add(t) for t in ids]
    assert stream.stopped and "".join(pieces) + stream.flush() == "héllo wörld ✓ done, "


@pytest.mark.slow
def test_sigterm_stops_gracefully_exit_0(tmp_path):
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "serve.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from serve_fixtures import FakeEngine, write_tokenizer\n"
        "from opweave.serve.app import run_server\n"
        "from opweave.serve.tokenizer import Tokenizer\n"
        f"tok = Tokenizer.from_folder(write_tokenizer({str(tmp_path / 'tok')!r}))\n"
        "engine = FakeEngine()\n"
        "engine.start()\n"
        f"rc = run_server(engine, tok, 'tiny', '127.0.0.1', {port}, log_level='warning')\n"
        "print('engine healthy after exit:', engine.healthy, flush=True)\n"
        "sys.exit(rc)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: http_ok(f"http://127.0.0.1:{port}"), timeout=30), proc.stdout.read()
        stream = client(f"http://127.0.0.1:{port}").completions.create(model="tiny", prompt="hi", max_tokens=30,
                                                                       stream=True)
        next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        chunks = list(stream)  # the running request finishes
        assert chunks[-1].choices[0].finish_reason == "length"
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "engine healthy after exit: False" in out  # run_server stopped the engine


@pytest.mark.slow
def tiny_afd_llama(tiny_checkpoint, tmp_path):
    """(checkpoint folder, its tokenizer, an AFD artifact) of the tiny Llama the real-engine tests serve."""
    from opweave.serve.tokenizer import Tokenizer
    from test_runtime import LAYERS, compile_pinned

    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    tok_folder = str(tmp_path / "tok")
    with open(os.path.join(folder, "config.json")) as f:
        write_tokenizer(tok_folder, vocab_size=json.load(f)["vocab_size"])
    art = str(tmp_path / "art")
    compile_pinned(folder, "afd", art)
    return folder, Tokenizer.from_folder(tok_folder), art


def test_real_engine_greedy_text_equals_reference(tiny_checkpoint, tmp_path):
    """Through the server over the real engine (CPU ranks of an AFD plan): the greedy tokens of `opweave
    run` (the Hugging Face reference), as text, streamed or not, for prompts given as token ids."""
    from opweave.serve.engine import Engine
    from hf_fixtures import hf_generate
    from test_runtime import NEW_TOKENS, PROMPTS

    folder, tok, art = tiny_afd_llama(tiny_checkpoint, tmp_path)
    with serving(Engine(art, folder, max_queue=16), tok) as url:
        for prompt in (PROMPTS[0], PROMPTS[2]):
            want = hf_generate(folder, prompt, NEW_TOKENS)[1]
            whole = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS)
            streamed = "".join(c.choices[0].text for c in client(url).completions.create(
                model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, stream=True))
            assert whole.choices[0].text == streamed == tok.decode(list(want))
            assert whole.usage.completion_tokens == NEW_TOKENS and whole.choices[0].finish_reason == "length"
        # n choices: greedy ones are all the reference; seeded ones are choice i = one request at seed + i,
        # whole or streamed (each chunk names its choice); the prompt counts once in the usage
        many = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW_TOKENS, n=3)
        want = tok.decode(list(hf_generate(folder, PROMPTS[0], NEW_TOKENS)[1]))
        assert [c.index for c in many.choices] == [0, 1, 2] and {c.text for c in many.choices} == {want}
        assert many.usage.completion_tokens == 3 * NEW_TOKENS and many.usage.prompt_tokens == len(PROMPTS[0])
        drawn = dict(model="tiny", prompt=PROMPTS[2], max_tokens=NEW_TOKENS, temperature=1.0)
        alone = [client(url).completions.create(**drawn, seed=5 + i).choices[0].text for i in range(2)]
        assert alone[0] != alone[1]
        assert [c.text for c in client(url).completions.create(**drawn, seed=5, n=2).choices] == alone
        pieces = {0: "", 1: ""}
        for c in client(url).completions.create(**drawn, seed=5, n=2, stream=True):
            for choice in c.choices:
                pieces[choice.index] += choice.text
        assert [pieces[0], pieces[1]] == alone
        chat = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, n=2, temperature=1.0, seed=1)
        assert [c.index for c in chat.choices] == [0, 1] and all(c.message.role == "assistant" for c in chat.choices)


def test_sampling_defaults_come_from_the_checkpoint(tmp_path):
    """A request without temperature / top_p takes generation_config.json's recommendation when
    it samples (`do_sample`), greedy otherwise; a request's own values always win."""
    import shutil

    from opweave.errors import OpWeaveError
    from opweave.serve.tokenizer import Tokenizer, generation_defaults

    folder = write_tokenizer(str(tmp_path / "tok"))
    assert generation_defaults(folder) == (0.0, 1.0)                      # no generation_config.json
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, f)
    assert generation_defaults(folder) == (0.6, 0.9)
    tok = Tokenizer.from_folder(folder)
    engine = FakeEngine()
    with serving(engine, tok) as url:
        client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, seed=3)
    first, second = (engine.submitted[i][1] for i in (0, 1))
    assert (first.temperature, first.top_p) == (0.6, 0.9)
    assert (second.temperature, second.top_p, second.seed) == (0.0, 0.9, 3)
    other = str(tmp_path / "greedy")
    shutil.copytree(folder, other)
    with open(os.path.join(other, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False, "temperature": 0.6}, f)              # recommends no sampling
    assert generation_defaults(other) == (0.0, 1.0)
    with open(os.path.join(other, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, "temperature": 9}, f)
    with pytest.raises(OpWeaveError, match="temperature must be a number in"):
        generation_defaults(other)


def test_every_accepted_field_reaches_the_engine(server, tokenizer):
    """What vLLM's benchmark client sends (neutral penalties, logprobs null, ignore_eos, top_k -1)
    is served, and each field with an effect reaches the engine's sampling record."""
    engine, url = server
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": -1,
            "min_p": 0.1, "min_tokens": 2, "ignore_eos": True, "repetition_penalty": 1.0, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": None, "user": "bench", "seed": 3}
    got, _, out = http(url, "POST", "/v1/completions", json.dumps(body).encode())
    assert got == 200, out
    sampling = list(engine.submitted.values())[-1][1]
    assert (sampling.top_k, sampling.min_p, sampling.min_tokens, sampling.ignore_eos) == (0, 0.1, 2, True)
    assert (sampling.temperature, sampling.top_p, sampling.seed, sampling.max_tokens) == (0.5, 0.9, 3, 4)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
            "top_k": 5, "tool_choice": "none", "response_format": {"type": "text"}}
    got, _, out = http(url, "POST", "/v1/chat/completions", json.dumps(chat).encode())
    assert got == 200, out
    assert list(engine.submitted.values())[-1][1].top_k == 5
