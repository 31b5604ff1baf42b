"""Paged-KV-cache kernels: the Triton kernels (`triton_kernels.paged`, under TRITON_INTERPRET=1 on
CPU; skipped without triton) against the torch references (`kernels.paged`), and the references
against the ring-buffer ones (`kernels.reference`) on the same keys laid out contiguously.

The pools are built to catch a kernel that reads what it must not: pages in shuffled order, rows
0 and 1 sharing their first pages (a common prefix), a span shorter than the table, unallocated
entries on the null page, and the null page, the unused pages and every slot past a row's
length filled with large garbage, which would dominate any softmax it leaked into. Tolerances as
in tests/test_kernels.py: float32 1e-5, float16 2e-3.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opweave.kernels import paged as ref
from opweave.kernels import reference

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.float16]
PAGE = 16
GARBAGE = 30.0  # scale of the values nothing may read (finite: the reference multiplies them by p = 0)


@pytest.fixture
def tri(monkeypatch):
    """The Triton backend splitting test-sized spans: blocks of 16 keys, 16-position splits,
    16-row chunk programs."""
    pytest.importorskip("triton")
    from opweave.kernels import get_backend

    mod = get_backend("triton")
    monkeypatch.setattr(mod.attention, "ATTN_BLOCK_N", 16)
    monkeypatch.setattr(mod.attention, "ATTN_MIN_SPLIT", 16)
    monkeypatch.setattr(mod.paged, "CHUNK_BLOCK_M", 16)
    return mod


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _pools(lengths, hkv, d, dtype, width, shared=0, seed=0):
    """(k_pages, v_pages, table) for rows holding positions 0 .. lengths[b] - 1. Rows 0 and 1 share
    their first `shared` pages; the others' pages are a shuffled draw from the pool, which has
    two pages nobody owns; entries past a row's pages hold the null page (the last)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lengths]
    owned = sum(need) - min(shared, need[1] if len(need) > 1 else 0)
    null = owned + 2
    ids = iter(torch.randperm(null, generator=gen).tolist())
    table = torch.full((len(lengths), width), null, dtype=torch.int32)
    for row, pages in enumerate(need):
        for e in range(pages):
            table[row, e] = table[0, e] if row == 1 and e < shared else next(ids)
    k_pages = torch.randn(null + 1, PAGE, hkv, d, generator=gen) * GARBAGE
    v_pages = torch.randn(null + 1, PAGE, hkv, d, generator=gen) * GARBAGE
    for row, n in enumerate(lengths):  # the written positions (a shared page: the later row's values)
        for p in range(n):
            page, slot = table[row, p // PAGE].item(), p % PAGE
            k_pages[page, slot] = torch.randn(hkv, d, generator=gen)
            v_pages[page, slot] = torch.randn(hkv, d, generator=gen)
    return k_pages.to(dtype), v_pages.to(dtype), table


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------------------------------------- decode

# mid-page; the first slot of its second page (its first page is row 0's); padding; the last slot of page 4
DECODE_POSITIONS = [37, 16, -1, 79]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_decode_attention_triton(tri, dtype, group, d, with_sinks):
    hkv, width, span = 2, 8, 5
    positions = torch.tensor(DECODE_POSITIONS)
    k_pages, v_pages, table = _pools([max(p + 1, 0) for p in DECODE_POSITIONS], hkv, d, dtype, width, shared=1)
    assert table[0, 0] == table[1, 0] and table[1, 1] != table[0, 1]
    q = _randn(4, hkv * group, d, dtype=dtype, seed=1)
    sinks = _randn(hkv * group, dtype=torch.float32, seed=2) if with_sinks else None
    _, split = tri.paged.paged_plan(q, k_pages, table, span)
    assert (split.splits, split.split_len) == (5, 16)  # 80 positions in 16-position splits
    got = tri.paged_decode_attention(q, k_pages, v_pages, table, positions, d ** -0.5, span, sinks)
    _close(got, ref.paged_decode_attention(q, k_pages, v_pages, table, positions, d ** -0.5, span, sinks), dtype)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # padding


class _NoHostReads(TorchDispatchMode):
    """Fails on any read of a tensor value by the host (`.item()`, `int()`, `.tolist()`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the host read a tensor value")
        return func(*args, **(kwargs or {}))


def test_paged_decode_attention_over_the_whole_table_reads_nothing_on_the_host(tri):
    """span = W (a captured graph's choice): 8 splits, most past every row's position; the null
    entries are never read. The interpreted launch reads no tensor value on the host."""
    hkv, group, d, width = 2, 4, 64, 8
    positions = torch.tensor(DECODE_POSITIONS)
    k_pages, v_pages, table = _pools([max(p + 1, 0) for p in DECODE_POSITIONS], hkv, d, torch.float32, width,
                                     shared=1, seed=3)
    q = _randn(4, hkv * group, d, dtype=torch.float32, seed=4)
    assert tri.paged.paged_plan(q, k_pages, table, width)[1].splits == 8
    with _NoHostReads():
        got = tri.paged_decode_attention(q, k_pages, v_pages, table, positions, 0.2, width)
    _close(got, ref.paged_decode_attention(q, k_pages, v_pages, table, positions, 0.2, width), torch.float32)
    # the same with the span the rows need: the entries past it change nothing
    _close(got, ref.paged_decode_attention(q, k_pages, v_pages, table, positions, 0.2, 5), torch.float32)


def test_paged_launches_depend_on_shapes_only(tri, monkeypatch):
    """Meta tensors of batch 1 at 128K positions (8192 pages) on a 132-SM GPU: every wrapper
    launches without reading a tensor value, and decode splits the span so the 8 KV heads fill
    the GPU (at least 4 programs per SM)."""
    from opweave.kernels import targets

    from launch_spy import record_launches

    grids = record_launches(monkeypatch, {
        **{name: (tri.paged, name) for name in
           ("_paged_decode_attention_kernel", "_paged_chunk_attention_kernel", "_paged_cache_write_kernel")},
        "merge": (tri.attention, "_decode_attention_merge_kernel")})
    monkeypatch.setattr(targets, "launch_sm_count", lambda device: 132)
    meta = dict(device="meta", dtype=torch.bfloat16)
    pool, table = torch.empty(8193, PAGE, 8, 128, **meta), torch.empty(1, 8192, dtype=torch.int32, device="meta")
    t = 64
    with _NoHostReads():
        out = tri.paged_decode_attention(torch.empty(1, 32, 128, **meta), pool, pool, table,
                                         torch.empty(1, dtype=torch.int64, device="meta"), 0.1, 8192)
        chunk = tri.paged_chunk_attention(torch.empty(1, t, 32, 128, **meta), torch.empty(1, t, 8, 128, **meta),
                                          torch.empty(1, t, 8, 128, **meta), pool, pool, table,
                                          torch.empty(1, t, dtype=torch.int64, device="meta"), 0.1, 8192)
        tri.paged_cache_write(pool, pool, table, torch.empty(1, t, 8, 128, **meta), torch.empty(1, t, 8, 128, **meta),
                              torch.empty(1, t, dtype=torch.int64, device="meta"))
    assert out.shape == (1, 32, 128) and chunk.shape == (1, t, 32, 128)
    b, hkv, splits = grids["_paged_decode_attention_kernel"]
    assert (b, hkv) == (1, 8) and b * hkv * splits >= targets.ATTN_PROGRAMS_PER_SM * 132
    assert grids["merge"] == (1, 32)
    assert grids["_paged_chunk_attention_kernel"] == (1, 8, t * 4 // 16)  # (token, head) rows of each group
    assert grids["_paged_cache_write_kernel"] == (t,)


# ---------------------------------------------------------------------------------------------- chunk

# row 0: a chunk after 30 cached positions; row 1: after 32 (its 2 pages are row 0's: row 0 must
# not see the slots row 1 wrote past its own 30) with padding inside and at the end; row 2:
# padding only; row 3: a first chunk (nothing cached) after leading padding
CHUNK_POSITIONS = [list(range(30, 42)), [32, 33, 34, -1, 35, 36, 37, 38, 39, 40, -1, -1], [-1] * 12,
                   [-1, -1] + list(range(10))]
CHUNK_CACHED = [30, 32, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_chunk_attention_triton(tri, dtype, group, d, with_sinks):
    hkv, width, span = 2, 8, 3
    positions = torch.tensor(CHUNK_POSITIONS)
    b, t = positions.shape
    k_pages, v_pages, table = _pools(CHUNK_CACHED, hkv, d, dtype, width, shared=2, seed=5)
    assert torch.equal(table[0, :2], table[1, :2])
    q = _randn(b, t, hkv * group, d, dtype=dtype, seed=6)
    k, v = _randn(b, t, hkv, d, dtype=dtype, seed=7), _randn(b, t, hkv, d, dtype=dtype, seed=8)
    sinks = _randn(hkv * group, dtype=torch.float32, seed=9) if with_sinks else None
    got = tri.paged_chunk_attention(q, k, v, k_pages, v_pages, table, positions, d ** -0.5, span, sinks)
    want = ref.paged_chunk_attention(q, k, v, k_pages, v_pages, table, positions, d ** -0.5, span, sinks)
    _close(got, want, dtype)
    pad = positions < 0
    assert torch.equal(got[pad], torch.zeros_like(got[pad]))


# ---------------------------------------------------------------------------------------------- cache write

@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_cache_write_triton(tri, dtype):
    """Every non-null page ends as the reference leaves it (a chunk across a page boundary,
    padding inside a row, a row of padding); the Triton write never touches the null page."""
    hkv, d, width = 2, 64, 8
    positions = torch.tensor(CHUNK_POSITIONS)
    b, t = positions.shape
    k_pages, v_pages, table = _pools([42, 41, 0, 10], hkv, d, dtype, width, shared=2, seed=10)
    k, v = _randn(b, t, hkv, d, dtype=dtype, seed=11), _randn(b, t, hkv, d, dtype=dtype, seed=12)
    got_k, got_v, want_k, want_v = k_pages.clone(), v_pages.clone(), k_pages.clone(), v_pages.clone()
    tri.paged_cache_write(got_k, got_v, table, k, v, positions)
    ref.paged_cache_write(want_k, want_v, table, k, v, positions)
    assert torch.equal(got_k[:-1], want_k[:-1]) and torch.equal(got_v[:-1], want_v[:-1])
    assert torch.equal(got_k[-1], k_pages[-1]) and torch.equal(got_v[-1], v_pages[-1])
    assert not torch.equal(got_k, k_pages)  # it wrote something
    # the written keys are where attention reads them: row 0's position 41
    assert torch.equal(got_k[int(table[0, 41 // PAGE]), 41 % PAGE], k[0, 11])


# ---------------------------------------------------------------------------------------------- reference

def test_paged_reference_matches_the_ring_buffer_reference():
    """The same keys as a contiguous ring cache (position p at slot p) and as pages: the paged
    references give the ring-buffer references' results (decode and chunk, GQA, sinks, padding)."""
    b, hkv, group, d, width = 3, 2, 2, 32, 4
    slots = width * PAGE
    gen = torch.Generator().manual_seed(13)
    k_cache, v_cache = torch.randn(b, slots, hkv, d, generator=gen), torch.randn(b, slots, hkv, d, generator=gen)
    table = torch.randperm(b * width, generator=gen).view(b, width).int()
    k_pages = torch.randn(b * width + 1, PAGE, hkv, d, generator=gen) * GARBAGE
    v_pages = torch.randn(b * width + 1, PAGE, hkv, d, generator=gen) * GARBAGE
    k_pages[table.flatten().long()] = k_cache.reshape(b * width, PAGE, hkv, d)
    v_pages[table.flatten().long()] = v_cache.reshape(b * width, PAGE, hkv, d)
    sinks = torch.randn(hkv * group, generator=gen)
    scale = d ** -0.5
    q = torch.randn(b, hkv * group, d, generator=gen)
    positions = torch.tensor([5, slots - 1, -1])
    for s in (None, sinks):
        torch.testing.assert_close(ref.paged_decode_attention(q, k_pages, v_pages, table, positions, scale, width, s),
                                   reference.decode_attention(q, k_cache, v_cache, positions, scale, None, s),
                                   atol=1e-6, rtol=1e-6)
    t = 6
    q = torch.randn(b, t, hkv * group, d, generator=gen)
    k, v = torch.randn(b, t, hkv, d, generator=gen), torch.randn(b, t, hkv, d, generator=gen)
    positions = torch.tensor([list(range(10, 16)), [-1, 40, 41, 42, -1, 43], [-1] * t])
    for s in (None, sinks):
        torch.testing.assert_close(
            ref.paged_chunk_attention(q, k, v, k_pages, v_pages, table, positions, scale, width, s),
            reference.chunk_attention(q, k, v, k_cache, v_cache, positions, scale, None, s), atol=1e-6, rtol=1e-6)
