"""The page pool split into data-parallel slices: each shard's pages, free list, LRU and prefix index stay
its own (no page of a sequence on another shard), and one slice is exactly the old single pool."""

from __future__ import annotations

import numpy as np
import pytest

from dsv3_jax.engine.paging import OutOfPages, PagePool


def test_one_shard_is_the_plain_pool():
    pool = PagePool(8, 4)
    assert pool.shards == 1 and pool.scratch(0) == 0 and pool.capacity == 7
    assert pool.allocate(3) == [1, 2, 3]  # ascending, page 0 never handed out
    assert pool.num_used == 3 and pool.num_free == 4
    with pytest.raises(OutOfPages, match="need 5 pages, 4 obtainable of 7"):
        pool.allocate(5)
    pool.check()


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_slices_are_disjoint_under_random_traffic(shards):
    """Random allocate / release / prefix reuse on every shard: every page a shard gets lies in its slice,
    prefix hits never cross slices, and the invariants hold after every operation."""
    pool = PagePool(shards * 6, 2, shards=shards)
    n = pool.pages_per_shard
    rng = np.random.default_rng(shards)
    seqs = [list(rng.integers(0, 5, size=8)) for _ in range(3)]
    held: list[tuple[int, list[int]]] = []
    for it in range(400):
        s = int(rng.integers(shards))
        op = rng.integers(4)
        try:
            if op == 0:
                pages = pool.allocate(int(rng.integers(1, 4)), shard=s)
                held.append((s, pages))
            elif op == 1 and held:
                pool.release(held.pop(int(rng.integers(len(held))))[1])
            elif op == 2:
                seq = seqs[it % 3]
                got = pool.match_prefix(seq, 4, shard=s)
                assert len(got) == pool.cached_prefix(seq, 4, shard=s) or not got
                held.append((s, got))
            elif op == 3 and held:
                hs, pages = held[int(rng.integers(len(held)))]
                pool.register(seqs[it % 3], pages)
        except OutOfPages as e:
            assert f"on shard {s}" in str(e)
        for hs, pages in held:
            assert all(hs * n < p < (hs + 1) * n for p in pages), (hs, pages)
        pool.check()
    for _, pages in held:
        pool.release(pages)
    pool.check()
    assert pool.num_used == 0 and pool.num_free == pool.capacity == shards * (n - 1)


def test_a_full_shard_does_not_borrow_and_evicts_only_its_own_pages():
    pool = PagePool(8, 2, shards=2)  # shard 0: pages 1-3, shard 1: pages 5-7
    a = pool.allocate(3, shard=0)
    assert a == [1, 2, 3] and pool.free_in(0) == 0 and pool.free_in(1) == 3
    with pytest.raises(OutOfPages, match="on shard 0"):
        pool.allocate(1, shard=0)
    # Shard 1 caches a prompt; shard 0 cannot hit it, shard 1 can.
    toks = [1, 2, 3, 4]
    b = pool.allocate(2, shard=1)
    pool.register(toks, b)
    pool.release(b)  # idle, cached on shard 1
    assert pool.cached_prefix(toks, 2, shard=0) == 0 and pool.match_prefix(toks, 2, shard=0) == []
    assert pool.match_prefix(toks, 2, shard=1) == b
    pool.release(b)
    # Shard 1 under pressure evicts its own idle pages (LRU); shard 0's held pages are untouched.
    assert sorted(pool.allocate(3, shard=1)) == [5, 6, 7] and pool.cached_prefix(toks, 2, shard=1) == 0
    assert all(pool.refcount(p) == 1 for p in a)
    pool.check()
    with pytest.raises(ValueError, match="must share one slice"):
        pool.register([1, 2, 3, 4], [1, 5])


def test_bad_partitions_fail_clearly():
    with pytest.raises(ValueError, match="multiple of shards"):
        PagePool(10, 4, shards=4)
    with pytest.raises(ValueError, match=">= 2 per shard"):
        PagePool(4, 4, shards=4)
    with pytest.raises(ValueError, match="out of range"):
        PagePool(8, 4, shards=2).allocate(1, shard=2)
    pool = PagePool(8, 4, shards=2)
    assert [pool.scratch(s) for s in range(2)] == [0, 4] and pool.local(6) == 2 and pool.shard_of(6) == 1
