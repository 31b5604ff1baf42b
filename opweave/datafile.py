"""Reading the files users hand to OpWeave: only regular files, never blocking, bounded in size and
in nesting.

    read_regular     a file's bytes; a FIFO, device, socket or folder is refused by name, unopened
    read_data_file   a YAML or JSON mapping (catalogs, cluster files), its structure checked

Note: a FIFO or a device named like an input would block `open` (or read forever), so the file's
type is checked before it is opened, and again on the opened descriptor (opened non-blocking).
Parsers recurse per level of nesting: a file of 100,000 `[` would end them with a RecursionError,
and YAML's aliases can make a small file stand for an enormous (or self-referencing) structure;
`check_structure` bounds both before anything walks the data.
"""

from __future__ import annotations

import datetime
import json
import os
import stat

from opweave.errors import OpWeaveError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
MAX_DATA_FILE_BYTES = 4 << 20
"""A catalog or cluster file is a few kB; a larger one is not one (and YAML parses slowly)."""
MAX_DEPTH = 16
"""Nesting levels a data file may have: a catalog needs 3 (entry, field, source), a cluster file 4."""
MAX_NODES = 1_000_000
"""Values a data file may stand for, counting each alias again where it is used."""


def file_kind(mode: int) -> str:
    """'a regular file', 'a FIFO', 'a folder', ... for an `st_mode`."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _require_regular(mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise OpWeaveError(f"{what} is {file_kind(mode)}, not a regular file")


def read_regular(path: str, what: str, max_bytes: int | None = None) -> bytes:
    """The bytes of regular file `path` (symbolic links followed).

    Args:
        path: the file.
        what: how errors name it ("/art/rank_00.py", "--sign-key key"): "{what} is a FIFO, not a
            regular file", "{what} is larger than N bytes".
        max_bytes: refuse a larger file (None: no bound).
    Raises:
        OSError: missing or unreadable (FileNotFoundError for a missing file): the caller words it.
        OpWeaveError: not a regular file, or too large.
    """
    _require_regular(os.stat(path).st_mode, what)  # before opening: opening some devices acts
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    with os.fdopen(fd, "rb") as f:
        _require_regular(os.fstat(fd).st_mode, what)  # swapped for a FIFO meanwhile
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise OpWeaveError(f"{what} is larger than {max_bytes:,} bytes")
    return data


def read_data_file(path: str, what: str) -> dict:
    """A YAML (.yaml/.yml) or JSON (.json) file holding a mapping, its structure checked
    (`check_structure`); one-line OpWeaveError on any problem. `what`: "catalog", "cluster", ..."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".yaml", ".yml", ".json"):
        raise OpWeaveError(f"{path}: a {what} file must end in .yaml, .yml or .json")
    try:
        text = read_regular(path, f"{what} file {path}", MAX_DATA_FILE_BYTES).decode("utf-8-sig")
        data = json.loads(text) if ext == ".json" else _load_yaml(text)
    except FileNotFoundError:
        raise OpWeaveError(f"{what} file '{path}' not found") from None
    except OSError as err:
        raise OpWeaveError(f"{path}: cannot read {what} file: {err.strerror or err}") from None
    except RecursionError:
        raise OpWeaveError(f"{path}: cannot read {what} file: nested too deeply "
                           f"(a {what} file has at most {MAX_DEPTH} levels)") from None
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError, and YAML errors (`_load_yaml`)
        raise OpWeaveError(f"{path}: cannot read {what} file: {_one_line(err)}") from None
    check_structure(data, f"{path}: {what} file")
    if not isinstance(data, dict):
        raise OpWeaveError(f"{path}: a {what} file must hold a mapping, not {type(data).__name__}")
    return data


def _load_yaml(text: str):
    """`yaml.safe_load`, its errors as ValueError (PyYAML is imported only for YAML files)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(_one_line(err)) from None


_SCALARS = (str, int, float, bool, type(None), datetime.date)  # YAML reads 2024-05-01 as a date


def check_structure(data, where: str) -> None:
    """Refuses data nested more than `MAX_DEPTH` levels, standing for more than `MAX_NODES`
    values, holding itself (a YAML alias inside its own anchor), or holding anything but
    mappings with text or number keys, lists, text, numbers, booleans, dates and nulls (YAML
    sets, binary). Each mapping and list is visited once, so aliases cost nothing extra."""
    sizes: dict[int, int] = {}  # id of a mapping or list checked -> values it stands for
    open_ids: set[int] = set()

    def size(node, depth: int, at: str) -> int:
        at = at if len(at) <= 80 else at[:77] + "..."
        if isinstance(node, _SCALARS):
            return 1
        if not isinstance(node, (dict, list)):
            raise OpWeaveError(f"{where}: {at or 'the top level'} holds a {type(node).__name__}, "
                               "not text, a number, a list or a mapping")
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_ids:
            raise OpWeaveError(f"{where}: {at or 'the top level'} holds itself (a YAML alias inside its anchor)")
        if depth >= MAX_DEPTH:
            raise OpWeaveError(f"{where}: nested too deeply at {at} (at most {MAX_DEPTH} levels)")
        open_ids.add(id(node))
        if isinstance(node, dict):
            for key in node:
                if not isinstance(key, _SCALARS):
                    raise OpWeaveError(f"{where}: {at or 'the top level'} has a key that is a "
                                       f"{type(key).__name__}, not text or a number")
            items = ((f"{at}.{key}" if at else str(key), value) for key, value in node.items())
        else:
            items = ((f"{at}[{i}]", value) for i, value in enumerate(node))
        total = 1
        for child_at, child in items:
            total += size(child, depth + 1, child_at)
            if total > MAX_NODES:
                raise OpWeaveError(f"{where}: stands for more than {MAX_NODES:,} values (YAML aliases count "
                                   "each time they are used)")
        open_ids.discard(id(node))
        sizes[id(node)] = total
        return total

    size(data, 0, "")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
