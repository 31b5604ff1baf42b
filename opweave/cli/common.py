"""What the subcommands of `opweave` share: the parser class (argparse's errors as one line, exit
2), the flags several commands take with one spelling and one help text (`--catalog`/`--prices`,
`--device`, `--format`, `--quiet`), the `type=` validators of numeric flags, and the warning and
progress lines on stderr."""

from __future__ import annotations

import argparse
import os
import sys

from opweave.errors import OpWeaveError


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        raise OpWeaveError(message)


DEVICES = ("cpu", "cuda")
DEVICE_HELP = ("where the work runs: cpu (this machine's cores; run and serve start one process per planned "
               "GPU) or cuda (CUDA devices: one per rank for run and serve, the first one for profile) "
               "(default: %(default)s)")
MODEL_HELP = "built-in model name (e.g. gemma-3-27b), Hugging Face checkpoint folder, or model.py"


def catalog_args(p: argparse.ArgumentParser) -> None:
    """--catalog and --prices, as every command that reads the GPU catalog takes them."""
    p.add_argument("--catalog", metavar="FILE",
                   help="YAML/JSON file overriding hardware catalog fields, or 'roofline' for the ideal bound "
                        "(default: the built-in catalog, opweave/hardware/catalog.json)")
    p.add_argument("--prices", metavar="NAME",
                   help="public price table applied over the catalog's prices: aws, lambda (docs/hardware.md); "
                        "GPUs it does not list keep the catalog price (a warning names them) (default: none, "
                        "the catalog's prices: AWS on-demand)")


def device_arg(p: argparse.ArgumentParser) -> None:
    """--device, with the same choices, default and help on every command that computes."""
    p.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)


def format_arg(p: argparse.ArgumentParser) -> None:
    """--format text|json, the output of every command that prints a report."""
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: a readable report; json: the same figures as one JSON document on stdout "
                        "(default: %(default)s)")


def quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (default: progress shown)")


def examples(*lines: str) -> str:
    """A subcommand's epilog: realistic command lines, printed as written."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def folder(path: str) -> str:
    """A folder as printed: normalised, with one trailing separator (`out/` whether the user
    wrote `out`, `out/` or `out//`)."""
    return os.path.join(os.path.normpath(path), "")


def count(n: int, word: str, plural: str | None = None) -> str:
    """`n` and `word`, plural unless `n` is 1: "1 rank module", "18 rank modules"."""
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def warn(message: str) -> None:
    """A warning for the user: one line on stderr."""
    print(f"opweave: warning: {message}", file=sys.stderr)


def progress_printer(quiet: bool):
    """A long command's progress lines on stderr (nothing with --quiet)."""
    def progress(message: str) -> None:
        if not quiet:
            print(f"  ... {message}", file=sys.stderr, flush=True)
    return progress


def threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not 1 <= n <= 4096:
        raise argparse.ArgumentTypeError(f"must be from 1 to 4096, got {n}")
    return n


def pages(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of pages, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def tokens(flag: str):
    """A `type=` for a token count such as 1024 or 8k (`units.parse_tokens`), naming `flag` in its error."""
    def parse(text: str) -> int:
        from opweave.units import parse_tokens

        try:
            return parse_tokens(text, flag)
        except OpWeaveError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def tcp_port(text: str) -> int:
    """A TCP port flag's value, 1..65535 (argparse's one-line error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {value}")
    return value
