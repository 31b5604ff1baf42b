"""Expert parallelism in the runtime: each rank of a group of t holds E / t whole experts.

Kernels: a pair whose expert is not on the rank carries the sentinel id E_local and contributes
exactly nothing (torch reference and Triton under the interpreter, float32), and the sum of the
ranks' partial outputs is the unsharded output, for both expert layouts (Qwen-style fused
[E, 2I, H] and GPT-OSS's interleaved [E, H, 2I] with biases). Modules: `materialize` with
experts="ep" builds each rank's block of experts, from random weights and from tiny Hugging Face
checkpoints (per-expert tensors for Qwen3-MoE, fused for GPT-OSS), and the ranks' outputs sum
to the unsharded module's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from opweave.kernels import reference as ref
from opweave.errors import OpWeaveError
from opweave.ir import tp as T
from opweave.ir.kinds import OpKind
from opweave.models import ops
from opweave.models.checkpoint import CheckpointReader
from opweave.models.model import DecodeStep, build_model
from opweave.models.registry import resolve
from opweave.runtime.shard import materialize, shard_module
from opweave.runtime.syncguard import NoHostSync
from test_device import CountingReader

TOL = dict(atol=1e-5, rtol=1e-5)  # float32, as tests/test_kernels.py
ALPHA, LIMIT = 1.702, 7.0         # GPT-OSS's clamped SwiGLU
LAYOUTS = ("fused", "swiglu")     # Qwen/Mixtral-style experts; GPT-OSS's with biases


def _backend(name: str):
    if name == "torch":
        return ref
    pytest.importorskip("triton")
    from opweave.kernels import triton_kernels

    return triton_kernels


def _weights(layout: str, e: int, h: int, i: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    if layout == "fused":  # gate_up [E, 2I, H] gate rows first, down [E, H, I]
        return (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5, torch.randn(e, h, i, generator=gen) * i ** -0.5)
    return (torch.randn(e, h, 2 * i, generator=gen) * h ** -0.5 * 4,  # gate_up [E, H, 2I] interleaved
            torch.randn(e, 2 * i, generator=gen), torch.randn(e, i, h, generator=gen) * i ** -0.5,
            torch.randn(e, h, generator=gen) * 0.1)


def _run(backend, layout: str, x, w, ids, weights):
    if layout == "fused":
        return backend.moe_experts(x, w, ids, *weights)
    return backend.moe_experts_swiglu(x, w, ids, *weights, ALPHA, LIMIT)


def _expert_dense(layout: str, weights, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e applied to every token [N, H], written plainly (no gather)."""
    if layout == "fused":
        gate_up, down = weights
        gate, up = (x @ gate_up[e].T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ down[e].T
    gate_up, gate_up_bias, down, down_bias = weights
    return ref.swiglu_clamped(x @ gate_up[e] + gate_up_bias[e], ALPHA, LIMIT) @ down[e] + down_bias[e]


def _masked_dense(layout: str, weights, x, w, ids) -> torch.Tensor:
    """sum over the k pairs whose id is a held expert (< E) of weight * expert(x); others: nothing."""
    e = weights[0].shape[0]
    out = torch.zeros_like(x)
    for expert in range(e):
        y = _expert_dense(layout, weights, expert, x)           # [N, H]
        chosen = ((ids == expert) * w).sum(dim=-1, keepdim=True)  # the routing weight on it, or 0
        out += chosen * y
    return out


def _routing(n: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.moe_route(torch.randn(n, e, generator=torch.Generator().manual_seed(seed)), k, True)


def test_local_expert_ids_maps_a_block_and_marks_the_rest():
    ids = torch.tensor([[0, 5], [2, 3], [7, 4]])
    assert ref.local_expert_ids(ids, 2, 2).tolist() == [[2, 2], [0, 1], [2, 2]]  # experts 2, 3 held
    assert ref.local_expert_ids(ids, 4, 4).tolist() == [[4, 1], [4, 4], [3, 0]]
    assert ref.local_expert_ids(ids, 0, 8).tolist() == ids.tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sentinel_pairs_contribute_nothing(backend, layout):
    """Ids in [0, E]: the result is the masked dense sum over the held pairs. Expert E - 1 (where
    the reference clamps sentinels) has NaN weights and no held pair, so any leak would show."""
    k_ = _backend(backend)
    e, h, i, n, k = 6, 32, 16, 21, 2
    weights = _weights(layout, e, h, i, seed=1)
    w, ids = _routing(n, e - 1, k, seed=2)  # experts 0..4 only
    ids = torch.where(torch.rand(n, k, generator=torch.Generator().manual_seed(3)) < 0.4, e, ids)
    for t in weights:
        t[e - 1] = float("nan")
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(4))
    got = _run(k_, layout, x, w, ids, weights)
    assert torch.isfinite(got).all()
    clean = tuple(torch.nan_to_num(t) for t in weights)  # expert E-1's weights never count
    torch.testing.assert_close(got, _masked_dense(layout, clean, x, w, ids), **TOL)
    assert (got[(ids == e).all(dim=-1)] == 0).all() and (ids == e).all(dim=-1).any()  # a token with no pair here


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_never_reads_the_unwritten_rows_of_sentinel_pairs(monkeypatch, layout):
    """The per-pair output buffer is uninitialised where a sentinel pair sits: filled with NaN
    here, the result must not change."""
    tk = _backend("triton")
    e, h, i, n, k = 4, 32, 16, 9, 2
    weights = _weights(layout, e, h, i, seed=5)
    w, ids = _routing(n, e, k, seed=6)
    ids[::2, 1] = e
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(7))
    want = _run(tk, layout, x, w, ids, weights)
    empty = torch.empty

    def poisoned(*size, **kw):
        t = empty(*size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    got = _run(tk, layout, x, w, ids, weights)
    monkeypatch.undo()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_block_table_leaves_sentinel_pairs_out():
    tk = _backend("triton")
    e, n, k, m = 5, 40, 3, 16
    _, ids = _routing(n, e, k, seed=8)
    ids = torch.where(ids >= 3, e, ids)  # a rank holding experts 0..2 of 0..4 (ids past it: sentinel)
    order, table = tk.moe_block_table(ids, e, m)
    flat, seen = ids.reshape(-1), torch.zeros(n * k, dtype=torch.int64)
    for expert, start, stop in table.tolist():
        block = order[start:stop]
        assert expert < e and (flat[block] == expert).all()
        seen[block] += 1
    assert seen.tolist() == (flat < e).long().tolist()  # every held pair once, no sentinel pair


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.slow
def test_expert_parallel_partial_sums_are_the_unsharded_output(backend, layout, tp):
    k_ = _backend(backend)
    e, h, i, n, k = 8, 32, 16, 13, 2
    weights = _weights(layout, e, h, i, seed=10 + tp)
    w, ids = _routing(n, e, k, seed=11)
    x = torch.randn(2, n, h, generator=torch.Generator().manual_seed(12))[1]  # any rows
    want = _run(k_, layout, x, w, ids, weights)
    kind = OpKind.MOE_EXPERTS if layout == "fused" else OpKind.MOE_EXPERTS_SWIGLU
    view = T.OpTP(kind=kind, units=i, kv_heads=0,
                  weights=tuple((f"w{j}", tuple(t.shape)) for j, t in enumerate(weights)))
    partials = []
    for rank in range(tp):
        first, count = view.expert_block(tp, rank)
        block = tuple(t[first:first + count] for t in weights)  # every fused tensor by expert, biases too
        with NoHostSync("an expert-parallel shard"):
            local = ref.local_expert_ids(ids, first, count)
            partials.append(_run(k_, layout, x, w, local, block))
    assert all(p.abs().sum() > 0 for p in partials)  # every rank had work
    torch.testing.assert_close(sum(partials), want, **TOL)


# ---------------------------------------------------------------------------------------------- modules

FAMILIES = ("qwen3_moe", "gpt_oss")  # per-expert checkpoint tensors; fused with biases


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """family -> (checkpoint folder, config)."""
    out = {}
    for family in FAMILIES:
        folder = tiny_checkpoint(family)
        out[family] = (folder, resolve(folder).cfg)
    return out


def _experts_op(cfg) -> ops.RoutedExperts:
    return next(m for m in DecodeStep(build_model(cfg, "meta")).modules() if isinstance(m, ops.RoutedExperts))


@pytest.mark.parametrize("source", ["random", "checkpoint"])
@pytest.mark.parametrize("family", FAMILIES)
def test_ep_ranks_sum_to_the_unsharded_module(models, family, source):
    folder, cfg = models[family]
    meta = _experts_op(cfg)
    e, top_k = cfg.moe.num_experts, cfg.moe.top_k
    readers = []

    def weights():
        if source == "random":
            return "random"
        return lambda _shapes: readers.append(CountingReader(CheckpointReader(folder))) or readers[-1]

    full = materialize({0: copy.deepcopy(meta)}, weights(), 1, 0, torch.device("cpu"))[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, cfg.hidden_size, generator=gen).to(full.gate_up.dtype)
    w, ids = ref.moe_route(torch.randn(2, 3, e, generator=gen), top_k, True)
    w = w.to(x.dtype)
    with torch.no_grad():
        want = full(x, w, ids)
        partials = []
        for rank in range(2):
            shard = materialize({0: meta}, weights(), 2, rank, torch.device("cpu"), experts="ep")[0]
            assert (shard.first_expert, shard.num_local_experts) == (rank * e // 2, e // 2)
            for name, p in shard.named_parameters():
                full_p = getattr(full, name)
                assert tuple(p.shape) == (e // 2,) + tuple(full_p.shape[1:]), name  # whole experts
                torch.testing.assert_close(p, full_p[rank * e // 2:(rank + 1) * e // 2], atol=0, rtol=0)
            partials.append(shard(x, w, ids))
    assert all(p.abs().sum() > 0 for p in partials)
    torch.testing.assert_close(partials[0] + partials[1], want, **TOL)
    if source == "checkpoint" and family == "qwen3_moe":  # per-expert tensors: each rank reads its own
        for rank, reader in enumerate(readers[1:]):
            held = {int(key.split(".")[5]) for key in reader.keys}
            assert held == set(range(rank * e // 2, (rank + 1) * e // 2)), held


@pytest.mark.parametrize("family", FAMILIES)
def test_an_ep_degree_not_dividing_the_experts_is_a_one_line_error(models, family):
    _, cfg = models[family]
    e = cfg.moe.num_experts
    meta = _experts_op(cfg)
    bad = next(t for t in (3, 5, 6, 7) if e % t)
    with pytest.raises(OpWeaveError, match=f"does not split over EP {bad}") as err:
        shard_module(meta, bad, 0, None, torch.device("meta"), layout="ep")
    assert "\n" not in str(err.value) and f"{e} experts" in str(err.value)
    with pytest.raises(OpWeaveError, match="routed-experts layout 'xp'"):
        materialize({0: meta}, "random", 2, 0, torch.device("meta"), experts="xp")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_meta_ranks_hold_their_expert_block_and_nothing_else_changes(models, family, tp):
    _, cfg = models[family]
    e = cfg.moe.num_experts
    named = [m for m in DecodeStep(build_model(cfg, "meta")).modules() if isinstance(m, ops.OpModule)]
    modules = dict(enumerate(named))
    layouts = {layout: materialize(modules, "random", tp, tp - 1, torch.device("meta"), experts=layout)
               for layout in ("tp", "ep")}
    seen = 0
    for index, module in modules.items():
        by_tp, by_ep = layouts["tp"][index], layouts["ep"][index]
        shapes = {layout: {n: tuple(p.shape) for n, p in layouts[layout][index].named_parameters()}
                  for layout in ("tp", "ep")}
        if isinstance(module, ops.RoutedExperts):
            seen += 1
            assert (by_ep.first_expert, by_ep.num_local_experts) == ((tp - 1) * e // tp, e // tp)
            for name, p in module.named_parameters():  # the full module: the whole op
                assert shapes["ep"][name] == (e // tp,) + tuple(p.shape[1:])
                assert shapes["tp"][name][0] == e  # the TP layout: every expert, a slice of each
            assert by_tp.num_local_experts == e and not by_tp.is_expert_shard
        else:
            assert shapes["ep"] == shapes["tp"], type(module).__name__
    assert seen == cfg.mlp_types.count("moe") > 0
