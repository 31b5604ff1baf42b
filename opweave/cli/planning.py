"""The planning commands of `opweave`: `compile` (search the cheapest plan meeting a TPOT SLO and
write the artifact that runs it) and `demo` (the main job on embedded defaults: plan a real model,
then compile and run a tiny one on CPU ranks)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from opweave.cli.common import (MODEL_HELP, catalog_args, count, folder, format_arg, progress_printer, quiet_arg,
                                warn)
from opweave.errors import OpWeaveError
from opweave.ir.plan import PREFILL_CHUNK

COMPILE_EXAMPLES = (
    "opweave compile gemma-3-27b --cluster h100x32 --tpot-slo 100ms --context 128k -o out/",
    "opweave compile llama-3.1-70b --cluster h100x8+l40sx8 --tpot-slo 50ms --isl 1024 --osl 1024 --ttft-slo 2s "
    "-o art/",
)
DEMO_EXAMPLES = (
    "opweave demo",
    "opweave demo --out /tmp/opweave-demo",
)


def args_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--cluster", required=True,
                   help="e.g. h100x8+l40sx8, a100x16, h100x16@dgx+a100x16@aws-p4de, a YAML/JSON file, or local "
                        "(required)")
    p.add_argument("--tpot-slo", required=True, help="time per output token target, e.g. 50ms (required)")
    p.add_argument("--context", default=None,
                   help="context length to plan for, e.g. 32k (default: isl + osl with --isl and --osl, the "
                        "workload's longest sequence with --workload; required otherwise)")
    p.add_argument("--isl", default=None, metavar="TOKENS",
                   help="the workload's prompt tokens, e.g. 1024 (with --osl): the plan carries its TTFT, and "
                        "--context defaults to isl + osl (default: none, a decode-only plan)")
    p.add_argument("--osl", default=None, metavar="TOKENS",
                   help="the workload's output tokens, e.g. 1024 (with --isl) (default: none)")
    p.add_argument("--workload", default=None, metavar="FILE.jsonl",
                   help="the workload as JSON Lines of requests ({\"isl\": 812, \"osl\": 240}, optionally "
                        "\"count\"): planned at its mean lengths, --context defaults to its longest sequence "
                        "(default: none)")
    p.add_argument("--ttft-slo", default=None, metavar="DURATION",
                   help="mean time to first token target under the workload, e.g. 250ms, 2s (default: none)")
    p.add_argument("--rate", default=None, metavar="REQ_PER_S",
                   help="requests/s the deployment must take: the plan's TTFT is at the load this leaves each "
                        "of the fewest replica sets that take it (default: 80%% of capacity)")
    p.add_argument("--prefill", choices=("auto", "aggregated", "disaggregated"), default="auto",
                   help="how prompts are prefilled under a workload: in the decode rounds under a token budget "
                        "(aggregated), on GPUs of their own (disaggregated), or the cheaper that meets the SLOs "
                        "(auto) (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="how attention caches keys and values: in the model's dtype (auto), or in float8 e4m3 "
                        "(fp8: half a bf16 cache's memory and reads, so larger batches; scale 1, as vLLM's "
                        "--kv-cache-dtype fp8 without calibrated scales; GPUs of compute capability 8.9 or later) "
                        "(default: %(default)s)")
    p.add_argument("--prefill-chunk", default=None, metavar="TOKENS",
                   help=f"prompt tokens per sequence per step at run time (default {PREFILL_CHUNK}); sizes the "
                        "planned activation memory")
    p.add_argument("-o", "--output", required=True,
                   help="artifact folder to write: a new or empty folder, or a previous artifact (replaced) "
                        "(required)")
    p.add_argument("--sign-key", metavar="KEY_FILE",
                   help="sign the artifact: manifest.sig = HMAC-SHA256 of manifest.json under the secret in "
                        "KEY_FILE (opweave run --verify-key checks it) (default: none, unsigned)")
    p.add_argument("--force", action="store_true",
                   help="replace -o even if it holds other files (never the model's folder or one above it) "
                        "(default: refuse a folder holding anything but an artifact)")
    p.add_argument("--templates", choices=("all", "colocated", "afd", "cad"), default="all",
                   help="restrict the stage templates (baselines) (default: %(default)s)")
    p.add_argument("--objective", choices=("cost", "throughput"), default="cost",
                   help="cost: least $/Mtoken; throughput: most tokens/s on the given cluster, ties by cost; both "
                        "at the TPOT SLO (default: %(default)s)")
    p.add_argument("--fleet", action="store_true",
                   help="also plan the GPUs the plan leaves idle: further plans side by side (a fleet), "
                        "each on what the earlier ones leave, with the idle GPUs reported; the artifact "
                        "holds the first plan (compile the others with the --cluster each one names)")
    p.add_argument("--explain", action="store_true",
                   help="also print the best plan of each template family, way of serving prefill and GPU "
                        "type, and what bounds it")
    p.add_argument("--no-pareto", action="store_true", help="switch off per-owner Pareto pruning (ablation)")
    p.add_argument("--no-bnb", action="store_true", help="switch off branch-and-bound (ablation)")
    p.add_argument("--no-attention-dp", action="store_true",
                   help="leave out data-parallel attention inside expert-parallel groups (an owner whose GPUs each "
                        "run attention for their own rows, the routed experts spread over them: DeepSeek's and "
                        "SGLang's wide-EP layout, `experts: dp` in plan.json), which the search considers by default")
    p.add_argument("--expert-load", metavar="LOAD.json",
                   help="measured routing, each MoE layer's pairs per expert (opweave profile --routing): the "
                        "planner charges the busiest expert-parallel GPU's share (default: uniform routing)")
    p.add_argument("--redundant-experts", default="0", metavar="R[,R...]",
                   help="extra expert slots per GPU of expert-parallel groups to search, holding copies of the "
                        "most loaded experts (e.g. 0,1,2; default %(default)s)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="largest resident batch per replica set the search tries (default 4096, "
                        "opweave.passes.search.DEFAULT_MAX_BATCH; the grid also stops where the cluster's memory does)")
    format_arg(p)
    catalog_args(p)
    p.add_argument("--profile", metavar="PROFILE.json",
                   help="measured op latencies from opweave profile (default: none, the catalog's figures)")
    quiet_arg(p)
    p.add_argument("--allow-long-context", action="store_true",
                   help="plan a --context beyond the model's max_position_embeddings (with a warning) "
                        "(default: refused)")


def cmd_compile(args: argparse.Namespace) -> int:
    from opweave.compiler.compile import compile_model, write_artifact
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import detect_local, parse_cluster
    from opweave.ir.plan import format_plan, plan_to_json
    from opweave.passes.search import SearchOptions
    from opweave.outputs import check_artifact_dir
    from opweave.units import parse_duration, parse_tokens

    # before the search: a bad -o is reported at once, and a folder holding an input is never replaced
    check_artifact_dir(args.output, force=args.force,
                       inputs=(args.model, args.profile, args.catalog, args.sign_key, args.expert_load))
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
    catalog = load_catalog(args.catalog, prices=args.prices, warn=warn)
    progress = progress_printer(args.quiet)
    table = front_end = None
    if args.profile:  # the profile is checked against the traced graph, which the compile then reuses
        from opweave.compiler.frontend import run_front_end
        from opweave.profile import cpu_gpu_spec, load_profile

        progress("trace: tracing the decode step (torch.fx), to check the profile against it")
        front_end = run_front_end(args.model, kv_cache_dtype=args.kv_cache_dtype)
        table = load_profile(args.profile, graph=front_end.graph)
        for w in table.warnings:
            print(f"opweave: warning: {w}", file=sys.stderr)
        if table.gpu == "cpu" and "cpu" in catalog:  # --cluster cpuxN then uses the measured figures
            catalog["cpu"] = cpu_gpu_spec(table, catalog["cpu"])
    cluster = detect_local(catalog) if args.cluster == "local" else parse_cluster(args.cluster, catalog)
    if args.max_batch is not None and args.max_batch < 1:
        raise OpWeaveError(f"--max-batch must be at least 1, got {args.max_batch}")
    from opweave.units import nonnegative_list

    redundant = tuple(sorted(set(nonnegative_list(args.redundant_experts, "--redundant-experts"))))
    options = SearchOptions(templates=args.templates, pareto=not args.no_pareto, bnb=not args.no_bnb,
                            objective=args.objective, attention_dp=not args.no_attention_dp,
                            redundant_experts=redundant,
                            **({} if args.max_batch is None else {"max_batch": args.max_batch}))

    from opweave.cost.model import CostModel

    load = None
    if args.expert_load:
        from opweave.ir.experts import ExpertLoad

        load = ExpertLoad.load(args.expert_load)
    compiled = compile_model(args.model, cluster, slo, context, options,
                             cost_model=CostModel(profile=table, expert_load=load),
                             progress=progress, allow_long_context=args.allow_long_context,
                             warn=warn,
                             prefill_chunk=prefill_chunk, front_end=front_end, workload=workload,
                             kv_cache_dtype=args.kv_cache_dtype)
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
        modules = count(compiled.plan.gpus_used // max(compiled.plan.replica_sets, 1), "rank module")
        print(f"wrote {folder(args.output)} (plan.json, plan.txt, ir.txt, trace.json, gantt.png, {modules}, "
              "manifest.json, compile-info.json)")
    return 0


def args_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="opweave-demo",
                   help="folder for the two artifacts, made if missing (default: ./%(default)s)")


def cmd_demo(args: argparse.Namespace) -> int:
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
    print(f"   artifact: {folder(big)} ({count(compiled.plan.gpus_used, 'rank module')}, trace.json, gantt.png)\n",
          flush=True)

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
    print(f"   artifact: {folder(tiny)} — rerun with: opweave run {folder(tiny)} --weights random --prompt-ids 1,2,3")
    return 0
