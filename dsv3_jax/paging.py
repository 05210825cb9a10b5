"""Page bookkeeping for the paged latent cache: a reference-counted pool and a prefix cache.

Owns: which physical pages are free, who holds them (reference counts), and the prefix cache: full
pages indexed by a hash chain of their token content (system prompts, multi-turn history) so that a
new request reuses them instead of recomputing, with LRU eviction of pages nobody holds.
Physical page 0 is scratch (padding writes land there) and is never handed out.
Must not touch device arrays: this is host-side bookkeeping only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


class OutOfPages(RuntimeError):
    """The pool has no free page (after evicting every unreferenced cached page)."""


def page_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Hash chain over the *full* pages of `tokens`: h_i = H(h_{i-1}, tokens of page i)."""
    out, prev = [], b""
    for i in range(len(tokens) // page_size):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        prev = hashlib.blake2b(prev + b"|" + ",".join(map(str, chunk)).encode(), digest_size=16).digest()
        out.append(prev)
    return out


class PagePool:
    """Physical pages 1..num_pages-1 with reference counts; a prefix cache of full pages on top.

    A page is in exactly one state: free, held (refcount > 0), or cached-idle (refcount 0, kept for
    reuse in LRU order, evicted on demand).
    """

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._ref = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, LRU first
        self.hits = self.lookups = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Pages obtainable now (free + evictable cached ones)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free) - len(self._idle)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    # ------------------------------------------------------------------ alloc / free
    def allocate(self, n: int) -> list[int]:
        """n fresh pages (refcount 1), evicting idle cached pages (LRU) if needed."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} obtainable of {self.num_pages - 1}")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._idle.popitem(last=False)
                del self._page_of[self._hash_of.pop(p)]
            self._ref[p] = 1
            pages.append(p)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; cached pages go idle, others back to the free list."""
        for p in pages:
            if self._ref[p] <= 0:
                raise RuntimeError(f"page {p} released more often than held")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._hash_of:
                    self._idle[p] = None
                else:
                    self._free.append(p)

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """Take a reference to the longest run of cached pages matching tokens' full pages."""
        if not self.prefix_caching:
            return []
        self.lookups += 1
        got = []
        for h in page_hashes(tokens, self.page_size)[:max_pages]:
            p = self._page_of.get(h)
            if p is None:
                break
            if self._ref[p] == 0:
                self._idle.pop(p, None)
            self._ref[p] += 1
            got.append(p)
        if got:
            self.hits += 1
        return got

    def register(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Publish the full pages of `tokens` (held in `pages`, in order) for reuse by others."""
        if not self.prefix_caching:
            return
        for h, p in zip(page_hashes(tokens, self.page_size), pages, strict=False):
            if p in self._hash_of or h in self._page_of:
                continue  # already published (by us or an identical page of another request)
            self._hash_of[p] = h
            self._page_of[h] = p

    def check(self) -> None:
        """Invariants (for tests): every page in exactly one state, refcounts never negative."""
        free, idle = set(self._free), set(self._idle)
        assert not free & idle and 0 not in free | idle
        for p in range(1, self.num_pages):
            assert self._ref[p] >= 0
            assert (p in free) + (p in idle) + (self._ref[p] > 0) == 1, p
            assert (p in idle) <= (p in self._hash_of)
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())
