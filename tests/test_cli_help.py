"""The help of `opweave` and of every subcommand, walked on the real parser: every flag says what
it does and its default (or what happens when it is absent), a flag with choices shows them, every
subcommand's help ends with examples that parse, and `--device` is one flag with one set of
choices, one default and one help wherever it appears, refused the same way (one line, exit 2)
when its value is not one of them."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from opweave.cli import COMMANDS, build_parser, main
from opweave.cli.common import DEVICE_HELP, DEVICES
from opweave.errors import OpWeaveError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = [c.name for c in COMMANDS]


@pytest.fixture
def parser(monkeypatch):
    monkeypatch.delenv("OPWEAVE_API_KEY", raising=False)  # serve's --api-key defaults to it: a secret, never shown
    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def label(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or action.dest


def shows_default(default, text: str) -> bool:
    """Whether `text` names `default` after the word "default" ("default 16", "default: cpu",
    "default 4m: 4194304 bytes"); a float also as %g (120.0 as "120")."""
    shown = {str(default)} | ({f"{default:g}"} if isinstance(default, float) else set())
    return any(re.search(r"\bdefault\b.*?(?<![\w.])" + re.escape(s) + r"(?!\w)", text, re.S) for s in shown)


def help_problems(p: argparse.ArgumentParser) -> list[str]:
    """What is wrong with the help of `p`'s actions (all but -h), one line each."""
    formatter = p._get_formatter()
    problems = []
    for action in p._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if not action.help or action.help == argparse.SUPPRESS or not action.help.strip():
            problems.append(f"{label(action)}: no help")
            continue
        text = formatter._expand_help(action)  # the help as printed: %(default)s filled in
        if action.choices is not None:
            shown = formatter._format_action_invocation(action) + " " + text
            missing = [c for c in action.choices if str(c) not in shown]
            if missing:
                problems.append(f"{label(action)}: choices {missing} not shown")
        if action.required or not action.option_strings or action.nargs == 0:
            continue  # required, positional, or a switch (off unless given): no default to show
        if action.default is None or action.default == []:
            if "default" not in text:
                problems.append(f"{label(action)}: help does not say what happens when it is absent: {text!r}")
        elif not shows_default(action.default, text):
            problems.append(f"{label(action)}: help does not show the default {action.default!r}: {text!r}")
    return problems


@pytest.mark.parametrize("name", NAMES)
def test_every_flag_has_help_with_its_default(parser, name):
    assert help_problems(subcommands(parser)[name]) == []


def test_top_level_flags_have_help(parser):
    assert help_problems(parser) == []
    assert set(subcommands(parser)) == set(NAMES)
    assert "example" in parser.format_help()


def test_a_flag_without_help_or_default_fails_the_check(parser):
    """The check itself can fail: a flag with no help, one hiding its default, one hiding its choices."""
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--bare", default=3)
    p.add_argument("--hidden", default=5, help="a number")
    p.add_argument("--absent", default=None, help="a file")
    p.add_argument("--kind", choices=("a", "b"), metavar="K", default="a", help="a kind (default %(default)s)")
    problems = help_problems(p)
    assert [line.split(":")[0] for line in problems] == ["--bare", "--hidden", "--absent", "--kind"], problems


@pytest.mark.parametrize("name", NAMES)
def test_every_subcommand_ends_with_examples_that_parse(parser, name):
    text = subcommands(parser)[name].format_help()
    assert "example" in text.lower()
    lines = text[text.rindex("examples:"):].splitlines()[1:]
    examples = [line.strip() for line in lines if line.strip()]
    assert examples and all(e.startswith("opweave ") for e in examples), examples
    assert any(shlex.split(e)[1] == name for e in examples), examples
    for example in examples:  # only flags that exist, with values they take
        try:
            args = build_parser().parse_args(shlex.split(example)[1:])
        except OpWeaveError as e:
            pytest.fail(f"{example}: {e}")
        assert args.command == shlex.split(example)[1]


def test_device_is_one_flag_everywhere(parser):
    devices = {name: a for name, p in subcommands(parser).items() for a in p._actions if "--device" in a.option_strings}
    assert {"profile", "run", "serve"} <= set(devices)
    assert {name: (a.choices and tuple(a.choices), a.default, a.help, a.type) for name, a in devices.items()} == {
        name: (DEVICES, "cpu", DEVICE_HELP, None) for name in devices}
    assert DEVICES == ("cpu", "cuda")


def _placeholders(p: argparse.ArgumentParser) -> list[str]:
    """Values for `p`'s positionals and required flags: parsing gets as far as --device."""
    out = []
    for a in p._actions:
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction):
            out.append("x")
        elif a.required:
            out += [a.option_strings[-1], "x"]
    return out


def test_bad_device_is_refused_alike_by_every_command(parser, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = {name: p for name, p in subcommands(parser).items()
                if any("--device" in a.option_strings for a in p._actions)}
    lines = {}
    for name, p in commands.items():
        argv = [name, *_placeholders(p)]
        for good in DEVICES:  # both choices parse
            assert build_parser().parse_args([*argv, "--device", good]).device == good
        assert main([*argv, "--device", "tpu"]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert captured.out == "" and len(err) == 1, (name, captured)
        lines[name] = err[0]
    assert len(set(lines.values())) == 1, lines
    (line,) = set(lines.values())
    assert line.startswith("opweave: error: argument --device: invalid choice: 'tpu'") and "cuda" in line, line
    assert os.listdir(tmp_path) == []


def test_bad_device_exits_2_from_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "opweave", "run", str(tmp_path), "--weights", "random",
                          "--prompt-ids", "1", "--device", "cuda:0"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stdout == ""
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("opweave: error: argument --device: invalid choice: 'cuda:0'"), err
