"""Data-parallel attention over a page-partitioned cache: each batch shard touches only its own pages.

Owns: running the paged-cache part of attention (page writes, page reads, the attention kernel) inside
a `shard_map` over the batch axes, where every batch shard sees only its slice of the page pool and its
own tokens, with the block table turned into slice-local page ids. Without this, XLA's partitioner
cannot know that a token's pages live on its own devices: it all-gathers the whole pool after every
page write (measured: one all-gather of the full [P, page_size, 576] pool per layer per step), which
undoes the memory saving of splitting the pool and costs a pool's worth of traffic every layer.

The invariant it relies on is paging.PagePool's (shards > 1): a sequence of batch shard s holds only
pages of slice s = [s*n, (s+1)*n), n = P / shards, and the first page of each slice is its scratch
page. Inside, table entries outside the slice (the zeros of unused columns) map to the local scratch
page 0, so padding writes stay local too. Batch shards are the (data, expert) devices in row-major
order, the order `sharding.LOGICAL_RULES["cache_pages"]` splits the page axis in. Heads stay split over
`tensor` (each device runs the kernel on its heads). Must not own the attention math (attention.py)
or the cache layout (cache.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv3_jax.parallel import sharding

LAYOUTS = ("pages", "layer_pages", "rows", "heads", "meta", "replicated")
_POOL_AXIS = {"pages": 0, "layer_pages": 1}  # where a pool leaf keeps its page axis


def batch_shards() -> int:
    """Batch shards of the mesh set around tracing (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return sharding.batch_multiple(mesh)


def _spec(layout: str, ndim: int, heads_axis: int = 2) -> Any:
    batch = sharding.LOGICAL_RULES["batch"]
    if layout == "meta":
        return P(batch)  # every PageMeta leaf is batch-leading
    if layout == "rows":
        return P(batch)
    if layout == "heads":
        return P(*[batch if i == 0 else ("tensor" if i == heads_axis else None) for i in range(ndim)])
    if layout == "replicated":
        return P()
    if layout in _POOL_AXIS:
        # [P, page_size, latent] or [P, page_size, H, d] (naive: heads over tensor); "layer_pages" is a
        # scanned stack of those, [L, P, ...].
        pa = _POOL_AXIS[layout]
        naive = ndim == 4 + pa
        return P(*[batch if i == pa else ("tensor" if naive and i == pa + 2 else None) for i in range(ndim)])
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard_local(fn: Callable[..., Any], args: Sequence[Any], layouts: Sequence[str],
                out_layouts: Sequence[str]) -> Any:
    """fn(*args) run per batch shard, or as is when the mesh has one batch shard.

    `layouts[i]` says how args[i] is laid out: "pages" (a pool leaf, split by pages), "layer_pages" (a
    scanned stack of pool leaves [L, P, ...], split by pages), "rows" (batch-leading, replicated over
    tensor), "heads" ([B, T, H, ...], heads over tensor), "meta" (a PageMeta whose block table holds
    global page ids; fn receives slice-local ids) or "replicated" (e.g. a layer index). `out_layouts`
    likewise for fn's outputs (a tuple).
    """
    d = batch_shards()
    if d == 1:
        return fn(*args)
    if len(args) != len(layouts):
        raise ValueError(f"shard_local: {len(args)} args but {len(layouts)} layouts")
    batch = sharding.LOGICAL_RULES["batch"]
    axes = (batch,) if isinstance(batch, str) else tuple(batch)
    pools = [a.shape[_POOL_AXIS[lay]] for a, lay in zip(args, layouts, strict=True) if lay in _POOL_AXIS]
    if not pools:
        raise ValueError("shard_local needs the page pool among its args")
    if pools[0] % d:
        raise sharding.MeshError(f"the page pool's {pools[0]} pages do not split over {d} batch "
                                 f"shards; size the pool to a multiple of {d} (paging.PagePool shards)")
    n_local = pools[0] // d

    def body(*local):
        s = jax.lax.axis_index(axes)
        out = []
        for a, lay in zip(local, layouts, strict=True):
            if lay == "meta":
                t = a.block_table - s * n_local
                a = dataclasses.replace(
                    a, block_table=jnp.where((t >= 0) & (t < n_local), t, 0).astype(a.block_table.dtype))
            out.append(a)
        return fn(*out)

    mesh = jax.sharding.get_abstract_mesh()
    in_specs = tuple(_spec(lay, getattr(a, "ndim", 0)) for a, lay in zip(args, layouts, strict=True))
    shapes = jax.eval_shape(fn, *args)
    out_specs = tuple(_spec(lay, o.ndim) for o, lay in zip(shapes, out_layouts, strict=True))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
