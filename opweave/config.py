"""Process-wide flags, read from environment variables (documented in docs/flags.md).

Each flag is read when asked for, so tests can set the environment without reloading modules.
"""

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() not in ("", "0", "false", "no")


def verify_enabled() -> bool:
    """OPWEAVE_VERIFY=1: run each IR's `verify()` between passes."""
    return _flag("OPWEAVE_VERIFY")


def debug_dir() -> str | None:
    """OPWEAVE_DEBUG_DIR=path: each pass writes its output IR as `NN_<pass>.txt` there."""
    return os.environ.get("OPWEAVE_DEBUG_DIR") or None


def debug_enabled() -> bool:
    """OPWEAVE_DEBUG=1: show tracebacks for user errors too (for reporting bugs)."""
    return _flag("OPWEAVE_DEBUG")
