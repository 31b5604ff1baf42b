"""The package's layers: every import (function-level ones included) points down the layer list,
no two files import each other (directly or through others), no file is over 800 lines, and
docs/layout.md names every file of the package."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "opweave")

# Bottom to top: a module may import its own folder and any folder of a lower layer, nothing above.
LAYERS = (
    ("__init__", "errors"),
    ("units", "signals", "config", "datafile"),
    ("outputs", "artifact"),
    ("ir",),          # pure Python: the IRs, their printers and verifiers
    ("hardware",),    # GPU figures, clusters, networks, prices
    ("kernels",),     # torch references, Triton kernels, the sampler, block sizes, AOT checks
    ("models",),      # the torch modules of every family, configs, checkpoints
    ("cost",),        # per-op cost and memory formulas
    ("runtime",),     # one process per rank: what a compiled artifact runs on
    ("passes",),      # the compile's passes: trace, blocks, templates, search, simulate, place, lower
    ("codegen",),     # rank programs to Python modules
    ("compiler",),    # the pipeline of passes and the artifact it writes
    ("profile",),     # measuring tools: op profiles, calibration, planned-versus-allocated memory
    ("serve",),       # the OpenAI-compatible server over a running artifact
    ("cli",),
    ("__main__",),
)
MAX_LINES = 800


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out["opweave" if rel == "__init__" else "opweave." + rel.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "opweave"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "opweave":
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                found.add(full if full in MODULES else _resolve(base))
    return found - {module}


IMPORTS = {m: _imports(m) for m in MODULES}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> int:
    folder = _folder(module)
    return next(i for i, names in enumerate(LAYERS) if folder in names)


def test_every_folder_has_a_layer():
    assert {_folder(m) for m in MODULES} <= {name for names in LAYERS for name in names}


def test_imports_point_down():
    upward = sorted(f"{m} -> {t}" for m, targets in IMPORTS.items() for t in targets
                    if _folder(t) != _folder(m) and _layer(t) >= _layer(m))
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_no_import_cycle_between_files():
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in IMPORTS[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(MODULES):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_no_file_over_800_lines():
    long = {os.path.relpath(p, ROOT): n for p in MODULES.values() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not long, long


def test_layout_doc_names_every_file():
    doc = open(os.path.join(ROOT, "..", "docs", "layout.md")).read()
    named = set(re.findall(r"`([\w/]+\.(?:py|json|j2))`", doc))
    missing = []
    for path in MODULES.values():
        rel = os.path.relpath(path, ROOT)
        if os.path.basename(rel) == "__init__.py" and os.path.getsize(path) < 400:
            continue  # an empty package marker
        if rel not in named and os.path.basename(rel) not in named:
            missing.append(rel)
    assert not missing, f"docs/layout.md does not name: {sorted(missing)}"


@pytest.mark.parametrize("module", ["opweave.ir"])
def test_ir_is_pure_python(module):
    heavy = sorted(f"{m}: {line.strip()}" for m, p in MODULES.items() if m.startswith(module + ".")
                   for line in open(p) if re.match(r"\s*(import|from)\s+(torch|numpy|triton)\b", line))
    assert not heavy, heavy
