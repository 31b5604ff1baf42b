"""The KV pages of a rank's sequence slots: which pages each slot holds, kept alike on every rank.

Full-attention layers keep their keys and values in pages of `PAGE_TOKENS` positions
(`opweave.kernels.paged`); every full-attention layer of a rank uses the same page ids, so one
`PagePool` per rank says, for each slot (a row of a microbatch: slot `mb * rows + row`), which
pages hold its sequence (`tables`) and how many positions it has written (`lengths`). The pool
holds `slots x ceil(context / PAGE_TOKENS)` pages, what the planner counts: a sequence may grow to
the full context whatever the others do.

No rank sends another a page id. The pool changes only through `apply_rows` (each row's event, then each row's tokens), in
the order of the rounds and, within a round, of microbatches and rows; every rank that holds a
slot applies the same agreed values (the round's tokens per row and a page event per row, both in
the control word, `opweave.runtime.transport`), so every pool over the same slots, and the
scheduler's own copy of its replica's pool (`opweave.runtime.prefix`), holds the same pages:
  - a slot grows page by page as its tokens arrive (`tokens`), taking the lowest free page;
  - `RELEASE` (the slot's request ended) drops its pages: a page no slot holds goes back to the
    free pages, or, when the slot had filled it, to the *cached* pages, least recently used
    first, its keys kept (a later prompt with the same tokens may take it again); when no page is
    free the least recently used cached page is reused (`on_evict` is told);
  - `START` (a new request takes the slot) releases the old pages and starts empty; `SHARED + p`
    starts on the chain of full pages ending at page p (each page remembers the page before it in
    the sequence that filled it), holding them with the other slots that do: a prompt's cached
    prefix. Shared pages are full, and a slot writes only past its prefix, so nothing writes a
    shared page.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from opweave.errors import OpWeaveError

from opweave.ir.plan import PAGE_TOKENS  # positions per page (vLLM's default block size)

NONE, RELEASE, START, SHARED = 0, 1, 2, 3
"""A row's page event in a round: nothing; drop its pages; a new request starts on fresh pages;
`SHARED + p`: a new request starts on the cached chain ending at page p."""

_TOKEN_BITS = 24
# a control-word value: tokens | padding << 24 | sampled << 25 | logprobs << 26 | imported << 27 | event << 28
_IMPORTED = _TOKEN_BITS + 3
_EVENT_SHIFT = _TOKEN_BITS + 4


def encode(tokens: int, event: int, padding: bool = False, sampled: bool = False, logprobs: bool = False,
           imported: bool = False) -> int:
    """One row's control-word value: its tokens this round, whether they are padding tokens of an
    idle row (computed, position -1: they take no page), whether the row's token this round is
    drawn at a positive temperature (`sampled`: the sampler walks the vocabulary for it; greedy
    rows only take the argmax), whether the row reports log-probabilities this round
    (`logprobs`: the last stage computes them, `opweave.kernels.logprobs`), whether `tokens` are
    positions whose state arrives from a prefill rank instead of being computed (`imported`:
    prefill/decode disaggregation, `opweave.runtime.kvtransfer`), and its page event."""
    if not 0 <= tokens < 1 << _TOKEN_BITS:
        raise ValueError(f"{tokens} tokens in one row's round")
    return (tokens | int(padding) << _TOKEN_BITS | int(sampled) << (_TOKEN_BITS + 1)
            | int(logprobs) << (_TOKEN_BITS + 2) | int(imported) << _IMPORTED | event << _EVENT_SHIFT)


def decode(value: int) -> tuple[int, int]:
    """(tokens, page event) of a control-word value (tokens: what the round computes for the row;
    none for an imported row)."""
    return 0 if value >> _IMPORTED & 1 else value & ((1 << _TOKEN_BITS) - 1), value >> _EVENT_SHIFT


def held_tokens(value: int) -> int:
    """The positions a control-word value adds to its slot's sequence (0 for padding tokens; an
    imported row's positions)."""
    return 0 if value >> _TOKEN_BITS & 1 else value & ((1 << _TOKEN_BITS) - 1)


def imported(value: int) -> int:
    """The positions of a row whose state this round arrives from a prefill rank (0: none)."""
    return value & ((1 << _TOKEN_BITS) - 1) if value >> _IMPORTED & 1 else 0


def sampled(value: int) -> bool:
    """Whether a control-word value's row draws its token at a positive temperature this round."""
    return bool(value >> (_TOKEN_BITS + 1) & 1)


def logprobs(value: int) -> bool:
    """Whether a control-word value's row reports log-probabilities this round."""
    return bool(value >> (_TOKEN_BITS + 2) & 1)


def pages_for(tokens: int, page_tokens: int = PAGE_TOKENS) -> int:
    return -(-tokens // page_tokens)


class PagePool:
    """The pages of `slots` sequence slots of up to `width` pages each (`pages` in all)."""

    def __init__(self, pages: int, slots: int, width: int, page_tokens: int = PAGE_TOKENS):
        self.pages, self.width, self.page_tokens = pages, width, page_tokens
        self.free: deque[int] = deque(range(pages))
        self.cached: OrderedDict[int, None] = OrderedDict()  # held by no slot, keys kept; LRU first
        self.refs = [0] * pages
        self.parent = [-1] * pages   # the page before it in the sequence that filled it
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self.lengths = [0] * slots   # positions written per slot (after the rounds applied)
        self.changed: set[int] = set()  # slots whose table changed since `take_changed`
        self.on_evict = None         # called with a cached page about to be reused

    @classmethod
    def for_context(cls, slots: int, context: int, page_tokens: int = PAGE_TOKENS,
                    pages: int | None = None) -> "PagePool":
        """A pool for `slots` sequences of up to `context` positions: `pages` pages (default: every
        slot at the full context, `slots * width`)."""
        width = pages_for(context, page_tokens)
        if pages is not None and not 1 <= pages <= slots * width:
            raise OpWeaveError(f"a KV pool of {pages} pages: it must hold 1 to {slots * width} "
                               f"({slots} slots of {width} pages)")
        return cls(slots * width if pages is None else pages, slots, width, page_tokens)

    @property
    def null(self) -> int:
        """The null page's id (the pools' last page: padding writes there, no slot holds it)."""
        return self.pages

    @property
    def available(self) -> int:
        """Pages a slot can take now (free or cached)."""
        return len(self.free) + len(self.cached)

    def apply(self, slot: int, tokens: int, event: int) -> None:
        """One row's agreed round: its page event, then its tokens' positions."""
        if event >= RELEASE:
            self.release(slot)
        if event >= SHARED:
            self._share(slot, event - SHARED)
        if tokens:
            self._grow(slot, self.lengths[slot] + tokens)

    def apply_rows(self, rows: list[tuple[int, int, int]]) -> None:
        """One microbatch's agreed round, (slot, tokens, event) per row: every row's page event first
        (a prefix found for one row is held before another row's tokens could take its cached
        pages), then every row's tokens, in row order."""
        for slot, _, event in rows:
            self.apply(slot, 0, event)
        for slot, tokens, _ in rows:
            if tokens:
                self._grow(slot, self.lengths[slot] + tokens)

    def release(self, slot: int) -> None:
        table, full = self.tables[slot], self.lengths[slot] // self.page_tokens
        for i in reversed(range(len(table))):  # the tail first: a prompt's first pages stay cached longest
            page = table[i]
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if i < full:
                    self.cached[page] = None
                else:
                    self.free.append(page)
        if table:
            self.changed.add(slot)
        self.tables[slot], self.lengths[slot] = [], 0

    def chain(self, last: int) -> list[int]:
        """The pages of the sequence that filled page `last`, up to it."""
        out = [last]
        while self.parent[out[-1]] >= 0:
            out.append(self.parent[out[-1]])
            if len(out) > self.width:
                raise RuntimeError(f"page {last}: a chain longer than {self.width} pages")
        return out[::-1]

    def _share(self, slot: int, last: int) -> None:
        pages = self.chain(last)
        for page in pages:
            self.refs[page] += 1
            self.cached.pop(page, None)
        self.tables[slot], self.lengths[slot] = pages, len(pages) * self.page_tokens
        self.changed.add(slot)

    def _grow(self, slot: int, length: int) -> None:
        table = self.tables[slot]
        if length > self.width * self.page_tokens:
            raise RuntimeError(f"slot {slot}: {length} positions exceed its {self.width} pages")
        while len(table) * self.page_tokens < length:
            page = self._take()
            self.parent[page] = table[-1] if table else -1
            self.refs[page] = 1
            table.append(page)
            self.changed.add(slot)
        self.lengths[slot] = length

    def _take(self) -> int:
        if self.free:
            return self.free.popleft()
        if self.cached:
            page, _ = self.cached.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(page)
            return page
        raise OpWeaveError(f"the KV cache's {self.pages} pages are all held")

    def take_changed(self) -> list[tuple[int, list[int]]]:
        """(slot, its table padded with the null page to `width`) for each slot changed since the
        last call, in slot order."""
        out = [(s, self.tables[s] + [self.null] * (self.width - len(self.tables[s]))) for s in sorted(self.changed)]
        self.changed.clear()
        return out
