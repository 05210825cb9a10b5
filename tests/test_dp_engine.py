"""Data-parallel attention in the engine on 8 virtual devices: continuous batching with prefix caching on a
mesh with batch shards gives one device's tokens, every sequence's pages stay in its own shard's slice, the
pool is split (never replicated: bytes per device = total / d), and the compiled step never moves the pool."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.engine.core import Engine, EngineConfig
from dsv3_jax.parallel import sharding
from tests.hf_reference import make_hf_model, save_hf
from tests.mesh_models import MESH_CONFIGS  # noqa: F401  (registers h8e16)

PS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf(make_hf_model("h8e16"), tmp_path_factory.mktemp("h8e16"))


def _workload(seed: int = 0):
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, 500, size=9).tolist()  # a "system prompt" spanning two full pages
    prompts = [shared + rng.integers(2, 500, size=n).tolist() for n in (3, 7, 1, 12, 5, 2)]
    prompts += [rng.integers(2, 500, size=n).tolist() for n in (4, 15)]
    arrivals = {0: [0, 1, 6], 1: [2], 3: [3, 7], 5: [4, 5]}  # requests join between steps
    return prompts, arrivals


def _run(handle, check=None) -> list[list[int]]:
    """A small pool (preemption possible), 4-token pages and chunks, requests arriving over time."""
    prompts, arrivals = _workload()
    # One step shape, (8 tokens, 8 rows): one compiled program per mesh (CPU compiles dominate this test).
    eng = Engine(handle, EngineConfig(num_pages=48, page_size=PS, max_batch=8, max_batched_tokens=8,
                                      chunk_size=4, prefix_caching=True, row_buckets=(8,)))
    assert eng.shapes.pairs == ((8, 8),)
    rids, got, step = {}, {}, 0
    while len(got) < len(prompts):
        for i in arrivals.get(step, []):
            rids[eng.add_request(prompts[i], max_new_tokens=5)] = i
        for ev in eng.step():
            if ev.finished:
                got[rids[ev.rid]] = eng.finished[ev.rid].output
        if check:
            check(eng)
        step += 1
    assert eng.engine_stats()["prefix_hit_rate"] > 0
    return [got[i] for i in range(len(prompts))], eng


def test_dp_engine_matches_one_device_and_keeps_pages_local(ckpt):
    want, _ = _run(dsv3_jax.load(ckpt))
    handle = dsv3_jax.load(ckpt, mesh="data=2,tensor=2,expert=2")  # 4 batch shards, heads over tensor
    seen_shards = set()

    def local_pages(eng):
        pool = eng.pool
        assert pool.shards == 4
        pool.check()
        for r in eng.running:
            assert all(pool.shard_of(p) == r.shard for p in r.pages), (r.rid, r.shard, r.pages)
            seen_shards.add(r.shard)

    got, eng = _run(handle, local_pages)
    assert got == want
    assert seen_shards == {0, 1, 2, 3}  # least-loaded placement used every shard
    # The compiled steps move no cache data between devices: no collective carries pages or gathered
    # KV ([..., page_size, latent] arrays), as they do when the partitioner is left to place attention
    # (it all-gathers pool slices and all-reduces masked gathers of every token's pages).
    kv_tail = f",{PS},{handle.config.latent_dim}]"
    from dsv3_jax.engine.executor import compiled_programs

    for compiled in compiled_programs(handle).values():
        hlo = compiled.as_text()
        moving = [ln for ln in hlo.splitlines() if kv_tail in ln.split("(")[0] and any(
            c in ln for c in ("all-gather(", "all-reduce(", "all-to-all(", "collective-permute("))]
        assert not moving, moving[:2]


@pytest.mark.parametrize("spec,d", [("data=2,tensor=4", 2), ("data=2,tensor=2,expert=2", 4), ("expert=8", 8)])
def test_pool_is_split_never_replicated(ckpt, spec, d):
    handle = dsv3_jax.load(ckpt, mesh=spec)
    eng = Engine(handle, EngineConfig(num_pages=6 * d - 1, page_size=PS, max_batch=8))
    assert eng.pool.shards == d and eng.pool.num_pages % d == 0  # rounded up to whole slices
    for leaf in jax.tree.leaves(eng.executor.cache):
        total = leaf.nbytes
        for s in leaf.addressable_shards:
            assert s.data.nbytes * d == total, (spec, leaf.shape, s.data.shape)
    assert sharding.batch_multiple(handle.mesh) == d
