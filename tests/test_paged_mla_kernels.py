"""Paged latent-attention (MLA) decode: the Triton kernel (`triton_kernels.paged_mla`, under
TRITON_INTERPRET=1 on CPU; skipped without triton) against the torch reference
(`kernels.paged.paged_mla_decode_attention`), and the reference against the ring-buffer MLA
reference on the same rows laid out contiguously.

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
# mid-page; the first slot of its second page (its first page is row 0's); padding; the last slot of page 4
POSITIONS = [37, 16, -1, 79]


@pytest.fixture
def tri(monkeypatch):
    """The Triton backend splitting test-sized spans: blocks of 16 rows, 16-position splits."""
    pytest.importorskip("triton")
    from opweave.kernels import get_backend

    mod = get_backend("triton")
    monkeypatch.setattr(mod.attention, "ATTN_BLOCK_N", 16)
    monkeypatch.setattr(mod.attention, "ATTN_MIN_SPLIT", 16)
    return mod


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _pool(lengths, row, dtype, width, shared=0, seed=0):
    """(kv_pages [N, PAGE, row], table) for rows holding positions 0 .. lengths[b] - 1. Rows 0 and
    1 share their first `shared` pages; the others' pages are a shuffled draw from the pool, which
    has two pages nobody owns; entries past a row's pages hold the null page (the last)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lengths]
    owned = sum(need) - min(shared, need[1] if len(need) > 1 else 0)
    null = owned + 2
    ids = iter(torch.randperm(null, generator=gen).tolist())
    table = torch.full((len(lengths), width), null, dtype=torch.int32)
    for b, pages in enumerate(need):
        for e in range(pages):
            table[b, e] = table[0, e] if b == 1 and e < shared else next(ids)
    kv_pages = torch.randn(null + 1, PAGE, row, generator=gen) * GARBAGE
    for b, n in enumerate(lengths):  # the written positions (a shared page: the later row's values)
        for p in range(n):
            kv_pages[table[b, p // PAGE].item(), p % PAGE] = torch.randn(row, generator=gen)
    return kv_pages.to(dtype), table


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class _NoHostReads(TorchDispatchMode):
    """Fails on any read of a tensor value by the host (`.item()`, `int()`, `.tolist()`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the host read a tensor value")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,rank,rope", [(16, 64, 16), (20, 32, 32)])
def test_paged_mla_decode_attention_triton(tri, dtype, heads, rank, rope):
    """span 5 of a table of 8 (80 positions in 5 splits of 16); 20 heads: a second, partial head block."""
    width, span = 8, 5
    positions = torch.tensor(POSITIONS)
    kv_pages, table = _pool([max(p + 1, 0) for p in POSITIONS], rank + rope, dtype, width, shared=1)
    assert table[0, 0] == table[1, 0] and table[1, 1] != table[0, 1]
    assert torch.diff(table[3, :5]).ne(1).any()  # row 3's pages are not consecutive ids
    q = _randn(4, heads, rank + rope, dtype=dtype, seed=1)
    _, split = tri.paged_mla.paged_mla_plan(q, kv_pages, table, span, rank)
    assert (split.splits, split.split_len) == (5, 16)
    scale = (rank + rope) ** -0.5
    got = tri.paged_mla_decode_attention(q, kv_pages, table, positions, scale, rank, span)
    assert got.shape == (4, heads, rank) and got.dtype == dtype
    _close(got, ref.paged_mla_decode_attention(q, kv_pages, table, positions, scale, rank, span), dtype)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # padding


def test_paged_mla_decode_attention_over_the_whole_table_reads_nothing_on_the_host(tri):
    """span = W (a captured graph's choice): 8 splits, most past every row's position; the null
    entries are never read. The interpreted launch reads no tensor value on the host."""
    heads, rank, rope, width = 16, 32, 16, 8
    positions = torch.tensor(POSITIONS)
    kv_pages, table = _pool([max(p + 1, 0) for p in POSITIONS], rank + rope, torch.float32, width,
                            shared=1, seed=3)
    q = _randn(4, heads, rank + rope, dtype=torch.float32, seed=4)
    assert tri.paged_mla.paged_mla_plan(q, kv_pages, table, width, rank)[1].splits == 8
    with _NoHostReads():
        got = tri.paged_mla_decode_attention(q, kv_pages, table, positions, 0.2, rank, width)
    want = ref.paged_mla_decode_attention(q, kv_pages, table, positions, 0.2, rank, width)
    _close(got, want, torch.float32)
    # the same with the span the rows need: the entries past it change nothing
    _close(got, ref.paged_mla_decode_attention(q, kv_pages, table, positions, 0.2, rank, 5), torch.float32)


def test_paged_mla_launch_depends_on_shapes_only(tri, monkeypatch):
    """Meta tensors of DeepSeek-V3's shapes at batch 1, 128K positions (8192 pages) on a 132-SM
    GPU: the wrapper launches without reading a tensor value, and splits the span so the 8 head
    blocks fill the GPU (at least 4 programs per SM)."""
    from opweave.kernels import targets

    from launch_spy import record_launches

    grids = record_launches(monkeypatch, {"decode": (tri.paged_mla, "_paged_mla_decode_kernel"),
                                          "merge": (tri.attention, "_decode_attention_merge_kernel")})
    monkeypatch.setattr(targets, "launch_sm_count", lambda device: 132)
    meta = dict(device="meta", dtype=torch.bfloat16)
    pool, table = torch.empty(8193, PAGE, 576, **meta), torch.empty(1, 8192, dtype=torch.int32, device="meta")
    with _NoHostReads():
        out = tri.paged_mla_decode_attention(torch.empty(1, 128, 576, **meta), pool, table,
                                             torch.empty(1, dtype=torch.int64, device="meta"), 0.1, 512, 8192)
    assert out.shape == (1, 128, 512)
    b, head_blocks, splits = grids["decode"]
    assert (b, head_blocks) == (1, 8) and b * head_blocks * splits >= targets.ATTN_PROGRAMS_PER_SM * 132
    assert grids["merge"] == (1, 128)


def test_paged_mla_reference_matches_the_ring_buffer_reference():
    """The same latent rows as a contiguous ring cache (position p at slot p) and as pages: the
    paged reference gives `reference.mla_decode_attention`'s results (padding included)."""
    b, h, rank, rope, width = 3, 4, 16, 8, 4
    slots = width * PAGE
    gen = torch.Generator().manual_seed(13)
    cache = torch.randn(b, slots, rank + rope, generator=gen)
    table = torch.randperm(b * width, generator=gen).view(b, width).int()
    kv_pages = torch.randn(b * width + 1, PAGE, rank + rope, generator=gen) * GARBAGE
    kv_pages[table.flatten().long()] = cache.reshape(b * width, PAGE, rank + rope)
    q = torch.randn(b, h, rank + rope, generator=gen)
    positions = torch.tensor([5, slots - 1, -1])
    torch.testing.assert_close(ref.paged_mla_decode_attention(q, kv_pages, table, positions, 0.3, rank, width),
                               reference.mla_decode_attention(q, cache, positions, 0.3, rank), atol=1e-6, rtol=1e-6)
