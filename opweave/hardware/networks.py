"""Network profiles: `networks.json`, the inter-node network of one kind of node, per GPU type.

Note: the inter-node figures of a GPU (`inter_link_bandwidth` per GPU, `inter_link_latency`)
belong to the node it sits in, not to the GPU: a DGX A100 has one 200 Gb/s InfiniBand NIC per
GPU (25 GB/s each), an AWS p4de.24xlarge 400 Gb/s of EFA for its 8 GPUs (6.25 GB/s each). A
profile names such a node; for each GPU type it covers it gives the NICs (text), both figures and
their sources. A catalog entry names its default profile in `network`; a cluster pool picks
another (`h100x16@dgx`, or `network: dgx` in a pool file). A profile covers only the GPU types it
lists: asking `aws-p4de` for H100 figures is an error that names the profiles that do cover H100.
"""

import dataclasses
import difflib
import functools
import json
import math
import os
import re

from opweave.errors import OpWeaveError

NETWORKS_PATH = os.path.join(os.path.dirname(__file__), "networks.json")
FIGURE_FIELDS = ("inter_link_bandwidth", "inter_link_latency")
"""The GPUSpec fields a profile sets."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NetworkFigures:
    """One profile's inter-node figures for one GPU type."""

    profile: str
    gpu: str  # catalog name
    nic: str  # the node's NICs, e.g. "8x 400 Gb/s NDR InfiniBand (ConnectX-7) per 8 GPUs (DGX H100)"
    inter_link_bandwidth: float  # bytes/s per GPU, one direction (NIC line rate / GPUs per node)
    inter_link_latency: float  # s, small-message NCCL send/recv between nodes
    sources: dict[str, str] = dataclasses.field(compare=False, hash=False)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NetworkProfile:
    """A kind of node (an instance type, a DGX) and its figures per GPU type, in file order."""

    name: str
    description: str
    gpus: dict[str, NetworkFigures] = dataclasses.field(compare=False, hash=False)


@functools.cache
def load_networks() -> dict[str, NetworkProfile]:
    """The built-in profiles (`networks.json`), validated: every figure positive and sourced."""
    with open(NETWORKS_PATH, encoding="utf-8") as f:
        raw = json.load(f)
    return {name: _profile(name, entry) for name, entry in raw.items() if not name.startswith("_")}


def _profile(name: str, entry: dict) -> NetworkProfile:
    where = f"{NETWORKS_PATH}: profile '{name}'"
    if not isinstance(entry, dict) or not isinstance(entry.get("description"), str) \
            or not isinstance(entry.get("gpus"), dict) or not entry["gpus"]:
        raise OpWeaveError(f"{where}: needs 'description' (text) and 'gpus' (GPU type -> figures)")
    gpus = {}
    for gpu, fig in entry["gpus"].items():
        at = f"{where}, GPU '{gpu}'"
        if not isinstance(fig, dict) or not isinstance(fig.get("nic"), str):
            raise OpWeaveError(f"{at}: needs 'nic' (text) and {', '.join(FIGURE_FIELDS)}")
        sources = fig.get("sources", {})
        for field in FIGURE_FIELDS:
            value = fig.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise OpWeaveError(f"{at}, field '{field}': must be a positive number, got {value!r}")
            if not isinstance(sources.get(field), str) or not sources[field].strip():
                raise OpWeaveError(f"{at}: no source for {field}")
        gpus[gpu] = NetworkFigures(profile=name, gpu=gpu, nic=fig["nic"],
                                   inter_link_bandwidth=float(fig["inter_link_bandwidth"]),
                                   inter_link_latency=float(fig["inter_link_latency"]),
                                   sources={f: sources[f] for f in FIGURE_FIELDS})
    return NetworkProfile(name=name, description=entry["description"], gpus=gpus)


def profiles_for(gpu: str) -> tuple[str, ...]:
    """Names of the profiles that cover catalog GPU type `gpu`, in file order."""
    return tuple(name for name, p in load_networks().items() if gpu in p.gpus)


def network_figures(profile: str, gpu: str) -> NetworkFigures:
    """Profile `profile`'s figures for catalog GPU type `gpu`.

    Raises:
        OpWeaveError (one line): an unknown profile (with the nearest names and the list), or a
            profile that does not cover `gpu` (with the ones that do).
    """
    networks = load_networks()
    key = str(profile).strip().lower()
    if key not in networks:
        near = difflib.get_close_matches(key, list(networks), n=3, cutoff=0.5)
        hint = f"did you mean: {', '.join(near)}?; " if near else ""
        raise OpWeaveError(f"unknown network profile '{profile}' ({hint}profiles: {', '.join(networks)})")
    figures = networks[key].gpus.get(gpu)
    if figures is None:
        others = profiles_for(gpu)
        alternatives = f"profiles for {gpu}: {', '.join(others)}" if others else f"no profile covers {gpu}"
        raise OpWeaveError(f"network profile '{key}' has no figures for {gpu} "
                           f"(it covers {', '.join(networks[key].gpus)}; {alternatives})")
    return figures


def format_networks(networks: dict[str, NetworkProfile] | None = None) -> str:
    """A Markdown table, one row per (profile, GPU type): NICs, per-GPU GB/s, latency and the
    bandwidth's source (its first address, else 'assumption' or 'placeholder'), aligned."""
    networks = load_networks() if networks is None else networks
    header = ("profile", "GPU", "NICs", "GB/s per GPU", "latency us", "bandwidth source")
    rows = [header] + [(p.name, f.gpu, f.nic, f"{f.inter_link_bandwidth / 1e9:g}", f"{f.inter_link_latency * 1e6:g}",
                        _short_source(f.sources["inter_link_bandwidth"]))
                       for p in networks.values() for f in p.gpus.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    numeric = (False, False, False, True, True, False)

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if n else ":" + "-" * (w + 1) for w, n in zip(widths, numeric)) + "|"
    return "\n".join([line(rows[0]), rule] + [line(r) for r in rows[1:]])


def _short_source(text: str) -> str:
    if text.startswith(("assumption", "placeholder")):
        return text.split(":", 1)[0]
    m = re.search(r"https?://[^\s,;)'\"]+", text)
    return m.group(0).rstrip(".:") if m else text
