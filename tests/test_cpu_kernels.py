"""The C kernels of CPU ranks (`opweave.kernels.cpu`) against the torch reference (`kernels.paged`,
`kernels.reference`): paged decode attention (GQA, MHA, MLA's shared latent rows, sinks, padding
rows, scattered pages, rows ending on page edges), paged cache writes (strided inputs, padding),
the row kernels (RMSNorm with and without the residual add and the offset, RoPE full and
partial, silu(gate) * up; strided inputs as the fused projections give them), a first chunk's
causal attention, and the fallbacks."""

from __future__ import annotations

import shutil

import pytest
import torch

from opweave.kernels import cpu as CPUK
from opweave.kernels import paged as PK
from opweave.kernels import reference as K
from opweave.models.config import RopeSpec
from opweave.models.ops import rope_inv_freq

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
    (3, 4, 2, 48, 16, 4, True),       # 2 query heads per kv head: 8 keys a block of 16 dot products
    (2, 32, 2, 64, 8, 5, False),      # 16 query heads per kv head: one key a block; pages of 8
    (2, 8, 1, 64, 64, 2, False),      # the largest page the kernel takes
    (5, 12, 4, 64, 16, 3, False),     # 3 query heads per kv head: the portable scores
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
def test_paged_write_of_a_decode_segment_view():
    """A packed round's decode rows: [1, T] tokens of the fused q/k/v output seen as [T, 1, Hkv, D]
    (the size-1 step axis has its own stride): written in place, as the reference writes them."""
    k_ref, v_ref, table, g = _pool(4, 2, 16, 2, 8, seed=11)
    k_c, v_c = k_ref.clone(), v_ref.clone()
    qkv = torch.randn(1, 4, 8 * 8, generator=g)
    k = qkv[..., 32:48].view(1, 4, 2, 8).reshape(4, 1, 2, 8)
    v = qkv[..., 48:].view(1, 4, 2, 8).reshape(4, 1, 2, 8)
    assert k.stride(0) != k.stride(1)
    pos = torch.tensor([[3], [20], [-1], [7]])
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


# ---------------------------------------------------------------- row kernels

@needs_cc
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 37, 1024), (16, 1, 72), (2, 3, 4, 24)])
def test_rms_norm_matches_reference(shape, offset):
    """[..., H] rows, a hidden size with a tail past 16 lanes, QK-norm's per-head rows; the sum
    of the residual add is bit-exact, the norm equal to float rounding (summation order)."""
    g = torch.Generator().manual_seed(sum(shape))
    x, res = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(CPUK.rms_norm(x, w, 1e-6, offset), K.rms_norm(x, w, 1e-6, offset),
                               rtol=1e-5, atol=1e-5)
    normed, summed = CPUK.add_rms_norm(x, res, w, 1e-5, offset)
    ref_normed, ref_summed = K.add_rms_norm(x, res, w, 1e-5, offset)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
    assert CPUK.status() == "on"


@needs_cc
def test_rms_norm_of_a_strided_view():
    """A column block of a wider tensor (rows one stride apart) and a transposed one."""
    g = torch.Generator().manual_seed(2)
    wide, w = torch.randn(1, 9, 200, generator=g), torch.randn(64, generator=g)
    for x in (wide[..., 100:164], wide[0, :, :64].t()[:, :9].t()):
        torch.testing.assert_close(CPUK.rms_norm(x, w, 1e-6, False), K.rms_norm(x, w, 1e-6, False),
                                   rtol=1e-5, atol=1e-5)


@needs_cc
@pytest.mark.parametrize("rot_frac,factor", [(1.0, 1.0), (0.5, 1.0), (1.0, 1.25)])
def test_rope_matches_reference_exactly(rot_frac, factor):
    """The reference's cos, sin, products and sums: the same bits. q and k as the fused q/k/v
    projection gives them (views with a token stride), padding positions acting as 0."""
    g = torch.Generator().manual_seed(int(rot_frac * 10 + factor * 100))
    hq, hkv, d, t = 8, 2, 64, 21
    qkv = torch.randn(1, t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[..., : hq * d].view(1, t, hq, d)
    k = qkv[..., hq * d: (hq + hkv) * d].view(1, t, hkv, d)
    pos = torch.arange(t)[None] + 100
    pos[0, 3] = -1
    spec = RopeSpec(theta=10000.0, partial_rotary_factor=rot_frac)
    inv, rot = rope_inv_freq(spec, d), int(d * rot_frac)
    out, ref = CPUK.rope(q, k, pos, inv, rot, factor), K.rope(q, k, pos, inv, rot, factor)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@needs_cc
@pytest.mark.parametrize("shape", [(1, 144, 2816), (16, 1, 100), (3, 7)])
def test_silu_mul_matches_reference(shape):
    g = torch.Generator().manual_seed(shape[-1])
    both = torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 6  # gate | up, as the fused GEMM gives them
    gate, up = both.split(shape[-1], dim=-1)
    gate[..., :4] = torch.tensor([0.0, -0.0, -90.0, 90.0])  # exp's clamp and both signs of zero
    out, ref = CPUK.gated_act(gate, up, "silu"), K.gated_act(gate, up, "silu")
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    # gelu (Gemma) is not a C kernel: the reference, exactly
    assert torch.equal(CPUK.gated_act(gate, up, "gelu_pytorch_tanh"), K.gated_act(gate, up, "gelu_pytorch_tanh"))


@pytest.mark.parametrize("hq,hkv", [(16, 4), (4, 4)])
def test_first_chunk_causal_attention_matches_paged_reference(hq, hkv):
    """A prompt's first chunk (nothing cached): torch's fused causal attention gives what the
    paged reference's blocks and merges give."""
    g = torch.Generator().manual_seed(hq)
    t, d, page = 70, 32, 16
    q, k, v = (torch.randn(1, t, h, d, generator=g) for h in (hq, hkv, hkv))
    k_pages, v_pages = torch.zeros(9, page, hkv, d), torch.zeros(9, page, hkv, d)
    table = torch.arange(8, dtype=torch.int32)[None]
    pos = torch.arange(t)[None]
    ref = PK.paged_chunk_attention(q, k, v, k_pages, v_pages, table, pos, 0.17, 5)
    torch.testing.assert_close(CPUK.causal_attention(q, k, v, 0.17), ref, rtol=1e-5, atol=1e-5)


def test_first_chunk_is_known_from_the_host_count():
    kv = PK.PagedKV(torch.zeros(3, 16, 1, 8), torch.zeros(3, 16, 1, 8), torch.zeros(2, 2, dtype=torch.int32),
                    lengths=[40, 16], base=0)
    assert kv.rows(1, 2).first_chunk(16)            # the row holds just this chunk
    assert not kv.rows(0, 1).first_chunk(16)        # 24 positions cached before it
    assert not kv.first_chunk(16)                   # two rows: not one chunk
    assert not PK.PagedKV(kv.k_pages, kv.v_pages, kv.table[:1]).first_chunk(16)  # no host count


def test_off_by_flag_runs_the_reference(monkeypatch):
    monkeypatch.setenv("OPWEAVE_CPU_KERNELS", "0")
    assert CPUK.status() == "off (OPWEAVE_CPU_KERNELS=0)"
    assert CPUK.library() is None
    k, v, table, g = _pool(2, 3, 16, 2, 16, seed=1)
    q = torch.randn(2, 4, 16, generator=g)
    pos = torch.tensor([3, 40])
    assert torch.equal(CPUK.paged_decode_attention(q, k, v, table, pos, 0.25, 3),
                       PK.paged_decode_attention(q, k, v, table, pos, 0.25, 3))
    x, w = torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    assert torch.equal(CPUK.rms_norm(x, w, 1e-6, False), K.rms_norm(x, w, 1e-6, False))
    assert torch.equal(CPUK.gated_act(x, w.expand(3, 40), "silu"), K.gated_act(x, w.expand(3, 40), "silu"))


def test_other_dtypes_run_the_reference():
    """bf16 pools are not the C kernels' (they take float32): the reference's result, exactly."""
    k, v, table, g = _pool(2, 3, 16, 2, 16, seed=2)
    k, v = k.bfloat16(), v.bfloat16()
    q = torch.randn(2, 4, 16, generator=g).bfloat16()
    pos = torch.tensor([3, 40])
    assert torch.equal(CPUK.paged_decode_attention(q, k, v, table, pos, 0.25, 3),
                       PK.paged_decode_attention(q, k, v, table, pos, 0.25, 3))
    x, w = torch.randn(3, 40, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    assert torch.equal(CPUK.rms_norm(x, w, 1e-6, True), K.rms_norm(x, w, 1e-6, True))
    assert torch.equal(CPUK.add_rms_norm(x, x, w, 1e-6, False)[0], K.add_rms_norm(x, x, w, 1e-6, False)[0])
    assert torch.equal(CPUK.gated_act(x, x, "silu"), K.gated_act(x, x, "silu"))


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
