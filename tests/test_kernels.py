"""The kernel library: the operator modules call the torch references (checked bitwise), blocked
attention against a naive softmax, and the Triton kernels against the references (under
TRITON_INTERPRET=1 on CPU; skipped without triton).

Tolerances of the Triton tests: float32 1e-5; float16 2e-3 (about two units in the last place:
the kernels round once where the references round after each torch op); bfloat16 (attention and
RMSNorm only) 2e-2, because the interpreter truncates float32 -> bfloat16 casts instead of
rounding them to nearest (docs/kernels.md).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from opweave.kernels import KERNEL_NAMES, get_backend
from opweave.kernels import cpu as CPUK
from opweave.errors import OpWeaveError
from opweave.models import ops, ops_linear
from opweave.models.config import FULL, SLIDING
from opweave.models.hf_config import config_from_hf

ref = get_backend("torch")

TINY_NEXT = dict(model_type="qwen3_next", vocab_size=64, hidden_size=32, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
                 partial_rotary_factor=0.25, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                 norm_topk_prob=True, shared_expert_intermediate_size=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                 linear_conv_kernel_dim=4, torch_dtype="float32")
TINY_GEMMA = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  sliding_window=4, rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=16,
                  torch_dtype="float32")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.float16]


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.5).to(p.dtype)


def _cfg(raw: dict, dtype: str = "float32"):
    return config_from_hf(raw, "tiny").with_dtype(dtype)


@pytest.fixture
def tri(monkeypatch):
    pytest.importorskip("triton")
    mod = get_backend("triton")
    monkeypatch.setattr(mod.attention, "ATTN_BLOCK_N", 16)  # several cache blocks even on short test caches
    return mod


# ---------------------------------------------------------------------------------------------- interface

def test_backends_share_one_interface():
    for name in KERNEL_NAMES:
        assert callable(getattr(ref, name)), name
    with pytest.raises(OpWeaveError, match="unknown kernel backend"):
        get_backend("cuda")
    pytest.importorskip("triton")
    tri = get_backend("triton")
    for name in KERNEL_NAMES:
        assert inspect.signature(getattr(tri, name)) == inspect.signature(getattr(ref, name)), name


def test_triton_backend_without_triton_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(OpWeaveError, match="needs the triton package"):
        get_backend("triton")


# ---------------------------------------------------------------------------------------------- references vs modules

@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rms_norm_reference_is_the_module(dtype):
    cfg = _cfg(TINY_NEXT, dtype)
    for offset in (False, True):
        c = dataclasses.replace(cfg, norm_offset=offset)
        m = ops.RMSNorm(c, 0, "model.layers.0.input_layernorm.weight")
        _randomize(m)
        x = torch.randn(3, 1, c.hidden_size).to(m.weight.dtype)
        want = ref.rms_norm(x, m.weight, c.rms_norm_eps, c.norm_offset)
        # the module runs the CPU kernels' function: float32 in C (the same math, another summation
        # order: tests/test_cpu_kernels.py), other dtypes the reference itself
        assert torch.equal(CPUK.rms_norm(x, m.weight, c.rms_norm_eps, c.norm_offset), m(x))
        if dtype == "float32":
            torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(want, m(x))


@pytest.mark.parametrize("raw,layer_type", [(TINY_NEXT, FULL), (TINY_GEMMA, SLIDING)], ids=["partial", "full"])
def test_rope_reference_is_the_module(raw, layer_type):
    cfg = _cfg(raw)
    m = ops.Rope(cfg, 0, cfg.rope[layer_type])
    q = torch.randn(3, 1, cfg.num_heads, cfg.head_dim)
    k = torch.randn(3, 1, cfg.num_kv_heads, cfg.head_dim)
    positions = torch.tensor([[0], [7], [-1]])
    got = ref.rope(q, k, positions, m.inv_freq, m.rot_dim)
    want = m(q, k, positions)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("window", [None, 4])
def test_decode_attention_reference_is_the_module(window):
    cfg = _cfg(TINY_GEMMA)
    m = ops.Attention(cfg, 0, window)
    b, context, hq, hkv, d = 4, 12, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    m.allocate_state(b, context, "cpu")
    assert m.k_cache.shape[1] == (window or context)  # a sliding window keeps a ring of its size
    m.k_cache.normal_()
    m.v_cache.normal_()
    q, k, v = torch.randn(b, 1, hq, d), torch.randn(b, 1, hkv, d), torch.randn(b, 1, hkv, d)
    positions = torch.tensor([[0], [3], [11], [-1]])
    before = m.k_cache.clone(), m.v_cache.clone()
    want = m(q, k, v, positions)  # writes k, v into the cache, then attends
    ref.cache_write(*before, k, v, positions)
    assert torch.equal(before[0], m.k_cache) and torch.equal(before[1], m.v_cache)
    got = ref.decode_attention(q[:, 0], m.k_cache, m.v_cache, positions[:, 0], cfg.attn_scale, window)
    assert torch.equal(got.reshape(want.shape), want)


def _naive_attention(q, k, v, q_pos, k_pos, scale, window):
    """Softmax over every key (no blocks) with the causal / window mask by position; [B, T, Hq, D]."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bthd,blhd->bhtl", q, k) * scale
    qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
    allowed = (kp >= 0) & (kp <= qp) & ((kp > qp - window) if window else True)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhtl,blhd->bthd", p, v)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "online-softmax"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block", [3, 256])
def test_chunk_attention_in_key_blocks(monkeypatch, window, block, fused):
    """A prefill chunk over a wrapped ring and itself, in key blocks smaller than the ring and the
    chunk (online softmax across blocks, or the CPU's fused kernel per block merged by log-sum-exp),
    equals one softmax over the whole history."""
    monkeypatch.setattr(ref, "ATTN_KEY_BLOCK", block)
    if not fused:
        monkeypatch.setattr(ref, "_fused_attention_op", lambda: None)
    elif ref._fused_attention_op() is None:
        pytest.skip("this torch build has no fused CPU attention")
    gen = torch.Generator().manual_seed(4)
    b, t, hq, hkv, d, slots = 3, 7, 4, 2, 8, (window or 40)  # a full cache holds the context (40)
    start = torch.tensor([0, 9, 23])  # position of each row's first chunk column
    history = torch.randn(b, 40, 2, hkv, d, generator=gen)  # keys and values of positions 0..39
    positions = start[:, None] + torch.arange(t)
    positions[2, :2] = -1  # left padding: row 2's chunk starts at 25 (the ring has wrapped)
    k_cache, v_cache = torch.randn(b, slots, hkv, d), torch.randn(b, slots, hkv, d)  # stale slots
    for row in range(b):
        for p in range(int(positions[row][positions[row] >= 0].min())):
            k_cache[row, p % slots], v_cache[row, p % slots] = history[row, p, 0], history[row, p, 1]
    q = torch.randn(b, t, hq, d, generator=gen)
    k = torch.stack([history[r, positions[r].clamp(min=0), 0] for r in range(b)])
    v = torch.stack([history[r, positions[r].clamp(min=0), 1] for r in range(b)])
    got = ref.chunk_attention(q, k, v, k_cache, v_cache, positions, 0.3, window)
    all_pos = torch.arange(40).repeat(b, 1)
    all_pos = torch.where(all_pos < start[:, None] + t, all_pos, -1)  # the future is not there
    want = _naive_attention(q, history[:, :, 0], history[:, :, 1], positions, all_pos, 0.3, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_attention_equals_the_online_softmax_with_sinks_and_padding(monkeypatch, dtype):
    """The CPU's fused path (`_attend_fused`) gives `_attend`'s online softmax: GQA, key blocks
    merged by log-sum-exp, per-head sinks, a window, and padding queries (zeros)."""
    if ref._fused_attention_op() is None:
        pytest.skip("this torch build has no fused CPU attention")
    monkeypatch.setattr(ref, "ATTN_KEY_BLOCK", 4)
    gen = torch.Generator().manual_seed(5)
    b, t, hq, hkv, d, slots = 2, 5, 6, 2, 8, 11
    q = torch.randn(b, t, hq, d, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(b, slots, hkv, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, t, hkv, d, generator=gen).to(dtype) for _ in range(2))
    positions = torch.tensor([[6, 7, 8, 9, 10], [-1, -1, 3, 4, 5]])
    sinks = torch.randn(hq, generator=gen)
    for window, sink in ((None, None), (3, None), (None, sinks), (4, sinks)):
        got = ref.chunk_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions, 0.4, window, sinks=sink)
        monkeypatch.setattr(ref, "_fused_attention_op", lambda: None)
        want = ref.chunk_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions, 0.4, window, sinks=sink)
        monkeypatch.undo()
        monkeypatch.setattr(ref, "ATTN_KEY_BLOCK", 4)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert torch.equal(got[1, :2], torch.zeros_like(got[1, :2]))  # padding queries


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_act_reference_is_the_module(act):
    cfg = dataclasses.replace(_cfg(TINY_GEMMA), hidden_act=act)
    gate, up = torch.randn(3, 1, cfg.intermediate_size), torch.randn(3, 1, cfg.intermediate_size)
    got = ops.Act(cfg, 0)(gate, up)
    assert torch.equal(CPUK.gated_act(gate, up, cfg.hidden_act), got)  # silu in float32: C
    torch.testing.assert_close(got, ref.gated_act(gate, up, cfg.hidden_act), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("renorm", [True, False])
def test_moe_reference_is_the_module(renorm):
    raw = {**TINY_NEXT, "norm_topk_prob": renorm}
    cfg = _cfg(raw)
    router, experts = ops.MoERouter(cfg, 0), ops.MoEExperts(cfg, 0)
    _randomize(router, 1)
    _randomize(experts, 2)
    x = torch.randn(3, 2, cfg.hidden_size)
    w_mod, ids_mod = router(x)
    w, ids = ref.moe_route(F.linear(x, router.weight), cfg.moe.top_k, cfg.moe.norm_topk_prob)
    assert torch.equal(w, w_mod) and torch.equal(ids, ids_mod)
    assert torch.equal(ref.moe_experts(x, w, ids, experts.gate_up, experts.down), experts(x, w, ids))


def test_argmax_reference_is_the_module():
    cfg = _cfg(TINY_GEMMA)
    logits = torch.randn(4, 1, cfg.vocab_size)
    assert torch.equal(ref.argmax(logits[:, -1]), ops.Sample(cfg)(logits))


def _gdn_decode_with_kernels(backend, m: ops_linear.GatedDeltaNet, mixed, z, b, a, positions):
    """One decode token of GatedDeltaNet with the recurrence from `backend.gdn_step` (conv, gates
    and gated norm as in the module). Returns (out [B, 1, Hv*Dv], new recurrent state)."""
    bsz = mixed.shape[0]
    pos = positions[:, 0]
    u, _ = ref.causal_conv_step(mixed[:, 0], m.conv_state, m.conv_weight[:, 0, :], pos)
    q, k, v = torch.split(u, [m.key_dim, m.key_dim, m.hv * m.dv], dim=-1)
    beta = torch.sigmoid(b[:, 0]).float()
    g = -m.A_log.float().exp() * F.softplus(a[:, 0].float() + m.dt_bias.float())
    o, state = backend.gdn_step(q.reshape(bsz, m.hk, m.dk), k.reshape(bsz, m.hk, m.dk), v.reshape(bsz, m.hv, m.dv),
                                g, beta, m.recurrent_state.clone(), pos)  # Triton's updates it in place
    h = ref.gated_rms_norm(o, m.norm_weight, z[:, 0], m.cfg.rms_norm_eps)
    return h.reshape(bsz, 1, m.hv * m.dv), state


def _gdn_module(dtype: str):
    cfg = _cfg(TINY_NEXT, dtype)
    m = ops_linear.GatedDeltaNet(cfg, 0)
    _randomize(m, 3)
    m.allocate_state(3, 16, "cpu")
    m.conv_state.normal_()
    m.recurrent_state.normal_()
    la = cfg.linear_attn
    x = (torch.randn(3, 1, m.conv_dim), torch.randn(3, 1, la.num_value_heads, la.value_head_dim),
         torch.randn(3, 1, la.num_value_heads), torch.randn(3, 1, la.num_value_heads))
    return m, tuple(t.to(m.conv_weight.dtype) for t in x), torch.tensor([[5], [0], [-1]])


def test_gdn_step_reference_is_the_module():
    m, (mixed, z, b, a), positions = _gdn_module("float32")
    got, state = _gdn_decode_with_kernels(ref, m, mixed, z, b, a, positions)
    want = m(mixed, z, b, a, positions)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, m.recurrent_state, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- Triton vs references

def _close(got, want, dtype):
    if isinstance(want, tuple):
        for g, w in zip(got, want):
            _close(g, w, dtype)
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.is_floating_point():
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 40), (2, 1, 64)])
def test_rms_norm_triton(tri, dtype, shape):
    x, w = torch.randn(shape).to(dtype), torch.randn(shape[-1]).to(dtype)
    for offset in (False, True):
        _close(tri.rms_norm(x, w, 1e-6, offset), ref.rms_norm(x, w, 1e-6, offset), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,rot", [(6, 2, 24, 24), (6, 2, 24, 6), (4, 4, 64, 16), (3, 1, 128, 128)])
def test_rope_triton(tri, dtype, hq, hkv, d, rot):
    q, k = torch.randn(4, hq, d).to(dtype), torch.randn(4, hkv, d).to(dtype)
    positions = torch.tensor([0, 1, -1, 131071 if dtype == torch.float32 else 4097])
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot, 2).float() / rot))
    _close(tri.rope(q, k, positions, inv_freq, rot), ref.rope(q, k, positions, inv_freq, rot), dtype)


def test_rope_triton_leading_dims_and_strided_input(tri):
    qkv = torch.randn(2, 3, 4 + 2 + 2, 16)  # q, k, v heads of one projection: q and k are strided views
    q, k = qkv[:, :, :4], qkv[:, :, 4:6]
    positions = torch.tensor([[0, 1, 2], [9, 10, 11]])
    inv_freq = ops.rope_inv_freq(_cfg(TINY_NEXT).rope[FULL], 16)
    _close(tri.rope(q, k, positions, inv_freq, 4), ref.rope(q, k, positions, inv_freq, 4), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16])
@pytest.mark.parametrize("hkv,group,d", [(2, 3, 24), (1, 8, 64), (3, 1, 16)])
@pytest.mark.parametrize("window", [None, 5, 16])
@pytest.mark.slow
def test_decode_attention_triton(tri, dtype, hkv, group, d, window):
    b, length = 7, 40
    q = torch.randn(b, hkv * group, d).to(dtype)
    # ring-buffer caches (position p at slot p % length); a strided view, as a microbatch's rows are
    k_cache = torch.randn(b + 1, length, hkv, d).to(dtype)[1:]
    v_cache = torch.randn(b + 1, length, hkv, d).to(dtype)[1:]
    # first slot; window boundary on and off block edges (16); last slot; padding; wrapped rings
    positions = torch.tensor([0, 20, 31, length - 1, -1, length + 3, 3 * length + 17])
    _close(tri.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, window),
           ref.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 8), (1, 3, 12, 20), (2, 2, 32, 128)])
@pytest.mark.slow
def test_gdn_step_triton(tri, dtype, hk, hv, dk, dv):
    b = 3
    q, k = torch.randn(b, hk, dk).to(dtype), torch.randn(b, hk, dk).to(dtype)
    v = torch.randn(b, hv, dv).to(dtype)
    g, beta = -torch.rand(b, hv) * 2, torch.rand(b, hv)
    state = torch.randn(b, hv, dk, dv)
    for positions in (None, torch.tensor([4, 0, -1])):
        _close(tri.gdn_step(q, k, v, g, beta, state.clone(), positions),  # in place: a copy
               ref.gdn_step(q, k, v, g, beta, state, positions), dtype)


def test_gdn_step_triton_in_the_module_pipeline(tri):
    m, (mixed, z, b, a), positions = _gdn_module("float16")
    got = _gdn_decode_with_kernels(tri, m, mixed, z, b, a, positions)
    _close(got, _gdn_decode_with_kernels(ref, m, mixed, z, b, a, positions), torch.float16)


# ------------------------------------------------------------------------------ split-KV attention, in-place GDN

@pytest.fixture
def tri_split(tri, monkeypatch):
    """The Triton backend splitting even test-sized caches: 16-position splits (blocks of 16 slots)."""
    monkeypatch.setattr(tri.attention, "ATTN_MIN_SPLIT", 16)
    return tri


def _attention_inputs(b, hkv, group, d, slots, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * group, d, generator=gen).to(dtype)
    # strided views of larger caches, as a microbatch's rows are
    k_cache = torch.randn(b + 1, slots, hkv, d, generator=gen).to(dtype)[1:]
    v_cache = torch.randn(b + 1, slots, hkv, d, generator=gen).to(dtype)[1:]
    return q, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,d", [(1, 64), (4, 128), (8, 256)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.slow
def test_split_kv_decode_attention_triton(tri_split, dtype, group, d, window):
    b, hkv, slots = 5, 2, 64
    q, k_cache, v_cache = _attention_inputs(b, hkv, group, d, slots, dtype)
    # first slot; mid-ring (window boundary inside a split); last slot; padding; a wrapped ring
    # whose attended span starts off the split grid (position 139)
    positions = torch.tensor([0, 37, slots - 1, -1, 3 * slots + 10])
    _, split = tri_split.attention_plan(q, k_cache, window)
    assert (split.splits, split.split_len) == ((4, 16) if window is None else (2, 16))
    _close(tri_split.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, window),
           ref.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_decode_attention_with_mostly_empty_splits(tri_split, dtype):
    """A long ring with short sequences: 16 splits, of which at most two hold attended positions;
    the empty ones merge as nothing (no NaN) and padding gives exact zeros."""
    b, hkv, group, d, slots = 3, 1, 4, 32, 256
    q, k_cache, v_cache = _attention_inputs(b, hkv, group, d, slots, dtype, seed=1)
    positions = torch.tensor([2, 20, -1])
    assert tri_split.attention_plan(q, k_cache, None)[1].splits == 16
    got = tri_split.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, None)
    assert torch.isfinite(got).all() and torch.equal(got[2], torch.zeros_like(got[2]))
    _close(got, ref.decode_attention(q, k_cache, v_cache, positions, d ** -0.5, None), dtype)


class _NoHostReads(TorchDispatchMode):
    """Fails on any read of a tensor value by the host (`.item()`, `int()`, `bool()`, `.tolist()`
    reach `aten._local_scalar_dense`) and on any copy to the CPU from another device; records the
    sizes of new allocations."""

    def __init__(self):
        super().__init__()
        self.allocated: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            raise AssertionError("the host read a tensor value")
        if func is aten._to_copy.default and str(kwargs.get("device", args[0].device)) == "cpu":
            assert args[0].device.type == "cpu", f"copy to the cpu from {args[0].device}"
        if func is aten.copy_.default:
            dst, src = args[0].device, args[1].device
            assert dst.type != "cpu" or src.type == "cpu", f"copy to the cpu from {src}"
        out = func(*args, **kwargs)
        if func.overloadpacket in (aten.empty, aten.empty_like, aten.empty_strided, aten.zeros, aten.new_empty):
            self.allocated.append(out.numel())
        return out


def test_no_host_reads_mode_has_teeth():
    with pytest.raises(AssertionError, match="host read"), _NoHostReads():
        int(torch.tensor([3]).sum())
    with pytest.raises(AssertionError, match="copy to the cpu from meta"), _NoHostReads():
        torch.empty(2, device="meta").cpu()


def test_split_kv_decode_attention_launch_reads_nothing_on_the_host(tri, monkeypatch):
    """Batch 1 at 128K on an H200-sized GPU (132 SMs), meta tensors: the launch reads no tensor
    value on the host (so it can be captured in a CUDA graph), and splits the cache so that the
    8 KV heads fill the GPU instead of running as 8 programs."""
    from opweave.kernels import targets

    from launch_spy import record_launches

    grids = record_launches(monkeypatch, {name: (tri.attention, name) for name in
                                          ("_decode_attention_kernel", "_decode_attention_merge_kernel")})
    monkeypatch.setattr(targets, "launch_sm_count", lambda device: 132)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, cache = torch.empty(1, 32, 128, **meta), torch.empty(1, 131072, 8, 128, **meta)
    positions = torch.empty(1, dtype=torch.int64, device="meta")
    with _NoHostReads():
        out = tri.decode_attention(q, cache, cache, positions, 128 ** -0.5, None)
    assert out.shape == q.shape
    b, hkv, splits = grids["_decode_attention_kernel"]
    assert (b, hkv) == (1, 8) and b * hkv * splits >= targets.ATTN_PROGRAMS_PER_SM * 132
    assert grids["_decode_attention_merge_kernel"] == (1, 32)


def test_triton_attention_and_gdn_step_run_without_host_reads(tri_split):
    """The interpreted kernels themselves under the mode: same results as outside it."""
    q, k_cache, v_cache = _attention_inputs(3, 2, 4, 32, 64, torch.float32, seed=2)
    positions = torch.tensor([40, -1, 130])
    with _NoHostReads():
        got = tri_split.decode_attention(q, k_cache, v_cache, positions, 0.2, 24)
    _close(got, ref.decode_attention(q, k_cache, v_cache, positions, 0.2, 24), torch.float32)
    args = _gdn_inputs(torch.float32)
    state = args[5].clone()
    with _NoHostReads() as mode:
        o, _ = tri_split.gdn_step(*args[:5], state, args[6])
    assert max(mode.allocated) < state.numel()  # the output only: no second state buffer
    _close((o, state), ref.gdn_step(*args), torch.float32)


def _gdn_inputs(dtype, b=4, hk=2, hv=4, dk=16, dv=32):
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(b, hk, dk, generator=gen).to(dtype), torch.randn(b, hk, dk, generator=gen).to(dtype)
    v = torch.randn(b, hv, dv, generator=gen).to(dtype)
    g, beta = -torch.rand(b, hv, generator=gen) * 2, torch.rand(b, hv, generator=gen)
    state = torch.randn(b + 1, hv, dk, dv, generator=gen)[1:]  # a microbatch's rows of the state slots
    return q, k, v, g, beta, state, torch.tensor([4, 0, -1, 9])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_step_triton_updates_the_state_in_place(tri, dtype):
    q, k, v, g, beta, state, positions = _gdn_inputs(dtype)
    before = state.clone()
    o, new_state = tri.gdn_step(q, k, v, g, beta, state, positions)
    assert new_state is state
    want_o, want_state = ref.gdn_step(q, k, v, g, beta, before, positions)
    _close((o, state), (want_o, want_state), dtype)
    assert torch.equal(state[2], before[2])  # padding: untouched, bit for bit
    assert not torch.equal(state[0], before[0]) and torch.equal(want_state[2], before[2])
    # a second step continues from the updated state, as the module's token loop does
    o2, _ = tri.gdn_step(q, k, v, g, beta, state, positions + 1)
    _close(o2, ref.gdn_step(q, k, v, g, beta, want_state, positions + 1)[0], dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy sigmoid(-large): 0
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["silu", "gelu_pytorch_tanh"])
def test_gated_act_triton(tri, dtype, kind):
    gate_up = torch.randn(3, 2, 2 * 50).to(dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)  # strided views, as a fused gate_up projection gives them
    _close(tri.gated_act(gate, up, kind), ref.gated_act(gate, up, kind), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k", [(6, 2), (10, 3), (64, 8)])
@pytest.mark.slow
def test_moe_route_triton(tri, dtype, experts, top_k):
    # distinct router logits, exact in every dtype: which of two tied experts is picked is not specified
    logits = ((torch.stack([torch.randperm(experts) for _ in range(6)]) - experts / 2) / 8).view(2, 3, experts)
    logits = logits.to(dtype)
    for renorm in (True, False):
        _close(tri.moe_route(logits, top_k, renorm), ref.moe_route(logits, top_k, renorm), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k,inter,hidden", [(6, 2, 24, 40), (4, 1, 16, 32), (5, 3, 200, 136)])
@pytest.mark.slow
def test_moe_experts_triton(tri, dtype, experts, top_k, inter, hidden):
    x = torch.randn(3, hidden).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden) * hidden ** -0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter) * inter ** -0.5).to(dtype)
    weights, ids = ref.moe_route(torch.randn(3, experts).to(dtype), top_k, True)
    _close(tri.moe_experts(x, weights, ids, gate_up, down), ref.moe_experts(x, weights, ids, gate_up, down), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 1000, 2500])
def test_argmax_triton(tri, dtype, vocab):
    logits = torch.randn(4, vocab).to(dtype)
    if vocab > 1:
        logits[1, vocab - 1] = 100.0   # maximum in the last (partial) block
        logits[2, :] = -1.0
        logits[2, [3, vocab - 2]] = 5.0  # a tie: the first index wins, like torch.argmax
        logits[3, :] = float("-inf")
    _close(tri.argmax(logits), ref.argmax(logits), dtype)


def test_gdn_module_runs_the_triton_recurrence_in_the_runtime_wrapper(tri):
    """`KernelOp` runs Gated-DeltaNet with the backend's `gdn_step`: a 4-token chunk then a decode
    token agree with the module, outputs and both states."""
    import copy

    from opweave.runtime.kernel_ops import KernelOp

    m, _, _ = _gdn_module("float32")
    wrapped = KernelOp(copy.deepcopy(m), tri)
    la = m.cfg.linear_attn
    gen = torch.Generator().manual_seed(5)
    for positions in (torch.tensor([[0, 1, 2, 3], [-1, -1, 7, 8], [-1, -1, -1, -1]]), torch.tensor([[4], [9], [0]])):
        t = positions.shape[1]
        x = (torch.randn(3, t, m.conv_dim, generator=gen), torch.randn(3, t, la.num_value_heads, la.value_head_dim,
             generator=gen), torch.randn(3, t, la.num_value_heads, generator=gen),
             torch.randn(3, t, la.num_value_heads, generator=gen))
        _close(wrapped(*x, positions), m(*x, positions), torch.float32)
        _close((wrapped.op.conv_state, wrapped.op.recurrent_state), (m.conv_state, m.recurrent_state), torch.float32)


def test_packed_linear_pads_few_rows_and_gives_the_dense_result(monkeypatch):
    """A packed GEMM on fewer than `PACKED_MIN_ROWS` rows computes that many (zeros added) and
    returns the rows asked for, in the input's leading shape, equal to `F.linear`'s."""
    if not ref.can_pack_linear():
        pytest.skip("no oneDNN in this torch build")
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(24, 16, generator=gen)
    packed = ref.pack_linear(w)
    seen = []
    original = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.append(x.shape[0] if x.dim() == 2 else x.shape[0] * x.shape[1])
        return original(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for shape in ((1, 1, 16), (1, 3, 16), (2, 16), (1, 9, 16)):
        x = torch.randn(*shape, generator=gen)
        got = ref.linear(x, packed)
        assert got.shape == (*shape[:-1], 24)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)
    assert seen == [ref.PACKED_MIN_ROWS, ref.PACKED_MIN_ROWS, ref.PACKED_MIN_ROWS, 9]
