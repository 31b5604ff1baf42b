"""Traffic-planning fidelity: a plan's predicted TTFT, TPOT and throughput under Poisson arrivals
against `opweave serve` measured on this machine's CPU ranks.

A Llama-style checkpoint (4 layers, hidden 512, float32, random weights, a small BPE tokenizer
built offline) is profiled on this machine (`opweave profile`, one thread), then compiled with a
workload (`--isl ISL --osl OSL --profile PROFILE`, and `--rate R` for each load: the plan's TTFT is
predicted at the load the rate leaves) in two ways: aggregated (`--prefill aggregated` for
`cpux1`: one rank computes prompts and decodes) and disaggregated (`--prefill disaggregated` for
`cpux2`: one decode rank, one prefill rank, each on its core). Each plan is served
(`opweave serve --threads 1`) and driven by Poisson arrivals at that rate for
`--duration` seconds: prompts of exactly ISL random token ids, OSL output tokens each
(`ignore_eos`), greedy, streamed through the official `openai` client. Per load: predicted and
measured TTFT (mean and p99), TPOT (mean at the load, and the p99 round against the measured
p99 of the inter-token gaps) and output tokens/s, and the mean absolute error over them.

    python bench/traffic_fidelity.py [--loads 0.4,0.75] [--modes aggregated,disaggregated] [--duration 60]
                                     [--out bench/results/traffic_fidelity.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from common import emit, git_commit  # noqa: E402
from serve import _free_port, _pct  # noqa: E402

MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=320, max_position_embeddings=1024)
ISL, OSL, MAX_BATCH = 64, 32, 8


def build(tmp: str) -> tuple[str, str]:
    """(checkpoint, profile) of this machine."""
    from hf_fixtures import make_tiny_checkpoint
    from serve_fixtures import write_tokenizer

    from opweave.profile.measure import profile

    ckpt = make_tiny_checkpoint("llama", os.path.join(tmp, "ckpt"), **MODEL)
    write_tokenizer(ckpt, vocab_size=MODEL["vocab_size"])
    path = os.path.join(tmp, "profile.json")
    profile(ckpt, "cpu", batches=(1, 2, 4, 8), contexts=(64, 128), measure_links=False).save(path)
    return ckpt, path


CLUSTERS = {"aggregated": "cpux1", "disaggregated": "cpux2"}


def compile_plan(ckpt: str, prof: str, out: str, rate: float | None, mode: str = "aggregated") -> dict:
    from opweave.cli import main

    args = ["compile", ckpt, "--cluster", CLUSTERS[mode], "--tpot-slo", "10s", "--isl", str(ISL), "--osl", str(OSL),
            "--prefill", mode, "--profile", prof, "--max-batch", str(MAX_BATCH), "-o", out, "--force",
            "--quiet"] + ([] if rate is None else ["--rate", f"{rate:.6g}"])
    if main(args) != 0:
        raise SystemExit("compile failed")
    with open(os.path.join(out, "plan.json")) as f:
        return json.load(f)


async def _one(client, prompt: list[int], start: float) -> dict:
    t0 = time.perf_counter()
    times = []
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=OSL, stream=True, temperature=0,
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    n = len(times)
    return {"ttft": times[0] - t0 if times else None, "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
            "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": n, "end": time.perf_counter() - start}


async def drive(port: int, rate: float, duration: float, seed: int) -> dict:
    from openai import AsyncOpenAI

    rng = random.Random(seed)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    tasks, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        prompt = [rng.randrange(6, MODEL["vocab_size"]) for _ in range(ISL)]
        tasks.append(asyncio.create_task(_one(client, prompt, start)))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    ok = [r for r in results if isinstance(r, dict) and r["ttft"] is not None]
    elapsed = max([r["end"] for r in ok] + [duration])
    ttft = [r["ttft"] * 1e3 for r in ok]
    tpot = [r["tpot"] * 1e3 for r in ok if r["tpot"] is not None]
    gaps = [g * 1e3 for r in ok for g in r["gaps"]]
    return {"sent": len(tasks), "ok": len(ok), "tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"), "ttft_p99": _pct(ttft, 0.99),
            "tpot_mean": statistics.fmean(tpot) if tpot else float("nan"), "itl_p99": _pct(gaps, 0.99),
            "itl_max": max(gaps, default=float("nan"))}


def serve_and_drive(ckpt: str, art: str, rate: float, duration: float, seed: int) -> dict:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen([sys.executable, "-m", "opweave", "serve", art, "--weights", ckpt, "--port", str(port),
                               "--served-model-name", "tiny", "--threads", "1", "--max-queue", "4096"], env=env,
                              cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server did not start: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
        asyncio.run(drive(port, rate, min(5.0, duration), seed + 1000))   # warm-up, not counted
        return asyncio.run(drive(port, rate, duration, seed))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="0.4,0.75", help="arrival rates as shares of the plan's predicted capacity "
                    "(below 0.8: at more, `--rate` plans a second replica set)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per load")
    ap.add_argument("--modes", default="aggregated,disaggregated", help="how prefill is served")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "traffic_fidelity.md"))
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    modes = args.modes.split(",")
    if any(m not in CLUSTERS for m in modes):
        raise SystemExit(f"--modes: each of {', '.join(CLUSTERS)}")
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, prof = build(tmp)
        for mode in modes:
            base = compile_plan(ckpt, prof, os.path.join(tmp, f"base-{mode}"), None, mode)
            capacity = base["prefill"]["requests_per_s"]
            for i, load in enumerate(loads):
                art = os.path.join(tmp, f"art-{mode}-{i}")
                plan = compile_plan(ckpt, prof, art, load * capacity, mode)
                measured = serve_and_drive(ckpt, art, load * capacity, args.duration, seed=i)
                pre = plan["prefill"]
                predicted = {"ttft_mean": plan["ttft_ms"], "ttft_p99": plan["ttft_p99_ms"],
                             "tpot_mean": pre["tpot_at_load_ms"], "itl_p99": plan["tpot_p99_ms"],
                             "tokens_per_s": load * capacity * OSL}
                print(f"{mode}, load {load:g}: predicted {predicted}, measured {measured}", file=sys.stderr)
                rows.append((mode, load, capacity, plan, predicted, measured))
    keys = ("ttft_mean", "ttft_p99", "tpot_mean", "itl_p99", "tokens_per_s")
    names = {"ttft_mean": "TTFT mean ms", "ttft_p99": "TTFT p99 ms", "tpot_mean": "TPOT mean ms",
             "itl_p99": "inter-token gap p99 ms (predicted: the p99 round)",
             "tokens_per_s": "output tokens/s"}
    errors = {k: [] for k in keys}
    lines = ["# Traffic-planning fidelity: predicted against `opweave serve` under Poisson arrivals (CPU ranks)", "",
             f"- date: {started:%Y-%m-%d %H:%M UTC}",
             f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; load "
             f"average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"- git commit: {git_commit()}",
             f"- command: `python bench/traffic_fidelity.py --loads {args.loads} --modes {args.modes} "
             f"--duration {args.duration:g}`", "",
             f"Model: Llama-style, 4 layers, hidden 512, float32, random weights; profiled on this machine, compiled "
             f"with `--isl {ISL} --osl {OSL} --max-batch {MAX_BATCH} --rate R` and `--prefill aggregated` for `cpux1` "
             "(one rank) or `--prefill disaggregated` for `cpux2` (a decode rank and a prefill rank, each on its core); "
             "served with one thread per rank; prompts of exactly ISL random ids, OSL tokens each (ignore_eos), greedy, "
             "streamed with the `openai` client after a 5 s warm-up. Measured TTFT: request sent to first text; "
             "TPOT: per request (last - first text) / (tokens - 1), its mean over requests; inter-token gaps: "
             "every gap between two streamed tokens.", ""]
    for mode, load, capacity, plan, predicted, measured in rows:
        pre = plan["prefill"]
        how = (f"token budget {pre['token_budget']}" if mode == "aggregated" else
               "prefill on " + ", ".join(f"{o['replicas']}x {o['gpu']} tp{o['tp']}" for o in pre["owners"]))
        lines += [f"## {mode.capitalize()}, load {load:g} of the predicted capacity ({load * capacity:.3g} requests/s)",
                  "", f"Plan: batch {plan['batch']}, {how}, predicted capacity "
                  f"{pre['requests_per_s']:.3g} requests/s; {measured['ok']}/{measured['sent']} requests completed.", "",
                  "| figure | predicted | measured | error |", "|---|---:|---:|---:|"]
        for k in keys:
            err = predicted[k] / measured[k] - 1 if measured[k] else float("nan")
            errors[k].append(abs(err))
            lines.append(f"| {names[k]} | {predicted[k]:.4g} | {measured[k]:.4g} | {err:+.0%} |")
        lines += [f"| longest inter-token gap ms (not compared) | | {measured['itl_max']:.4g} | |", ""]
    by_mode = {m: [abs(p[k] / ms[k] - 1) for mm, _, _, _, p, ms in rows if mm == m for k in keys if ms[k]]
               for m in modes}
    every = [e for k in keys for e in errors[k] if e == e]
    lines.append(f"Mean absolute error over every figure and load: {statistics.fmean(every):.0%} "
                 f"(TTFT {statistics.fmean(errors['ttft_mean'] + errors['ttft_p99']):.0%}, TPOT mean "
                 f"{statistics.fmean(errors['tpot_mean']):.0%}, p99 round {statistics.fmean(errors['itl_p99']):.0%}, "
                 "throughput "
                 f"{statistics.fmean(errors['tokens_per_s']):.0%}); "
                 + ", ".join(f"{m} {statistics.fmean(e):.0%}" for m, e in by_mode.items() if e) + ".")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
