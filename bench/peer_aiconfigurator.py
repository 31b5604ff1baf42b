"""OpWeave's planner beside NVIDIA's AIConfigurator (a peer planner) on the same settings.

For each setting (model, GPU type and count, ISL/OSL, TPOT and TTFT targets) it runs:

- AIConfigurator's `cli default` search (its best aggregated and best disaggregated configuration
  and which of the two it chooses), in AIConfigurator's own venv through `bench/aic_runner.py`
  (the same call as the `aiconfigurator cli default ...` line it records);
- `python -m opweave compile MODEL --cluster ... --isl --osl --tpot-slo --ttft-slo --prefill MODE`
  for MODE = aggregated, disaggregated and auto (OpWeave's choice), reading each `plan.json`;

and prints, per setting, one table: each system's plan (mode, GPUs, parallelism, batch), its
tokens/s/GPU, TTFT and TPOT as that system predicts them, and the ratio OpWeave/AIConfigurator of
tokens/s/GPU; then AIConfigurator's best aggregated configuration priced in OpWeave's cost model
(`opweave.compiler.pinned.pinned_plan`, and `passes/traffic.py` at AIConfigurator's context-token
budget) where OpWeave can express it, and OpWeave's aggregated plan priced by AIConfigurator's
`cli estimate` (agg) where AIConfigurator can express it. With `--out` it also writes the report
as markdown. Both tools only plan: nothing runs on a GPU.

AIConfigurator is never a dependency of OpWeave. Set its venv up once (no torch needed):
    python3.11 -m venv /work/peers/aic && /work/peers/aic/bin/pip install aiconfigurator==0.12.0
Run (minutes; AIConfigurator's raw JSON answers are cached under --cache, default
/tmp/peer_aiconfigurator, so a re-run reuses them unless --refresh):
    python bench/peer_aiconfigurator.py --out bench/results/peer_aiconfigurator.md
    python bench/peer_aiconfigurator.py --settings llama70b-loose,qwen3-moe
The model configs are OpWeave's built-in Hugging Face configs (`opweave/models/configs/`), which
aic_runner.py copies into a local folder as config.json (AIConfigurator cannot download here).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from opweave.compiler.frontend import run_front_end  # noqa: E402
from opweave.compiler.inputs import plan_space  # noqa: E402
from opweave.compiler.pinned import pinned_plan  # noqa: E402
from opweave.errors import OpWeaveError  # noqa: E402
from opweave.hardware.catalog import load_catalog  # noqa: E402
from opweave.hardware.cluster import parse_cluster  # noqa: E402
from opweave.ir.workload import Workload  # noqa: E402
from opweave.passes.space import Evaluator  # noqa: E402
from opweave.passes.traffic import TrafficModel  # noqa: E402

DEFAULT_AIC = "/work/peers/aic/bin/aiconfigurator"
DEFAULT_CACHE = "/tmp/peer_aiconfigurator"
AIC_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    model: str          # OpWeave built-in name (opweave/models/configs/<model>.json)
    gpu: str            # OpWeave catalog GPU
    aic_system: str     # AIConfigurator system
    gpus: int
    isl: int
    osl: int
    tpot_ms: float
    ttft_ms: float
    kv_cache_dtype: str = "auto"   # OpWeave's --kv-cache-dtype (AIConfigurator picks its own)
    attention_dp: bool = False     # OpWeave with data-parallel attention in expert groups (its default); False:
                                   # --no-attention-dp, the plan space without it

    @property
    def cluster(self) -> str:
        return f"{self.gpu}x{self.gpus}"

    @property
    def title(self) -> str:
        return (f"{self.model}, {self.gpus}x {self.gpu.upper()} ({self.aic_system} / {self.cluster}), "
                f"ISL/OSL {self.isl}/{self.osl}, TPOT <= {self.tpot_ms:g} ms, TTFT <= {self.ttft_ms:g} ms"
                + ("" if self.kv_cache_dtype == "auto" else f", OpWeave --kv-cache-dtype {self.kv_cache_dtype}")
                + ("" if self.attention_dp or self.model.startswith("llama") else ", OpWeave --no-attention-dp"))


SETTINGS = {s.name: s for s in (
    Setting("llama70b-loose", "llama-3.1-70b", "h100", "h100_sxm", 8, 1024, 1024, 50, 5000),
    Setting("llama70b-tight", "llama-3.1-70b", "h100", "h100_sxm", 8, 1024, 1024, 50, 300),
    Setting("qwen3-moe", "qwen3-30b-a3b", "h200", "h200_sxm", 16, 1024, 1024, 30, 5000),
    Setting("deepseek-v3", "deepseek-v3", "h200", "h200_sxm", 16, 1024, 1024, 50, 5000),
    # AIConfigurator serves DeepSeek-V3's FP8 checkpoint with an FP8 KV cache: OpWeave with one too
    Setting("deepseek-v3-fp8kv", "deepseek-v3", "h200", "h200_sxm", 16, 1024, 1024, 50, 5000, "fp8"),
    # data-parallel attention inside the expert group, as AIConfigurator's MoE plans (OpWeave's default)
    Setting("qwen3-moe-dp", "qwen3-30b-a3b", "h200", "h200_sxm", 16, 1024, 1024, 30, 5000, attention_dp=True),
    Setting("deepseek-v3-fp8kv-dp", "deepseek-v3", "h200", "h200_sxm", 16, 1024, 1024, 50, 5000, "fp8",
            attention_dp=True),
)}


# --------------------------------------------------------------------------- AIConfigurator side


def aic_python(aic_bin: str) -> str:
    """The interpreter of the venv that holds the `aiconfigurator` binary."""
    return os.path.join(os.path.dirname(os.path.abspath(aic_bin)), "python")


def aic_request(aic_bin: str, request: dict, cache: str, refresh: bool) -> dict:
    """One request to `bench/aic_runner.py` in AIConfigurator's venv, its JSON answer cached."""
    key = hashlib.sha1(json.dumps(request, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(cache, f"{request['kind']}-{os.path.basename(request['model_config'])[:-5]}-"
                               f"{request['system']}x{request.get('total_gpus', 0)}-{key}.json")
    if request["kind"] == "estimate":
        path = path.replace("x0-", "-")
    if os.path.exists(path) and not refresh:
        with open(path) as f:
            return json.load(f)
    try:
        proc = subprocess.run([aic_python(aic_bin), os.path.join(HERE, "aic_runner.py"), "-"],
                              input=json.dumps(request), capture_output=True, text=True, timeout=AIC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"AIConfigurator ran past {AIC_TIMEOUT_S} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    os.makedirs(cache, exist_ok=True)
    with open(path, "w") as f:
        f.write(proc.stdout)
    return json.loads(proc.stdout)


def aic_base(s: Setting) -> dict:
    return {"model_config": os.path.join(ROOT, "opweave", "models", "configs", f"{s.model}.json"),
            "system": s.aic_system, "backend": "trtllm", "isl": s.isl, "osl": s.osl}


def aic_default(aic_bin: str, s: Setting, cache: str, refresh: bool) -> dict:
    """AIConfigurator's agg-vs-disagg search of the setting (`cli default`)."""
    return aic_request(aic_bin, {**aic_base(s), "kind": "default", "ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms,
                                 "total_gpus": s.gpus, "top_n": 3}, cache, refresh)


def _quant(c: dict) -> str:
    q = c.get("quant") or {}
    return f"gemm {q.get('gemm')}, kv {q.get('kvcache')}"


def describe_aic(best: dict, mode: str) -> str:
    c = best["config"]
    if mode == "agg":
        return (f"{c['replicas']}x {c['parallel']}, batch {c['batch_size']}/rank x dp{c['attention_dp']}, "
                f"ctx_tokens {c['ctx_tokens']} ({_quant(c)})")
    p, d = c["prefill"], c["decode"]
    return (f"prefill {p['workers']}x {p['parallel']} b{p['batch_size']} + decode {d['workers']}x "
            f"{d['parallel']} b{d['batch_size']}/rank ({_quant(c)})"
            + (f", {c['replicas']}x" if c["replicas"] > 1 else ""))


def aic_rows(peer: dict) -> list[dict]:
    """The table's rows of AIConfigurator's answer: its best agg and best disagg configuration."""
    rows = []
    for mode in ("agg", "disagg"):
        best = (peer.get(mode) or {}).get("best")
        label = "aggregated" if mode == "agg" else "disaggregated"
        if not best:
            rows.append({"system": "AIConfigurator", "mode": label, "error": (peer.get(mode) or {}).get("error")
                         or "no configuration"})
            continue
        rows.append({"system": "AIConfigurator", "mode": label, "chosen": peer.get("chosen") == mode,
                     "gpus": best["config"]["gpus_used"], "plan": describe_aic(best, mode),
                     "tps_gpu": best["tokens_per_s_per_gpu_cluster"], "ttft_ms": best["ttft_ms"],
                     "tpot_ms": best["tpot_ms"], "slo": best["sla_met"], "raw": best})
    return rows


# --------------------------------------------------------------------------- OpWeave side


def opweave_compile(s: Setting, prefill: str, cache: str) -> dict:
    """`python -m opweave compile` of the setting with `--prefill prefill`: plan.json, or an error."""
    out = os.path.join(cache, "opweave", f"{s.name}-{prefill}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = [sys.executable, "-m", "opweave", "compile", s.model, "--cluster", s.cluster,
           "--tpot-slo", f"{s.tpot_ms:g}ms", "--isl", str(s.isl), "--osl", str(s.osl),
           "--ttft-slo", f"{s.ttft_ms:g}ms", "--prefill", prefill, "--kv-cache-dtype", s.kv_cache_dtype,
           "-o", out, "--quiet"] + ([] if s.attention_dp else ["--no-attention-dp"])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1], "seconds": seconds}
    with open(os.path.join(out, "plan.json")) as f:
        return {"plan": json.load(f), "seconds": seconds}


def plan_gpus(plan: dict) -> int:
    """GPUs the plan prices: its decode replica sets and, disaggregated, its prefill groups."""
    price = plan["owners"][0]["price_per_hour"]
    return round(plan["predicted"]["cost_per_hour_usd"] / price)


def describe_opweave(plan: dict) -> str:
    roles = ("attention ", "FFN ") if plan["template_family"] == "afd" and len(plan["owners"]) == 2 else ("", "")
    owners = " + ".join(f"{role}{o['replicas']}x tp{o['tp']}{'' if o['experts'] == 'tp' else ' ' + o['experts']}"
                        for role, o in zip(roles, plan["owners"]))
    sets = plan["prefill"].get("sets", plan["replica_sets"])
    head = f"{plan['template']} {owners}, batch {plan['batch']}/set, {plan['microbatches']} mb, {sets} set(s)"
    pre = plan["prefill"]
    if pre["mode"] == "aggregated":
        return f"{head}; token budget {pre['token_budget']}"
    pool = "; ".join(f"prefill {p['replicas']}x tp{p['tp']} per {p['for_sets']} set(s)" for p in pre["owners"])
    return f"{head}; {pool}"


def opweave_rows(s: Setting, cache: str) -> tuple[list[dict], dict]:
    """The table's rows of OpWeave's aggregated and disaggregated plans (the one auto picks marked)."""
    runs = {mode: opweave_compile(s, mode, cache) for mode in ("aggregated", "disaggregated", "auto")}
    auto = runs["auto"].get("plan")
    rows = []
    for mode in ("aggregated", "disaggregated"):
        r = runs[mode]
        if "error" in r:
            rows.append({"system": "OpWeave", "mode": mode, "error": r["error"]})
            continue
        p = r["plan"]
        gpus = plan_gpus(p)
        rows.append({"system": "OpWeave", "mode": mode, "chosen": auto is not None and auto["prefill"]["mode"] == mode,
                     "gpus": gpus, "plan": describe_opweave(p), "tps_gpu": p["tokens_per_s"] / gpus,
                     "ttft_ms": p["ttft_ms"], "tpot_ms": p["tpot_ms"],
                     "slo": p["ttft_ms"] <= s.ttft_ms and p["tpot_ms"] <= s.tpot_ms, "raw": p,
                     "seconds": r["seconds"]})
    return rows, runs


# --------------------------------------------------------------------------- cross-pricing


def _layout(c: dict, moe: bool, attention_dp: bool = False) -> tuple[str | None, str | None]:
    """OpWeave's expert layout for AIConfigurator's agg configuration `c`, or (None, why not):
    with `attention_dp`, attention data-parallel 1 x G beside EP G is OpWeave's "dp" owner of G."""
    if c["pp"] != 1 or (c.get("cp") or 1) != 1:
        return None, f"pipeline/context parallel ({c['parallel']}): OpWeave's colocated owners have no PP"
    if c["attention_dp"] != 1 and attention_dp and moe and c["tp"] == 1 and c["moe_ep"] == c["attention_dp"] \
            and c["moe_tp"] in (None, 1):
        return "dp", None
    if c["attention_dp"] != 1:
        return None, (f"attention data-parallel {c['attention_dp']} inside an expert group ({c['parallel']}): "
                      "not expressible in OpWeave (its attention runs TP across the expert group)")
    if not moe or c["moe_ep"] in (None, 1):
        return "tp", None
    if c["moe_ep"] == c["tp"] and c["moe_tp"] in (None, 1):
        return "ep", None
    return None, f"experts split TP x EP ({c['parallel']}): OpWeave has whole-TP or whole-EP expert layouts"


def opweave_prices_aic(s: Setting, best: dict, fe, moe: bool) -> dict:
    """AIConfigurator's best agg configuration as an OpWeave pinned colocated plan (one replica of
    its TP group at its batch), decode alone and under the workload at its ctx_tokens budget."""
    c = best["config"]
    layout, why = _layout(c, moe, s.attention_dp)
    if layout is None:
        return {"error": why}
    group = c["attention_dp"] if layout == "dp" else c["tp"]  # GPUs of the owner
    cluster = parse_cluster(s.cluster, load_catalog())
    workload = Workload(isl=s.isl, osl=s.osl, ttft_slo_s=s.ttft_ms / 1e3)
    fe = dataclasses.replace(fe, inputs=dataclasses.replace(fe.inputs, workload=workload))  # workload-sized KV pool
    owners = [(s.gpu, group, 1, layout)]
    args = dict(batch=c["batch_size"] * (group if layout == "dp" else 1), microbatches=1, context=s.isl + s.osl, tpot_slo_s=s.tpot_ms / 1e3)
    waived = None
    try:
        done = pinned_plan(fe, cluster, "colocated", owners, **args)
    except OpWeaveError as e:   # OpWeave's memory check refuses it: price its speed all the same, flagged
        waived = str(e)
        roomy = dataclasses.replace(cluster, pools=tuple(
            dataclasses.replace(p, gpu=dataclasses.replace(p.gpu, memory_bytes=p.gpu.memory_bytes * 4))
            for p in cluster.pools))
        try:
            done = pinned_plan(fe, roomy, "colocated", owners, **args)
        except OpWeaveError as e2:
            return {"error": str(e2)}
    plan, cand = done.plan, done.result.best
    space = plan_space(fe.graph, fe.blocks, done.inputs, workload=workload, tpot_slo_s=s.tpot_ms / 1e3)
    traffic = TrafficModel(Evaluator(space), workload)
    allowed = traffic.budgets(cand)
    budget = max([b for b in allowed if b <= c["ctx_tokens"]] or [min(allowed)])
    t = traffic.aggregated(cand, budget)
    return {"decode_tpot_ms": plan.predicted.tpot_ms, "decode_tps_gpu": plan.predicted.tokens_per_s_per_set / group,
            "tps_gpu": t.tokens_per_s / group, "ttft_ms": t.ttft_s * 1e3, "tpot_ms": t.tpot_s * 1e3,
            "budget": budget, "waived": waived,
            "slo": t.tpot_s * 1e3 <= s.tpot_ms and t.ttft_s * 1e3 <= s.ttft_ms and waived is None}


def aic_prices_opweave(aic_bin: str, s: Setting, plan: dict, cache: str, refresh: bool, moe: bool) -> dict:
    """AIConfigurator's agg estimate of OpWeave's aggregated plan (one colocated owner, 1 microbatch):
    per TP group at its rows, with OpWeave's token budget as ctx_tokens."""
    if len(plan["owners"]) != 1 or plan["template"] != "colocated" or plan["microbatches"] != 1:
        return {"error": "not one colocated owner in one microbatch: no AIConfigurator equivalent"}
    o = plan["owners"][0]
    if o["experts"] == "dp":
        return {"error": "data-parallel attention owner: not passed to AIConfigurator's estimate here"}
    point = {"tp": o["tp"], "batch": plan["batch"] // o["replicas"], "ctx_tokens": plan["prefill"]["token_budget"]}
    if moe:
        point.update(ep=o["tp"], moe_tp=1) if o["experts"] == "ep" else point.update(ep=1, moe_tp=o["tp"])
    out = aic_request(aic_bin, {**aic_base(s), "kind": "estimate", "points": [point], "modes": ["agg"]}, cache, refresh)
    if "error" in out:
        return out
    est = out["points"][0].get("agg") or {"error": out["points"][0].get("error", "no estimate")}
    return est


# --------------------------------------------------------------------------- report


def _num(x, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def setting_report(s: Setting, aic_bin: str, cache: str, refresh: bool) -> tuple[list[str], dict]:
    print(f"# {s.title}", file=sys.stderr)
    t0 = time.perf_counter()
    peer = aic_default(aic_bin, s, cache, refresh)
    print(f"  AIConfigurator done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    ours, runs = opweave_rows(s, cache)
    print("  OpWeave done", file=sys.stderr)
    theirs = [{"system": "AIConfigurator", "mode": "", "error": peer["error"]}] if "error" in peer else aic_rows(peer)
    by_mode = {(r["system"], r["mode"]): r for r in ours + theirs}
    lines = [f"### {s.title}", "",
             "| system | mode | plan | GPUs | tokens/s/GPU | TTFT ms | TPOT ms | SLOs met | OpWeave / AIC |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in ours + theirs:
        name = r["system"] + (" (chosen)" if r.get("chosen") else "")
        if "error" in r:
            lines.append(f"| {name} | {r['mode']} | failed: {r['error']} | | | | | | |")
            continue
        ratio = ""
        if r["system"] == "OpWeave":
            peer_row = by_mode.get(("AIConfigurator", r["mode"]))
            if peer_row and "error" not in peer_row and peer_row["tps_gpu"]:
                ratio = f"{r['tps_gpu'] / peer_row['tps_gpu']:.2f}"
        lines.append(f"| {name} | {r['mode']} | {r['plan']} | {r['gpus']} | {_num(r['tps_gpu'], ',.0f')} | "
                     f"{_num(r['ttft_ms'], ',.0f')} | {_num(r['tpot_ms'], '.1f')} | {'yes' if r['slo'] else 'no'} | "
                     f"{ratio} |")
    chosen = [r for r in ours if r.get("chosen")], [r for r in theirs if r.get("chosen")]
    summary = {"setting": s.name}
    if chosen[0] and chosen[1]:
        a, b = chosen[0][0], chosen[1][0]
        summary.update(opweave=a["tps_gpu"], aic=b["tps_gpu"], ratio=a["tps_gpu"] / b["tps_gpu"],
                       opweave_mode=a["mode"], aic_mode=b["mode"], opweave_gpus=a["gpus"], aic_gpus=b["gpus"])
        lines += ["", f"Chosen plans: OpWeave {a['mode']} {a['tps_gpu']:,.0f} tokens/s/GPU, AIConfigurator "
                      f"{b['mode']} {b['tps_gpu']:,.0f}: ratio {summary['ratio']:.2f}."]
    elif "error" in runs["auto"]:
        lines += ["", f"OpWeave (auto) found no plan: {runs['auto']['error']}"]
    lines.append("")
    moe = s.model in ("qwen3-30b-a3b", "deepseek-v3")
    agg_aic = by_mode.get(("AIConfigurator", "aggregated"))
    if agg_aic and "error" not in agg_aic:
        mine = opweave_prices_aic(s, agg_aic["raw"], run_front_end(s.model, kv_cache_dtype=s.kv_cache_dtype), moe)
        if "error" in mine:
            lines.append(f"- AIConfigurator's agg configuration in OpWeave's model: not expressible: {mine['error']}")
            summary["priced"] = "not expressible" + (" (--no-attention-dp)" if not s.attention_dp else "")
        else:
            misses = [f"TPOT {mine['tpot_ms']:.1f} > {s.tpot_ms} ms"] * (mine["tpot_ms"] > s.tpot_ms) + \
                [f"TTFT {mine['ttft_ms']:,.0f} > {s.ttft_ms} ms"] * (mine["ttft_ms"] > s.ttft_ms) + \
                ["memory"] * bool(mine["waived"])
            verdict = "meets the SLOs and memory" if mine["slo"] else "misses " + ", ".join(misses)
            summary["priced"] = f"{mine['tps_gpu']:,.0f} ({verdict})"
            lines.append(
                f"- AIConfigurator's agg configuration ({agg_aic['raw']['config']['parallel']}, batch "
                f"{agg_aic['raw']['config']['batch_size']}) in OpWeave's model: {mine['tps_gpu']:,.0f} tokens/s/GPU, "
                f"TTFT {mine['ttft_ms']:,.0f} ms, TPOT {mine['tpot_ms']:.1f} ms at token budget {mine['budget']} "
                f"(decode alone: TPOT {mine['decode_tpot_ms']:.1f} ms, {mine['decode_tps_gpu']:,.0f} tokens/s/GPU); "
                f"AIConfigurator's own: {agg_aic['tps_gpu']:,.0f}, {agg_aic['ttft_ms']:,.0f} ms, "
                f"{agg_aic['tpot_ms']:.1f} ms; in OpWeave's model it {verdict}"
                + (f". OpWeave's memory check refuses it ({mine['waived']}); priced with that check waived"
                   if mine["waived"] else ""))
    agg_ours = by_mode.get(("OpWeave", "aggregated"))
    if agg_ours and "error" not in agg_ours:
        est = aic_prices_opweave(aic_bin, s, agg_ours["raw"], cache, refresh, moe)
        if "error" in est:
            lines.append(f"- OpWeave's agg plan in AIConfigurator's model (`cli estimate`, agg): {est['error']}")
        else:
            lines.append(
                f"- OpWeave's agg plan in AIConfigurator's model (`cli estimate`, agg, ctx_tokens "
                f"{est.get('ctx_tokens')}): {est['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, TTFT "
                f"{est['ttft_ms']:,.0f} ms, TPOT {est['tpot_ms']:.1f} ms; OpWeave's own: {agg_ours['tps_gpu']:,.0f}, "
                f"{agg_ours['ttft_ms']:,.0f} ms, {agg_ours['tpot_ms']:.1f} ms"
                + (f" (AIConfigurator prices it at its own quantization, {_quant(agg_aic['raw']['config'])})"
                   if agg_aic and "error" not in agg_aic else "")
                + ("; AIConfigurator flags a KV-cache OOM" if est.get("kv_cache_oom") else ""))
    if "equivalent_cli" in peer:
        lines.append(f"- AIConfigurator call ({peer['elapsed_s']:.0f} s): `{peer['equivalent_cli']}`")
    lines.append("")
    return lines, {**summary, "aic_versions": peer.get("aiconfigurator_version"),
                   "backend_version": peer.get("backend_version")}


NOTES = """## Where the two model different things

- **Plan space.** AIConfigurator searches TP x PP x attention data-parallel x MoE TP/EP layouts per
  worker (wide expert parallelism with attention DP, e.g. `tp1 dp16 ep16` for DeepSeek-V3) and xPyD
  worker counts for disaggregation. OpWeave searches stage templates that cut the model by operator
  (colocated; AFD: attention and FFN/experts on different owners; CAD), owners of TP groups with
  experts sliced, whole-expert EP inside the group, or attention data-parallel inside the expert
  group ("dp": each GPU its own rows, the experts EP over the group, the routed tokens gathered and
  their sums reduce-scattered, or dispatched and combined all-to-all as AIConfigurator's wide EP
  does, whichever is cheaper at the rows), replica sets and microbatches. It has no layer pipeline
  in a colocated plan and no TP x EP split of experts, so those AIConfigurator configurations are
  not expressible in it, nor attention-DP with the `--no-attention-dp` settings (said so per
  setting); AIConfigurator's `tp1 dpG epG` is OpWeave's "dp" owner of G GPUs and is priced as one.
  OpWeave's AFD plans, microbatched plans and dp owners are not passed to AIConfigurator's
  `cli estimate` here.
- **Cost model.** AIConfigurator interpolates a measured kernel database (TensorRT-LLM on the named
  system: GEMM, attention, MoE, communication tables) and picks the quantization its database
  holds: FP8 block GEMMs and an FP8 KV cache for DeepSeek-V3's FP8 checkpoint, BF16 for the others.
  OpWeave's model is analytic per operator with efficiencies fitted to public TensorRT-LLM and vLLM
  measurements (`opweave/hardware/catalog.json` sources), the weights as published (DeepSeek-V3
  FP8) and the KV cache in the model's dtype unless `--kv-cache-dtype fp8` (the
  `deepseek-v3-fp8kv` setting).
- **Aggregated serving.** AIConfigurator's mixed step carries `ctx_tokens` prompt tokens (whole
  prompts, a multiple of the ISL, in its search) beside the decode rows; its TPOT is the mean step.
  OpWeave searches a chunked-prefill token budget (256-8192 tokens per round), weighs rounds that
  carry a chunk by their share and checks the TPOT SLO on that mean round.
- **TTFT.** AIConfigurator's aggregated TTFT is the per-request prefill time times a queueing factor
  min(2 + (steps - 3) / 20, 4) (`aiconfigurator_core/sdk/backends/base_backend.py`); disaggregated,
  a prefill worker's TTFT times a fixed correction of 1.8. OpWeave's is predicted at 80% of the
  plan's capacity: an M/D/1 wait for the budget or the prefill pool, a wait for a free row, the
  request's own chunks (or its prefill and KV transfer) and two rounds of host lag.
- **Disaggregation.** AIConfigurator rate-matches prefill and decode workers with their throughputs
  derated (x 0.9 prefill, x 0.92 decode, `aiconfigurator/sdk/picking.py`) and fills the GPUs it is
  given. OpWeave sizes the fewest prefill TP groups that keep up with its decode sets at capacity and
  meet the TTFT SLO, costs the KV transfer over the NICs, and may leave GPUs idle: its objective is
  the cheapest tokens, which on one GPU type is the most tokens/s per GPU it prices (decode and
  prefill GPUs), the figure in the tables.
- **Memory.** OpWeave sizes the KV pool at the workload's expected occupancy + 3 sigma and checks
  90% of each GPU; AIConfigurator has its own memory model, so a batch one accepts the other may
  refuse (flagged where OpWeave's check had to be waived to price AIConfigurator's plan).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aic", default=DEFAULT_AIC, help=f"the aiconfigurator binary in its venv (default {DEFAULT_AIC})")
    ap.add_argument("--settings", default="all",
                    help=f"comma-separated subset of: {', '.join(SETTINGS)} (default: all)")
    ap.add_argument("--cache", default=DEFAULT_CACHE, help="AIConfigurator answers and OpWeave artifacts "
                                                            f"(default {DEFAULT_CACHE})")
    ap.add_argument("--refresh", action="store_true", help="re-run AIConfigurator instead of reading its cache")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args(argv)
    if not os.access(args.aic, os.X_OK) or not os.access(aic_python(args.aic), os.X_OK):
        print(f"peer_aiconfigurator: no aiconfigurator at {args.aic} (or no python beside it); set up its venv as "
              "this script's docstring says, or pass --aic", file=sys.stderr)
        return 2
    names = list(SETTINGS) if args.settings == "all" else [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"peer_aiconfigurator: unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}",
              file=sys.stderr)
        return 2
    body, summaries = [], []
    for name in names:
        lines, summary = setting_report(SETTINGS[name], args.aic, args.cache, args.refresh)
        body += lines
        summaries.append(summary)
    versions = next((x for x in summaries if x.get("aic_versions")), {})
    aic_v = (versions.get("aic_versions") or {}).get("aiconfigurator")
    dbs = sorted({f"{SETTINGS[x['setting']].aic_system}: trtllm {x['backend_version']}" for x in summaries
                  if x.get("backend_version")})
    cmd = "python bench/peer_aiconfigurator.py" + ("" if args.settings == "all" else f" --settings {args.settings}")
    head = [f"# OpWeave beside AIConfigurator {aic_v}", "",
            f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"- Machine: {platform.node() or 'this machine'}, {os.cpu_count()}-core CPU VM, no GPU: both tools "
            "only plan from their models.",
            f"- AIConfigurator {aic_v} (`cli default`, backend trtllm, database mode SILICON; perf database "
            f"{', '.join(dbs) or 'unknown'}), run from its own venv through `bench/aic_runner.py`.",
            "- OpWeave: `python -m opweave compile MODEL --cluster GPUxN --isl --osl --tpot-slo --ttft-slo "
            "--prefill aggregated|disaggregated|auto` with its built-in catalog (objective: cost, which on one GPU "
            "type is tokens/s per GPU priced); `(chosen)` marks what `--prefill auto` and AIConfigurator's "
            "`chosen` pick.",
            f"- Reproduce: `{cmd}` (add `--out bench/results/peer_aiconfigurator.md` to write this file).",
            "- tokens/s/GPU: output tokens per second per GPU the plan uses (AIConfigurator: `tokens/s/gpu_cluster`; "
            "OpWeave: plan tokens/s over the GPUs it prices, decode and prefill). TTFT and TPOT are each system's own "
            "prediction. `OpWeave / AIC`: the ratio of tokens/s/GPU, aggregated to aggregated and disaggregated to "
            "disaggregated.", ""]
    summary_lines = ["## Headline: chosen plans, tokens/s/GPU", "",
                     "| setting | OpWeave | AIConfigurator | OpWeave / AIC | AIConfigurator's agg configuration "
                     "in OpWeave's model |",
                     "|---|---|---|---|---|"]
    for x in summaries:
        if "ratio" in x:
            summary_lines.append(f"| {SETTINGS[x['setting']].title} | {x['opweave_mode']} on {x['opweave_gpus']} GPUs: "
                                 f"{x['opweave']:,.0f} | {x['aic_mode']} on {x['aic_gpus']} GPUs: {x['aic']:,.0f} | "
                                 f"{x['ratio']:.2f} | {x.get('priced', '')} |")
        else:
            summary_lines.append(f"| {SETTINGS[x['setting']].title} | | | (no pair of chosen plans) | |")
    text = "\n".join(head + summary_lines + [""] + body + [NOTES])
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
