"""Termination signals as exceptions, so that an interrupted command cleans up after itself.

    SIGINT            -> KeyboardInterrupt
    SIGTERM, SIGHUP   -> opweave.errors.Interrupted(signum)

`raising_on_signals()` installs the handlers for the length of one CLI command (`opweave.cli.main`)
and restores the previous ones afterwards; `deferred()` holds a signal back while a short step that
must not be cut in half runs (swapping an artifact folder into place, removing a temporary one).

Note: the first signal raises; any later one while the command unwinds is only noted. Cleanups run
in `finally` blocks, and a second Ctrl-C arriving in the middle of one (the user pressing twice)
would otherwise abandon it half done — a temporary folder half removed, rank processes left
running. A command stuck in its cleanup can still be ended with SIGKILL.

Handlers are installed only in the main thread (Python runs signal handlers there and nowhere
else) and never over SIG_IGN: `nohup` and background jobs that were told to ignore a signal keep
ignoring it. A process forked while they are installed (a rank of `opweave run`) gets the previous
handlers back at once, so a rank killed with SIGTERM dies as it did before, even while it is blocked
inside a collective, where a Python handler would never get to run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

from opweave.errors import Interrupted

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _State:
    """The handlers' shared state (one command at a time per process)."""

    previous: dict[int, object] = {}  # signum -> handler to restore; empty when not installed
    raised = False                    # a signal has already been turned into an exception
    depth = 0                         # nesting of `deferred()`
    pending: int | None = None        # a signal held back by `deferred()`


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


def _handler(signum: int, frame) -> None:
    if _State.raised:
        return  # already unwinding: let the cleanups finish (module Note)
    if _State.depth:
        _State.pending = _State.pending or signum
        return
    _State.raised = True
    raise _exception(signum)


def _restore() -> None:
    for signum, previous in _State.previous.items():
        signal.signal(signum, previous)
    _State.previous = {}
    _State.raised, _State.pending = False, None


def _in_forked_child() -> None:
    """A child forked while the handlers are installed starts with the previous ones."""
    if _State.previous:
        _restore()


os.register_at_fork(after_in_child=_in_forked_child)


@contextlib.contextmanager
def raising_on_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise (module docstring) inside the block; the previous handlers
    come back when it ends. Does nothing outside the main thread or when already installed."""
    if threading.current_thread() is not threading.main_thread() or _State.previous:
        yield
        return
    for signum in HANDLED:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN or previous is None:  # ignored on purpose, or set outside Python
            continue
        _State.previous[signum] = previous
        signal.signal(signum, _handler)
    try:
        yield
    finally:
        _restore()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds a signal back until the block ends, then raises it (a no-op without the handlers, and
    outside the main thread, where no handler runs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        if not _State.depth and _State.pending is not None and not _State.raised:
            signum, _State.pending = _State.pending, None
            _State.raised = True
            raise _exception(signum)
