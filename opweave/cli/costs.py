"""The cost-model commands of `opweave`: `analyze` (the §3 analysis against context length),
`estimate` (colocated decode at given points, each cost term broken out), `calibrate` (fit the
model's efficiency and overhead terms to measured steps) and `profile` (measure a model's
operators and links on this machine for the planner)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from opweave.cli.common import (MODEL_HELP, catalog_args, device_arg, format_arg, progress_printer, quiet_arg,
                                tokens, warn)
from opweave.errors import OpWeaveError

ANALYZE_EXAMPLES = (
    "opweave analyze gemma-3-27b --gpus h100 --context 8k,32k,128k",
    "opweave analyze qwen3-next-80b-a3b --gpus h100,l40s --context 1k..128k --plot g.png",
    "opweave analyze llama-3.1-8b --gpus h100,a100 --context 8k --tpot-slo 100ms --plan",
)
PLAN_GPUS_PER_TYPE = 16
"""`analyze --plan` without --cluster searches this many GPUs of each --gpus type (two nodes of 8)."""
ESTIMATE_EXAMPLES = (
    "opweave estimate llama-3.1-8b --gpu h100 --tp 1,2 --batch 1,16,64 --context 1536,32k",
    "opweave estimate llama-3.1-70b --gpu h100 --tp 4,8 --batch 16 --context 8k --isl 1024 --format json",
)
CALIBRATE_EXAMPLES = (
    "opweave calibrate bench/data/decode-measurements.csv -o mine.json",
    "opweave calibrate bench/data/decode-measurements.csv -o trtllm.json --engine trtllm --catalog roofline",
)
PROFILE_EXAMPLES = (
    "opweave profile --device cpu --model tiny-gemma3 -o profile.json",
    "opweave compile tiny-gemma3 --cluster cpux2 --tpot-slo 500ms --context 256 --profile profile.json --max-batch 8 "
    "-o out/",
)


def args_analyze(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--gpus", default=None,
                   help="comma-separated GPU types from the catalog (default: h100, or the --cluster's types)")
    p.add_argument("--context", default="1k..128k",
                   help="context lengths: 32k, 4k,32k,128k, or a doubling range such as 1k..32k "
                        "(default %(default)s)")
    p.add_argument("--tpot-slo", default=None, metavar="DURATION",
                   help="time per output token target, e.g. 100ms: the two-type split's bound counts only plans "
                        "that meet it, and --plan searches for it (default: none, no latency limit; --plan needs it)")
    p.add_argument("--cluster", default=None,
                   help="the GPU pools, e.g. h100x16+a100x16@aws-p4de: their types (and each pool's network) "
                        f"are analysed, and --plan searches them (default: {PLAN_GPUS_PER_TYPE} of each --gpus type, "
                        "each on its catalog network)")
    p.add_argument("--plan", action="store_true",
                   help="also run opweave compile's search on the cluster at each context and TPOT SLO, and print "
                        "the best plan's gain over the best colocated plan beside the split's bound (seconds to "
                        "minutes per context) (default: no search)")
    format_arg(p)
    p.add_argument("--plot", metavar="FILE.png",
                   help="write cost and gain against context length to FILE.png (default: none, no plot)")
    catalog_args(p)


def _analyze_gpus(args: argparse.Namespace, catalog: dict):
    """(GPU specs to analyse, the cluster --plan searches or None): from --cluster (its pools, with
    their networks) or --gpus."""
    from opweave.hardware.catalog import get_gpu
    from opweave.hardware.cluster import parse_cluster
    from opweave.units import names

    cluster = parse_cluster(args.cluster, catalog) if args.cluster is not None else None
    if cluster is not None:
        gpus = [pool.gpu for pool in cluster.pools]
        if args.gpus is not None and {get_gpu(n, catalog).name for n in names(args.gpus)} != {g.name for g in gpus}:
            raise OpWeaveError(f"--gpus {args.gpus} names other GPU types than --cluster {args.cluster}; give one")
        return gpus, cluster
    gpu_names = names(args.gpus if args.gpus is not None else "h100")
    if not gpu_names:
        raise OpWeaveError("--gpus needs at least one GPU type, e.g. --gpus h100,l40s")
    gpus = [get_gpu(n, catalog) for n in gpu_names]
    if len({g.name for g in gpus}) != len(gpus):
        raise OpWeaveError(f"--gpus lists a GPU type twice: {args.gpus}")
    if args.plan:
        cluster = parse_cluster("+".join(f"{g.name}x{PLAN_GPUS_PER_TYPE}" for g in gpus), catalog)
    return gpus, cluster


SPLIT_TEMPLATES = ("cad", "afd")
"""The two-owner splits whose bound `analyze` reports: core attention | the rest, attention half | FFN half."""


def planner_splits(fe, templates: tuple[str, ...] = SPLIT_TEMPLATES) -> list:
    """The planner's own view of each named template on two owner slots (`SplitSpec`): its stages
    (`passes/templates.py`), round-robin slots and what the carry rule sends at each boundary
    (`passes/carry.py`), as the search costs them. A template the model has no cut for is left out."""
    from opweave.cost.split import SplitSpec
    from opweave.passes.carry import round_robin, send_bytes_per_token
    from opweave.passes.templates import build_stages, template_by_name

    out = []
    for name in templates:
        plan = build_stages(fe.blocks, template_by_name(fe.blocks, name))
        if plan.stages_per_block % 2 or len(plan.stages) < 2:
            continue
        owners = round_robin(plan, 2)
        out.append(SplitSpec.from_stages(name, fe.graph, [(st.first, st.last) for st in plan.stages], owners,
                                         send_bytes_per_token(plan, owners)))
    return out


def _describe_plan(plan) -> str:
    """e.g. "cad: hbm tp1 x3 + flop tp4 x1" (template family: each owner's GPU type, TP, replicas)."""
    return f"{plan.template_family}: " + " + ".join(f"{o.gpu} tp{o.tp} x{o.replicas}" for o in plan.owners)


def _search(args: argparse.Namespace, fe, cluster, slo_s: float, context: int):
    """The best plan and the best colocated plan of opweave compile's search (`compile_model`, the
    entry point `opweave compile` uses) at `context`, as a `SearchedPlan`."""
    from opweave.compiler.compile import compile_model
    from opweave.cost.report import SearchedPlan
    from opweave.passes.search import SearchOptions

    found = {}
    progress = progress_printer(False)
    for templates in ("all", "colocated"):
        if templates == "colocated" and not isinstance(found["all"], str) \
                and found["all"].template_family == "colocated":
            found[templates] = found["all"]  # the best plan is the best colocated one
            continue
        progress(f"searching {templates} templates at context {context} on {cluster.spec}")
        try:
            plan = compile_model(args.model, cluster, slo_s, context, SearchOptions(templates=templates),
                                 front_end=fe, allow_long_context=True, warn=warn).plan
            found[templates] = plan
        except OpWeaveError as e:
            found[templates] = str(e)
    best, col = found["all"], found["colocated"]
    return SearchedPlan(context=context, cost=None if isinstance(best, str) else best.predicted.cost_per_mtok_usd,
                        plan="" if isinstance(best, str) else _describe_plan(best),
                        gpu_types=() if isinstance(best, str) else tuple(dict.fromkeys(o.gpu for o in best.owners)),
                        colocated_cost=None if isinstance(col, str) else col.predicted.cost_per_mtok_usd,
                        colocated_plan="" if isinstance(col, str) else _describe_plan(col),
                        error="; ".join(f"{t}: {v}" for t, v in found.items() if isinstance(v, str)))


def cmd_analyze(args: argparse.Namespace) -> int:
    from opweave.compiler.frontend import run_front_end
    from opweave.cost.analysis import TP_SCAN, analyze
    from opweave.cost.report import analysis_to_json, format_analysis, format_searched, plot_analysis, \
        searched_to_json
    from opweave.cost.split import SplitLimits
    from opweave.hardware.catalog import load_catalog
    from opweave.passes.search import DEFAULT_MAX_BATCH, SearchOptions
    from opweave.units import parse_contexts, parse_duration

    if args.plot is not None:
        from opweave.outputs import check_output_file

        check_output_file(args.plot, "--plot", inputs=(args.model, args.catalog))
    contexts = parse_contexts(args.context)
    slo = parse_duration(args.tpot_slo, "--tpot-slo") if args.tpot_slo is not None else math.inf
    catalog = load_catalog(args.catalog, prices=args.prices, warn=warn)
    gpus, cluster = _analyze_gpus(args, catalog)
    if args.plan and math.isinf(slo):
        raise OpWeaveError("--plan needs --tpot-slo (the search plans for a TPOT target), e.g. --tpot-slo 100ms")
    if args.plan and len(gpus) < 2:
        raise OpWeaveError("--plan compares the search with the two-type split's bound: give two GPU types, "
                           "e.g. --gpus h100,a100")
    grid = SearchOptions()  # the bound covers the search's own grid
    limits = SplitLimits(tpot_slo_s=slo, microbatches=grid.microbatches, max_rows=DEFAULT_MAX_BATCH,
                         max_replicas=max(grid.replicas), tp_degrees=TP_SCAN)
    fe = run_front_end(args.model)
    result = analyze(fe.graph, gpus, contexts, limits=limits, splits=planner_splits(fe) if len(gpus) >= 2 else ())
    searched = [_search(args, fe, cluster, slo, s) for s in contexts] if args.plan else None
    if args.plot:
        plot_analysis(result, args.plot)
    if args.format == "json":
        data = analysis_to_json(result)
        if searched is not None:
            data["searched"] = searched_to_json(result, searched, cluster.spec)
        print(json.dumps(data, indent=1))
    else:
        print(format_analysis(result))
        if searched is not None:
            print(format_searched(result, searched, cluster.spec))
    if args.plot and args.format != "json":
        print(f"plot written to {args.plot}")
    return 0


def args_estimate(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--gpu", required=True, help="GPU type from the catalog, e.g. h100 (required)")
    p.add_argument("--tp", default="1", help="TP degrees, e.g. 1 or 1,2,4 (default %(default)s)")
    p.add_argument("--batch", default="1", help="resident batches, e.g. 1,16,64 (default %(default)s)")
    p.add_argument("--context", default="1536",
                   help="context lengths: 1536,32k or a doubling range 1k..32k (default %(default)s)")
    p.add_argument("--isl", type=tokens("--isl"), default=None, metavar="TOKENS",
                   help="a prompt length (e.g. 1024 or 8k): each point also gets the TTFT of one such prompt "
                        "prefilled alone on its TP group (docs/calibration.md, \"Prefill\") (default: none, no TTFT)")
    catalog_args(p)
    format_arg(p)
    p.add_argument("--eager", action="store_true",
                   help="ops launched one by one instead of a replayed CUDA graph (eager launch overhead) "
                        "(default: CUDA graphs)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="attention's keys and values in the model's dtype (auto) or float8 e4m3 (fp8: half a "
                        "bf16 cache's memory and reads, as compile --kv-cache-dtype) (default: %(default)s)")


def cmd_estimate(args: argparse.Namespace) -> int:
    from opweave.compiler.frontend import run_front_end
    from opweave.cost.estimate import estimate, estimate_to_json, format_estimate
    from opweave.cost.model import CostModel
    from opweave.hardware.catalog import get_gpu, load_catalog
    from opweave.units import parse_contexts, positive_list

    tps = list(positive_list(args.tp, "--tp"))
    batches = list(positive_list(args.batch, "--batch"))
    contexts = parse_contexts(args.context)
    gpu = get_gpu(args.gpu, load_catalog(args.catalog, prices=args.prices, warn=warn))
    graph = run_front_end(args.model, kv_cache_dtype=args.kv_cache_dtype).graph
    points = estimate(graph, gpu, tps, batches, contexts, CostModel(cuda_graphs=not args.eager), isl=args.isl)
    print(json.dumps(estimate_to_json(graph.model, points), indent=1) if args.format == "json"
          else format_estimate(graph.model, points))
    return 0


def args_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("measurements", metavar="MEASUREMENTS.csv",
                   help="columns gpu, model, tp, batch, context, tpot_ms (others ignored; engine groups rows), or "
                        "gpu, model, tp, batch, isl, prefill_ms (or ttft_ms): the prefill efficiency")
    p.add_argument("-o", "--output", required=True, metavar="CATALOG.json",
                   help="override catalog to write (give it to --catalog of compile, analyze, estimate) (required)")
    p.add_argument("--catalog", metavar="FILE",
                   help="starting catalog: terms the rows cannot identify keep its values (default: the built-in "
                        "one; 'roofline': the ideal bound)")
    p.add_argument("--engine", metavar="NAME",
                   help="fit the rows whose engine column is NAME; the file's other rows give the starting values "
                        "(default: fit every row)")
    p.add_argument("--no-logo", action="store_true",
                   help="skip the leave-one-group-out check (faster) (default: the check runs)")
    format_arg(p)
    quiet_arg(p)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from opweave.profile.calibrate_prefill import calibrate_file
    from opweave.hardware.catalog import load_catalog
    from opweave.outputs import atomic_file, check_output_file

    if not args.output.lower().endswith(".json"):
        raise OpWeaveError(f"-o {args.output}: the catalog file must end in .json (--catalog reads it)")
    check_output_file(args.output, "-o", inputs=(args.measurements, args.catalog))
    entries, data, text = calibrate_file(args.measurements, load_catalog(args.catalog), not args.no_logo, args.engine,
                                         progress=progress_printer(args.quiet))
    with atomic_file(args.output, flag="-o") as f:
        json.dump(entries, f, indent=2)
        f.write("\n")
    if args.format == "json":
        print(json.dumps(data, indent=1))
    else:
        print(text)
        print(f"wrote {args.output}: use it with --catalog {args.output} (compile, analyze, estimate)")
    return 0


def args_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"{MODEL_HELP} (required)")
    device_arg(p)
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.json",
                   help="profile file to write, for compile --profile (required)")
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes to measure (default %(default)s)")
    p.add_argument("--contexts", default="64,256,1024",
                   help="context lengths for attention ops (default %(default)s)")
    p.add_argument("--tp", default="1", help="TP degrees to measure one shard at, e.g. 1,2 (default %(default)s)")
    p.add_argument("--busy-cores", type=int, default=0, metavar="N",
                   help="CPU: keep N other cores running the decode step while ops are timed, as the ranks of "
                        "a plan that fills the machine will (default %(default)s)")
    p.add_argument("--routing", metavar="PROMPTS.jsonl",
                   help="instead of timing ops: run these prompts (run's JSONL lines) through the checkpoint "
                        "--model on CPU and write each MoE layer's routed pairs per expert, for compile "
                        "--expert-load (default: none, ops are timed)")
    p.add_argument("--tokenizer", metavar="FOLDER",
                   help="with --routing: the tokenizer of text prompts (default: the checkpoint's)")
    quiet_arg(p)


def _profile_routing(args: argparse.Namespace) -> int:
    import json

    from opweave.outputs import check_output_file
    from opweave.profile.routing import measure_expert_load
    from opweave.runtime.run_io import read_prompts, run_tokenizer
    from opweave.serve.tokenizer import Tokenizer

    check_output_file(args.output, "-o", inputs=(args.model, args.routing))
    tokenizer = run_tokenizer(args.tokenizer, args.model, Tokenizer.from_folder)
    requests = read_prompts(args.routing, 1, tokenizer)
    load = measure_expert_load(args.model, [r.prompt for r in requests], progress_printer(args.quiet))
    from opweave.outputs import atomic_file

    with atomic_file(args.output, flag="-o") as f:
        f.write(json.dumps(load.to_json(), indent=1) + "\n")
    print(f"wrote {args.output}: routed pairs of {len(load.counts)} MoE layers over {load.tokens} tokens "
          f"of {len(requests)} prompts")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    if args.routing:
        return _profile_routing(args)
    from opweave.profile.measure import profile
    from opweave.units import parse_tokens, positive_list

    progress = progress_printer(args.quiet)
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
