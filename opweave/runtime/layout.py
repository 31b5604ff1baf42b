"""A round's packed tokens: which rows of a microbatch feed how many tokens, and where they lie.

A round carries, per microbatch, one flat batch of tokens (`[1, T]` ids and positions, values
`[1, T, ...]`): no padding. Rows feed tokens in row order: a decoding row one (the token sampled
for it last round), a prefilling row a chunk of its prompt, an idle row none. So the per-row
counts (`counts[r]`, planned by the scheduler and agreed by every rank before the round) say
everything about the batch: its size, each row's tokens (`offsets`), each row's last token (the
one its logits are sampled from), and the bytes every message of the round carries.

Most operators work per token and never look at rows. Those that keep per-sequence state (the
ATTN class: KV caches, Gated-DeltaNet's recurrent state) and the LM head do, through `Packed`:
  - a stateful op is called once per `Segment` of the layout: a run of consecutive decoding rows
    (`[n, 1]` inputs, the rows' state as views, exactly the one-token path of the op) or one
    prefilling row (`[1, c]` inputs, its own state row, the op's chunk path); the outputs are
    joined back in token order. The math per row is what the op computes for that row alone.
  - the LM head takes each row's last token only (`last`): `[rows, 1, H]`, so a prompt chunk's
    other tokens never reach the vocabulary projection, and the sampler sees one row per row of
    the replica, as it always did (idle rows give a token nobody reads; on the CPU their logits
    are zeros, not computed: the projection takes the live rows alone).

A microbatch with no token in a round, in any row of any replica, is not run at all: no op, no
message. When it runs, every replica runs it; a replica none of whose rows has a token this round
computes one padding token instead (`pad`: position -1, which writes no state), so no operator
ever sees an empty batch. Messages carry real tokens only.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from opweave.kernels.paged import PagedKV


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """Rows [row, row + rows) feeding tokens [token, token + tokens) of the packed batch: a run of
    decoding rows (one token each) or a single row feeding a chunk (`chunk`)."""

    row: int
    rows: int
    token: int
    tokens: int

    @property
    def chunk(self) -> bool:
        return self.tokens > self.rows


@dataclasses.dataclass(frozen=True)
class Layout:
    """The packed tokens of one replica's rows of one microbatch in one round."""

    counts: tuple[int, ...]  # tokens per row of the replica (0: idle)
    pad: bool = False        # no row has a token: the batch is one padding token (position -1)
    sampled: bool = False    # some row draws its token at a positive temperature (else all are greedy)
    logprobs: bool = False   # some row reports log-probabilities (`opweave.kernels.logprobs`)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Row r's tokens are [offsets[r], offsets[r + 1])."""
        out = [0]
        for c in self.counts:
            out.append(out[-1] + c)
        return tuple(out)

    @property
    def real(self) -> int:
        """The rows' tokens (what messages carry)."""
        return self.offsets[-1]

    @property
    def tokens(self) -> int:
        """The packed batch's size: the rows' tokens, or the one padding token."""
        return 1 if self.pad else self.offsets[-1]

    @property
    def decode_only(self) -> bool:
        """Every row decodes or idles (one token or none): a decode round's microbatch."""
        return all(c <= 1 for c in self.counts)

    def tokens_of(self, lo: int, hi: int) -> tuple[int, int]:
        """Token range [a, b) of rows [lo, hi) (replica-local rows)."""
        return self.offsets[lo], self.offsets[hi]

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        if self.pad:
            return (Segment(0, 1, 0, 1),)
        out: list[Segment] = []
        start = None  # first row of the current decode run
        for r, c in enumerate(self.counts + (0,)):
            if c == 1:
                if start is None:
                    start = r
                continue
            if start is not None:
                out.append(Segment(start, r - start, self.offsets[start], r - start))
                start = None
            if c > 1:
                out.append(Segment(r, 1, self.offsets[r], c))
        return tuple(out)

    @functools.cached_property
    def last_rows(self) -> tuple[int, ...]:
        """Per row, the index of its last token (an idle row: token 0, read by nobody)."""
        return tuple(self.offsets[r + 1] - 1 if c else 0 for r, c in enumerate(self.counts))

    def last(self, device: torch.device) -> torch.Tensor:
        """`last_rows` as an index tensor on `device` (made once per layout and device)."""
        return _index(self.last_rows, device)

    @functools.cached_property
    def live(self) -> tuple[int, ...]:
        """The rows with a token this round."""
        return tuple(r for r, c in enumerate(self.counts) if c)

    def live_last(self, device: torch.device) -> torch.Tensor:
        """The live rows' last tokens (`last_rows` of `live`) as an index tensor on `device`."""
        return _index(tuple(self.last_rows[r] for r in self.live), device)

    def live_rows(self, device: torch.device) -> torch.Tensor:
        """`live` as an index tensor on `device`."""
        return _index(self.live, device)

    def prepare(self, device: torch.device) -> None:
        """Makes, between rounds, every index tensor the round reads (`last`, `live_last`,
        `live_rows`): made inside a round, a new layout's indices would be a copy from host data
        in a decode round (a synchronising copy on a GPU; `NoHostSync` refuses it)."""
        self.last(device)
        if self.live:
            self.live_last(device)
            self.live_rows(device)



@functools.lru_cache(maxsize=4096)
def _index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _per_token(x, total: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == total


def _take(x, seg: Segment, total: int):
    """Segment `seg`'s part of argument `x` (a per-token tensor; anything else as it is)."""
    if not _per_token(x, total):
        return x
    part = x[:, seg.token:seg.token + seg.tokens]
    return part if seg.chunk else part.reshape(seg.rows, 1, *x.shape[2:])


def _flat(out, seg: Segment):
    """An op's output for a segment, back to the packed form [1, tokens, ...]."""
    if isinstance(out, tuple):
        return tuple(_flat(o, seg) for o in out)
    return out if seg.chunk else out.reshape(1, seg.tokens, *out.shape[2:])


def _join(parts: list):
    if isinstance(parts[0], tuple):
        return tuple(_join([p[i] for p in parts]) for i in range(len(parts[0])))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def packed_call(op, layout: Layout, args: tuple, state):
    """Stateful operator `op` over a packed batch: one call per segment, each with its rows'
    state (views of the microbatch's state `state`: a tuple of per-row tensors, or its pages), the
    outputs joined in token order."""
    total = layout.tokens
    parts = []
    for seg in layout.segments:
        views = (state.rows(seg.row, seg.row + seg.rows) if isinstance(state, PagedKV)
                 else tuple(t[seg.row:seg.row + seg.rows] for t in state))
        parts.append(_flat(op(*(_take(a, seg, total) for a in args), state=views), seg))
    return _join(parts)


class Packed:
    """An operator as the generated code calls it in a packed round: a stateful op runs per
    segment (`packed_call`); the LM head (`last=True`) projects each row's last token only.
    `layout()` is the current microbatch's layout (the runtime's). Other attributes read through."""

    __slots__ = ("op", "_layout", "_last")

    def __init__(self, op, layout, last: bool = False):
        self.op, self._layout, self._last = op, layout, last

    def __call__(self, *args, state=None):
        layout = self._layout()
        if self._last:
            x = args[0]
            live = layout.live
            if x.device.type == "cpu" and 0 < len(live) < len(layout.counts):
                # a CPU GEMM costs what its rows do: the live rows' logits only, the idle rows'
                # zeros (a token nobody reads). A CUDA decode graph keeps every row's shape.
                logits = self.op(x[0].index_select(0, layout.live_last(x.device))[:, None], *args[1:])
                out = logits.new_zeros((len(layout.counts), *logits.shape[1:]))
                return out.index_copy_(0, layout.live_rows(x.device), logits)
            rows = x[0].index_select(0, layout.last(x.device))
            return self.op(rows[:, None], *args[1:])
        if state is None:
            return self.op(*args)
        return packed_call(self.op, layout, args, state)

    def __getattr__(self, name):
        return getattr(self.op, name)
