"""`opweave` command line: one subcommand per job.

This module holds the command table (`COMMANDS`), the parser built from it (`build_parser`) and
`main`; each family's flags and bodies live beside it: `dump.py`, `costs.py` (analyze, estimate,
calibrate, profile), `planning.py` (compile, demo), `serving.py` (run, serve) and `deploy.py`
(launch-files), with what they share in `common.py`.

User errors (`OpWeaveError`) print one line and exit with status 2; OPWEAVE_DEBUG=1 shows the
traceback as well.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import textwrap
from typing import Callable, NamedTuple

from opweave import __version__, config
from opweave.cli import costs, deploy, dump, planning, serving
from opweave.cli.common import Parser, examples
from opweave.errors import Interrupted, OpWeaveError
from opweave.signals import raising_on_signals


class Command(NamedTuple):
    name: str
    summary: str                                          # `opweave --help` and the command's description
    arguments: Callable[[argparse.ArgumentParser], None]  # adds its flags
    run: Callable[[argparse.Namespace], int]              # its body: the exit status
    examples: tuple[str, ...]                             # the epilog of `opweave NAME --help`


COMMANDS = (  # `opweave --help` lists them in this order
    Command("demo", "plan gemma-3-27b on 32 H100s, then compile and run a tiny model on CPU ranks",
            planning.args_demo, planning.cmd_demo, planning.DEMO_EXAMPLES),
    Command("dump", "print a model's operator IR or partition blocks, or an artifact's plan, rank programs or memory",
            dump.args_dump, dump.cmd_dump, dump.EXAMPLES),
    Command("analyze", "cost analysis of colocated vs disaggregated decode (§3) on the cost model, with a TP scan "
                       "and Theorem 3.1/3.2's closed forms",
            costs.args_analyze, costs.cmd_analyze, costs.ANALYZE_EXAMPLES),
    Command("estimate", "TPOT, tokens/s and memory fit of colocated decode at given points, with the cost model's "
                        "terms",
            costs.args_estimate, costs.cmd_estimate, costs.ESTIMATE_EXAMPLES),
    Command("calibrate", "fit the cost model's efficiency and overhead terms per GPU type to measured decode steps; "
                         "write an override catalog",
            costs.args_calibrate, costs.cmd_calibrate, costs.CALIBRATE_EXAMPLES),
    Command("compile", "search the cheapest serving plan that meets a TPOT SLO",
            planning.args_compile, planning.cmd_compile, planning.COMPILE_EXAMPLES),
    Command("profile", "measure a model's operators and links on this machine for the planner",
            costs.args_profile, costs.cmd_profile, costs.PROFILE_EXAMPLES),
    Command("run", "run a compiled artifact: one process per rank, greedy generation",
            serving.args_run, serving.cmd_run, serving.RUN_EXAMPLES),
    Command("serve", "serve a compiled artifact over an OpenAI-compatible HTTP API (continuous batching on the "
                     "plan's ranks)",
            serving.args_serve, serving.cmd_serve, serving.SERVE_EXAMPLES),
    Command("launch-files", "write the files that start a compiled plan's ranks on a cluster: a torchrun script "
                            "per node, a Slurm batch script or a Kubernetes LeaderWorkerSet manifest",
            deploy.args_launch_files, deploy.cmd_launch_files, deploy.EXAMPLES),
)


def build_parser() -> argparse.ArgumentParser:
    """The `opweave` parser: one subparser per `COMMANDS` entry, its summary as the description
    and its examples as the epilog (printed as written, so each example stays on one line)."""
    parser = Parser(prog="opweave", description="Compiler for LLM decode serving on mixed GPU clusters.",
                    epilog=examples("opweave demo", planning.COMPILE_EXAMPLES[0], "opweave COMMAND --help"),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"opweave {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.summary, description=textwrap.fill(command.summary, 100),
                           epilog=examples(*command.examples), formatter_class=argparse.RawDescriptionHelpFormatter)
        command.arguments(p)
        p.set_defaults(func=command.run)
    return parser


_NEGATIVE = re.compile(r"-[0-9.]")


def _attach_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with `--tpot-slo -5ms` written `--tpot-slo=-5ms`, for every long option that takes a
    value: argparse reads a value starting with '-' that is not a plain number as an option
    ("expected one argument"), where the command says what is wrong with it ("must be positive")."""
    commands = [a.choices.values() for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    takes_value = {option for command in commands for p in command for a in p._actions if a.nargs is None
                   for option in a.option_strings if option.startswith("--")}
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] in takes_value and i + 1 < len(argv) and _NEGATIVE.match(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs one command. SIGINT, SIGTERM and SIGHUP end it through an exception, so that its
    cleanups run (no temporary folder, no rank process left), then print one line and return
    128 + the signal number (130, 143, 129), as a shell reports a process the signal killed."""
    with raising_on_signals():
        try:
            try:
                parser = build_parser()
                args = parser.parse_args(_attach_negative_values(parser, sys.argv[1:] if argv is None else argv))
                config.check_environment()  # each variable's value, before any work (docs/flags.md)
                return args.func(args)
            except OpWeaveError as e:
                if config.debug_enabled():
                    raise
                print(f"opweave: error: {e}", file=sys.stderr)
                return e.exit_code
            except BrokenPipeError:  # `opweave dump ... | head`
                return 0
        except (KeyboardInterrupt, Interrupted) as e:
            signum = e.signum if isinstance(e, Interrupted) else int(signal.SIGINT)
            print(f"opweave: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
            return 128 + signum
