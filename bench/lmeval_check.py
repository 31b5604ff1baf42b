"""lm-eval's loglikelihoods through `opweave serve` against lm-eval's own `hf` model: one checkpoint, one task.

A random-weight Llama checkpoint in the Hugging Face format (hidden 128, 2 layers, 4 attention heads /
2 KV heads of 32, intermediate 256, fp32, untied, rope theta 1e4, `tests/hf_fixtures.make_tiny_checkpoint`
with init std 0.1; the vocabulary is the tokenizer's: `tests/serve_fixtures.write_tokenizer`'s 320-entry
BPE, which puts BOS `<s>` in front of every encoding) is built in a temporary folder, compiled to a
one-rank colocated plan on `cpux1` (`pinned_plan(..., "colocated", [("cpu", 1, 1)], batch=4,
microbatches=1, context=256)`, as bench/serve_peer.py) and, unless --skip-tp2, to a plan whose one
stage (and so the LM head's vocabulary) is split over TP 2 on `cpux2` (`[("cpu", 2, 1)]`: the server
merges the two ranks' log-sum-exps and best tokens, docs/serve.md "Log-probabilities"); a plan the
compiler refuses is skipped and the report says why. Each plan is served in turn by
`python -m opweave serve ART --weights CKPT --tokenizer CKPT --port P` on a free port (up when
/health answers 200).

lm-eval (the venv --lmeval-venv) then runs the task `opweave_ll` (bench/lmeval/tasks: 8 questions,
2-4 choices, 25 loglikelihood requests; `--include_path bench/lmeval/tasks`, no --limit unless given:
every document) twice per plan and once on `hf`, each with `--log_samples`:

- `local-completions` against the server: `model_args model=NAME,base_url=http://127.0.0.1:P/v1/completions,
  tokenizer=CKPT,tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,num_concurrent=1,
  max_retries=1 --batch_size 1` (the server takes one prompt per request). lm-eval tokenizes each
  (context, continuation) itself and sends `{"prompt": [[ids...]], "max_tokens": 1, "logprobs": 1,
  "echo": true, "temperature": 0, "seed": 1234}`; it sums the echoed `token_logprobs` of the
  continuation and calls it greedy when each of them equals the largest value of its `top_logprobs`.
- `hf` on the same checkpoint: `--model hf --model_args pretrained=CKPT,dtype=float32 --device cpu
  --batch_size 1` (its log_softmax of transformers' logits; is_greedy: argmax equals each token).

Both add BOS: `hf` by default (the tokenizer's post-processor), `local-completions` with
add_bos_token=True; the script checks that the tokenizer has a BOS and puts it first, and that the
server counted (its `/metrics`, `opweave:prompt_tokens_total` and `opweave:request_success_total`, before
and after each run) one request and len(BOS + context + continuation) prompt tokens per loglikelihood.

The task's choices are seldom what a random model would write, so every is_greedy is False on both
sides and the greedy check says little. A second task, `opweave_ll_greedy`, is written into the work
folder: the same documents and template (`Question: {{question}}\\nAnswer:`), the choices with their
leading space (target_delimiter ""), plus per document the model's own greedy continuation of up to 4
tokens (transformers, this process; no special tokens; kept only if lm-eval's split of context +
continuation re-encodes to exactly those tokens after the context's), so those requests are greedy on
both sides. --no-greedy-task skips it.

The two runs' samples (`DIR/<model>/samples_<task>_<ts>.jsonl`: `arguments` = (context,
continuation) per request, `filtered_resps` = [loglik, is_greedy] as strings) are paired by
(doc_id, context, continuation). Printed and written to a markdown report (--out): per run the
requests, acc / acc_norm, wall time, what the server counted; per plan and task the number of pairs,
max and median |loglik difference| in nats (the worst pair named), is_greedy agreement and how many
were greedy. Exit status 1 when a max difference exceeds 1e-3 nats, an is_greedy differs, the runs'
requests do not pair up, the server's counts differ from the expected ones, or a run or server
fails; 0 otherwise.

    python bench/lmeval_check.py [--lmeval-venv /work/peers/lmeval] [--out bench/results/lmeval_check.md]
        [--limit N] [--skip-tp2] [--no-greedy-task] [--keep DIR]

Runtime on the 2-core machine: about 3 min (the checkpoint and the plans ~10 s, each server ~10 s
to start, each lm-eval run 15-30 s, most of it lm-eval's start-up).

The peer environment is not installed by this script; once:

    python3.11 -m venv /work/peers/lmeval && /work/peers/lmeval/bin/pip install torch==2.13.0 \\
        && /work/peers/lmeval/bin/pip install "lm-eval[api,hf]"

(lm-eval 0.4.13 at the time of writing). lm-eval runs offline: HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
TRANSFORMERS_OFFLINE=1 (the task's data is read from a local jsonl by its own loader). A missing venv,
or one without lm-eval's `lm_eval` script, its api extra (aiohttp, tenacity) or its hf extra
(transformers, torch): one line, exit status 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from common import RunClock, emit, header_lines  # noqa: E402
from serve_peer import Server, _cpu_model, _free_port, _get  # noqa: E402

MODEL_NAME = "lmeval-llama-tiny"
MODEL_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.1,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # <s>, </s> of serve_fixtures
TOKENIZER_VOCAB = 320  # serve_fixtures.write_tokenizer's default; the model takes the size it reaches
BATCH, CONTEXT = 4, 256
TASK_DIR = os.path.join(HERE, "lmeval", "tasks")
TASK, GREEDY_TASK = "opweave_ll", "opweave_ll_greedy"
GREEDY_TOKENS = 4
TOLERANCE = 1e-3  # nats
PLANS = (("TP 1", "cpux1", [("cpu", 1, 1)]), ("TP 2", "cpux2", [("cpu", 2, 1)]))
LMEVAL_ENV = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                  HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")


class PeerError(Exception):
    """A peer environment that cannot run: one line, exit status 2."""


# ---------------------------------------------------------------------------------------------- peer venv

_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, sys
out = {"python": sys.version.split()[0], "versions": {}, "missing": []}
for name in ("lm_eval", "torch", "transformers", "datasets", "aiohttp", "tenacity"):
    try:
        out["versions"][name] = md.version(name)
    except md.PackageNotFoundError:
        pass
    if iu.find_spec(name) is None:
        out["missing"].append(name)
print(json.dumps(out))
"""


def check_venv(venv: str) -> dict:
    venv = os.path.abspath(venv)
    python, script = os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "lm_eval")
    setup = (f'python3.11 -m venv {venv} && {venv}/bin/pip install torch==2.13.0 && '
             f'{venv}/bin/pip install "lm-eval[api,hf]"')
    if not os.path.isdir(venv):
        raise PeerError(f"--lmeval-venv {venv}: no such folder (make it: {setup})")
    if not os.access(python, os.X_OK):
        raise PeerError(f"--lmeval-venv {venv}: not a virtual environment (no bin/python)")
    if not os.access(script, os.X_OK):
        raise PeerError(f"--lmeval-venv {venv}: no bin/lm_eval (lm-eval not installed: {venv}/bin/pip install "
                        '"lm-eval[api,hf]")')
    try:
        probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=_lmeval_env())
        info = json.loads(probe.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as e:
        raise PeerError(f"--lmeval-venv {venv}: its python does not answer a probe ({type(e).__name__})") from None
    if info["missing"]:
        raise PeerError(f"--lmeval-venv {venv}: {', '.join(info['missing'])} missing (lm-eval with its api and hf "
                        f'extras: {venv}/bin/pip install "lm-eval[api,hf]")')
    info.update(venv=venv, script=script)
    return info


def _lmeval_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(LMEVAL_ENV)
    return env


# ---------------------------------------------------------------------------------------------- model, plans, tasks

def build_checkpoint(folder: str) -> dict:
    """The tokenizer, then the model with the tokenizer's vocabulary; checks that the tokenizer puts BOS first."""
    from hf_fixtures import make_tiny_checkpoint
    from safetensors import safe_open
    from serve_fixtures import write_tokenizer
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    write_tokenizer(folder, TOKENIZER_VOCAB, max_length=MODEL_CONFIG["max_position_embeddings"])
    vocab = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab_size()
    make_tiny_checkpoint("llama", folder, vocab_size=vocab, **MODEL_CONFIG)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tok.bos_token_id is None:
        raise RuntimeError("the tokenizer has no BOS token: lm-eval's two models would not add the same one")
    first = tok("Question: x").input_ids[0]
    if first != tok.bos_token_id:
        raise RuntimeError(f"the tokenizer does not put BOS ({tok.bos_token_id}) first (got {first})")
    params = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                for key in f.keys():
                    params += _numel(f.get_slice(key).get_shape())
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return {"vocab": vocab, "params": params, "bos": tok.bos_token_id, "bos_text": tok.bos_token,
            "eos": config.get("eos_token_id"), "dtype": config.get("dtype") or config.get("torch_dtype")}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def build_artifact(ckpt: str, art: str, cluster: str, owners: list[tuple]) -> dict:
    from opweave.compiler.compile import write_artifact
    from opweave.compiler.frontend import run_front_end
    from opweave.compiler.pinned import pinned_plan
    from opweave.hardware.catalog import load_catalog
    from opweave.hardware.cluster import parse_cluster

    plan = pinned_plan(run_front_end(ckpt), parse_cluster(cluster, load_catalog()), "colocated", owners,
                       batch=BATCH, microbatches=1, context=CONTEXT)
    write_artifact(art, plan)
    with open(os.path.join(art, "plan.json")) as f:
        return json.load(f)


_GREEDY_YAML = """\
# Written by bench/lmeval_check.py: opweave_ll's documents and template, each document's choices with
# their leading space plus the checkpoint's own greedy continuation (so those requests are greedy).
task: {task}
custom_dataset: !function {task}_data.load
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_GREEDY_LOADER = '''\
"""Written by bench/lmeval_check.py: reads {task}.jsonl next to this file."""
import json
import os

import datasets


def load(**kwargs):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "{task}.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({{"test": datasets.Dataset.from_list(rows)}})
'''


def write_greedy_task(ckpt: str, folder: str) -> list[dict]:
    """The opweave_ll_greedy task in `folder`; returns per document its greedy choice (or why none)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)  # <s>, </s>, <|user|>, ...
    with open(os.path.join(TASK_DIR, f"{TASK}.jsonl")) as f:
        docs = [json.loads(line) for line in f if line.strip()]
    rows, found = [], []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"  # opweave_ll.yaml's doc_to_text
        ids = tok(context).input_ids
        greedy: list[int] = []
        with torch.no_grad():
            for _ in range(GREEDY_TOKENS):
                nxt = int(model(torch.tensor([ids + greedy])).logits[0, -1].argmax())
                if nxt in special:
                    break
                greedy.append(nxt)
        choices = [" " + c for c in doc["choices"]]
        base = tok.decode(ids, skip_special_tokens=False)
        pick = None
        for k in range(len(greedy), 0, -1):  # the longest prefix that lm-eval's split gives back as is
            text = tok.decode(ids + greedy[:k], skip_special_tokens=False)[len(base):]
            if text and text not in choices and tok(context + text).input_ids == ids + greedy[:k]:
                pick = (text, k)
                break
        if pick:
            choices.append(pick[0])
            found.append({"doc_id": doc["id"], "text": pick[0], "tokens": pick[1]})
        else:
            found.append({"doc_id": doc["id"], "text": None,
                          "why": "a special token first" if not greedy else "no prefix re-encodes to itself"})
        rows.append({"id": doc["id"], "question": doc["question"], "choices": choices, "answer": doc["answer"]})
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{GREEDY_TASK}.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(folder, f"{GREEDY_TASK}.yaml"), "w") as f:
        f.write(_GREEDY_YAML.format(task=GREEDY_TASK))
    with open(os.path.join(folder, f"{GREEDY_TASK}_data.py"), "w") as f:
        f.write(_GREEDY_LOADER.format(task=GREEDY_TASK))
    return found


# ---------------------------------------------------------------------------------------------- lm-eval runs

def lmeval_argv(peer: dict, model: str, model_args: str, include_path: str, task: str, out_dir: str,
                limit: int | None) -> list[str]:
    argv = [peer["script"], "--model", model, "--model_args", model_args]
    argv += ["--device", "cpu"] if model == "hf" else []
    argv += ["--batch_size", "1", "--include_path", include_path, "--tasks", task, "--log_samples",
             "--output_path", out_dir]
    return argv + (["--limit", str(limit)] if limit is not None else [])


def api_model_args(port: int, ckpt: str) -> str:
    return (f"model={MODEL_NAME},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={ckpt},"
            "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,num_concurrent=1,max_retries=1")


def hf_model_args(ckpt: str) -> str:
    return f"pretrained={ckpt},dtype=float32"


def run_lmeval(argv: list[str], log_path: str, cwd: str, timeout: float) -> tuple[object, float]:
    """Runs one lm-eval command (its own session), logged; returns (exit status or "timeout", wall s)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=_lmeval_env(), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: object = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, time.perf_counter() - t0


def load_samples(out_dir: str, task: str) -> dict[tuple, list[tuple[float, bool]]]:
    """(doc_id, context, continuation) -> [(loglik, is_greedy), ...] from the run's samples file."""
    paths = glob.glob(os.path.join(out_dir, "*", f"samples_{task}_*.jsonl"))
    if len(paths) != 1:
        raise RuntimeError(f"{len(paths)} samples files for {task} under {out_dir}")
    out: dict[tuple, list[tuple[float, bool]]] = {}
    with open(paths[0]) as f:
        for line in f:
            s = json.loads(line)
            names = sorted(s["arguments"], key=lambda n: int(n.rsplit("_", 1)[-1]))
            if len(names) != len(s["filtered_resps"]):
                raise RuntimeError(f"doc {s['doc_id']}: {len(names)} requests, {len(s['filtered_resps'])} answers")
            for name, (ll, greedy) in zip(names, s["filtered_resps"]):
                a = s["arguments"][name]
                out.setdefault((s["doc_id"], a["arg_0"], a["arg_1"]), []).append(
                    (float(ll), str(greedy).strip().lower() == "true"))
    return out


def load_metrics(out_dir: str, task: str) -> dict:
    paths = glob.glob(os.path.join(out_dir, "*", "results_*.json"))
    if len(paths) != 1:
        return {}
    with open(paths[0]) as f:
        res = json.load(f).get("results", {}).get(task, {})
    return {"acc": res.get("acc,none"), "acc_norm": res.get("acc_norm,none")}


def server_counts(port: int) -> dict[str, float]:
    """Requests finished and prompt tokens counted by the server's /metrics ({} when absent)."""
    status, text = _get(f"http://127.0.0.1:{port}/metrics")
    if status != 200:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        if name == "opweave:prompt_tokens_total":  # (opweave_prompt_tokens_total repeats it without labels)
            out["prompt_tokens"] = out.get("prompt_tokens", 0.0) + value
        elif name == "opweave:request_success_total":
            out["requests"] = out.get("requests", 0.0) + value
    return out if len(out) == 2 else {}


def expected_prompt_tokens(tok, keys) -> int:
    """What lm-eval's local-completions sends per request: BOS + context + continuation, as its _encode_pair
    splits them (the whole string encoded with add_special_tokens=add_bos_token=True)."""
    return sum(len(tok(context + continuation).input_ids) for _, context, continuation in keys)


def compare(api: dict, hf: dict) -> dict:
    keys = sorted(set(api) | set(hf), key=lambda k: (k[0], k[2]))
    only_api, only_hf = [k for k in keys if k not in hf], [k for k in keys if k not in api]
    diffs, agree, total, greedy_api, greedy_hf = [], 0, 0, 0, 0
    worst = None
    for k in keys:
        if k in only_api or k in only_hf or len(api[k]) != len(hf[k]):
            continue
        for (la, ga), (lh, gh) in zip(api[k], hf[k]):
            d = abs(la - lh)
            diffs.append(d)
            total += 1
            agree += ga == gh
            greedy_api += ga
            greedy_hf += gh
            if worst is None or d > worst[0]:
                worst = (d, k, la, lh)
    return {"pairs": total, "only_api": len(only_api), "only_hf": len(only_hf),
            "max": max(diffs) if diffs else None, "median": statistics.median(diffs) if diffs else None,
            "agree": agree, "greedy_api": greedy_api, "greedy_hf": greedy_hf, "worst": worst}


# ---------------------------------------------------------------------------------------------- main

def _terminate(signum, frame):
    """SIGTERM/SIGINT: unwind, so the finally blocks stop the server and lm-eval (a second signal is ignored)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def stop_server(server: Server) -> str:
    """Server.stop (SIGTERM, wait); whatever interrupts it, the server's session is killed before returning."""
    try:
        return server.stop()
    finally:
        if server.proc is not None and server.proc.poll() is None:
            try:
                os.killpg(server.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.proc.wait()


def main() -> int:
    clock = RunClock.start()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lmeval-venv", default="/work/peers/lmeval", help="venv with lm-eval[api,hf] installed")
    ap.add_argument("--limit", type=int, default=None, help="lm-eval --limit (default: every document)")
    ap.add_argument("--skip-tp2", action="store_true", help="serve the one-rank plan only")
    ap.add_argument("--no-greedy-task", action="store_true", help=f"run {TASK} only, not {GREEDY_TASK}")
    ap.add_argument("--startup-timeout", type=float, default=300, help="seconds for the server's /health")
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds for one lm-eval run")
    ap.add_argument("--keep", metavar="DIR", help="build and log into DIR and keep it (default: a temporary folder)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "lmeval_check.md"))
    args = ap.parse_args()
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be at least 1, got {args.limit}")
    try:
        peer = check_venv(args.lmeval_venv)
    except PeerError as e:
        print(f"lmeval_check.py: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="lmeval_check_")
    os.makedirs(work, exist_ok=True)
    try:
        return _run(args, peer, work, clock)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _run(args, peer: dict, work: str, clock: RunClock) -> int:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from opweave.errors import OpWeaveError

    ckpt, logs = os.path.join(work, "ckpt"), os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    t0 = time.perf_counter()
    print(f"building the checkpoint in {ckpt} ...", file=sys.stderr)
    model = build_checkpoint(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    plans = []  # (label, cluster, art or None, plan or error text)
    for label, cluster, owners in PLANS:
        if label != "TP 1" and args.skip_tp2:
            continue
        art = os.path.join(work, "art_" + label.replace(" ", "").lower())
        try:
            plans.append((label, cluster, art, build_artifact(ckpt, art, cluster, owners)))
        except OpWeaveError as e:
            plans.append((label, cluster, None, f"the compiler refused it: {e}"))
    tasks = [(TASK, TASK_DIR)]
    greedy_found: list[dict] = []
    if not args.no_greedy_task:
        greedy_dir = os.path.join(work, "tasks")
        greedy_found = write_greedy_task(ckpt, greedy_dir)
        tasks.append((GREEDY_TASK, greedy_dir))
    print(f"  built in {time.perf_counter() - t0:.0f} s; plans: "
          + ", ".join(f"{p[0]} ({'ok' if p[2] else p[3]})" for p in plans), file=sys.stderr)

    runs: list[dict] = []  # one per lm-eval run
    failed = False

    def one_run(kind: str, plan_label: str, task: str, include: str, argv: list[str], out_dir: str,
                port: int | None = None) -> dict:
        tag = f"{kind}-{plan_label.replace(' ', '').lower()}-{task}" if port else f"{kind}-{task}"
        print(f"lm-eval {kind} {plan_label} {task} ...", file=sys.stderr)
        before = server_counts(port) if port else {}
        rc, wall = run_lmeval(argv, os.path.join(logs, tag + ".log"), work, args.run_timeout)
        after = server_counts(port) if port else {}
        run = {"kind": kind, "plan": plan_label, "task": task, "argv": argv, "rc": rc, "wall": wall,
               "log": os.path.join(logs, tag + ".log")}
        if rc == 0:
            try:
                run["samples"] = load_samples(out_dir, task)
                run.update(load_metrics(out_dir, task))
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                run["error"] = f"samples unreadable: {e}"
        else:
            run["error"] = f"lm-eval exit status {rc}: {_tail_lines(run['log'])}"
        if before and after:
            run["server_requests"] = after["requests"] - before["requests"]
            run["server_prompt_tokens"] = after["prompt_tokens"] - before["prompt_tokens"]
        if "samples" in run:
            run["requests"] = sum(len(v) for v in run["samples"].values())
            if port:
                run["expected_prompt_tokens"] = sum(
                    len(v) * expected_prompt_tokens(tok, [k]) for k, v in run["samples"].items())
        msg = run.get("error") or (f"{run['requests']} requests, acc {run.get('acc')}, acc_norm {run.get('acc_norm')}, "
                                   f"{wall:.0f} s")
        print(f"  {msg}", file=sys.stderr)
        return run

    for task, include in tasks:
        out_dir = os.path.join(work, "out", f"hf-{task}")
        runs.append(one_run("hf", "-", task, include,
                            lmeval_argv(peer, "hf", hf_model_args(ckpt), include, task, out_dir, args.limit), out_dir))
    servers = []
    for label, cluster, art, plan in plans:
        if art is None:
            continue
        port = _free_port()
        argv = [sys.executable, "-m", "opweave", "serve", art, "--weights", ckpt, "--tokenizer", ckpt,
                "--port", str(port), "--served-model-name", MODEL_NAME]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        server = Server(f"OpWeave {label}", argv, env, ROOT, port,
                        os.path.join(logs, f"opweave-{label.replace(' ', '').lower()}.log"))
        facts = {"label": label, "server": server}
        servers.append(facts)
        try:
            print(f"{server.name}: starting on port {port} ...", file=sys.stderr)
            try:
                server.start(args.startup_timeout)
            except RuntimeError as e:
                facts["error"] = str(e)
                failed = True
                print(f"  {e}", file=sys.stderr)
                continue
            print(f"  up after {server.startup_s:.0f} s", file=sys.stderr)
            for task, include in tasks:
                out_dir = os.path.join(work, "out", f"api-{label.replace(' ', '').lower()}-{task}")
                runs.append(one_run("local-completions", label, task, include,
                                    lmeval_argv(peer, "local-completions", api_model_args(port, ckpt), include, task,
                                                out_dir, args.limit), out_dir, port))
        finally:
            status = stop_server(server)
            print(f"{server.name}: stopped, exit status {status}", file=sys.stderr)

    comparisons = []
    for run in runs:
        if run["kind"] != "local-completions":
            continue
        ref = next(r for r in runs if r["kind"] == "hf" and r["task"] == run["task"])
        if "samples" not in run or "samples" not in ref:
            comparisons.append({"plan": run["plan"], "task": run["task"], "error": run.get("error") or ref.get("error")})
            continue
        c = compare(run["samples"], ref["samples"])
        c.update(plan=run["plan"], task=run["task"])
        c["ok"] = (c["pairs"] > 0 and not c["only_api"] and not c["only_hf"] and c["max"] <= TOLERANCE
                   and c["agree"] == c["pairs"])
        comparisons.append(c)
    for run in runs:
        if "error" in run:
            failed = True
        if run["kind"] == "local-completions" and "requests" in run:
            run["counts_ok"] = (run.get("server_requests") == run["requests"]
                                and run.get("server_prompt_tokens") == run.get("expected_prompt_tokens"))
            failed |= not run["counts_ok"]
    failed |= any(not c.get("ok") for c in comparisons) or not comparisons

    lines = _report(args, peer, work, clock, model, plans, tasks, greedy_found, runs, servers, comparisons,
                    versions={"torch": torch.__version__, "transformers": transformers.__version__})
    emit(lines, args.out)
    if args.keep:
        print(f"kept {work} (checkpoint, artifacts, tasks, lm-eval outputs, logs)", file=sys.stderr)
    return 1 if failed else 0


def _tail_lines(path: str, n: int = 2) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-400:]


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "n/a"
    return format(value, spec)


def _report(args, peer, work, clock, model, plans, tasks, greedy_found, runs, servers, comparisons,
            versions) -> list[str]:
    def rel(s: str) -> str:  # the work folder is temporary: name it $WORK
        return s.replace(work, "$WORK").replace(ROOT + os.sep, "")

    lines = header_lines("lm-eval loglikelihoods: `local-completions` on `opweave serve` vs `hf` on the same checkpoint",
                         ["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]], clock)
    v = peer["versions"]
    lines += [
        f"- peer: lm-eval {v.get('lm_eval', '?')}, venv `{peer['venv']}` (Python {peer['python']}, torch "
        f"{v.get('torch', '?')}, transformers {v.get('transformers', '?')}, datasets {v.get('datasets', '?')}); "
        f"OpWeave's env: Python {platform.python_version()}, torch {versions['torch']}, transformers "
        f"{versions['transformers']}",
        f"- CPU: {_cpu_model()}; {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))})",
        f"- work folder `$WORK` = `{work}`" + (" (kept)" if args.keep else " (temporary, removed)"), "",
        f"Model: Llama, hidden {MODEL_CONFIG['hidden_size']}, {MODEL_CONFIG['num_hidden_layers']} layers, "
        f"{MODEL_CONFIG['num_attention_heads']} attention heads / {MODEL_CONFIG['num_key_value_heads']} KV heads of "
        f"{MODEL_CONFIG['head_dim']}, intermediate {MODEL_CONFIG['intermediate_size']}, vocab {model['vocab']}, untied, "
        f"rope theta 1e4: {model['params'] / 1e6:.2f}M parameters, random weights (`tests/hf_fixtures.make_tiny_checkpoint`, "
        f"init std {MODEL_CONFIG['initializer_range']}), {model['dtype']}. Tokenizer: `tests/serve_fixtures.write_tokenizer`, "
        f"{model['vocab']} entries, BOS `{model['bos_text']}` (id {model['bos']}) put first by its post-processor.",
        f"Plans: template `colocated`, batch {BATCH}, 1 microbatch, context {CONTEXT} (`pinned_plan`); "
        + "; ".join(f"{label} on `{cluster}`: " + (f"predicted TPOT {plan.get('tpot_ms', float('nan')):.2f} ms"
                                                    if art else f"skipped, {plan}")
                    for label, cluster, art, plan in plans) + ".",
        f"Tasks: `{TASK}` (`bench/lmeval/tasks`)" + (
            f" and `{GREEDY_TASK}` (written into `$WORK/tasks`: `{TASK}`'s documents, template and choices, "
            f"target_delimiter \"\" with the choices' leading space kept, plus the checkpoint's greedy continuation of up "
            f"to {GREEDY_TOKENS} tokens for {sum(1 for g in greedy_found if g['text'])} of {len(greedy_found)} documents: "
            + ", ".join(f"doc {g['doc_id']} {json.dumps(g['text'])} ({g['tokens']} token{'s' * (g['tokens'] != 1)})"
                        if g["text"] else f"doc {g['doc_id']} none ({g['why']})" for g in greedy_found) + ")"
            if greedy_found else "") + (f"; `--limit {args.limit}`" if args.limit else "; no `--limit`: every document")
        + ".", "",
        "Commands (environment of every lm-eval run: " + " ".join(f"{k}={val}" for k, val in LMEVAL_ENV.items()
                                                                  if "OFFLINE" in k) + "):", "", "```",
    ]
    for facts in servers:
        s = facts["server"]
        lines.append(f"# {s.name} (startup {_fmt(s.startup_s, '.0f')} s, exit status after SIGTERM: {s.exit_status})")
        lines.append(rel(" ".join(shlex.quote(a) for a in s.argv)))
    for run in runs:
        lines.append(f"# {run['kind']} {'' if run['plan'] == '-' else run['plan'] + ' '}{run['task']}")
        lines.append(rel(" ".join(shlex.quote(a) for a in run["argv"])))
    lines += ["```", ""]

    lines += ["Every lm-eval run (in the order they ran; server counts: `/metrics` `opweave:request_success_total` and "
              "`opweave:prompt_tokens_total` before and after the run, against one request and len(BOS + context + "
              "continuation) tokens per loglikelihood):", "",
              "| model | plan | task | requests | acc | acc_norm | wall s | server: requests / prompt tokens (expected) |",
              "|---|---|---|---:|---:|---:|---:|---|"]
    for run in runs:
        if "error" in run:
            lines.append(f"| {run['kind']} | {run['plan']} | {run['task']} | failed: {run['error'].replace('|', '/')} "
                         f"| | | {run['wall']:.0f} | |")
            continue
        counts = "n/a"
        if run["kind"] == "local-completions":
            counts = (f"{_fmt(run.get('server_requests'), '.0f')} / {_fmt(run.get('server_prompt_tokens'), '.0f')} "
                      f"({run['requests']} / {run.get('expected_prompt_tokens', 'n/a')})"
                      + ("" if run.get("counts_ok") else " **differ**"))
        lines.append(f"| {run['kind']} | {run['plan']} | {run['task']} | {run['requests']} | {_fmt(run.get('acc'), '.3f')} | "
                     f"{_fmt(run.get('acc_norm'), '.3f')} | {run['wall']:.0f} | {counts} |")
    for facts in servers:
        if "error" in facts:
            lines.append(f"| local-completions | {facts['label']} | all | server did not start: "
                         f"{facts['error'].replace('|', '/')} | | | | |")
    lines.append("")

    lines += [f"`local-completions` on OpWeave against `hf`, paired by (doc_id, context, continuation); pass: every "
              f"request paired, max |loglik difference| <= {TOLERANCE:g} nats, every is_greedy equal:", "",
              "| plan | task | pairs | max abs diff (nats) | median abs diff (nats) | is_greedy equal | greedy (OpWeave / hf) "
              "| result |", "|---|---|---:|---:|---:|---:|---|---|"]
    for c in comparisons:
        if "error" in c:
            lines.append(f"| {c['plan']} | {c['task']} | not compared: {c['error'].replace('|', '/')} | | | | | FAIL |")
            continue
        unpaired = (f" ({c['only_api']} only in OpWeave's run, {c['only_hf']} only in hf's)"
                    if c["only_api"] or c["only_hf"] else "")
        lines.append(f"| {c['plan']} | {c['task']} | {c['pairs']}{unpaired} | {_fmt(c['max'], '.2e')} | "
                     f"{_fmt(c['median'], '.2e')} | {c['agree']}/{c['pairs']} | {c['greedy_api']} / {c['greedy_hf']} | "
                     f"{'pass' if c['ok'] else 'FAIL'} |")
    lines.append("")
    worst = [c for c in comparisons if c.get("worst")]
    if worst:
        lines += ["The largest difference of each comparison:", ""]
        for c in worst:
            d, (doc, _, cont), la, lh = c["worst"]
            lines.append(f"- {c['plan']}, {c['task']}: doc {doc}, continuation {json.dumps(cont)}: OpWeave {la:.6f}, "
                         f"hf {lh:.6f} (|diff| {d:.2e})")
        lines.append("")
    skipped = [(label, plan) for label, _, art, plan in plans if art is None]
    for label, why in skipped:
        lines += [f"{label}: not run, {why}", ""]
    if args.skip_tp2:
        lines += ["TP 2: not run (--skip-tp2).", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
