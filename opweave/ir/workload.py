"""The traffic a plan is made for (`compile --isl/--osl`, or `--workload FILE`): prompt and output
lengths, the TTFT target, the arrival rate and how prefill may be served.

A workload file is JSON Lines, one request per line, `{"isl": 812, "osl": 240}` (or the names
vLLM's and AIConfigurator's request logs use: `prompt_tokens` / `input_len`, `completion_tokens` /
`output_len`), optionally with `"count": N` for a histogram bin. The planner plans for the mean
lengths (the flows: prefill tokens per output token are mean isl / mean osl) and the longest
sequence (the context); `Workload.to_json` is what plan.json carries.
"""

from __future__ import annotations

import dataclasses
import json
import math

from opweave.errors import OpWeaveError
from opweave.units import parse_duration, parse_tokens

PREFILL_MODES = ("auto", "aggregated", "disaggregated")
"""How prefill is served: chosen by the search (auto), in the decode plan's rounds under a token
budget (aggregated, chunked prefill), or on a prefill pool of its own (disaggregated)."""

KV_TAIL_Z = 3.0
"""Standard deviations of the pool's occupancy a workload-sized KV pool holds above its mean
(`kv_pool_pages`): about one round in a thousand needs more, and preempts its newest request."""

_ISL_KEYS = ("isl", "prompt_tokens", "input_len", "input_tokens")
_OSL_KEYS = ("osl", "completion_tokens", "output_len", "output_tokens")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """Mean prompt and output tokens of a request, the longest of each, and the targets."""

    isl: int                         # mean prompt tokens (rounded)
    osl: int                         # mean output tokens (rounded), at least 1
    max_isl: int = 0                 # the longest prompt (0: isl)
    max_osl: int = 0                 # the longest output (0: osl)
    ttft_slo_s: float = math.inf     # mean time to first token at the planned load
    rate: float | None = None        # requests/s the fleet must take (None: most tokens per dollar)
    prefill: str = "auto"            # `PREFILL_MODES`
    requests: int = 0                # requests in the workload file (0: given by --isl/--osl)

    def __post_init__(self):
        if self.isl < 1 or self.osl < 1:
            raise OpWeaveError(f"a workload needs at least 1 prompt and 1 output token, got isl {self.isl}, "
                               f"osl {self.osl}")
        if self.prefill not in PREFILL_MODES:
            raise OpWeaveError(f"--prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise OpWeaveError(f"--rate must be a positive number of requests/s, got {self.rate!r}")
        object.__setattr__(self, "max_isl", max(self.max_isl, self.isl))
        object.__setattr__(self, "max_osl", max(self.max_osl, self.osl))

    @property
    def longest(self) -> int:
        """The longest sequence the workload holds (its context when --context is not given)."""
        return self.max_isl + self.max_osl

    def to_json(self) -> dict:
        out = {"isl": self.isl, "osl": self.osl, "max_isl": self.max_isl, "max_osl": self.max_osl,
               "ttft_slo_ms": None if math.isinf(self.ttft_slo_s) else self.ttft_slo_s * 1e3,
               "rate": self.rate, "prefill": self.prefill}
        if self.requests:
            out["requests"] = self.requests
        return out

    @classmethod
    def from_json(cls, data: dict | None) -> Workload | None:
        if data is None:
            return None
        slo = data.get("ttft_slo_ms")
        return cls(isl=data["isl"], osl=data["osl"], max_isl=data.get("max_isl", 0), max_osl=data.get("max_osl", 0),
                   ttft_slo_s=math.inf if slo is None else slo / 1e3, rate=data.get("rate"),
                   prefill=data.get("prefill", "auto"), requests=data.get("requests", 0))


def kv_pool_pages(slots: int, context: int, workload: Workload | None, page_tokens: int) -> int:
    """The KV pages of a pool of `slots` sequence slots: every slot at the full context without a
    workload; with one, the slots' expected occupancy (a request holds isl + osl / 2 tokens on
    average over its life, half a page more for its last page) plus `KV_TAIL_Z` standard deviations
    of the sum (a slot's tokens are spread uniformly over its output, plus the spread of the
    lengths) plus one longest sequence, never more than the full pool. The one formula of the
    planner (`passes/space.py`), the runtime's default pool (`runtime/worker.py`) and the
    planned-versus-allocated check."""
    full = slots * -(-context // page_tokens)
    if workload is None or slots <= 0:
        return full
    mean = workload.isl + workload.osl / 2
    spread = math.sqrt(workload.osl ** 2 / 12 + ((workload.max_isl - workload.isl) / 2) ** 2
                       + ((workload.max_osl - workload.osl) / 2) ** 2)
    pages = (slots * (mean / page_tokens + 0.5) + KV_TAIL_Z * math.sqrt(slots) * spread / page_tokens
             + -(-workload.longest // page_tokens))
    return min(full, math.ceil(pages))


def _length(row: dict, keys: tuple[str, ...], where: str) -> int:
    for key in keys:
        if key in row:
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise OpWeaveError(f"{where}: {key} must be a whole number of tokens, got {value!r}")
            return value
    raise OpWeaveError(f"{where}: no {keys[0]} (or {', '.join(keys[1:])})")


def read_workload(path: str, **targets) -> Workload:
    """The workload of a JSON Lines file of requests (module docstring); `targets` are the other
    `Workload` fields (ttft_slo_s, rate, prefill). A one-line error for a bad file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise OpWeaveError(f"--workload {path}: {e.strerror or e}") from None
    total = isl_sum = osl_sum = max_isl = max_osl = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--workload {path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise OpWeaveError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise OpWeaveError(f"{where}: expected an object like {{\"isl\": 512, \"osl\": 128}}")
        isl, osl = _length(row, _ISL_KEYS, where), _length(row, _OSL_KEYS, where)
        count = row.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise OpWeaveError(f"{where}: count must be a whole number, at least 1, got {count!r}")
        total += count
        isl_sum, osl_sum = isl_sum + count * isl, osl_sum + count * osl
        max_isl, max_osl = max(max_isl, isl), max(max_osl, osl)
    if total == 0:
        raise OpWeaveError(f"--workload {path}: no requests")
    return Workload(isl=max(1, round(isl_sum / total)), osl=max(1, round(osl_sum / total)), max_isl=max_isl,
                    max_osl=max_osl, requests=total, **targets)


def workload_from_flags(*, isl: str | None, osl: str | None, path: str | None, ttft_slo: str | None,
                        rate: str | None, prefill: str = "auto") -> Workload | None:
    """The workload `compile`'s flags describe (`--isl/--osl` or `--workload`, `--ttft-slo`,
    `--rate`, `--prefill`), or None to plan decode alone; traffic flags without a workload, or
    both ways of giving one, are a one-line error."""
    if path is not None and (isl is not None or osl is not None):
        raise OpWeaveError("--workload and --isl/--osl describe the same thing: give one of them")
    if (isl is None) != (osl is None):
        raise OpWeaveError("--isl and --osl go together: give both (the workload's prompt and output tokens)")
    targets = {"ttft_slo_s": math.inf if ttft_slo is None else parse_duration(ttft_slo, "--ttft-slo"),
               "rate": _rate(rate), "prefill": prefill}
    if path is not None:
        return read_workload(path, **targets)
    if isl is None:
        given = [flag for flag, value in (("--ttft-slo", ttft_slo), ("--rate", rate),
                                          ("--prefill", None if prefill == "auto" else prefill)) if value is not None]
        if given:
            raise OpWeaveError(f"{', '.join(given)}: no workload to plan it for; give --isl and --osl, or --workload FILE")
        return None
    return Workload(isl=parse_tokens(isl, "--isl"), osl=parse_tokens(osl, "--osl"), **targets)


def planned_context(text: str | None, workload: Workload | None) -> int:
    """`--context` (or without it the workload's longest sequence); a one-line error when neither
    is given or the workload does not fit the context."""
    if text is None and workload is None:
        raise OpWeaveError("--context is required (or give --isl and --osl, or --workload: the context is then "
                           "the longest sequence of the workload)")
    context = workload.longest if text is None else parse_tokens(text)
    if workload is not None and workload.longest > context:
        raise OpWeaveError(f"the workload's longest sequence ({workload.max_isl} prompt + {workload.max_osl} output "
                           f"tokens) exceeds --context {context}")
    return context


def _rate(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise OpWeaveError(f"bad --rate '{text[:40]}' (expected requests per second, e.g. 12.5)")
    return value
