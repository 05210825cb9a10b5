"""dp_attention.shard_local: page writes and reads run per batch shard on its own slice of the pool, give the
unsharded result, and compile without gathering the pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.engine.paging import PagePool
from dsv3_jax.model.kv_cache import PageMeta
from dsv3_jax.parallel import dp_attention, sharding

PS, LAT, H = 4, 8, 4


def _write_read(pages, new, meta, start, q):
    """Write one new latent per row at `start` (padding rows to page 0), read every row's pages."""
    page = jnp.take_along_axis(meta.block_table, (start // PS)[:, None], axis=1)[:, 0]
    page = jnp.where(meta.chunk_lens > 0, page, 0)
    pages = pages.at[page, start % PS].set(new[:, 0])
    kv = pages[meta.block_table].reshape(new.shape[0], -1, LAT)  # [B, W*PS, LAT]
    return jnp.einsum("bthr,bsr->bths", q, kv), pages


@pytest.mark.parametrize("spec", ["data=4", "data=2,tensor=2,expert=2"])
def test_local_pages_match_global(spec):
    mesh = sharding.make_mesh(spec, jax.devices()[:8] if "tensor" in spec else jax.devices()[:4])
    d = sharding.batch_multiple(mesh)
    pool = PagePool(d * 6, PS, shards=d)
    rng = np.random.default_rng(0)
    b, w = 2 * d, 3
    table = np.zeros((b, w), np.int32)
    for i in range(b):  # rows are split over shards in order: row i lives on shard i // (b / d)
        table[i, :2] = pool.allocate(2, shard=i // (b // d))
    start = rng.integers(0, 5, size=b).astype(np.int32)
    lens = np.array([1, 0] * d, np.int32)  # every other row is padding
    pages = jnp.asarray(rng.normal(size=(d * 6, PS, LAT)), jnp.float32)
    new = jnp.asarray(rng.normal(size=(b, 1, LAT)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(b, 1, H, LAT)), jnp.float32)
    meta = PageMeta(jnp.asarray(table), jnp.asarray(lens))
    ref_out, ref_pages = _write_read(pages, new, meta, jnp.asarray(start), q)

    def local(pages, new, meta, start, q):
        return dp_attention.shard_local(_write_read, (pages, new, meta, start, q),
                                        ("pages", "rows", "meta", "rows", "heads"), ("heads", "pages"))

    fn = jax.jit(local)
    with jax.set_mesh(mesh):
        lowered = fn.lower(pages, new, meta, jnp.asarray(start), q)
        out, got_pages = fn(pages, new, meta, jnp.asarray(start), q)
    # Real rows equal; each shard's scratch page takes its padding writes instead of global page 0.
    real = [p for p in range(d * 6) if p % 6]
    np.testing.assert_allclose(np.asarray(got_pages)[real], np.asarray(ref_pages)[real])
    # Scores over the rows' own pages (unused table columns read a scratch page, masked in attention).
    np.testing.assert_allclose(np.asarray(out)[..., :2 * PS], np.asarray(ref_out)[..., :2 * PS], rtol=1e-5)
    def pool_collectives(hlo: str) -> bool:
        return f"f32[{d * 6},{PS},{LAT}]" in " ".join(
            ln for ln in hlo.splitlines() if "all-gather(" in ln or "all-reduce(" in ln)

    assert not pool_collectives(lowered.compile().as_text()), "shard_local gathered the pool"
    if spec != "data=4":
        return
    # The control: the same code left to the partitioner, pool and rows batch-sharded, moves the pool.
    pool_sh = jax.sharding.NamedSharding(mesh, dp_attention._spec("pages", 3))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.LOGICAL_RULES["batch"]))
    plain = jax.jit(_write_read, in_shardings=(pool_sh, rows, rows, rows, rows))
    with jax.set_mesh(mesh):
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                (pages, new, meta, jnp.asarray(start), q))
        assert pool_collectives(plain.lower(*abstract).compile().as_text())
