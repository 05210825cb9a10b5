"""Pallas Mosaic GPU kernel: absorbed MLA attention over a paged latent cache (decode, MTP verify).

Owns `mla_decode` and the paged-attention kernel core that `mla_prefill.py` reuses, with the XLA ops
around it (`query_tiles` before, `merge_splits` after), and what the MLA kernels share: the work lists and
split plans, the launch over them (`launch_items`), the partial writes, the merges, the softmax constants
and the P V step (`pv_accumulate`). Semantics are those of `mla_reference.py` (read
its docstring for the cache layout); widths, page size and argument checks come from `mla_common.py`.
`interpret=None` follows `pallas_kernels.interpret.resolve_interpret` (the interpreter off a GPU).

Kernel design ("v2", split QK; Hopper, one CTA = three warpgroups):
- Rows are (query token, head) pairs, row = j * H + h, tiled by 64 (one wgmma M). The 64x576 query tile
  (latent ++ rope, laid out by `query_tiles`, one fused XLA op) sits in shared memory for the whole CTA.
- Warpgroup 2 is the producer: it TMA-loads one 64-token page [64, 576] per step into a two-slot ring,
  reading the physical page id from `block_table` in global memory. Before reusing a slot it waits for
  both consumers' release of it (`consumed_bars`), and after its last load it waits for the release of
  the last pages too (the GPU interpreter requires every phase of a waited barrier to be observed).
- Warpgroups 0 and 1 are consumers sharing the 64-row tile. Consumer c scores only keys [32c, 32c + 32)
  of the page (S = Q K^T with wgmma N=32 on its half of the keys, K=576), so each QK FLOP is done once,
  and accumulates its own half (256 columns) of O = P V where V is the first 512 columns of the same page
  (so the cache is read once). A 64x512 fp32 accumulator would need 256 registers per thread; two halves
  of 128 fit.
- Per page, two cross-warpgroup barriers (`m_bar`, `p_bar`, 2 arrivals): each consumer stores its row
  maxima in `mx_smem[c]`, meets the other at `m_bar`, and takes the max of both (the same m on both
  sides, so the halves of P share one scale); it then stores its bf16 P half [64, 32] in `px_smem[c]`,
  meets at `p_bar`, loads the other half into registers and concatenates the full P [64, 64] as the
  register A operand of its P V wgmma (K=64: with 128-byte swizzled V a wgmma needs K to be a multiple
  of 64, so two K=32 products are not an option). Each consumer sums only its own P half into l; the
  halves are added once, at the final barrier (`done_bar`). One buffer of each kind suffices: a consumer
  writes step i+1's maxima only after passing step i's `p_bar`, i.e. after the other has read step i's
  maxima, and its P half only after step i+1's `m_bar`, i.e. after the other has loaded step i's P half
  into registers (on the GPU no wgmma reads `px_smem`).
- Shared memory (bytes): Q 73,728 + two pages 147,456 + P halves 8,192 + maxima/sums 512 (reused to
  stage the lse) + Mosaic's reduction scratch 1,024 = 230,912, which Pallas rounds up to 231,424, plus
  8 barriers (64) = 231,488 of the 232,448 allowed. Mosaic's default reduction scratch (2 KiB) would make
  it 232,512: the row reductions stay inside a warp, so the kernel asks for 1 KiB
  (`REDUCTION_SCRATCH_BYTES`; the CPU lowering test holds the budget).
- Split-KV: the grid is (work item, row tile); a work item (`work_items`) is a row, a page window and a
  share of it, so split s of a row takes an equal share of each of its tiles' pages. `split_plan` sets the
  layout (static: base splits that fill the GPU, plus slots for long rows, whose pages are then shared by
  more CTAs, picked at run time from the lengths, in proportion to each long row's pages: a long row among
  short ones no longer runs as one CTA walking its whole prefix; its docstring has the arithmetic).
  Partial outputs and their log-sum-exp are merged by `merge_splits` (plain max and add reductions over
  the splits: ~4x faster by GPU time than the single variadic reduce it replaced), long rows' extra
  partials by `merge_long_rows` (L rows only).
- Causality and raggedness are a per-row limit: row (j, h) attends to positions
  < min(q_start + 1 + j, kv_len); each tile only visits pages below its last row's limit.

Measured on the H200 (2026-12-03) against the earlier design v1 (both consumers compute the full score
tile, so the tensor cores do ~1.53x the necessary QK work), by wall clock: 0.985x v1's time at H=128,
B=64-128, S=4K and 1.01-1.04x at H=16 ("MLA decode v2" in benchmarks/RESULTS.md); by GPU time from
profiler traces (round four): 0.93-0.96x v1's time at H=128, B=64-128, S=4K-32K, 0.94x at H=16, B=128,
S=32K, and equal (0.99-1.01x) at B=1-8, so this is the design since then, for decode and prefill chunks.

Interpret mode (CPU tests): the GPU interpreter cannot take a wgmma A operand from registers nor run
`pl.run_state` accumulators, so under `interpret=True` the P tile is staged through shared memory and
the P V product is added to the carried accumulator as a value. Everything else is the same code.

Earlier and alternative designs (v1, v3, v8, v9) and the earlier one-reduce split merge are the kernel lab
in `pallas_kernels/experimental/mla_variants.py`: not used by the model.
"""

import functools
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.interpret import resolve_interpret
from pallas_kernels.mla_common import (
    KV_DIM,
    LATENT_DIM,
    PAGE_SIZE,
    as_4d,
    check_cache_args,
    check_kernel_args,
    clamp_page_ids,
)

BLOCK_ROWS = 64  # rows (token, head) per tile: one wgmma M
HALF = LATENT_DIM // 2  # output columns per consumer warpgroup
HALF_PAGE = PAGE_SIZE // 2  # keys each consumer scores per page
NUM_SLOTS = 2  # pipeline depth: 72 KiB Q + 2 x 72 KiB pages fills the 227 KiB of shared memory
DEFAULT_NUM_SMS = 132  # H100/H200 SXM
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
M_INIT = -1e30  # finite so that rows with nothing to attend to in a split give 0, not NaN
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
# The row reductions stay inside a warp (wgmma layout, axis 1), so Mosaic's cross-warp reduction scratch
# (default 2 KiB, reserved whether used or not) is cut to 1 KiB: the room for the exchange buffers.
REDUCTION_SCRATCH_BYTES = 1024


def choose_num_splits(batch: int, row_tiles: int, max_pages: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Splits of every row tile's KV pages so that batch * tiles * splits roughly fills the GPU once, at
    least 2 pages a split (B=1, H=128 at a 2,048-page table: 66 splits, a 128K row 31 pages each; at
    B >= 66 (H=128) or 132 (H <= 64): 1). Long rows among many get more through `split_plan`."""
    programs = batch * row_tiles
    return max(1, min(num_sms // max(programs, 1), pl.cdiv(max_pages, 2)))


LONG_ROW_PAGES = 128  # a row is long when one of its splits would walk more pages than this (8K tokens)
LONG_SPLITS = 3  # long CTAs per long-row slot: the plan's long_rows x 3 long CTAs are shared by the long rows


class SplitPlan(NamedTuple):
    """The static split layout of one kernel call (`split_plan`): every row tile's pages in `num_splits`
    equal shares, and up to `long_rows` long rows whose pages are shared with `long_rows * long_splits`
    long CTAs a tile, divided among the long rows at run time (`long_row_windows`)."""

    num_splits: int
    long_rows: int
    long_splits: int
    long_pages: int = LONG_ROW_PAGES  # the run-time test: a row is long when a base share exceeds this
    fill: int = DEFAULT_NUM_SMS  # CTAs per row tile that the long rows together fill: num_sms // tiles


def split_plan(batch: int, row_tiles: int, max_pages: int, num_sms: int = DEFAULT_NUM_SMS,
               long_pages: int = LONG_ROW_PAGES) -> SplitPlan:
    """The static split layout for `batch` rows of `row_tiles` tiles over a `max_pages`-wide table.

    `num_splits` is `choose_num_splits` (fill the GPU once). It cannot see that one row is long and the
    others short: the engine's ragged step sends every token as a row (T = 1), so a step with 32 decode
    rows at 4K (64 pages) and a 22-token chunk at a 128K prefix (2,048 pages a token) is B >= 54 rows,
    1 split, and each of the chunk's 44 row tiles is one CTA walking 2,048 pages (~2.36 us a page at
    H=128: the kernel's ~500 TFLOP/s over 132 SMs is 3.8 TFLOP/s a CTA, 8.9 MFLOP a page and tile) = 4.8
    ms a layer while the decode rows finish in 64 pages and 88 of 132 SMs idle; the balanced time is
    (44 x 2,048 + 64 x 64) / 132 = 714 pages = 1.7 ms. A static split count large enough for the long
    rows costs every row B x S partials: at the engine's 512-token program that is 64 MiB a split to write
    and merge per layer.

    So long rows get more CTAs, chosen at run time from the lengths (`long_row_windows`): a row is long when
    one of its `num_splits` shares would walk more than LONG_ROW_PAGES (128 pages, ~0.3 ms, 2x a 4K
    decode row's whole walk: steady-state decode never qualifies). The `long_rows` longest long rows share
    a tile's num_sms // tiles CTAs (one wave: 176 CTAs of 512 pages would be two waves, 1,024 pages) in
    proportion to their pages, each at most num_splits + L // m CTAs a tile with L = long_rows x LONG_SPLITS
    long CTAs in all (m rows extended; `long_row_windows`): the base splits take the first num_splits / c
    of a row's pages, its c - num_splits long CTAs the rest; their partials [L, R_pad, 512] are merged into
    the row after the base merge (`merge_long_rows`). At the stall step: 22 long rows x 2 tiles x 3 = 132
    CTAs of 683 pages (1.6 ms) instead of 44 of 2,048 (4.8 ms); 15 rows (the default cap's chunk at 128K): 120
    CTAs of 512; 8 rows: 128 of 256; 1 row: 132 of 31. (Until 2026-12-06 a long row got at most
    LONG_SPLITS long CTAs whatever n: one long row then took 8 CTAs of 512 pages, 1.17 ms a layer on the
    H200 where 132 CTAs of 31 pages need ~0.1: the floor under every small capped chunk, measured by
    `benchmarks/long_context.py --tasks stallparts`.)
    `long_rows` = 2 x num_sms // (tiles x LONG_SPLITS) (44 at H=128, T=1: at most 264 long CTAs, 17 MiB
    of partials); none when a table-wide row's share is at most LONG_ROW_PAGES (short-context engines;
    B=1 decode: 66 splits of 31 pages) or when a row's tiles alone fill the GPU (prefill chunks, T >= ~45
    at H=128). The cost when no row is long (a wide-table engine's decode step): 264 CTAs that exit at
    once, a few small ops building the work list, and the long merge over 44 rows (~28 MiB, ~10 us).
    `num_sms` and `long_pages` are parameters for tests and toy benchmarks."""
    num_splits = choose_num_splits(batch, row_tiles, max_pages, num_sms)
    if pl.cdiv(max_pages, num_splits) <= long_pages:
        return SplitPlan(num_splits, 0, 0, long_pages, num_sms // row_tiles)
    long_rows = min(batch, 2 * num_sms // (row_tiles * LONG_SPLITS))
    return SplitPlan(num_splits, long_rows, LONG_SPLITS if long_rows else 0, long_pages, num_sms // row_tiles)


def row_pages(q_start: jax.Array, kv_len: jax.Array, num_queries: int, max_pages: int) -> jax.Array:
    """[B] pages of each row's last row tile (its widest): what the kernel walks for the row's last query,
    min(cdiv(min(kv_len, q_start + Q), PAGE_SIZE), max_pages)."""
    ends = jnp.minimum(kv_len, q_start + num_queries)
    return jnp.minimum(pl.cdiv(jnp.maximum(ends, 0), PAGE_SIZE), max_pages)


class LongRows(NamedTuple):
    """The run-time part of a `SplitPlan` (`long_row_windows`)."""

    head: jax.Array  # [B] pages [0, head) the row's base splits share (max_pages: all; the row is not long)
    idx: jax.Array  # [long_rows] the long rows, longest first, B in a free slot
    extra: jax.Array  # [long_rows] long CTAs each slot's row uses (0 .. long_rows * long_splits; 0 when free)


def long_row_windows(pages: jax.Array, plan: SplitPlan, max_pages: int) -> LongRows:
    """Which rows are long and how their pages are shared, from each row's pages [B] (`split_plan`).

    The `long_rows` longest long rows are taken (a row is long when a base share walks more than
    `long_pages`). A tile's `fill` CTAs (one wave) are divided among them in proportion to their pages:
    c_i = floor(fill * p_i / P), P the pages of the rows that get more than their `num_splits` base CTAs
    (one refinement: rows too short for a CTA of their own, like decode rows just past 8K beside a 128K
    chunk, keep their base splits and leave the wave to the others). Equal rows get fill // n each, as
    before. Unequal rows got that too until this rule: 32 decode rows at 9K made the 128K chunk's rows
    long rows among 43, one CTA a tile of 2,048 pages each (the 128K stall run's extra ~11 ms a step, found
    2026-12-06). Each row's long CTAs are capped at L // m (L = long_rows * long_splits long items, m rows
    extended), so every row's items fit the list; the base splits take the first num_splits / c_i of the
    row's pages, its c_i - num_splits long CTAs the rest, so its CTAs walk equal shares."""
    bsz = pages.shape[0]
    ns, nl, ks, long_pages, fill = plan
    pages = pages.astype(jnp.int32)
    is_long = pl.cdiv(pages, ns) > long_pages
    # Longest first (stable: equal rows keep their order); rows that are not long sort last.
    # (nl <= B: split_plan's long_rows is at most the batch, attend_items checks it.)
    cand = jnp.argsort(jnp.where(is_long, -pages, 1), stable=True)[:nl].astype(jnp.int32)
    occupied = is_long[cand]
    idx = jnp.where(occupied, cand, bsz)
    p = jnp.where(occupied, pages[cand], 0)  # [nl] each slot's pages
    share = (fill * p) // jnp.maximum(jnp.sum(p), 1)
    big = occupied & (share > ns)
    p_big = jnp.maximum(jnp.sum(jnp.where(big, p, 0)), 1)
    per_row_cap = (nl * ks) // jnp.maximum(jnp.sum(big.astype(jnp.int32)), 1)
    extra = jnp.where(big, jnp.clip((fill * p) // p_big - ns, 0, per_row_cap), 0).astype(jnp.int32)
    row_extra = jnp.zeros((bsz,), jnp.int32).at[idx].set(extra, mode="drop")
    head = jnp.where(row_extra > 0, pl.cdiv(pages * ns, ns + row_extra), max_pages)
    return LongRows(head.astype(jnp.int32), idx.astype(jnp.int32), extra)


def work_items(bsz: int, plan: SplitPlan, max_pages: int, long: LongRows | None = None) -> jax.Array:
    """The kernel's work list [I, 5] int32, I = B * num_splits + long_rows * long_splits: per item (row,
    lo, hi, part, parts): it walks share `part` of `parts` of the pages [lo, hi) of each of the row's tiles
    (clipped to the tile's own pages). Base items first, row-major (item b * S + s, pages [0, head)), then
    the long items: each slot's extra[l] items in a run, one share each of its row's [head, max_pages)
    (`long_item_slots`); an item past the last run walks nothing."""
    ns, nl, ks = plan[:3]
    # Built on the host when static (a literal in the program, no op on the device).
    rows = np.repeat(np.arange(bsz, dtype=np.int32), ns)
    base = np.stack([rows, np.zeros_like(rows), np.full_like(rows, max_pages),
                     np.tile(np.arange(ns, dtype=np.int32), bsz), np.full_like(rows, ns)], axis=1)
    if not nl:
        return jnp.asarray(base)
    head, idx, extra = long
    base = jnp.asarray(base).at[:, 2].set(jnp.repeat(head, ns))
    slot, part, used = long_item_slots(nl * ks, idx, extra, bsz)
    at = jnp.minimum(slot, nl - 1)
    src = jnp.where(used, idx[at], 0)
    lo = jnp.where(used, head[src], 0)
    hi = jnp.where(used, max_pages, 0)
    parts = jnp.maximum(jnp.where(used, extra[at], 1), 1)
    return jnp.concatenate([base, jnp.stack([src, lo, hi, part, parts], axis=1).astype(jnp.int32)])


def long_item_slots(num_long: int, idx: jax.Array, extra: jax.Array, bsz: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For the `num_long` long items: (slot [L], share [L], used [L]): the slots' items lie one after the
    other, extra[l] of them for slot l (extra [nl]); item j serves the slot whose run holds j, as its share
    j - (the items before that slot); used when that slot holds a row (idx < bsz) and j is inside a run.
    The one owner of the item -> slot rule (`work_items` lays the items out by it, `merge_long_rows` merges
    by it); slots are nondecreasing in j and unused items come last."""
    j = jnp.arange(num_long, dtype=jnp.int32)
    nl = idx.shape[0]
    ends = jnp.cumsum(extra.astype(jnp.int32))  # [nl] one past each slot's last item
    slot = jnp.sum((ends[None, :] <= j[:, None]).astype(jnp.int32), axis=1)  # [L] in 0 .. nl
    at = jnp.minimum(slot, nl - 1)
    used = (slot < nl) & (idx[at] < bsz)
    return slot, j - (ends[at] - extra[at]), used


def item_pages(items, tile_pages) -> np.ndarray:
    """Host mirror of the kernel's window arithmetic, for tests and benchmarks: items [I, 5] (`work_items`)
    and each row's pages per tile [B, T] -> [I, T, 2] the (first page, page count) each CTA walks."""
    items, tile_pages = np.asarray(items), np.asarray(tile_pages)
    n = tile_pages[items[:, 0]]  # [I, T]
    lo = np.minimum(items[:, 1:2], n)
    hi = np.minimum(items[:, 2:3], n)
    per = -(-(hi - lo) // items[:, 4:5])
    first = np.minimum(lo + items[:, 3:4] * per, hi)
    return np.stack([first, np.minimum(first + per, hi) - first], axis=-1)


def item_window(items_ref, item, n_blocks) -> tuple[jax.Array, jax.Array]:
    """In a kernel: the (first page, page count) work item `item` walks of a tile with `n_blocks` pages,
    share items[item, 3] of items[item, 4] of the window [items[item, 1], items[item, 2]) clipped to the
    tile (the rule `item_pages` mirrors on the host). Shared by this kernel and `mla_decode_fp8`'s."""
    win_lo = jnp.minimum(items_ref[item, 1], n_blocks)
    win_hi = jnp.minimum(items_ref[item, 2], n_blocks)
    per_split = pl.cdiv(win_hi - win_lo, items_ref[item, 4])
    blk_lo = jnp.minimum(win_lo + items_ref[item, 3] * per_split, win_hi)
    return blk_lo, jnp.minimum(blk_lo + per_split, win_hi) - blk_lo


def write_partials(q_smem, lse_stage, outs, item, num_base: int, row0, half: int) -> None:
    """In a kernel's consumer `half`: copy its column half of the output tile (staged in `q_smem`) and,
    for half 0, the lse (`lse_stage`) to item `item`'s partials: outs = (out, lse) or, with long items,
    (out, lse) of the first `num_base` items then (out, lse) of the rest (see `run_items`). Shared by this
    kernel and `mla_decode_fp8`'s; the caller waits for the copies."""
    def write(out_ref, lse_ref, at):
        # A column half of the tiled tile is not contiguous; each 8-row group of it is (8x64 tiles).
        for r in range(0, BLOCK_ROWS, 8):
            plgpu.copy_smem_to_gmem(
                q_smem.at[pl.ds(r, 8), pl.ds(half * HALF, HALF)],
                out_ref.at[at, pl.ds(row0 + r, 8), pl.ds(half * HALF, HALF)],
            )
        if half == 0:
            plgpu.copy_smem_to_gmem(lse_stage, lse_ref.at[at, pl.ds(row0, BLOCK_ROWS)])

    if len(outs) == 2:
        write(*outs, item)
    else:  # base items and long items go to separate outputs (the base one is merged in place)
        pl.when(item < num_base)(lambda: write(outs[0], outs[1], item))
        pl.when(item >= num_base)(lambda: write(outs[2], outs[3], item - num_base))


def _masked_scores(q_smem, k_smem, slot, key0: int, nkeys: int, page_pos0, limit, scale2):
    """Scaled log2-domain scores of the Q tile against keys key0 .. key0 + nkeys of the page in `slot`
    (wgmma N = nkeys), with positions at or past each row's `limit` [64, nkeys] set to -inf."""
    def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot, pl.ds(key0, nkeys)].T)
        return s_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, nkeys), jnp.float32))
    cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, nkeys), 1, layout=plgpu.Layout.WGMMA)
    pos = page_pos0 + key0 + cols
    return jnp.where(pos < limit, s * scale2, -jnp.inf)


def pv_accumulate(acc, p16, v, p_stage, interpret: bool):
    """acc + P V for P [64, 64] in registers (wgmma A from registers); the interpreter takes A only from
    shared memory, so there P goes through `p_stage` first (see the module docstring). Shared by the MLA
    kernels (`mla_decode_fp8`, the experimental variants), as the constants above are."""
    if interpret:
        p_stage[...] = p16
        plgpu.commit_smem()

        def pv(o_ref):
            plgpu.wgmma(o_ref, p_stage, v)
            return o_ref[...]

        return acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(lambda o_ref: plgpu.wgmma(o_ref, p16, v))(plgpu.ACC.init(acc))


def _kernel(
    q_ref, kv_ref, bt_ref, qstart_ref, kvlen_ref, items_ref,  # inputs (GMEM)
    *outs,  # outputs (GMEM): out, lse of the first `num_base` items (and of the rest, when there are more)
    q_smem, k_smem, p_smem, px_smem, mx_smem, q_bar, k_bars, consumed_bars, done_bar, m_bar, p_bar,
    num_base: int, num_heads: int, num_queries: int, softmax_scale: float, interpret: bool,
):
    item = lax.axis_index("i")
    tile = lax.axis_index("t")
    wg = lax.axis_index("wg")
    b = items_ref[item, 0]  # the work item (`work_items`): row, page window [lo, hi), share part / parts
    row0 = tile * BLOCK_ROWS
    q_start = qstart_ref[b]
    kv_len = kvlen_ref[b]

    # Pages this CTA visits: the tile's last real token bounds the causal range.
    last_tok = jnp.minimum((row0 + BLOCK_ROWS - 1) // num_heads, num_queries - 1)
    tile_end = jnp.minimum(kv_len, q_start + 1 + last_tok)
    # Positions past the block table's capacity do not exist (as in the reference): reads stay in the table.
    n_blocks = jnp.minimum(pl.cdiv(tile_end, PAGE_SIZE), bt_ref.shape[1])
    blk_lo, n_steps = item_window(items_ref, item, n_blocks)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, BLOCK_ROWS)], q_smem, q_bar.at[0])

        @pl.loop(0, n_steps)
        def _load(i):
            slot = lax.rem(i, NUM_SLOTS)

            @pl.when(i >= NUM_SLOTS)
            def _():
                plgpu.barrier_wait(consumed_bars.at[slot])

            page = clamp_page_ids(bt_ref[b, blk_lo + i], kv_ref.shape[0])
            plgpu.copy_gmem_to_smem(kv_ref.at[page], k_smem.at[slot], k_bars.at[slot])

        # Observe the consumers' release of the last (up to) NUM_SLOTS pages too: every phase a thread has
        # waited on a barrier for must be observed before the barrier is freed (Pallas' GPU interpreter
        # rejects the kernel otherwise once a split has more pages than slots). The producer is idle here
        # and at most one phase behind on each slot, so this costs the consumers nothing.
        for back in range(NUM_SLOTS, 0, -1):
            @pl.when(n_steps >= back)
            def _(back=back):  # (called at once by pl.when)
                plgpu.barrier_wait(consumed_bars.at[lax.rem(n_steps - back, NUM_SLOTS)])

    def consumer(half: int):
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(q_bar.at[0])
        scale2 = softmax_scale * LOG2E
        other = 1 - half

        rows = row0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, HALF_PAGE), 0, layout=plgpu.Layout.WGMMA)
        limit = jnp.minimum(q_start + 1 + rows // num_heads, kv_len)

        p_stage = p_smem.at[half] if interpret else None

        def step(i, carry):
            # l_i sums only this consumer's P half (the halves are added once, after the loop); m_i is the
            # shared row maximum.
            acc, m_i, l_i = carry
            # Page i: this consumer's keys [32 * half, 32 * half + 32).
            slot = lax.rem(i, NUM_SLOTS)
            plgpu.barrier_wait(k_bars.at[slot])
            s = _masked_scores(q_smem, k_smem, slot, half * HALF_PAGE, HALF_PAGE, (blk_lo + i) * PAGE_SIZE,
                               limit, scale2)
            m_own = jnp.maximum(m_i, s.max(axis=1))
            mx_smem.at[half][...] = m_own
            plgpu.barrier_arrive(m_bar)
            plgpu.barrier_wait(m_bar)
            m_new = jnp.maximum(m_own, plgpu.load(mx_smem.at[other], layout=ROW_LAYOUT))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(k_smem.dtype)
            px_smem.at[half][...] = p16
            plgpu.barrier_arrive(p_bar)
            plgpu.barrier_wait(p_bar)
            p_other = plgpu.load(px_smem.at[other], layout=plgpu.Layout.WGMMA)
            # P V on this consumer's half of V with the full P [64, 64] made of the two consumers' halves.
            p_full = jnp.concatenate([p16, p_other] if half == 0 else [p_other, p16], axis=1)
            acc = pv_accumulate(acc, p_full, k_smem.at[slot, :, pl.ds(half * HALF, HALF)], p_stage, interpret)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, HALF), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), M_INIT, jnp.float32), ROW_LAYOUT)
        l_i = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS,), jnp.float32), ROW_LAYOUT)
        acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))

        # The row sum is the two consumers' halves; they meet at done_bar anyway.
        mx_smem.at[half][...] = l_i
        # Both consumers must be done reading the Q tile before it is reused to stage the output.
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)
        l_i = l_i + plgpu.load(mx_smem.at[other], layout=ROW_LAYOUT)
        # Consumer 0 stages the lse in row 1, which it has read already; consumer 1 now reads only row 0.
        lse_stage = mx_smem.at[1]
        empty = l_i == 0.0
        l_safe = jnp.where(empty, 1.0, l_i)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        out_smem = q_smem.at[:, pl.ds(half * HALF, HALF)]
        out_smem[...] = out.astype(q_smem.dtype)
        if half == 0:
            lse_stage[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
        plgpu.commit_smem()

        write_partials(q_smem, lse_stage, outs, item, num_base, row0, half)
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 0)(functools.partial(consumer, 0))
    pl.when(wg == 1)(functools.partial(consumer, 1))


def query_tiles(q_latent: jax.Array, q_rope: jax.Array) -> jax.Array:
    """[B, Q, H, 512] ++ [B, Q, H, 64] -> [B, R_pad, 576] rows (token, head), zero rows up to a multiple
    of BLOCK_ROWS. Written as two pads and a select so XLA makes it one fusion (a concatenate and a
    pad are two ops at small batch)."""
    bsz, nq, nh, _ = q_latent.shape
    rows = nq * nh
    pad_rows = pl.cdiv(rows, BLOCK_ROWS) * BLOCK_ROWS - rows
    zero = jnp.zeros((), q_latent.dtype)
    lat = lax.pad(q_latent.reshape(bsz, rows, LATENT_DIM), zero,
                  ((0, 0, 0), (0, pad_rows, 0), (0, KV_DIM - LATENT_DIM, 0)))
    rope = lax.pad(q_rope.reshape(bsz, rows, KV_DIM - LATENT_DIM).astype(q_latent.dtype), zero,
                   ((0, 0, 0), (0, pad_rows, 0), (LATENT_DIM, 0, 0)))
    col = lax.broadcasted_iota(jnp.int32, lat.shape, 2)
    return jnp.where(col < LATENT_DIM, lat, rope)


def split_partials(out_parts: jax.Array, lse_parts: jax.Array, num_queries: int, num_heads: int,
                   valid_queries: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """What a split merge starts from: the real rows of the partials as out [B, S, Q, H, 512] and
    lse [B, S, Q, H], padding queries (j >= valid_queries[b]) set to out 0 / lse -inf in every split."""
    bsz, ns = out_parts.shape[:2]
    rows = num_queries * num_heads
    out = out_parts[:, :, :rows].reshape(bsz, ns, num_queries, num_heads, LATENT_DIM)
    lse = lse_parts[:, :, :rows].reshape(bsz, ns, num_queries, num_heads)
    if valid_queries is not None:
        valid = jnp.arange(num_queries)[None, :] < valid_queries[:, None]  # [B, Q]
        lse = jnp.where(valid[:, None, :, None], lse, -jnp.inf)
        out = jnp.where(valid[:, None, :, None, None], out, jnp.zeros((), out.dtype))
    return out, lse


def merge_partials(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge over axis 1 of normalized partials out [N, S, ..., D] / lse [N, S, ...] (empty
    partials: lse -inf) -> out [N, ..., D] float32, lse [N, ...] float32 (D = 512 here; any width: the
    long-prefill path, dsv3_jax/model/long_prefill.py, merges its blocks with it too). Two plain passes:
    m = max lse, w = exp(lse - m), out = sum(w out) / sum(w), lse = m + log(sum w); rows empty in every
    split give (out 0, lse -inf), not NaN."""
    m = jnp.max(lse, axis=1)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - jnp.expand_dims(m, 1))  # 0 for an empty split
    total = jnp.sum(w, axis=1)
    merged = jnp.sum(w[..., None] * out.astype(jnp.float32), axis=1)
    safe = jnp.where(total > 0, total, 1.0)
    return merged / safe[..., None], jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)


def merge_splits(out_parts: jax.Array, lse_parts: jax.Array, num_queries: int, num_heads: int,
                 valid_queries: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Kernel partials out [B, S, R_pad, 512] / lse [B, S, R_pad] -> out [B, Q, H, 512] (partials' dtype)
    and lse [B, Q, H] float32: drops the padding rows, merges the S splits in fp32 (`merge_partials`) and,
    when `valid_queries` [B] is given, zeroes (lse -inf) queries j >= valid_queries[b] (a chunk's padding).

    Plain max and add reductions over S. The earlier single variadic reduce (reducer = the pairwise
    log-sum-exp merge; now `experimental.mla_variants.merge_splits_one_reduce`) was one launch but slow by
    GPU time on the H200: 27-29 us at B=1, H=128, 32 splits (2.7x the kernel) against 7.3 us for this
    form, with equal results (benchmarks/RESULTS.md, round four; `tests/test_mla_kernels.py` holds it to a
    numpy merge and to the old form)."""
    out, lse = split_partials(out_parts, lse_parts, num_queries, num_heads, valid_queries)
    if out.shape[1] == 1:
        return out[:, 0], lse[:, 0]
    out_m, lse_m = merge_partials(out, lse)
    return out_m.astype(out_parts.dtype), lse_m


def run_items(q_latent: jax.Array, q_rope: jax.Array, kv_pages: jax.Array, block_table: jax.Array,
              q_start: jax.Array, kv_len: jax.Array, items: jax.Array, *, softmax_scale: float,
              interpret: bool, num_base: int | None = None) -> tuple[jax.Array, ...]:
    """Runs the kernel over the work list `items` [I, 5] (`work_items`); returns one partial per item,
    out [I, R_pad, 512] and lse [I, R_pad], rows R = Q * H padded to a multiple of 64 (every element is
    written, padding rows and empty items included: an empty share gives out 0, lse -inf). With
    `num_base` < I: (out, lse) of the first num_base items and (out, lse) of the rest, four arrays (so the
    base partials are a whole buffer that a merge may update in place, not a slice)."""
    bsz, nq, nh, _ = q_latent.shape
    num_items = items.shape[0]
    num_base = num_items if num_base is None else num_base
    row_tiles = pl.cdiv(nq * nh, BLOCK_ROWS)
    q = query_tiles(q_latent, q_rope)

    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    dtype = q.dtype
    # Allocated in this order (it sets the shared-memory layout).
    scratch = dict(
        q_smem=plgpu.SMEM((BLOCK_ROWS, KV_DIM), dtype, transforms=(tiling, swizzle)),
        k_smem=plgpu.SMEM((NUM_SLOTS, PAGE_SIZE, KV_DIM), dtype, transforms=(tiling, swizzle)),
        # Only interpret mode stages the full P tile through shared memory (see the module docstring).
        p_smem=(
            plgpu.SMEM((2, BLOCK_ROWS, PAGE_SIZE), dtype, transforms=(tiling, swizzle)) if interpret else None
        ),
        # The consumers' exchange: each one's P half [64, 32] and its row maxima (then row sums, then the
        # lse); the P halves come first so that they sit 1 KiB-aligned like every swizzled buffer.
        px_smem=plgpu.SMEM((2, BLOCK_ROWS, HALF_PAGE), dtype,
                           transforms=(plgpu.TilingTransform((8, HALF_PAGE)), plgpu.SwizzleTransform(64))),
        mx_smem=plgpu.SMEM((2, BLOCK_ROWS), jnp.float32),
        q_bar=plgpu.Barrier(num_barriers=1),
        k_bars=plgpu.Barrier(num_barriers=NUM_SLOTS),
        consumed_bars=plgpu.Barrier(num_arrivals=2, num_barriers=NUM_SLOTS),
        done_bar=plgpu.Barrier(num_arrivals=2),
        m_bar=plgpu.Barrier(num_arrivals=2),  # both consumers meet at each
        p_bar=plgpu.Barrier(num_arrivals=2),
    )
    body = functools.partial(
        _kernel, num_base=num_base, num_heads=nh, num_queries=nq,
        softmax_scale=float(softmax_scale), interpret=bool(interpret),
    )
    return launch_items(body, scratch, num_items, num_base, row_tiles, dtype, interpret)(
        q, kv_pages, block_table.astype(jnp.int32), q_start.astype(jnp.int32), kv_len.astype(jnp.int32),
        items.astype(jnp.int32))


def launch_items(body: Callable[..., None], scratch: dict, num_items: int, num_base: int, row_tiles: int,
                 dtype: jnp.dtype, interpret: bool) -> Callable[..., tuple[jax.Array, ...]]:
    """The MLA kernels' launch, shared by this kernel and the FP8-page ones: a grid of (work item, row
    tile) CTAs of three warpgroups, `body(*gmem_refs, **scratch_refs)` with the `scratch` buffers and
    barriers (None entries are not allocated and reach `body` as None) allocated in dict order (it sets
    the shared-memory layout), and the partial outputs as `run_items` returns them (out [I, R_pad, 512] in
    `dtype`, lse [I, R_pad] f32; split in two pairs at `num_base`). Returns the callable on the inputs."""
    names = [k for k, v in scratch.items() if v is not None]

    def entry(*refs):
        def scoped(*allocs):
            body(*refs, **(dict.fromkeys(scratch) | dict(zip(names, allocs))))

        pl.run_scoped(scoped, *(scratch[k] for k in names), collective_axes="wg")

    rows = row_tiles * BLOCK_ROWS
    out_type = [jax.ShapeDtypeStruct((num_base, rows, LATENT_DIM), dtype),
                jax.ShapeDtypeStruct((num_base, rows), jnp.float32)]
    if num_base < num_items:
        out_type += [jax.ShapeDtypeStruct((num_items - num_base, rows, LATENT_DIM), dtype),
                     jax.ShapeDtypeStruct((num_items - num_base, rows), jnp.float32)]
    return plgpu.kernel(
        entry,
        out_type=tuple(out_type),
        grid=(num_items, row_tiles),
        grid_names=("i", "t"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES),
        # Interpret mode fills outputs and scratch with NaN first, so an unwritten element shows up.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )


def _check_splits(num_splits) -> None:
    if num_splits is not None and (not isinstance(num_splits, numbers.Integral) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None (automatic), got {num_splits!r}")


def paged_mla_partials(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_table: jax.Array,
    q_start: jax.Array,
    kv_len: jax.Array,
    *,
    softmax_scale: float,
    num_splits: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs the kernel with every row tile's pages in `num_splits` equal shares (None: `choose_num_splits`;
    no long-row splits); returns the raw split partials out [B, S, R_pad, 512] and lse [B, S, R_pad] with
    rows R = Q * H padded to a multiple of 64 (every element is written, padding rows included)."""
    interpret = resolve_interpret(interpret)
    bsz, nq, nh, _ = q_latent.shape
    check_kernel_args(q_latent, q_rope, kv_pages, block_table, q_start=q_start, kv_len=kv_len)
    _check_splits(num_splits)
    row_tiles = pl.cdiv(nq * nh, BLOCK_ROWS)
    if num_splits is None:
        num_splits = choose_num_splits(bsz, row_tiles, block_table.shape[1])
    items = work_items(bsz, SplitPlan(num_splits, 0, 0), block_table.shape[1])
    out, lse = run_items(q_latent, q_rope, kv_pages, block_table, q_start, kv_len, items,
                         softmax_scale=softmax_scale, interpret=interpret)
    return out.reshape(bsz, num_splits, *out.shape[1:]), lse.reshape(bsz, num_splits, -1)


def paged_mla_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_table: jax.Array,
    q_start: jax.Array,
    kv_len: jax.Array,
    *,
    softmax_scale: float,
    num_splits: int | None = None,
    interpret: bool | None = None,
    valid_queries: jax.Array | None = None,
    plan: SplitPlan | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Kernel core shared by decode and prefill; q_* are [B, Q, H, D]; semantics of
    `mla_reference.paged_attention_reference`. Returns out [B, Q, H, 512] and lse [B, Q, H].
    `valid_queries` [B]: queries j >= valid_queries[b] are padding (out 0, lse -inf; see `merge_splits`).
    Splits: `num_splits` given = that many equal shares for every row (no long-row splits); otherwise
    `plan` or, by default, `split_plan` (long rows get more CTAs; see there)."""
    interpret = resolve_interpret(interpret)
    check_kernel_args(q_latent, q_rope, kv_pages, block_table, q_start=q_start, kv_len=kv_len)

    def run(items, num_base):
        return run_items(q_latent, q_rope, kv_pages, block_table, q_start, kv_len, items,
                         softmax_scale=softmax_scale, interpret=interpret, num_base=num_base)

    return attend_items(run, q_latent, block_table, q_start, kv_len, num_splits=num_splits,
                        valid_queries=valid_queries, plan=plan)


def attend_items(run, q_latent: jax.Array, block_table: jax.Array, q_start: jax.Array, kv_len: jax.Array, *,
                 num_splits: int | None, valid_queries: jax.Array | None, plan: SplitPlan | None
                 ) -> tuple[jax.Array, jax.Array]:
    """The split plan, work list and merges around one kernel run, shared by the bf16-page kernel
    (`paged_mla_attention`) and the FP8-page one (`mla_decode_fp8`): `run(items, num_base)` runs a kernel
    over the work list and returns its partials as `run_items` does. Returns out [B, Q, H, 512], lse."""
    _check_splits(num_splits)
    bsz, nq, nh, _ = q_latent.shape
    width = block_table.shape[1]
    row_tiles = pl.cdiv(nq * nh, BLOCK_ROWS)
    if num_splits is not None:
        plan = SplitPlan(num_splits, 0, 0)
    elif plan is None:
        plan = split_plan(bsz, row_tiles, width)
    ns, nl, ks = plan[:3]
    if ns < 1 or nl < 0 or (nl and ks < 1) or nl > bsz:
        raise ValueError(f"bad split plan {plan} for {bsz} rows")
    q_start, kv_len = q_start.astype(jnp.int32), kv_len.astype(jnp.int32)
    long = long_row_windows(row_pages(q_start, kv_len, nq, width), plan, width) if nl else None
    items = work_items(bsz, plan, width, long)
    out_p, lse_p, *long_p = run(items, bsz * ns)
    base_o = out_p.reshape(bsz, ns, *out_p.shape[1:])
    base_l = lse_p.reshape(bsz, ns, -1)
    if not nl:
        return merge_splits(base_o, base_l, nq, nh, valid_queries)
    long_o, long_l = long_p
    merged_o, merged_l = merge_long_rows(base_o, base_l, long_o, long_l, long.idx, long.extra)
    return merge_splits(merged_o[:, None], merged_l[:, None], nq, nh, valid_queries)


def merge_long_rows(base_out: jax.Array, base_lse: jax.Array, long_out: jax.Array, long_lse: jax.Array,
                    long_idx: jax.Array, extra: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Base partials [B, S, R_pad, 512] / [B, S, R_pad] and the long items' partials [L, R_pad, 512] /
    [L, R_pad] (item j serves the long slot `long_item_slots` gives; slot l belongs to row long_idx[l],
    B = free) -> out [B, R_pad, 512] (partials' dtype), lse [B, R_pad]: the base splits merged, then each
    long row's merged base and its long partials merged again (log-sum-exp as `merge_partials`, the long
    partials summed per slot by segment sums since `extra` is known only at run time), written back to
    its row (a gather and a scatter of the slots' rows; no other row is touched)."""
    bsz = base_out.shape[0]
    nl = long_idx.shape[0]
    dtype = base_out.dtype
    if base_out.shape[1] == 1:
        out, lse = base_out[:, 0], base_lse[:, 0]
    else:
        out, lse = merge_partials(base_out, base_lse)
        out = out.astype(dtype)
    slot, _, used = long_item_slots(long_out.shape[0], long_idx, extra, bsz)
    seg = jnp.where(used, slot, nl)  # unused items go to a dropped segment
    long_lse = jnp.where(used[:, None], long_lse, -jnp.inf)
    src = jnp.minimum(long_idx, bsz - 1)
    base_l = lse[src]  # [nl, R]
    m = jnp.maximum(base_l, jax.ops.segment_max(long_lse, seg, num_segments=nl + 1,
                                                indices_are_sorted=True)[:nl])
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w_base = jnp.exp(base_l - m)
    w_long = jnp.exp(long_lse - jnp.concatenate([m, jnp.zeros_like(m[:1])])[seg])  # 0 where unused
    def per_slot(x):  # sum over each slot's long items (seg is sorted: the used slots come first)
        return jax.ops.segment_sum(x, seg, num_segments=nl + 1, indices_are_sorted=True)[:nl]

    total = w_base + per_slot(w_long)
    acc = w_base[..., None] * out[src].astype(jnp.float32)
    acc = acc + per_slot(w_long[..., None] * long_out.astype(jnp.float32))
    safe = jnp.where(total > 0, total, 1.0)
    m_o = acc / safe[..., None]
    m_l = jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)
    out = out.at[long_idx].set(m_o.astype(dtype), mode="drop")
    lse = lse.at[long_idx].set(m_l, mode="drop")
    return out, lse


@functools.partial(jax.jit, static_argnames=("softmax_scale", "num_splits", "interpret"))
def mla_decode(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    softmax_scale: float,
    interpret: bool | None = None,
    num_splits: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode over a paged latent cache (Pallas Mosaic GPU).

    Same contract as `mla_reference.mla_decode_reference`: q_latent [B, H, 512] or [B, Q, H, 512] (Q
    newest tokens, causal among themselves), q_rope [..., 64], kv_pages [num_pages, 64, 576],
    block_table [B, max_pages] int32, seq_lens [B] int32 (>= Q, counting the Q new tokens).
    Returns out shaped like q_latent in q's dtype and lse [B, (Q,) H] float32 (natural log).
    `num_splits` overrides the split-KV heuristic; `interpret=True` runs Pallas' GPU interpreter,
    `None` (default) does so whenever the default backend is not a GPU.
    With splits > 1 the partial outputs are kept in q's dtype before the fp32 combine.
    """
    q_latent, q_rope, squeeze = as_4d(q_latent, q_rope)
    check_cache_args(kv_pages, block_table, q_latent.shape[0], seq_lens=seq_lens)
    seq_lens = seq_lens.astype(jnp.int32)
    out, lse = paged_mla_attention(
        q_latent, q_rope, kv_pages, block_table, seq_lens - q_latent.shape[1], seq_lens,
        softmax_scale=softmax_scale, num_splits=num_splits, interpret=interpret,
    )
    if squeeze:
        out, lse = out[:, 0], lse[:, 0]
    return out, lse
