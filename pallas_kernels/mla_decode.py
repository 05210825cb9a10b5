"""Pallas Mosaic GPU kernel: absorbed MLA attention over a paged latent cache (decode, MTP verify).

Owns `mla_decode` and the paged-attention kernel core that `mla_prefill.py` reuses, with the XLA ops
around it (`query_tiles` before, `merge_splits` after). Semantics are those of `mla_reference.py` (read
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
- Split-KV: the grid is (batch, row tile, split); split s takes an equal share of the tile's pages.
  Partial outputs and their log-sum-exp are merged by `merge_splits` (plain max and add reductions over
  the splits: ~4x faster by GPU time than the single variadic reduce it replaced).
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

import jax
import jax.numpy as jnp
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
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30  # finite so that rows with nothing to attend to in a split give 0, not NaN
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
# The row reductions stay inside a warp (wgmma layout, axis 1), so Mosaic's cross-warp reduction scratch
# (default 2 KiB, reserved whether used or not) is cut to 1 KiB: the room for the exchange buffers.
REDUCTION_SCRATCH_BYTES = 1024


def choose_num_splits(batch: int, row_tiles: int, max_pages: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Splits of the KV length so that batch * tiles * splits roughly fills the GPU once."""
    programs = batch * row_tiles
    return max(1, min(num_sms // max(programs, 1), pl.cdiv(max_pages, 2)))


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


def _pv(acc, p16, v, p_stage, interpret: bool):
    """acc + P V for P [64, 64] in registers (wgmma A from registers); the interpreter takes A only from
    shared memory, so there P goes through `p_stage` first (see the module docstring)."""
    if interpret:
        p_stage[...] = p16
        plgpu.commit_smem()

        def pv(o_ref):
            plgpu.wgmma(o_ref, p_stage, v)
            return o_ref[...]

        return acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(lambda o_ref: plgpu.wgmma(o_ref, p16, v))(plgpu.ACC.init(acc))


def _kernel(
    q_ref, kv_ref, bt_ref, qstart_ref, kvlen_ref,  # inputs (GMEM)
    out_ref, lse_ref,  # outputs (GMEM)
    q_smem, k_smem, p_smem, px_smem, mx_smem, q_bar, k_bars, consumed_bars, done_bar, m_bar, p_bar,
    *, num_heads: int, num_queries: int, num_splits: int, softmax_scale: float, interpret: bool,
):
    b = lax.axis_index("b")
    tile = lax.axis_index("t")
    split = lax.axis_index("s")
    wg = lax.axis_index("wg")
    row0 = tile * BLOCK_ROWS
    q_start = qstart_ref[b]
    kv_len = kvlen_ref[b]

    # Pages this CTA visits: the tile's last real token bounds the causal range.
    last_tok = jnp.minimum((row0 + BLOCK_ROWS - 1) // num_heads, num_queries - 1)
    tile_end = jnp.minimum(kv_len, q_start + 1 + last_tok)
    # Positions past the block table's capacity do not exist (as in the reference): reads stay in the table.
    n_blocks = jnp.minimum(pl.cdiv(tile_end, PAGE_SIZE), bt_ref.shape[1])
    per_split = pl.cdiv(n_blocks, num_splits)
    blk_lo = jnp.minimum(split * per_split, n_blocks)
    n_steps = jnp.minimum(blk_lo + per_split, n_blocks) - blk_lo

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
        scale2 = softmax_scale * _LOG2E
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
            m_new = jnp.maximum(m_own, plgpu.load(mx_smem.at[other], layout=_ROW_LAYOUT))
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
            acc = _pv(acc, p_full, k_smem.at[slot, :, pl.ds(half * HALF, HALF)], p_stage, interpret)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, HALF), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), _M_INIT, jnp.float32), _ROW_LAYOUT)
        l_i = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS,), jnp.float32), _ROW_LAYOUT)
        acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))

        # The row sum is the two consumers' halves; they meet at done_bar anyway.
        mx_smem.at[half][...] = l_i
        # Both consumers must be done reading the Q tile before it is reused to stage the output.
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)
        l_i = l_i + plgpu.load(mx_smem.at[other], layout=_ROW_LAYOUT)
        # Consumer 0 stages the lse in row 1, which it has read already; consumer 1 now reads only row 0.
        lse_stage = mx_smem.at[1]
        empty = l_i == 0.0
        l_safe = jnp.where(empty, 1.0, l_i)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        out_smem = q_smem.at[:, pl.ds(half * HALF, HALF)]
        out_smem[...] = out.astype(q_smem.dtype)
        if half == 0:
            lse_stage[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * _LN2)
        plgpu.commit_smem()
        # A column half of the tiled tile is not contiguous; each 8-row group of it is (8x64 tiles).
        for r in range(0, BLOCK_ROWS, 8):
            plgpu.copy_smem_to_gmem(
                q_smem.at[pl.ds(r, 8), pl.ds(half * HALF, HALF)],
                out_ref.at[b, split, pl.ds(row0 + r, 8), pl.ds(half * HALF, HALF)],
            )
        if half == 0:
            plgpu.copy_smem_to_gmem(lse_stage, lse_ref.at[b, split, pl.ds(row0, BLOCK_ROWS)])
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
    """Log-sum-exp merge over axis 1 of normalized partials out [N, S, ..., 512] / lse [N, S, ...] (empty
    partials: lse -inf) -> out [N, ..., 512] float32, lse [N, ...] float32. Two plain passes: m = max lse,
    w = exp(lse - m), out = sum(w out) / sum(w), lse = m + log(sum w); rows empty in every split give
    (out 0, lse -inf), not NaN."""
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
    """Runs the kernel; returns the raw split partials out [B, S, R_pad, 512] and lse [B, S, R_pad] with
    rows R = Q * H padded to a multiple of 64 (every element is written, padding rows included)."""
    interpret = resolve_interpret(interpret)
    bsz, nq, nh, _ = q_latent.shape
    check_kernel_args(q_latent, q_rope, kv_pages, block_table, q_start=q_start, kv_len=kv_len)
    if num_splits is not None and (not isinstance(num_splits, numbers.Integral) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None (automatic), got {num_splits!r}")
    row_tiles = pl.cdiv(nq * nh, BLOCK_ROWS)
    if num_splits is None:
        num_splits = choose_num_splits(bsz, row_tiles, block_table.shape[1])
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
        _kernel, num_heads=nh, num_queries=nq, num_splits=num_splits,
        softmax_scale=float(softmax_scale), interpret=bool(interpret),
    )

    names = [k for k, v in scratch.items() if v is not None]

    def entry(*refs):
        def scoped(*allocs):
            bufs = dict.fromkeys(scratch) | dict(zip(names, allocs))
            body(*refs, **bufs)

        pl.run_scoped(scoped, *(scratch[k] for k in names), collective_axes="wg")

    out_parts, lse_parts = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((bsz, num_splits, row_tiles * BLOCK_ROWS, LATENT_DIM), dtype),
            jax.ShapeDtypeStruct((bsz, num_splits, row_tiles * BLOCK_ROWS), jnp.float32),
        ),
        grid=(bsz, row_tiles, num_splits),
        grid_names=("b", "t", "s"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES),
        # Interpret mode fills outputs and scratch with NaN first, so an unwritten element shows up.
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,
    )(q, kv_pages, block_table.astype(jnp.int32), q_start.astype(jnp.int32), kv_len.astype(jnp.int32))
    return out_parts, lse_parts


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
) -> tuple[jax.Array, jax.Array]:
    """Kernel core shared by decode and prefill; q_* are [B, Q, H, D]; semantics of
    `mla_reference.paged_attention_reference`. Returns out [B, Q, H, 512] and lse [B, Q, H].
    `valid_queries` [B]: queries j >= valid_queries[b] are padding (out 0, lse -inf; see `merge_splits`)."""
    _, nq, nh, _ = q_latent.shape
    out_parts, lse_parts = paged_mla_partials(
        q_latent, q_rope, kv_pages, block_table, q_start, kv_len,
        softmax_scale=softmax_scale, num_splits=num_splits, interpret=interpret,
    )
    return merge_splits(out_parts, lse_parts, nq, nh, valid_queries)


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
