"""Progress of worker processes, and the watch that names a stalled one.

Workers report each step they finish (started, joined the process group, loaded, each decode
round) by writing to shared memory created before they were forked: a write never blocks and
costs nothing, whatever state the watcher is in. The watcher, polled by the process that started
them, sees a step as a change of a worker's counter and times it on its own clock (workers' clocks
are never compared). A group of workers that depend on each other stalls as a whole: once one
stops, its peers soon wait for it. So the watch declares a group stalled when no worker of it
changed for the timeout, and names the one that is behind: a process stopped by a signal first,
then the one with the least progress (phase, then round), then the one that changed least recently.

Progress is work, not rounds: besides its steps, a computing rank reports work in progress with
`pulse` (after each operator call and at each stage's receive and send, `runtime/worker.py`), which
only bumps its counter: one shared-memory write (about 0.2 us), no lock, no system call, nothing
read from a tensor, so it may run inside a decode round. A round of any length is then never
mistaken for a stall; only a rank whose operators stop completing is (or a group whose ranks all
wait). On CUDA the host runs ahead of the device and then waits for it, so a rank also records a
CUDA event at those points (never while a round is being captured) and `DeviceBeats`' thread
pulses as the device completes them: a hung device stops the pulses.

Note: `opweave run` (launch.py) creates one `Heartbeat` for all its ranks; the rank loop
(worker.py) and the launcher's rank setup report through `report`, which is a no-op in a process
that was not started with a heartbeat (a rank under torchrun, a test calling `run_rank`), so code
deep inside a rank can report without a handle passed down to it.
"""

from __future__ import annotations

import collections
import enum
import math
import threading
import time
from collections.abc import Callable


class Phase(enum.IntEnum):
    """A worker's last step, in the order they happen."""

    STARTED = 0
    JOINED = 1      # the process group is initialised
    LOADING = 2     # one more operator's weights read (reported per operator: a long load is progress)
    LOADED = 3      # weights and program loaded
    ROUND = 4       # a decode round finished (the round number beside it)
    FINISHED = 5    # the loop ended; results are being gathered


_DESCRIPTIONS = {Phase.STARTED: "started", Phase.JOINED: "joined the process group",
                 Phase.LOADING: "loading weights",
                 Phase.LOADED: "weights loaded", Phase.FINISHED: "finished its rounds"}
_FIELDS = 3  # per worker: counter, phase, round


class Heartbeat:
    """One cell per worker in memory shared with the processes forked after it was created."""

    def __init__(self, num_workers: int, ctx=None):
        import multiprocessing

        ctx = ctx or multiprocessing.get_context("fork")
        self.num_workers = num_workers
        self._cells = ctx.RawArray("q", _FIELDS * num_workers)  # no lock: one writer per cell

    def beat(self, worker: int, phase: Phase, round_index: int = 0) -> None:
        """Records that `worker` finished a step (called in the worker)."""
        base = _FIELDS * worker
        self._cells[base + 1] = int(phase)
        self._cells[base + 2] = round_index
        self._cells[base] += 1  # last: the watcher sees the new phase with the new count

    def read(self, worker: int) -> tuple[int, Phase, int]:
        """The worker's (counter, phase, round)."""
        base = _FIELDS * worker
        return self._cells[base], Phase(self._cells[base + 1]), self._cells[base + 2]

    def describe(self, worker: int) -> str:
        _, phase, round_index = self.read(worker)
        return f"round {round_index}" if phase == Phase.ROUND else _DESCRIPTIONS[phase]


class StallWatch:
    """Times each worker's progress on the watcher's clock; `stalled` names a stalled worker."""

    def __init__(self, heartbeat: Heartbeat, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"stall timeout must be a positive number of seconds, got {timeout_s!r}")
        self.heartbeat = heartbeat
        self.timeout_s = timeout_s
        self._clock = clock
        now = clock()
        self._seen = [heartbeat.read(w)[0] for w in range(heartbeat.num_workers)]
        self._changed = [now] * heartbeat.num_workers

    def stalled(self, groups: list[list[int]], is_stopped: Callable[[int], bool] = lambda w: False) -> int | None:
        """A worker of the first group none of whose `workers` changed for the timeout, or None.

        Args:
            groups: workers that wait on each other (one replica set's ranks); pass only the
                workers still running.
            is_stopped: whether a worker's process is stopped (SIGSTOP): the surest culprit.
        """
        now = self._clock()
        for w in range(self.heartbeat.num_workers):
            count = self.heartbeat.read(w)[0]
            if count != self._seen[w]:
                self._seen[w], self._changed[w] = count, now
        for group in groups:
            if group and all(now - self._changed[w] >= self.timeout_s for w in group):
                return min(group, key=lambda w: (not is_stopped(w), self._progress(w), self._changed[w]))
        return None

    def _progress(self, worker: int) -> tuple[int, int]:
        _, phase, round_index = self.heartbeat.read(worker)
        return int(phase), round_index


# ---------------------------------------------------------------- worker side
_reporter: tuple[Heartbeat, int] | None = None
_counter: tuple[object, int] | None = None  # (the shared cells, this worker's counter index): `pulse`


def install(heartbeat: Heartbeat, worker: int) -> None:
    """Makes `report` and `pulse` in this process write to `worker`'s cell of `heartbeat`."""
    global _reporter, _counter
    _reporter = (heartbeat, worker)
    _counter = (heartbeat._cells, _FIELDS * worker)


def installed() -> bool:
    """Whether this process reports to a heartbeat (it was started by `opweave run` or `serve`)."""
    return _reporter is not None


def report(phase: Phase, round_index: int = 0) -> None:
    """Reports this process's progress, if it was started with a heartbeat."""
    if _reporter is not None:
        _reporter[0].beat(_reporter[1], phase, round_index)


def pulse() -> None:
    """Reports work in progress inside a step (an operator call, a stage's receive or send): the
    counter changes, the phase and round stay. A no-op without a heartbeat."""
    if _counter is not None:
        cells, i = _counter
        cells[i] += 1


class DeviceBeats:
    """Pulses as the device completes the work marked on it (CUDA, where the host runs ahead and
    then waits for the device). `mark()` records an event on the current stream (no synchronisation;
    never call it while a CUDA graph is being captured); a daemon thread queries the oldest events
    every `poll_s` (a query never blocks) and pulses when one or more completed since its last look.
    `make_event` makes an object with `record()` and `query()` (`torch.cuda.Event`)."""

    def __init__(self, make_event: Callable[[], object], poll_s: float = 0.05,
                 on_progress: Callable[[], None] = pulse):
        self._make_event, self._poll_s, self._on_progress = make_event, poll_s, on_progress
        self._pending: collections.deque = collections.deque()
        self._thread = threading.Thread(target=self._run, name="opweave-device-beats", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        event = self._make_event()
        event.record()
        self._pending.append(event)

    def poll(self) -> bool:
        """Drops the completed events in order; True when there was one."""
        done = False
        while self._pending and self._pending[0].query():
            self._pending.popleft()
            done = True
        return done

    def _run(self) -> None:
        while True:
            time.sleep(self._poll_s)
            if self.poll():
                self._on_progress()
