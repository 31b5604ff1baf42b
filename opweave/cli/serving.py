"""The commands of `opweave` that run a compiled artifact: `run` (one process per rank, a batch
of prompts, greedy generation) and `serve` (the ranks started once behind an OpenAI-compatible
HTTP API). Both take the same flags for how the ranks run (`rank_flags`)."""

from __future__ import annotations

import argparse
import sys

from opweave import config
from opweave.cli.common import device_arg, pages, threads, tokens
from opweave.errors import OpWeaveError

MAX_LOGPROBS = 20  # --max-logprobs' default: `opweave.kernels.logprobs.MAX_TOP_LOGPROBS` (no torch import here)

RUN_EXAMPLES = (
    "opweave run art/ --weights CKPT --prompts prompts.jsonl --json",
    "opweave run out/ --weights random --prompt-ids 1,2,3,4,5,6,7,8,9,10 --max-new-tokens 20 --trace t.json",
)
SERVE_EXAMPLES = (
    "opweave serve art/ --weights CKPT --served-model-name tiny --port 8000",
    "opweave serve art/ --weights CKPT --device cuda --replica-sets all --host 0.0.0.0 --api-key KEY",
)
WEIGHTS_HELP = "Hugging Face checkpoint folder, or 'random' (required)"


def args_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="folder written by opweave compile")
    p.add_argument("--weights", required=True, help=WEIGHTS_HELP)
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help='one {"prompt_ids": [...]}, {"prompt": "text"} or {"messages": [...]} per line '
                        "(default: none; give --prompts, --prompt-ids or both)")
    p.add_argument("--prompt-ids", help="one prompt as comma-separated token ids (default: none)")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="tokens to generate per prompt whose line sets no max_new_tokens (default %(default)s)")
    device_arg(p)
    p.add_argument("--json", action="store_true",
                   help='print {"outputs": [{"prompt_ids", "token_ids", "text"}], "stats": {rounds, round times, '
                        "CUDA graphs}} (default: a line of token ids per prompt, with its text when there is a "
                        "tokenizer)")
    p.add_argument("--tokenizer", metavar="FOLDER", help="folder with tokenizer.json / tokenizer_config.json, for "
                   "text prompts and output text (default: the --weights folder, when it has one)")
    p.add_argument("--torchrun", action="store_true", help="print the torchrun command for each node instead")
    p.add_argument("--replica-sets", default="1", metavar="N|all",
                   help="run N of the plan's replica sets at once (requests dealt round-robin; default %(default)s)")
    prefill_sets_flag(p)
    p.add_argument("--trace", metavar="FILE.json",
                   help="record what every rank did when (Chrome trace: compute, wait, send per stage and "
                        "microbatch) (default: none)")
    p.add_argument("--verify-key", metavar="KEY_FILE",
                   help="refuse the artifact unless its manifest.sig is the HMAC-SHA256 of manifest.json under "
                        "the secret in KEY_FILE (see compile --sign-key) (default: none, no signature check)")
    rank_flags(p, "end the run, naming the rank, when a rank makes no progress for this long "
                  "(default %(default)g)")


def rank_flags(p: argparse.ArgumentParser, stall_help: str) -> None:
    """The flags of how the ranks run, shared by `run` and `serve`."""
    p.add_argument("--stall-timeout", type=float, default=120.0, metavar="SECONDS", help=stall_help)
    p.add_argument("--threads", type=threads, default=None, metavar="N",
                   help="torch threads per rank (default: the cores this process may use, divided among the ranks)")
    p.add_argument("--prefill-budget", type=tokens("--prefill-budget"), default=None, metavar="TOKENS",
                   help="prompt tokens per round and microbatch, after the decoding rows' one each (default: the "
                        "plan's prefill chunk; at most its rows x chunk, what the plan's memory holds)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole: do not start prompts on the KV pages of earlier prompts with "
                        "the same first tokens (on by default where the model keeps all its state in pages)")
    p.add_argument("--kv-pages", type=pages, default=None, metavar="N",
                   help="KV pages (16 tokens each) of each replica's pool (default: every slot at the plan's context); "
                        "with fewer, requests are admitted while their pages are free and the newest is preempted "
                        "and computed again when a round runs short")


def prefill_sets_flag(p) -> None:
    p.add_argument("--prefill-sets", type=int, default=None, metavar="N",
                   help="a plan with disaggregated prefill: start N prefill sets (TP groups of its prefill pool) "
                        "beside the decode ranks; decode leaders send them prompts round-robin (default 1)")


def replica_sets(text: str, artifact: str) -> int:
    """--replica-sets N, or "all": as many as the plan places."""
    if text == "all":
        from opweave.runtime.launch import planned_replica_sets

        return planned_replica_sets(artifact)
    try:
        return int(text)
    except ValueError:
        raise OpWeaveError(f"--replica-sets must be a whole number or 'all', got {text!r}") from None


def cmd_run(args: argparse.Namespace) -> int:
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
                    trace=bool(args.trace), replica_sets=replica_sets(args.replica_sets, args.artifact),
                    stall_timeout_s=args.stall_timeout, verify_key=verify_key, threads=args.threads,
                    prefill_budget=args.prefill_budget, prefix_cache=not args.no_prefix_cache,
                    kv_pages=args.kv_pages, prefill_sets=args.prefill_sets)
    outputs, stats = run_detailed(cfg)
    print_outputs(outputs, tokenizer, args.json, _run_stats(stats))
    if args.trace:
        from opweave.runtime.timeline import write_trace

        sys.stdout.flush()
        for line in write_trace(stats, args.trace, args.artifact, device=args.device):
            print(line, file=sys.stderr)
    return 0


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


def args_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="folder written by opweave compile")
    p.add_argument("--weights", required=True, help=WEIGHTS_HELP)
    p.add_argument("--tokenizer", metavar="FOLDER",
                   help="folder with tokenizer.json / tokenizer_config.json (default: the --weights folder)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 listens on every interface (default %(default)s: this "
                        "machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on, 1..65535 (default %(default)s)")
    p.add_argument("--served-model-name", help="the model name clients use (default: the plan's model)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot before 429 (default %(default)s)")
    p.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                   help="the most top log-probabilities a request may ask for (logprobs / top_logprobs); the last "
                        "stage returns 2 + 2N numbers per row and token; -1: serve no log-probabilities, token ids "
                        "alone (default %(default)s)")
    p.add_argument("--replica-sets", default="1", metavar="N|all",
                   help="run N of the plan's replica sets (default %(default)s)")
    prefill_sets_flag(p)
    device_arg(p)
    rank_flags(p, "a rank without progress for this long stops the server, naming the rank "
                  "(default %(default)g)")
    from opweave.serve import guard  # the standard library only

    p.add_argument("--api-key", type=guard.parse_api_key, default=config.api_key(),
                   help="require 'Authorization: Bearer KEY' on every path but /health, /ping and /metrics "
                        "(default: $OPWEAVE_API_KEY; none when unset)")
    p.add_argument("--allowed-hosts", type=guard.parse_hosts, default=[], metavar="NAME,...|*",
                   help="Host header names accepted besides localhost, 127.0.0.1 and ::1 ('*': any) (default: "
                        "bound to loopback, no other name; bound elsewhere, any name)")
    p.add_argument("--max-request-bytes", type=lambda t: guard.parse_size(t, "--max-request-bytes"),
                   default=guard.MAX_REQUEST_BYTES, metavar="SIZE",
                   help="larger request bodies are refused with 413, e.g. 512k, 16m (default 4m: %(default)s bytes)")
    p.add_argument("--max-connections", type=lambda t: guard.parse_count(t, "--max-connections"),
                   default=guard.MAX_CONNECTIONS, metavar="N",
                   help="open connections beyond this are answered 503 and closed (default %(default)s)")
    p.add_argument("--header-timeout", type=lambda t: guard.parse_seconds(t, "--header-timeout"),
                   default=guard.HEADER_TIMEOUT_S, metavar="SECONDS",
                   help="close a connection whose request head takes longer (default %(default)g)")
    p.add_argument("--body-timeout", type=lambda t: guard.parse_seconds(t, "--body-timeout"),
                   default=guard.BODY_TIMEOUT_S, metavar="SECONDS",
                   help="answer 408 to a request whose body takes longer (default %(default)g)")


def cmd_serve(args: argparse.Namespace) -> int:
    """Starts the plan's ranks once and serves the OpenAI-compatible API until a signal."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise OpWeaveError(f"opweave serve needs {', '.join(missing)}: pip install 'opweave[serve]'")
    if not 0 < args.port < 65536:
        raise OpWeaveError(f"--port must be 1..65535, got {args.port}")
    if not -1 <= args.max_logprobs <= MAX_LOGPROBS:
        raise OpWeaveError(f"--max-logprobs must be -1 (none) or 0 to {MAX_LOGPROBS}, got {args.max_logprobs}")
    tokenizer_dir = args.tokenizer or (args.weights if args.weights != "random" else None)
    if tokenizer_dir is None:
        raise OpWeaveError("--weights random has no tokenizer: give --tokenizer CHECKPOINT_FOLDER")
    from opweave.serve.app import run_server
    from opweave.serve.engine import Engine
    from opweave.serve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(tokenizer_dir)
    engine = Engine(args.artifact, args.weights, args.device,
                    replica_sets=replica_sets(args.replica_sets, args.artifact), max_queue=args.max_queue,
                    stall_timeout_s=args.stall_timeout, threads=args.threads, prefill_budget=args.prefill_budget,
                    prefix_cache=not args.no_prefix_cache, kv_pages=args.kv_pages,
                    max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs, prefill_sets=args.prefill_sets)
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
