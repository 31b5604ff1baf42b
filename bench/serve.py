"""`opweave serve` under load: a Poisson load generator against the server on CPU ranks.

A tiny Llama-style checkpoint (random weights, a small BPE tokenizer built offline) is compiled
for two CPU "GPUs" (an AFD plan: attention and FFN on their own ranks, batch 8 in 2 microbatches)
and served with `opweave serve` (its own process, one process per rank). For each arrival rate,
requests arrive as a Poisson process for `--duration` seconds; each streams a completion of
`--output` tokens (`max_tokens`; fewer when the random model emits EOS) for a
prompt of 8-32 random token ids, through the official `openai` client. Per rate: completed
requests, output tokens/s, time to first token and time per output token (p50 / p99), beside the
plan's predicted TPOT (the catalog's nominal CPU entry: a relative figure, not a calibrated one).

    python bench/serve.py [--rates 1,2,4,8] [--duration 15] [--out bench/results/serve.md]
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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from common import emit, git_commit  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def build(tmp: str) -> tuple[str, str, float]:
    """(checkpoint, artifact, predicted TPOT ms)."""
    from hf_fixtures import make_tiny_checkpoint
    from serve_fixtures import write_tokenizer

    from opweave.compiler.compile import write_artifact
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster

    ckpt = make_tiny_checkpoint("llama", os.path.join(tmp, "ckpt"), num_hidden_layers=4, vocab_size=320)
    write_tokenizer(ckpt, vocab_size=320)
    art = os.path.join(tmp, "art")
    plan = pinned_plan(run_front_end(ckpt), parse_cluster("cpux2", load_catalog()), "afd", [("cpu", 1, 1), ("cpu", 1, 1)],
                       batch=8, microbatches=2, context=256)
    write_artifact(art, plan)
    with open(os.path.join(art, "plan.json")) as f:
        return ckpt, art, json.load(f)["tpot_ms"]


SAMPLING = {"greedy": dict(temperature=0), "sampled": dict(temperature=1.0, top_p=0.9)}


async def _one(client, prompt: list[int], max_tokens: int, start: float, mode: str, seed: int) -> dict:
    t0 = time.perf_counter()
    times = []
    tokens = None
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                             seed=seed, stream_options={"include_usage": True}, **SAMPLING[mode])
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    n = len(times)
    return {"ttft": times[0] - t0 if times else None, "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
            "tokens": tokens if tokens is not None else n, "end": time.perf_counter() - start}


async def load(port: int, rate: float, duration: float, output: int, seed: int, mode: str) -> dict:
    from openai import AsyncOpenAI

    rng = random.Random(seed)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    start = time.perf_counter()
    tasks, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        prompt = [rng.randrange(6, 320) for _ in range(rng.randint(8, 32))]
        tasks.append(asyncio.create_task(_one(client, prompt, output, start, mode, len(tasks))))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    ok = [r for r in results if isinstance(r, dict) and r["ttft"] is not None]
    elapsed = max([r["end"] for r in ok] + [duration])
    ttft = [r["ttft"] * 1e3 for r in ok]
    tpot = [r["tpot"] * 1e3 for r in ok if r["tpot"] is not None]
    await client.close()
    return {"rate": rate, "mode": mode, "sent": len(tasks), "ok": len(ok), "failed": len(tasks) - len(ok),
            "tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
            "tpot_p50": _pct(tpot, 0.5), "tpot_p99": _pct(tpot, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1,2,4,8", help="requests per second, comma-separated")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    ap.add_argument("--output", type=int, default=16, help="max_tokens per request")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve.md"))
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, art, predicted = build(tmp)
        port = _free_port()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        server = subprocess.Popen([sys.executable, "-m", "opweave", "serve", art, "--weights", ckpt, "--port", str(port),
                                   "--served-model-name", "tiny", "--max-queue", "512"], env=env, cwd=ROOT,
                                  stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + 120
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
            rows = []
            for i, rate in enumerate(rates):
                for mode in SAMPLING:  # the same arrivals and prompts, greedy then sampled
                    row = asyncio.run(load(port, rate, args.duration, args.output, seed=i, mode=mode))
                    print(f"rate {rate:g}/s {mode}: {row['ok']}/{row['sent']} ok, {row['tokens_per_s']:.1f} tokens/s, "
                          f"TTFT p50 {row['ttft_p50']:.0f} ms, TPOT p50 {row['tpot_p50']:.1f} ms", file=sys.stderr)
                    rows.append(row)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                code = "killed"
    load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        "# `opweave serve` under Poisson load (CPU ranks, tiny model)", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"load average after: {load_avg}",
        f"- git commit: {git_commit()}",
        f"- command: `python bench/serve.py --rates {args.rates} --duration {args.duration:g} --output {args.output}`",
        f"- server exit status after SIGTERM: {code}", "",
        "Model: Llama-style, 4 layers, random weights, vocab 320 (BPE tokenizer built offline); plan: AFD on "
        "`cpux2` (attention rank, FFN rank), batch 8 in 2 microbatches, context 256, gloo on loopback. "
        f"Requests: prompts of 8-32 random token ids, {args.output} output tokens (fewer when the model "
        "emits EOS), each rate run twice with the same arrivals and prompts: greedy (temperature 0) and sampled on "
        "the device (temperature 1, top_p 0.9, a seed per request); streamed with the `openai` client; Poisson arrivals for "
        f"{args.duration:g} s per rate. Output tokens from each stream's `usage`; TTFT: request sent to first text; TPOT: (last - first text) / (text chunks - 1).", "",
        f"Predicted TPOT of the plan: {predicted:.2f} ms (the catalog's nominal `cpu` entry, not a profile of "
        "this machine: compare the trend, not the figure; `bench/fidelity.py` calibrates on a profile).", "",
        "| rate (req/s) | decoding | sent | ok | failed | output tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['mode']} | {r['sent']} | {r['ok']} | {r['failed']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['tpot_p50']:.1f} | {r['tpot_p99']:.1f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
