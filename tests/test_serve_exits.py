"""How `opweave serve` ends, as a real process over CPU ranks: a signal to the server or to its
whole process group (what `timeout`, systemd and container runtimes send) drains the running
requests and exits 0; a rank that dies, fails or stalls ends the server with exit 1 and one line
on stderr naming the rank. No rank process outlives the server in any case."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from serve_fixtures import write_tokenizer
from test_processes import _children, _running, _wait_for
from test_runtime import LAYERS, compile_pinned

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

WORLD = 3          # ranks of the AFD plan
NEW_TOKENS = 40    # long enough for a request to be running when the signal comes
START_S = 600      # guards against a hang while the server starts (not a time limit: a loaded machine is slow)
END_S = 300        # the same, for the server's exit


@pytest.fixture(scope="module")
def plan(tiny_checkpoint, tmp_path_factory):
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    root = tmp_path_factory.mktemp("serve_exits")
    art = str(root / "art")
    compile_pinned(folder, "afd", art)
    with open(os.path.join(folder, "config.json")) as f:
        tok = write_tokenizer(str(root / "tok"), vocab_size=json.load(f)["vocab_size"])
    return folder, art, tok


class Server:
    """`opweave serve` in its own session (its own process group, so a signal to the group does not
    reach the test), its stderr in a file."""

    def __init__(self, plan, tmp_path, env=(), stall_timeout=None):
        folder, art, tok = plan
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "opweave", "serve", art, "--weights", folder, "--tokenizer", tok,
               "--port", str(self.port), "--served-model-name", "tiny"]
        if stall_timeout is not None:
            cmd += ["--stall-timeout", str(stall_timeout)]
        full_env = {**os.environ, **dict(env), "TMPDIR": str(tmp_path)}
        for name in ("OPWEAVE_DEBUG", "OPWEAVE_API_KEY"):
            full_env.pop(name, None)
        self.err_path = tmp_path / "stderr.txt"
        self._err = open(self.err_path, "w")
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=self._err,
                                     start_new_session=True)
        self.ranks: list[int] = []

    def wait_ready(self) -> None:
        def up():
            assert self.proc.poll() is None, self.stderr()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            except OSError:
                return False
        _wait_for(up, START_S, "the server to answer /health")
        self.ranks = _children(self.proc.pid)
        assert len(self.ranks) == WORLD, self.ranks

    def stream(self, prompt=(5, 6, 7), max_tokens=NEW_TOKENS):
        """A streaming completion: (its response, after its first event has been read)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = json.dumps({"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens, "stream": True})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        first = _next_event(response)
        assert first is not None and "choices" in first, first
        return response

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=END_S)
        finally:
            self._err.close()

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.err_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.ranks:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if not self._err.closed:
            self._err.close()


def _next_event(response):
    """The next server-sent event's JSON ("[DONE]" as the string), None at the end of the stream."""
    while True:
        line = response.readline()
        if not line:
            return None
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            return data if data == "[DONE]" else json.loads(data)


def _rest(response) -> list:
    events = []
    while (event := _next_event(response)) is not None:
        events.append(event)
        if event == "[DONE]":
            break
    return events


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("opweave: error:")]


def _no_rank_left(server: Server) -> None:
    _wait_for(lambda: not any(_running(r) for r in server.ranks), 60, "the ranks to end")
    _wait_for(lambda: _group_gone(server.proc.pid), 60, "the server's process group to be empty")


# ---------------------------------------------------------------- signals: drain, exit 0
@pytest.mark.parametrize("how", ["SIGTERM-server", "SIGTERM-group", "SIGINT-group"])
@pytest.mark.slow
def test_signal_drains_running_requests_and_exits_0(plan, tmp_path, how):
    """A request is streaming when the signal comes; it finishes (`length`, all its tokens), the
    server exits 0 without an error line, and every rank is gone. To the group, the ranks get the
    signal too: they ignore it and leave it to the server (they used to die of SIGTERM: the
    request failed and the server exited 1)."""
    name, target = how.split("-")
    server = Server(plan, tmp_path)
    try:
        server.wait_ready()
        response = server.stream()
        sig = getattr(signal, name)
        if target == "group":
            os.killpg(server.proc.pid, sig)
        else:
            server.proc.send_signal(sig)
        events = _rest(response)
        code = server.wait_exit()
        err = server.stderr()
    finally:
        server.kill()
    assert events and events[-1] == "[DONE]", events
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
    assert code == 0, err
    assert _error_lines(err) == [] and "Traceback" not in err, err
    _no_rank_left(server)


# ---------------------------------------------------------------- a rank ends: exit 1, one line
@pytest.mark.slow
def test_killed_rank_ends_the_server_with_one_line(plan, tmp_path):
    """SIGKILL to a rank while a request streams: the request ends with an error event, the server
    exits 1 and says which rank died and how."""
    server = Server(plan, tmp_path)
    try:
        server.wait_ready()
        response = server.stream()
        os.kill(sorted(server.ranks)[1], signal.SIGKILL)
        events = _rest(response)
        code = server.wait_exit()
        err = server.stderr()
    finally:
        server.kill()
    assert any(isinstance(e, dict) and "error" in e for e in events), events  # ended cleanly: an error event
    assert code == 1, err
    lines = _error_lines(err)
    assert len(lines) == 1 and re.fullmatch(r"opweave: error: rank \d died \(killed by signal 9\)", lines[0]), err
    assert "Traceback" not in err, err
    _no_rank_left(server)


@pytest.mark.parametrize("fault,stall_timeout,message", [
    ("OPWEAVE_FAULT_RAISE", None, r"rank 1 failed: RuntimeError: fault injected after round 100 \(OPWEAVE_FAULT_RAISE\)"),
    ("OPWEAVE_FAULT_STALL", 5, r"rank 1 made no progress for 5 s \(last: round 99\)"),
])
@pytest.mark.slow
def test_failing_or_stalled_rank_ends_the_server_with_one_line(plan, tmp_path, fault, stall_timeout, message):
    """Rank 1 raises (or sleeps forever) after round 100, while the idle server runs rounds: exit 1,
    one line naming it."""
    server = Server(plan, tmp_path, env={fault: "1:100"}, stall_timeout=stall_timeout)
    try:
        code = server.wait_exit()
        err = server.stderr()
    finally:
        server.kill()
    assert code == 1, err
    lines = _error_lines(err)
    assert len(lines) == 1 and re.fullmatch(f"opweave: error: {message}", lines[0]), err
    assert "Traceback" not in err, err
    _wait_for(lambda: _group_gone(server.proc.pid), 60, "the server's process group to be empty")
