"""The C kernels of CPU ranks (`opweave.kernels.cpu`) against the torch reference (`kernels.paged`):
paged decode attention (GQA, MHA, MLA's shared latent rows, sinks, padding rows, scattered pages,
rows ending on page edges) and paged cache writes (strided inputs, padding), and the fallbacks."""

from __future__ import annotations

import shutil

import pytest
import torch

from opweave.kernels import cpu as CPUK
from opweave.kernels import paged as PK

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler on this machine")


def _pool(rows: int, width: int, page: int, hkv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pages = rows * width + 1  # the last is the null page
    k = torch.randn(pages, page, hkv, d, generator=g)
    v = torch.randn(pages, page, hkv, d, generator=g)
    table = torch.randperm(pages - 1, generator=g)[: rows * width].view(rows, width).int()
    return k, v, table, g


CASES = [  # rows, query heads, kv heads, head dim, page, table width, sinks
    (16, 16, 4, 64, 16, 16, False),   # the serving benchmark's Llama
    (3, 8, 8, 32, 16, 5, True),       # MHA with GPT-OSS-style sinks
    (2, 16, 2, 128, 16, 3, False),
    (4, 6, 3, 40, 8, 7, True),        # a head dim with a tail past 16 lanes, small pages
    (1, 4, 1, 576, 16, 2, False),     # MLA's latent rows: one shared "head" of 512 + 64
]


@needs_cc
@pytest.mark.parametrize("rows,hq,hkv,d,page,width,sinks", CASES)
def test_paged_decode_matches_reference(rows, hq, hkv, d, page, width, sinks):
    k, v, table, g = _pool(rows, width, page, hkv, d, seed=rows * 7 + d)
    q = torch.randn(rows, hq, d, generator=g)
    pos = torch.randint(0, width * page, (rows,), generator=g)
    pos[0] = page - 1                        # a row ending on a page's last slot
    if rows > 2:
        pos[1] = -1                          # padding: zeros
        pos[2] = width * page - 1            # the whole table
    s = torch.randn(hq, generator=g) if sinks else None
    ref = PK.paged_decode_attention(q, k, v, table, pos, 0.11, width, s)
    out = CPUK.paged_decode_attention(q, k, v, table, pos, 0.11, width, s)
    assert CPUK.status() == "on"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if rows > 2:
        assert torch.count_nonzero(out[1]) == 0


@needs_cc
def test_paged_decode_strided_query_and_positions():
    """q a view of a wider tensor and positions a column of [B, T]: what the operators pass."""
    k, v, table, g = _pool(5, 4, 16, 2, 64, seed=3)
    wide = torch.randn(5, 1, 8 * 64 + 2 * 2 * 64, generator=g)
    q = wide[:, 0, : 8 * 64].view(5, 8, 64)
    pos2 = torch.randint(0, 64, (5, 3), generator=g)
    ref = PK.paged_decode_attention(q.contiguous(), k, v, table, pos2[:, 1].contiguous(), 0.125, 4)
    out = CPUK.paged_decode_attention(q, k, v, table, pos2[:, 1], 0.125, 4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_cc
def test_paged_mla_decode_matches_reference():
    g = torch.Generator().manual_seed(5)
    rows, width, page, rank, rope, heads = 3, 4, 16, 64, 16, 8
    pool = torch.randn(rows * width + 1, page, rank + rope, generator=g)
    table = torch.randperm(rows * width, generator=g).view(rows, width).int()
    q = torch.randn(rows, heads, rank + rope, generator=g)
    pos = torch.tensor([0, 37, 63])
    ref = PK.paged_mla_decode_attention(q, pool, table, pos, 0.2, rank, width)
    out = CPUK.paged_mla_decode_attention(q, pool, table, pos, 0.2, rank, width)
    assert out.shape == (rows, heads, rank)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_cc
@pytest.mark.parametrize("rows,t", [(4, 1), (1, 37), (3, 5)])
def test_paged_write_matches_reference(rows, t):
    """Keys and values as the operators pass them (views of one projection's output), padding
    positions included: every page, the null page too, ends up as the reference leaves it."""
    hkv, d, page, width = 2, 32, 16, 4
    k_ref, v_ref, table, g = _pool(rows, width, page, hkv, d, seed=rows + t)
    k_c, v_c = k_ref.clone(), v_ref.clone()
    qkv = torch.randn(rows, t, (4 + 2 * hkv) * d, generator=g)
    k = qkv[..., 4 * d: (4 + hkv) * d].view(rows, t, hkv, d)
    v = qkv[..., (4 + hkv) * d:].view(rows, t, hkv, d)
    start = torch.randint(0, width * page - t, (rows, 1), generator=g)
    pos = start + torch.arange(t)
    pos[0, 0] = -1  # padding goes to the null page
    PK.paged_cache_write(k_ref, v_ref, table, k, v, pos)
    CPUK.paged_cache_write(k_c, v_c, table, k, v, pos)
    assert torch.equal(k_c, k_ref) and torch.equal(v_c, v_ref)


@needs_cc
def test_paged_mla_write_matches_reference():
    g = torch.Generator().manual_seed(9)
    pool = torch.randn(9, 16, 80, generator=g)
    table = torch.randperm(8, generator=g).view(2, 4).int()
    kv = torch.randn(2, 3, 80, generator=g)
    pos = torch.tensor([[5, 6, 7], [-1, 16, 17]])
    ref = pool.clone()
    PK.paged_mla_cache_write(ref, table, kv, pos)
    CPUK.paged_mla_cache_write(pool, table, kv, pos)
    assert torch.equal(pool, ref)


def test_off_by_flag_runs_the_reference(monkeypatch):
    monkeypatch.setenv("OPWEAVE_CPU_KERNELS", "0")
    assert CPUK.status() == "off (OPWEAVE_CPU_KERNELS=0)"
    assert CPUK.library() is None
    k, v, table, g = _pool(2, 3, 16, 2, 16, seed=1)
    q = torch.randn(2, 4, 16, generator=g)
    pos = torch.tensor([3, 40])
    assert torch.equal(CPUK.paged_decode_attention(q, k, v, table, pos, 0.25, 3),
                       PK.paged_decode_attention(q, k, v, table, pos, 0.25, 3))


def test_other_dtypes_run_the_reference():
    """bf16 pools are not the C kernels' (they take float32): the reference's result, exactly."""
    k, v, table, g = _pool(2, 3, 16, 2, 16, seed=2)
    k, v = k.bfloat16(), v.bfloat16()
    q = torch.randn(2, 4, 16, generator=g).bfloat16()
    pos = torch.tensor([3, 40])
    assert torch.equal(CPUK.paged_decode_attention(q, k, v, table, pos, 0.25, 3),
                       PK.paged_decode_attention(q, k, v, table, pos, 0.25, 3))


def test_a_compiler_that_fails_leaves_the_reference(monkeypatch, tmp_path):
    """A broken compiler is no error: the functions run the torch reference and `status` says why."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(CPUK, "_tried", False)
    monkeypatch.setattr(CPUK, "_lib", None)
    monkeypatch.setattr(CPUK, "_why", None)
    assert CPUK.library() is None
    assert CPUK.status().startswith("off (false failed")
    k, v, table, g = _pool(2, 3, 16, 2, 16, seed=4)
    q = torch.randn(2, 4, 16, generator=g)
    pos = torch.tensor([0, 47])
    assert torch.equal(CPUK.paged_decode_attention(q, k, v, table, pos, 0.25, 3),
                       PK.paged_decode_attention(q, k, v, table, pos, 0.25, 3))
    assert not list(tmp_path.rglob("*.so"))
