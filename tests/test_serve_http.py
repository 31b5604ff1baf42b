"""HTTP-level hardening of the server (opweave.serve.guard, app, protocol.load_json) against hostile input.

A live uvicorn server with `guard.h11_protocol` runs in a thread over `serve_fixtures.FakeEngine`;
raw sockets send what a well-behaved client would not (lying Content-Length, slow heads, deep JSON).
Every refusal must be an OpenAI-style JSON error, and a client's error must leave no traceback in
the log. Timeouts are configured short; waits for them are generous.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import pytest

from serve_fixtures import FakeEngine, wait_until, write_tokenizer

for _module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_module)

from opweave.serve import guard, protocol  # noqa: E402

BODY = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from opweave.serve.tokenizer import Tokenizer

    return Tokenizer.from_folder(write_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@contextlib.contextmanager
def serving(tokenizer, engine=None, header_timeout_s=5.0, max_connections=64, **app_kwargs):
    """A live guarded server in a thread; yields (engine, uvicorn server, (host, port))."""
    import uvicorn

    from opweave.serve.app import make_app

    engine = engine or FakeEngine()
    engine.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(engine, tokenizer, "tiny", **app_kwargs), log_level="info", lifespan="off",
                            timeout_graceful_shutdown=2, log_config=None,
                            http=guard.h11_protocol(header_timeout_s, max_connections))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 10)
    try:
        yield engine, server, sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop(timeout_s=5)
        sock.close()


def connect(addr, timeout=20.0) -> socket.socket:
    s = socket.create_connection(addr, timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-case headers, body) of one response read off a raw socket (Content-Length bodies)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a response: {raw!r}"
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed(s: socket.socket) -> bool:
    """True once the server has closed `s` (EOF or reset); raises if it sends something instead."""
    try:
        data = s.recv(65536)
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    assert data == b"", data
    return True


def request(addr, method, path, body: bytes | None = None, headers=None):
    """(status, headers, parsed JSON or raw bytes) of one plain HTTP request."""
    import http.client

    conn = http.client.HTTPConnection(*addr, timeout=20)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(raw)
    except ValueError:
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, raw


def assert_error(status, body, want_status, param=None):
    assert status == want_status, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "\n" not in body["error"]["message"]
    assert body["error"]["type"] == protocol.error_type(want_status)
    if param is not None:
        assert body["error"]["param"] == param, body


def assert_quiet(caplog):
    """No traceback and nothing at ERROR in the log (client errors)."""
    loud = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not loud, [r.getMessage() for r in loud]
    assert "Traceback" not in caplog.text


@pytest.fixture
def server(tokenizer):
    with serving(tokenizer) as s:
        yield s


# ---------------------------------------------------------------- JSON bodies
def test_load_json_depth_limit_counts_outside_strings():
    deep = {"model": "m"}
    inner = deep
    for _ in range(protocol.MAX_JSON_DEPTH - 2):
        inner["x"] = {}
        inner = inner["x"]
    inner["x"] = [1]                                         # exactly MAX_JSON_DEPTH levels
    assert protocol.load_json(json.dumps(deep).encode()) == deep
    inner["x"] = [[1]]
    with pytest.raises(protocol.ApiError, match="deeper than 64"):
        protocol.load_json(json.dumps(deep).encode())
    brackets = {"prompt": "[[[[{{{{\\\"" * 1000, "model": "m"}  # brackets inside a string do not count
    assert protocol.load_json(json.dumps(brackets).encode()) == brackets


@pytest.mark.parametrize("raw", [b"[" * 100000, b"{" * 100000,
                                 b'{"model": "tiny", "prompt": "hi", "unknown": ' + b"[" * 100000 + b"]" * 100000
                                 + b"}"], ids=["lists", "objects", "in-an-unknown-field"])
def test_deep_json_is_400_without_traceback(server, raw, caplog):
    _, _, addr = server
    status, _, body = request(addr, "POST", "/v1/completions", raw)
    assert_error(status, body, 400)
    assert "deeper than" in body["error"]["message"]
    assert_quiet(caplog)


def test_recursion_error_of_the_parser_is_400(monkeypatch):
    def boom(*_a, **_k):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(protocol.json, "loads", boom)
    with pytest.raises(protocol.ApiError) as e:
        protocol.load_json(b'{"model": "m"}')
    assert e.value.status == 400


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi \\ud800 there"}', "prompt"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfff"}]}',
     "messages[0].content"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["ok", "\\ud83d"]}', "stop[1]"),
])
def test_lone_surrogate_is_400_naming_the_field(server, path, raw, param, caplog):
    _, _, addr = server
    status, _, body = request(addr, "POST", path, raw)
    assert_error(status, body, 400, param)
    assert "invalid Unicode" in body["error"]["message"]
    assert_quiet(caplog)


def test_a_surrogate_pair_is_fine(server):
    _, _, addr = server
    status, _, body = request(addr, "POST", "/v1/completions",
                              b'{"model": "tiny", "prompt": "hi \\ud83d\\ude00", "max_tokens": 2}')
    assert status == 200, body


@pytest.mark.parametrize("field, value, param", [
    ("n", 1.0, "n"), ("n", 0, "n"), ("n", 65, "n"), ("n", True, "n"), ("n", "1", "n"),
    ("stream_options", {"include_usage": "no"}, "stream_options.include_usage"),
    ("stream_options", {"include_usage": 1}, "stream_options.include_usage"),
    ("stream_options", {"include_usage": True, "continuous": True}, "stream_options.continuous"),
])
@pytest.mark.slow
def test_n_and_stream_options_types(server, field, value, param):
    _, _, addr = server
    status, _, body = request(addr, "POST", "/v1/completions", json.dumps({**BODY, field: value}).encode())
    assert_error(status, body, 400, param)


def test_n_1_and_include_usage_bool_are_accepted(server):
    _, _, addr = server
    for extra in ({"n": 1}, {"n": None}, {"stream": True, "stream_options": {"include_usage": False}}):
        status, _, body = request(addr, "POST", "/v1/completions", json.dumps({**BODY, **extra}).encode())
        assert status == 200, (extra, body)


# ---------------------------------------------------------------- body size and time
def test_declared_content_length_over_the_limit_is_413_at_once(tokenizer, caplog):
    with serving(tokenizer, body_timeout_s=600) as (_, _, addr):  # a long body timeout: no waiting on it
        s = connect(addr)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n" + b"x" * 1024)
        status, headers, raw = read_response(s)
        assert_error(status, json.loads(raw), 413)
        assert headers["connection"] == "close" and headers["x-request-id"]
        assert wait_until(lambda: closed(s))
    assert_quiet(caplog)


def test_body_over_the_limit_is_413(tokenizer, caplog):
    with serving(tokenizer, max_request_bytes=2048) as (engine, _, addr):
        big = json.dumps({**BODY, "prompt": "a" * 5000}).encode()
        status, _, body = request(addr, "POST", "/v1/completions", big)
        assert_error(status, body, 413)
        # chunked: no declared size, cut once the received bytes pass the limit
        s = connect(addr)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(OSError):  # the server may close while we still send
            for _ in range(64):
                s.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")
        status, headers, raw = read_response(s)
        assert_error(status, json.loads(raw), 413)
        assert headers["connection"] == "close"
        assert not engine.submitted
    assert_quiet(caplog)


def test_body_that_stops_arriving_is_408(tokenizer, caplog):
    with serving(tokenizer, body_timeout_s=0.5) as (engine, _, addr):
        s = connect(addr)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n" + b'{"model": ')
        status, headers, raw = read_response(s)
        assert_error(status, json.loads(raw), 408)
        assert headers["connection"] == "close"
        assert wait_until(lambda: closed(s))
        assert not engine.submitted
    assert_quiet(caplog)


def test_client_leaving_during_upload_is_quiet(tokenizer, caplog):
    caplog.set_level(logging.DEBUG, logger="opweave.serve")
    with serving(tokenizer) as (engine, _, addr):
        s = connect(addr)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"model": "tiny"')
        time.sleep(0.2)
        s.close()
        assert wait_until(lambda: "left during its upload" in caplog.text)
        status, _, _ = request(addr, "GET", "/health")
        assert status == 200 and not engine.submitted
    assert_quiet(caplog)


# ---------------------------------------------------------------- 5xx bodies
class _BrokenTokenizer:
    """A tokenizer whose encode fails like a bug would."""

    sampling_defaults = (0.0, 1.0)

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def encode(self, text):
        raise RuntimeError("index -1 is out of bounds for axis 0 with size 0 (secret internals)")

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_unexpected_exception_is_a_generic_500_with_the_request_id(tokenizer, caplog):
    with serving(_BrokenTokenizer(tokenizer)) as (_, _, addr):
        status, headers, body = request(addr, "POST", "/v1/completions", json.dumps(BODY).encode())
    assert_error(status, body, 500)
    rid = headers["x-request-id"]
    assert rid in body["error"]["message"] and "index -1" not in body["error"]["message"]
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert logged and logged[0].exc_info and "index -1" in caplog.text
    assert "Exception in ASGI application" not in caplog.text  # handled once, not again by uvicorn


def test_engine_failure_is_a_generic_5xx_and_the_detail_is_logged(tokenizer, caplog):
    with serving(tokenizer) as (engine, _, addr):
        engine.pause()
        result = {}
        t = threading.Thread(target=lambda: result.update(r=request(addr, "POST", "/v1/completions",
                                                                  json.dumps(BODY).encode())))
        t.start()
        assert wait_until(lambda: len(engine.submitted) == 1)
        engine.fail("rank 2 exited with status 1")
        t.join(20)
        status, headers, body = result["r"]
        assert_error(status, body, 500)
        assert headers["x-request-id"] in body["error"]["message"] and "rank 2" not in body["error"]["message"]
        assert f"request {headers['x-request-id']}: 500: the engine failed: rank 2 exited" in caplog.text
        status, headers, body = request(addr, "POST", "/v1/completions", json.dumps(BODY).encode())
        assert_error(status, body, 503)                      # the engine is not running any more
        assert headers["x-request-id"] in body["error"]["message"]


def test_engine_failure_mid_stream_event_is_generic(tokenizer, caplog):
    with serving(tokenizer, engine=FakeEngine(round_s=0.01)) as (engine, _, addr):
        s = connect(addr)
        raw = json.dumps({**BODY, "max_tokens": 50, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(raw) + raw)
        assert wait_until(lambda: engine.submitted)
        engine.fail("rank 1 died: CUDA error at 0xdeadbeef")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    events = [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: {")]
    error = events[-1]["error"]
    assert "rank 1" not in error["message"] and "request id" in error["message"]
    assert "0xdeadbeef" in caplog.text


# ---------------------------------------------------------------- slow and hostile clients
def test_half_open_connections_are_closed_after_the_header_timeout(tokenizer, caplog):
    with serving(tokenizer, header_timeout_s=0.5, max_connections=1000) as (_, _, addr):
        socks = []
        for i in range(300):
            s = connect(addr)
            if i % 3:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            socks.append(s)
        dripping = connect(addr)
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:  # never reaches the timeout alone
            try:
                dripping.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
        assert wait_until(lambda: closed(dripping), 20)
        for s in socks:
            s.settimeout(20)
            assert closed(s)
            s.close()
        status, _, _ = request(addr, "GET", "/health")     # served as usual
        assert status == 200
    assert_quiet(caplog)


def test_kept_alive_connection_gets_the_header_timeout_for_its_next_request(tokenizer):
    with serving(tokenizer, header_timeout_s=0.5) as (_, _, addr):
        s = connect(addr)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = read_response(s)
        assert status == 200
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")     # the next head never ends
        assert wait_until(lambda: closed(s), 20)


def test_connections_beyond_the_cap_get_503(tokenizer, caplog):
    with serving(tokenizer, max_connections=5, header_timeout_s=60) as (_, server, addr):
        idle = [connect(addr) for _ in range(5)]
        assert wait_until(lambda: len(server.server_state.connections) == 5)
        extra = connect(addr)
        status, headers, raw = read_response(extra)
        assert_error(status, json.loads(raw), 503)
        assert headers["connection"] == "close" and headers["retry-after"] == "1"
        assert json.loads(raw)["error"]["code"] == "too_many_connections"
        for s in idle:
            s.close()
        assert wait_until(lambda: len(server.server_state.connections) == 0)
        status, _, _ = request(addr, "GET", "/health")
        assert status == 200
    assert not [r for r in caplog.records if r.exc_info]


def test_malformed_http_is_a_json_400(server):
    _, _, addr = server
    s = connect(addr)
    s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    status, _, raw = read_response(s)
    assert_error(status, json.loads(raw), 400)


# ---------------------------------------------------------------- Host, API key, HEAD
@pytest.mark.parametrize("host, ok", [
    ("localhost", True), ("localhost:8000", True), ("LOCALHOST.", True), ("127.0.0.1", True),
    ("127.0.0.1:80", True), ("[::1]", True), ("[::1]:8000", True), ("::1", True),
    ("evil.example", False), ("evil.example:8000", False), ("localhost.evil.example", False),
    ("127.0.0.1:80:80", False), ("[::1]x", False), ("", False),
])
@pytest.mark.slow
def test_host_header_checked_when_bound_to_loopback(tokenizer, host, ok, caplog):
    with serving(tokenizer, allowed_hosts=guard.allowed_hosts("127.0.0.1")) as (_, _, addr):
        s = connect(addr)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: " + host.encode() + b"\r\n\r\n")
        status, _, raw = read_response(s)
    if ok:
        assert status == 200, raw
    else:
        assert_error(status, json.loads(raw), 400)
        assert json.loads(raw)["error"]["code"] == "host_not_allowed"
    assert_quiet(caplog)


def test_allowed_hosts_defaults_and_widening():
    assert guard.allowed_hosts("0.0.0.0") is None and guard.allowed_hosts("::") is None
    assert guard.allowed_hosts("localhost") == guard.LOOPBACK_NAMES
    assert guard.allowed_hosts("127.0.0.2") == guard.LOOPBACK_NAMES | {"127.0.0.2"}
    assert guard.allowed_hosts("::1", ["API.example.com", "10.0.0.5:8000"]) == \
        guard.LOOPBACK_NAMES | {"api.example.com", "10.0.0.5"}
    assert guard.allowed_hosts("127.0.0.1", ["*"]) is None
    assert guard.allowed_hosts("0.0.0.0", ["api.example.com"]) == guard.LOOPBACK_NAMES | {"api.example.com"}


def test_widened_host_is_served(tokenizer):
    with serving(tokenizer, allowed_hosts=guard.allowed_hosts("127.0.0.1", ["api.example.com"])) as (_, _, addr):
        assert request(addr, "GET", "/health", headers={"Host": "api.example.com:443"})[0] == 200
        assert request(addr, "GET", "/health", headers={"Host": "other.example.com"})[0] == 400


def test_api_key(tokenizer, caplog):
    openai = pytest.importorskip("openai")
    with serving(tokenizer, api_key="s3cret-key") as (_, _, addr):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                        {"Authorization": "Basic s3cret-key"}, {"Authorization": "Bearer s3cret-ke"}):
            status, got, body = request(addr, "POST", "/v1/completions", json.dumps(BODY).encode(), headers)
            assert_error(status, body, 401)
            assert body["error"]["code"] == "invalid_api_key" and got["www-authenticate"] == "Bearer"
        assert request(addr, "GET", "/v1/models")[0] == 401
        assert request(addr, "GET", "/v1/models", headers={"Authorization": "bearer s3cret-key"})[0] == 200
        assert request(addr, "GET", "/health")[0] == 200        # open, as in vLLM
        assert request(addr, "GET", "/metrics")[0] == 200
        url = f"http://{addr[0]}:{addr[1]}/v1"
        out = openai.OpenAI(base_url=url, api_key="s3cret-key", max_retries=0).completions.create(**BODY)
        assert out.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="nope", max_retries=0).completions.create(**BODY)
    assert_quiet(caplog)


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_head_is_200_without_a_body(server, path):
    import http.client

    _, _, addr = server
    conn = http.client.HTTPConnection(*addr, timeout=20)
    conn.request("HEAD", path)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b""
    conn.close()
    # the connection stays usable: no stray body bytes were sent
    s = connect(addr)
    s.sendall(f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = b""
    while not data.endswith(b'{"status":"ok"}') and (chunk := s.recv(65536)):
        data += chunk
    assert data.count(b"HTTP/1.1 200") == 2 and data.endswith(b'{"status":"ok"}'), data
    assert data.split(b"\r\n\r\n")[1].startswith(b"HTTP/1.1 200"), data  # nothing between the two


def test_every_response_has_a_request_id(server):
    _, _, addr = server
    ids = {request(addr, "GET", "/health")[1]["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
    status, headers, body = request(addr, "GET", "/nowhere")
    assert_error(status, body, 404) if isinstance(body, dict) else pytest.fail(body)
    assert headers["x-request-id"]


# ---------------------------------------------------------------- flags
@pytest.mark.parametrize("flag, value", [
    ("--max-request-bytes", "-1"), ("--max-request-bytes", "0"), ("--max-request-bytes", "4x"),
    ("--max-connections", "0"), ("--max-connections", "-5"), ("--header-timeout", "0"),
    ("--header-timeout", "nan"), ("--body-timeout", "-1"), ("--body-timeout", "inf"),
    ("--allowed-hosts", ","), ("--api-key", ""), ("--api-key", "two words"),
])
def test_bad_serve_flags_are_one_line_exit_2(flag, value, capsys):
    from opweave.cli import main

    assert main(["serve", "no-such-artifact", "--weights", "random", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opweave: error: bad ") and "\n" not in err, err


def test_flag_values_parse():
    assert guard.parse_size("4m") == 4 << 20 and guard.parse_size("512KiB") == 512 << 10
    assert guard.parse_size("1000") == 1000
    assert guard.parse_seconds("0.5") == 0.5 and guard.parse_count("7") == 7
    assert guard.parse_hosts("a.example, *") == ["a.example", "*"]
