"""The processes of `opweave run`: ranks die with their launcher whatever signal ends it, a
stalled rank is named and the run ends with no process left, a round longer than the stall
timeout is progress (reported per operator), and a local run listens on loopback only."""

import ipaddress
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from test_runtime import compile_pinned, requests
from opweave.cli import main
from opweave.errors import OpWeaveError
from opweave.runtime.heartbeat import Heartbeat, Phase, StallWatch
from opweave.runtime.launch import RunConfig, run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

WORLD = 3  # ranks of the AFD plan below
SIGNALS = {  # signal to the launcher (or its whole process group) -> its exit status (SIGKILL: killed, nothing runs)
    "SIGTERM": 143,
    "SIGHUP": 129,
    "SIGINT": 130,
    "SIGKILL": -signal.SIGKILL,
    "SIGTERM-group": 143,  # `timeout`, systemd, container runtimes: kill -TERM -PGID
}


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path_factory.mktemp("processes") / "art")
    compile_pinned(folder, "afd", art)
    return folder, art


# ---------------------------------------------------------------- /proc readers
def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_stat_fields(int(entry))[1]) == pid:
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # exited while scanning
    return out


def _running(pid: int) -> bool:
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def _listening(pid: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Addresses of the TCP sockets this process listens on: its socket inodes (/proc/PID/fd)
    looked up in its network namespace's tables (/proc/PID/net/tcp, tcp6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state 0A: LISTEN
                    hex_addr = fields[1].split(":")[0]  # 32-bit words, each in host (little-endian) order
                    raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
                    out.append(ipaddress.ip_address(raw))
    return out


def _is_loopback(addr) -> bool:
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------- signals to the launcher
@pytest.mark.parametrize("name", list(SIGNALS))
@pytest.mark.slow
def test_signal_to_launcher_leaves_no_rank(setup, name, tmp_path):
    """The launcher of a run that cannot finish (rank 1 sleeps at round 2) gets a signal once
    every rank has joined the process group (each listens on its gloo socket, on loopback only):
    it exits with 128+signal and one line on stderr (none for SIGKILL), and no rank survives it. SIGINT goes
    to the whole process group, as a terminal's Ctrl-C does, and so does SIGTERM-group; the ranks
    ignore both (they must not print, nor die before the launcher kills them)."""
    folder, art = setup
    env = {**os.environ, "OPWEAVE_FAULT_STALL": "1:2", "TMPDIR": str(tmp_path)}  # SIGKILL leaves the run's folder
    env.pop("OPWEAVE_DEBUG", None)
    launcher = subprocess.Popen([sys.executable, "-m", "opweave", "run", art, "--weights", folder,
                                 "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--stall-timeout", "60"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        ranks = _wait_for(lambda: (lambda c: c if len(c) == WORLD else None)(_children(launcher.pid)), 60,
                          "the ranks to start")
        listening = _wait_for(lambda: (lambda s: s if all(s) else None)([_listening(r) for r in ranks]), 60,
                              "every rank to listen")
        assert all(_is_loopback(a) for addrs in listening for a in addrs), listening
        sig = getattr(signal, name.split("-")[0])
        if sig == signal.SIGINT or name.endswith("-group"):
            os.killpg(launcher.pid, sig)
        else:
            launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=120)  # a guard against a hang, not a time limit
        _wait_for(lambda: not any(_running(r) for r in ranks), 60, "the ranks to end")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        for r in _children(launcher.pid):
            os.kill(r, signal.SIGKILL)
    assert launcher.returncode == SIGNALS[name]
    assert "Traceback" not in err and len(err.splitlines()) == (0 if name == "SIGKILL" else 1), err
    if name != "SIGKILL":  # the launcher cleaned up: no run folder left
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("opweave-run-")] == []


# ---------------------------------------------------------------- stalls
@pytest.mark.slow
def test_stalled_rank_is_named_and_the_run_ends(setup, monkeypatch):
    folder, art = setup
    monkeypatch.setenv("OPWEAVE_FAULT_STALL", "1:2")  # rank 1 sleeps after round 2, before reporting it
    # 8 s: on a loaded 2-core machine a healthy rank's start (fork, gloo, loading) has gone 3 s
    # without a report, and the watch named that rank instead
    with pytest.raises(OpWeaveError, match=r"^rank 1 made no progress for 8 s \(last: round 1\)$"):
        run(RunConfig(artifact=art, weights=folder, device="cpu", requests=requests(), stall_timeout_s=8))
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_stopped_rank_is_named_and_killed(setup):
    """A rank stopped by SIGSTOP as soon as it exists: every rank then waits at the rendezvous,
    and the stopped one is named."""
    folder, art = setup
    stopped = []

    def stop_rank_1():
        child = _wait_for(lambda: next((p for p in multiprocessing.active_children() if p.name == "rank 1"), None),
                          30, "rank 1")
        os.kill(child.pid, signal.SIGSTOP)
        stopped.append(child.pid)

    thread = threading.Thread(target=stop_rank_1)
    thread.start()
    try:
        with pytest.raises(OpWeaveError, match=r"^rank 1 made no progress for 2 s \(last: "):
            run(RunConfig(artifact=art, weights=folder, device="cpu", requests=requests(), stall_timeout_s=2))
    finally:
        thread.join()
    assert stopped and not _running(stopped[0])
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e9", "abc"])
def test_stall_timeout_flag_is_checked(setup, capsys, value):
    folder, art = setup
    assert main(["run", art, "--weights", folder, "--prompt-ids", "1", f"--stall-timeout={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stall-timeout" in err and "Traceback" not in err


def test_stall_watch_names_the_rank_behind():
    """A group is stalled once none of its workers changed for the timeout; the stopped worker is
    named first, then the least progress, then the oldest change."""
    now = [0.0]
    beats = Heartbeat(4)
    watch = StallWatch(beats, 10, clock=lambda: now[0])
    for w in range(3):
        beats.beat(w, Phase.ROUND, 7)
    beats.beat(3, Phase.ROUND, 6)  # worker 3 is a round behind
    now[0] = 5.0
    assert watch.stalled([[0, 1, 2, 3]]) is None
    beats.beat(0, Phase.ROUND, 8)
    now[0] = 12.0
    assert watch.stalled([[1, 2, 3]]) is None  # 7 s since the changes seen at 5
    now[0] = 16.0
    assert watch.stalled([[0, 1, 2, 3]]) is None  # worker 0 moved at 12
    assert watch.stalled([[1, 2, 3]]) == 3
    assert beats.describe(3) == "round 6"
    assert watch.stalled([[1, 2, 3]], is_stopped=lambda w: w == 2) == 2
    now[0] = 22.0
    assert watch.stalled([[0], [1, 2, 3]]) == 0  # the first stalled group
    with pytest.raises(ValueError):
        StallWatch(beats, 0)


PICKLING_COLLECTIVES = ("gather_object(", "broadcast_object_list(", "scatter_object_list(", "send_object_list(",
                        "recv_object_list(")


def test_no_pickled_objects_cross_ranks():
    """Results and spans cross ranks as JSON bytes in tensors, never through a `*_object`
    collective (which unpickles what a peer sends)."""
    import opweave

    root = os.path.dirname(opweave.__file__)
    offenders = []
    for base, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(base, name)) as f:
                    text = f.read()
                offenders += [f"{name}: {c}" for c in PICKLING_COLLECTIVES if c in text]
    assert offenders == []


# ---------------------------------------------------------------- progress, not rounds
LONG_CONTEXT = 128  # the default prefill chunk: a 127-token prompt is one prefill step
SLOW_OP_S = 0.25    # OPWEAVE_FAULT_SLOW_OP: each operator call of a prefill step on rank 0
LONG_STALL_S = 3    # shorter than rank 0's prefill round (19 operators: >= 4.75 s), longer than one operator


@pytest.fixture(scope="module")
def long_context_plan(tiny_checkpoint, tmp_path_factory):
    """The AFD plan of `setup` at context 128 and batch 8 (4 rows per microbatch)."""
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from test_runtime import PLANS

    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    art = str(tmp_path_factory.mktemp("long_context") / "art")
    cluster = parse_cluster("h100x8+l40sx8", load_catalog())
    write_artifact(art, pinned_plan(run_front_end(folder), cluster, "afd", PLANS["afd"], batch=8, microbatches=2,
                                    context=LONG_CONTEXT))
    return folder, art


@pytest.mark.slow
def test_a_round_longer_than_the_stall_timeout_is_progress(long_context_plan, monkeypatch):
    """Context-filling prompts (127 tokens of a 128 context) on a batch-8 plan whose rank 0 takes
    SLOW_OP_S per operator call in a prefill step: its prefill round lasts longer than the stall
    timeout, while ranks 1 and 2 wait on it. The rank reports each operator call, so the run
    completes; the stall watch would end it if progress were counted in rounds."""
    from opweave.runtime.launch import run_detailed
    from opweave.runtime.scheduler import Request

    folder, art = long_context_plan
    monkeypatch.setenv("OPWEAVE_FAULT_SLOW_OP", f"0:{SLOW_OP_S}")
    prompts = [[(7 * i + 3 * j) % 200 + 20 for j in range(LONG_CONTEXT - 1)] for i in range(4)]
    reqs = tuple(Request(index=i, prompt=p, max_new_tokens=1) for i, p in enumerate(prompts))
    outputs, stats = run_detailed(RunConfig(artifact=art, weights=folder, device="cpu", requests=reqs,
                                            stall_timeout_s=LONG_STALL_S))
    assert [len(r.output) for r in outputs] == [1] * len(prompts) and all(r.error is None for r in outputs)
    # the premise, a lower bound that load cannot break: a round took longer than the stall timeout
    assert max(stats["round_s"]) > LONG_STALL_S, stats["round_s"]
    assert multiprocessing.active_children() == []


def test_pulses_are_progress_without_a_new_step():
    """`pulse` (per operator and stage) changes the worker's counter only: the watch sees progress,
    the stall message still names the last step."""
    from opweave.runtime import heartbeat

    now = [0.0]
    beats = Heartbeat(2)
    watch = StallWatch(beats, 10, clock=lambda: now[0])
    saved = heartbeat._reporter, heartbeat._counter
    try:
        heartbeat.install(beats, 1)
        heartbeat.report(Phase.ROUND, 4)
        for t in (6.0, 12.0, 18.0):  # a long round: pulses only, each sooner than the timeout
            now[0] = t
            heartbeat.pulse()
            assert watch.stalled([[0, 1]]) is None
        assert beats.describe(1) == "round 4" and beats.read(1)[0] == 4
        now[0] = 28.5  # no pulse for 10.5 s: stalled, named by its last step
        assert watch.stalled([[1]]) == 1 and beats.describe(1) == "round 4"
        heartbeat._reporter, heartbeat._counter = None, None
        heartbeat.pulse()  # without a heartbeat: nothing
        assert beats.read(1)[0] == 4
    finally:
        heartbeat._reporter, heartbeat._counter = saved


def test_device_beats_pulse_as_the_device_completes():
    """CUDA: marks are events the device completes later; the poller pulses once per look that
    found completed ones, in order, and never for an event not yet done."""
    from opweave.runtime.heartbeat import DeviceBeats

    class Event:
        done = set()

        def __init__(self):
            self.id = len(made)
            made.append(self)

        def record(self):
            pass

        def query(self):
            return self.id in Event.done

    made, pulses = [], []
    beats = DeviceBeats(Event, poll_s=3600, on_progress=lambda: pulses.append(1))  # polled by hand below
    for _ in range(3):
        beats.mark()
    assert not beats.poll()
    Event.done |= {1}  # a later event alone: still waiting for the first
    assert not beats.poll()
    Event.done |= {0}
    assert beats.poll() and len(beats._pending) == 1
    Event.done |= {2}
    assert beats.poll() and not beats._pending and not beats.poll()


def test_counted_ops_pulse_after_each_call_and_read_through():
    """`rt.ops` in a rank with a heartbeat: each call reports after it; attributes (a norm's
    weight for `rt.add_norm`) read through to the operator."""
    from opweave.runtime.worker import _Counted

    class Op:
        weight = "w"

        def __call__(self, x, state=None):
            calls.append(("op", x, state))
            return x + 1

    calls = []
    op = _Counted(Op(), lambda: calls.append("done"), lambda: calls.append("slow"))
    assert op(1, state="s") == 2 and op.weight == "w"
    assert calls == ["slow", ("op", 1, "s"), "done"]


def test_slow_op_fault_is_parsed(monkeypatch):
    from opweave import config

    monkeypatch.delenv("OPWEAVE_FAULT_SLOW_OP", raising=False)
    assert config.fault_slow_op(0) == 0.0
    monkeypatch.setenv("OPWEAVE_FAULT_SLOW_OP", "1:0.5")
    assert config.fault_slow_op(1) == 0.5 and config.fault_slow_op(0) == 0.0
    for bad in ("1", "x:1", "1:-1", "1:nan"):
        monkeypatch.setenv("OPWEAVE_FAULT_SLOW_OP", bad)
        with pytest.raises(OpWeaveError, match="OPWEAVE_FAULT_SLOW_OP"):
            config.fault_slow_op(1)
