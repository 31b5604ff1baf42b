"""Parsing the quantities users type: context lengths (`32k`, `1k..128k`) and durations (`50ms`)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from opweave.errors import OpWeaveError

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us)\s*$")
_NEGATIVE = re.compile(r"^\s*-\s*[0-9.]")
MAX_TOKENS = 1 << 31  # far above any model's positions; keeps sizes derived from it finite


def parse_tokens(text: str, what: str = "context length") -> int:
    """`4096`, `4k` (= 4096), `1m` (= 1048576) -> a positive token count (`what` names it in errors)."""
    _refuse_negative(text, what)
    m = _TOKENS.match(text)
    if not m:
        raise OpWeaveError(f"bad {what} '{text}' (expected e.g. 4096, 32k, 1m)")
    if len(m.group(1)) > 30:
        raise OpWeaveError(f"bad {what} '{text[:40]}...' (at most {MAX_TOKENS} tokens)")
    value = Fraction(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]  # exact
    if value.denominator != 1 or value <= 0:
        raise OpWeaveError(f"bad {what} '{text}' (must be a positive whole number of tokens)")
    if value > MAX_TOKENS:
        raise OpWeaveError(f"bad {what} '{text}' (at most {MAX_TOKENS} tokens)")
    return int(value)


def parse_contexts(text: str) -> list[int]:
    """`32k`, `4k,32k,128k`, or a doubling range `1k..128k` -> sorted context lengths."""
    if ".." in text:
        lo_text, _, hi_text = text.partition("..")
        lo, hi = parse_tokens(lo_text), parse_tokens(hi_text)
        if lo > hi:
            raise OpWeaveError(f"bad context range '{text}' (start above end)")
        out = []
        s = lo
        while s < hi:
            out.append(s)
            s *= 2
        return out + [hi]
    values = sorted({parse_tokens(part) for part in text.split(",") if part.strip()})
    if not values:
        raise OpWeaveError(f"bad context list '{text}'")
    return values


def parse_duration(text: str, what: str = "duration") -> float:
    """`50ms`, `0.05s`, `800us` -> seconds (`what` names it in errors, e.g. "--tpot-slo")."""
    _refuse_negative(text, what)
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0 or not math.isfinite(float(m.group(1))):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise OpWeaveError(f"bad duration '{shown}' (expected e.g. 50ms, 0.05s, 800us)")
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]


def _refuse_negative(text: str, what: str) -> None:
    """A quantity written with a minus sign (`-5ms`, `-32k`): "{what} must be positive"."""
    if _NEGATIVE.match(text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise OpWeaveError(f"{what} must be positive, got '{shown}'")


def positive_list(text: str, flag: str, parse=int) -> tuple:
    """`1,16,64` -> (1, 16, 64), each item read by `parse` (e.g. `parse_tokens` for `1k,4k`), in
    order without repeats; a one-line error naming `flag` for anything else."""
    try:
        values = tuple(dict.fromkeys(parse(x.strip()) for x in text.split(",") if x.strip()))
    except (ValueError, OverflowError):  # OverflowError: a figure too large for a float
        raise OpWeaveError(f"{flag} must be comma-separated whole numbers, got {text[:60]!r}") from None
    if not values or min(values) <= 0:
        raise OpWeaveError(f"{flag} must list positive whole numbers, got {text[:60]!r}")
    return values


def nonnegative_list(text: str, flag: str) -> tuple[int, ...]:
    """`0,1,2` -> (0, 1, 2): as `positive_list`, zero allowed."""
    if not all(x.strip().isdigit() for x in text.split(",")):
        raise OpWeaveError(f"{flag} must list whole numbers of 0 or more, got {text[:60]!r}")
    return tuple(dict.fromkeys(int(x) for x in text.split(",")))


def names(text: str) -> list[str]:
    """`h100, l40s` -> ["h100", "l40s"]: a comma-separated list of names, blanks dropped."""
    return [n.strip() for n in text.split(",") if n.strip()]



def counted(n: float, noun: str, plural: str | None = None) -> str:
    """`n` and its noun, singular for exactly one ("1 template", "3 templates", "0 owner configs")."""
    n = int(round(n))
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
