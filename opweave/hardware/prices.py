"""Price tables: `prices/<name>.json`, one public price list each, applied over the catalog by name.

Note: a table is {name, description, source, date, prices: {gpu: USD per GPU-hour}, sources:
{gpu: text}}; `name` is the file's stem, `date` (YYYY-MM-DD) the day the list was read, and every
price has a source naming its address and date. `apply_prices(catalog, name)` sets the listed GPUs'
`price_per_hour` (source "price table 'NAME': ..."); a catalog GPU the table does not list keeps
the catalog price, its source then starts "catalog price (not in price table 'NAME')", and it is
returned in `missing` (entries with a placeholder price, the `cpu` one, are not: no cloud lists
them). `--prices NAME` on the CLI does this through `load_catalog(..., prices=NAME)`.
"""

import dataclasses
import difflib
import functools
import json
import math
import os
import re

from opweave.errors import OpWeaveError

PRICES_DIR = os.path.join(os.path.dirname(__file__), "prices")
DATE_RE = re.compile(r"\b20\d\d-[01]\d(?:-[0-3]\d)?\b")
"""A date in a source: YYYY-MM-DD, or YYYY-MM where the source gives only the month."""
ADDRESS_RE = re.compile(r"https?://[^\s,;)'\"]+")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PriceTable:
    """One public price list: USD per GPU-hour by catalog GPU name, each with its source."""

    name: str
    description: str
    source: str  # the list's address
    date: str  # YYYY-MM-DD the list was read
    prices: dict[str, float] = dataclasses.field(compare=False, hash=False)
    sources: dict[str, str] = dataclasses.field(compare=False, hash=False)

    def missing(self, catalog: dict) -> tuple[str, ...]:
        """Catalog GPU names this table does not price (placeholder-priced entries left out)."""
        return tuple(k for k, spec in catalog.items()
                     if k not in self.prices and not spec.sources.get("price_per_hour", "").startswith("placeholder"))


def price_table_names() -> tuple[str, ...]:
    """The built-in tables' names (file stems in `prices/`), sorted."""
    return tuple(sorted(f[:-len(".json")] for f in os.listdir(PRICES_DIR) if f.endswith(".json")))


def load_price_table(name: str) -> PriceTable:
    """The built-in table `name`; OpWeaveError naming the tables when there is none."""
    key = str(name).strip().lower()
    names = price_table_names()
    if key not in names:
        near = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
        hint = f"did you mean: {', '.join(near)}?; " if near else ""
        raise OpWeaveError(f"unknown price table '{name}' ({hint}price tables: {', '.join(names)}; "
                           "give your own prices with --catalog FILE)")
    return _read_table(key)


@functools.cache
def _read_table(name: str) -> PriceTable:
    path = os.path.join(PRICES_DIR, f"{name}.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    for field in ("name", "description", "source", "date"):
        if not isinstance(raw.get(field), str) or not raw[field].strip():
            raise OpWeaveError(f"{path}: needs '{field}' (text)")
    if raw["name"] != name:
        raise OpWeaveError(f"{path}: 'name' is '{raw['name']}', not the file's name '{name}'")
    if not re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", raw["date"]):
        raise OpWeaveError(f"{path}: 'date' must be YYYY-MM-DD, got {raw['date']!r}")
    prices, sources = raw.get("prices"), raw.get("sources")
    if not isinstance(prices, dict) or not prices or not isinstance(sources, dict):
        raise OpWeaveError(f"{path}: needs 'prices' (GPU -> USD per GPU-hour) and 'sources' (GPU -> text)")
    for gpu, value in prices.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise OpWeaveError(f"{path}: price of '{gpu}' must be a positive number, got {value!r}")
        if not isinstance(sources.get(gpu), str) or not sources[gpu].strip():
            raise OpWeaveError(f"{path}: no source for the price of '{gpu}'")
    return PriceTable(name=name, description=raw["description"], source=raw["source"], date=raw["date"],
                      prices={g: float(v) for g, v in prices.items()}, sources={g: sources[g] for g in prices})


def apply_prices(catalog: dict, name: str) -> tuple[dict, tuple[str, ...]]:
    """`catalog` with table `name`'s prices, and the GPU names the table does not price.

    Args:
        catalog: name -> GPUSpec (from `load_catalog`).
        name: a built-in table (`price_table_names()`).
    Returns:
        (a new catalog: listed GPUs take the table's price and source, the others keep theirs with
        a note; the order is kept), `PriceTable.missing(catalog)`.
    """
    table = load_price_table(name)
    unknown = [g for g in table.prices if g not in catalog]
    if unknown:
        raise OpWeaveError(f"price table '{table.name}' prices GPU types the catalog does not have: "
                           f"{', '.join(unknown)}")
    out = {}
    for key, spec in catalog.items():
        if key in table.prices:
            source = f"price table '{table.name}': {table.sources[key]}"
            out[key] = dataclasses.replace(spec, price_per_hour=table.prices[key],
                                           sources={**spec.sources, "price_per_hour": source})
        else:
            note = f"catalog price (not in price table '{table.name}'): {spec.sources.get('price_per_hour', '')}"
            out[key] = dataclasses.replace(spec, sources={**spec.sources, "price_per_hour": note})
    return out, table.missing(catalog)


def source_address(text: str) -> str:
    """The first web address in a source text ('' if none)."""
    m = ADDRESS_RE.search(text)
    return m.group(0).rstrip(".:") if m else ""


def source_date(text: str) -> str:
    """The first YYYY-MM-DD (or YYYY-MM) date in a source text ('' if none)."""
    m = DATE_RE.search(text)
    return m.group(0) if m else ""


def format_prices(catalog: dict) -> str:
    """A Markdown table of the catalog's prices: GPU, $/GPU-h, date, address (from each source)."""
    rows = [("GPU", "$/GPU-h", "date", "source")]
    for spec in catalog.values():
        text = spec.sources.get("price_per_hour", "")
        placeholder = text.startswith("placeholder")
        rows.append((spec.name, f"{spec.price_per_hour:g}", "" if placeholder else source_date(text),
                     "placeholder" if placeholder else source_address(text)))
    return _markdown(rows, numeric=(False, True, False, False))


def format_price_table(name: str) -> str:
    """A Markdown table of built-in table `name`: GPU, $/GPU-h, date, address (from each source)."""
    table = load_price_table(name)
    rows = [("GPU", "$/GPU-h", "date", "source")]
    rows += [(g, f"{p:g}", source_date(table.sources[g]), source_address(table.sources[g]))
             for g, p in table.prices.items()]
    return _markdown(rows, numeric=(False, True, False, False))


def _markdown(rows: list[tuple[str, ...]], numeric: tuple[bool, ...]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if n else ":" + "-" * (w + 1) for w, n in zip(widths, numeric)) + "|"
    return "\n".join([line(rows[0]), rule] + [line(r) for r in rows[1:]])
