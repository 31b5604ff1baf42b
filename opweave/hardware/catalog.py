"""The GPU catalog: `catalog.json` loaded into `GPUSpec`s, with an optional override file.

Note: every number is in SI units (FLOP/s, bytes/s, bytes, seconds, USD per GPU-hour) and has a
source string in the entry's `sources` map (the public source and its confidence, or "assumption: why").
Link bandwidths are one-direction line rates per GPU; the cost model applies its own factors.
The inter-node figures come from the entry's `network` profile (`networks.py`: they belong to the
node, not the GPU). An override file (YAML or JSON, same layout as `catalog.json`) may change any
field of an entry or add an entry with every field; a price table (`prices.py`, `--prices NAME`)
replaces the prices it lists. docs/hardware.md has the price policy, the profiles and an example.
"""

import dataclasses
import difflib
import functools
import math
import os
import re
from collections.abc import Callable

from opweave.datafile import read_data_file
from opweave.errors import OpWeaveError
from opweave.hardware.networks import FIGURE_FIELDS, network_figures
from opweave.hardware.prices import apply_prices

CATALOG_PATH = os.path.join(os.path.dirname(__file__), "catalog.json")
PRESETS = {"roofline": os.path.join(os.path.dirname(__file__), "roofline.json")}
"""Override files built in, named instead of a path: `--catalog roofline` is the ideal bound
(copy-kernel streaming efficiency, no fixed costs) the built-in catalog's fitted figures replace."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    """One GPU type; derived figures are properties so overrides cannot make them disagree."""

    name: str  # catalog key, e.g. "h100"
    description: str
    peak_flops: float  # dense BF16 FLOP/s
    mem_bandwidth: float  # bytes/s
    memory_bytes: float  # bytes
    usable_memory_fraction: float  # of memory_bytes, for weights + KV/state
    intra_link_bandwidth: float  # bytes/s per GPU, one direction (NVLink, else PCIe)
    intra_link_latency: float  # s
    inter_link_bandwidth: float  # bytes/s per GPU, one direction (node network)
    inter_link_latency: float  # s
    gpus_per_node: int
    gemm_efficiency: float  # achievable fraction of peak_flops
    mem_efficiency: float  # achieved fraction of mem_bandwidth streaming weights and activations
    launch_overhead: float  # s per op (kernel) under CUDA-graph replay
    price_per_hour: float  # USD per GPU-hour
    # The terms below are optional in a file (a new entry without them is an ideal roofline):
    kv_efficiency: float | None = None  # achieved fraction of mem_bandwidth reading KV/state (None: mem_efficiency)
    serial_fraction: float = 0.0  # share of the smaller of an op's memory and math time not hidden under the larger
    eager_launch_overhead: float | None = None  # s per op launched eagerly (None: EAGER_LAUNCH_FACTOR x launch)
    step_overhead: float = 0.0  # s per decode step (scheduling, input preparation, sampling launch)
    sequence_overhead: float = 0.0  # s per sequence per decode step (its metadata, sampling, output)
    collective_latency: float = 0.0  # s of fixed cost per TP collective, beyond the ring's link hops
    prefill_efficiency: float | None = None  # achieved fraction of peak_flops in a prefill (None: gemm_efficiency)
    network: str | None = None  # network profile the inter_link figures come from (None: given directly)
    sources: dict[str, str] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.gemm_efficiency

    @property
    def prefill_flops(self) -> float:
        """FLOP/s a prefill reaches (`opweave.cost.prefill`)."""
        return self.peak_flops * (self.gemm_efficiency if self.prefill_efficiency is None else self.prefill_efficiency)

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s streaming weights and activations."""
        return self.mem_bandwidth * self.mem_efficiency

    @property
    def effective_kv_bandwidth(self) -> float:
        """Bytes/s reading per-sequence state (KV cache, recurrent state)."""
        return self.mem_bandwidth * (self.mem_efficiency if self.kv_efficiency is None else self.kv_efficiency)

    def op_launch_s(self, cuda_graphs: bool = True) -> float:
        """Seconds per op launched: replayed in a CUDA graph, or eagerly."""
        if cuda_graphs:
            return self.launch_overhead
        if self.eager_launch_overhead is not None:
            return self.eager_launch_overhead
        return self.launch_overhead * EAGER_LAUNCH_FACTOR

    @property
    def price_per_second(self) -> float:
        return self.price_per_hour / 3600.0


EAGER_LAUNCH_FACTOR = 4.2 / 1.28
"""Eager launch / CUDA-graph replay per op: 4.2 us vs 1.28 us per kernel on an H100 NVL (refdata
efficiency.launch_overhead.python_issued_op_vs_graph_replay_H100NVL, medium)."""

FRACTION_FIELDS = ("usable_memory_fraction", "gemm_efficiency", "mem_efficiency", "kv_efficiency",
                   "serial_fraction", "prefill_efficiency")
INT_FIELDS = ("gpus_per_node",)
NUMERIC_FIELDS = tuple(
    f.name for f in dataclasses.fields(GPUSpec) if f.name not in ("name", "description", "network", "sources")
)
OPTIONAL_FIELDS = ("kv_efficiency", "serial_fraction", "eager_launch_overhead", "step_overhead",
                   "sequence_overhead", "collective_latency", "prefill_efficiency")
"""Fields a new entry may leave out (their defaults leave the ideal roofline)."""
ZERO_FIELDS = ("serial_fraction", "step_overhead", "sequence_overhead", "collective_latency")
"""Fields that may be 0 (a term that is absent)."""
VALUE_FIELDS = ("description", "network") + NUMERIC_FIELDS  # what a file may give
REQUIRED_FIELDS = tuple(f for f in VALUE_FIELDS if f not in OPTIONAL_FIELDS + ("network",))
"""What a new entry must give (`network` may stand for the two inter_link figures)."""
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")

# Other spellings of catalog names, after normalisation (lower case, '_' and ' ' -> '-', no
# leading "nvidia-"); NVML's device names ("NVIDIA H100 80GB HBM3") normalise into this table.
ALIASES = {
    "h100-sxm": "h100", "h100-sxm5": "h100", "h100-80gb": "h100", "h100-sxm-80gb": "h100",
    "h100-sxm5-80gb": "h100", "h100-80gb-hbm3": "h100",
    "h100-pcie-80gb": "h100-pcie", "h100-80gb-pcie": "h100-pcie",
    "h200-sxm": "h200", "h200-141gb": "h200", "h200-sxm-141gb": "h200", "h200-141gb-hbm3e": "h200",
    "a100-sxm": "a100", "a100-sxm4": "a100", "a100-80gb": "a100", "a100-sxm-80gb": "a100",
    "a100-sxm4-80gb": "a100", "a100-80gb-sxm": "a100",
    "a100-40gb-sxm": "a100-40gb", "a100-sxm-40gb": "a100-40gb", "a100-sxm4-40gb": "a100-40gb",
    "l40s-48gb": "l40s", "l4-24gb": "l4", "a10g-24gb": "a10g",
    "b200-hgx": "b200", "b200-sxm": "b200", "b200-180gb": "b200",
}


def normalize_name(name: str) -> str:
    """Lower case, '_' and spaces to '-', without a leading 'nvidia-': 'A100_SXM_80GB' -> 'a100-sxm-80gb'."""
    key = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    return key[len("nvidia-"):] if key.startswith("nvidia-") else key


def find_gpu_name(name: str, catalog: dict[str, "GPUSpec"]) -> str | None:
    """The catalog key `name` refers to (directly or by alias), or None."""
    key = normalize_name(name)
    if key in catalog:
        return key
    target = ALIASES.get(key)
    return target if target in catalog else None


def get_gpu(name: str, catalog: dict[str, GPUSpec]) -> GPUSpec:
    """The entry for `name` (case-insensitive, aliases accepted); OpWeaveError naming the nearest."""
    key = find_gpu_name(name, catalog)
    if key is None:
        raise OpWeaveError(unknown_gpu_message(name, catalog))
    return catalog[key]


def unknown_gpu_message(name: str, catalog: dict[str, GPUSpec]) -> str:
    """"unknown GPU type 'h10' (did you mean: h100, h200?; known: ...)"."""
    spellings = {k: k for k in catalog} | {a: t for a, t in ALIASES.items() if t in catalog}
    near = difflib.get_close_matches(normalize_name(name), list(spellings), n=6, cutoff=0.5)
    suggested = list(dict.fromkeys(spellings[s] for s in near))[:3]
    hint = f"did you mean: {', '.join(suggested)}?; " if suggested else ""
    return f"unknown GPU type '{name}' ({hint}known: {', '.join(catalog)})"


def load_catalog(override_path: str | None = None, prices: str | None = None,
                 warn: Callable[[str], None] | None = None) -> dict[str, GPUSpec]:
    """The built-in catalog, then price table `prices`, then `override_path` (YAML or JSON) on top.

    Args:
        override_path: a file mapping entry names to fields; an existing entry (or alias) takes
            the given fields, a new name needs every field. Validated field by field. A name in
            `PRESETS` ("roofline") stands for that built-in file. Applied last, so its prices win.
        prices: a built-in price table (`prices.price_table_names()`: "aws", "lambda"); the GPUs
            it lists take its prices, the others keep the catalog's.
        warn: called with one line naming the GPUs `prices` does not list (if any).
    Returns:
        name -> GPUSpec, built-in entries first in file order, new entries after.
    """
    catalog = dict(_builtin_catalog())
    if prices is not None:
        catalog, missing = apply_prices(catalog, prices)
        if missing and warn is not None:
            warn(f"price table '{prices.strip().lower()}' has no price for {', '.join(missing)}: "
                 "they keep the catalog price")
    if override_path is not None:
        path = PRESETS.get(override_path, override_path)
        catalog = _apply_entries(read_data_file(path, "catalog override"), catalog, path)
    return catalog


@functools.cache
def _builtin_catalog() -> dict[str, GPUSpec]:
    catalog = _apply_entries(read_data_file(CATALOG_PATH, "catalog"), {}, CATALOG_PATH)
    for spec in catalog.values():  # the data file itself must source every number
        missing = [f for f in NUMERIC_FIELDS if f not in spec.sources and f not in OPTIONAL_FIELDS]
        if missing:
            raise OpWeaveError(f"{CATALOG_PATH}: entry '{spec.name}' has no source for {', '.join(missing)}")
    return catalog


def default_network(name: str) -> str | None:
    """The network profile built-in entry `name` names (None for a name not built in)."""
    spec = _builtin_catalog().get(name)
    return None if spec is None else spec.network


def with_network(spec: GPUSpec, profile: str, where: str) -> GPUSpec:
    """`spec` with network profile `profile`'s inter-node figures (OpWeaveError prefixed by `where`)."""
    try:
        figures = network_figures(profile, spec.name)
    except OpWeaveError as err:
        raise OpWeaveError(f"{where}: {err}") from None
    return override_spec(spec, {"network": figures.profile}, where)


def override_spec(spec: GPUSpec, fields: dict, where: str) -> GPUSpec:
    """`spec` with `fields` (validated; `where` prefixes errors and becomes the default source).

    A `network` field sets both inter_link figures from that profile (and their sources); giving
    inter_link figures directly leaves the entry with no profile (`network` None).
    """
    fields, network = _expand_network(fields, spec.name, where)
    values, sources = _check_fields(fields, where, default_source=f"override: {where}")
    if network is not _UNSET:
        values["network"] = network
    return dataclasses.replace(spec, **values, sources={**spec.sources, **sources})


_UNSET = object()


def _expand_network(fields: dict, gpu: str, where: str) -> tuple[dict, object]:
    """`fields` with a `network` profile's figures (and sources) for GPU `gpu` in place of its name,
    and the profile the entry ends with: the name; None when the entry gives inter_link figures
    itself; `_UNSET` when it gives neither."""
    given = [f for f in FIGURE_FIELDS if f in fields]
    if "network" not in fields:
        return fields, (None if given else _UNSET)
    name = fields["network"]
    if given:
        raise OpWeaveError(f"{where}: give either 'network' (a profile) or {' and '.join(given)}, not both")
    if not isinstance(name, str) or not name.strip():
        raise OpWeaveError(f"{where}, field 'network': must be a network profile name, got {name!r}")
    try:
        figures = network_figures(name, gpu)
    except OpWeaveError as err:
        raise OpWeaveError(f"{where}, field 'network': {err}") from None
    out = {k: v for k, v in fields.items() if k != "network"}
    out.update({f: getattr(figures, f) for f in FIGURE_FIELDS})
    given_sources = fields.get("sources", {})
    if isinstance(given_sources, dict):  # anything else: _check_fields reports it
        out["sources"] = {**given_sources, **{f: f"network profile '{figures.profile}' ({figures.nic}): {text}"
                                             for f, text in figures.sources.items()}}
    return out, figures.profile


def _apply_entries(raw: dict, catalog: dict[str, GPUSpec], path: str) -> dict[str, GPUSpec]:
    out = dict(catalog)
    for key, fields in raw.items():
        if str(key).startswith("_"):  # "_meta", "_comment": notes for people
            continue
        where = f"{path}: entry '{key}'"
        if not isinstance(fields, dict):
            raise OpWeaveError(f"{where}: must be a mapping of field: value")
        existing = find_gpu_name(str(key), out)
        if existing is not None:
            out[existing] = override_spec(out[existing], fields, where)
            continue
        name = normalize_name(str(key))
        if not NAME_RE.fullmatch(name) or name == "local":
            raise OpWeaveError(f"{where}: a GPU name is letters, digits, '.', '_' or '-' (and not 'local')")
        fields, network = _expand_network(fields, name, where)
        missing = [f for f in REQUIRED_FIELDS if f not in fields]
        if missing:
            raise OpWeaveError(f"{where}: not in the catalog, so it needs every field; missing: {', '.join(missing)}")
        values, sources = _check_fields(fields, where, default_source=f"{path} (no source given)")
        out[name] = GPUSpec(name=name, **values, network=None if network is _UNSET else network, sources=sources)
    return out


def _check_fields(fields: dict, where: str, default_source: str) -> tuple[dict, dict[str, str]]:
    values: dict = {}
    given_sources = fields.get("sources", {})
    if not isinstance(given_sources, dict):
        raise OpWeaveError(f"{where}, field 'sources': must be a mapping of field: source text")
    for field, value in fields.items():
        if field == "sources":
            continue
        if field not in VALUE_FIELDS:
            near = difflib.get_close_matches(str(field), VALUE_FIELDS, n=1)
            hint = f"did you mean {near[0]}?; " if near else ""
            raise OpWeaveError(f"{where}: unknown field '{field}' ({hint}fields: {', '.join(VALUE_FIELDS)})")
        values[field] = _check_value(field, value, f"{where}, field '{field}'")
    sources = {}
    for field, text in given_sources.items():
        if field not in NUMERIC_FIELDS or not isinstance(text, str):
            raise OpWeaveError(f"{where}, field 'sources': '{field}' must name a numeric field and map to text")
        sources[field] = text
    for field in values:
        if field in NUMERIC_FIELDS and field not in sources:
            sources[field] = default_source
    return values, sources


def _check_value(field: str, value, where: str):
    if field == "description":
        if not isinstance(value, str) or not value.strip():
            raise OpWeaveError(f"{where}: must be non-empty text, got {value!r}")
        return value
    if isinstance(value, str):  # YAML 1.1 reads 1e12 (no '.') as text
        try:
            value = float(value) if field not in INT_FIELDS else int(value)
        except ValueError:
            raise OpWeaveError(f"{where}: must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpWeaveError(f"{where}: must be a number, got {value!r}")
    if field in INT_FIELDS:
        if not isinstance(value, int):
            raise OpWeaveError(f"{where}: must be a whole number, got {value!r}")
        if value <= 0:
            raise OpWeaveError(f"{where}: must be positive, got {value!r}")
        return value
    if field in ZERO_FIELDS:
        if not math.isfinite(value) or value < 0:
            raise OpWeaveError(f"{where}: must be a number >= 0, got {value!r}")
        if field in FRACTION_FIELDS and value > 1:
            raise OpWeaveError(f"{where}: is a fraction and must be in [0, 1], got {value!r}")
        return float(value)
    if not math.isfinite(value) or value <= 0:
        raise OpWeaveError(f"{where}: must be a positive number, got {value!r}")
    if field in FRACTION_FIELDS and value > 1:
        raise OpWeaveError(f"{where}: is a fraction and must be in (0, 1], got {value!r}")
    return float(value)


def format_catalog(catalog: dict[str, GPUSpec]) -> str:
    """A Markdown table of the catalog, one row per entry, aligned for a terminal."""
    header = ("name", "BF16 TFLOP/s", "mem GB/s", "memory GB", "usable GB", "intra GB/s", "network",
              "inter GB/s", "GPUs/node", "GEMM eff", "mem eff", "KV eff", "launch us", "step us", "seq us",
              "coll. us", "$/GPU-h")
    rows = [header]
    for s in catalog.values():
        kv = s.mem_efficiency if s.kv_efficiency is None else s.kv_efficiency
        rows.append((s.name, f"{s.peak_flops / 1e12:g}", f"{s.mem_bandwidth / 1e9:g}", f"{s.memory_bytes / 1e9:g}",
                     f"{s.usable_memory_bytes / 1e9:.1f}", f"{s.intra_link_bandwidth / 1e9:g}",
                     s.network or "-", f"{s.inter_link_bandwidth / 1e9:g}", str(s.gpus_per_node),
                     f"{s.gemm_efficiency:g}",
                     f"{s.mem_efficiency:g}", f"{kv:g}", f"{s.launch_overhead * 1e6:.3g}",
                     f"{s.step_overhead * 1e6:.0f}", f"{s.sequence_overhead * 1e6:.3g}",
                     f"{s.collective_latency * 1e6:.3g}", f"{s.price_per_hour:g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    text = (0, header.index("network"))  # left-aligned columns

    def line(cells):
        padded = [c.ljust(w) if i in text else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(":" + "-" * (w + 1) if i in text else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(rows[0]), rule] + [line(r) for r in rows[1:]])
