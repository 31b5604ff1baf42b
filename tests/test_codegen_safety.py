"""Generated modules are safe by construction: names from outside (a checkpoint folder's name is
the model's name) reach `rank_XX.py` only as escaped literals and comments, so a hostile or odd
folder name can neither run code nor break the module, and the artifact still runs correctly."""

import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fixtures import hf_generate
from opweave.codegen.render import _ENV, comment, literal
from opweave.runtime.launch import RunConfig, run
from opweave.runtime.scheduler import Request
from test_runtime import compile_pinned

INJECTION = "x\"\"\"\nimport os; open('PWNED','w')\n\"\"\""
NAMES = {
    "quote": "it's",
    "triple_quote": INJECTION,
    "backslashes": "back\\slash\\\\",
    "escapes": "bad\\uZZ\\N{oops\\x",
    "newline": "two\nlines",
    "non_ascii": "模型-é",
    "coding": "x -*- coding: utf-7 -*- +AAo-",
}
RUN = ("triple_quote", "escapes", "non_ascii")  # run end to end (the others are compiled and imported)
PROMPT, NEW_TOKENS = [5, 6, 7], 3


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoint, tmp_path_factory):
    """{key: (checkpoint folder named NAMES[key], artifact)}, one pinned AFD plan for every name."""
    source = tiny_checkpoint("llama", num_hidden_layers=3)
    root = tmp_path_factory.mktemp("names")
    out = {}
    for key, name in NAMES.items():
        folder = str(root / key / name)
        shutil.copytree(source, folder)
        art = str(root / key / "art")
        compile_pinned(folder, "afd", art)
        out[key] = (folder, art)
    return out


def _pwned(*roots):
    return [os.path.join(d, f) for r in roots for d, _, files in os.walk(r) for f in files if "PWNED" in f]


def _modules(art):
    return sorted(n for n in os.listdir(art) if n.startswith("rank_") and n.endswith(".py"))


@pytest.mark.parametrize("key", list(NAMES))
@pytest.mark.slow
def test_every_module_compiles_and_holds_the_name_as_a_literal(artifacts, key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, art = artifacts[key]
    assert _modules(art)
    for name in _modules(art):
        path = os.path.join(art, name)
        with open(path, "rb") as f:
            raw = f.read()
        head = raw.split(b"\n")[:2]
        assert not any(b"coding" in line for line in head)  # nothing from the plan in the encoding lines
        namespace = {"__name__": "generated"}
        exec(compile(raw, path, "exec"), namespace)  # the module's top level: constants and a class
        assert namespace["MODEL"] == NAMES[key] and namespace["RANK"] == int(name[5:7])
        assert "Program" in namespace
    assert _pwned(tmp_path, art) == []


@pytest.mark.parametrize("key", RUN)
@pytest.mark.slow
def test_oddly_named_checkpoints_run_and_generate_reference_tokens(artifacts, key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder, art = artifacts[key]
    outputs = run(RunConfig(artifact=art, weights=folder, device="cpu", timeout_s=120,
                            requests=(Request(index=0, prompt=PROMPT, max_new_tokens=NEW_TOKENS),)))
    assert [r.error for r in outputs] == [None]
    assert list(outputs[0].output) == hf_generate(folder, PROMPT, NEW_TOKENS)[1]
    assert _pwned(tmp_path, os.path.dirname(folder)) == []


@settings(max_examples=200, deadline=None)
@given(st.text())
@pytest.mark.slow
def test_any_text_becomes_a_literal_and_a_one_line_comment(text):
    source = f"value = {literal(text)}  {comment(text, text)}\n"
    assert source.count("\n") == 1
    namespace = {}
    exec(compile(source, "<generated>", "exec"), namespace)
    assert namespace["value"] == text
    assert literal(text).isascii() and eval(literal((1, text, None, True))) == (1, text, None, True)


def test_only_plain_values_become_literals():
    import enum

    class Kind(enum.IntEnum):
        A = 1

    for bad in (1.5, Kind.A, object(), {"a": 1}, (1, 2.0)):
        with pytest.raises(TypeError, match="generated module holds only"):
            literal(bad)
    assert literal((3,)) == "(3,)" and literal([1, "a"]) == "[1, 'a']" and literal("é") == "'\\xe9'"


def test_the_template_cannot_paste_a_raw_string():
    """Any `{{ value }}` that is not generator-made `Code` comes out quoted."""
    assert _ENV.from_string("X = {{ value }}\n").render(value="1\nimport os") == "X = '1\\nimport os'\n"
    assert _ENV.from_string("X = {{ value|string }}\n").render(value=7) == "X = '7'\n"
    with pytest.raises(TypeError):  # a str subclass (jinja2's Markup) is not a plain value either
        _ENV.from_string("X = {{ value|safe }}\n").render(value="os.system('x')")
