"""Prefix reuse: full KV pages of a prompt, found again by the tokens that filled them.

A scheduler keeps its own copy of its replica's `PagePool` (every rank holding those slots keeps
the same pages, `opweave.runtime.pages`) and, here, a key for each full page of a prompt: a hash
chain, `key(i) = hash((key(i - 1), the page's tokens))`, so a key names a page's tokens and every
token before them. A new prompt's keys are looked up page by page; the longest run found (at most
up to the page before its last token: a prompt's last token is always computed, its logits
sample the first output) is started on (`SHARED` page event, `PagePool.chain`), and only the rest
of the prompt is prefilled. A key is dropped when its page is reused for other tokens
(`PagePool.on_evict`).

A page is found only after the round that fills it has started (`ready`): a round that has
started runs to the end, so its writes come before any later round's reads; a round planned but
not started may still be cancelled into padding (its keys are dropped then, `forget`).

Reuse needs every stateful layer of the model to be paged full attention (a sliding window's ring
buffer, a recurrent state or MLA's latent cache holds no state per page), and the ranks holding
the KV cache to hold exactly the scheduler's slots (so their pools are the scheduler's copy).
"""

from __future__ import annotations

from opweave.runtime.pages import PagePool


def page_keys(prompt: list[int], page_tokens: int) -> list[int]:
    """The hash-chain key of each full page of `prompt`."""
    keys, key = [], 0
    for i in range(len(prompt) // page_tokens):
        key = hash((key, tuple(prompt[i * page_tokens:(i + 1) * page_tokens])))
        keys.append(key)
    return keys


class PrefixCache:
    """Keys of the full prompt pages in a scheduler's copy of its pool; hit counts in tokens."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._page: dict[int, int] = {}   # key -> page
        self._key: dict[int, int] = {}    # page -> key
        self._round: dict[int, int] = {}  # page -> the round that fills it
        self._tokens: dict[int, tuple[int, ...]] = {}  # page -> its tokens (a hit is checked, not trusted to a hash)
        self.queried = self.hit = 0       # prompt tokens looked up / found cached
        pool.on_evict = self._drop

    def lookup(self, keys: list[int], prompt: list[int], ready: int) -> tuple[int, int]:
        """(pages found, the last one's id) for `prompt` with page keys `keys`: the longest run of
        its first pages whose fill round is before `ready`, each holding the prompt's tokens there
        (a key is a 64-bit hash: its tokens are compared) and the one before it in the chain (what
        the ranks will walk, `PagePool.chain`)."""
        self.queried += len(prompt)
        p = self.pool.page_tokens
        limit = (len(prompt) - 1) // p
        found, last = 0, -1
        for i, key in enumerate(keys[:limit]):
            page = self._page.get(key)
            if (page is None or self._round[page] >= ready or self.pool.parent[page] != last
                    or self._tokens[page] != tuple(prompt[i * p:(i + 1) * p])):
                break
            found, last = found + 1, page
        self.hit += found * self.pool.page_tokens
        return found, last

    def register(self, table: list[int], keys: list[int], prompt: list[int], first: int, end: int,
                 round_index: int) -> tuple[int, ...]:
        """After a chunk [first, end) of `prompt` is planned for a slot holding pages `table`: the
        keys of the pages it fills, where the page before holds the key before (the chain a lookup
        walks); answers the pages given a key."""
        p = self.pool.page_tokens
        added = []
        for i in range(first // p, min(end // p, len(keys))):
            page, key = table[i], keys[i]
            if key in self._page or page in self._key:
                continue
            if (self._page.get(keys[i - 1]) if i else -1) != (table[i - 1] if i else -1):
                continue
            self._page[key], self._key[page], self._round[page] = page, key, round_index
            self._tokens[page] = tuple(prompt[i * p:(i + 1) * p])
            added.append(page)
        return tuple(added)

    def forget(self, pages: tuple[int, ...]) -> None:
        """Keys of pages whose filling step was cancelled before its round started."""
        for page in pages:
            self._drop(page)

    def _drop(self, page: int) -> None:
        key = self._key.pop(page, None)
        if key is not None:
            del self._page[key]
            del self._round[page]
            del self._tokens[page]
