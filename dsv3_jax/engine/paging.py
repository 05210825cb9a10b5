"""Page bookkeeping for the paged latent cache: a reference-counted pool and a prefix cache.

Owns: which physical pages are free, who holds them (reference counts), and the prefix cache: full
pages indexed by a hash chain of their token content (system prompts, multi-turn history) so that a
new request reuses them instead of recomputing, with LRU eviction of pages nobody holds.

Data-parallel attention: the pool is split into `shards` equal slices, one per batch shard of the mesh
(data x expert), matching how layout.CACHE_AXES (through sharding) splits the page axis over devices:
shard s owns the physical pages [s*n, (s+1)*n) with n = num_pages / shards. Each slice has its own free
list, its own LRU of idle cached pages and its own prefix index, so a request placed on shard s is only
ever given pages of slice s (its attention stays on its own devices) and a prefix hit never crosses slices.
The first page of each slice (s*n; page 0 when shards = 1) is that slice's scratch page (padding
writes land there) and is never handed out. shards = 1 is the plain single pool.
Must not touch device arrays, nor choose which shard a request goes to (the engine's scheduler does):
this is host-side bookkeeping only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


class OutOfPages(RuntimeError):
    """The pool (or one shard's slice of it) has no free page, after evicting every unreferenced cached
    page."""


def page_hashes(tokens: Sequence[int], page_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """Hash chain over the *full* pages of `tokens`: h_i = H(h_{i-1}, tokens of page i). `known`: the
    chain's first hashes for these tokens, extended rather than recomputed (a long prefill publishes a
    page every few steps; rehashing a 128K prefix each time costs ~20 ms of host time)."""
    out, prev = list(known), known[-1] if known else b""
    for i in range(len(known), len(tokens) // page_size):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        prev = hashlib.blake2b(prev + b"|" + ",".join(map(str, chunk)).encode(), digest_size=16).digest()
        out.append(prev)
    return out


class PagePool:
    """Physical pages with reference counts, in `shards` disjoint slices; a prefix cache on top.

    A page is in exactly one state: free, held (refcount > 0), or cached-idle (refcount 0, kept for
    reuse in LRU order, evicted on demand). Counts without a shard are over all slices.
    """

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True, shards: int = 1):
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if num_pages % shards:
            raise ValueError(f"num_pages ({num_pages}) must be a multiple of shards ({shards}): each batch "
                             f"shard holds an equal slice of the pool")
        if num_pages // shards < 2:
            raise ValueError(f"num_pages must be >= 2 per shard (the first page of each slice is scratch), "
                             f"got {num_pages} for {shards} shards")
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.shards, self.pages_per_shard = shards, num_pages // shards
        n = self.pages_per_shard
        self._free: list[list[int]] = [list(range((s + 1) * n - 1, s * n, -1)) for s in range(shards)]
        self._ref = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: list[dict[bytes, int]] = [{} for _ in range(shards)]
        self._idle: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(shards)]  # LRU first
        self.hits = self.lookups = 0

    # ------------------------------------------------------------------ slices
    def shard_of(self, page: int) -> int:
        return page // self.pages_per_shard

    def scratch(self, shard: int = 0) -> int:
        """The slice's scratch page: rows of that batch shard with nothing to write point here."""
        return shard * self.pages_per_shard

    def local(self, page: int) -> int:
        """Index of `page` inside its slice (what a device holding only that slice sees)."""
        return page % self.pages_per_shard

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} out of range 0..{self.shards - 1}")

    # ------------------------------------------------------------------ counts
    def free_in(self, shard: int) -> int:
        """Pages obtainable now on `shard` (free + evictable cached ones)."""
        return len(self._free[shard]) + len(self._idle[shard])

    def used_in(self, shard: int) -> int:
        return self.pages_per_shard - 1 - self.free_in(shard)

    @property
    def num_free(self) -> int:
        """Pages obtainable now (free + evictable cached ones), all slices."""
        return sum(self.free_in(s) for s in range(self.shards))

    @property
    def num_used(self) -> int:
        return self.num_pages - self.shards - self.num_free

    @property
    def capacity(self) -> int:
        """Pages that can be handed out, all slices (scratch pages excluded)."""
        return self.num_pages - self.shards

    def refcount(self, page: int) -> int:
        return self._ref[page]

    # ------------------------------------------------------------------ alloc / free
    def allocate(self, n: int, shard: int = 0) -> list[int]:
        """n fresh pages of `shard`'s slice (refcount 1), evicting its idle cached pages (LRU) if needed."""
        self._check_shard(shard)
        if n > self.free_in(shard):
            where = f" on shard {shard}" if self.shards > 1 else ""
            raise OutOfPages(f"need {n} pages{where}, {self.free_in(shard)} obtainable of "
                             f"{self.pages_per_shard - 1}")
        free, idle, pages = self._free[shard], self._idle[shard], []
        for _ in range(n):
            if free:
                p = free.pop()
            else:
                p, _ = idle.popitem(last=False)
                del self._page_of[shard][self._hash_of.pop(p)]
            self._ref[p] = 1
            pages.append(p)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; cached pages go idle, others back to their slice's free list."""
        for p in pages:
            if self._ref[p] <= 0:
                raise RuntimeError(f"page {p} released more often than held")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                s = self.shard_of(p)
                if p in self._hash_of:
                    self._idle[s][p] = None
                else:
                    self._free[s].append(p)

    # ------------------------------------------------------------------ prefix cache
    def cached_prefix(self, tokens: Sequence[int], max_pages: int, shard: int = 0) -> int:
        """How many leading full pages of `tokens` `shard` has cached (no references taken)."""
        if not self.prefix_caching:
            return 0
        index, n = self._page_of[shard], 0
        for h in page_hashes(tokens, self.page_size)[:max_pages]:
            if h not in index:
                break
            n += 1
        return n

    def match_prefix(self, tokens: Sequence[int], max_pages: int, shard: int = 0) -> list[int]:
        """Take a reference to the longest run of `shard`'s cached pages matching tokens' full pages."""
        if not self.prefix_caching:
            return []
        self._check_shard(shard)
        self.lookups += 1
        got = []
        for h in page_hashes(tokens, self.page_size)[:max_pages]:
            p = self._page_of[shard].get(h)
            if p is None:
                break
            if self._ref[p] == 0:
                self._idle[shard].pop(p, None)
            self._ref[p] += 1
            got.append(p)
        if got:
            self.hits += 1
        return got

    def register(self, tokens: Sequence[int], pages: Sequence[int],
                 hashes: Sequence[bytes] | None = None) -> None:
        """Publish the full pages of `tokens` (held in `pages`, in order, all of one slice) for reuse;
        `hashes`: their page_hashes when the caller keeps them."""
        if not self.prefix_caching or not pages:
            return
        shard = self.shard_of(pages[0])
        index = self._page_of[shard]
        if hashes is None:
            hashes = page_hashes(tokens, self.page_size)
        for h, p in zip(hashes, pages, strict=False):
            if self.shard_of(p) != shard:
                raise ValueError(f"register: page {p} is on shard {self.shard_of(p)}, the sequence's first "
                                 f"page on shard {shard}; a sequence's pages must share one slice")
            if p in self._hash_of or h in index:
                continue  # already published (by us or an identical page of another request)
            self._hash_of[p] = h
            index[h] = p

    def check(self) -> None:
        """Invariants (for tests): every page in exactly one state and in its own slice's structures,
        refcounts never negative, scratch pages never handed out."""
        n = self.pages_per_shard
        for s in range(self.shards):
            free, idle = set(self._free[s]), set(self._idle[s])
            assert not free & idle
            assert all(self.shard_of(p) == s and p != s * n for p in free | idle), s
            assert all(self.shard_of(p) == s for p in self._page_of[s].values()), s
            assert self._ref[s * n] == 0, f"scratch page {s * n} is held"
            for p in range(s * n + 1, (s + 1) * n):
                assert self._ref[p] >= 0
                assert (p in free) + (p in idle) + (self._ref[p] > 0) == 1, p
                assert (p in idle) <= (p in self._hash_of)
        for p, h in self._hash_of.items():
            assert self._page_of[self.shard_of(p)][h] == p
