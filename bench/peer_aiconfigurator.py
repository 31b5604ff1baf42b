"""OpWeave's traffic planner beside NVIDIA's AIConfigurator, on the same settings, in one run.

For each setting (model, H100 SXM GPUs, ISL/OSL, TPOT and TTFT targets), both tools plan:
AIConfigurator's `cli default` search (aggregated and disaggregated, through `bench/aic_runner.py`
in AIConfigurator's own venv) and `opweave compile` with the same workload (`--isl --osl
--tpot-slo --ttft-slo`). Then each plan is priced by the other tool's model where it can be
expressed: AIConfigurator's `cli estimate` (agg mode) of OpWeave's plan (a colocated TP group at
its batch), and OpWeave's traffic model (`passes/traffic.py`, aggregated) of AIConfigurator's best
aggregated configuration as a pinned plan (pure TP; attention data-parallel inside an expert group
is not expressible in OpWeave yet). Prints a markdown report and writes it with `--out`.

Set-up (never by CI; AIConfigurator needs no torch):
    python3 -m venv /work/peers/aic && /work/peers/aic/bin/pip install aiconfigurator==0.12.0
Run:
    python bench/peer_aiconfigurator.py --out bench/results/peer_aiconfigurator.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from opweave.compiler.compile import compile_model  # noqa: E402
from opweave.compiler.frontend import run_front_end  # noqa: E402
from opweave.compiler.inputs import plan_space  # noqa: E402
from opweave.compiler.pinned import pinned_plan  # noqa: E402
from opweave.errors import OpWeaveError  # noqa: E402
from opweave.hardware.catalog import load_catalog  # noqa: E402
from opweave.hardware.cluster import parse_cluster  # noqa: E402
from opweave.ir.workload import Workload  # noqa: E402
from opweave.passes.space import Evaluator  # noqa: E402
from opweave.passes.traffic import TrafficModel  # noqa: E402

# (model, GPUs, isl, osl, TPOT SLO ms, TTFT SLO ms)
SETTINGS = (
    ("llama-3.1-70b", 8, 1024, 1024, 50, 5000),
    ("llama-3.1-70b", 8, 1024, 1024, 50, 300),
    ("qwen3-30b-a3b", 8, 1024, 1024, 50, 5000),
    ("qwen3-30b-a3b", 8, 1024, 1024, 50, 100),
)
QUICK = SETTINGS[:1]


def aic(python: str, request: dict) -> dict:
    """One request to `bench/aic_runner.py` in AIConfigurator's interpreter."""
    proc = subprocess.run([python, os.path.join(HERE, "aic_runner.py"), "-"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout)


def opweave_plan(model: str, gpus: int, isl: int, osl: int, tpot_ms: float, ttft_ms: float):
    cluster = parse_cluster(f"h100x{gpus}", load_catalog())
    fe = run_front_end(model)
    workload = Workload(isl=isl, osl=osl, ttft_slo_s=ttft_ms / 1e3)
    start = time.perf_counter()
    compiled = compile_model(model, cluster, tpot_ms / 1e3, isl + osl, front_end=fe, workload=workload)
    return fe, cluster, compiled, time.perf_counter() - start


def describe_opweave(plan) -> str:
    owners = " + ".join(f"{o.replicas}x tp{o.tp}{' ep' if o.experts == 'ep' else ''}" for o in plan.owners)
    pre = plan.prefill
    how = (f"agg, budget {pre['token_budget']}" if pre["mode"] == "aggregated" else
           "disagg, prefill " + ", ".join(f"{p['replicas']}x tp{p['tp']} per {p['for_sets']} set(s)"
                                          for p in pre["owners"]))
    return f"{plan.template} {owners}, batch {plan.batch}/set; {how}"


def describe_aic(best: dict, mode: str) -> str:
    c = best["config"]
    if mode == "agg":
        return (f"{c['replicas']}x {c['parallel']}, batch {c['batch_size']}, ctx_tokens {c.get('ctx_tokens')}")
    p, d = c["prefill"], c["decode"]
    return (f"prefill {p['workers']}x {p['parallel']} b{p['batch_size']} + decode {d['workers']}x {d['parallel']} "
            f"b{d['batch_size']}")


def aic_prices_opweave(python: str, base: dict, plan) -> dict | None:
    """AIConfigurator's agg estimate of OpWeave's plan, when it is one colocated TP group replicated."""
    if len(plan.owners) != 1:
        return None
    o = plan.owners[0]
    point = {"tp": o.tp, "batch": plan.batch // o.replicas, "modes": ["agg"]}
    if o.experts == "ep":
        point.update(ep=o.tp, moe_tp=1)
    out = aic(python, {**base, "kind": "estimate", "points": [point]})
    if "error" in out:
        return {"error": out["error"]}
    return out["points"][0].get("agg")


def opweave_prices_aic(fe, cluster, best: dict, context: int, workload: Workload, tpot_ms: float) -> dict:
    """OpWeave's traffic model of AIConfigurator's aggregated configuration (pure TP only)."""
    c = best["config"]
    if c["pp"] != 1 or c["attention_dp"] != 1 or c.get("cp", 1) != 1:
        return {"error": "attention data-parallel or pipeline parallel: not expressible in OpWeave yet"}
    layout = "ep" if c["moe_ep"] > 1 else "tp"
    batch = c["batch_size"] * c["replicas"]
    fe = dataclasses.replace(fe, inputs=dataclasses.replace(fe.inputs, workload=workload))  # its KV pool
    waived = None
    try:
        compiled = pinned_plan(fe, cluster, "colocated", [("h100", c["tp"], c["replicas"], layout)], batch=batch,
                               microbatches=1, context=context)
    except OpWeaveError as e:   # OpWeave holds every slot at the full context: price its speed all the same
        waived = str(e)
        roomy = dataclasses.replace(cluster, pools=tuple(
            dataclasses.replace(p, gpu=dataclasses.replace(p.gpu, memory_bytes=p.gpu.memory_bytes * 4))
            for p in cluster.pools))
        try:
            compiled = pinned_plan(fe, roomy, "colocated", [("h100", c["tp"], c["replicas"], layout)], batch=batch,
                                   microbatches=1, context=context)
        except OpWeaveError as e2:
            return {"error": str(e2)}
    cand = compiled.result.best
    space = plan_space(fe.graph, fe.blocks, compiled.inputs, workload=workload, tpot_slo_s=tpot_ms / 1e3)
    model = TrafficModel(Evaluator(space), workload)
    options = [model.aggregated(cand, b) for b in model.budgets(cand)]
    chosen = min(options, key=lambda t: (t.tpot_s > tpot_ms / 1e3 or t.ttft_s > workload.ttft_slo_s,
                                         t.cost_per_mtok_usd))
    gpus = c["tp"] * c["replicas"]
    return {"tokens_per_s_per_gpu": chosen.tokens_per_s / gpus, "ttft_ms": chosen.ttft_s * 1e3,
            "tpot_ms": chosen.tpot_s * 1e3, "decode_tpot_ms": cand.sim.tpot_s * 1e3, "budget": chosen.token_budget,
            "waived": waived}


def run(settings, python: str) -> list[str]:
    lines = []
    for model, gpus, isl, osl, tpot_ms, ttft_ms in settings:
        base = {"model_config": os.path.join(ROOT, "opweave", "models", "configs", f"{model}.json"),
                "system": "h100_sxm", "backend": "trtllm", "isl": isl, "osl": osl}
        print(f"# {model} h100x{gpus} ISL/OSL {isl}/{osl} TPOT<={tpot_ms} TTFT<={ttft_ms}", file=sys.stderr)
        peer = aic(python, {**base, "kind": "default", "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "total_gpus": gpus,
                            "top_n": 1})
        fe, cluster, compiled, seconds = opweave_plan(model, gpus, isl, osl, tpot_ms, ttft_ms)
        plan = compiled.plan
        workload = compiled.inputs.workload
        lines += [f"### {model}, {gpus}x H100 SXM, ISL/OSL {isl}/{osl}, TPOT <= {tpot_ms} ms, TTFT <= {ttft_ms} ms", "",
                  "| planner | plan | tokens/s/GPU | TTFT ms | TPOT ms | SLOs met |", "|---|---|---|---|---|---|"]
        ours = plan.predicted.tokens_per_s / plan.gpus_used
        lines.append(f"| OpWeave ({seconds:.1f} s) | {describe_opweave(plan)} | {ours:,.0f} | {plan.ttft_ms:,.0f} | "
                     f"{plan.predicted.tpot_ms:.1f} | yes |")
        best_aic = None
        if "error" in peer:
            lines.append(f"| AIConfigurator | error: {peer['error']} | | | | |")
        else:
            for mode in ("agg", "disagg"):
                best = (peer.get(mode) or {}).get("best")
                if not best:
                    lines.append(f"| AIConfigurator {mode} | none | | | | |")
                    continue
                lines.append(f"| AIConfigurator {mode} ({peer['elapsed_s']:.0f} s) | {describe_aic(best, mode)} | "
                             f"{best['tokens_per_s_per_gpu_cluster']:,.0f} | {best['ttft_ms']:,.0f} | "
                             f"{best['tpot_ms']:.1f} | {'yes' if best['sla_met'] else 'no'} |")
                if mode == "agg":
                    best_aic = best
        lines.append("")
        theirs = aic_prices_opweave(python, base, plan)
        if theirs is None:
            lines.append("- AIConfigurator's estimate of OpWeave's plan: not expressible (more than one owner).")
        elif "error" in theirs:
            lines.append(f"- AIConfigurator's estimate of OpWeave's plan: {theirs['error']}")
        else:
            lines.append(f"- AIConfigurator's agg estimate of OpWeave's plan: {theirs['tokens_per_s_per_gpu']:,.0f} "
                         f"tokens/s/GPU, TTFT {theirs['ttft_ms']:,.0f} ms, TPOT {theirs['tpot_ms']:.1f} ms "
                         f"(OpWeave: {ours:,.0f}, {plan.ttft_ms:,.0f}, {plan.predicted.tpot_ms:.1f})")
        if best_aic is not None:
            mine = opweave_prices_aic(fe, cluster, best_aic, isl + osl, workload, tpot_ms)
            if "error" in mine:
                lines.append(f"- OpWeave's model of AIConfigurator's agg plan: {mine['error']}")
            else:
                lines.append(f"- OpWeave's model of AIConfigurator's agg plan: {mine['tokens_per_s_per_gpu']:,.0f} "
                             f"tokens/s/GPU, TTFT {mine['ttft_ms']:,.0f} ms, TPOT {mine['tpot_ms']:.1f} ms at token "
                             f"budget {mine['budget']} (its decode alone {mine['decode_tpot_ms']:.1f} ms; "
                             f"AIConfigurator: {best_aic['tokens_per_s_per_gpu_cluster']:,.0f}, "
                             f"{best_aic['ttft_ms']:,.0f}, {best_aic['tpot_ms']:.1f})"
                             + (f"; memory check waived: {mine['waived']} (KV pool sized for the workload)"
                                if mine["waived"] else ""))
        lines.append("")
    return lines


NOTES = """## Where the two model different things

- **Throughput**: both count output tokens per second per GPU of the deployment. AIConfigurator's
  aggregated figure is its batch x (osl - 1) over a mean step mixing context and generation
  requests; OpWeave's is r0 x n x lam x osl over the mean round (`passes/traffic.py`), at capacity.
- **TTFT**: AIConfigurator's is a heuristic: the prefill time times a queueing multiplier that grows
  with the number of decode steps (aggregated), or a batch-1 prefill x 1.1 x 1.8 (disaggregated).
  OpWeave's is an M/D/1 queue at 80% of the plan's capacity plus the request's own chunks
  (aggregated) or its prefill and last KV transfer (disaggregated); p99 from the queue's tail.
- **Interference**: AIConfigurator weighs mixed and decode-only steps by their mean counts; OpWeave
  simulates a round carrying a full chunk through the plan's stages (its p99 TPOT) and weighs it
  by the share of rounds that carry one. Chunking: AIConfigurator's `ctx_tokens` is a multiple of
  the ISL by default (whole prompts per step); OpWeave searches the token budget (256-8192).
- **Disaggregation**: AIConfigurator derates prefill (x 0.9) and decode (x 0.92) capacities and
  takes their minimum; OpWeave sizes the fewest prefill groups for y decode sets that keep up at
  capacity and meet the TTFT SLO at the planned load, and costs the KV transfer over the NICs.
- **Plan space**: AIConfigurator expresses attention data-parallel inside an expert-parallel group
  (its Qwen3-30B-A3B plans), which OpWeave cannot yet; OpWeave expresses operator cuts across GPU
  types (AFD/CAD), which AIConfigurator does not. On one GPU type the best OpWeave plans here are
  colocated.
- **Missed SLOs**: AIConfigurator returns its closest configurations when none meets the TPOT
  target (`SLOs met: no`); OpWeave fails with the closest plan named.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aic-python", default="/work/peers/aic/bin/python", help="AIConfigurator's interpreter")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    ap.add_argument("--quick", action="store_true", help="the first setting only")
    args = ap.parse_args(argv)
    if not os.path.exists(args.aic_python):
        print(f"peer_aiconfigurator: {args.aic_python} not found; set it up as the module docstring says",
              file=sys.stderr)
        return 2
    version = subprocess.run([args.aic_python, "-c", "import aiconfigurator; print(aiconfigurator.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    head = [f"# OpWeave beside AIConfigurator {version}: traffic planning", "",
            f"{datetime.date.today().isoformat()}, {platform.node() or 'this machine'} ({os.cpu_count()} cores, "
            f"no GPU: both tools plan from their models). Command: `python bench/peer_aiconfigurator.py"
            f"{' --quick' if args.quick else ''}`. AIConfigurator: system h100_sxm, backend trtllm (its newest "
            "perf database), `cli default`; OpWeave: `compile MODEL --cluster h100xN --isl --osl --tpot-slo "
            "--ttft-slo` at its catalog's H100 SXM figures and prices.", ""]
    lines = head + run(QUICK if args.quick else SETTINGS, args.aic_python) + [NOTES]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
