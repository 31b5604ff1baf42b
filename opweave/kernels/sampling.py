"""Sampling on the device: temperature, top-k, top-p and min-p with a per-request seed, and a
ban on the end-of-sequence ids until a request's `min_tokens`, over a vocabulary that may be
split across a TP group, with no host synchronisation (a decode round stays capturable).

Each row carries its request's sampling parameters as `WORD` int64s (`encode`, the row's
"sampling word", fields in `FIELDS` order): the seed; the temperature, top_p and min_p in
millionths; top_k (0: off); `ban_until`, the position before which the model's EOS ids are
banned (0: no ban); `logprobs`, one more than the top log-probabilities the row reports (0: it
reports none, `opweave.kernels.logprobs`); and `target`, one more than the id whose
log-probability the row reports this round instead of the sampled token's (0: the sampled one's;
the scheduler sets it round by round while it feeds a prompt whose log-probabilities `echo` asks for). They travel with the row's positions through every stage cut
(`opweave.runtime.message`), so the last stage, wherever it runs, samples each row with its own
parameters.

The rule, for a row with temperature T > 0 and logits l over the whole vocabulary:
  - a banned id (an EOS id while the row's newest position < ban_until) is set to the lowest
    finite value of the logits' dtype before anything else (the row stays "finite");
  - the kept tokens are those whose scaled logit l / T reaches every threshold that is on:
    top_k's k-th largest; top_p's nucleus, the most likely tokens whose probabilities,
    renormalised over the top-k tokens, first sum to at least top_p; min_p's
    max(l / T) + log(min_p) (probability at least min_p times the most likely token's). All
    three are read from the `NUCLEUS_CANDIDATES` most likely tokens: top_k is at most that
    (`MAX_TOP_K`); top_p is exact whenever the nucleus holds at most that many, beyond it the
    nucleus is those candidates. The most likely token is always kept, so no parameter, however
    small (a top_p that rounds to 0 millionths included), leaves the nucleus empty;
  - the token is the Gumbel-max choice argmax_i(l_i / T + g_i) over the kept tokens, with
    g_i = -log(-log(u_i)) and u_i a hash of (seed, position, vocabulary id) (`uniform`), so one
    seed gives the same tokens at any TP degree, batch row or plan, and a rerun repeats them.
Temperature 0 is greedy: exactly `argmax` (`opweave.kernels.reference`) of the logits
after the ban, the path `opweave run` takes; top_k, top_p and min_p do not change it. A row
whose logits are not all finite gives NON_FINITE_TOKEN either way.

Under TP each rank perturbs and masks its own slice; the thresholds need each rank's
log-sum-exp and its top candidates (one all-gather), and the choice one (max, index) all-gather,
the same as the greedy sampler's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from opweave.kernels.reference import NON_FINITE_TOKEN

FIELDS = ("seed", "temperature", "top_p", "top_k", "min_p", "ban_until", "logprobs", "target")  # a word's int64s
WORD = len(FIELDS)
SCALE = 1_000_000          # temperature, top_p and min_p are carried as integers of 1e-6
NUCLEUS_CANDIDATES = 64    # top_k, top_p and min_p choose among at most this many of the most likely tokens
MAX_TOP_K = NUCLEUS_CANDIDATES
CHUNK = 8192               # vocabulary ids the sampler walks at a time (bounds its workspace)
WORKSPACE_BYTES_PER_ID = 48  # peak workspace per row and id of a chunk (`workspace_bytes`; 38 measured)
GREEDY_BYTES_PER_ID = 4      # ... and per id of the whole slice (the greedy answer every row also gets)
_M32 = 0xFFFFFFFF


def encode(temperature: float, top_p: float, seed: int, top_k: int = 0, min_p: float = 0.0,
           ban_until: int = 0, logprobs: int | None = None) -> tuple[int, ...]:
    """A request's sampling word (`FIELDS`): the seed mod 2^63, temperature, top_p and min_p in
    millionths, top_k (0 or at least the vocabulary: off), the position before which EOS ids are
    banned, the top log-probabilities reported (None: no log-probabilities), no target. A
    positive top_p keeps at least one millionth (the nucleus is never empty); a positive min_p
    keeps at least one millionth too (it never vanishes into "off")."""
    if not 0 <= temperature <= 2 ** 31 / SCALE or not 0 < top_p <= 1 or not 0 <= min_p <= 1:
        raise ValueError(f"sampling out of range: temperature {temperature!r}, top_p {top_p!r}, min_p {min_p!r}")
    if top_k < 0 or ban_until < 0 or (logprobs is not None and logprobs < 0):
        raise ValueError(f"sampling out of range: top_k {top_k!r}, ban_until {ban_until!r}, logprobs {logprobs!r}")
    millionths = lambda x: max(1, int(round(x * SCALE))) if x > 0 else 0  # noqa: E731
    return (int(seed) & (2 ** 63 - 1), int(round(temperature * SCALE)), millionths(top_p), int(top_k),
            millionths(min_p), int(ban_until), 0 if logprobs is None else int(logprobs) + 1, 0)


GREEDY = encode(0.0, 1.0, 0)


def bad_word(word: tuple[int, ...], max_logprobs: int | None = None) -> str | None:
    """Why a sampling word that reached a rank cannot be served (None: it can): a rank checks each
    request's word on arrival, so a malformed one fails that request alone. `max_logprobs`: the
    top log-probabilities the run's records hold (None: the run reports none)."""
    if len(word) != WORD or not all(isinstance(v, int) and 0 <= v < 2 ** 63 for v in word):
        return f"malformed sampling word {word!r}"
    values = dict(zip(FIELDS, word))
    if values["top_p"] < 1 or values["top_p"] > SCALE or values["min_p"] > SCALE:
        return f"sampling word out of range: {values}"
    if values["logprobs"] and (max_logprobs is None or values["logprobs"] - 1 > max_logprobs):
        return (f"{values['logprobs'] - 1} top log-probabilities asked; this run reports "
                f"{'none' if max_logprobs is None else f'at most {max_logprobs}'}")
    return None


def top_logprobs(word: tuple[int, ...]) -> int | None:
    """The top log-probabilities a word asks for (None: no log-probabilities)."""
    n = word[FIELDS.index("logprobs")]
    return n - 1 if n else None


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


def _threshold(logits: torch.Tensor, inv_temp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
               log_min_p: torch.Tensor, gather: Callable) -> torch.Tensor:
    """The smallest scaled logit (l / T) that top_k, top_p and min_p all keep, per row [B]
    (-inf keeps every token).

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
    n = cand.shape[-1]
    rank = torch.arange(n, device=cand.device)[None, :]
    k = torch.where((top_k > 0) & (top_k < n), top_k, torch.full_like(top_k, n))  # [B], 1..n
    in_k = rank < k[:, None]
    # top_p's probabilities are renormalised over the top-k tokens (the whole vocabulary when off).
    kept_total = torch.where(k < n, torch.logsumexp(torch.where(in_k, cand, -math.inf), dim=-1), total)
    probs = torch.where(in_k, torch.exp(cand - kept_total[:, None]), 0.0)
    before = torch.cumsum(probs, dim=-1) - probs        # mass of the more likely candidates
    keep = ((before < top_p[:, None]) & in_k) | (rank == 0)  # the most likely token, whatever the rounding
    last = (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    threshold = cand.gather(-1, last)[:, 0]
    threshold = torch.where((top_p >= 1.0) & (k >= n), torch.full_like(threshold, -math.inf), threshold)
    threshold = torch.maximum(threshold, torch.minimum(cand[:, 0] + log_min_p, cand[:, 0]))
    return torch.nan_to_num(threshold, nan=-math.inf)


def ban(logits: torch.Tensor, word: torch.Tensor, position: torch.Tensor, columns: torch.Tensor | None) -> None:
    """Bans, in place, `columns` (this rank's columns of the EOS ids, a device tensor) of the rows
    [B, Vr] whose newest `position` is before their word's ban_until: they get the lowest finite
    value of the dtype (a NaN or an infinity stays), so the greedy and the sampled choice avoid them
    and a finite row stays finite."""
    if columns is None or columns.numel() == 0:
        return
    banned = (position < word[:, FIELDS.index("ban_until")])[:, None]
    low = torch.finfo(logits.dtype).min
    cols = logits[:, columns]
    # A non-finite value stays: the row is still reported as not finite (NON_FINITE_TOKEN).
    logits[:, columns] = torch.where(banned & torch.isfinite(cols), torch.full_like(cols, low), cols)


def sample(logits: torch.Tensor, word: torch.Tensor, position: torch.Tensor, vocab_offset: int = 0,
           gather: Callable | None = None, greedy: Callable | None = None,
           banned: torch.Tensor | None = None, walk: bool = True) -> torch.Tensor:
    """Token ids [B] for this rank's slice of the last position's logits [B, Vr] (vocabulary ids
    vocab_offset .. vocab_offset + Vr), each row by its sampling word [B, WORD] at `position` [B]
    (its newest token's position). The vocabulary is walked `CHUNK` ids at a time, so the
    workspace is a few [B, CHUNK] tensors whatever the vocabulary (`workspace_bytes`).

    `gather(x)`: every TP rank's x stacked on a new first dim (None: one rank);
    `greedy(logits)`: the greedy sampler of the same group (ids [B]), whose answer temperature-0
    rows take (None: `argmax` on this rank alone); `banned`: this rank's columns of the ids
    `ban` masks (written into `logits` in place, before `greedy` sees them); `walk` False: the
    caller knows every row's temperature is 0 (the host knows each row's word), so the greedy ids
    are the answer and the vocabulary walk is skipped."""
    from opweave.kernels.reference import argmax

    ban(logits, word, position, banned)
    gather = gather or (lambda x: x[None])
    greedy_ids = greedy(logits) if greedy is not None else argmax(logits)
    if not walk:
        return greedy_ids
    seed = word[:, 0]
    temp, top_p, min_p = (word[:, FIELDS.index(f)].float() / SCALE for f in ("temperature", "top_p", "min_p"))
    hot = temp > 0
    inv_temp = 1.0 / torch.where(hot, temp, torch.ones_like(temp))
    log_min_p = torch.where(min_p > 0, torch.log(min_p.clamp(min=1.0 / SCALE)), -math.inf)
    threshold = _threshold(logits, inv_temp, top_p, word[:, FIELDS.index("top_k")], log_min_p, gather)[:, None]
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


def ban_columns(eos_ids, vocab_offset: int, vocab_slice: int, device) -> torch.Tensor:
    """This rank's columns (a device tensor) of the EOS ids in its vocabulary slice."""
    cols = sorted({int(e) - vocab_offset for e in eos_ids if vocab_offset <= int(e) < vocab_offset + vocab_slice})
    return torch.tensor(cols, dtype=torch.long, device=device)


def workspace_bytes(rows: int, vocab_slice: int) -> int:
    """An upper bound of the sampler's peak workspace on one rank (beyond its logits input): a
    few [rows, CHUNK] tensors of the hash (int64) and of the scores (float32), and the greedy
    path's pass over the whole slice (a float32 copy; its finiteness is two reductions); measured on meta
    against `sample` by tests/test_sampling.py."""
    return rows * (min(CHUNK, vocab_slice) * WORKSPACE_BYTES_PER_ID + vocab_slice * GREEDY_BYTES_PER_ID)
