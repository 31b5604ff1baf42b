"""Grouped MoE experts and fused residual-add + RMSNorm: Triton (interpreter) against the torch
references, the grouped schedule, no host synchronisation, and weight reads per token block.

Tolerances are those of tests/test_kernels.py: float32 1e-5, float16 2e-3.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opweave.kernels import reference as ref

pytest.importorskip("triton")

from opweave.kernels import triton_kernels as tk  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.float16]


def _experts(e: int, h: int, i: int, dtype, gen, unused=()):
    """gate_up [E, 2I, H], down [E, H, I] scaled like trained weights; experts in `unused` are NaN."""
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5
    down = torch.randn(e, h, i, generator=gen) * i ** -0.5
    for x in unused:
        gate_up[x], down[x] = float("nan"), float("nan")
    return gate_up.to(dtype), down.to(dtype)


def _routing(kind: str, n: int, e: int, k: int, gen):
    """(weights [n, k] float32, ids [n, k] int64) for a routing pattern."""
    if kind == "random":
        w, ids = ref.moe_route(torch.randn(n, e, generator=gen), k, True)
        return w, ids
    if kind == "one expert":  # every token on the same k experts: full blocks of one expert
        ids = torch.arange(3, 3 + k).remainder(e).expand(n, k).clone()
    elif kind == "sparse":    # first choices 0, 3, 5, second choices 3, 6, 8: the other experts get no token
        first = torch.tensor([0, 3, 5])[torch.randint(0, 3, (n,), generator=gen)]
        ids = torch.stack([first, (first + 3) % e], dim=1)[:, :k]
    else:
        raise AssertionError(kind)
    w = torch.rand(n, k, generator=gen) + 0.1
    return w / w.sum(dim=1, keepdim=True), ids


MOE_CASES = [  # (routing, tokens, experts, top k, intermediate, hidden)
    ("random", 5, 8, 1, 24, 32),
    ("random", 9, 8, 2, 24, 40),
    ("random", 12, 8, 8, 16, 32),     # top-8 of 8: every expert, every token
    ("random", 1, 6, 2, 16, 16),      # N = 1
    ("random", 64, 16, 2, 16, 32),    # N = 64
    ("one expert", 40, 8, 1, 24, 32),  # 40 pairs on one expert: blocks of 16, 16, 8
    ("one expert", 33, 8, 2, 16, 24),
    ("sparse", 20, 9, 1, 16, 32),      # experts without tokens (their weights are NaN)
    ("sparse", 20, 9, 2, 16, 32),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: f"{c[0]}-N{c[1]}-E{c[2]}-k{c[3]}")
@pytest.mark.slow
def test_grouped_moe_matches_reference(dtype, case):
    kind, n, e, k, i, h = case
    gen = torch.Generator().manual_seed(n * 100 + k)
    w, ids = _routing(kind, n, e, k, gen)
    unused = sorted(set(range(e)) - set(ids.flatten().tolist()))
    assert unused or kind == "random"
    gate_up, down = _experts(e, h, i, dtype, gen, unused)
    x = torch.randn(n, h, generator=gen).to(dtype)
    got = tk.moe_experts(x, w.to(dtype), ids, gate_up, down)
    want = ref.moe_experts(x, w.to(dtype), ids, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_grouped_moe_leading_dims_strided_rows_and_no_tokens():
    gen = torch.Generator().manual_seed(1)
    gate_up, down = _experts(4, 32, 16, torch.float32, gen)
    big = torch.randn(2, 3, 48, generator=gen)
    x = big[..., :32]  # rows strided by 48: the kernel takes the row stride
    w, ids = ref.moe_route(torch.randn(2, 3, 4, generator=gen), 2, False)
    torch.testing.assert_close(tk.moe_experts(x, w, ids, gate_up, down), ref.moe_experts(x, w, ids, gate_up, down),
                               **TOL[torch.float32])
    empty = tk.moe_experts(x[:0], w[:0], ids[:0], gate_up, down)
    assert empty.shape == (0, 3, 32)


# ---------------------------------------------------------------------------------------------- the schedule

def _check_table(ids: torch.Tensor, e: int, block_m: int) -> int:
    """Checks `moe_block_table` on a routing; returns the number of non-empty blocks."""
    order, table = tk.moe_block_table(ids, e, block_m)
    pairs = ids.numel()
    assert table.shape[0] == min(pairs, pairs // block_m + min(e, pairs))
    flat = ids.reshape(-1)
    seen = torch.zeros(pairs, dtype=torch.int64)
    blocks_of = torch.zeros(e, dtype=torch.int64)
    for expert, start, stop in table.tolist():
        assert 0 <= start <= stop and stop - start <= block_m
        if stop == start:
            continue
        block = order[start:stop]
        assert (flat[block] == expert).all(), "a block holds pairs of one expert only"
        assert (block.diff() > 0).all(), "pairs of a block in token order"
        seen[block] += 1
        blocks_of[expert] += 1
    assert (seen == 1).all(), "every (token, expert) pair in exactly one block"
    counts = torch.bincount(flat, minlength=e)
    assert blocks_of.tolist() == [math.ceil(c / block_m) for c in counts.tolist()], "blocks per expert: ceil(pairs / M)"
    return int(blocks_of.sum())


@pytest.mark.parametrize("seed", range(6))
def test_block_table_covers_every_pair_once(seed):
    gen = torch.Generator().manual_seed(seed)
    n, e, k = [(1, 4, 1), (7, 5, 2), (64, 16, 8), (30, 3, 3), (100, 64, 4), (17, 2, 2)][seed]
    _, ids = ref.moe_route(torch.randn(n, e, generator=gen) * 3, k, True)
    _check_table(ids, e, 16)


def test_block_table_bound_is_reached():
    """Every expert with 17 pairs needs two blocks: the static bound N*k // M + E is exact."""
    e, m = 8, 16
    ids = torch.arange(e).repeat_interleave(17)[torch.randperm(17 * e, generator=torch.Generator().manual_seed(0))]
    assert _check_table(ids[:, None], e, m) == 17 * e // m + e


@pytest.mark.parametrize("n,e,split,pairs_per_expert", [
    (40, 4, 16, [40, 16, 24, 0]),    # 20 pairs an expert expected: blocks of 32
    (12, 4, 4, [12, 4, 8, 0]),       # 6 expected: blocks of 16
    (128, 2, 128, [128, 128]),       # 128 expected: blocks of 128, each expert read once
])
def test_each_experts_weights_are_read_once_per_block(monkeypatch, n, e, split, pairs_per_expert):
    """A spy on the interpreter's loads counts how often each weight element is read: once per
    block of its expert's pairs (the kernel's block, which grows with the pairs an expert
    expects: `moe_block_m`), not once per (token, expert) pair."""
    from triton.runtime.interpreter import InterpreterBuilder

    k, i, h = 2, 16, 32
    m = tk.moe.moe_block_m(n, k, e)
    first = torch.zeros(n, dtype=torch.int64)
    second = torch.where(torch.arange(n) < split, 1, 2) if e > 2 else torch.ones(n, dtype=torch.int64)
    ids = torch.stack([first, second], dim=1)
    gen = torch.Generator().manual_seed(0)
    gate_up, down = _experts(e, h, i, torch.float32, gen)
    x, w = torch.randn(n, h, generator=gen), torch.full((n, k), 0.5)
    loads: list[np.ndarray] = []
    real = InterpreterBuilder.create_masked_load

    def spy(self, ptrs, mask, other, cache_policy, is_volatile):
        loads.append(ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].copy())
        return real(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", spy)
    got = tk.moe_experts(x, w, ids, gate_up, down)
    monkeypatch.undo()
    torch.testing.assert_close(got, ref.moe_experts(x, w, ids, gate_up, down), **TOL[torch.float32])
    addrs = np.concatenate(loads).astype(np.int64)
    blocks = [math.ceil(pairs / m) for pairs in pairs_per_expert]
    for weights in (gate_up, down):
        base, size = weights.data_ptr(), weights.numel() * weights.element_size()
        inside = addrs[(addrs >= base) & (addrs < base + size)]
        reads = np.bincount((inside - base) // weights.element_size(), minlength=weights.numel()).reshape(e, -1)
        for expert, want in enumerate(blocks):
            assert (reads[expert] == want).all(), (expert, want, np.unique(reads[expert]))
        assert reads.sum() == sum(blocks) * reads[0].size < sum(pairs_per_expert) * reads[0].size
    if n * k / e >= 64:
        assert blocks == [1] * e  # once per step


# ---------------------------------------------------------------------------------------------- add + RMSNorm

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [True, False])
@pytest.mark.parametrize("shape", [(5, 40), (2, 3, 64), (1, 1000)])
def test_add_rms_norm_matches_reference(dtype, offset, shape):
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    res = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    weight = (torch.randn(shape[-1], generator=gen) * (0.1 if offset else 1.0)).to(dtype)
    x_before, res_before = x.clone(), res.clone()
    normed, summed = tk.add_rms_norm(x, res, weight, 1e-6, offset)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched
    want_normed, want_summed = ref.add_rms_norm(x, res, weight, 1e-6, offset)
    assert torch.equal(summed, want_summed) and torch.equal(want_summed, x + res)  # one rounding, like the add
    assert normed.dtype == dtype and normed.shape == x.shape
    torch.testing.assert_close(normed.float(), want_normed.float(), **TOL[dtype])
    torch.testing.assert_close(want_normed, ref.rms_norm(x + res, weight, 1e-6, offset), atol=0, rtol=0)


def test_add_rms_norm_strided_rows():
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(6, 100, generator=gen)
    x, res = buf[:, :48], buf[:, 50:98]  # row stride 100 on both
    weight = torch.randn(48, generator=gen)
    for got, want in zip(tk.add_rms_norm(x, res, weight, 1e-5, False), ref.add_rms_norm(x, res, weight, 1e-5, False)):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


# ---------------------------------------------------------------------------------------------- host syncs

class _NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor's value on the host (`.item()`, `int(t)`, `bool(t)`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host synchronisation: aten._local_scalar_dense")
        return func(*args, **(kwargs or {}))


def test_the_no_sync_mode_catches_a_sync():
    t = torch.ones(3, dtype=torch.int64)
    with pytest.raises(AssertionError, match="host synchronisation"), _NoHostSync():
        int(t.sum())
    with pytest.raises(AssertionError, match="host synchronisation"), _NoHostSync():
        if t.any():  # a branch on a tensor's value
            pass


def test_wrappers_do_not_synchronise_with_the_host():
    gen = torch.Generator().manual_seed(5)
    gate_up, down = _experts(6, 32, 16, torch.float16, gen)
    x = torch.randn(10, 32, generator=gen).to(torch.float16)
    w, ids = ref.moe_route(torch.randn(10, 6, generator=gen).to(torch.float16), 2, True)
    res, weight = torch.randn(10, 32, generator=gen).to(torch.float16), torch.randn(32, generator=gen).to(torch.float16)
    with _NoHostSync():
        y = tk.moe_experts(x, w, ids, gate_up, down)
        normed, summed = tk.add_rms_norm(y, res, weight, 1e-6, True)
    torch.testing.assert_close(y.float(), ref.moe_experts(x, w, ids, gate_up, down).float(), **TOL[torch.float16])
    torch.testing.assert_close(normed.float(), ref.add_rms_norm(y, res, weight, 1e-6, True)[0].float(),
                               **TOL[torch.float16])
