"""The GPU catalog (sources, values, aliases, override files) and cluster specs (grammar, layout, local)."""

import dataclasses
import json
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.errors import OpWeaveError
from opweave.hardware.catalog import (
    FRACTION_FIELDS, NUMERIC_FIELDS, REQUIRED_FIELDS, ZERO_FIELDS, format_catalog, get_gpu, load_catalog,
)
from opweave.hardware.cluster import Cluster, Pool, parse_cluster
from opweave.hardware.networks import network_figures, profiles_for

CATALOG = load_catalog()
EXPECTED = ("h100", "h100-pcie", "h200", "a100", "a100-40gb", "l40s", "l4", "a10g", "b200", "cpu")
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "hardware.md")


@pytest.mark.parametrize("name", EXPECTED)
def test_every_number_has_a_source_and_a_sane_value(name):
    spec = CATALOG[name]
    for field in NUMERIC_FIELDS:
        value = getattr(spec, field)
        if value is None:  # derived from another field (eager_launch_overhead)
            continue
        assert spec.sources.get(field, "").strip(), f"{name}.{field} has no source"
        assert value >= 0 if field in ZERO_FIELDS else value > 0, f"{name}.{field} = {value}"
        if field in FRACTION_FIELDS:
            assert value <= 1
    assert isinstance(spec.gpus_per_node, int)
    assert spec.description


def test_sources_cite_a_public_source_or_say_assumption():
    for spec in CATALOG.values():
        for field, text in spec.sources.items():
            if field in ("inter_link_bandwidth", "inter_link_latency"):  # from the entry's network profile
                figures = network_figures(spec.network, spec.name)
                assert text == f"network profile '{spec.network}' ({figures.nic}): {figures.sources[field]}"
                text = figures.sources[field]
            cited = text.startswith(("refdata ", "assumption", "placeholder", "fit: ")) or re.search(r"https?://", text)
            assert cited, (spec.name, field, text)
            assert "/work/" not in text and "refdata.json" not in text, (spec.name, field, text)  # public sources only
    assert all("placeholder until `opweave profile`" in s for s in CATALOG["cpu"].sources.values())


def test_h100_spot_check_and_derived_figures():
    assert tuple(CATALOG) == EXPECTED
    h100 = CATALOG["h100"]
    assert (h100.peak_flops, h100.mem_bandwidth, h100.memory_bytes) == (989e12, 3.35e12, 80e9)
    assert h100.intra_link_bandwidth == 450e9 and h100.inter_link_bandwidth == 50e9
    assert h100.usable_memory_bytes == pytest.approx(72e9)
    assert h100.effective_flops == pytest.approx(989e12 * 0.803)
    assert h100.effective_bandwidth == pytest.approx(3.35e12 * h100.mem_efficiency)
    assert h100.effective_kv_bandwidth == pytest.approx(3.35e12 * h100.kv_efficiency)
    # fitted to measured decode (docs/calibration.md): below a copy kernel's 0.9, KV below weights
    assert 0.5 < h100.kv_efficiency < h100.mem_efficiency < 0.9
    assert h100.step_overhead > 0 and h100.sequence_overhead > 0 and h100.collective_latency > 0
    roof = load_catalog("roofline")["h100"]
    assert roof.mem_efficiency == roof.kv_efficiency == 0.9 and roof.step_overhead == 0
    assert roof.peak_flops == h100.peak_flops and roof.price_per_hour == h100.price_per_hour
    assert h100.price_per_second == pytest.approx(h100.price_per_hour / 3600)
    assert CATALOG["h200"].memory_bytes == 141e9 and CATALOG["l40s"].peak_flops == 362.05e12
    bare = dataclasses.replace(h100, sources={})  # sources stay out of eq and hash
    assert bare == h100 and hash(bare) == hash(h100)


@pytest.mark.parametrize("alias, name", [
    ("H100", "h100"), ("h100-sxm", "h100"), ("A100_SXM_80GB", "a100"), ("a100-80gb", "a100"),
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("L40S", "l40s"),
    ("NVIDIA H100 PCIe", "h100-pcie"), (" b200 ", "b200"),
])
def test_aliases(alias, name):
    assert get_gpu(alias, CATALOG).name == name


def test_unknown_gpu_suggests_the_nearest():
    with pytest.raises(OpWeaveError, match=r"unknown GPU type 'h10' \(did you mean: h100, h200.*known: h100, h100-pcie"):
        get_gpu("h10", CATALOG)


def test_format_catalog_is_the_table_in_the_docs():
    table = format_catalog(CATALOG)
    assert len(table.splitlines()) == 2 + len(CATALOG) and "| h100 " in table
    with open(DOCS, encoding="utf-8") as f:
        assert table in f.read(), "docs/hardware.md: paste the new format_catalog(load_catalog()) table"


NEW_GPU = {
    "description": "a made-up test GPU", "peak_flops": 100e12, "mem_bandwidth": 1e12, "memory_bytes": 32e9,
    "usable_memory_fraction": 0.9, "intra_link_bandwidth": 32e9, "intra_link_latency": 8e-6,
    "inter_link_bandwidth": 3e9, "inter_link_latency": 30e-6, "gpus_per_node": 4, "gemm_efficiency": 0.7,
    "mem_efficiency": 0.8, "launch_overhead": 2e-6, "price_per_hour": 1.25,
}


def _write(tmp_path, name, data):
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(data))
    else:
        import yaml

        path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("ext", ["yaml", "json"])
def test_override_changes_a_price_and_adds_a_gpu(tmp_path, ext):
    path = _write(tmp_path, f"hw.{ext}", {"H100-SXM": {"price_per_hour": 2.5, "sources": {"price_per_hour": "my contract"}},
                                          "l40s": {"price_per_hour": 1.0}, "mygpu": NEW_GPU})
    cat = load_catalog(path)
    assert cat["h100"].price_per_hour == 2.5 and cat["h100"].sources["price_per_hour"] == "my contract"
    assert cat["h100"].peak_flops == 989e12  # untouched fields stay
    assert cat["l40s"].price_per_hour == 1.0 and path in cat["l40s"].sources["price_per_hour"]
    assert cat["mygpu"].gpus_per_node == 4 and set(cat["mygpu"].sources) == set(REQUIRED_FIELDS) - {"description"}
    assert cat["mygpu"].effective_kv_bandwidth == cat["mygpu"].effective_bandwidth  # optional terms: ideal
    assert cat["mygpu"].step_overhead == cat["mygpu"].collective_latency == 0
    assert tuple(cat)[-1] == "mygpu"
    assert load_catalog()["h100"].price_per_hour == CATALOG["h100"].price_per_hour  # built-in unchanged
    cluster = parse_cluster("mygpux6+h100x8", cat)
    assert cluster.price_per_hour == pytest.approx(6 * 1.25 + 8 * 2.5)


def test_override_file_network_field(tmp_path):
    path = _write(tmp_path, "hw.yaml", {"a100": {"network": "dgx"}, "l4": {"inter_link_bandwidth": 3e9},
                                        "mygpu": {**{k: v for k, v in NEW_GPU.items() if not k.startswith("inter")},
                                                  "inter_link_bandwidth": 3e9, "inter_link_latency": 30e-6}})
    cat = load_catalog(path)
    assert (cat["a100"].network, cat["a100"].inter_link_bandwidth) == ("dgx", 25e9)
    assert parse_cluster("a100x8", cat).canonical_spec == "a100x8@dgx"  # not the built-in default: named
    assert (cat["l4"].network, cat["l4"].inter_link_bandwidth) == (None, 3e9)  # figures given: no profile
    assert cat["mygpu"].network is None and "| mygpu " in format_catalog(cat)
    bad = _write(tmp_path, "bad.yaml", {"mygpu": {**{k: v for k, v in NEW_GPU.items() if not k.startswith("inter")},
                                                  "network": "dgx"}})
    with pytest.raises(OpWeaveError, match=r"entry 'mygpu', field 'network': network profile 'dgx' has no figures "
                                           r"for mygpu \(.*no profile covers mygpu\)$"):
        load_catalog(bad)


def test_yaml_exponent_without_a_dot_is_read_as_a_number(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text("h100:\n  peak_flops: 1e15\n")  # YAML 1.1 reads this as text
    assert load_catalog(str(path))["h100"].peak_flops == 1e15


@pytest.mark.parametrize("entry, fragment", [
    ({"h100": {"pric_per_hour": 1}}, r"entry 'h100': unknown field 'pric_per_hour' \(did you mean price_per_hour"),
    ({"h100": {"price_per_hour": -1}}, r"entry 'h100', field 'price_per_hour': must be a positive number"),
    ({"h100": {"price_per_hour": 0}}, r"field 'price_per_hour': must be a positive number"),
    ({"h100": {"price_per_hour": "cheap"}}, r"field 'price_per_hour': must be a number, got 'cheap'"),
    ({"h100": {"peak_flops": [1, 2]}}, r"field 'peak_flops': must be a number"),
    ({"h100": {"peak_flops": True}}, r"field 'peak_flops': must be a number"),
    ({"h100": {"gemm_efficiency": 1.5}}, r"field 'gemm_efficiency': is a fraction and must be in \(0, 1\]"),
    ({"h100": {"usable_memory_fraction": 0}}, r"field 'usable_memory_fraction': must be a positive number"),
    ({"h100": {"gpus_per_node": 7.5}}, r"field 'gpus_per_node': must be a whole number"),
    ({"h100": {"description": ""}}, r"field 'description': must be non-empty text"),
    ({"h100": 3}, r"entry 'h100': must be a mapping"),
    ({"h100": {"sources": {"bogus": "x"}}}, r"field 'sources': 'bogus' must name a numeric field"),
    ({"newgpu": {"price_per_hour": 1.0}}, r"entry 'newgpu': not in the catalog, so it needs every field; missing: description, peak_flops"),
    ({"bad name!": NEW_GPU}, r"entry 'bad name!': a GPU name is"),
    ({"h100": {"step_overhead": -1e-6}}, r"field 'step_overhead': must be a number >= 0"),
    ({"h100": {"serial_fraction": 1.5}}, r"field 'serial_fraction': is a fraction and must be in \[0, 1\]"),
    ({"h100": {"kv_efficiency": 0}}, r"field 'kv_efficiency': must be a positive number"),
])
@pytest.mark.parametrize("ext", ["yaml", "json"])
def test_bad_override_names_file_entry_and_field(tmp_path, entry, fragment, ext):
    path = _write(tmp_path, f"bad.{ext}", entry)
    with pytest.raises(OpWeaveError, match=fragment) as info:
        load_catalog(path)
    assert str(info.value).startswith(path) and "\n" not in str(info.value)


@pytest.mark.parametrize("name, text, fragment", [
    ("hw.txt", "{}", "must end in .yaml, .yml or .json"),
    ("hw.json", "{not json", "cannot read catalog override file"),
    ("hw.yaml", "a: [1,", "cannot read catalog override file"),
    ("hw.yaml", "- 1\n- 2\n", "must hold a mapping"),
])
def test_unreadable_override_files(tmp_path, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(OpWeaveError, match=fragment) as info:
        load_catalog(str(path))
    assert "\n" not in str(info.value)
    with pytest.raises(OpWeaveError, match="not found"):
        load_catalog(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("spec, pools", [
    ("h100x8+l40sx8", [("h100", 8), ("l40s", 8)]),
    ("a100x16", [("a100", 16)]),
    ("h100", [("h100", 1)]),
    ("H100:8 + L4x2", [("h100", 8), ("l4", 2)]),
    ("h100-sxmx4", [("h100", 4)]),
    ("cpux4", [("cpu", 4)]),
])
def test_parse_cluster(spec, pools):
    cluster = parse_cluster(spec, CATALOG)
    assert [(p.gpu.name, p.count) for p in cluster.pools] == pools
    assert cluster.spec == spec
    assert cluster.total_gpus == sum(n for _, n in pools)
    assert cluster.gpu_types == tuple(name for name, _ in pools)
    assert cluster.price_per_hour == pytest.approx(sum(n * CATALOG[g].price_per_hour for g, n in pools))
    for name, n in pools:
        assert cluster.count(name) == n
    assert cluster.count("b200") == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(EXPECTED), st.integers(1, 64), st.integers(0, 8)), min_size=1, max_size=4,
                unique_by=lambda t: t[0]))
def test_canonical_spec_round_trips(pools):
    """Pools with and without a network profile (index 0: none; past the last: the last)."""
    def pool(g, n, k):
        profiles = profiles_for(g)
        return f"{g}x{n}" + (f"@{profiles[min(k, len(profiles)) - 1]}" if k else "")

    cluster = parse_cluster("+".join(pool(*t) for t in pools), CATALOG)
    again = parse_cluster(cluster.canonical_spec, CATALOG)
    assert again.pools == cluster.pools and again.canonical_spec == cluster.canonical_spec
    for p, (g, n, k) in zip(cluster.pools, pools):  # a non-default profile is named, the default is not
        assert (f"{g}x{n}@{p.gpu.network}" in cluster.canonical_spec) == (p.gpu.network != CATALOG[g].network)
    layout = cluster.physical_gpus()
    assert [g.global_index for g in layout] == list(range(cluster.total_gpus))
    assert len({g.node_index for g in layout}) == cluster.num_nodes
    for g in layout:  # a node holds one type and at most gpus_per_node GPUs
        assert 0 <= g.local_index < CATALOG[g.gpu_name].gpus_per_node


@pytest.mark.parametrize("spec, fragment", [
    ("", "empty cluster spec"),
    ("   ", "empty cluster spec"),
    ("h100x8+", "empty pool"),
    ("+", "empty pool"),
    ("h100x8++l4x2", "empty pool"),
    ("h100x", "has no count after 'x'"),
    ("h100xx8", "malformed pool 'h100xx8'"),
    ("x8", "has no GPU type before 'x'"),
    ("h100x8.5", "count '8.5' in pool 'h100x8.5' is not a whole number"),
    ("h100x0", "must be positive"),
    ("h100x-2", "must be positive"),
    ("h10x8", r"unknown GPU type 'h10' \(did you mean: h100"),
    ("l40", r"unknown GPU type 'l40' \(did you mean: l40s"),
    ("h100x8+H100x4", r"GPU type 'h100' appears more than once; write it once \(h100x12\)"),
    ("h100x8+a100-80gbx2+a100x2", "GPU type 'a100' appears more than once"),
    ("missing.yaml", "cluster file 'missing.yaml' not found"),
    ("h100x8@", r"pool 'h100x8@' has no network profile after '@' \(profiles: dgx, aws-p4d, "),
    ("h100x8@dgz", r"unknown network profile 'dgz' \(did you mean: dgx\?; profiles: dgx, "),
    ("h100x8@aws-p4de", r"network profile 'aws-p4de' has no figures for h100 \(it covers a100; "
                        r"profiles for h100: dgx, aws-p5, gcp-a3-high, azure-nd-h100-v5\)"),
    ("cpux2@dgx", r"network profile 'dgx' has no figures for cpu .*profiles for cpu: loopback"),
    ("@dgx", r"pool '@dgx' has no GPUs before '@'"),
    ("h100x8@dgx@dgx", r"malformed pool 'h100x8@dgx@dgx' \(one '@' before a network profile"),
    ("h10x8@dgx", r"unknown GPU type 'h10'"),
    ("h100x8@dgx+h100x8@aws-p5", r"GPU type 'h100' appears more than once, with network profiles dgx, aws-p5; "
                                 r"a cluster holds one pool per GPU type whatever its network: write it once "
                                 r"\(h100x16@dgx\)"),
    ("h100x8@dgx+h100x4@DGX", r"GPU type 'h100' appears more than once; write it once \(h100x12@dgx\)"),
])
def test_bad_cluster_specs(spec, fragment):
    with pytest.raises(OpWeaveError, match=fragment) as info:
        parse_cluster(spec, CATALOG)
    assert "\n" not in str(info.value)


def test_network_profiles_per_pool():
    cluster = parse_cluster("h100x16@dgx+a100x16@aws-p4de", CATALOG)
    h100, a100 = (p.gpu for p in cluster.pools)
    assert (h100.network, h100.inter_link_bandwidth) == ("dgx", 50e9)
    assert (a100.network, a100.inter_link_bandwidth) == ("aws-p4de", 6.25e9) and a100 == CATALOG["a100"]
    assert cluster.canonical_spec == "h100x16@dgx+a100x16"  # aws-p4de is the A100's default
    assert cluster.spec == "h100x16@dgx+a100x16@aws-p4de"
    dgx_a100 = parse_cluster("a100x16@dgx", CATALOG).pools[0].gpu
    assert dgx_a100.inter_link_bandwidth == 4 * CATALOG["a100"].inter_link_bandwidth  # 8x200G vs 4x100G per node
    assert dgx_a100.peak_flops == CATALOG["a100"].peak_flops and dgx_a100.price_per_hour == CATALOG["a100"].price_per_hour
    assert dgx_a100.sources["inter_link_bandwidth"].startswith("network profile 'dgx' (8x 200 Gb/s HDR")
    assert parse_cluster("l40s:4@eth-1x100", CATALOG).canonical_spec == "l40sx4@eth-1x100"
    assert parse_cluster("h100@aws-p5", CATALOG).canonical_spec == "h100x1"


def test_physical_layout_and_direct_construction():
    cluster = parse_cluster("h100x12+l40sx3", CATALOG)
    layout = [(g.pool_index, g.node_index, g.local_index, g.global_index) for g in cluster.physical_gpus()]
    assert layout[:8] == [(0, 0, i, i) for i in range(8)]
    assert layout[8:12] == [(0, 1, i, 8 + i) for i in range(4)]
    assert layout[12:] == [(1, 2, i, 12 + i) for i in range(3)]
    assert cluster.num_nodes == 3
    with pytest.raises(OpWeaveError, match="must be a positive whole number"):
        Cluster(pools=(Pool(gpu=CATALOG["h100"], count=0),), spec="x")
    with pytest.raises(OpWeaveError, match="has no GPUs"):
        Cluster(pools=(), spec="")


@pytest.mark.parametrize("ext", ["yaml", "json"])
def test_cluster_file_with_network_profiles(tmp_path, ext):
    path = _write(tmp_path, f"cluster.{ext}", {"pools": [
        {"gpu": "h100", "count": 16, "network": "dgx", "price_per_hour": 2.49},
        {"gpu": "a100", "count": 8, "network": "dgx"},
        {"gpu": "l40s", "count": 8},
    ]})
    cluster = parse_cluster(path, CATALOG)
    assert cluster.canonical_spec == "h100x16@dgx+a100x8@dgx+l40sx8"
    assert [p.gpu.inter_link_bandwidth for p in cluster.pools] == [50e9, 25e9, CATALOG["l40s"].inter_link_bandwidth]
    assert parse_cluster(cluster.canonical_spec, CATALOG).pools[1] == cluster.pools[1]
    assert cluster.pools[0].gpu.price_per_hour == 2.49


@pytest.mark.parametrize("ext", ["yaml", "json"])
def test_cluster_file_with_pool_overrides(tmp_path, ext):
    path = _write(tmp_path, f"cluster.{ext}", {"pools": [
        {"gpu": "H100", "count": 12, "gpus_per_node": 4, "price_per_hour": 3.0},
        {"gpu": "l40s", "count": 8},
    ]})
    cluster = parse_cluster(path, CATALOG)
    assert cluster.canonical_spec == "h100x12+l40sx8" and cluster.spec == path
    assert cluster.pools[0].gpu.gpus_per_node == 4 and cluster.num_nodes == 4
    assert cluster.price_per_hour == pytest.approx(12 * 3.0 + 8 * CATALOG["l40s"].price_per_hour)
    assert path in cluster.pools[0].gpu.sources["price_per_hour"]


@pytest.mark.parametrize("data, fragment", [
    ({"pools": []}, "one key, 'pools'"),
    ({"nodes": [{"gpu": "h100", "count": 1}]}, "one key, 'pools'"),
    ({"pools": [{"gpu": "h100"}]}, "pool 0: needs 'gpu'"),
    ({"pools": [{"gpu": "h100", "count": 0}]}, "pool 0, field 'count': must be a positive whole number"),
    ({"pools": [{"gpu": "h10", "count": 1}]}, r"pool 0: unknown GPU type 'h10' \(did you mean: h100"),
    ({"pools": [{"gpu": "h100", "count": 1, "price_per_hour": -3}]}, "pool 0 \\(h100\\), field 'price_per_hour': must be a positive"),
    ({"pools": [{"gpu": "h100", "count": 1, "colour": "red"}]}, "unknown field 'colour'"),
    ({"pools": [{"gpu": "h100", "count": 1}, {"gpu": "h100-sxm", "count": 1}]}, "appears more than once"),
    ({"pools": [{"gpu": "h100", "count": 1, "network": "aws-p4de"}]},
     r"pool 0 \(h100\), field 'network': network profile 'aws-p4de' has no figures for h100"),
    ({"pools": [{"gpu": "h100", "count": 1, "network": 3}]}, r"field 'network': must be a network profile name"),
    ({"pools": [{"gpu": "h100", "count": 1, "network": "dgx", "inter_link_latency": 5e-6}]},
     r"give either 'network' \(a profile\) or inter_link_latency, not both"),
    ({"pools": [{"gpu": "h100", "count": 8, "network": "dgx"}, {"gpu": "h100", "count": 8}]},
     r"appears more than once, with network profiles dgx, aws-p5; a cluster holds one pool per GPU type"),
])
def test_bad_cluster_files(tmp_path, data, fragment):
    path = _write(tmp_path, "cluster.yaml", data)
    with pytest.raises(OpWeaveError, match=fragment):
        parse_cluster(path, CATALOG)


def test_local_without_nvidia_gpus_is_a_clear_error(monkeypatch):
    import pynvml
    message = r"^no NVIDIA GPU found on this machine \(NVML: .+\); give the cluster explicitly, e.g. --cluster h100x8$"
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:  # no driver here: the real path, unpatched
        with pytest.raises(OpWeaveError, match=message):
            parse_cluster("local", CATALOG)

    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)  # the same on any machine
    with pytest.raises(OpWeaveError, match=message):
        parse_cluster("local", CATALOG)


def _fake_nvml(monkeypatch, names):
    import pynvml

    calls = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(names))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: names[h])
    return calls


def test_local_with_fake_gpus(monkeypatch):
    calls = _fake_nvml(monkeypatch, ["NVIDIA H100 80GB HBM3", b"NVIDIA H100 80GB HBM3"])
    cluster = parse_cluster("local", CATALOG)
    assert cluster.canonical_spec == "h100x2" and cluster.spec == "local"
    assert calls == ["init", "shutdown"]
    _fake_nvml(monkeypatch, ["NVIDIA L4", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"])
    assert parse_cluster("local", CATALOG).canonical_spec == "l4x2+a100x1"
    _fake_nvml(monkeypatch, [])
    with pytest.raises(OpWeaveError, match=r"no NVIDIA GPU found on this machine \(NVML: 0 devices\)"):
        parse_cluster("local", CATALOG)
    _fake_nvml(monkeypatch, ["NVIDIA GeForce RTX 4090"])
    with pytest.raises(OpWeaveError, match="GPU 'NVIDIA GeForce RTX 4090' is not in the catalog"):
        parse_cluster("local", CATALOG)
