"""Cluster specs: `--cluster` text, a YAML/JSON pool file, or `local` (NVML) -> `Cluster`.

Grammar (docs/hardware.md): SPEC := POOL ('+' POOL)* ; POOL := TYPE [('x' | ':') COUNT] ['@' NETWORK].
A pool without a count is one GPU (`h100` == `h100x1`). NETWORK names a network profile
(`networks.json`) for the pool's inter-node figures instead of the GPU's default one
(`h100x16@dgx+a100x16@aws-p4de`). A GPU type may appear once per cluster: `h100x8+h100x4` is
refused (write `h100x12`), because two pools of one type would be a distinction the planner cannot
see (same GPUSpec) while changing the node layout silently; two network profiles for one type
(`h100x8@dgx+h100x8@aws-p5`) are refused too (one pool per type).
Nodes are filled in pool order, `gpus_per_node` GPUs of one type per node (h100x12 -> 8 + 4).

A cluster is described per pool (`PoolLayout`: first GPU, first node, node size), never per GPU:
parsing and placement cost grows with the number of pools, so `h100x1000000` is as quick as
`h100x8`. A cluster holds at most `MAX_CLUSTER_GPUS` GPUs.
"""

import dataclasses
import os
import re

from opweave.errors import OpWeaveError
from opweave.datafile import read_data_file
from opweave.hardware.catalog import GPUSpec, default_network, find_gpu_name, get_gpu, override_spec, with_network
from opweave.hardware.networks import load_networks

EXAMPLE = "h100x8+l40sx8"
_POOL_RE = re.compile(r"(?P<name>.*?)(?P<sep>[x:])(?P<count>[^x:]*)")
_FILE_EXTS = (".yaml", ".yml", ".json")
MAX_CLUSTER_GPUS = 10_000_000
"""The most GPUs a cluster may hold. The largest GPU clusters built hold a few hundred thousand
GPUs, so a count beyond ten million is a typo (an extra digit or two); refusing it keeps every
global index, count and price in the plan a plain, exact number."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Pool:
    """`count` GPUs of one type."""

    gpu: GPUSpec
    count: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PhysicalGPU:
    """Where one GPU sits: its pool, its node (numbered across the cluster) and its indices."""

    pool_index: int
    node_index: int
    local_index: int  # within the node
    global_index: int  # within the cluster, in pool order
    gpu_name: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PoolLayout:
    """Where one pool's GPUs sit: global indices `first_gpu` .. `first_gpu + count - 1`, in nodes
    numbered from `first_node`, `per_node` GPUs each (the last node holds the remainder)."""

    pool_index: int
    gpu_name: str
    first_gpu: int
    first_node: int
    per_node: int
    count: int

    @property
    def num_nodes(self) -> int:
        return -(-self.count // self.per_node)

    @property
    def num_full_nodes(self) -> int:
        return self.count // self.per_node

    def node_size(self, node: int) -> int:
        """GPUs of the pool's `node`-th node (0-based within the pool)."""
        return min(self.per_node, self.count - node * self.per_node)

    def gpu(self, node: int, local: int) -> int:
        """Global index of GPU `local` of the pool's `node`-th node."""
        return self.first_gpu + node * self.per_node + local


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Pools of distinct GPU types, in the order given."""

    pools: tuple[Pool, ...]
    spec: str  # the text it was parsed from

    def __post_init__(self):
        if not self.pools:
            raise OpWeaveError(f"cluster '{self.spec}' has no GPUs")
        for pool in self.pools:
            if isinstance(pool.count, bool) or not isinstance(pool.count, int) or pool.count <= 0:
                raise OpWeaveError(f"cluster '{self.spec}': GPU count for '{pool.gpu.name}' must be a positive "
                                   f"whole number, got {pool.count!r}")
            if pool.count > MAX_CLUSTER_GPUS:  # before formatting it: a count may have thousands of digits
                raise OpWeaveError(f"cluster '{self.spec}': GPU count for '{pool.gpu.name}' is more than the "
                                   f"{MAX_CLUSTER_GPUS:,} GPUs a cluster may hold")
        if self.total_gpus > MAX_CLUSTER_GPUS:
            raise OpWeaveError(f"cluster '{self.spec}' holds {self.total_gpus:,} GPUs, more than the "
                               f"{MAX_CLUSTER_GPUS:,} a cluster may hold")
        names = [p.gpu.name for p in self.pools]
        for name in names:
            if names.count(name) > 1:
                same = [p for p in self.pools if p.gpu.name == name]
                total = sum(p.count for p in same)
                networks = list(dict.fromkeys(p.gpu.network or "custom" for p in same))
                if len(networks) > 1:
                    raise OpWeaveError(f"cluster '{self.spec}': GPU type '{name}' appears more than once, with "
                                       f"network profiles {', '.join(networks)}; a cluster holds one pool per GPU "
                                       f"type whatever its network: write it once ({name}x{total}{_tag(same[0].gpu)})")
                raise OpWeaveError(f"cluster '{self.spec}': GPU type '{name}' appears more than once; "
                                   f"write it once ({name}x{total}{_tag(same[0].gpu)})")

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(p.gpu.name for p in self.pools)

    @property
    def total_gpus(self) -> int:
        return sum(p.count for p in self.pools)

    @property
    def price_per_hour(self) -> float:
        """USD per hour for the whole cluster."""
        return sum(p.count * p.gpu.price_per_hour for p in self.pools)

    @property
    def canonical_spec(self) -> str:
        """`h100x8+l40sx8`, `h100x16@dgx` (a profile other than the GPU's default): parses back to the
        same pools (file overrides aside)."""
        return "+".join(f"{p.gpu.name}x{p.count}{_tag(p.gpu)}" for p in self.pools)

    @property
    def num_nodes(self) -> int:
        return sum(-(-p.count // p.gpu.gpus_per_node) for p in self.pools)

    def count(self, name: str) -> int:
        """GPUs of catalog type `name` (case-insensitive), 0 if none."""
        return sum(p.count for p in self.pools if p.gpu.name == name.lower())

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.gpu.name == name.lower():
                return p
        raise OpWeaveError(f"cluster '{self.spec}' has no '{name}' GPUs (types: {', '.join(self.gpu_types)})")

    def layouts(self) -> tuple[PoolLayout, ...]:
        """Each pool's place in the cluster: pools fill nodes in order, one GPU type per node."""
        out, gpu, node = [], 0, 0
        for i, p in enumerate(self.pools):
            layout = PoolLayout(pool_index=i, gpu_name=p.gpu.name, first_gpu=gpu, first_node=node,
                                per_node=p.gpu.gpus_per_node, count=p.count)
            out.append(layout)
            gpu, node = gpu + p.count, node + layout.num_nodes
        return tuple(out)

    def locate(self, global_index: int) -> PhysicalGPU:
        """Where GPU `global_index` sits (arithmetic over the pools)."""
        for layout in self.layouts():
            i = global_index - layout.first_gpu
            if 0 <= i < layout.count:
                return PhysicalGPU(pool_index=layout.pool_index, node_index=layout.first_node + i // layout.per_node,
                                   local_index=i % layout.per_node, global_index=global_index,
                                   gpu_name=layout.gpu_name)
        raise OpWeaveError(f"cluster '{self.spec}' has no GPU {global_index} (it holds {self.total_gpus})")

    def physical_gpus(self) -> tuple[PhysicalGPU, ...]:
        """Every GPU with its node: one object per GPU, for small clusters (printing, tests);
        placement works on `layouts()` instead."""
        return tuple(self.locate(i) for i in range(self.total_gpus))


def _tag(gpu: GPUSpec) -> str:
    """`@PROFILE` when `gpu` uses a network profile other than its built-in entry's default, else ''."""
    return f"@{gpu.network}" if gpu.network is not None and gpu.network != default_network(gpu.name) else ""


def parse_cluster(spec: str, catalog: dict[str, GPUSpec]) -> Cluster:
    """A Cluster from `h100x8+l40sx8`, `h100:8`, `a100` (one GPU), `h100x16@dgx` (a network profile),
    a .yaml/.json pool file, or `local`.

    Args:
        spec: the --cluster text.
        catalog: from `load_catalog()`; GPU names resolve through `get_gpu` (aliases allowed).
    Returns:
        the Cluster, with `spec` kept as given. Bad text raises a one-line OpWeaveError.
    """
    text = spec.strip()
    if not text:
        raise OpWeaveError(f"empty cluster spec; give GPU pools, e.g. {EXAMPLE}")
    if text.lower() == "local":
        return detect_local(catalog)
    if text.lower().endswith(_FILE_EXTS) or os.sep in text or "/" in text:
        return _cluster_from_file(text, catalog)
    pools = tuple(_parse_pool(part.strip(), text, catalog) for part in text.split("+"))
    return Cluster(pools=pools, spec=spec)


def _clip(text: str, limit: int = 60) -> str:
    """`text`, shortened for an error message (a count of thousands of digits stays one short line)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _parse_pool(part: str, text: str, catalog: dict[str, GPUSpec]) -> Pool:
    where = f"cluster '{_clip(text)}'"
    if not part:
        raise OpWeaveError(f"{where}: empty pool ('+' needs a pool on each side, e.g. {EXAMPLE})")
    if "@" not in part:
        return _parse_gpus(part, where, catalog)
    gpus, _, network = (s.strip() for s in part.partition("@"))
    if "@" in network:
        raise OpWeaveError(f"{where}: malformed pool '{_clip(part)}' (one '@' before a network profile, "
                           "e.g. h100x16@dgx)")
    if not gpus:
        raise OpWeaveError(f"{where}: pool '{_clip(part)}' has no GPUs before '@' (e.g. h100x16@dgx)")
    pool = _parse_gpus(gpus, where, catalog)
    if not network:
        raise OpWeaveError(f"{where}: pool '{_clip(part)}' has no network profile after '@' "
                           f"(profiles: {', '.join(load_networks())})")
    gpu = with_network(pool.gpu, network, f"{where}, pool '{_clip(part)}'")
    return Pool(gpu=gpu, count=pool.count)


def _parse_gpus(part: str, where: str, catalog: dict[str, GPUSpec]) -> Pool:
    """`TYPE [('x' | ':') COUNT]` (no network profile)."""
    if find_gpu_name(part, catalog) is not None:
        return Pool(gpu=get_gpu(part, catalog), count=1)
    m = _POOL_RE.fullmatch(part)
    if m is None:
        raise OpWeaveError(f"{where}: {_unknown(part, catalog)}")
    name, sep, count = m["name"].strip(), m["sep"], m["count"].strip()
    if not name:
        raise OpWeaveError(f"{where}: pool '{part}' has no GPU type before '{sep}' (e.g. h100x8)")
    if name[-1] in "x:":
        raise OpWeaveError(f"{where}: malformed pool '{part}' (expected TYPExCOUNT, e.g. h100x8)")
    if not count:
        raise OpWeaveError(f"{where}: pool '{part}' has no count after '{sep}' (e.g. {name}{sep}8)")
    if re.fullmatch(r"[+-]?[0-9]+", count) is None:
        raise OpWeaveError(f"{where}: count '{count}' in pool '{part}' is not a whole number")
    digits = count.lstrip("+-").lstrip("0")
    if count.startswith("-") or not digits:
        raise OpWeaveError(f"{where}: count in pool '{_clip(part)}' must be positive")
    if len(digits) > len(str(MAX_CLUSTER_GPUS)) or int(digits) > MAX_CLUSTER_GPUS:  # before int() of 5000 digits
        raise OpWeaveError(f"{where}: count in pool '{_clip(part)}' is more than the {MAX_CLUSTER_GPUS:,} GPUs "
                           "a cluster may hold")
    if find_gpu_name(name, catalog) is None:
        raise OpWeaveError(f"{where}: {_unknown(name, catalog)}")
    return Pool(gpu=get_gpu(name, catalog), count=int(count))


def _unknown(name: str, catalog: dict[str, GPUSpec]) -> str:
    try:
        get_gpu(name, catalog)
    except OpWeaveError as err:
        return str(err)
    raise AssertionError(f"{name!r} is in the catalog")


def _cluster_from_file(path: str, catalog: dict[str, GPUSpec]) -> Cluster:
    """pools: [{gpu: h100, count: 8, network: dgx, <any other GPUSpec field>: override for this pool}, ...]."""
    data = read_data_file(path, "cluster")
    extra = set(data) - {"pools"}
    if extra or not isinstance(data.get("pools"), list) or not data["pools"]:
        raise OpWeaveError(f"{path}: a cluster file holds one key, 'pools', "
                           "a non-empty list of {gpu: TYPE, count: N}")
    pools = []
    for i, item in enumerate(data["pools"]):
        where = f"{path}: pool {i}"
        if not isinstance(item, dict) or not isinstance(item.get("gpu"), str) or "count" not in item:
            raise OpWeaveError(f"{where}: needs 'gpu' (a catalog name) and 'count', e.g. {{gpu: h100, count: 8}}")
        count = item["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise OpWeaveError(f"{where}, field 'count': must be a positive whole number, got {count!r}")
        if find_gpu_name(item["gpu"], catalog) is None:
            raise OpWeaveError(f"{where}: {_unknown(item['gpu'], catalog)}")
        gpu = get_gpu(item["gpu"], catalog)
        overrides = {k: v for k, v in item.items() if k not in ("gpu", "count")}
        if overrides:
            gpu = override_spec(gpu, overrides, f"{where} ({gpu.name})")
        pools.append(Pool(gpu=gpu, count=count))
    return Cluster(pools=tuple(pools), spec=path)


def detect_local(catalog: dict[str, GPUSpec]) -> Cluster:
    """This machine's NVIDIA GPUs through NVML, one pool per type in device order."""
    import pynvml

    no_gpu = "no NVIDIA GPU found on this machine (NVML: {}); give the cluster explicitly, e.g. --cluster h100x8"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise OpWeaveError(no_gpu.format(err)) from None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        names = [pynvml.nvmlDeviceGetName(h) for h in handles]
    except pynvml.NVMLError as err:
        raise OpWeaveError(no_gpu.format(err)) from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass  # shutting down after a failed query: the query's error is the one to report
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    if not names:
        raise OpWeaveError(no_gpu.format("0 devices"))
    counts: dict[str, int] = {}
    for device_name in names:
        key = find_gpu_name(device_name, catalog)
        if key is None:
            raise OpWeaveError(f"this machine's GPU '{device_name}' is not in the catalog "
                               f"({_unknown(device_name, catalog)}); add it with a catalog override file "
                               "(docs/hardware.md) or give the cluster explicitly")
        counts[key] = counts.get(key, 0) + 1
    return Cluster(pools=tuple(Pool(gpu=catalog[k], count=n) for k, n in counts.items()), spec="local")
