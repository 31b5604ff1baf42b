"""Log-probabilities on the device: each row's token with its log-probability and the `top` most
likely tokens with theirs, over a vocabulary that may be split across a TP group, with no host
synchronisation (a decode round stays capturable).

The log-probabilities are the model's: `log_softmax` of the logits as the LM head gives them,
before the EOS ban, the temperature and the top-k/top-p/min-p cut (vLLM's default "raw"
log-probabilities), so a greedy request's figures equal `log_softmax` of transformers' logits.

A row's answer travels back to the scheduler as a *record*: `record_width(top)` int64s,
  - [0]: the token id sampled (what the token path always carried; NON_FINITE_TOKEN included);
  - [1]: the log-probability of the reported token: the sampled one, or the row's `target` when
    it has one (a prompt token whose log-probability `echo` asks for), float64 bits;
  - [2, 2 + top): the ids of the `top` most likely tokens, most likely first;
  - [2 + top, 2 + 2 top): their log-probabilities, float64 bits.
A record of width 1 is the bare token id (a run that serves no log-probabilities). A round no row
of which asks for log-probabilities computes none: its records hold the ids and zeros.

Under TP each rank reduces its own slice (its log-sum-exp, the reported token's logit when the
token is in its slice, its `top` best), and one all-gather merges them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

CHUNK = 8192  # vocabulary ids reduced at a time (bounds the workspace)
MAX_TOP_LOGPROBS = 20  # the most top log-probabilities a request may ask for (OpenAI's limit)


def record_width(top: int | None) -> int:
    """int64s per row of a record with `top` top log-probabilities (None: ids alone)."""
    return 1 if top is None else 2 + 2 * top


def bare(ids: torch.Tensor, width: int) -> torch.Tensor:
    """Records [B, width] holding `ids` and no log-probabilities (zeros)."""
    if width == 1:
        return ids.view(-1, 1)
    out = torch.zeros((ids.shape[0], width), dtype=torch.long, device=ids.device)
    out[:, 0] = ids
    return out


def partials(logits: torch.Tensor, target: torch.Tensor, top: int, vocab_offset: int = 0) -> torch.Tensor:
    """This rank's share of the rows' log-probabilities, float64 [B, 2 + 2 top]: its slice's
    log-sum-exp, the logit of `target` [B] (a global id; -inf when not in the slice), its `top`
    largest logits and their global ids. `logits` [B, Vr] is this rank's slice (as the LM head
    gave it: call before anything masks it in place)."""
    rows, width = logits.shape
    lses, vals, idxs = [], [], []
    for a in range(0, width, CHUNK):
        chunk = logits[:, a:a + CHUNK].float()
        lses.append(torch.logsumexp(chunk, dim=-1))
        if top:
            v, i = chunk.topk(min(top, chunk.shape[-1]), dim=-1)
            vals.append(v)
            idxs.append(i + a)
        del chunk
    lse = torch.logsumexp(torch.stack(lses, dim=-1), dim=-1)
    local = target - vocab_offset
    mine = (local >= 0) & (local < width)
    picked = logits.gather(1, local.clamp(0, width - 1)[:, None])[:, 0].float()
    picked = torch.where(mine, picked, -math.inf)
    parts = [lse[:, None], picked[:, None]]
    if top:
        v, i = torch.cat(vals, dim=-1), torch.cat(idxs, dim=-1)
        v, j = v.topk(min(top, v.shape[-1]), dim=-1)
        i = i.gather(1, j) + vocab_offset
        if v.shape[-1] < top:  # a slice narrower than `top`: pad with impossible entries
            pad = top - v.shape[-1]
            v = torch.cat([v, v.new_full((rows, pad), -math.inf)], dim=-1)
            i = torch.cat([i, i.new_zeros((rows, pad))], dim=-1)
        parts += [v, i.float()]
    return torch.cat([p.double() for p in parts], dim=-1)


def merge(gathered: torch.Tensor, ids: torch.Tensor, top: int) -> torch.Tensor:
    """Records [B, record_width(top)] from every rank's `partials` stacked [tp, B, 2 + 2 top] and
    the sampled `ids` [B]."""
    total = torch.logsumexp(gathered[:, :, 0], dim=0)          # [B]
    picked = gathered[:, :, 1].max(dim=0).values - total       # one rank holds the id
    out = torch.empty((ids.shape[0], record_width(top)), dtype=torch.float64, device=ids.device)
    out[:, 1] = picked
    if top:
        vals = gathered[:, :, 2:2 + top].permute(1, 0, 2).reshape(ids.shape[0], -1)
        idx = gathered[:, :, 2 + top:].permute(1, 0, 2).reshape(ids.shape[0], -1)
        best, j = vals.topk(top, dim=-1)
        out[:, 2:2 + top] = idx.gather(1, j)
        out[:, 2 + top:] = best - total[:, None]
    record = out.view(torch.long)
    if top:
        record[:, 2:2 + top] = out[:, 2:2 + top].long()  # ids as integers (exact in float64)
    record[:, 0] = ids
    return record


def records(logits: torch.Tensor, sample: Callable[[], torch.Tensor], target: torch.Tensor, top: int,
            vocab_offset: int = 0, gather: Callable | None = None) -> torch.Tensor:
    """The rows' records [B, record_width(top)]: `sample()` draws the ids [B] (it may mask
    `logits` in place: the figures are taken before it); a row's `target` >= 0 is the id whose
    log-probability it reports instead of the sampled one's. `gather(x)` stacks every TP rank's
    x on a new first dim (None: one rank)."""
    target = target.long()
    before = partials(logits, target, top, vocab_offset)
    ids = sample()
    own = target < 0  # the sampled id: its logit (a banned id is never sampled from a banned row)
    local = (ids - vocab_offset).clamp(0, logits.shape[-1] - 1)
    chosen = logits.gather(1, local[:, None])[:, 0].float()
    in_slice = (ids >= vocab_offset) & (ids < vocab_offset + logits.shape[-1])
    before[:, 1] = torch.where(own, torch.where(in_slice, chosen, -math.inf).double(), before[:, 1])
    gathered = (gather or (lambda x: x[None]))(before)
    return merge(gathered, ids, top)


def decode(record: list[int], top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A record read on the host (a list of its int64s): (the reported token's log-probability,
    the top (id, log-probability) pairs, most likely first)."""
    import struct

    floats = lambda vs: struct.unpack(f"<{len(vs)}d", struct.pack(f"<{len(vs)}q", *vs))  # noqa: E731
    logprob = floats(record[1:2])[0]
    top_lps = floats(record[2 + top:2 + 2 * top])
    return logprob, tuple((int(i), lp) for i, lp in zip(record[2:2 + top], top_lps) if lp != -math.inf)
