"""Torch reference kernels: the math of every operator, written once.

The operator modules in `opweave.models.ops` / `opweave.models.ops_linear` call these functions
(they hold weights and state, and wire the calls); the runtime's CPU path is therefore these
functions, and they are the oracle the Triton backend (`triton_kernels`, same names and
signatures for the functions in `KERNEL_NAMES`) is tested against. Shapes and conventions are
documented in `docs/kernels.md`.

Besides the decode kernels (`KERNEL_NAMES`) this module holds the torch-only pieces the modules
need for steps of several tokens: `chunk_attention` (key-blocked attention of a prefill chunk over
the cache and itself), `cache_write` (writes a step's keys and values into a ring-buffer cache),
`causal_conv_step` and `gated_rms_norm` (Gated-DeltaNet). Their scratch is bounded by the block
sizes in `opweave.kernels.blocks`, never by the context.

KV caches are ring buffers: a cache of C slots holds position p at slot p % C. A full-attention
cache has C = context (so slot = position); a sliding-window cache has C = min(context, window).
Which position a slot holds is derived from the newest position of its sequence, so a slot reused
for a new request never shows the previous request's keys.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from opweave.kernels.blocks import ATTN_KEY_BLOCK, MOE_TOKEN_BLOCK
from opweave.kernels.stored import FP8_BLOCK, StoredMatrix, dequantize_fp8, dequantize_mxfp4

NON_FINITE_TOKEN = -1
"""The id the sampler gives a row whose logits are not all finite (NaN or infinite): argmax would
pick an arbitrary token (NaN wins, or an all-NaN row gives 0), so the row is marked instead and the
scheduler ends that request with an error. Chosen on the device (no host sync per step)."""

# running maximum before any key is seen: finite, so a fully masked block gives exp(-inf) = 0, not NaN
_NO_MAX = -1.0e30

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the CPU's fused attention takes


# ---------------------------------------------------------------------------------------------- GEMMs

PACKED_MIN_ROWS = 4
"""The fewest rows a packed GEMM computes (the extra rows are zeros, dropped after). oneDNN picks
its kernel by the row count, and the one it takes for one to three rows is slower than its
four-row kernel: on a Zen 4 core (fp32, one thread) the GEMMs of a decode step of
`bench/serve_peer.py`'s 155M-parameter Llama take 28 ms at one row, 35 ms at two and 22 ms at
four, and a two-row decode round of `opweave run` 54-59 ms unpadded against 46 ms padded. A
decode GEMM streams its weights from memory whatever its rows, so the padding costs next to
nothing where the small kernel is not slower."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or, for a weight packed by `pack_linear` (a oneDNN tensor), oneDNN's GEMM on it
    (on at least `PACKED_MIN_ROWS` rows); a weight held as a checkpoint stores it (`stored.StoredMatrix`)
    computes by its own `linear`."""
    if isinstance(weight, StoredMatrix):
        return weight.linear(x, bias)
    if weight.is_mkldnn:
        rows = x.numel() // x.shape[-1]
        if rows < PACKED_MIN_ROWS:
            flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, PACKED_MIN_ROWS - rows))
            out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")[:rows]
            return out.view(*x.shape[:-1], out.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def can_pack_linear() -> bool:
    """Whether this torch build packs linear weights for oneDNN (x86 and Arm CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A CPU linear weight [N, K] (float32 or bfloat16) in oneDNN's blocked layout for any batch: the
    same bytes, and a GEMM about 1.6x faster at decode batches (16 rows, one thread) than `F.linear`'s,
    what vLLM's CPU backend does with its weights (`linear` computes with it; results agree with
    `F.linear` to float rounding, the summation order differs)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


# ---------------------------------------------------------------------------------------------- norms

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim: `weight * norm(x)` or, with `offset`, `(1 + weight) * norm(x)`.

    Args:
        x: [..., H] activations.
        weight: [H].
        eps: added to the mean square.
        offset: scale by (1 + weight) in float32 (Gemma, Qwen3-Next) instead of weight.
    Returns:
        [..., H] in x's dtype.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add, then RMSNorm of the sum: the pre-norm of a layer's next sub-block.

    Args:
        x: [..., H] a sub-block's output; residual: [..., H] the residual stream (same dtype).
        weight, eps, offset: as in `rms_norm`.
    Returns:
        (normed, summed): summed = x + residual rounded to the model dtype (the new residual
        stream), normed = rms_norm(summed, weight, eps, offset).
    """
    summed = x + residual
    return rms_norm(summed, weight, eps, offset), summed


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (Gated-DeltaNet's q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------- RoPE

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         rot_dim: int, attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half convention) of the first `rot_dim` dims of each head.

    Args:
        q: [..., Hq, D]; k: [..., Hkv, D] with the same leading dims.
        positions: [...] int, the token positions (negative values, padding, act as 0).
        inv_freq: [rot_dim // 2] float32 inverse frequencies (`ops.rope_inv_freq`).
        rot_dim: rotated dims per head (D for full rotary, fewer for partial rotary).
        attention_factor: cos and sin are multiplied by it in float32 before rounding (YaRN).
    Returns:
        (q, k) rotated, in their dtypes.
    """
    freqs = positions.clamp(min=0)[..., None].float() * inv_freq.float()   # [..., rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]                  # broadcast over heads
    cos, sin = (emb.cos() * attention_factor).to(q.dtype), (emb.sin() * attention_factor).to(q.dtype)

    def apply(x):
        rot, keep = x[..., :rot_dim], x[..., rot_dim:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, keep), dim=-1)

    return apply(q), apply(k)


# ---------------------------------------------------------------------------------------------- attention

def ring_positions(newest: torch.Tensor, slots: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The position each ring slot j in [start, stop) holds when its sequence's newest cached
    position is `newest` [B]: newest - ((newest - j) mod slots) -> [B, stop - start] (negative: empty)."""
    j = torch.arange(start, slots if stop is None else stop, device=newest.device)
    return newest[:, None] - torch.remainder(newest[:, None] - j, slots)


def _cache_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, newest: torch.Tensor) -> Iterator:
    """(keys, values, key positions) of a ring cache in blocks of `ATTN_KEY_BLOCK` slots (views)."""
    slots = k_cache.shape[1]
    for start in range(0, slots, ATTN_KEY_BLOCK):
        stop = min(start + ATTN_KEY_BLOCK, slots)
        yield k_cache[:, start:stop], v_cache[:, start:stop], ring_positions(newest, slots, start, stop)


def _fused_attention_op():
    """The CPU's fused attention kernel (the one `F.scaled_dot_product_attention` runs on CPU),
    which also returns each query's log-sum-exp, so blocks of keys can be merged; None where
    this torch build has none."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_fused(q: torch.Tensor, q_pos: torch.Tensor, blocks, scale: float, window: int | None,
                  sinks: torch.Tensor | None, op) -> torch.Tensor:
    """`_attend` on the CPU with its fused attention kernel: per key block, the block's output
    and log-sum-exp (GQA in the kernel, no scores tensor), merged across blocks (and with the
    sink term) in float32. A query with no allowed key in a block takes nothing from it; one
    with none at all (padding) gets zeros. Same math as `_attend`, float rounding aside."""
    b, t, hq, d = q.shape
    qh = q.transpose(1, 2)                                                          # B,Hq,T,D
    qp = q_pos[:, None, :, None]                                                    # B,1,T,1
    out = lse = None
    for keys, vals, k_pos in blocks:
        kp = k_pos[:, None, None, :]                                                # B,1,1,L
        allowed = (kp >= 0) & (kp <= qp)
        if window:
            allowed = allowed & (kp > qp - window)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        o, l = op(qh, keys.transpose(1, 2).to(q.dtype), vals.transpose(1, 2).to(q.dtype), 0.0, False,
                  attn_mask=mask, scale=scale)
        l = torch.where(allowed.any(dim=-1), l, float("-inf"))                      # B,Hq,T
        o = o.float()
        if out is None:
            out, lse = o, l
            continue
        merged = torch.logaddexp(lse, l)
        safe = torch.where(torch.isfinite(merged), merged, 0.0)
        out = out * torch.exp(lse - safe)[..., None] + o * torch.exp(l - safe)[..., None]
        lse = merged
    if sinks is not None:  # one more softmax term exp(sink) with a zero value
        merged = torch.logaddexp(lse, sinks.float().view(1, hq, 1))
        out = out * torch.exp(lse - merged)[..., None]
    out = torch.where(torch.isfinite(lse)[..., None], out, 0.0)
    return out.transpose(1, 2).to(q.dtype).contiguous()


def _attend(q: torch.Tensor, q_pos: torch.Tensor, blocks, scale: float, window: int | None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Online-softmax attention (GQA) of queries over key blocks, float32 accumulation.

    A query at position p attends keys at positions kp with 0 <= kp <= p and, with a window,
    kp > p - window; a query with nothing to attend (padding) gets zeros. Scratch per block:
    [B, Hq, T, block] float32.

    Args:
        q: [B, T, Hq, D]; q_pos: [B, T] int.
        blocks: iterable of (keys [B, L, Hkv, D], values [B, L, Hkv, D], key positions [B, L]).
        sinks: optional [Hq] per-head sink logits (GPT-OSS): one more softmax term exp(sink) with a
            zero value, so the running max starts at the sink and the sum at 1.
    Returns:
        [B, T, Hq, D] in q's dtype.
    """
    op = _fused_attention_op() if q.device.type == "cpu" and q.dtype in _FUSED_DTYPES else None
    if op is not None:
        return _attend_fused(q, q_pos, blocks, scale, window, sinks, op)
    b, t, hq, d = q.shape
    hkv = g = qh = m = l = acc = None
    for keys, vals, k_pos in blocks:
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)  # an fp8 cache's block, read back (no copy otherwise)
        if qh is None:
            hkv = keys.shape[2]
            g = hq // hkv
            # a kv head's query heads and tokens as the rows of one matmul: no broadcast copy of the keys
            qh = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
            qp = q_pos[:, None, None, :].expand(b, 1, g, t).reshape(b, 1, g * t, 1)
            m = torch.full((b, hkv, g * t, 1), _NO_MAX, dtype=torch.float32, device=q.device)
            l = torch.zeros_like(m)
            if sinks is not None:  # head hkv * g + j: rows j * t .. j * t + t - 1 of kv head hkv
                sink = sinks.float().view(1, hkv, g, 1, 1).expand(1, hkv, g, t, 1).reshape(1, hkv, g * t, 1)
                m = torch.maximum(m, sink)
                l = l + 1.0
            acc = torch.zeros(b, hkv, g * t, d, dtype=torch.float32, device=q.device)
        # one matmul per kv head on the cache's own strides ([B, L, D] rows Hkv*D apart): a permuted
        # [B, Hkv, D, L] operand would be copied whole first, the cache read twice
        s = torch.stack([torch.matmul(qh[:, h], keys[:, :, h].transpose(1, 2)) for h in range(hkv)],
                        dim=1).float() * scale                                         # B,Hkv,G*T,L
        kp = k_pos[:, None, None, :]
        allowed = (kp >= 0) & (kp <= qp)
        if window:
            allowed = allowed & (kp > qp - window)
        s = s.masked_fill(~allowed, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        pv = p.to(vals.dtype)
        acc = acc * alpha + torch.stack([torch.matmul(pv[:, h], vals[:, :, h]) for h in range(hkv)], dim=1).float()
        m = m_new
    out = acc / torch.where(l > 0, l, 1.0)                                            # B,Hkv,G*T,D
    return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, hq, d).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one query token per sequence over its ring-buffer KV cache (GQA).

    Sequence b attends the cached positions kp <= positions[b] (and, with a sliding `window`,
    kp > pos - window); slot j holds position pos - ((pos - j) mod L). A sequence with a negative
    position (padding) gets zeros. The cache must already hold this token's k and v (slot pos % L).

    Args:
        q: [B, Hq, D].
        k_cache, v_cache: [B, L, Hkv, D] with Hq a multiple of Hkv (query head h reads kv head h // (Hq/Hkv)).
        positions: [B] int.
        scale: softmax scale of q·k.
        window: sliding-window size, or None (or 0) for full attention.
        sinks: optional [Hq] learned sink logits (GPT-OSS): each head's softmax has one more term
            exp(sink) whose value is zero (it only takes probability mass); padding still gets zeros.
    Returns:
        [B, Hq, D] in q's dtype.
    """
    out = _attend(q[:, None], positions[:, None], _cache_blocks(k_cache, v_cache, positions), scale, window,
                  sinks)
    return out[:, 0]


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, positions: torch.Tensor, scale: float,
                    window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a chunk of T tokens per sequence over its cached positions and the chunk itself.

    The cache holds the positions before the chunk's first valid position (not this chunk's keys:
    write them afterwards with `cache_write`); the chunk's own keys are attended causally. Keys are
    processed in blocks of `ATTN_KEY_BLOCK`, so the scratch is [B, Hq, T, ATTN_KEY_BLOCK] float32
    whatever the context.

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; caches [B, L, Hkv, D].
        positions: [B, T] int, -1 for padding (anywhere in the row).
        sinks: optional [Hq] sink logits (see `decode_attention`).
    Returns:
        [B, T, Hq, D] in q's dtype (zeros for padding).
    """
    t = positions.shape[1]
    first = torch.where(positions >= 0, positions, torch.iinfo(positions.dtype).max).amin(dim=1)
    cached = first - 1  # newest cached position of each sequence (rows of padding only: irrelevant)

    def blocks():
        yield from _cache_blocks(k_cache, v_cache, cached)
        for start in range(0, t, ATTN_KEY_BLOCK):
            stop = min(start + ATTN_KEY_BLOCK, t)
            yield k[:, start:stop], v[:, start:stop], positions[:, start:stop]

    return _attend(q, positions, blocks(), scale, window, sinks)


FP8_MAX = 448.0
"""The largest float8 e4m3 value: a cache in it saturates there (scale 1, `to_cache`)."""


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` stores it: a float8 e4m3 cache saturates at +-FP8_MAX (scale 1)
    and rounds to nearest, explicitly, so the Triton writes (`triton_kernels.paged`, which clamp
    the same way) agree whatever a cast does out of range; another dtype casts."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor) -> None:
    """Writes a step's keys and values into ring-buffer caches, in place: position p -> slot p % L.

    Only a sequence's newest L positions of the step are written (older ones of a chunk longer than
    the ring would be overwritten in the same step). Padding (position < 0) and those dropped
    tokens are redirected to a slot that the step writes anyway, with the value it gets there
    (the sequence's newest token; a row of padding only rewrites slot 0 with its own content), so
    every duplicate index carries the same value and the result does not depend on write order.
    No host synchronisation, no data-dependent shapes (runs on the meta device and in CUDA graphs).

    Args:
        k_cache, v_cache: [B, L, Hkv, D] (the model's dtype, or float8 e4m3: values rounded to it).
        k, v: [B, T, Hkv, D].
        positions: [B, T] int.
    """
    b, t = positions.shape
    slots = k_cache.shape[1]
    newest, t_newest = positions.max(dim=1)                                    # [B]
    keep = (positions >= 0) & (positions > newest[:, None] - slots)
    any_valid = (newest >= 0)[:, None, None]
    fill_slot = torch.remainder(newest.clamp(min=0), slots)                    # [B]
    batch = torch.arange(b, device=positions.device)
    index = torch.where(keep, torch.remainder(positions.clamp(min=0), slots), fill_slot[:, None])
    rows = batch[:, None].expand(b, t)
    for cache, new in ((k_cache, k), (v_cache, v)):
        old = cache[batch, fill_slot].to(new.dtype)  # an fp8 cache's slot, in the model's dtype
        fill = torch.where(any_valid, new[batch, t_newest], old)  # [B, Hkv, D]
        cache[rows, index] = to_cache(torch.where(keep[..., None, None], new, fill[:, None]), cache.dtype)


# ---------------------------------------------------------------------------------------------- Gated-DeltaNet

def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of Gated-DeltaNet's causal depthwise conv + silu.

    u = silu(sum_j w[:, j] * window[:, j]) over window = [K-1 previous inputs | x] (float32 sum, u
    rounded to x's dtype). Position 0 starts a new sequence (zeros before it); a negative position
    (padding) keeps the old conv state.

    Args:
        x: [B, C] this token's conv input; conv_state: [B, C, K-1]; weight: [C, K]; positions: [B].
    Returns:
        (u [B, C] in x's dtype, new conv state [B, C, K-1]).
    """
    prev = torch.where((positions == 0)[:, None, None], 0.0, conv_state)
    window = torch.cat((prev, x[:, :, None]), dim=-1)                                 # [B, C, K]
    u = F.silu((window.float() * weight.float()).sum(dim=-1)).to(x.dtype)
    return u, torch.where((positions >= 0)[:, None, None], window[:, :, 1:], conv_state)


def gdn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Gated-DeltaNet recurrent step (after the causal conv, before the gated norm).

    Per value head h (key head h // (Hv/Hk)), with q, k l2-normalised in float32 and q scaled by Dk^-0.5:
        S = exp(g) * S;  S = S + k (beta * (v - S^T k))^T;  o = S^T q.
    With `positions`, a sequence at position 0 starts from S = 0 and one at a negative position
    (padding) keeps its old state (its output is computed but meaningless).

    Args:
        q, k: [B, Hk, Dk] (conv output, any float dtype).
        v: [B, Hv, Dv]; its dtype is the output dtype.
        g: [B, Hv] log decay (<= 0), float32.
        beta: [B, Hv] write strength, float32.
        state: [B, Hv, Dk, Dv] float32 (not modified here; the Triton backend updates it in place
            and returns it: callers use the returned state).
        positions: optional [B] int.
    Returns:
        (o [B, Hv, Dv] in v's dtype, new_state [B, Hv, Dk, Dv] float32).
    """
    hk, dk = q.shape[1], q.shape[2]
    r = v.shape[1] // hk
    qf = l2_normalize(q.float()).repeat_interleave(r, dim=1) * dk ** -0.5
    kf = l2_normalize(k.float()).repeat_interleave(r, dim=1)                 # [B, Hv, Dk]
    s = state
    if positions is not None:
        s = torch.where((positions == 0)[:, None, None, None], 0.0, state)
    s = s * g.float().exp()[..., None, None]
    predicted = (s * kf[..., None]).sum(dim=-2)                              # S^T k  [B, Hv, Dv]
    delta = (v.float() - predicted) * beta.float()[..., None]
    s = s + kf[..., None] * delta[:, :, None, :]
    o = (s * qf[..., None]).sum(dim=-2)                                      # S^T q
    if positions is not None:
        s = torch.where((positions >= 0)[:, None, None, None], s, state)
    return o.to(v.dtype), s


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated-DeltaNet's output norm: rms_norm(o) * w (model dtype) * silu(z) (float32), in o's dtype.

    Shapes: o, z [..., Dv]; weight [Dv]."""
    return (rms_norm(o, weight, eps, False) * F.silu(z.float())).to(o.dtype)


# ---------------------------------------------------------------------------------------------- MLP / MoE

def activation(kind: str, x: torch.Tensor) -> torch.Tensor:
    """silu (`kind` "silu") or tanh-approximated gelu (any other kind, e.g. "gelu_pytorch_tanh")."""
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh")


def gated_act(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """act(gate) * up (see `activation`). Shapes [..., I]; result in gate's dtype."""
    return activation(kind, gate) * up


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: softmax over experts in float32, top-k, optional renormalisation of the k weights.

    Args:
        logits: [..., E] router logits.
        top_k: experts per token.
        renormalize: divide the k weights by their sum.
    Returns:
        (weights [..., k] in logits' dtype, ids [..., k] int64), largest weight first.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def local_expert_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Global expert ids -> the ids an expert-parallel shard holding experts [first, first + count)
    runs them with: id - first for its own experts, `count` (the foreign-pair sentinel: the pair
    contributes nothing on this shard) for the others. On the device, no host synchronisation."""
    local = ids - first
    return torch.where((local >= 0) & (local < count), local, count)


def _held_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids clamped into [0, E) for gathering, whether each pair's expert is held: id < E)."""
    return ids.clamp(max=num_experts - 1), ids < num_experts


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """Routed experts: sum_k weights_k * down[ids_k] (silu(gate) * up), [gate | up] = gate_up[ids_k] x.

    The selected experts' weights are gathered per token (shapes never depend on the routing), in
    blocks of `MOE_TOKEN_BLOCK` tokens so the gathered copy stays bounded. An id equal to E (the
    foreign-pair sentinel of an expert-parallel shard, `local_expert_ids`) contributes exactly
    zero: its pair is computed with a held expert's weights and then dropped, not multiplied.

    Args:
        x: [..., H].
        weights: [..., k] (x's dtype); ids: [..., k] int expert ids in [0, E].
        gate_up: [E, 2I, H], gate rows first; down: [E, H, I].
    Returns:
        [..., H] in x's dtype.
    """
    h = x.shape[-1]
    flat = x.reshape(-1, 1, h, 1)
    n = flat.shape[0]
    idx, held = _held_pairs(ids.reshape(n, -1), gate_up.shape[0])
    w = weights.reshape(n, -1, 1)
    parts = []
    for start in range(0, n, MOE_TOKEN_BLOCK):
        sl = slice(start, min(start + MOE_TOKEN_BLOCK, n))
        i = idx[sl]
        gu = torch.matmul(gate_up[i], flat[sl].expand(-1, i.shape[1], -1, -1))[..., 0]   # N,k,2I
        gate, up = gu.chunk(2, dim=-1)
        act = (F.silu(gate) * up)[..., None]
        out = torch.matmul(down[i], act)[..., 0]                                        # N,k,H
        parts.append(torch.where(held[sl, :, None], out * w[sl], 0.0).sum(dim=1))
    if not parts:
        return torch.zeros_like(x)
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(x.shape)


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU of interleaved [..., 2I] gate/up (gate at even, up at odd
    columns): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_experts_swiglu(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                       gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                       limit: float) -> torch.Tensor:
    """GPT-OSS's routed experts: sum_k weights_k * (swiglu_clamped(x gate_up[e] + gate_up_bias[e])
    down[e] + down_bias[e]), e = ids_k, in the model dtype like transformers.

    Gathered per token in blocks of `MOE_TOKEN_BLOCK` tokens like `moe_experts` (shapes never
    depend on the routing). A TP shard holds a block of the intermediate channels (gate/up pairs)
    and, on its first rank only, the down bias (zeros elsewhere): the partial sums add up to it once.
    An expert-parallel shard holds whole experts with their biases; an id equal to E (the
    foreign-pair sentinel, `local_expert_ids`) contributes exactly zero, bias included.

    Args:
        x: [..., H]; weights: [..., k] (x's dtype); ids: [..., k] int expert ids in [0, E].
        gate_up: [E, H, 2I] gate/up columns interleaved; gate_up_bias: [E, 2I].
        down: [E, I, H]; down_bias: [E, H].
        alpha, limit: `swiglu_clamped`'s gain and clamp.
    Returns:
        [..., H] in x's dtype.
    """
    h = x.shape[-1]
    flat = x.reshape(-1, 1, 1, h)
    n = flat.shape[0]
    idx, held = _held_pairs(ids.reshape(n, -1), gate_up.shape[0])
    w = weights.reshape(n, -1, 1)
    parts = []
    for start in range(0, n, MOE_TOKEN_BLOCK):
        sl = slice(start, min(start + MOE_TOKEN_BLOCK, n))
        i = idx[sl]
        gu = torch.matmul(flat[sl].expand(-1, i.shape[1], -1, -1), gate_up[i])[:, :, 0] + gate_up_bias[i]  # N,k,2I
        act = swiglu_clamped(gu, alpha, limit)[:, :, None]                                             # N,k,1,I
        out = torch.matmul(act, down[i])[:, :, 0] + down_bias[i]                                       # N,k,H
        parts.append(torch.where(held[sl, :, None], out * w[sl], 0.0).sum(dim=1))
    if not parts:
        return torch.zeros_like(x)
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(x.shape)


# ---------------------------------------------------------------------------------------------- sampling

def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: [B, V] logits -> [B] int64 ids (the first index among equal maxima), or
    `NON_FINITE_TOKEN` for a row whose logits are not all finite."""
    best, ids = logits.max(dim=-1)  # first index of the maximum; NaN propagates to `best`
    return torch.where(all_finite(logits, best), ids, NON_FINITE_TOKEN)


def all_finite(logits: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """[B] bool: whether each row of [B, V] logits is all finite, given its maximum `best` (a NaN
    or +inf anywhere shows in the maximum, a -inf in the minimum): two vectorised reductions
    instead of a [B, V] mask (a 16-row decode round's sampler on one CPU thread: 1.9 to 0.3 ms)."""
    return torch.isfinite(best) & torch.isfinite(logits.amin(dim=-1))


# ---------------------------------------------------------------------------------------------- MLA (DeepSeek-V3)

def grouped_sigmoid_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: sigmoid scores in float32; experts are chosen by score + bias
    (`e_score_correction_bias`) among the `topk_group` best of `n_group` groups (a group's merit:
    the sum of its two best biased scores); the weights are the chosen experts' unbiased scores,
    renormalised to sum 1 (`renormalize`) and multiplied by `scaling` (routed_scaling_factor).

    Args:
        logits: [..., E] router logits; bias: [E].
    Returns:
        (weights [..., k] float32, ids [..., k] int64).
    """
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    experts = choice.shape[-1]
    if n_group > 1:
        grouped = choice.view(*choice.shape[:-1], n_group, experts // n_group)
        merit = grouped.topk(2, dim=-1)[0].sum(dim=-1)                                # [..., G]
        keep = torch.zeros_like(merit).scatter_(-1, merit.topk(topk_group, dim=-1)[1], 1.0)
        keep = keep.repeat_interleave(experts // n_group, dim=-1).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor, scale: float,
                         rank: int) -> torch.Tensor:
    """Absorbed multi-head latent attention of one query token per sequence over its latent cache.

    Every head attends the same cache rows: row = [latent (rank) | rope key (P)], the key of a
    position is the whole row and its value the latent part. q's latent part is q_nope folded
    through the key up-projection (q_nope @ W_UK), so q·row = q_nope·k_nope + q_pe·k_pe. Ring
    buffer, padding and masking as in `decode_attention` (one KV head, no window).

    Args:
        q: [B, H, rank + P]; kv_cache: [B, L, rank + P]; positions: [B] int.
        scale: softmax scale; rank: kv_lora_rank (the latent's width).
    Returns:
        [B, H, rank] in q's dtype: the attention-weighted latents (W_UV is applied after).
    """
    cache = kv_cache[:, :, None, :]
    out = _attend(q[:, None], positions[:, None], _cache_blocks(cache, cache, positions), scale, None)
    return out[:, 0, :, :rank]


def mla_chunk_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor,
                        scale: float, rank: int) -> torch.Tensor:
    """`mla_decode_attention` for a chunk of T tokens per sequence: q [B, T, H, rank + P], the
    chunk's rows kv [B, T, rank + P] (attended causally), the cache holding the positions before
    the chunk (written afterwards with `mla_cache_write`). Returns [B, T, H, rank]."""
    cache, new = kv_cache[:, :, None, :], kv[:, :, None, :]
    return chunk_attention(q, new, new, cache, cache, positions, scale, None)[..., :rank]


def mla_cache_write(kv_cache: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> None:
    """Writes a step's latent rows kv [B, T, rank + P] into the ring-buffer cache [B, L, rank + P]
    (position p at slot p % L; padding and overflow as in `cache_write`)."""
    cache, new = kv_cache[:, :, None, :], kv[:, :, None, :]
    cache_write(cache, cache, new, new, positions)  # the one cache as both "k" and "v": same rows twice


def moe_experts_fp8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_bits: torch.Tensor,
                    gate_up_scale: torch.Tensor, down_bits: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    """`moe_experts` over experts held as DeepSeek-V3's fp8 checkpoint stores them, dequantized on the
    fly to x's dtype (`stored.dequantize_fp8`): `gate_up_bits` uint8 [E, 2I, H] (each expert's
    `gate_proj.weight` bytes, then `up_proj.weight`'s), `gate_up_scale` float32 [E, 2 ceil(I/128),
    ceil(H/128)] (the gate's block scales, then the up's), `down_bits` uint8 [E, H, I],
    `down_scale` float32 [E, ceil(H/128), ceil(I/128)]."""
    i = gate_up_bits.shape[1] // 2
    rows = -(-i // FP8_BLOCK[0])
    gate_up = torch.cat((dequantize_fp8(gate_up_bits[:, :i], gate_up_scale[:, :rows], x.dtype),
                         dequantize_fp8(gate_up_bits[:, i:], gate_up_scale[:, rows:], x.dtype)), dim=1)
    return moe_experts(x, weights, ids, gate_up, dequantize_fp8(down_bits, down_scale, x.dtype))


def moe_experts_swiglu_mxfp4(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_blocks: torch.Tensor,
                             gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor, down_blocks: torch.Tensor,
                             down_scales: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                             limit: float) -> torch.Tensor:
    """`moe_experts_swiglu` over GPT-OSS's experts as its checkpoint stores them (MXFP4), dequantized
    on the fly to x's dtype (`stored.dequantize_mxfp4`): `gate_up_blocks` uint8 [E, 2I, H/32, 16] and
    `gate_up_scales` [E, 2I, H/32] (`gate_up_proj_blocks` / `_scales`), `down_blocks` uint8
    [E, H, I/32, 16] and `down_scales` [E, H, I/32]; biases dense."""
    return moe_experts_swiglu(x, weights, ids, dequantize_mxfp4(gate_up_blocks, gate_up_scales, x.dtype), gate_up_bias,
                              dequantize_mxfp4(down_blocks, down_scales, x.dtype), down_bias, alpha, limit)
