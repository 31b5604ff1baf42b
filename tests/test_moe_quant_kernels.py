"""Grouped MoE experts over weights held as the published checkpoints store them (Triton kernels
under TRITON_INTERPRET=1 on CPU): `moe_experts_fp8` (DeepSeek-V3's e4m3 bytes, 128 x 128 block
scales, the gate's and the up's stacked) and `moe_experts_swiglu_mxfp4` (GPT-OSS's MXFP4 blocks)
against their torch references, and the references against the checkpoint reader's own
dequantizers (`models.quantized`) feeding the dense kernels' references."""

from __future__ import annotations

import inspect

import pytest
import torch

from opweave.kernels import reference as R
from opweave.kernels import triton_kernels as tk
from opweave.kernels.stored import dequantize_mxfp4
from opweave.models import quantized as Q

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


def _fp8_bits(*shape, gen):
    bits = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return torch.where((bits & 0x7F) == 0x7F, bits ^ 0x01, bits)  # no NaN codes (0x7F, 0xFF)


def _routing(n, e, k, gen, dtype, shard=None):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=gen), -1).to(dtype)
    if shard is not None:  # an expert-parallel shard: pairs routed elsewhere carry the sentinel
        first, count = shard
        ids = R.local_expert_ids(ids, first, count)
    return weights, ids


def _fp8_experts(e, i, h, gen):
    rows, cols = -(-i // 128), -(-h // 128)
    gate_up = _fp8_bits(e, 2 * i, h, gen=gen)
    down = _fp8_bits(e, h, i, gen=gen)
    gs = torch.empty(e, 2 * rows, cols).uniform_(2e-4, 2e-3, generator=gen)
    ds = torch.empty(e, -(-h // 128), -(-i // 128)).uniform_(2e-4, 2e-3, generator=gen)
    return gate_up, gs, down, ds


def _mxfp4_experts(e, i, h, gen):
    gu = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8, generator=gen)
    gus = torch.randint(117, 124, (e, 2 * i, h // 32), dtype=torch.uint8, generator=gen)
    down = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, generator=gen)
    ds = torch.randint(117, 124, (e, h, i // 32), dtype=torch.uint8, generator=gen)
    return gu, gus, down, ds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,e,i,h,shard", [(1, 4, 160, 64, None), (5, 8, 32, 200, None), (40, 6, 96, 128, (2, 3))])
def test_fp8_experts_match_the_reference(dtype, n, e, i, h, shard):
    gen = torch.Generator().manual_seed(n * 100 + e)
    gate_up, gs, down, ds = _fp8_experts(shard[1] if shard else e, i, h, gen)
    weights, ids = _routing(n, e, 2, gen, dtype, shard)
    x = torch.randn(n, h, generator=gen).to(dtype)
    got = tk.moe_experts_fp8(x, weights, ids, gate_up, gs, down, ds)
    want = R.moe_experts_fp8(x, weights, ids, gate_up, gs, down, ds)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,e,i,h,shard", [(1, 4, 64, 64, None), (5, 8, 32, 96, None), (40, 6, 96, 64, (3, 3))])
def test_mxfp4_experts_match_the_reference(dtype, n, e, i, h, shard):
    gen = torch.Generator().manual_seed(n * 100 + e + 1)
    held = shard[1] if shard else e
    gu, gus, down, ds = _mxfp4_experts(held, i, h, gen)
    gub, db = (torch.randn(held, 2 * i, generator=gen) * 0.1).to(dtype), (torch.randn(held, h, generator=gen) * 0.1).to(dtype)
    weights, ids = _routing(n, e, 2, gen, dtype, shard)
    x = (torch.randn(n, h, generator=gen) * 0.5).to(dtype)
    got = tk.moe_experts_swiglu_mxfp4(x, weights, ids, gu, gus, gub, down, ds, db, 1.702, 7.0)
    want = R.moe_experts_swiglu_mxfp4(x, weights, ids, gu, gus, gub, down, ds, db, 1.702, 7.0)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_references_dequantize_as_the_checkpoint_reader_does():
    """The references' on-device dequantizers against `models.quantized`'s, through the dense
    references: the same experts, value for value."""
    gen = torch.Generator().manual_seed(3)
    e, i, h = 3, 160, 200
    gate_up, gs, down, ds = _fp8_experts(e, i, h, gen)
    rows = -(-i // 128)
    dense_gu = torch.cat([torch.cat((Q.dequantize_fp8(gate_up[x, :i].view(torch.float8_e4m3fn), gs[x, :rows]),
                                     Q.dequantize_fp8(gate_up[x, i:].view(torch.float8_e4m3fn), gs[x, rows:])))[None]
                          for x in range(e)])
    dense_down = Q.dequantize_fp8(down.view(torch.float8_e4m3fn), ds)
    weights, ids = _routing(4, e, 2, gen, torch.float32)
    x = torch.randn(4, h, generator=gen)
    torch.testing.assert_close(R.moe_experts_fp8(x, weights, ids, gate_up, gs, down, ds),
                               R.moe_experts(x, weights, ids, dense_gu, dense_down), atol=0, rtol=0)
    gu, gus, dn, dns = _mxfp4_experts(e, 64, 96, gen)
    gub, db = torch.randn(e, 128, generator=gen), torch.randn(e, 96, generator=gen)
    weights, ids = _routing(4, e, 2, gen, torch.float32)
    x = torch.randn(4, 96, generator=gen)
    assert torch.equal(dequantize_mxfp4(gu, gus, torch.float32), Q.dequantize_mxfp4(gu, gus))
    torch.testing.assert_close(  # the same values, laid out otherwise: float32 sums in another order
        R.moe_experts_swiglu_mxfp4(x, weights, ids, gu, gus, gub, dn, dns, db, 1.702, 7.0),
        R.moe_experts_swiglu(x, weights, ids, Q.dequantize_mxfp4(gu, gus), gub, Q.dequantize_mxfp4(dn, dns), db,
                             1.702, 7.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["moe_experts_fp8", "moe_experts_swiglu_mxfp4"])
def test_both_backends_share_the_signature(name):
    assert inspect.signature(getattr(R, name)).parameters.keys() == inspect.signature(getattr(tk, name)).parameters.keys()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_the_widest_blocks(fmt):
    """128 pairs a block (a prefill chunk): a float32 model's narrowest tiles (16 wide), so the fp8
    tiles step through a 128 x 128 scale block in eight (I 136: a second block of channels) and the
    MXFP4 K-direction tile covers half a group of 32."""
    from opweave.kernels.triton_kernels.moe import moe_block_m

    gen = torch.Generator().manual_seed(128)
    n, e, h = 160, 4, 64
    assert moe_block_m(n, 2, e) == 128
    weights, ids = _routing(n, e, 2, gen, torch.float32)
    x = torch.randn(n, h, generator=gen)
    if fmt == "fp8":
        args = _fp8_experts(e, 136, h, gen)
        got, want = tk.moe_experts_fp8(x, weights, ids, *args), R.moe_experts_fp8(x, weights, ids, *args)
    else:
        gu, gus, down, ds = _mxfp4_experts(e, 64, h, gen)
        gub, db = torch.randn(e, 128, generator=gen) * 0.1, torch.randn(e, h, generator=gen) * 0.1
        args = (gu, gus, gub, down, ds, db, 1.702, 7.0)
        got = tk.moe_experts_swiglu_mxfp4(x, weights, ids, *args)
        want = R.moe_experts_swiglu_mxfp4(x, weights, ids, *args)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_mxfp4_channels_in_whole_groups():
    gen = torch.Generator().manual_seed(5)
    e, h = 2, 64
    gu = torch.zeros(e, 2 * 48, h // 32, 16, dtype=torch.uint8)
    gus = torch.full((e, 96, h // 32), 127, dtype=torch.uint8)
    down, ds = torch.zeros(e, h, 1, 16, dtype=torch.uint8), torch.full((e, h, 1), 127, dtype=torch.uint8)
    weights, ids = _routing(1, e, 2, gen, torch.float32)
    with pytest.raises(AssertionError, match="whole groups of 32"):
        tk.moe_experts_swiglu_mxfp4(torch.zeros(1, h), weights, ids, gu, gus, torch.zeros(e, 96), down, ds,
                                    torch.zeros(e, h), 1.702, 7.0)
