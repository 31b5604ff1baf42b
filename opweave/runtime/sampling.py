"""Sampling on the device: temperature and top-p with a per-request seed, over a vocabulary that
may be split across a TP group, with no host synchronisation (a decode round stays capturable).

Each row carries its request's sampling parameters as three int64s (`encode`, the row's
"sampling word"): the seed, the temperature and top_p in millionths. They travel with the
row's positions through every stage cut (`opweave.runtime.message`), so the last stage, wherever
it runs, samples each row with its own parameters.

The rule, for a row with temperature T > 0 and logits l over the whole vocabulary:
  - top_p < 1 keeps the nucleus: the most likely tokens whose probabilities (softmax of l / T)
    first sum to at least top_p, taken among the `NUCLEUS_CANDIDATES` most likely tokens (exact
    whenever the nucleus holds at most that many; beyond it the nucleus is those candidates);
  - the token is the Gumbel-max choice argmax_i(l_i / T + g_i) over the kept tokens, with
    g_i = -log(-log(u_i)) and u_i a hash of (seed, position, vocabulary id) (`uniform`), so one
    seed gives the same tokens at any TP degree, batch row or plan, and a rerun repeats them.
Temperature 0 is greedy: exactly `argmax` (`opweave.codegen.kernels.reference`), the path
`opweave run` takes. A row whose logits are not all finite gives NON_FINITE_TOKEN either way.

Under TP each rank perturbs and masks its own slice; the nucleus threshold needs each rank's
log-sum-exp and its top candidates (one all-gather), and the choice one (max, index) all-gather,
the same as the greedy sampler's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from opweave.codegen.kernels.reference import NON_FINITE_TOKEN

WORD = 3                   # int64s per row: seed, temperature and top_p in millionths
SCALE = 1_000_000          # temperature and top_p are carried as integers of 1e-6
NUCLEUS_CANDIDATES = 64    # top_p < 1 chooses among at most this many of the most likely tokens
CHUNK = 8192               # vocabulary ids the sampler walks at a time (bounds its workspace)
WORKSPACE_BYTES_PER_ID = 48  # peak workspace per row and id of a chunk (`workspace_bytes`; 38 measured)
GREEDY_BYTES_PER_ID = 8      # ... and per id of the whole slice (the greedy answer every row also gets)
_M32 = 0xFFFFFFFF


def encode(temperature: float, top_p: float, seed: int) -> tuple[int, int, int]:
    """A request's sampling word: (seed mod 2^63, temperature and top_p in millionths)."""
    return (int(seed) & (2 ** 63 - 1), int(round(temperature * SCALE)), int(round(top_p * SCALE)))


GREEDY = encode(0.0, 1.0, 0)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche (xor-shift-multiply) on int64 tensors holding values below 2^32; the
    multipliers are below 2^31 so no product leaves int64."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & _M32
    return h ^ (h >> 16)


def uniform(seed: torch.Tensor, position: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float32 [B, V]: a hash of (seed [B], position [B], vocabulary id [V]) that
    every device computes alike (integer arithmetic only)."""
    s_lo, s_hi = (seed & _M32)[:, None], ((seed >> 32) & _M32)[:, None]
    p = (position & _M32)[:, None]
    h = _mix(vocab_ids[None, :].to(torch.long) ^ 0x5BD1E995)
    h = _mix(h ^ p)
    h = _mix(h ^ s_lo)
    h = _mix(h ^ s_hi)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel(seed: torch.Tensor, position: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(seed, position, vocab_ids)))


def _chunks(n: int):
    """Column ranges of a vocabulary slice of n ids, `CHUNK` at a time (bounded workspace)."""
    return [(a, min(n, a + CHUNK)) for a in range(0, n, CHUNK)]


def _nucleus_threshold(logits: torch.Tensor, inv_temp: torch.Tensor, top_p: torch.Tensor,
                       gather: Callable) -> torch.Tensor:
    """The smallest scaled logit (l / T) top_p keeps, per row [B] (-inf keeps every token).

    `logits` is this rank's slice [B, Vr]; `gather(x)` stacks every TP rank's `x` along a new
    first dim (one all-gather of each rank's log-sum-exp and top candidates)."""
    lses, tops = [], []
    for a, b in _chunks(logits.shape[-1]):
        scaled = logits[:, a:b].float() * inv_temp[:, None]
        scaled = torch.where(torch.isfinite(scaled), scaled, -math.inf)
        lses.append(torch.logsumexp(scaled, dim=-1))
        tops.append(scaled.topk(min(NUCLEUS_CANDIDATES, b - a), dim=-1).values)
        del scaled
    lse = torch.logsumexp(torch.stack(lses, dim=-1), dim=-1, keepdim=True)         # [B, 1]
    top = torch.cat(tops, dim=-1)
    top = top.topk(min(NUCLEUS_CANDIDATES, top.shape[-1]), dim=-1).values          # [B, k]
    parts = gather(torch.cat([lse, top], dim=-1))                                 # [tp, B, 1 + k]
    total = torch.logsumexp(parts[:, :, 0], dim=0)                                # [B]
    cand = parts[:, :, 1:].permute(1, 0, 2).reshape(logits.shape[0], -1)          # [B, tp * k]
    cand = cand.topk(min(NUCLEUS_CANDIDATES, cand.shape[-1]), dim=-1).values     # descending
    probs = torch.exp(cand - total[:, None])
    before = torch.cumsum(probs, dim=-1) - probs        # mass of the more likely candidates
    keep = before < top_p[:, None]                      # the first candidate is always kept
    last = keep.sum(dim=-1, keepdim=True) - 1
    threshold = cand.gather(-1, last)[:, 0]
    return torch.where(top_p >= 1.0, torch.full_like(threshold, -math.inf), threshold)


def sample(logits: torch.Tensor, word: torch.Tensor, position: torch.Tensor, vocab_offset: int = 0,
           gather: Callable | None = None, greedy: Callable | None = None) -> torch.Tensor:
    """Token ids [B] for this rank's slice of the last position's logits [B, Vr] (vocabulary ids
    vocab_offset .. vocab_offset + Vr), each row by its sampling word [B, 3] at `position` [B]
    (its newest token's position). The vocabulary is walked `CHUNK` ids at a time, so the
    workspace is a few [B, CHUNK] tensors whatever the vocabulary (`workspace_bytes`).

    `gather(x)`: every TP rank's x stacked on a new first dim (None: one rank);
    `greedy(logits)`: the greedy sampler of the same group (ids [B]), whose answer temperature-0
    rows take (None: `argmax` on this rank alone)."""
    from opweave.codegen.kernels.reference import argmax

    gather = gather or (lambda x: x[None])
    greedy_ids = greedy(logits) if greedy is not None else argmax(logits)
    seed, temp, top_p = word[:, 0], word[:, 1].float() / SCALE, word[:, 2].float() / SCALE
    hot = temp > 0
    inv_temp = 1.0 / torch.where(hot, temp, torch.ones_like(temp))
    threshold = _nucleus_threshold(logits, inv_temp, top_p, gather)[:, None]
    best = torch.full_like(temp, -math.inf)
    idx = torch.zeros_like(seed)
    finite = torch.ones_like(hot)
    for a, b in _chunks(logits.shape[-1]):
        l = logits[:, a:b].float()
        finite = finite & torch.isfinite(l).all(dim=-1)
        scaled = l * inv_temp[:, None]
        del l
        ids = torch.arange(vocab_offset + a, vocab_offset + b, device=logits.device)
        score = torch.where(scaled >= threshold, scaled + gumbel(seed, position, ids), -math.inf)
        del scaled
        chunk_best, chunk_idx = score.max(dim=-1)
        del score
        better = chunk_best > best                      # the first maximum wins ties
        best = torch.where(better, chunk_best, best)
        idx = torch.where(better, chunk_idx + vocab_offset + a, idx)
    best = torch.where(finite, best, math.nan)
    pairs = gather(torch.stack([best.double(), idx.double()]))  # [tp, 2, B]
    winner = pairs[:, 0].argmax(dim=0)
    sampled = pairs[:, 1].gather(0, winner[None])[0].long()
    sampled = torch.where(pairs[:, 0].isnan().any(dim=0), NON_FINITE_TOKEN, sampled)
    return torch.where(hot, sampled, greedy_ids)


def workspace_bytes(rows: int, vocab_slice: int) -> int:
    """An upper bound of the sampler's peak workspace on one rank (beyond its logits input): a
    few [rows, CHUNK] tensors of the hash (int64) and of the scores (float32), and the greedy
    path's pass over the whole slice (a float32 copy and a finiteness mask); measured on meta
    against `sample` by tests/test_sampling.py."""
    return rows * (min(CHUNK, vocab_slice) * WORKSPACE_BYTES_PER_ID + vocab_slice * GREEDY_BYTES_PER_ID)
