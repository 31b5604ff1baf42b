"""The cost-model commands of `opweave`: `analyze` (the §3 analysis against context length),
`estimate` (colocated decode at given points, each cost term broken out), `calibrate` (fit the
model's efficiency and overhead terms to measured steps) and `profile` (measure a model's
operators and links on this machine for the planner)."""

from __future__ import annotations

import argparse
import json
import sys

from opweave.cli.common import (MODEL_HELP, catalog_args, device_arg, format_arg, progress_printer, quiet_arg,
                                tokens, warn)
from opweave.errors import OpWeaveError

ANALYZE_EXAMPLES = (
    "opweave analyze gemma-3-27b --gpus h100 --context 8k,32k,128k",
    "opweave analyze qwen3-next-80b-a3b --gpus h100,l40s --context 1k..128k --plot g.png",
)
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
    "opweave compile tiny-gemma3 --cluster cpux2 --tpot-slo 500ms --context 256 --profile profile.json -o out/",
)


def args_analyze(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--gpus", default="h100", help="comma-separated GPU types from the catalog (default %(default)s)")
    p.add_argument("--context", default="1k..128k",
                   help="context lengths: 32k, 4k,32k,128k, or a doubling range such as 1k..32k "
                        "(default %(default)s)")
    format_arg(p)
    p.add_argument("--plot", metavar="FILE.png",
                   help="write cost and gain against context length to FILE.png (default: none, no plot)")
    catalog_args(p)


def cmd_analyze(args: argparse.Namespace) -> int:
    from opweave.compiler.frontend import run_front_end
    from opweave.cost.analysis import analyze
    from opweave.cost.report import analysis_to_json, format_analysis, plot_analysis
    from opweave.hardware.catalog import get_gpu, load_catalog
    from opweave.units import names, parse_contexts

    if args.plot is not None:
        from opweave.outputs import check_output_file

        check_output_file(args.plot, "--plot", inputs=(args.model, args.catalog))
    contexts = parse_contexts(args.context)
    catalog = load_catalog(args.catalog, prices=args.prices, warn=warn)
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
    graph = run_front_end(args.model).graph
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


def cmd_calibrate(args: argparse.Namespace) -> int:
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
    quiet_arg(p)


def cmd_profile(args: argparse.Namespace) -> int:
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
