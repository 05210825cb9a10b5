"""Row-tile bookkeeping shared by the grouped GEMMs (bf16 ``grouped_gemm`` and ``fp8_grouped_gemm``).

Owns: how rows sorted by group are cut into row tiles that never straddle two groups
(``tile_metadata``, computed outside the kernels), how a kernel writes back only a tile's valid
rows (``store_rows``, a power-of-two ladder of TMA stores), how a persistent CTA runs (and optionally
chains) its tiles' K pipelines (``run_tile_pipeline``), the plain-jnp segment matmul over such
tiles that both references use (``segment_matmul``: the bf16 reference and the FP8 one, which
dequantizes one group's weight per tile), and the few shape helpers both kernels share
(``round_up``, ``pad_axis``, ``num_sms``, ``padded_rows``: the row count a kernel's TMA operands
need), the host-side row tiles of a dense GEMM
(``dense_tile_metadata``), and the one check of ``group_sizes`` that kernels and references share
(``check_group_sizes``). Must not know about operand dtypes, scales, tilings of N/K or the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# meta rows (see tile_metadata)
GROUP, ROW0, LO, HI = range(4)


def tile_metadata(group_sizes: jax.Array, num_rows: int, tile_m: int) -> tuple[jax.Array, int]:
    """Row tiles that never straddle two groups.

    Group ``G`` (one past the last group) is the tail ``[sum(group_sizes), M)``, written as zeros.
    Returns ``meta [4, T] int32`` with rows (group, tile_row0, lo, hi): the tile covers rows
    ``[tile_row0, tile_row0 + tile_m)`` of which ``[lo, hi)`` belong to the group; ``hi == lo`` marks
    an unused slot. ``T = cdiv(M, tile_m) + G`` is a static bound on the number of tiles. Tiles come
    in group order, so the tiles of real groups form a prefix, then the tail's, then unused slots.
    Empty groups get no tile. Group sizes summing past ``M`` are clipped at ``M``.
    """
    e = group_sizes.shape[0]
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1]
    starts = jnp.concatenate([starts, total[None]])
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    first = starts // tile_m
    ntiles = jnp.where(ends > starts, (ends + tile_m - 1) // tile_m - first, 0)
    tile_end = jnp.cumsum(ntiles)
    num_slots = -(-num_rows // tile_m) + e
    t = jnp.arange(num_slots, dtype=jnp.int32)
    # compare_all, not the default binary search: that one is a while loop, which on a GPU pays a
    # device-to-host round trip per iteration on every grouped GEMM call; T x (G + 1) compares is tiny.
    g = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"), e).astype(jnp.int32)
    row0 = (first[g] + t - (tile_end[g] - ntiles[g])) * tile_m
    valid = t < tile_end[-1]
    lo = jnp.where(valid, jnp.maximum(starts[g], row0), 0)
    hi = jnp.where(valid, jnp.minimum(ends[g], row0 + tile_m), 0)
    row0 = jnp.where(valid, row0, 0)
    return jnp.stack([g, row0, lo, hi]).astype(jnp.int32), num_slots


def tile_counts(meta: jax.Array, num_groups: int) -> jax.Array:
    """``[2] int32``: how many tiles belong to real groups, and how many to the zero tail."""
    used = meta[HI] > meta[LO]
    real = jnp.sum(used & (meta[GROUP] < num_groups))
    tail = jnp.sum(used & (meta[GROUP] == num_groups))
    return jnp.stack([real, tail]).astype(jnp.int32)


def dense_tile_metadata(num_rows: int, tile_m: int) -> tuple[np.ndarray, np.ndarray]:
    """``tile_metadata`` and ``tile_counts`` of a single group of ``num_rows`` rows, computed on the host:
    a dense GEMM's row tiles are known at trace time, so they enter the program as constants instead of
    as several small device ops per call (which at a few rows cost as much as streaming the weight).
    No zero-tail tiles: padding rows past ``num_rows`` are left unwritten and the caller drops them."""
    real = -(-num_rows // tile_m)
    row0 = np.arange(real, dtype=np.int32) * tile_m
    meta = np.stack([np.zeros_like(row0), row0, row0, np.minimum(row0 + tile_m, num_rows)]).astype(np.int32)
    return meta, np.array([real, 0], np.int32)


def store_rows(o_smem, out_gmem, row_base, start, size, col0, max_rows: int) -> None:
    """TMA-store rows ``[start, start + size)`` of ``o_smem [max_rows, w]`` to ``out_gmem`` at rows
    ``row_base + start ...`` and columns ``[col0, col0 + w)``.

    TMA boxes have static shapes and the row count is known only at run time, so the rows go out as a
    ladder of power-of-two boxes (``max_rows``, ..., 2, 1), each issued only when its bit of ``size`` is
    set. The caller has written ``o_smem`` and called ``commit_smem``; it waits on the stores later.
    """
    width = o_smem.shape[1]
    p = max_rows
    while p >= 1:

        @pl.when((size & p) != 0)
        def _(start=start, p=p):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(start, p)],
                out_gmem.at[pl.ds(row_base + start, p), pl.ds(col0, width)],
            )

        start = start + (size & p)
        p //= 2


def run_tile_pipeline(make_pipeline, step, ctx, refs, allocs, info: plgpu.NDLoopInfo, chain: bool) -> None:
    """Run one work item's K pipeline inside a persistent CTA's tile loop.

    ``make_pipeline(step, ctx, state)`` builds the warp-specialised pipeline. Unchained, each tile primes
    and drains its own pipeline. Chained, one CTA's tiles form one long pipeline: the first tile primes
    it, the last drains it, the ones between run steady (the loader fetches the next tile's first K
    blocks while the current tile's epilogue runs).
    """
    if not chain:
        make_pipeline(step, ctx)(*refs, allocations=allocs)
        return
    first = info.local_index == 0
    last = info.local_index == info.num_local_steps - 1
    S = plgpu.PipelinePipeline
    for cond, state in ((first & last, None), (first & ~last, S.START),
                        (~first & ~last, S.STEADY), (~first & last, S.STOP)):
        pl.when(cond)(lambda state=state: make_pipeline(step, ctx, state)(*refs, allocations=allocs))


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# TMA operands are tiled (8, 128 bytes) in shared memory, and Mosaic GPU tiles the whole global array the
# same way: a dimension longer than 8 rows must be a whole number of 8-row tiles (rows = 65 fails to lower).
TMA_ROW_TILE = 8


def padded_rows(num_rows: int, tile_m: int) -> int:
    """Rows a grouped/dense GEMM kernel runs on: ``num_rows`` rounded up to whole ``TMA_ROW_TILE`` tiles
    and to at least one ``tile_m`` row tile. A row tile that ends past them reads zeros (TMA fills a
    box's out-of-bounds part with zeros) and stores only its valid rows, so rows need no more padding,
    and a row count the model produces (tokens x experts per token, a multiple of 8) costs no copy."""
    return max(round_up(num_rows, TMA_ROW_TILE), tile_m)


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `axis` of `x` up to `size` (no copy when it already has that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def num_sms() -> int:
    """Streaming multiprocessors of the first device (the persistent kernels' grid); 132 on an H100/H200."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def check_group_sizes(group_sizes: jax.Array, num_groups: int) -> None:
    """``group_sizes`` must be ``[num_groups]`` integers (rows per group; the sizes themselves are traced,
    so a negative size counts as 0 and rows past ``num_rows`` are dropped, in kernels and references
    alike)."""
    if group_sizes.shape != (num_groups,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integer [{num_groups}], got {group_sizes.shape} "
                         f"{group_sizes.dtype}")


def _reference_row_tile(num_rows: int, num_groups: int) -> int:
    """About the mean rows per group (a power of two in [8, 128]): at most ~2x the rows get computed."""
    return min(128, max(8, 1 << int(math.log2(max(1, num_rows // max(1, num_groups))))))


def segment_matmul(x: jax.Array, group_sizes: jax.Array, weight_of: Callable[[jax.Array], jax.Array],
                   n: int) -> jax.Array:
    """fp32 ``out[r] = x[r] @ weight_of(g(r)).T`` for rows sorted by group, in plain jnp.

    ``weight_of(g)`` returns group ``g``'s ``[n, K]`` weight in fp32 (it is called per row tile, so an
    FP8 caller dequantizes one group at a time, never all of them). Row tiles never straddle two groups,
    so each tile multiplies only by its own group's weight: no dense all-groups product and no
    ``ragged_dot`` (which XLA densifies). Rows at or past ``sum(group_sizes)`` come out zero.
    Differentiable in ``x`` and in whatever ``weight_of`` closes over.
    """
    m = x.shape[0]
    g = group_sizes.shape[0]
    if m == 0 or n == 0:
        return jnp.zeros((m, n), jnp.float32)
    t = _reference_row_tile(m, g)
    mp = round_up(m, t)
    meta, _ = tile_metadata(group_sizes, mp, t)
    xp = pad_axis(x.astype(jnp.float32), 0, mp)

    def one_tile(col):
        gi, row0, lo, hi = col[GROUP], col[ROW0], col[LO], col[HI]
        xt = lax.dynamic_slice_in_dim(xp, row0, t)
        y = jnp.dot(xt, weight_of(jnp.minimum(gi, g - 1)).T, precision=lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)
        rows = row0 + jnp.arange(t, dtype=jnp.int32)
        keep = (rows >= lo) & (rows < hi) & (gi < g)
        return jnp.where(keep[:, None], y, 0.0), jnp.where(keep, rows, mp)

    ys, rows = lax.map(one_tile, meta.T)
    # Every row is kept by exactly one tile; rows of no tile (past the groups) stay zero.
    out = jnp.zeros((mp, n), jnp.float32).at[rows.reshape(-1)].add(ys.reshape(-1, n), mode="drop")
    return out[:m]
