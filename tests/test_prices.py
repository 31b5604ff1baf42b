"""Price tables (`--prices NAME`, sources and dates) and network profiles (`networks.json`)."""

import json
import os
import re

import pytest

from opweave.cli import main
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import load_catalog
from opweave.hardware.networks import format_networks, load_networks, network_figures, profiles_for
from opweave.hardware.prices import (
    apply_prices, format_price_table, format_prices, load_price_table, price_table_names, source_address,
    source_date,
)

CATALOG = load_catalog()
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "hardware.md")
TABLES = price_table_names()


def _docs() -> str:
    with open(DOCS, encoding="utf-8") as f:
        return f.read()


def test_at_least_a_hyperscaler_and_a_gpu_cloud_table():
    assert {"aws", "lambda"} <= set(TABLES)


@pytest.mark.parametrize("name", TABLES)
def test_every_preset_price_is_sourced_and_dated(name):
    table = load_price_table(name)
    assert table.name == name and table.description and source_address(table.source) == table.source
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", table.date)
    assert table.prices and set(table.prices) <= set(CATALOG), "a table prices catalog GPU types only"
    for gpu, price in table.prices.items():
        text = table.sources[gpu]
        assert price > 0 and source_address(text) and source_date(text), (name, gpu, text)
        assert source_date(text) >= "2025-06", (name, gpu, "a price from before the 2025 cuts")


def test_every_catalog_price_is_sourced_dated_and_current():
    for spec in CATALOG.values():
        text = spec.sources["price_per_hour"]
        if text.startswith("placeholder"):
            assert spec.name == "cpu"
            continue
        assert source_address(text) and source_date(text) >= "2025-06", (spec.name, text)


def test_the_catalog_prices_are_the_aws_table():
    """The catalog's policy (AWS on-demand list) is the `aws` table; its one exception (AWS rents no
    H100 PCIe) says so."""
    aws = load_price_table("aws")
    for gpu, spec in CATALOG.items():
        if gpu in aws.prices:
            assert spec.price_per_hour == aws.prices[gpu] and spec.sources["price_per_hour"] == aws.sources[gpu]
        elif gpu != "cpu":
            assert "exception to the AWS policy" in spec.sources["price_per_hour"], gpu
    assert CATALOG["h100"].price_per_hour < 0.6 * 12.29  # after AWS's June-2025 P5 cut of ~45%


@pytest.mark.parametrize("name", TABLES)
def test_an_instance_price_divided_by_its_gpus_gives_the_per_gpu_price(name):
    """Where a source states '$X/h / N GPUs', the table's figure is X / N (rounded to 4 places)."""
    table = load_price_table(name)
    checked = 0
    for gpu, text in table.sources.items():
        m = re.search(r"\$([0-9.]+)/h / (\d+) GPUs", text)
        if m:
            assert table.prices[gpu] == pytest.approx(float(m[1]) / int(m[2]), abs=5e-5), (name, gpu)
            checked += 1
    assert name != "aws" or checked >= 7


def test_a_preset_applies_over_the_catalog_and_reports_what_it_lacks():
    lines = []
    cat = load_catalog(prices="lambda", warn=lines.append)
    lam = load_price_table("lambda")
    assert cat["h100"].price_per_hour == lam.prices["h100"] != CATALOG["h100"].price_per_hour
    assert cat["h100"].sources["price_per_hour"] == f"price table 'lambda': {lam.sources['h100']}"
    assert cat["h100"].peak_flops == CATALOG["h100"].peak_flops and cat["h100"].network == CATALOG["h100"].network
    missing = [g for g in CATALOG if g not in lam.prices and g != "cpu"]
    assert missing and lines == [f"price table 'lambda' has no price for {', '.join(missing)}: "
                                 "they keep the catalog price"]
    for gpu in missing:  # kept, and marked
        assert cat[gpu].price_per_hour == CATALOG[gpu].price_per_hour
        assert cat[gpu].sources["price_per_hour"].startswith("catalog price (not in price table 'lambda'): ")
    assert cat["cpu"].price_per_hour == CATALOG["cpu"].price_per_hour
    assert tuple(cat) == tuple(CATALOG)
    assert load_catalog()["h100"].price_per_hour == CATALOG["h100"].price_per_hour  # built-in unchanged
    again, missing_again = apply_prices(CATALOG, "LAMBDA")
    assert missing_again == tuple(missing) and again["b200"].price_per_hour == lam.prices["b200"]
    lines.clear()
    assert load_catalog(prices="aws", warn=lines.append)["h100"].price_per_hour == CATALOG["h100"].price_per_hour
    assert lines == ["price table 'aws' has no price for h100-pcie: they keep the catalog price"]


def test_an_override_file_wins_over_a_preset(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"h100": {"price_per_hour": 2.25}}))
    cat = load_catalog(str(path), prices="lambda")
    assert cat["h100"].price_per_hour == 2.25 and cat["a100"].price_per_hour == load_price_table("lambda").prices["a100"]


@pytest.mark.parametrize("name, fragment", [
    ("lamda", r"^unknown price table 'lamda' \(did you mean: lambda\?; price tables: aws, lambda"),
    ("gcp", r"^unknown price table 'gcp' \(price tables: aws, lambda"),
    ("", r"^unknown price table ''"),
])
def test_unknown_preset_is_one_line_naming_the_presets(name, fragment):
    with pytest.raises(OpWeaveError, match=fragment) as info:
        load_catalog(prices=name)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_cli_prices_flag(capsys):
    assert main(["estimate", "llama-3.1-8b", "--gpu", "a100", "--prices", "lambda", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    (point,) = json.loads(out)["points"]
    price = load_price_table("lambda").prices["a100"]  # $/Mtok = price per GPU-second / tokens per second
    assert point["cost_per_mtok_usd"] == pytest.approx(price / 3600 / point["tokens_per_s"] * 1e6, rel=1e-3)
    assert err.startswith("opweave: warning: price table 'lambda' has no price for ")
    assert main(["estimate", "llama-3.1-8b", "--gpu", "a100", "--prices", "nope"]) == 2
    assert capsys.readouterr().err.startswith("opweave: error: unknown price table 'nope' (price tables: aws, lambda")
    for command in ("analyze", "estimate", "compile"):  # the help lists every table
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert all(name in out for name in TABLES), command


def test_price_tables_in_the_docs():
    docs = _docs()
    assert format_prices(CATALOG) in docs, "docs/hardware.md: paste format_prices(load_catalog())"
    for name in TABLES:
        assert format_price_table(name) in docs, f"docs/hardware.md: paste format_price_table('{name}')"


# ---- network profiles


def test_every_profile_figure_is_sourced_and_for_a_catalog_gpu():
    networks = load_networks()
    assert {"dgx", "aws-p4de", "aws-p5"} <= set(networks)
    for profile in networks.values():
        assert profile.description and profile.gpus
        for gpu, fig in profile.gpus.items():
            assert gpu in CATALOG and fig.nic, (profile.name, gpu)
            assert fig.inter_link_bandwidth > 0 and fig.inter_link_latency > 0
            for text in fig.sources.values():
                assert text.startswith(("assumption", "placeholder")) or source_address(text), (profile.name, gpu)


def test_every_catalog_gpu_names_a_default_profile_that_covers_it():
    for spec in CATALOG.values():
        fig = network_figures(spec.network, spec.name)
        assert (spec.inter_link_bandwidth, spec.inter_link_latency) == (fig.inter_link_bandwidth,
                                                                        fig.inter_link_latency)
        assert spec.network in profiles_for(spec.name)


def test_the_node_not_the_gpu_sets_the_network():
    """A100 in a DGX (one 200 Gb/s HDR NIC per GPU) vs an AWS p4de (400 Gb/s EFA for 8 GPUs)."""
    dgx, p4de = network_figures("dgx", "a100"), network_figures("aws-p4de", "a100")
    assert dgx.inter_link_bandwidth == 200e9 / 8 and p4de.inter_link_bandwidth == 400e9 / 8 / 8
    assert network_figures("dgx", "h100").inter_link_bandwidth == 400e9 / 8
    assert network_figures("DGX", "h100") == network_figures("dgx", "h100")
    assert profiles_for("h100")[:2] == ("dgx", "aws-p5") and "aws-p4de" not in profiles_for("h100")


@pytest.mark.parametrize("profile, gpu, fragment", [
    ("dgz", "h100", r"^unknown network profile 'dgz' \(did you mean: dgx\?; profiles: dgx, "),
    ("aws-p4de", "h100", r"^network profile 'aws-p4de' has no figures for h100 \(it covers a100; "
                         r"profiles for h100: dgx, aws-p5"),
    ("dgx", "cpu", r"^network profile 'dgx' has no figures for cpu \(.*profiles for cpu: loopback\)$"),
    ("dgx", "mygpu", r"no profile covers mygpu\)$"),
])
def test_profile_errors(profile, gpu, fragment):
    with pytest.raises(OpWeaveError, match=fragment) as info:
        network_figures(profile, gpu)
    assert "\n" not in str(info.value)


def test_network_profiles_in_the_docs():
    assert format_networks() in _docs(), "docs/hardware.md: paste format_networks()"
