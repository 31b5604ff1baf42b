"""Fitting the cost model's terms to measured decode steps, per GPU type (`opweave calibrate`).

A measurement is one colocated decode point: GPU type, model, TP degree, resident batch, context
and the measured time per output token. The cost model (`opweave.cost.model`) predicts it as the
sum over the model's ops of

    max(m_i, c_i) + serial_fraction * min(m_i, c_i)    m_i = a_i / mem_efficiency + k_i / kv_efficiency
    + launch_overhead * ops + step_overhead + batch * sequence_overhead
    + collective_latency * collectives + the ring's link time

with a_i the op's weight and activation bytes and k_i its state bytes over the GPU's bandwidth,
c_i its math time. `Features` holds those per row, so a prediction is a few array operations and
the fit never leaves the cost model's own accounting (`tests/test_calibrate.py` checks that a
fitted catalog makes `CostModel` give the same figures).

The fit (`fit_gpu`) minimises the relative error of the rows of one GPU type: Gauss-Newton on the
piecewise-linear prediction, each step a bounded linear least-squares problem (efficiencies in
(0, 1], the serial fraction in [0, 1], the overheads >= 0), with Huber weights so that a few
outlying rows (a published point can be off by 2x) do not pull the fit. A term the rows cannot
tell apart from the others (`Term` order sets which one gives way) is not fitted: it keeps the
starting catalog's value and the fit says why, in one line.

Leave-one-group-out (`leave_one_group_out`): every group (GPU, model, TP, and engine when the
file has that column) is predicted by a fit of its GPU type's other groups.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import math
import os
import re
import statistics

import numpy as np

from opweave.cost.model import CostModel, needs_allreduce, op_stream_bytes, shards, state_shards
from opweave.errors import OpWeaveError
from opweave.hardware.catalog import GPUSpec, get_gpu
from opweave.ir.kinds import OpKind

REQUIRED_COLUMNS = ("gpu", "model", "tp", "batch", "context", "tpot_ms")
LIMITS = {"tp": 1024, "batch": 1 << 20, "context": 1 << 24, "tpot_ms": 1e6}
"""The largest value of each column a measurement may have: TP over 1024 GPUs, a resident batch
of 1,048,576 sequences, a 16M-token context, 1000 s per output token. Anything larger is a typo
(or a unit mix-up), and bounding them keeps every derived figure finite and the fit fast."""
MIN_ROWS_PER_GPU = 4
"""Fewer rows of one GPU type than this cannot say anything about more than a term or two."""

HUBER_DELTA = 0.08
"""Relative residual beyond which a row's weight falls off (Huber): a few published points are
off by up to 2x (`bench/data/README.md` names one)."""

IDENTIFIABLE_MIN = 0.02
"""A term is identifiable when its column of the (relative) Jacobian, scaled to unit length, is
at least this far from the span of the other terms' columns."""

GN_ITERATIONS = 60

MAX_STREAM_EFFICIENCY = 0.92
"""No kernel streams memory faster than a copy: 0.906 of peak for a device copy on an H100 NVL,
0.90 for FlashMLA's decode attention on an H800 (refdata efficiency.memory_bandwidth_fraction)."""


@dataclasses.dataclass(frozen=True)
class Term:
    """One fitted catalog field: how it enters the prediction and its bounds."""

    field: str
    inverse: bool      # fitted as 1 / value (an efficiency); bounds apply to the fitted parameter
    lower: float
    upper: float
    unit: str          # how reports print it


TERMS = (
    Term("mem_efficiency", True, 1.0 / MAX_STREAM_EFFICIENCY, math.inf, "fraction"),
    Term("kv_efficiency", True, 1.0 / MAX_STREAM_EFFICIENCY, math.inf, "fraction"),
    Term("step_overhead", False, 0.0, math.inf, "us"),
    Term("sequence_overhead", False, 0.0, math.inf, "us"),
    Term("collective_latency", False, 0.0, math.inf, "us"),
    Term("serial_fraction", False, 0.0, 1.0, "fraction"),
    Term("launch_overhead", False, 1.28e-6, math.inf, "us"),
)
"""In priority order: when two terms cannot be told apart, the later one keeps its starting value.
The launch overhead is at least a kernel's cost inside a replayed CUDA graph, 1.28 us on an H100
NVL (refdata efficiency.launch_overhead.python_issued_op_vs_graph_replay_H100NVL)."""
TERM_NAMES = tuple(t.field for t in TERMS)


# ---------------------------------------------------------------- reading measurements


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    line: int          # line in the file (header = 1)
    gpu: str           # catalog name
    model: str         # the MODEL argument as written
    engine: str        # "" when the file has no engine column
    tp: int
    batch: int
    context: int
    tpot_s: float

    @property
    def group(self) -> str:
        return group_name(self.gpu, self.engine, self.model, self.tp)


def group_name(gpu: str, engine: str, model: str, tp: int) -> str:
    """"h100 vllm llama-3.1-8b tp2": the rows of one GPU type, engine, model and TP degree."""
    return f"{gpu}{' ' + engine if engine else ''} {model} tp{tp}"


def _groups(rows: list[Measurement]) -> tuple[str, ...]:
    """The groups of `rows`, in order of appearance."""
    return tuple(group_name(*key) for key in dict.fromkeys((r.gpu, r.engine, r.model, r.tp) for r in rows))


def read_measurements(path: str, catalog: dict[str, GPUSpec]) -> list[Measurement]:
    """The rows of a measurements CSV (UTF-8, with or without a byte-order mark); one-line
    OpWeaveError for a missing file or column, a value that is not a positive number or is
    beyond `LIMITS`, an unknown GPU type, or no rows."""
    gpus: dict[str, str] = {}  # as written -> catalog name
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise OpWeaveError(f"{path}: missing column(s) {', '.join(missing)} "
                                   f"(a measurements CSV has {', '.join(REQUIRED_COLUMNS)})")
            reader.fieldnames = header
            rows = [_measurement(path, reader.line_num, raw, catalog, gpus) for raw in reader]
    except FileNotFoundError:
        raise OpWeaveError(f"measurements file '{path}' not found") from None
    except IsADirectoryError:
        raise OpWeaveError(f"{path}: is a folder, not a measurements CSV") from None
    except UnicodeDecodeError:
        raise OpWeaveError(f"{path}: not UTF-8 text (a measurements CSV is text)") from None
    except csv.Error as e:
        raise OpWeaveError(f"{path}: not a readable CSV ({e})") from None
    if not rows:
        raise OpWeaveError(f"{path}: no measurement rows")
    return rows


def _measurement(path: str, line: int, raw: dict, catalog: dict[str, GPUSpec], gpus: dict[str, str]) -> Measurement:
    """One row (`gpus` caches the GPU names already resolved)."""
    where = f"{path} line {line}"

    def text(column: str) -> str:
        value = raw.get(column)
        if value is None or not str(value).strip():
            raise OpWeaveError(f"{where}: empty {column}")
        return str(value).strip()

    def whole(column: str) -> int:
        value = text(column)
        try:
            number = float(value)
        except ValueError:
            raise OpWeaveError(f"{where}: {column} must be a whole number, got {value[:30]!r}") from None
        if not math.isfinite(number) or number != int(number) or number <= 0:
            raise OpWeaveError(f"{where}: {column} must be a positive whole number, got {value[:30]!r}")
        if number > LIMITS[column]:
            raise OpWeaveError(f"{where}: {column} must be at most {LIMITS[column]:,}, got {value[:30]!r}")
        return int(number)

    tpot = text("tpot_ms")
    try:
        tpot_ms = float(tpot)
    except ValueError:
        raise OpWeaveError(f"{where}: tpot_ms must be a number, got {tpot[:30]!r}") from None
    if not math.isfinite(tpot_ms) or tpot_ms <= 0:
        raise OpWeaveError(f"{where}: tpot_ms must be a positive number, got {tpot[:30]!r}")
    if tpot_ms > LIMITS["tpot_ms"]:
        raise OpWeaveError(f"{where}: tpot_ms must be at most {LIMITS['tpot_ms']:,.0f} (ms per output token), "
                           f"got {tpot[:30]!r}")
    name = text("gpu")
    if name not in gpus:
        try:
            gpus[name] = get_gpu(name, catalog).name
        except OpWeaveError as e:
            raise OpWeaveError(f"{where}: {e}") from None
    gpu = gpus[name]
    return Measurement(line=line, gpu=gpu, model=text("model"), engine=str(raw.get("engine") or "").strip(),
                       tp=whole("tp"), batch=whole("batch"), context=whole("context"), tpot_s=tpot_ms / 1e3)


# ---------------------------------------------------------------- features of each row


@dataclasses.dataclass(frozen=True, kw_only=True)
class Features:
    """What the prediction of each row needs, for rows of one GPU type.

    Rows measured at the same point (model, TP, batch and context) share its figures: the arrays
    hold one entry per distinct point, and per-op arrays one column per distinct op (padded with
    zeros); `point` and `measured` are per row."""

    stream: np.ndarray      # [points, ops] weight + activation bytes / mem_bandwidth (s at efficiency 1)
    state: np.ndarray       # [points, ops] state bytes / mem_bandwidth
    math: np.ndarray        # [points, ops] math time at the catalog's GEMM efficiency
    num_ops: np.ndarray     # [points]
    batch: np.ndarray       # [points]
    collectives: np.ndarray  # [points] TP collectives per step
    ring_s: np.ndarray      # [points] the collectives' link time (hops and bytes)
    tp: np.ndarray          # [points] TP degree
    point: np.ndarray       # [rows] the row's point
    measured: np.ndarray    # [rows] seconds

    def per_point(self, values: np.ndarray) -> np.ndarray:
        """The sums of per-row `values` over the rows of each point."""
        return np.bincount(self.point, weights=values, minlength=len(self.batch))

    @functools.cached_property
    def sums(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per point: the sums of stream, state and math; and the columns where some point has state."""
        kv = np.flatnonzero(self.state.any(axis=0))
        return _row_sums(self.stream), _row_sums(self.state[:, kv]), _row_sums(self.math), kv


_PER_ROW = ("point", "measured")


def graph_of(model: str, graphs: dict) -> object:
    """The IR of a MODEL argument, resolved once."""
    if model not in graphs:
        from opweave.compiler.frontend import run_front_end

        graphs[model] = run_front_end(model).graph
    return graphs[model]


def features(rows: list[Measurement], gpu: GPUSpec, graphs: dict) -> Features:
    """The per-op arrays of `rows` (all of GPU type `gpu`), built per (model, TP) group of rows.

    Note: ops that differ only in their place in the model (the same op in another layer) cost
    the same, so they share one column holding their sum: an op's terms scale with its count
    (max(k m, k c) = k max(m, c)), so the prediction and its Jacobian are unchanged, and a
    column per distinct op (a dozen for a dense model) keeps 200,000 rows a few arrays."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r.model, r.tp), []).append(i)
    parts = [_group_features(graph_of(model, graphs), gpu, [rows[i] for i in index])
             for (model, _), index in groups.items()]
    width = max(part["stream"].shape[1] for part in parts)
    point = np.zeros(len(rows), dtype=int)
    offset = 0
    for index, part in zip(groups.values(), parts):
        point[np.array(index)] = part.pop("point") + offset
        offset += len(part["batch"])
        for name in ("stream", "state", "math"):
            part[name] = np.pad(part[name], ((0, 0), (0, width - part[name].shape[1])))
    columns = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    columns["collectives"] = np.round(columns["collectives"])
    return Features(**columns, point=point, measured=np.array([r.tpot_s for r in rows]))


def _cost_key(op) -> object:
    """`op` without its place in the model (index, layer, inputs, the layer's number in its names):
    equal for the same op in two layers, whose costs are the same."""
    if op.layer is None:
        return op
    number = re.compile(rf"(^|\.){op.layer}(\.|$)")

    def anonymous(name: str) -> str:
        return number.sub(r"\1#\2", name)

    return dataclasses.replace(op, index=0, layer=None, inputs=(), name=anonymous(op.name),
                               weights=tuple(dataclasses.replace(w, name=anonymous(w.name)) for w in op.weights))


def _group_features(graph, gpu: GPUSpec, rows: list[Measurement]):
    """The `Features` fields of rows of one model and TP degree, but `measured`: per distinct
    (batch, context) point, stream, state and math of each distinct op ([points, distinct ops],
    times the op's count), ops, collectives and ring seconds; per row, its point. Each term is
    computed once per distinct batch or context."""
    from opweave.cost.estimate import tp_problem

    first, tp = rows[0], rows[0].tp
    why = tp_problem(graph, gpu, tp)
    if why is not None:
        raise OpWeaveError(f"line {first.line} ({first.group}): {why}")
    ops = graph.ops
    if not any(op.kind == OpKind.EMBED for op in ops):
        raise OpWeaveError(f"line {first.line} ({first.group}): the model has no embedding op to carry the step costs")
    distinct: dict[object, list] = {}   # cost key -> [op, count]
    pairs: dict[object, list] = {}      # (cost key, all-reduced) -> [op, the op after it, count]
    for j, op in enumerate(ops):
        following = ops[j + 1] if j + 1 < len(ops) else None
        key = _cost_key(op)
        distinct.setdefault(key, [op, 0])[1] += 1
        pairs.setdefault((key, needs_allreduce(op, following)), [op, following, 0])[2] += 1
    points, point = np.unique(np.array([(r.batch, r.context) for r in rows], dtype=np.int64), axis=0,
                              return_inverse=True)
    batches, batch_at = np.unique(points[:, 0], return_inverse=True)
    contexts, context_at = np.unique(points[:, 1], return_inverse=True)
    counts = np.array([count for _, count in distinct.values()], dtype=float)
    reps = [op for op, _ in distinct.values()]
    stream = np.array([[op_stream_bytes(op, tp, b) / gpu.mem_bandwidth for op in reps] for b in batches.tolist()])
    state_bytes = np.zeros((len(contexts), len(reps)))
    flops = np.tile([float(op.flops_at(0)) for op in reps], (len(contexts), 1))
    for j, op in enumerate(reps):
        if op.state is not None:  # an op without state costs the same at every context (`Op.flops_at`)
            state_bytes[:, j] = [op.state_bytes(s) for s in contexts.tolist()]
            flops[:, j] = [op.flops_at(s) for s in contexts.tolist()]
    state_div = np.array([state_shards(op, tp) for op in reps], dtype=float)
    flops_div = np.array([shards(op, tp) for op in reps], dtype=float)
    batch = points[:, :1].astype(float)
    # op_state_bytes and op_flops (layout "tp": no expert-parallel factors), per point
    state = batch * state_bytes[context_at] / state_div / gpu.mem_bandwidth
    math_s = batch * flops[context_at] / flops_div / gpu.effective_flops
    hidden = graph.cuts[0].bytes_per_token if graph.cuts else 0
    silent = dataclasses.replace(gpu, collective_latency=0.0)
    counted = dataclasses.replace(gpu, collective_latency=1.0)
    model = CostModel()
    ring, collectives = np.zeros(len(batches)), np.zeros(len(batches))
    for k, b in enumerate(batches.tolist()):
        for op, following, count in pairs.values():
            base = model.collectives_s(op, silent, tp, b, hidden, following)
            ring[k] += count * base
            collectives[k] += count * (model.collectives_s(op, counted, tp, b, hidden, following) - base)
    return {"stream": stream[batch_at] * counts, "state": state * counts, "math": math_s * counts,
            "num_ops": np.full(len(points), float(len(ops))), "batch": batch[:, 0],
            "collectives": collectives[batch_at], "ring_s": ring[batch_at], "tp": np.full(len(points), float(tp)),
            "point": point.reshape(-1)}


def take(f: Features, index: np.ndarray) -> Features:
    """The rows `index` of `f` (with only their points)."""
    used, point = np.unique(f.point[index], return_inverse=True)
    per_point = {field.name: getattr(f, field.name)[used] for field in dataclasses.fields(Features)
                 if field.name not in _PER_ROW}
    return Features(**per_point, point=point.reshape(-1), measured=f.measured[index])


# ---------------------------------------------------------------- prediction and fit


def params_of(gpu: GPUSpec) -> np.ndarray:
    """The fitted parameters of a catalog entry (efficiencies as their inverses)."""
    values = []
    for t in TERMS:
        v = getattr(gpu, t.field)
        if t.field == "kv_efficiency" and v is None:
            v = gpu.mem_efficiency
        values.append(1.0 / v if t.inverse else v)
    return np.array(values, dtype=float)


def values_of(params: np.ndarray) -> dict[str, float]:
    """Catalog field values of fitted parameters."""
    return {t.field: float(1.0 / p if t.inverse else p) for t, p in zip(TERMS, params)}


def predict(params: np.ndarray, f: Features) -> np.ndarray:
    """Predicted seconds per token of every row."""
    return _predict_and_jacobian(params, f, jacobian=False)[0][f.point]


def _predict_and_jacobian(params: np.ndarray, f: Features, jacobian: bool = True):
    """Predictions at each point and their Jacobian in the parameters ([points, terms]).

    Note: per op, max(m, c) + serial * min(m, c) = m + c - (1 - serial) * min(m, c), and the
    sums of m and c are linear in the parameters (`Features.sums`): of the per-op arrays only
    min(m, c) and which ops are memory-bound are computed, a handful of passes over them."""
    u_w, u_kv, step, seq, coll, serial, launch = params
    stream_sum, state_sum, math_sum, kv = f.sums
    mem = np.multiply(f.stream, u_w)
    mem[:, kv] += f.state[:, kv] * u_kv
    lo_sum = _row_sums(np.minimum(mem, f.math))
    pred = u_w * stream_sum + u_kv * state_sum + math_sum - (1.0 - serial) * lo_sum
    pred += f.num_ops * launch + step + f.batch * seq + f.collectives * coll + f.ring_s
    if not jacobian:
        return pred, None
    bound = mem >= f.math  # memory-bound ops: d(max + serial * min) / dm = 1, else serial
    d_stream = serial * stream_sum + (1.0 - serial) * np.einsum("ij,ij->i", f.stream, bound)
    d_state = serial * state_sum + (1.0 - serial) * np.einsum("ij,ij->i", f.state[:, kv], bound[:, kv])
    jac = np.stack([d_stream, d_state, np.ones_like(pred), f.batch, f.collectives, lo_sum, f.num_ops], axis=1)
    return pred, jac


def _row_sums(a: np.ndarray) -> np.ndarray:
    """Row sums of a [rows, ops] array (einsum: a third of the time of `sum(axis=1)` on narrow rows)."""
    return np.einsum("ij->i", a)


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """min ||a x - b|| over x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    gradient = a.T @ (b - a @ x)
    for _ in range(3 * n + 10):
        if passive.all() or gradient[~passive].max(initial=-np.inf) <= tol:
            break
        candidates = np.where(~passive, gradient, -np.inf)
        passive[int(np.argmax(candidates))] = True
        for _ in range(3 * n + 10):
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            shrinking = passive & (z <= tol)
            alpha = np.min(x[shrinking] / np.maximum(x[shrinking] - z[shrinking], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        gradient = a.T @ (b - a @ x)
    return x


def bounded_lstsq(a: np.ndarray, b: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """min ||a x - b|| over lower <= x <= upper (upper bounds by fixing a variable that exceeds its
    bound at the bound and solving again)."""
    fixed = np.zeros(a.shape[1], dtype=bool)
    x = lower.copy()
    for _ in range(a.shape[1] + 1):
        free = ~fixed
        rhs = b - a[:, fixed] @ x[fixed] - a[:, free] @ lower[free]
        x[free] = lower[free] + nnls(a[:, free], rhs)
        over = free & (x > upper)
        if not over.any():
            return x
        x[over] = upper[over]
        fixed |= over
    return np.minimum(x, upper)


def _cholesky_qr(a: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(Q, R) of a tall `a` by Cholesky QR twice: three passes of matrix products over the rows,
    as accurate as Householder QR for a condition number up to about 1e7 (Yamamoto et al. 2015);
    None for a worse conditioned `a`."""
    try:
        r = np.linalg.cholesky(a.T @ a).T
        diagonal = np.abs(np.diag(r))
        if diagonal.min() <= 1e-7 * diagonal.max():
            return None
        q = a @ np.linalg.inv(r)
        r2 = np.linalg.cholesky(q.T @ q).T
    except np.linalg.LinAlgError:
        return None
    return q @ np.linalg.inv(r2), r2 @ r


def _triangular(a: np.ndarray) -> np.ndarray:
    """R of a's QR: ||a x - a y|| = ||R x - R y|| for all x, y, in min(rows, columns) rows."""
    fast = _cholesky_qr(a) if a.shape[0] > 4 * a.shape[1] else None
    return np.linalg.qr(a, mode="r") if fast is None else fast[1]


def _reduced(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, Q^T b) from a's QR: min ||R x - Q^T b|| has the minimisers of min ||a x - b|| (under any
    bounds), in as many rows as a has columns: each bounded solve costs the same for any row count."""
    fast = _cholesky_qr(a) if a.shape[0] > 4 * a.shape[1] else None
    q, r = np.linalg.qr(a) if fast is None else fast
    return r, q.T @ b


def _weights(pred: np.ndarray, f: Features) -> np.ndarray:
    """Per row: 1 / measured (relative error), times the Huber weight of its residual at `pred`
    (per point)."""
    rel = np.abs(pred[f.point] / f.measured - 1.0)
    huber = np.where(rel <= HUBER_DELTA, 1.0, HUBER_DELTA / np.maximum(rel, 1e-300))
    return np.sqrt(huber) / f.measured


def not_identifiable(params: np.ndarray, f: Features, fixed: dict[str, str] | None = None,
                     jac: np.ndarray | None = None) -> dict[str, str]:
    """Terms the rows of `f` cannot identify -> the one-line reason (the rest can be fitted);
    `jac`: the Jacobian at `params`, when the caller has it."""
    reasons = dict(fixed or {})
    batches = np.unique(f.batch)
    if len(batches) == 1:
        reasons.setdefault("sequence_overhead", f"every row has batch {int(batches[0])}, so the per-sequence "
                                                "cost cannot be told apart from the per-step cost")
    if (f.tp == 1).all():
        reasons.setdefault("collective_latency", "every row has TP 1 (no collectives)")
    if not f.state.any():
        reasons.setdefault("kv_efficiency", "no row reads KV cache or state")
    if len(np.unique(f.num_ops)) == 1:
        reasons.setdefault("launch_overhead", f"every row's model has {int(f.num_ops[0])} ops, so the per-op "
                                              "launch overhead cannot be told apart from the per-step cost")
    if jac is None:
        jac = _predict_and_jacobian(params, f)[1]
    jac = jac * np.sqrt(f.per_point(f.measured ** -2.0))[:, None]  # each row's relative error, per point
    while True:
        free = [i for i, t in enumerate(TERMS) if t.field not in reasons]
        if not free:
            return reasons
        cols = jac[:, free]
        norms = np.linalg.norm(cols, axis=0)
        cols = _triangular(cols)  # the same regressions below, on a few rows instead of one per measurement
        weak = []
        for pos, i in enumerate(free):
            if norms[pos] == 0:
                weak.append((i, 0.0, []))
                continue
            unit = cols / np.where(norms > 0, norms, 1.0)
            others = np.delete(unit, pos, axis=1)
            if others.shape[1] == 0:
                continue
            coef = np.linalg.lstsq(others, unit[:, pos], rcond=None)[0]
            distance = float(np.linalg.norm(unit[:, pos] - others @ coef))
            if distance < IDENTIFIABLE_MIN:
                other_ids = [j for j in free if j != i]
                weak.append((i, distance, [TERMS[other_ids[k]].field for k in np.argsort(-np.abs(coef))[:2]]))
        if not weak:
            return reasons
        i, distance, like = max(weak, key=lambda w: w[0])  # the lowest-priority weak term gives way
        reasons[TERMS[i].field] = ("has no effect on these rows" if distance == 0 else
                                   f"these rows cannot tell it apart from {' and '.join(like) or 'the other terms'}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPUFit:
    """The fit of one GPU type."""

    gpu: str
    start: dict[str, float]       # the starting catalog's values
    values: dict[str, float]      # fitted (or kept) values of every term
    held: dict[str, str]          # terms kept at their starting value -> why
    rows: int
    groups: tuple[str, ...]


def fit_gpu(gpu: GPUSpec, f: Features, rows: list[Measurement],
            held: dict[str, str] | None = None) -> GPUFit:
    """Fits the terms of `gpu` to `rows` (their `f`), starting from the entry's values."""
    if len(rows) < MIN_ROWS_PER_GPU:
        raise OpWeaveError(f"{gpu.name}: {len(rows)} measurement row(s), at least {MIN_ROWS_PER_GPU} are needed "
                           "to fit its terms")
    start = params_of(gpu)
    reasons = not_identifiable(start, f, held)
    if "mem_efficiency" in reasons:
        raise OpWeaveError(f"{gpu.name}: cannot fit the weight-streaming efficiency: {reasons['mem_efficiency']}")
    free = np.array([t.field not in reasons for t in TERMS])
    lower = np.array([t.lower for t in TERMS])[free]
    upper = np.array([t.upper for t in TERMS])[free]
    params = start.copy()
    params[free] = np.clip(params[free], lower, upper)
    pred, jac = _predict_and_jacobian(params, f)
    for _ in range(GN_ITERATIONS):
        # the rows' weighted least squares, per point: over a point's rows, the sum of
        # w_i^2 (measured_i - model)^2 is W^2 (target - model)^2 + a constant, with W^2 the sum
        # of the w_i^2 and target the w_i^2-weighted mean of the measured values
        w2 = _weights(pred, f) ** 2
        w = np.sqrt(f.per_point(w2))
        target = f.per_point(w2 * f.measured) / w ** 2
        a = jac[:, free] * w[:, None]
        scale = np.linalg.norm(a, axis=0)
        scale = np.where(scale > 0, scale, 1.0)
        rhs = w * (target - pred + jac[:, free] @ params[free])
        step = bounded_lstsq(*_reduced(a / scale, rhs), lower * scale, upper * scale) / scale
        moved = np.max(np.abs(step - params[free]) / np.maximum(np.abs(params[free]), 1e-9))
        params[free] = step
        if moved < 1e-7:
            break
        pred, jac = _predict_and_jacobian(params, f)
        late = not_identifiable(params, f, reasons, jac)  # a term may become unidentifiable at the fit
        if len(late) > len(reasons):
            reasons = late
            drop = np.array([t.field in reasons for t in TERMS]) & free
            params[drop] = start[drop]
            free = free & ~drop
            lower = np.array([t.lower for t in TERMS])[free]
            upper = np.array([t.upper for t in TERMS])[free]
            pred, jac = _predict_and_jacobian(params, f)
    return GPUFit(gpu=gpu.name, start=values_of(start), values=values_of(params), held=reasons, rows=len(rows),
                  groups=_groups(rows))


def fitted_spec(gpu: GPUSpec, fit: GPUFit) -> GPUSpec:
    """`gpu` with the fitted values."""
    return dataclasses.replace(gpu, **fit.values)


# ---------------------------------------------------------------- the whole calibration


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupReport:
    group: str
    gpu: str
    rows: int
    measured_ms: tuple[float, ...]
    before_ms: tuple[float, ...]   # the starting catalog
    after_ms: tuple[float, ...]    # the fit of all rows
    logo_ms: tuple[float, ...]     # the fit of the other groups of its GPU type (empty: not possible)
    logo_note: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    source: str
    fits: tuple[GPUFit, ...]
    groups: tuple[GroupReport, ...]
    rows: tuple[Measurement, ...]


def _rel_errors(pred: tuple[float, ...], measured: tuple[float, ...]) -> list[float]:
    return [p / m - 1.0 for p, m in zip(pred, measured)]


def calibrate(path: str, catalog: dict[str, GPUSpec], logo: bool = True, engine: str | None = None,
              graphs: dict | None = None, progress=None) -> Calibration:
    """Reads `path` (only the rows of `engine`, when given), fits every GPU type in it, and (with
    `logo`) predicts each group from a fit of the others. `progress` gets a line per model traced
    and per fit (a file of several large models takes seconds to trace)."""
    say = progress or (lambda message: None)
    every = read_measurements(path, catalog)
    rows = every
    if engine is not None:
        rows = [r for r in every if r.engine == engine]
        if not rows:
            raise OpWeaveError(f"{path}: no row has engine {engine!r} (an 'engine' column selects rows)")
    graphs = {} if graphs is None else graphs
    for r in every:
        if r.model not in graphs:
            say(f"tracing {r.model}'s decode step")
        try:
            graph_of(r.model, graphs)
        except OpWeaveError as e:
            raise OpWeaveError(f"{path} line {r.line}: model {r.model!r}: {e}") from None
    fits, reports = [], []
    for name in dict.fromkeys(r.gpu for r in rows):
        pool = [r for r in every if r.gpu == name]   # all engines: the prior of an engine's fit
        try:
            feats = features(pool, catalog[name], graphs)
        except OpWeaveError as e:
            raise OpWeaveError(f"{path} {e}") from None
        mine = np.array([i for i, r in enumerate(pool) if engine is None or r.engine == engine])
        say(f"{name}: fitting {len(mine)} rows" + (", then each group left out" if logo else ""))
        fit = _fit(catalog[name], feats, pool, mine, prior=engine is not None and len(mine) < len(pool))
        fits.append(fit)
        sub = take(feats, mine)
        before = predict(params_of(catalog[name]), sub)
        after = predict(params_of(fitted_spec(catalog[name], fit)), sub)
        labels = np.array([pool[i].group for i in mine])
        for group in fit.groups:
            index = np.flatnonzero(labels == group)
            logo_ms, note = (), ""
            if logo:
                logo_ms, note = _left_out(catalog[name], feats, pool, mine, mine[index], engine is not None)
            reports.append(GroupReport(group=group, gpu=name, rows=len(index),
                                       measured_ms=tuple(sub.measured[index] * 1e3),
                                       before_ms=tuple(before[index] * 1e3), after_ms=tuple(after[index] * 1e3),
                                       logo_ms=logo_ms, logo_note=note))
    return Calibration(source=path, fits=tuple(fits), groups=tuple(reports), rows=tuple(rows))


def _fit(gpu: GPUSpec, f: Features, pool: list[Measurement], mine: np.ndarray, prior: bool) -> GPUFit:
    """The fit of rows `mine` of `pool`; with `prior`, a fit of all of `pool` first gives the
    starting values (and the values of terms `mine` cannot identify)."""
    start = gpu
    if prior:
        start = fitted_spec(gpu, fit_gpu(gpu, f, pool))
    return dataclasses.replace(fit_gpu(start, take(f, mine), [pool[i] for i in mine]),
                               start=values_of(params_of(gpu)))


def _left_out(gpu: GPUSpec, f: Features, pool: list[Measurement], mine: np.ndarray, index: np.ndarray,
              prior: bool) -> tuple[tuple[float, ...], str]:
    """Rows `index` of `pool` predicted by a fit without their group (neither in the prior)."""
    keep_pool = np.setdiff1d(np.arange(len(pool)), index)
    keep = np.setdiff1d(mine, index)
    if len(keep) < MIN_ROWS_PER_GPU:
        return (), "no other group of this GPU type to fit"
    try:
        sub = take(f, keep_pool)
        where = np.searchsorted(keep_pool, keep)
        fit = _fit(gpu, sub, [pool[i] for i in keep_pool], where, prior)
    except OpWeaveError as e:
        return (), str(e)
    return tuple(predict(params_of(fitted_spec(gpu, fit)), take(f, index)) * 1e3), ""


# ---------------------------------------------------------------- reports and the catalog file


def summary(errors: list[float]) -> dict[str, float]:
    """Mean and median absolute relative error, mean signed error, worst absolute error."""
    if not errors:
        return {}
    absolute = [abs(e) for e in errors]
    return {"mean_abs": statistics.fmean(absolute), "median_abs": statistics.median(absolute),
            "mean_signed": statistics.fmean(errors), "max_abs": max(absolute), "rows": len(errors)}


def totals(cal: Calibration) -> dict[str, dict[str, float]]:
    """Summaries over every row: before, after, leave-one-group-out."""
    out = {}
    for key in ("before", "after", "logo"):
        errs = [e for g in cal.groups for e in _rel_errors(getattr(g, f"{key}_ms"), g.measured_ms)]
        out[key] = summary(errs)
    return out


def _show(field: str, value: float) -> str:
    unit = next(t.unit for t in TERMS if t.field == field)
    return f"{value * 1e6:.2f} us" if unit == "us" else f"{value:.3f}"


def format_calibration(cal: Calibration) -> str:
    """The fit per GPU type (each term, fitted or why not), then per group: rows, mean error
    before / after / left out, then the totals."""
    lines = [f"Calibration of the cost model to {cal.source} ({len(cal.rows)} rows)"]
    for fit in cal.fits:
        lines.append(f"\n{fit.gpu}: {fit.rows} rows, {len(fit.groups)} group{'s' * (len(fit.groups) != 1)}")
        for t in TERMS:
            old, new = fit.start[t.field], fit.values[t.field]
            if t.field in fit.held:
                lines.append(f"  {t.field:20s} {_show(t.field, new):>12s}  not fitted: {fit.held[t.field]}")
            else:
                lines.append(f"  {t.field:20s} {_show(t.field, new):>12s}  (was {_show(t.field, old)})")
    header = ("group", "rows", "before", "after", "left out", "worst after")
    table = []
    for g in cal.groups:
        before = summary(_rel_errors(g.before_ms, g.measured_ms))
        after = summary(_rel_errors(g.after_ms, g.measured_ms))
        logo = summary(_rel_errors(g.logo_ms, g.measured_ms))
        table.append((g.group, str(g.rows), f"{before['mean_signed']:+.1%}", f"{after['mean_signed']:+.1%}",
                      f"{logo['mean_abs']:.1%}" if logo else "-", f"{after['max_abs']:.1%}"))
    widths = [max(len(r[i]) for r in table + [header]) for i in range(len(header))]
    lines += ["", "Mean signed error per group (predicted / measured - 1); left out: mean absolute error of "
              "a fit without the group"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in table]
    notes = [f"{g.group}: not left out ({g.logo_note})" for g in cal.groups if g.logo_note]
    lines += [""] + notes if notes else []
    lines.append("")
    for key, label in (("before", "before"), ("after", "after"), ("logo", "left out")):
        s = totals(cal)[key]
        if s:
            lines.append(f"{label:9s} mean |error| {s['mean_abs']:.1%}, median {s['median_abs']:.1%}, "
                         f"mean signed {s['mean_signed']:+.1%}, worst {s['max_abs']:.1%} ({s['rows']} rows)")
    return "\n".join(lines)


def calibration_to_json(cal: Calibration) -> dict:
    return {"source": cal.source, "rows": len(cal.rows),
            "fits": [dataclasses.asdict(f) for f in cal.fits],
            "groups": [dataclasses.asdict(g) for g in cal.groups], "totals": totals(cal)}


def catalog_entries(cal: Calibration) -> dict:
    """An override catalog (the layout of `catalog.json`) with every term of every fitted GPU type."""
    stamp = datetime.date.today().isoformat()
    name = os.path.basename(cal.source)
    out: dict = {"_meta": {"written_by": "opweave calibrate", "date": stamp, "measurements": name,
                           "totals": totals(cal)}}
    for fit in cal.fits:
        sources = {}
        for t in TERMS:
            if t.field in fit.held:
                sources[t.field] = f"assumption: not fitted ({fit.held[t.field]}); kept from the starting catalog"
            else:
                sources[t.field] = (f"fit: opweave calibrate {name} ({stamp}), {fit.rows} rows of "
                                    f"{len(fit.groups)} group{'s' * (len(fit.groups) != 1)}")
        out[fit.gpu] = {**{k: float(f"{v:.6g}") for k, v in fit.values.items()}, "sources": sources}
    return out
