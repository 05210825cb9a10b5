"""Experimental (issue 28 item 2): the FP8-page MLA kernel with Q K^T as FP8 wgmma, two independent consumers.

Owns `run_fp8qk_items` / `paged_mla_fp8qk_attention`, a drop-in twin of `mla_decode_fp8.run_fp8_items` /
`paged_mla_fp8_attention` (same work lists, splits and merges: `mla_decode.attend_items`). Not used by
the model: it replaces the product kernel only if it beats it on the GPU (see
`pallas_kernels.experimental`). Must not change the FP8 cache format (`mla_common.Fp8Pages`).

Why (RESULTS.md, 2026-12-06 lab): the product kernel dequantizes each page into ONE bf16 buffer that both
consumers' Q K^T and P V read, so its CUDA-core work never overlaps the tensor cores; without any
dequantization it still takes 1.45x the bf16 kernel. Here the scores never read a dequantized page:
- Q is quantized like the cache (e4m3, one fp32 scale per row per 128 latent values: `quantize_queries`,
  `mla_common.quantize_kv` on the query rows), so S = sum_j (Q8_j K8_j^T) * sq_j (x) sk_j over the four
  128-wide blocks j: four FP8 wgmmas (m64 n64 k128, K-major operands straight from the TMA'd e4m3 tiles)
  plus the bf16 rope product, each block's accumulator scaled by the outer product of its scales.
- V = K8 * sk: the scale is folded into P instead (P_j = P * sk_j per key), so the page is converted to
  bf16 without a multiply (e4m3 -> bf16 is exact), and only for P V.
- Each consumer scores all 64 keys of a page itself (FP8 doubles wgmma throughput, so this costs what the
  product's key halves cost) and converts only its own 256 V columns into its own half of `kv_smem`:
  the two consumers share nothing but the page ring, no exchange barriers, so one's conversion and
  softmax overlap the other's wgmmas. Its conversion is issued between the rope wgmma and its wait.
- The semantics differ from the product kernel by Q's rounding to e4m3 (per 128-block scale): the CPU
  tests hold the kernel to the fp32 reference on the dequantized Q8 and pages (the same bound).

Shared memory (bytes): Q8 32,768 + Q rope 8,192 + Q scales 1,024 + 2 x (e4m3 page 32,768 + scales 1,024
+ rope 8,192) + bf16 V 65,536 + lse 256 + reduction scratch 1,024 = 192,768 (`smem_bytes()`); `q_split`
adds a second Q8 part (32,768).
"""

import functools
import math

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
    quantize_kv,
)
from pallas_kernels.mla_decode import (
    BLOCK_ROWS,
    LN2,
    LOG2E,
    M_INIT,
    NUM_SLOTS,
    REDUCTION_SCRATCH_BYTES,
    ROW_LAYOUT,
    SplitPlan,
    attend_items,
    item_window,
    launch_items,
    pv_accumulate,
    write_partials,
)

_COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)  # one value per column (key) of a wgmma tile
NUM_BLOCKS = LATENT_DIM // FP8_BLOCK  # scale blocks per token (4)
BLOCKS_PER_HALF = NUM_BLOCKS // 2  # V blocks (128 columns each) per consumer


def quantize_queries(q_latent: jax.Array, q_rope: jax.Array, q_split: bool = False) -> Fp8Pages:
    """[B, Q, H, 512] and [B, Q, H, 64] -> rows (token, head) padded to a multiple of 64, in the cache's own
    format: latent [B, T, R_pad, 512] e4m3, scale [B, 4, R_pad] fp32, rope [B, R_pad, 64] bf16, where T = 1
    or, with `q_split`, 2: the e4m3 value and the e4m3 rounding of what it missed, at the same scale, so that
    (hi + lo) x scale carries ~2^-8 relative error instead of 2^-4 (two FP8 wgmmas into one accumulator)."""
    bsz, nq, nh, _ = q_latent.shape
    rows = nq * nh
    pad = ((0, 0), (0, pl.cdiv(rows, BLOCK_ROWS) * BLOCK_ROWS - rows), (0, 0))
    lat = jnp.pad(q_latent.reshape(bsz, rows, LATENT_DIM), pad).astype(jnp.float32)
    q8 = quantize_kv(lat, jnp.pad(q_rope.reshape(bsz, rows, ROPE_DIM), pad))
    parts = [q8.latent]
    if q_split:
        scale = jnp.repeat(jnp.swapaxes(q8.scale, 1, 2), FP8_BLOCK, axis=-1)  # [B, R_pad, 512]
        parts.append((lat / scale - q8.latent.astype(jnp.float32)).astype(jnp.float8_e4m3fn))
    return Fp8Pages(jnp.stack(parts, axis=1), q8.scale, q8.rope)


def dequantized_queries(q_latent: jax.Array, q_rope: jax.Array, q_split: bool = False
                        ) -> tuple[jax.Array, jax.Array]:
    """The queries as this kernel sees them (sum of the e4m3 parts x their scale, bf16 rope), fp32
    [B, Q, H, D]: what a reference must be given to match the kernel's semantics."""
    bsz, nq, nh, _ = q_latent.shape
    q8 = quantize_queries(q_latent, q_rope, q_split)
    parts = q8.latent.astype(jnp.float32).sum(axis=1)
    lat = (parts.reshape(bsz, -1, NUM_BLOCKS, FP8_BLOCK)
           * jnp.swapaxes(q8.scale, 1, 2)[..., None]).reshape(bsz, -1, LATENT_DIM)
    rows = nq * nh
    return (lat[:, :rows].reshape(bsz, nq, nh, LATENT_DIM),
            q8.rope[:, :rows].astype(jnp.float32).reshape(bsz, nq, nh, ROPE_DIM))


def _scratch(interpret: bool, q_parts: int = 1) -> dict:
    """Shared-memory buffers and barriers, in allocation order (swizzled buffers first, 1 KiB-aligned)."""
    sw = plgpu.SwizzleTransform(128)
    t64 = plgpu.TilingTransform((8, 64))
    t128 = plgpu.TilingTransform((8, 128))
    e4m3, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    return dict(
        q8_smem=plgpu.SMEM((q_parts, BLOCK_ROWS, LATENT_DIM), e4m3, transforms=(t128, sw)),
        qr_smem=plgpu.SMEM((BLOCK_ROWS, ROPE_DIM), bf16, transforms=(t64, sw)),
        lat_smem=plgpu.SMEM((NUM_SLOTS, PAGE_SIZE, LATENT_DIM), e4m3, transforms=(t128, sw)),
        rope_smem=plgpu.SMEM((NUM_SLOTS, PAGE_SIZE, ROPE_DIM), bf16, transforms=(t64, sw)),
        kv_smem=plgpu.SMEM((PAGE_SIZE, LATENT_DIM), bf16, transforms=(t64, sw)),
        p_smem=plgpu.SMEM((2, BLOCK_ROWS, PAGE_SIZE), bf16, transforms=(t64, sw)) if interpret else None,
        qs_smem=plgpu.SMEM((NUM_BLOCKS, BLOCK_ROWS), jnp.float32),
        sc_smem=plgpu.SMEM((NUM_SLOTS, NUM_BLOCKS, PAGE_SIZE), jnp.float32),
        lse_smem=plgpu.SMEM((BLOCK_ROWS,), jnp.float32),
        q_bar=plgpu.Barrier(num_arrivals=q_parts + 2, num_barriers=1),  # Q8's parts, its scales, Q rope
        k_bars=plgpu.Barrier(num_arrivals=3, num_barriers=NUM_SLOTS),  # latent, scales, rope
        consumed_bars=plgpu.Barrier(num_arrivals=2, num_barriers=NUM_SLOTS),
    )


def smem_bytes(interpret: bool = False, q_parts: int = 1) -> int:
    """Bytes of shared-memory buffers (barriers excluded) plus Mosaic's reduction scratch."""
    bufs = [v for v in _scratch(interpret, q_parts).values()
            if v is not None and not isinstance(v, plgpu.Barrier)]
    return REDUCTION_SCRATCH_BYTES + sum(jnp.dtype(v.dtype).itemsize * math.prod(v.shape) for v in bufs)


def _wgmma_ref(acc, a, b):
    plgpu.wgmma(acc, a, b)
    return acc[...]


def _convert_v_block(lat, kv, j: int) -> None:
    """kv[:, block j] = bf16(lat[:, block j]): e4m3 -> bf16 is exact; the scale goes into P."""
    cols = pl.ds(FP8_BLOCK * j, FP8_BLOCK)
    x = plgpu.load(lat.at[:, cols], layout=plgpu.Layout.WGMMA, optimized=False)
    kv.at[:, cols][...] = x.astype(jnp.float32).astype(kv.dtype)


def _kernel(
    q8_ref, qs_ref, qr_ref, lat_ref, sc_ref, rope_ref, bt_ref, qstart_ref, kvlen_ref, items_ref,  # GMEM in
    *outs,  # GMEM out: out, lse of the first `num_base` items (and of the rest, when there are more)
    q8_smem, qr_smem, lat_smem, rope_smem, kv_smem, p_smem, qs_smem, sc_smem, lse_smem,
    q_bar, k_bars, consumed_bars,
    num_base: int, num_heads: int, num_queries: int, softmax_scale: float, interpret: bool,
):
    item = lax.axis_index("i")
    tile = lax.axis_index("t")
    wg = lax.axis_index("wg")
    b = items_ref[item, 0]
    row0 = tile * BLOCK_ROWS
    q_start = qstart_ref[b]
    kv_len = kvlen_ref[b]
    num_pages = lat_ref.shape[0]

    last_tok = jnp.minimum((row0 + BLOCK_ROWS - 1) // num_heads, num_queries - 1)
    tile_end = jnp.minimum(kv_len, q_start + 1 + last_tok)
    n_blocks = jnp.minimum(pl.cdiv(tile_end, PAGE_SIZE), bt_ref.shape[1])
    blk_lo, n_steps = item_window(items_ref, item, n_blocks)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        rows = pl.ds(row0, BLOCK_ROWS)
        for t in range(q8_smem.shape[0]):  # one copy per e4m3 part (a TMA copy takes at most 5 strided dims)
            plgpu.copy_gmem_to_smem(q8_ref.at[b, t, rows], q8_smem.at[t], q_bar.at[0])
        plgpu.copy_gmem_to_smem(qs_ref.at[b, :, rows], qs_smem, q_bar.at[0])
        plgpu.copy_gmem_to_smem(qr_ref.at[b, rows], qr_smem, q_bar.at[0])

        @pl.loop(0, n_steps)
        def _load(i):
            slot = lax.rem(i, NUM_SLOTS)

            @pl.when(i >= NUM_SLOTS)
            def _():
                plgpu.barrier_wait(consumed_bars.at[slot])

            page = clamp_page_ids(bt_ref[b, blk_lo + i], num_pages)
            plgpu.copy_gmem_to_smem(lat_ref.at[page], lat_smem.at[slot], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(sc_ref.at[page], sc_smem.at[slot], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(rope_ref.at[page], rope_smem.at[slot], k_bars.at[slot])

        # Observe every phase waited on (the interpreter's rule; see mla_decode): the last releases.
        for back in range(NUM_SLOTS, 0, -1):
            @pl.when(n_steps >= back)
            def _(back=back):
                plgpu.barrier_wait(consumed_bars.at[lax.rem(n_steps - back, NUM_SLOTS)])

    def consumer(half: int):
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(q_bar.at[0])
        scale2 = softmax_scale * LOG2E
        # Q's block scales with the softmax scale (log2 domain) folded in: one [64] row vector per block.
        q_scales = [plgpu.load(qs_smem.at[j], layout=ROW_LAYOUT) * scale2 for j in range(NUM_BLOCKS)]
        own = range(half * BLOCKS_PER_HALF, (half + 1) * BLOCKS_PER_HALF)
        shape = (BLOCK_ROWS, PAGE_SIZE)
        # The causal limit per row, kept as a row vector (2 registers a thread, not a [64, 64] tile: the
        # consumer's registers go to the two output accumulators and the scores).
        rows = row0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0, layout=ROW_LAYOUT)
        limit = jnp.minimum(q_start + 1 + rows // num_heads, kv_len)
        p_stage = p_smem.at[half] if interpret else None

        def scores(lat, sc, rope):
            """Log2-domain scores [64, 64] of the Q tile against the page; this consumer's V blocks are
            converted while the rope wgmma runs."""
            def rope_and_convert(s_ref):
                plgpu.wgmma(s_ref, qr_smem, rope.T)
                for j in own:
                    _convert_v_block(lat, kv_smem, j)
                return s_ref[...]

            s = pl.run_scoped(rope_and_convert, plgpu.ACC(shape, jnp.float32)) * scale2
            for j in range(NUM_BLOCKS):
                blk = pl.ds(FP8_BLOCK * j, FP8_BLOCK)

                def block(acc_ref, blk=blk):
                    for t in range(q8_smem.shape[0]):  # Q's e4m3 parts share the scale: one accumulator
                        plgpu.wgmma(acc_ref, q8_smem.at[t, :, blk], lat.at[:, blk].T)
                    return acc_ref[...]

                part = pl.run_scoped(block, plgpu.ACC(shape, jnp.float32))
                sk = plgpu.load(sc.at[j], layout=_COL_LAYOUT)
                s = s + part * (lax.broadcast_in_dim(q_scales[j], shape, [0])
                                * lax.broadcast_in_dim(sk, shape, [1]))
            return s

        def step(i, carry):
            accs, m_i, l_i = carry
            slot = lax.rem(i, NUM_SLOTS)
            plgpu.barrier_wait(k_bars.at[slot])
            sc = sc_smem.at[slot]
            s = scores(lat_smem.at[slot], sc, rope_smem.at[slot])
            v_scales = [plgpu.load(sc.at[j], layout=_COL_LAYOUT) for j in own]
            plgpu.commit_smem()  # the converted V visible to the async proxy (this consumer's P V)
            plgpu.barrier_arrive(consumed_bars.at[slot])  # the slot is read: scores done, V converted
            cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            pos = (blk_lo + i) * PAGE_SIZE + cols
            s = jnp.where(pos < lax.broadcast_in_dim(limit, shape, [0]), s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            out = []
            for acc, j, vs in zip(accs, own, v_scales):
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = (p * lax.broadcast_in_dim(vs, shape, [1])).astype(kv_smem.dtype)
                v = kv_smem.at[:, pl.ds(FP8_BLOCK * j, FP8_BLOCK)]
                out.append(pv_accumulate(acc, p16, v, p_stage, interpret))
            return tuple(out), m_new, l_i

        zero = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, FP8_BLOCK), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), M_INIT, jnp.float32), ROW_LAYOUT)
        l_i = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS,), jnp.float32), ROW_LAYOUT)
        accs, m_i, l_i = lax.fori_loop(0, n_steps, step, ((zero,) * BLOCKS_PER_HALF, m_i, l_i))

        # Both consumers hold the same m and l (each scored every key); each stages its own output half in
        # its own half of kv_smem (its P V is done), consumer 0 also the lse.
        empty = l_i == 0.0
        l_safe = jnp.where(empty, 1.0, l_i)
        for acc, j in zip(accs, own):
            out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            kv_smem.at[:, pl.ds(FP8_BLOCK * j, FP8_BLOCK)][...] = out.astype(kv_smem.dtype)
        if half == 0:
            lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
        plgpu.commit_smem()
        write_partials(kv_smem, lse_smem, outs, item, num_base, row0, half)
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 0)(functools.partial(consumer, 0))
    pl.when(wg == 1)(functools.partial(consumer, 1))


def run_fp8qk_items(q_latent: jax.Array, q_rope: jax.Array, kv_pages: Fp8Pages, block_table: jax.Array,
                    q_start: jax.Array, kv_len: jax.Array, items: jax.Array, *, softmax_scale: float,
                    interpret: bool, num_base: int | None = None, q_split: bool = False
                    ) -> tuple[jax.Array, ...]:
    """`mla_decode_fp8.run_fp8_items` with Q quantized to e4m3 (`quantize_queries`): one partial per work
    item, out [I, R_pad, 512] bf16 and lse [I, R_pad] (split in two pairs at `num_base`, as there)."""
    bsz, nq, nh, _ = q_latent.shape
    num_items = items.shape[0]
    num_base = num_items if num_base is None else num_base
    row_tiles = pl.cdiv(nq * nh, BLOCK_ROWS)
    q8 = quantize_queries(q_latent, q_rope, q_split)
    scratch = _scratch(bool(interpret), q8.latent.shape[1])
    body = functools.partial(
        _kernel, num_base=num_base, num_heads=nh, num_queries=nq,
        softmax_scale=float(softmax_scale), interpret=bool(interpret),
    )
    return launch_items(body, scratch, num_items, num_base, row_tiles, jnp.bfloat16, interpret)(
        q8.latent, q8.scale, q8.rope, kv_pages.latent, kv_pages.scale, kv_pages.rope,
        block_table.astype(jnp.int32), q_start.astype(jnp.int32), kv_len.astype(jnp.int32),
        items.astype(jnp.int32))


def paged_mla_fp8qk_attention(
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
    q_split: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`mla_decode_fp8.paged_mla_fp8_attention` through this kernel: out [B, Q, H, 512] bf16, lse
    [B, Q, H]."""
    interpret = resolve_interpret(interpret)
    check_kernel_args(q_latent, q_rope, kv_pages, block_table, fp8_pages=True, q_start=q_start,
                      kv_len=kv_len)

    def run(items, num_base):
        return run_fp8qk_items(q_latent, q_rope, kv_pages, block_table, q_start, kv_len, items,
                               softmax_scale=softmax_scale, interpret=bool(interpret), num_base=num_base,
                               q_split=q_split)

    return attend_items(run, q_latent, block_table, q_start, kv_len, num_splits=num_splits,
                        valid_queries=valid_queries, plan=plan)
