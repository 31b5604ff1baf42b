#!/usr/bin/env python
"""Run NVIDIA AIConfigurator as a side-by-side peer of OpWeave.

Meant to be run with AIConfigurator's own interpreter, never imported by
opweave (it imports only the standard library and aiconfigurator):

    /work/peers/aic/bin/python bench/aic_runner.py REQUEST.json
    echo '{"kind": "estimate", ...}' | /work/peers/aic/bin/python bench/aic_runner.py

It reads one JSON request (file argument, or stdin when no argument or "-")
and prints one JSON object on stdout.  On a request-level error it prints a
one-line message on stderr and exits 2 (this includes a "default" search
that finds no feasible configuration at all).  AIConfigurator's own logging goes to
stderr (level from the request's "log_level", default WARNING).

Request kinds
-------------
Common keys: "model_config" (a folder holding config.json, or a path to a
config json; keys starting with "_", such as OpWeave's "_source", are
stripped into $TMPDIR/aic_runner_models/NAME-HASH/config.json), "system"
(e.g. "h100_sxm"), "backend" (default "trtllm"), optional "backend_version"
(perf-database version; default: the newest one AIConfigurator lists for that
system/backend), optional "database_mode" (default "SILICON"), "isl", "osl".

"default": AIConfigurator's agg-vs-disagg search
    {"kind": "default", ..., "ttft_ms": 5000, "tpot_ms": 50, "total_gpus": 8,
     "top_n": 5, "strict_sla": false, "save_dir": null}
  -> "agg" and "disagg": {"best": {...}, "top": [...]} with tokens/s/GPU,
     tokens/s/user, TTFT, TPOT and the configuration.

"estimate": AIConfigurator's per-configuration estimate
    {"kind": "estimate", ..., "points": [{"tp": 8, "batch": 64}, ...],
     "modes": ["static", "agg"]}
  Point keys: "tp" (AIConfigurator tp_size, i.e. attention TP inside one
  attention-DP rank), "batch", optional "pp", "dp" (attention_dp_size),
  "ep" (moe_ep_size), "moe_tp" (moe_tp_size), "ctx_tokens" (agg only).
  GPUs per point = tp * pp * dp; for MoE models moe_tp * ep must equal tp * dp
  (if neither is given, ep = 1, i.e. experts tensor-parallel).
  -> per point, "static" (one static batch: prefill of the whole batch, then
     decode) and/or "agg" (AIConfigurator's in-flight-batching steady state).
     A point that fails (e.g. OOM) carries "error" and does not fail the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from importlib import metadata


class RequestError(Exception):
    """A problem with the request or the environment: exit 2."""


# --------------------------------------------------------------------------- utils


def _clean(value):
    """Make numpy / pandas scalars and containers JSON-safe."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return None
        return round(value, 4)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def _num(row, key, default=None):
    v = row.get(key, default)
    v = _clean(v)
    return default if v is None else v


@contextmanager
def _stdout_to_stderr():
    """Keep stdout clean for our JSON: anything printed (Python or native) goes to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        old = sys.stdout
        sys.stdout = sys.stderr
        try:
            yield
        finally:
            sys.stdout = old
            sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _setup_logging(level_name: str) -> None:
    level = getattr(logging, str(level_name).upper(), logging.WARNING)
    os.environ.setdefault("AICONFIGURATOR_LOG_LEVEL", logging.getLevelName(level))
    for name in ("aiconfigurator", "aiconfigurator_core", ""):
        logging.getLogger(name).setLevel(level)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _versions() -> dict:
    out = {}
    for dist in ("aiconfigurator", "aiconfigurator-core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _prepare_model_path(spec: str, tmp_root: str) -> str:
    """Return a folder holding a clean config.json (no network look-up needed)."""
    if not spec:
        raise RequestError("model_config is required")
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isdir(path):
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise RequestError(f"model_config folder has no config.json: {path}")
    elif os.path.isfile(path):
        cfg_file = path
    else:
        raise RequestError(f"model_config not found: {spec}")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise RequestError(f"cannot read {cfg_file}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise RequestError(f"{cfg_file} is not a JSON object")
    if os.path.isdir(path) and not any(k.startswith("_") for k in cfg):
        return path  # already usable as is (keeps any hf_quant_config.json beside it)
    # Copy into a stable folder (named after the model and its content, so the
    # recorded api_call / equivalent_cli stay reproducible), without OpWeave's
    # private "_..." keys.
    name = os.path.basename(path.rstrip("/"))
    if name.endswith(".json"):
        name = name[: -len(".json")]
    clean = {k: v for k, v in cfg.items() if not k.startswith("_")}
    text = json.dumps(clean, indent=1, sort_keys=True)
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    dest = os.path.join(tmp_root, f"{name or 'model'}-{digest}")
    os.makedirs(dest, exist_ok=True)
    target = os.path.join(dest, "config.json")
    if not os.path.isfile(target):
        fd, tmp_file = tempfile.mkstemp(dir=dest, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp_file, target)
    if os.path.isdir(path):
        for extra in ("hf_quant_config.json", "generation_config.json"):
            src = os.path.join(path, extra)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(dest, extra))
    return dest


def _int(req: dict, key: str, default=None, required=False):
    v = req.get(key, default)
    if v is None:
        if required:
            raise RequestError(f"'{key}' is required")
        return None
    try:
        iv = int(v)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"'{key}' must be an integer, got {v!r}") from exc
    if iv != v and not isinstance(v, str):
        raise RequestError(f"'{key}' must be an integer, got {v!r}")
    return iv


def _float(req: dict, key: str, default=None, required=False):
    v = req.get(key, default)
    if v is None:
        if required:
            raise RequestError(f"'{key}' is required")
        return None
    try:
        return float(v)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"'{key}' must be a number, got {v!r}") from exc


def _resolve_backend_version(system: str, backend: str, requested):
    if requested:
        return str(requested)
    from aiconfigurator.sdk.perf_database import get_latest_database_version

    v = get_latest_database_version(system=system, backend=backend)
    if v is None:
        raise RequestError(f"AIConfigurator has no perf database for system={system} backend={backend}")
    return v


# --------------------------------------------------------------------------- default


def _entry(row: dict, total_gpus: int, ttft_t: float, tpot_t: float, config: dict) -> dict:
    """One of AIConfigurator's result rows: its figures, whether it meets both targets, and
    `config` with the replicas of it the cluster holds."""
    per_replica = int(_num(row, "num_total_gpus", 0) or 0)
    replicas = total_gpus // per_replica if per_replica else 0
    ttft = _num(row, "ttft")
    tpot = _num(row, "tpot")
    return {
        "tokens_per_s_per_gpu": _num(row, "tokens/s/gpu"),
        "tokens_per_s_per_gpu_cluster": _num(row, "tokens/s/gpu_cluster"),
        "tokens_per_s_per_user": _num(row, "tokens/s/user"),
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "request_latency_ms": _num(row, "request_latency"),
        "sla_met": bool(ttft is not None and tpot is not None and ttft <= ttft_t and tpot <= tpot_t),
        "tokens_per_s_per_replica": _num(row, "tokens/s"),
        "requests_per_s_per_replica": _num(row, "seq/s"),
        "concurrency_per_replica": _num(row, "concurrency"),
        "config": {**config, "gpus_per_replica": per_replica, "replicas": replicas,
                   "gpus_used": replicas * per_replica},
    }


def _agg_entry(row: dict, total_gpus: int, ttft_t: float, tpot_t: float) -> dict:
    return _entry(row, total_gpus, ttft_t, tpot_t, {
        "tp": _num(row, "tp"),
        "pp": _num(row, "pp"),
        "attention_dp": _num(row, "dp"),
        "moe_tp": _num(row, "moe_tp"),
        "moe_ep": _num(row, "moe_ep"),
        "cp": _num(row, "cp"),
        "batch_size": _num(row, "bs"),
        "global_batch_size": _num(row, "global_bs"),
        "ctx_tokens": _num(row, "ctx_tokens"),
        "parallel": _num(row, "parallel"),
        "quant": {k: _num(row, k) for k in ("gemm", "kvcache", "fmha", "moe", "comm")},
        "memory_gb": _num(row, "memory"),
    })


def _disagg_worker(row: dict, p: str) -> dict:
    tp = int(_num(row, f"({p})tp", 1) or 1)
    pp = int(_num(row, f"({p})pp", 1) or 1)
    dp = int(_num(row, f"({p})dp", 1) or 1)
    cp = int(_num(row, f"({p})cp", 1) or 1)
    return {
        "workers": _num(row, f"({p})workers"),
        "tp": tp,
        "pp": pp,
        "attention_dp": dp,
        "moe_tp": _num(row, f"({p})moe_tp"),
        "moe_ep": _num(row, f"({p})moe_ep"),
        "cp": cp,
        "batch_size": _num(row, f"({p})bs"),
        "global_batch_size": _num(row, f"({p})global_bs"),
        "gpus_per_worker": tp * pp * dp * cp,
        "parallel": _num(row, f"({p})parallel"),
        "memory_gb": _num(row, f"({p})memory"),
        "requests_per_s_per_worker": _num(row, f"({p})seq/s/worker"),
    }


def _disagg_entry(row: dict, total_gpus: int, ttft_t: float, tpot_t: float) -> dict:
    return _entry(row, total_gpus, ttft_t, tpot_t, {
        "prefill": _disagg_worker(row, "p"),
        "decode": _disagg_worker(row, "d"),
        "quant": {k: _num(row, f"(p){k}") for k in ("gemm", "kvcache", "fmha", "moe", "comm")},
    })


def run_default(req: dict, model_path: str, common: dict) -> dict:
    from aiconfigurator.cli.api import cli_default

    total_gpus = _int(req, "total_gpus", required=True)
    ttft = _float(req, "ttft_ms", required=True)
    tpot = _float(req, "tpot_ms", required=True)
    top_n = _int(req, "top_n", 5)
    strict_sla = bool(req.get("strict_sla", False))
    save_dir = req.get("save_dir")
    kwargs = dict(
        model_path=model_path,
        total_gpus=total_gpus,
        system=common["system"],
        backend=common["backend"],
        backend_version=common["backend_version"],
        database_mode=common["database_mode"],
        isl=common["isl"],
        osl=common["osl"],
        ttft=ttft,
        tpot=tpot,
        top_n=top_n,
        strict_sla=strict_sla,
    )
    if req.get("request_latency_ms") is not None:
        kwargs["request_latency"] = _float(req, "request_latency_ms")
    if req.get("free_gpu_memory_fraction") is not None:
        kwargs["free_gpu_memory_fraction"] = _float(req, "free_gpu_memory_fraction")
    if save_dir:
        kwargs["save_dir"] = str(save_dir)

    cli = [
        "aiconfigurator", "cli", "default",
        "--model-path", model_path,
        "--total-gpus", str(total_gpus),
        "--system", common["system"],
        "--backend", common["backend"],
        "--perf-db-version", common["backend_version"],
        "--database-mode", common["database_mode"],
        "--isl", str(common["isl"]), "--osl", str(common["osl"]),
        "--ttft", f"{ttft:g}", "--tpot", f"{tpot:g}",
        "--top-n", str(top_n),
    ]  # fmt: skip
    if strict_sla:
        cli.append("--strict-sla")
    if "request_latency" in kwargs:
        cli += ["--request-latency", f"{kwargs['request_latency']:g}"]
    if "free_gpu_memory_fraction" in kwargs:
        cli += ["--free-gpu-memory-fraction", f"{kwargs['free_gpu_memory_fraction']:g}"]
    if save_dir:
        cli += ["--save-dir", str(save_dir)]

    t0 = time.perf_counter()
    try:
        result = cli_default(**kwargs)
    except Exception as exc:  # e.g. NoFeasibleConfigError: a request-level failure (exit 2)
        raise RequestError(f"cli_default failed: {type(exc).__name__}: {exc}") from exc
    elapsed = time.perf_counter() - t0

    out = {
        "ok": True,
        "chosen": result.chosen_exp,
        "best_tokens_per_s_per_gpu_cluster": _clean(result.best_throughputs),
        "elapsed_s": round(elapsed, 3),
        "api_call": "aiconfigurator.cli.api.cli_default(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")",
        "equivalent_cli": shlex.join(cli),
    }
    for mode in ("agg", "disagg"):
        df = result.best_configs.get(mode)
        outcome = result.outcomes.get(mode) if result.outcomes else None
        err = getattr(outcome, "error", None) if outcome is not None else None
        pareto = result.pareto_fronts.get(mode)
        entry_fn = _agg_entry if mode == "agg" else _disagg_entry
        if df is None or len(df) == 0:
            out[mode] = {"best": None, "top": [], "error": str(err) if err else "no configuration found"}
            continue
        rows = [
            {k: v for k, v in r.items() if not str(k).startswith("_")}
            for r in df.to_dict("records")
        ]
        top = [entry_fn(r, total_gpus, ttft, tpot) for r in rows]
        for rank, (t, r) in enumerate(zip(top, rows, strict=True), start=1):
            t["rank"] = rank
            t["raw"] = _clean(r)
        out[mode] = {
            "best": top[0],
            "top": top,
            "pareto_points": 0 if pareto is None else int(len(pareto)),
            "error": str(err) if err else None,
        }
    return out


# --------------------------------------------------------------------------- estimate


def _point_kwargs(point: dict, is_moe: bool) -> dict:
    if not isinstance(point, dict):
        raise ValueError(f"point must be an object, got {point!r}")
    tp = _int(point, "tp", 1)
    batch = _int(point, "batch", None) if "batch" in point else _int(point, "batch_size", None)
    if batch is None:
        raise ValueError("point needs 'batch'")
    kw = {
        "tp_size": tp,
        "pp_size": _int(point, "pp", 1),
        "attention_dp_size": _int(point, "dp", 1),
        "batch_size": batch,
    }
    ep = _int(point, "ep", None)
    moe_tp = _int(point, "moe_tp", None)
    if is_moe:
        if ep is None and moe_tp is None:
            ep = 1
        kw["moe_ep_size"] = ep
        kw["moe_tp_size"] = moe_tp
    elif ep not in (None, 1) or moe_tp not in (None, 1):
        raise ValueError("ep/moe_tp given for a dense (non-MoE) model")
    return kw


def _static_summary(res) -> dict:
    raw = res.raw
    return {
        "prefill_ms": _num(raw, "context_latency"),  # prefill of the whole batch at once
        "ttft_ms": _num(raw, "ttft"),
        "tpot_ms": _num(raw, "tpot"),
        "decode_ms": _num(raw, "generation_latency"),
        "request_latency_ms": _num(raw, "request_latency"),
        "tokens_per_s_per_gpu": _num(raw, "tokens/s/gpu"),
        "tokens_per_s_per_user": _num(raw, "tokens/s/user"),
        "memory_gb": _num(raw, "memory"),
        "gpus": _num(raw, "num_total_gpus"),
        "oom": bool(res.summary.check_oom()) if res.summary is not None else None,
        "warning": res.kv_cache_warning,
    }


def _agg_summary(res) -> dict:
    raw = res.raw
    return {
        "ttft_ms": _num(raw, "ttft"),
        "tpot_ms": _num(raw, "tpot"),
        "request_latency_ms": _num(raw, "request_latency"),
        "tokens_per_s_per_gpu": _num(raw, "tokens/s/gpu"),
        "tokens_per_s_per_user": _num(raw, "tokens/s/user"),
        "requests_per_s": _num(raw, "seq/s"),
        "ctx_tokens": _num(raw, "ctx_tokens"),
        "memory_gb": _num(raw, "memory"),
        "gpus": _num(raw, "num_total_gpus"),
        "kv_cache_oom": bool(res.summary.check_kv_cache_oom()) if res.summary is not None else None,
        "warning": res.kv_cache_warning,
    }


def run_estimate(req: dict, model_path: str, common: dict) -> dict:
    from aiconfigurator.cli.api import cli_estimate
    from aiconfigurator.sdk.models import check_is_moe

    points = req.get("points")
    if not isinstance(points, list) or not points:
        raise RequestError("'points' must be a non-empty list")
    modes = req.get("modes", ["static", "agg"])
    if isinstance(modes, str):
        modes = [modes]
    bad = [m for m in modes if m not in ("static", "agg", "static_ctx", "static_gen")]
    if bad or not modes:
        raise RequestError(f"unknown modes {bad}; use 'static', 'agg', 'static_ctx', 'static_gen'")
    is_moe = bool(check_is_moe(model_path))
    base = dict(
        backend_name=common["backend"],
        backend_version=common["backend_version"],
        database_mode=common["database_mode"],
        isl=common["isl"],
        osl=common["osl"],
    )
    t_all = time.perf_counter()
    results = []
    for point in points:
        entry = {"point": point}
        try:
            pk = _point_kwargs(point, is_moe)
        except (ValueError, RequestError) as exc:
            entry["error"] = str(exc)
            results.append(entry)
            continue
        for mode in modes:
            kw = dict(base, mode=mode, **pk)
            if mode == "agg" and point.get("ctx_tokens") is not None:
                kw["ctx_tokens"] = int(point["ctx_tokens"])
            t0 = time.perf_counter()
            try:
                res = cli_estimate(model_path, common["system"], **kw)
                summ = _agg_summary(res) if mode == "agg" else _static_summary(res)
            except Exception as exc:
                summ = {"error": f"{type(exc).__name__}: {exc}"}
            summ["elapsed_s"] = round(time.perf_counter() - t0, 3)
            summ["api_call"] = (
                f"aiconfigurator.cli.api.cli_estimate({model_path!r}, {common['system']!r}, "
                + ", ".join(f"{k}={v!r}" for k, v in kw.items())
                + ")"
            )
            entry[mode] = summ
        results.append(entry)
    return {
        "ok": True,
        "is_moe": is_moe,
        "modes": modes,
        "points": results,
        "elapsed_s": round(time.perf_counter() - t_all, 3),
    }


# --------------------------------------------------------------------------- main


def _read_request(argv: list[str]) -> dict:
    if len(argv) > 2:
        raise RequestError("usage: aic_runner.py [REQUEST.json|-]")
    src = argv[1] if len(argv) == 2 else "-"
    try:
        text = sys.stdin.read() if src == "-" else open(src).read()
    except OSError as exc:
        raise RequestError(f"cannot read request: {exc}") from exc
    try:
        req = json.loads(text)
    except ValueError as exc:
        raise RequestError(f"request is not valid JSON: {exc}") from exc
    if not isinstance(req, dict):
        raise RequestError("request must be a JSON object")
    return req


def main(argv: list[str]) -> int:
    t_start = time.perf_counter()
    try:
        req = _read_request(argv)
        kind = req.get("kind")
        if kind not in ("default", "estimate"):
            raise RequestError(f"'kind' must be 'default' or 'estimate', got {kind!r}")
        _setup_logging(req.get("log_level", "WARNING"))
        system = req.get("system")
        if not system:
            raise RequestError("'system' is required (e.g. h100_sxm)")
        backend = req.get("backend", "trtllm")
        isl = _int(req, "isl", required=True)
        osl = _int(req, "osl", required=True)
        model_root = os.path.join(tempfile.gettempdir(), "aic_runner_models")
        model_path = _prepare_model_path(req.get("model_config"), model_root)
        with _stdout_to_stderr():
            try:
                import aiconfigurator  # noqa: F401
            except ImportError as exc:
                raise RequestError(
                    f"aiconfigurator is not importable from {sys.executable}: {exc}"
                ) from exc
            t_ver = time.perf_counter()
            backend_version = _resolve_backend_version(system, backend, req.get("backend_version"))
            common = {
                "system": system,
                "backend": backend,
                "backend_version": backend_version,
                "database_mode": str(req.get("database_mode", "SILICON")),
                "isl": isl,
                "osl": osl,
            }
            t_ver = time.perf_counter() - t_ver
            if kind == "default":
                body = run_default(req, model_path, common)
            else:
                body = run_estimate(req, model_path, common)
        out = {
            "kind": kind,
            "aiconfigurator_version": _versions(),
            "python": sys.executable,
            "model_config": req.get("model_config"),
            "model_path_used": model_path,
            **{k: v for k, v in common.items()},
            "backend_version_requested": req.get("backend_version"),
            "backend_version_resolve_s": round(t_ver, 3),
        }
        if kind == "default":
            out.update(total_gpus=req.get("total_gpus"), ttft_ms=req.get("ttft_ms"), tpot_ms=req.get("tpot_ms"))
        out.update(body)
        out["wall_s"] = round(time.perf_counter() - t_start, 3)
        sys.stdout.write(json.dumps(_clean(out), indent=1) + "\n")
        sys.stdout.flush()
        return 0
    except RequestError as exc:
        print(f"aic_runner: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    except Exception as exc:  # anything unexpected: still one line, exit 2
        print(f"aic_runner: {type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
