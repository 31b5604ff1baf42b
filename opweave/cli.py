"""`opweave` command line: one subcommand per job.

User errors (`OpWeaveError`) print one line and exit with status 2; OPWEAVE_DEBUG=1 shows the
traceback as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys

from opweave import __version__, config
from opweave.errors import Interrupted, OpWeaveError
from opweave.signals import raising_on_signals
from opweave.ir.plan import PREFILL_CHUNK


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        raise OpWeaveError(message)


_NEGATIVE = re.compile(r"-[0-9.]")


def _catalog_args(p: argparse.ArgumentParser) -> None:
    """--catalog and --prices, as every command that reads the GPU catalog takes them."""
    p.add_argument("--catalog", metavar="FILE", help="YAML/JSON file overriding hardware catalog fields")
    p.add_argument("--prices", metavar="NAME",
                   help="public price table applied over the catalog's prices: aws, lambda (docs/hardware.md); "
                        "GPUs it does not list keep the catalog price (a warning names them)")


def _warn(message: str) -> None:
    """A warning for the user: one line on stderr."""
    print(f"opweave: warning: {message}", file=sys.stderr)


def _progress(quiet: bool):
    """A long command's progress lines on stderr (nothing with --quiet)."""
    def progress(message: str) -> None:
        if not quiet:
            print(f"  ... {message}", file=sys.stderr, flush=True)
    return progress


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


def _cmd_dump(args: argparse.Namespace) -> int:
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


def _args_dump(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name, Hugging Face checkpoint folder, model.py, "
                                 "or (with --what plan|ranks|memory) an artifact folder")
    p.add_argument("--what", choices=("ir", "blocks", "plan", "ranks", "memory"), default="ir")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="override the checkpoint's dtype for the cost facts")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="with --what plan: simulate the plan's schedule again and write its Chrome trace to FILE")
    p.add_argument("--gantt", metavar="FILE", default=None,
                   help="with --what plan: simulate the plan's schedule again and draw its Gantt chart (PNG) in FILE")


def _dump_memory(args: argparse.Namespace) -> int:
    """Per rank of an artifact: planned bytes and the bytes its modules allocate (built on meta)."""
    from opweave.profile.allocated import artifact_memory, format_memory

    if not os.path.isdir(args.model) or not os.path.isfile(os.path.join(args.model, "plan.json")):
        raise OpWeaveError(f"{args.model}: no plan.json (give an artifact folder written by opweave compile)")
    try:
        ranks = artifact_memory(args.model)
    except OpWeaveError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        detail = (str(e).splitlines() or [""])[0]
        raise OpWeaveError(f"{args.model}: not a readable artifact ({type(e).__name__}: {detail})") from None
    print(json.dumps({"ranks": [r.to_json() for r in ranks]}, indent=1) if args.format == "json"
          else format_memory(ranks))
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from opweave.compiler.frontend import run_front_end
    from opweave.cost.analysis import analyze
    from opweave.cost.report import analysis_to_json, format_analysis, plot_analysis
    from opweave.hardware.catalog import get_gpu, load_catalog
    from opweave.units import names, parse_contexts

    if args.plot is not None:
        from opweave.outputs import check_output_file

        check_output_file(args.plot, "--plot", inputs=(args.model, args.catalog))
    contexts = parse_contexts(args.context)
    catalog = load_catalog(args.catalog, prices=args.prices,
                           warn=_warn)
    gpu_names = names(args.gpus)
    if not gpu_names:
        raise OpWeaveError("--gpus needs at least one GPU type, e.g. --gpus h100,l40s")
    gpus = [get_gpu(n, catalog) for n in gpu_names]
    if len({g.name for g in gpus}) != len(gpus):
        raise OpWeaveError(f"--gpus lists a GPU type twice: {args.gpus}")
    fe = run_front_end(args.model)
    result = analyze(fe.graph, gpus, contexts)
    if args.plot:
        plot_analysis(result, args.plot)
    print(json.dumps(analysis_to_json(result), indent=1) if args.format == "json" else format_analysis(result))
    if args.plot and args.format != "json":
        print(f"plot written to {args.plot}")
    return 0


def _args_analyze(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name, Hugging Face checkpoint folder, or model.py")
    p.add_argument("--gpus", default="h100", help="comma-separated GPU types from the catalog (default h100)")
    p.add_argument("--context", default="1k..128k",
                   help="context lengths: 32k, 4k,32k,128k, or a doubling range 1k..128k (default)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--plot", metavar="FILE.png", help="write cost and gain against context length")
    _catalog_args(p)


def _cmd_compile(args: argparse.Namespace) -> int:
    from opweave.compiler.compile import compile_model, write_artifact
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import detect_local, parse_cluster
    from opweave.ir.plan import format_plan, plan_to_json
    from opweave.passes.search import SearchOptions
    from opweave.outputs import check_artifact_dir
    from opweave.units import parse_duration, parse_tokens

    # before the search: a bad -o is reported at once, and a folder holding an input is never replaced
    check_artifact_dir(args.output, force=args.force,
                       inputs=(args.model, args.profile, args.catalog, args.sign_key))
    sign_key = None
    if args.sign_key:
        from opweave.artifact import read_key

        sign_key = read_key(args.sign_key, "--sign-key")
    slo = parse_duration(args.tpot_slo, "--tpot-slo")
    from opweave.ir.workload import planned_context, workload_from_flags

    workload = workload_from_flags(isl=args.isl, osl=args.osl, path=args.workload, ttft_slo=args.ttft_slo,
                                   rate=args.rate, prefill=args.prefill)
    context = planned_context(args.context, workload)
    prefill_chunk = PREFILL_CHUNK if args.prefill_chunk is None else parse_tokens(args.prefill_chunk, "--prefill-chunk")
    catalog = load_catalog(args.catalog, prices=args.prices,
                           warn=_warn)
    table = front_end = None
    if args.profile:  # the profile is checked against the traced graph, which the compile then reuses
        from opweave.compiler.frontend import run_front_end
        from opweave.profile import cpu_gpu_spec, load_profile

        front_end = run_front_end(args.model)
        table = load_profile(args.profile, graph=front_end.graph)
        for w in table.warnings:
            print(f"opweave: warning: {w}", file=sys.stderr)
        if table.gpu == "cpu" and "cpu" in catalog:  # --cluster cpuxN then uses the measured figures
            catalog["cpu"] = cpu_gpu_spec(table, catalog["cpu"])
    cluster = detect_local(catalog) if args.cluster == "local" else parse_cluster(args.cluster, catalog)
    if args.max_batch is not None and args.max_batch < 1:
        raise OpWeaveError(f"--max-batch must be at least 1, got {args.max_batch}")
    options = SearchOptions(templates=args.templates, pareto=not args.no_pareto, bnb=not args.no_bnb,
                            objective=args.objective,
                            **({} if args.max_batch is None else {"max_batch": args.max_batch}))

    progress = _progress(args.quiet)
    from opweave.cost.model import CostModel

    compiled = compile_model(args.model, cluster, slo, context, options, cost_model=CostModel(profile=table),
                             progress=progress, allow_long_context=args.allow_long_context,
                             warn=_warn,
                             prefill_chunk=prefill_chunk, front_end=front_end, workload=workload)
    write_artifact(args.output, compiled, force=args.force, sign_key=sign_key)
    if table is not None:
        print(f"opweave: {table.usage_summary()}", file=sys.stderr)
    fleet = None
    if args.fleet:
        from opweave.compiler.inputs import plan_space
        from opweave.passes.fleet import plan_fleet

        space = plan_space(compiled.graph, compiled.blocks, compiled.inputs)  # the space the compile searched
        fleet = plan_fleet(space, options, first=compiled.result, progress=progress)
    from opweave.compiler.explain import explain

    why = explain(compiled.inputs, compiled.graph, compiled.blocks, progress) if args.explain else None
    if args.format == "json":
        data = plan_to_json(compiled.plan) | ({} if why is None else {"explain": why.to_json()})
        if fleet is not None:
            from opweave.passes.fleet import fleet_to_json

            data = {"plan": data, "fleet": fleet_to_json(fleet)}
        print(json.dumps(data, indent=1))
    else:
        print(format_plan(compiled.plan, search_seconds=compiled.result.seconds))
        if why is not None:
            print(why.text())
        if fleet is not None:
            from opweave.passes.fleet import format_fleet

            print(format_fleet(fleet))
        print(f"wrote {args.output}/ (plan.json, plan.txt, ir.txt, trace.json, gantt.png, "
              f"{compiled.plan.gpus_used // max(compiled.plan.replica_sets, 1)} rank modules, manifest.json, "
              "compile-info.json)")
    return 0


_BAD_CONTENT = (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError)
"""What parsing and printing a damaged artifact file raises: wrong or missing keys, wrong types."""


def _args_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name, Hugging Face checkpoint folder, or model.py")
    p.add_argument("--cluster", required=True, help="e.g. h100x8+l40sx8, a100x16, a YAML/JSON file, or local")
    p.add_argument("--tpot-slo", required=True, help="time per output token target, e.g. 50ms")
    p.add_argument("--context", default=None,
                   help="context length to plan for, e.g. 32k (required unless --isl and --osl give it)")
    p.add_argument("--isl", default=None, metavar="TOKENS",
                   help="the workload's prompt tokens, e.g. 1024 (with --osl): the plan carries its TTFT, and "
                        "--context defaults to isl + osl")
    p.add_argument("--osl", default=None, metavar="TOKENS", help="the workload's output tokens, e.g. 1024 (with --isl)")
    p.add_argument("--workload", default=None, metavar="FILE.jsonl",
                   help="the workload as JSON Lines of requests ({\"isl\": 812, \"osl\": 240}, optionally "
                        "\"count\"): planned at its mean lengths, --context defaults to its longest sequence")
    p.add_argument("--ttft-slo", default=None, metavar="DURATION",
                   help="mean time to first token target under the workload, e.g. 250ms, 2s (default: none)")
    p.add_argument("--rate", default=None, metavar="REQ_PER_S",
                   help="requests/s the deployment must take: the plan's TTFT is at the load this leaves each "
                        "of the fewest replica sets that take it (default: 80%% of capacity)")
    p.add_argument("--prefill", choices=("auto", "aggregated", "disaggregated"), default="auto",
                   help="how prompts are prefilled under a workload: in the decode rounds under a token budget "
                        "(aggregated), on GPUs of their own (disaggregated), or the cheaper that meets the SLOs "
                        "(auto, default)")
    p.add_argument("--prefill-chunk", default=None, metavar="TOKENS",
                   help="prompt tokens per sequence per step at run time (default 128); sizes the "
                        "planned activation memory")
    p.add_argument("-o", "--output", required=True,
                   help="artifact folder to write: a new or empty folder, or a previous artifact (replaced)")
    p.add_argument("--sign-key", metavar="KEY_FILE",
                   help="sign the artifact: manifest.sig = HMAC-SHA256 of manifest.json under the secret in "
                        "KEY_FILE (opweave run --verify-key checks it)")
    p.add_argument("--force", action="store_true",
                   help="replace -o even if it holds other files (never the model's folder or one above it)")
    p.add_argument("--templates", choices=("all", "colocated", "afd", "cad"), default="all",
                   help="restrict the stage templates (baselines): default all")
    p.add_argument("--objective", choices=("cost", "throughput"), default="cost",
                   help="cost: least $/Mtoken (default); throughput: most tokens/s on the given cluster, "
                        "ties by cost; both at the TPOT SLO")
    p.add_argument("--fleet", action="store_true",
                   help="also plan the GPUs the plan leaves idle: further plans side by side (a fleet), "
                        "each on what the earlier ones leave, with the idle GPUs reported; the artifact "
                        "holds the first plan (compile the others with the --cluster each one names)")
    p.add_argument("--explain", action="store_true",
                   help="also print the best plan of each template family, way of serving prefill and GPU "
                        "type, and what bounds it")
    p.add_argument("--no-pareto", action="store_true", help="switch off per-owner Pareto pruning (ablation)")
    p.add_argument("--no-bnb", action="store_true", help="switch off branch-and-bound (ablation)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="largest resident batch per replica set the search tries (default 4096, "
                        "opweave.passes.search.DEFAULT_MAX_BATCH; the grid also stops where the cluster's memory does)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    _catalog_args(p)
    p.add_argument("--profile", metavar="PROFILE.json", help="measured op latencies from opweave profile")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--allow-long-context", action="store_true",
                   help="plan a --context beyond the model's max_position_embeddings (with a warning)")


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


def _cmd_run(args: argparse.Namespace) -> int:
    from opweave.runtime.launch import RunConfig, read_requests, run_detailed

    if args.torchrun:
        from opweave.runtime.entry import torchrun_commands

        if not args.prompts:
            raise OpWeaveError("--torchrun needs --prompts FILE.jsonl (every node reads it)")
        extra = ("--stall-timeout", repr(args.stall_timeout))
        extra += ("--verify-key", args.verify_key) if args.verify_key else ()
        print("\n".join(torchrun_commands(args.artifact, args.weights, args.prompts, args.max_new_tokens,
                                          extra=extra)))
        return 0
    from opweave.runtime.run_io import print_outputs, run_tokenizer
    from opweave.serve.tokenizer import Tokenizer

    tokenizer = run_tokenizer(args.tokenizer, args.weights, Tokenizer.from_folder)
    requests = read_requests(args.prompts, args.prompt_ids, args.max_new_tokens, tokenizer)
    verify_key = None
    if args.verify_key:
        from opweave.artifact import read_key

        verify_key = read_key(args.verify_key, "--verify-key")
    if args.trace is not None:
        from opweave.outputs import check_output_file

        check_output_file(args.trace, "--trace", inputs=(args.artifact, args.weights, args.prompts))
    cfg = RunConfig(artifact=args.artifact, weights=args.weights, device=args.device, requests=requests,
                    trace=bool(args.trace), replica_sets=_replica_sets(args.replica_sets, args.artifact),
                    stall_timeout_s=args.stall_timeout, verify_key=verify_key, threads=args.threads,
                    prefill_budget=args.prefill_budget, prefix_cache=not args.no_prefix_cache,
                    kv_pages=args.kv_pages)
    outputs, stats = run_detailed(cfg)
    print_outputs(outputs, tokenizer, args.json, _run_stats(stats))
    if args.trace:
        from opweave.runtime.timeline import write_trace

        sys.stdout.flush()
        for line in write_trace(stats, args.trace, args.artifact):
            print(line, file=sys.stderr)
    return 0


def _args_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="folder written by opweave compile")
    p.add_argument("--weights", required=True, help="Hugging Face checkpoint folder, or 'random'")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help='one {"prompt_ids": [...]}, {"prompt": "text"} or {"messages": [...]} per line')
    p.add_argument("--prompt-ids", help="one prompt as comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--device", default="cpu", help="cpu (one process per planned GPU) or cuda")
    p.add_argument("--json", action="store_true", help='print {"outputs": [{"prompt_ids", "token_ids", "text"}], "stats": {rounds, round times, CUDA graphs}}')
    p.add_argument("--tokenizer", metavar="FOLDER", help="folder with tokenizer.json / tokenizer_config.json, for "
                   "text prompts and output text (default: the --weights folder, when it has one)")
    p.add_argument("--torchrun", action="store_true", help="print the torchrun command for each node instead")
    p.add_argument("--replica-sets", default="1", metavar="N|all",
                   help="run N of the plan's replica sets at once (requests dealt round-robin; default 1)")
    p.add_argument("--trace", metavar="FILE.json",
                   help="record what every rank did when (Chrome trace: compute, wait, send per stage and microbatch)")
    p.add_argument("--verify-key", metavar="KEY_FILE",
                   help="refuse the artifact unless its manifest.sig is the HMAC-SHA256 of manifest.json under "
                        "the secret in KEY_FILE (see compile --sign-key)")
    _rank_flags(p, "end the run, naming the rank, when a rank makes no progress for this long (default 120)")


def _rank_flags(p: argparse.ArgumentParser, stall_help: str) -> None:
    """The flags of how the ranks run, shared by `run` and `serve`."""
    p.add_argument("--stall-timeout", type=float, default=120.0, metavar="SECONDS", help=stall_help)
    p.add_argument("--threads", type=_threads, default=None, metavar="N",
                   help="torch threads per rank (default: the cores this process may use, divided among the ranks)")
    p.add_argument("--prefill-budget", type=_budget, default=None, metavar="TOKENS",
                   help="prompt tokens per round and microbatch, after the decoding rows' one each (default: the "
                        "plan's prefill chunk; at most its rows x chunk, what the plan's memory holds)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole: do not start prompts on the KV pages of earlier prompts with "
                        "the same first tokens (on by default where the model keeps all its state in pages)")
    p.add_argument("--kv-pages", type=_pages, default=None, metavar="N",
                   help="KV pages (16 tokens each) of each replica's pool (default: every slot at the plan's context); "
                        "with fewer, requests are admitted while their pages are free and the newest is preempted "
                        "and computed again when a round runs short")


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not 1 <= n <= 4096:
        raise argparse.ArgumentTypeError(f"must be from 1 to 4096, got {n}")
    return n


def _pages(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of pages, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _isl(text: str) -> int:
    from opweave.units import parse_tokens

    try:
        return parse_tokens(text, "--isl")
    except OpWeaveError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget(text: str) -> int:
    from opweave.units import parse_tokens

    try:
        return parse_tokens(text, "--prefill-budget")
    except OpWeaveError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_stats(stats: dict) -> dict:
    """Rank 0's rounds (median wall ms over all rounds and over the decode rounds after the first
    two), every rank's CUDA-graph use and the prompt tokens the prefix caches were asked for and
    held (`prefix_cache`: queried, hit), the requests preempted when KV pages ran short, and each
    rank's bytes collapsed into huge pages (`huge_pages`, CPU ranks), for `run --json`."""
    import statistics

    rounds = stats.get("round_s", [])
    steady = rounds[2:-3] or rounds  # past start-up, before the idle rounds at the end
    return {"rounds": len(rounds), "round_ms_median": 1e3 * statistics.median(rounds) if rounds else None,
            "steady_round_ms_median": 1e3 * statistics.median(steady) if steady else None,
            "graphs": stats.get("graphs"), "prefix_cache": stats.get("prefix_cache"),
            "preemptions": stats.get("preemptions", 0), "huge_pages": stats.get("huge_pages")}


def _cmd_serve(args: argparse.Namespace) -> int:
    """Starts the plan's ranks once and serves the OpenAI-compatible API until a signal."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise OpWeaveError(f"opweave serve needs {', '.join(missing)}: pip install 'opweave[serve]'")
    if not 0 < args.port < 65536:
        raise OpWeaveError(f"--port must be 1..65535, got {args.port}")
    tokenizer_dir = args.tokenizer or (args.weights if args.weights != "random" else None)
    if tokenizer_dir is None:
        raise OpWeaveError("--weights random has no tokenizer: give --tokenizer CHECKPOINT_FOLDER")
    from opweave.serve.app import run_server
    from opweave.serve.engine import Engine
    from opweave.serve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(tokenizer_dir)
    engine = Engine(args.artifact, args.weights, args.device,
                    replica_sets=_replica_sets(args.replica_sets, args.artifact), max_queue=args.max_queue,
                    stall_timeout_s=args.stall_timeout, threads=args.threads, prefill_budget=args.prefill_budget,
                    prefix_cache=not args.no_prefix_cache, kv_pages=args.kv_pages)
    print(f"opweave: starting the ranks of {args.artifact} ...", file=sys.stderr)
    try:
        engine.start()
        print(f"opweave: serving {args.served_model_name or engine.model} on http://{args.host}:{args.port}/v1",
              file=sys.stderr)
        code = run_server(engine, tokenizer, args.served_model_name, args.host, args.port,
                          max_request_bytes=args.max_request_bytes, body_timeout_s=args.body_timeout,
                          header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                          api_key=args.api_key, allowed_hosts=tuple(args.allowed_hosts))
        if code != 0:  # the engine failed: say why, in one line (a rank that died, failed or stalled)
            why = (engine.error or "").strip().splitlines() or ["the engine stopped"]
            print(f"opweave: error: {why[0]}", file=sys.stderr)
        return code
    finally:
        engine.stop()


def _args_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="folder written by opweave compile")
    p.add_argument("--weights", required=True, help="Hugging Face checkpoint folder, or 'random'")
    p.add_argument("--tokenizer", metavar="FOLDER",
                   help="folder with tokenizer.json / tokenizer_config.json (default: the --weights folder)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model name clients use (default: the plan's model)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 429 (default 256)")
    p.add_argument("--replica-sets", default="1", metavar="N|all", help="run N of the plan's replica sets (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (one process per planned GPU) or cuda")
    _rank_flags(p, "a rank without progress for this long stops the server, naming the rank (default 120)")
    from opweave.serve import guard  # the standard library only

    p.add_argument("--api-key", type=guard.parse_api_key, default=config.api_key(),
                   help="require 'Authorization: Bearer KEY' on every path but /health, /ping and /metrics "
                        "(default: $OPWEAVE_API_KEY; none when unset)")
    p.add_argument("--allowed-hosts", type=guard.parse_hosts, default=[], metavar="NAME,...|*",
                   help="Host header names accepted besides localhost, 127.0.0.1 and ::1 ('*': any). Bound to "
                        "loopback, other names are refused by default; bound elsewhere, any is accepted unless given")
    p.add_argument("--max-request-bytes", type=lambda t: guard.parse_size(t, "--max-request-bytes"),
                   default=guard.MAX_REQUEST_BYTES, metavar="SIZE",
                   help="larger request bodies are refused with 413, e.g. 512k, 16m (default 4m)")
    p.add_argument("--max-connections", type=lambda t: guard.parse_count(t, "--max-connections"),
                   default=guard.MAX_CONNECTIONS, metavar="N",
                   help=f"open connections beyond this are answered 503 and closed (default {guard.MAX_CONNECTIONS})")
    p.add_argument("--header-timeout", type=lambda t: guard.parse_seconds(t, "--header-timeout"),
                   default=guard.HEADER_TIMEOUT_S, metavar="SECONDS",
                   help=f"close a connection whose request head takes longer (default {guard.HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=lambda t: guard.parse_seconds(t, "--body-timeout"),
                   default=guard.BODY_TIMEOUT_S, metavar="SECONDS",
                   help=f"answer 408 to a request whose body takes longer (default {guard.BODY_TIMEOUT_S:g})")


def _replica_sets(text: str, artifact: str) -> int:
    """--replica-sets N, or "all": as many as the plan places."""
    if text == "all":
        from opweave.runtime.launch import planned_replica_sets

        return planned_replica_sets(artifact)
    try:
        return int(text)
    except ValueError:
        raise OpWeaveError(f"--replica-sets must be a whole number or 'all', got {text!r}") from None


def _cmd_demo(args: argparse.Namespace) -> int:
    """The main job on embedded defaults: plan a real model on a real cluster, then compile and
    run a tiny built-in model on CPU ranks (random weights)."""
    from opweave.compiler.compile import compile_model, write_artifact
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster
    from opweave.ir.plan import format_plan
    from opweave.passes.search import SearchOptions
    from opweave.runtime.launch import RunConfig, read_requests, run

    from opweave.outputs import check_artifact_dir, check_output_folder

    check_output_folder(args.out, "--out")  # before the work: the folder, then both artifacts in it
    if os.path.isdir(args.out):
        for name in ("gemma-3-27b", "tiny-gemma3"):
            check_artifact_dir(os.path.join(args.out, name), flag="--out")
    catalog = load_catalog()
    os.makedirs(args.out, exist_ok=True)
    big = os.path.join(args.out, "gemma-3-27b")
    print("== 1. gemma-3-27b on h100x32, TPOT SLO 100 ms, context 128k", flush=True)
    compiled = compile_model("gemma-3-27b", parse_cluster("h100x32", catalog), 0.1, 131072)
    write_artifact(big, compiled)
    print(format_plan(compiled.plan))
    print(f"   artifact: {big}/ ({compiled.plan.gpus_used} rank modules, trace.json, gantt.png)\n", flush=True)

    tiny = os.path.join(args.out, "tiny-gemma3")
    print("== 2. tiny-gemma3 (built-in, random weights) on h100x2+l40sx2, run on CPU ranks", flush=True)
    compiled = compile_model("tiny-gemma3", parse_cluster("h100x2+l40sx2", catalog), 0.05, 64,
                             SearchOptions(batches=(4,), templates="afd"))
    write_artifact(tiny, compiled)
    print(format_plan(compiled.plan), flush=True)
    requests = read_requests(None, "1,2,3,4,5,6,7,8,9,10,11,12", 8) + tuple(
        r for r in read_requests(None, "42,43,44", 8))
    requests = tuple(dataclasses.replace(r, index=i) for i, r in enumerate(requests))
    outputs = run(RunConfig(artifact=tiny, weights="random", device="cpu", requests=requests))
    for r in outputs:
        print(f"   prompt {r.prompt} -> generated {r.output}")
    print(f"   artifact: {tiny}/ — rerun with: opweave run {tiny} --weights random --prompt-ids 1,2,3")
    return 0


def _args_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="opweave-demo", help="folder for the two artifacts (default ./opweave-demo)")


def _cmd_profile(args: argparse.Namespace) -> int:
    from opweave.profile.measure import profile
    from opweave.units import parse_tokens, positive_list

    progress = _progress(args.quiet)
    from opweave.outputs import check_output_file

    check_output_file(args.output, "-o", inputs=(args.model,))  # before minutes of measuring
    table = profile(args.model, args.device, batches=positive_list(args.batches, "--batches"),
                    contexts=positive_list(args.contexts, "--contexts", parse_tokens),
                    tp_degrees=positive_list(args.tp, "--tp"), progress=progress, busy_cores=args.busy_cores)
    table.save(args.output)
    for w in table.warnings:
        print(f"opweave: warning: {w}", file=sys.stderr)
    print(f"wrote {args.output}: {len(table.entries)} measured op signatures of {table.model} "
          f"on {table.gpu} ({table.device_name})")
    return 0


def _args_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in model name, Hugging Face checkpoint folder, or model.py")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.json")
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes to measure (default 1,2,4,8)")
    p.add_argument("--contexts", default="64,256,1024", help="context lengths for attention ops (default 64,256,1024)")
    p.add_argument("--tp", default="1", help="TP degrees to measure one shard at, e.g. 1,2 (default 1)")
    p.add_argument("--busy-cores", type=int, default=0, metavar="N",
                   help="CPU: keep N other cores running the decode step while ops are timed, as the ranks of "
                        "a plan that fills the machine will (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _cmd_estimate(args: argparse.Namespace) -> int:
    from opweave.compiler.frontend import run_front_end
    from opweave.cost.estimate import estimate, estimate_to_json, format_estimate
    from opweave.cost.model import CostModel
    from opweave.hardware.catalog import get_gpu, load_catalog
    from opweave.units import parse_contexts, positive_list

    tps = list(positive_list(args.tp, "--tp"))
    batches = list(positive_list(args.batch, "--batch"))
    contexts = parse_contexts(args.context)
    gpu = get_gpu(args.gpu, load_catalog(args.catalog, prices=args.prices, warn=_warn))
    graph = run_front_end(args.model).graph
    points = estimate(graph, gpu, tps, batches, contexts, CostModel(cuda_graphs=not args.eager), isl=args.isl)
    print(json.dumps(estimate_to_json(graph.model, points), indent=1) if args.format == "json"
          else format_estimate(graph.model, points))
    return 0


def _args_estimate(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in model name, Hugging Face checkpoint folder, or model.py")
    p.add_argument("--gpu", required=True, help="GPU type from the catalog, e.g. h100")
    p.add_argument("--tp", default="1", help="TP degrees, e.g. 1 or 1,2,4 (default 1)")
    p.add_argument("--batch", default="1", help="resident batches, e.g. 1,16,64 (default 1)")
    p.add_argument("--context", default="1536",
                   help="context lengths: 1536,32k or a doubling range 1k..32k (default 1536)")
    p.add_argument("--isl", type=_isl, default=None, metavar="TOKENS",
                   help="a prompt length (e.g. 1024 or 8k): each point also gets the TTFT of one such prompt "
                        "prefilled alone on its TP group (docs/calibration.md, \"Prefill\")")
    _catalog_args(p)
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--eager", action="store_true",
                   help="ops launched one by one instead of a replayed CUDA graph (eager launch overhead)")


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from opweave.profile.calibrate_prefill import calibrate_file
    from opweave.hardware.catalog import load_catalog
    from opweave.outputs import atomic_file, check_output_file

    if not args.output.lower().endswith(".json"):
        raise OpWeaveError(f"-o {args.output}: the catalog file must end in .json (--catalog reads it)")
    check_output_file(args.output, "-o", inputs=(args.measurements, args.catalog))
    entries, data, text = calibrate_file(args.measurements, load_catalog(args.catalog), not args.no_logo, args.engine)
    with atomic_file(args.output, flag="-o") as f:
        json.dump(entries, f, indent=2)
        f.write("\n")
    if args.format == "json":
        print(json.dumps(data, indent=1))
    else:
        print(text)
        print(f"wrote {args.output}: use it with --catalog {args.output} (compile, analyze, estimate)")
    return 0


def _args_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("measurements", metavar="MEASUREMENTS.csv",
                   help="columns gpu, model, tp, batch, context, tpot_ms (others ignored; engine groups rows), or "
                        "gpu, model, tp, batch, isl, prefill_ms (or ttft_ms): the prefill efficiency")
    p.add_argument("-o", "--output", required=True, metavar="CATALOG.json",
                   help="override catalog to write (give it to --catalog of compile, analyze, estimate)")
    p.add_argument("--catalog", metavar="FILE",
                   help="starting catalog: terms the rows cannot identify keep its values (default the built-in "
                        "one; 'roofline' the ideal bound)")
    p.add_argument("--engine", metavar="NAME",
                   help="fit the rows whose engine column is NAME; the file's other rows give the starting values")
    p.add_argument("--no-logo", action="store_true", help="skip the leave-one-group-out check (faster)")
    p.add_argument("--format", choices=("text", "json"), default="text")


COMMANDS = (  # name, help, its arguments, its function (`opweave --help` lists them in this order)
    ("demo", "plan gemma-3-27b on 32 H100s, then compile and run a tiny model on CPU ranks", _args_demo, _cmd_demo),
    ("dump", "print a model's operator IR or partition blocks, or an artifact's plan, rank programs or memory",
     _args_dump, _cmd_dump),
    ("analyze", "cost analysis of colocated vs disaggregated decode (§3) on the cost model, with a TP scan and "
                "Theorem 3.1/3.2's closed forms", _args_analyze, _cmd_analyze),
    ("estimate", "TPOT, tokens/s and memory fit of colocated decode at given points, with the cost model's terms",
     _args_estimate, _cmd_estimate),
    ("calibrate", "fit the cost model's efficiency and overhead terms per GPU type to measured decode steps; "
                  "write an override catalog", _args_calibrate, _cmd_calibrate),
    ("compile", "search the cheapest serving plan that meets a TPOT SLO", _args_compile, _cmd_compile),
    ("profile", "measure a model's operators and links on this machine for the planner", _args_profile, _cmd_profile),
    ("run", "run a compiled artifact: one process per rank, greedy generation", _args_run, _cmd_run),
    ("serve", "serve a compiled artifact over an OpenAI-compatible HTTP API (continuous batching on the plan's "
              "ranks)", _args_serve, _cmd_serve),
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="opweave", description="Compiler for LLM decode serving on mixed GPU clusters.")
    parser.add_argument("--version", action="version", version=f"opweave {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text, add_arguments, func in COMMANDS:
        command = sub.add_parser(name, help=text)
        add_arguments(command)
        command.set_defaults(func=func)
    return parser


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


if __name__ == "__main__":
    sys.exit(main())
