"""Pallas Mosaic GPU kernel: absorbed MLA attention over the FP8 latent cache (`mla_common.Fp8Pages`).

Owns `paged_mla_fp8_partials` / `paged_mla_fp8_attention`, the FP8-page twin of `mla_decode.py`'s kernel
core (decode, MTP verify and prefill chunks all go through it: `mla_prefill.mla_chunk_attention` routes
`Fp8Pages` here). Semantics are `mla_reference.paged_attention_reference` on the dequantized pages (the
FP8 format is `mla_common`'s docstring); the row tiling, the work list of split-KV items (long rows shared
by more CTAs: `split_plan`, `work_items`), `query_tiles` and the merges (`attend_items`) are
`mla_decode`'s, imported, not copied.

Kernel design (Hopper, one CTA = three warpgroups; read `mla_decode`'s docstring first, this is its v2 with
a dequantizing stage):
- Warpgroup 2 (producer) TMA-loads per 64-token page the e4m3 latent [64, 512] ((8, 128) tiles, 128-B
  swizzle) and its scales [4, 64] f32 into a two-slot ring (`k_bars[slot]`, two copies per phase), and
  the bf16 rope [64, 64] into ONE rope buffer (`rope_bar`). A latent slot is reused after both consumers
  dequantized it (`consumed_bars`); the rope buffer after both finished scoring (`rope_free`).
- Consumers 0 and 1 each dequantize one column half of the page (latent blocks 2c, 2c + 1 for all 64
  tokens: a WGMMA-layout load of [64, 128] e4m3 times its scale row, which is a per-row vector there)
  into ONE bf16 buffer `kv_smem` [64, 512], fence it for the async proxy (`commit_smem`) and arrive at
  `deq_bar`. Consumer c's column half is exactly the V half its P V reads, so the single buffer needs no
  further barrier: before c overwrites its half with page i + 1 it has finished its own P V of page i,
  and the other consumer has finished its scores of page i (it passed page i's `m_bar`, as c did).
- Then as v2: consumer c scores keys [32c, 32c + 32), three asynchronous wgmmas into one accumulator:
  its own latent half (K=256), the rope (K=64, after `rope_bar`), the other half (K=256, after waiting at
  `deq_bar`, so that wait overlaps the first two products); it exchanges row maxima (`m_bar`) and bf16
  P halves (`p_bar`), and accumulates its 256 output columns with P [64, 64] against its half of
  `kv_smem`.
- Shared memory (bytes): Q 73,728 + e4m3 latent 2 x 32,768 + scales 2 x 1,024 + rope 8,192 + bf16
  latent 65,536 + P halves 8,192 + maxima 512 + reduction scratch 1,024 = 224,768 (`smem_bytes()`);
  Mosaic's total with the 11 barriers and alignment is 225,368 of the 232,448 allowed (measured by the
  CPU lowering test). A second rope slot (+8,192) does not fit; hence one, whose load for page i + 1
  overlaps page i's softmax, P V and the next dequantization.
- Dequantization loads whole 128-column blocks: a 64-column slice of the (8, 128)-tiled e4m3 buffer is
  refused by Pallas (slices must be whole tiles).

Interpret mode (CPU tests): as `mla_decode` (P staged through shared memory for the P V wgmma).
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
    FP8_BLOCK,
    LATENT_DIM,
    PAGE_SIZE,
    ROPE_DIM,
    Fp8Pages,
    check_kernel_args,
    clamp_page_ids,
)
from pallas_kernels.mla_decode import (
    BLOCK_ROWS,
    HALF,
    HALF_PAGE,
    LN2,
    LOG2E,
    M_INIT,
    NUM_SLOTS,
    REDUCTION_SCRATCH_BYTES,
    ROW_LAYOUT,
    SplitPlan,
    attend_items,
    choose_num_splits,
    item_window,
    launch_items,
    pv_accumulate,
    query_tiles,
    work_items,
    write_partials,
)

NUM_BLOCKS = LATENT_DIM // FP8_BLOCK  # scales per token (4)
BLOCKS_PER_HALF = NUM_BLOCKS // 2  # latent blocks each consumer dequantizes (and reads as V)


def _scratch(interpret: bool) -> dict:
    """Shared-memory buffers and barriers, in allocation order (it sets the layout; swizzled buffers
    first so each sits 1 KiB-aligned)."""
    sw = plgpu.SwizzleTransform(128)
    t64 = plgpu.TilingTransform((8, 64))
    bf16 = jnp.bfloat16
    return dict(
        q_smem=plgpu.SMEM((BLOCK_ROWS, LATENT_DIM + ROPE_DIM), bf16, transforms=(t64, sw)),
        lat_smem=plgpu.SMEM((NUM_SLOTS, PAGE_SIZE, LATENT_DIM), jnp.float8_e4m3fn,
                            transforms=(plgpu.TilingTransform((8, 128)), sw)),
        kv_smem=plgpu.SMEM((PAGE_SIZE, LATENT_DIM), bf16, transforms=(t64, sw)),
        rope_smem=plgpu.SMEM((PAGE_SIZE, ROPE_DIM), bf16, transforms=(t64, sw)),
        p_smem=plgpu.SMEM((2, BLOCK_ROWS, PAGE_SIZE), bf16, transforms=(t64, sw)) if interpret else None,
        px_smem=plgpu.SMEM((2, BLOCK_ROWS, HALF_PAGE), bf16,
                           transforms=(plgpu.TilingTransform((8, HALF_PAGE)), plgpu.SwizzleTransform(64))),
        sc_smem=plgpu.SMEM((NUM_SLOTS, NUM_BLOCKS, PAGE_SIZE), jnp.float32),
        mx_smem=plgpu.SMEM((2, BLOCK_ROWS), jnp.float32),
        q_bar=plgpu.Barrier(num_barriers=1),
        k_bars=plgpu.Barrier(num_arrivals=2, num_barriers=NUM_SLOTS),  # latent + scale copies
        rope_bar=plgpu.Barrier(num_barriers=1),
        consumed_bars=plgpu.Barrier(num_arrivals=2, num_barriers=NUM_SLOTS),
        rope_free=plgpu.Barrier(num_arrivals=2),
        deq_bar=plgpu.Barrier(num_arrivals=2),
        done_bar=plgpu.Barrier(num_arrivals=2),
        m_bar=plgpu.Barrier(num_arrivals=2),
        p_bar=plgpu.Barrier(num_arrivals=2),
    )


def smem_bytes(interpret: bool = False) -> int:
    """Bytes of shared-memory buffers (barriers excluded) plus Mosaic's reduction scratch: the module
    docstring's budget, held by tests against the 232,448 a Hopper block may have."""
    bufs = [v for v in _scratch(interpret).values() if v is not None and not isinstance(v, plgpu.Barrier)]
    return REDUCTION_SCRATCH_BYTES + sum(jnp.dtype(v.dtype).itemsize * math.prod(v.shape) for v in bufs)


def _dequantize_half(lat, sc, kv, half: int) -> None:
    """Consumer `half`'s column half (its V half) of one page: kv[:, blocks] = bf16(f32(lat) * scale) for
    latent blocks 2 half, 2 half + 1 (lat [64, 512] e4m3, sc [4, 64] f32 of one ring slot)."""
    for j in range(half * BLOCKS_PER_HALF, (half + 1) * BLOCKS_PER_HALF):
        x = plgpu.load(lat.at[:, pl.ds(FP8_BLOCK * j, FP8_BLOCK)], layout=plgpu.Layout.WGMMA, optimized=False)
        s = plgpu.load(sc.at[j], layout=ROW_LAYOUT)
        x = x.astype(jnp.float32) * lax.broadcast_in_dim(s, x.shape, [0])
        kv.at[:, pl.ds(FP8_BLOCK * j, FP8_BLOCK)][...] = x.astype(kv.dtype)


def _kernel(
    q_ref, lat_ref, sc_ref, rope_ref, bt_ref, qstart_ref, kvlen_ref, items_ref,  # inputs (GMEM)
    *outs,  # outputs (GMEM): out, lse of the first `num_base` items (and of the rest, when there are more)
    q_smem, lat_smem, kv_smem, rope_smem, p_smem, px_smem, sc_smem, mx_smem,
    q_bar, k_bars, rope_bar, consumed_bars, rope_free, deq_bar, done_bar, m_bar, p_bar,
    num_base: int, num_heads: int, num_queries: int, softmax_scale: float, interpret: bool,
):
    item = lax.axis_index("i")
    tile = lax.axis_index("t")
    wg = lax.axis_index("wg")
    b = items_ref[item, 0]  # the work item (`mla_decode.work_items`): row, window [lo, hi), part / parts
    row0 = tile * BLOCK_ROWS
    q_start = qstart_ref[b]
    kv_len = kvlen_ref[b]
    num_pages = lat_ref.shape[0]

    # Pages this CTA visits (as mla_decode): the tile's last real token bounds the causal range.
    last_tok = jnp.minimum((row0 + BLOCK_ROWS - 1) // num_heads, num_queries - 1)
    tile_end = jnp.minimum(kv_len, q_start + 1 + last_tok)
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

            page = clamp_page_ids(bt_ref[b, blk_lo + i], num_pages)
            plgpu.copy_gmem_to_smem(lat_ref.at[page], lat_smem.at[slot], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(sc_ref.at[page], sc_smem.at[slot], k_bars.at[slot])

            @pl.when(i >= 1)
            def _():
                plgpu.barrier_wait(rope_free)

            plgpu.copy_gmem_to_smem(rope_ref.at[page], rope_smem, rope_bar.at[0])

        # Observe every phase waited on (the interpreter's rule; see mla_decode): the last releases.
        for back in range(NUM_SLOTS, 0, -1):
            @pl.when(n_steps >= back)
            def _(back=back):
                plgpu.barrier_wait(consumed_bars.at[lax.rem(n_steps - back, NUM_SLOTS)])

        @pl.when(n_steps >= 1)
        def _():
            plgpu.barrier_wait(rope_free)

    def consumer(half: int):
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(q_bar.at[0])
        scale2 = softmax_scale * LOG2E
        other = 1 - half
        key0 = half * HALF_PAGE

        rows = row0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, HALF_PAGE), 0, layout=plgpu.Layout.WGMMA)
        limit = jnp.minimum(q_start + 1 + rows // num_heads, kv_len)
        cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, HALF_PAGE), 1, layout=plgpu.Layout.WGMMA)
        p_stage = p_smem.at[half] if interpret else None

        def qk_part(s_ref, col0: int, width: int, k_ref):
            plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(col0, width)], k_ref.at[pl.ds(key0, HALF_PAGE)].T)

        def scores():
            # Own column half first (dequantized by this consumer), then the rope, then the other half once
            # the other consumer has dequantized it: the wgmmas are asynchronous, so the wait at deq_bar
            # overlaps the first two products.
            def qk(s_ref):
                qk_part(s_ref, half * HALF, HALF, kv_smem.at[:, pl.ds(half * HALF, HALF)])
                plgpu.barrier_wait(rope_bar.at[0])
                qk_part(s_ref, LATENT_DIM, ROPE_DIM, rope_smem)
                plgpu.barrier_wait(deq_bar)
                qk_part(s_ref, other * HALF, HALF, kv_smem.at[:, pl.ds(other * HALF, HALF)])
                return s_ref[...]

            return pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, HALF_PAGE), jnp.float32))

        def step(i, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(i, NUM_SLOTS)
            plgpu.barrier_wait(k_bars.at[slot])
            _dequantize_half(lat_smem.at[slot], sc_smem.at[slot], kv_smem, half)
            plgpu.commit_smem()  # visible to the wgmmas (async proxy) of both consumers
            plgpu.barrier_arrive(consumed_bars.at[slot])
            plgpu.barrier_arrive(deq_bar)
            s = scores()
            plgpu.barrier_arrive(rope_free)
            pos = (blk_lo + i) * PAGE_SIZE + key0 + cols
            s = jnp.where(pos < limit, s * scale2, -jnp.inf)
            m_own = jnp.maximum(m_i, s.max(axis=1))
            mx_smem.at[half][...] = m_own
            plgpu.barrier_arrive(m_bar)
            plgpu.barrier_wait(m_bar)
            m_new = jnp.maximum(m_own, plgpu.load(mx_smem.at[other], layout=ROW_LAYOUT))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(kv_smem.dtype)
            px_smem.at[half][...] = p16
            plgpu.barrier_arrive(p_bar)
            plgpu.barrier_wait(p_bar)
            p_other = plgpu.load(px_smem.at[other], layout=plgpu.Layout.WGMMA)
            p_full = jnp.concatenate([p16, p_other] if half == 0 else [p_other, p16], axis=1)
            acc = pv_accumulate(acc, p_full, kv_smem.at[:, pl.ds(half * HALF, HALF)], p_stage, interpret)
            return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, HALF), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), M_INIT, jnp.float32), ROW_LAYOUT)
        l_i = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS,), jnp.float32), ROW_LAYOUT)
        acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))

        # Epilogue as mla_decode: add the two row-sum halves, stage the output in the Q tile.
        mx_smem.at[half][...] = l_i
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)
        l_i = l_i + plgpu.load(mx_smem.at[other], layout=ROW_LAYOUT)
        lse_stage = mx_smem.at[1]
        empty = l_i == 0.0
        l_safe = jnp.where(empty, 1.0, l_i)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        q_smem.at[:, pl.ds(half * HALF, HALF)][...] = out.astype(q_smem.dtype)
        if half == 0:
            lse_stage[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
        plgpu.commit_smem()
        write_partials(q_smem, lse_stage, outs, item, num_base, row0, half)
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 0)(functools.partial(consumer, 0))
    pl.when(wg == 1)(functools.partial(consumer, 1))


def run_fp8_items(q_latent: jax.Array, q_rope: jax.Array, kv_pages: Fp8Pages, block_table: jax.Array,
                  q_start: jax.Array, kv_len: jax.Array, items: jax.Array, *, softmax_scale: float,
                  interpret: bool, num_base: int | None = None) -> tuple[jax.Array, ...]:
    """`mla_decode.run_items` for FP8 pages: the kernel over the work list `items` [I, 5]; one partial per
    item, out [I, R_pad, 512] bf16 and lse [I, R_pad] (split in two pairs at `num_base`, as there)."""
    bsz, nq, nh, _ = q_latent.shape
    num_items = items.shape[0]
    num_base = num_items if num_base is None else num_base
    row_tiles = pl.cdiv(nq * nh, BLOCK_ROWS)
    q = query_tiles(q_latent, q_rope)
    scratch = _scratch(bool(interpret))
    body = functools.partial(
        _kernel, num_base=num_base, num_heads=nh, num_queries=nq,
        softmax_scale=float(softmax_scale), interpret=bool(interpret),
    )
    return launch_items(body, scratch, num_items, num_base, row_tiles, q.dtype, interpret)(
        q, kv_pages.latent, kv_pages.scale, kv_pages.rope, block_table.astype(jnp.int32),
        q_start.astype(jnp.int32), kv_len.astype(jnp.int32), items.astype(jnp.int32))


def paged_mla_fp8_partials(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: Fp8Pages,
    block_table: jax.Array,
    q_start: jax.Array,
    kv_len: jax.Array,
    *,
    softmax_scale: float,
    num_splits: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`mla_decode.paged_mla_partials` for FP8 pages (q_* bf16 [B, Q, H, D]): out [B, S, R_pad, 512] bf16
    and lse [B, S, R_pad] float32 split partials (equal shares, no long-row splits)."""
    interpret = resolve_interpret(interpret)
    bsz, nq, nh, _ = q_latent.shape
    check_kernel_args(q_latent, q_rope, kv_pages, block_table, fp8_pages=True, q_start=q_start,
                      kv_len=kv_len)
    if num_splits is not None and (not isinstance(num_splits, numbers.Integral) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None (automatic), got {num_splits!r}")
    if num_splits is None:
        num_splits = choose_num_splits(bsz, pl.cdiv(nq * nh, BLOCK_ROWS), block_table.shape[1])
    items = work_items(bsz, SplitPlan(num_splits, 0, 0), block_table.shape[1])
    out, lse = run_fp8_items(q_latent, q_rope, kv_pages, block_table, q_start, kv_len, items,
                             softmax_scale=softmax_scale, interpret=bool(interpret))
    return out.reshape(bsz, num_splits, *out.shape[1:]), lse.reshape(bsz, num_splits, -1)


def paged_mla_fp8_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: Fp8Pages,
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
    """`mla_decode.paged_mla_attention` for FP8 pages, with the same split plans (long rows shared by more
    CTAs, `mla_decode.split_plan`): out [B, Q, H, 512] bf16 and lse [B, Q, H]."""
    interpret = resolve_interpret(interpret)
    check_kernel_args(q_latent, q_rope, kv_pages, block_table, fp8_pages=True, q_start=q_start,
                      kv_len=kv_len)

    def run(items, num_base):
        return run_fp8_items(q_latent, q_rope, kv_pages, block_table, q_start, kv_len, items,
                             softmax_scale=softmax_scale, interpret=bool(interpret), num_base=num_base)

    return attend_items(run, q_latent, block_table, q_start, kv_len, num_splits=num_splits,
                        valid_queries=valid_queries, plan=plan)
