"""`opweave dump`: a model's operator IR or partition blocks, or a compiled artifact's plan, rank
programs or per-rank memory. An artifact's files are read as damaged input (one line naming the
file and what is wrong with it), never trusted to be what compile wrote."""

from __future__ import annotations

import argparse
import json
import os

from opweave.cli.common import format_arg, progress_printer, quiet_arg
from opweave.errors import OpWeaveError

EXAMPLES = (
    "opweave dump qwen3-next-80b-a3b --what ir",
    "opweave dump out/ --what plan --trace t.json --gantt g.png",
    "opweave dump out/ --what memory --quiet",
)


def args_dump(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name (e.g. gemma-3-27b), Hugging Face checkpoint folder, model.py, "
                                 "or (with --what plan|ranks|memory) an artifact folder")
    p.add_argument("--what", choices=("ir", "blocks", "plan", "ranks", "memory"), default="ir",
                   help="ir: the operator IR of one decode step; blocks: the partition blocks; of an artifact "
                        "folder, plan: its plan, ranks: each rank's program, memory: per rank the planned bytes "
                        "against what its modules allocate (default: %(default)s)")
    format_arg(p)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="override the checkpoint's dtype for the cost facts (default: the checkpoint's dtype)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="with --what plan: simulate the plan's schedule again and write its Chrome trace to FILE "
                        "(default: none)")
    p.add_argument("--gantt", metavar="FILE", default=None,
                   help="with --what plan: simulate the plan's schedule again and draw its Gantt chart (PNG) in FILE "
                        "(default: none)")
    quiet_arg(p)


def cmd_dump(args: argparse.Namespace) -> int:
    from opweave.compiler.frontend import run_front_end
    from opweave.ir.graph import format_graph, to_json
    from opweave.passes.blocks import blocks_to_json, format_blocks

    if (args.trace or args.gantt) and args.what != "plan":
        raise OpWeaveError("--trace and --gantt go with --what plan (an artifact's schedule)")
    if args.what == "plan":
        return _dump_plan(args)
    if args.what == "ranks":
        return _dump_ranks(args)
    if args.what == "memory":
        return _dump_memory(args)
    fe = run_front_end(args.model, dtype=args.dtype)
    if args.what == "ir":
        out = to_json(fe.graph) if args.format == "json" else format_graph(fe.graph)
    else:
        out = blocks_to_json(fe.blocks) if args.format == "json" else format_blocks(fe.blocks)
    print(json.dumps(out, indent=1) if args.format == "json" else out)
    return 0


def _dump_memory(args: argparse.Namespace) -> int:
    """Per rank of an artifact: planned bytes and the bytes its modules allocate (built on meta),
    with a progress line on stderr per rank (a large model's ranks take seconds each)."""
    from opweave.profile.allocated import artifact_memory, format_memory

    if not os.path.isdir(args.model) or not os.path.isfile(os.path.join(args.model, "plan.json")):
        raise OpWeaveError(f"{args.model}: no plan.json (give an artifact folder written by opweave compile)")
    try:
        ranks = artifact_memory(args.model, progress=progress_printer(args.quiet))
    except OpWeaveError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        detail = (str(e).splitlines() or [""])[0]
        raise OpWeaveError(f"{args.model}: not a readable artifact ({type(e).__name__}: {detail})") from None
    print(json.dumps({"ranks": [r.to_json() for r in ranks]}, indent=1) if args.format == "json"
          else format_memory(ranks))
    return 0


_BAD_CONTENT = (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError)
"""What parsing and printing a damaged artifact file raises: wrong or missing keys, wrong types."""


def _render_artifact_file(path: str, what: str, render) -> str:
    """`render(data)` for the JSON object in `path` (a plan or a rank program), any damage to the
    file (truncated, not JSON, not an object, keys missing or of the wrong type) as one line."""
    from opweave.models.checkpoint import require_regular_file

    require_regular_file(path, what)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise OpWeaveError(f"{path}: cannot read the {what} ({e.strerror})") from None
    except ValueError:
        raise OpWeaveError(f"{path}: the {what} is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except _BAD_CONTENT as e:
        raise OpWeaveError(f"{path}: the {what} is truncated or not JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise OpWeaveError(f"{path}: the {what} holds a JSON {type(data).__name__}, not an object")
    try:
        return render(data)
    except _BAD_CONTENT as e:
        detail = (str(e).splitlines() or [""])[0]
        raise OpWeaveError(f"{path}: not a readable {what} ({type(e).__name__}: {detail})") from None


def _dump_ranks(args: argparse.Namespace) -> int:
    from opweave.ir.program import format_program, program_from_json, program_to_json

    if not os.path.isdir(args.model) or not os.path.isfile(os.path.join(args.model, "rank_00.json")):
        raise OpWeaveError(f"{args.model}: no rank programs (give an artifact folder written by opweave compile)")
    names = sorted(n for n in os.listdir(args.model) if n.startswith("rank_") and n.endswith(".json"))
    if args.format == "json":
        parts = [_render_artifact_file(os.path.join(args.model, n), "rank program",
                                       lambda d: program_to_json(program_from_json(d))) for n in names]
        print(json.dumps(parts, indent=1))
    else:
        print("\n\n".join(_render_artifact_file(os.path.join(args.model, n), "rank program",
                                                 lambda d: format_program(program_from_json(d))) for n in names))
    return 0


def _dump_plan(args: argparse.Namespace) -> int:
    """Prints an artifact's plan; `--trace FILE` / `--gantt FILE` draw its schedule again from
    plan.json alone (the same bytes as the artifact's trace.json and gantt.png)."""
    from opweave.ir.plan import format_plan, plan_from_json, plan_to_json

    path = os.path.join(args.model, "plan.json") if os.path.isdir(args.model) else args.model
    if not os.path.lexists(path):
        raise OpWeaveError(f"{args.model}: no plan.json (give an artifact folder written by opweave compile)")
    draw = [(flag, value) for flag, value in (("--trace", args.trace), ("--gantt", args.gantt)) if value]
    if draw:
        from opweave.outputs import check_output_file
        from opweave.passes.trace_export import write_schedule

        for flag, value in draw:
            check_output_file(value, flag, inputs=(args.model, path))
        if args.trace and args.gantt and os.path.realpath(args.trace) == os.path.realpath(args.gantt):
            raise OpWeaveError("--trace and --gantt name the same file")
        plan = _render_artifact_file(path, "plan", plan_from_json)
        write_schedule(plan, args.trace, args.gantt)
    render = ((lambda d: json.dumps(plan_to_json(plan_from_json(d)), indent=1)) if args.format == "json"
              else (lambda d: format_plan(plan_from_json(d))))
    print(_render_artifact_file(path, "plan", render))
    if draw and args.format != "json":
        print("wrote " + ", ".join(value for _, value in draw))
    return 0
