"""A rank's rounds, eager or replayed from a captured CUDA graph.

A decode round (every microbatch that runs feeds one token per row or none: `Runtime.decode_round`)
reads nothing on the host and works on buffers that come back for the same rows (the inputs of
a layout, the inbox's receive buffers per size, the state), so on CUDA it is captured once per
layout (`Runtime.round_key`: which rows each microbatch computes) and replayed: one graph launch
instead of thousands of kernel launches and Python dispatch per round. At most `MAX_GRAPHS`
layouts are kept (the least recently used goes). Rounds with a prompt chunk run eagerly.

The first decode round runs eagerly (`WARMUP`: Triton compiles its kernels, communicators
connect, every static buffer is made); the next one is captured, then replayed (a capture only
records, so the round it was captured in is run by the first replay). A capture that fails, or a
CPU run, leaves every round eager; the reason is reported once on stderr and in the run's stats.
What a round changes in Python (sends kept until completed) is restored after the capture: in a
replayed round the stream orders everything.

Progress (`runtime/heartbeat.py`): an eager round pulses the heartbeat per operator and stage from
Python; a replay runs no Python per operator, so the rank pulses before it and marks a device
event after it (`rt.device_done`), which pulses once the device has run the round. While a round
is captured `rt.capturing` is set: no event is recorded into the graph.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from opweave import config
from opweave.runtime.heartbeat import pulse

WARMUP = 1  # eager decode rounds of a layout before its capture
MAX_GRAPHS = 32  # captured layouts kept


def cuda_capture(round_fn: Callable[[], None]) -> Callable[[], None]:
    """Captures `round_fn` into a CUDA graph; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_fn()
    return graph.replay


def supported(device: torch.device) -> str | None:
    """None when decode rounds can be captured on `device`, else why not."""
    if device.type != "cuda":
        return f"no CUDA graphs on {device.type}"
    if not config.cuda_graphs_enabled():
        return "OPWEAVE_CUDA_GRAPHS=0"
    return None


class RoundRunner:
    """Runs `prog.round()` of runtime `rt`: eagerly, or by replaying its captured decode round."""

    def __init__(self, rt, prog, capture: Callable | None = None, who: str = "rank"):
        self.rt, self.prog, self.who = rt, prog, who
        self.capture = capture or cuda_capture
        self.reason = supported(torch.device(rt.device)) or ("tracing (--trace) times each op" if rt.timeline is not None else None)
        self.replay: Callable[[], None] | None = None  # the current layout's
        self._graphs: dict = {}  # round key -> replay, least recently used first
        self._warm: dict = {}    # round key -> eager decode rounds run
        self.replays = self.eager = 0

    @property
    def stats(self) -> dict:
        return {"replays": self.replays, "eager": self.eager, "eager_reason": self.reason}

    def round(self) -> None:
        """One round."""
        if self.reason is None and self.rt.decode_round:
            key = getattr(self.rt, "round_key", ())
            self.replay = self._graphs.pop(key, None)
            if self.replay is None and self._warm.get(key, 0) >= WARMUP:
                self._capture()
            if self.replay is not None:
                self._graphs[key] = self.replay
                while len(self._graphs) > MAX_GRAPHS:
                    self._graphs.pop(next(iter(self._graphs)))
                pulse()
                self.replay()
                self.replays += 1
                done = getattr(self.rt, "device_done", None)
                if done is not None:
                    done()
                return
            self._warm[key] = self._warm.get(key, 0) + 1
        self.prog.round()
        self.eager += 1

    def _capture(self) -> None:
        transport = self.rt.transport
        pending = list(transport._pending)
        try:
            self.rt.capturing = True  # nothing records device events into the graph
            self.replay = self.capture(self.prog.round)
        except Exception as e:  # noqa: BLE001 - any failure leaves the rank eager, with the reason
            self.reason = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"opweave: {self.who}: decode rounds run eagerly: {self.reason}", file=sys.stderr)
        finally:
            self.rt.capturing = False
        transport._pending = pending  # sends recorded in the graph complete in stream order
