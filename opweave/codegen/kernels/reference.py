"""Torch reference kernels: the CPU path of the runtime and the oracle for the Triton kernels.

Each function computes exactly what the matching operator module in `opweave.models.ops` /
`opweave.models.ops_linear` computes for one decode token (same operations in the same dtypes, so
the results are bitwise equal to the modules'); the Triton backend (`triton_kernels`) has the same
names and signatures. Shapes and conventions are documented in `docs/kernels.md`.
"""

from __future__ import annotations

import torch

from opweave.models.ops import NON_FINITE_TOKEN, _rotate_half, activation
from opweave.models.ops import rms_norm as _ops_rms_norm
from opweave.models.ops_linear import _l2_normalize


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
    return _ops_rms_norm(x, weight, eps, offset)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half convention) of the first `rot_dim` dims of each head.

    Args:
        q: [..., Hq, D]; k: [..., Hkv, D] with the same leading dims.
        positions: [...] int, the token positions (negative values, padding, act as 0).
        inv_freq: [rot_dim // 2] float32 inverse frequencies (`ops.rope_inv_freq`).
        rot_dim: rotated dims per head (D for full rotary, fewer for partial rotary).
    Returns:
        (q, k) rotated, in their dtypes.
    """
    freqs = positions.clamp(min=0)[..., None].float() * inv_freq.float()   # [..., rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]                  # broadcast over heads
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)

    def apply(x):
        rot, keep = x[..., :rot_dim], x[..., rot_dim:]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, keep), dim=-1)

    return apply(q), apply(k)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float, window: int | None) -> torch.Tensor:
    """Softmax attention of one query token per sequence over its KV cache (GQA).

    Sequence b attends cache slots j <= positions[b] and, with a sliding `window`, j > pos - window;
    a sequence with a negative position (padding) gets zeros. The cache must already hold this
    token's k and v at slot positions[b].

    Args:
        q: [B, Hq, D].
        k_cache, v_cache: [B, L, Hkv, D] with Hq a multiple of Hkv (query head h reads kv head h // (Hq/Hkv)).
        positions: [B] int.
        scale: softmax scale of q·k.
        window: sliding-window size, or None (or 0) for full attention.
    Returns:
        [B, Hq, D] in q's dtype.
    """
    b, hq, d = q.shape
    length, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    qh = q.view(b, hkv, group, 1, d)                                       # B,Hkv,G,1,D
    kh = k_cache.permute(0, 2, 1, 3)[:, :, None]                           # B,Hkv,1,L,D
    vh = v_cache.permute(0, 2, 1, 3)[:, :, None]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale                # B,Hkv,G,1,L
    j = torch.arange(length, device=q.device)
    pos = positions[:, None, None, None, None]
    allowed = j <= pos
    if window:
        allowed = allowed & (j > pos - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.matmul(probs, vh).reshape(b, hq, d)


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
        state: [B, Hv, Dk, Dv] float32 (not modified).
        positions: optional [B] int.
    Returns:
        (o [B, Hv, Dv] in v's dtype, new_state [B, Hv, Dk, Dv] float32).
    """
    hk, dk = q.shape[1], q.shape[2]
    r = v.shape[1] // hk
    qf = _l2_normalize(q.float()).repeat_interleave(r, dim=1) * dk ** -0.5
    kf = _l2_normalize(k.float()).repeat_interleave(r, dim=1)                # [B, Hv, Dk]
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


def gated_act(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """act(gate) * up with act = silu (`kind` "silu") or tanh-approximated gelu (any other kind,
    e.g. "gelu_pytorch_tanh"), like `ops.activation`. Shapes [..., I]; result in gate's dtype."""
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


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """Routed experts: sum_k weights_k * down[ids_k] (silu(gate) * up), [gate | up] = gate_up[ids_k] x.

    Args:
        x: [..., H].
        weights: [..., k] (x's dtype); ids: [..., k] int expert ids.
        gate_up: [E, 2I, H], gate rows first; down: [E, H, I].
    Returns:
        [..., H] in x's dtype.
    """
    h = x.shape[-1]
    flat = x.reshape(-1, 1, h, 1)
    idx = ids.reshape(flat.shape[0], -1)
    gu = torch.matmul(gate_up[idx], flat.expand(-1, idx.shape[1], -1, -1))[..., 0]   # N,k,2I
    gate, up = gu.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up)[..., None]
    out = torch.matmul(down[idx], act)[..., 0]                                      # N,k,H
    out = (out * weights.reshape(flat.shape[0], -1, 1)).sum(dim=1)
    return out.reshape(x.shape)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: [B, V] logits -> [B] int64 ids (the first index among equal maxima), or
    `NON_FINITE_TOKEN` for a row whose logits are not all finite (like `ops.Sample`)."""
    ids = torch.argmax(logits, dim=-1)
    return torch.where(torch.isfinite(logits).all(dim=-1), ids, NON_FINITE_TOKEN)
