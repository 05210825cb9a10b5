"""The MLA decode kernel lab: earlier and alternative designs of `pallas_kernels.mla_decode`'s kernel.

Not used by the model and not in the GPU gate (its tests, `tests/test_mla_variants.py`, are marked
`experimental`); kept working so that the designs can be re-measured against the product
(`benchmarks/mla_bench.py --variants v1,v2`, `benchmarks/kernel_device_bench.py --mla-variants`,
`benchmarks/ncu_target.py mla --variant`). The product kernel is `pallas_kernels.mla_decode` (design
"v2", split QK: read its docstring first; everything here is a difference from it).

`KERNEL_VARIANTS` names every design the entry points here take (`variant=`): "v2" runs the product
kernel itself (`pallas_kernels.mla_decode.paged_mla_partials`, not a copy), the others run `_kernel`
below: a copy of the product's producer and epilogue with each design's consumers, using the product's
tiling constants, query tiles, split rule and split merge (`merge_splits`). Same arguments and results
as the product's `paged_mla_partials`, `paged_mla_attention` and `mla_decode`, plus `variant` (required:
the lab has no default).

- v1 (the design before v2, the baseline of its measurements): the two consumers both
  compute the full score tile S = Q K^T (64x64, K=576) and the online softmax, each accumulating its own
  half (256 columns) of O = P V. QK is 576/1088 of the FLOPs, so the tensor cores do ~1.53x the necessary
  work. Stages the lse in its own 256-byte buffer and keeps Mosaic's default reduction scratch.
- v3 (seesaw): consumer c scores the pages i with i % 2 == c (the full 64x64 tile, wgmma N=64), so each
  QK FLOP is done once, and both consumers multiply every page's P by their own 256 V columns. A turn of
  consumer c on page i: QK of page i (it needs only the page, so it overlaps the other consumer's softmax);
  then page i - 1's P and row maxima from the other consumer (`m_bar` / `p_bar`, one arrival each: "my P
  is out"), rescale and P V for page i - 1; then page i's softmax starting from page i - 1's maximum,
  published at once, and P V for page i. The running maximum is thus one chain through all pages, and
  both consumers see every P, so each keeps the full row sum (no l exchange at the end). One P buffer
  [64, 64] serves both directions: the consumers strictly alternate, a consumer overwrites it only after
  loading the previous P into registers, and in the WGMMA layout each thread stores exactly the elements
  it loaded. Each consumer waits every page's barrier once (its own pages in its turn, the other's before
  their P V). Page 0 has no predecessor and the last page may be the other consumer's (two `lax.cond`s).
  Shared memory as v2. Measured on the H200 (2026-12-03): 1.21-1.50x v1's time at H=128 and 1.07-1.56x
  at H=16. Also tried that day and removed (commits e0d65bd..466fadc, RESULTS.md "MLA decode, round
  three"): v3 with the two row tiles of a token in a 2-CTA cluster sharing each page by TMA multicast, v3
  with both P V products after the softmax, v1 with that multicast, and v1 with each page loaded as 9
  column chunks with their own barriers; none was faster than v1.
- v8 (ping-pong): v1 with a 2-arrival schedule barrier (`sched_bar`) that both consumers pass after issuing
  QK and after their softmax, consumer 1 once more before its loop and consumer 0 once more after its own,
  so one consumer's softmax runs while the other's wgmmas do (FlashAttention-3's warpgroup schedule).
  Measured by GPU time (2026-12-03): 0.99-1.00x v1 at H=128 and 1.03x at H=16: Nsight Compute shows v1's
  tensor pipe already 80% busy (the consumers drift apart by themselves).
- v9 (one exchange per page): v2 without `m_bar`. Each consumer publishes its P half scaled by its own
  running maximum together with that maximum, meets the other at `p_bar` (2 arrivals), and both rescale
  both halves to the larger maximum (the same bf16 bits times the same factor on both sides, so both hold
  the same P and each still sums only its own half into l). With one meeting per page the P and maxima
  buffers could be overwritten before the other has read them, so before publishing page i a consumer
  waits for page i - 1's `consumed_bars` slot (both P V products on it done, hence both reads), and once
  more after its loop before staging l in its maxima buffer; no new shared memory. Built after v2's
  profile (51.8% tensor-pipe use, the most barrier stalls of all variants); interpret-mode and Hopper
  lowering tests pass; not yet timed on a GPU.

`merge_splits_one_reduce` is the product's earlier split merge (one variadic reduce), replaced by the
two-pass `mla_decode.merge_splits`; kept to time against it (`kernel_device_bench.py --only merge`).
"""

import functools
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
    choose_num_splits,
    merge_splits,
    pv_accumulate,
    query_tiles,
    split_partials,
)
from pallas_kernels.mla_decode import paged_mla_partials as product_partials

PRODUCT_VARIANT = "v2"  # the design of pallas_kernels.mla_decode, which runs it
KERNEL_VARIANTS = ("v1", "v2", "v3", "v8", "v9")  # see the module docstring
SPLIT_QK_VARIANTS = ("v2", "v9")  # consumer c scores keys [32c, 32c + 32) of each page


def check_variant(variant: str) -> None:
    """One clear error for a kernel variant name that is not in `KERNEL_VARIANTS`."""
    if variant not in KERNEL_VARIANTS:
        raise ValueError(f"MLA kernel variant must be one of {KERNEL_VARIANTS}, got {variant!r}")


def _masked_scores(q_smem, k_smem, slot, key0: int, nkeys: int, page_pos0, limit, scale2, after_issue=None):
    """Scaled log2-domain scores of the Q tile against keys key0 .. key0 + nkeys of the page in `slot`
    (wgmma N = nkeys), with positions at or past each row's `limit` [64, nkeys] set to -inf.
    `after_issue()` runs between issuing the wgmma and waiting for it (v8's schedule barrier). The lab's
    copy of the product's `_masked_scores` (which has no `after_issue`)."""
    def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot, pl.ds(key0, nkeys)].T)
        if after_issue is not None:
            after_issue()
        return s_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, nkeys), jnp.float32))
    cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, nkeys), 1, layout=plgpu.Layout.WGMMA)
    pos = page_pos0 + key0 + cols
    return jnp.where(pos < limit, s * scale2, -jnp.inf)


def _kernel(
    q_ref, kv_ref, bt_ref, qstart_ref, kvlen_ref,  # inputs (GMEM)
    out_ref, lse_ref,  # outputs (GMEM)
    q_smem, k_smem, lse_smem, p_smem, mx_smem, px_smem, q_bar, k_bars, consumed_bars, done_bar, m_bar, p_bar,
    sched_bar,
    *, num_heads: int, num_queries: int, num_splits: int, softmax_scale: float, interpret: bool, variant: str,
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
        scale2 = softmax_scale * LOG2E
        other = 1 - half

        split_qk = variant in SPLIT_QK_VARIANTS
        nkeys = HALF_PAGE if split_qk else PAGE_SIZE  # keys this consumer scores per page
        rows = row0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, nkeys), 0, layout=plgpu.Layout.WGMMA)
        limit = jnp.minimum(q_start + 1 + rows // num_heads, kv_len)

        p_stage = p_smem.at[half] if interpret else None

        pingpong = variant == "v8"

        def schedule():
            # v8: the consumers pass this 2-arrival barrier twice a page, consumer 1 once more at the start
            # and consumer 0 once more at the end, so each one's softmax runs while the other's wgmmas do.
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(sched_bar)

        def step_v1(i, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(i, NUM_SLOTS)
            plgpu.barrier_wait(k_bars.at[slot])
            s = _masked_scores(q_smem, k_smem, slot, 0, PAGE_SIZE, (blk_lo + i) * PAGE_SIZE, limit, scale2,
                               after_issue=schedule if pingpong else None)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if pingpong:
                schedule()
            v = k_smem.at[slot, :, pl.ds(half * HALF, HALF)]
            acc = pv_accumulate(acc, p.astype(k_smem.dtype), v, p_stage, interpret)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc, m_new, l_i

        def v_half(slot):
            return k_smem.at[slot, :, pl.ds(half * HALF, HALF)]

        def own_keys(i, m_i):
            """Split QK (v9 here; v2 is the product's): wait for page i and score this consumer's keys
            [32 * half, 32 * half + 32); returns the slot, the scores and their row max joined with m_i."""
            slot = lax.rem(i, NUM_SLOTS)
            plgpu.barrier_wait(k_bars.at[slot])
            s = _masked_scores(q_smem, k_smem, slot, half * HALF_PAGE, HALF_PAGE, (blk_lo + i) * PAGE_SIZE,
                               limit, scale2)
            return slot, s, jnp.maximum(m_i, s.max(axis=1))

        def full_p_times_v(acc, mine, theirs, slot):
            """P V on this consumer's half of V with the full P [64, 64] made of the two consumers' halves."""
            p_full = jnp.concatenate([mine, theirs] if half == 0 else [theirs, mine], axis=1)
            acc = pv_accumulate(acc, p_full, v_half(slot), p_stage, interpret)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc

        def step_v9(i, carry):
            # v2 with one exchange per page: this consumer's P half goes out scaled by its own running
            # maximum, with that maximum; both sides then rescale both halves to the larger of the two.
            acc, m_i, l_i = carry
            slot, s, m_own = own_keys(i, m_i)
            p32 = jnp.exp2(s - lax.broadcast_in_dim(m_own, s.shape, [0]))
            p16 = p32.astype(k_smem.dtype)

            @pl.when(i > 0)
            def _():  # page i - 1's P V is done on both sides: the other has read what this buffer held
                plgpu.barrier_wait(consumed_bars.at[lax.rem(i - 1, NUM_SLOTS)])

            px_smem.at[half][...] = p16
            mx_smem.at[half][...] = m_own
            plgpu.barrier_arrive(p_bar)
            plgpu.barrier_wait(p_bar)
            m_other = plgpu.load(mx_smem.at[other], layout=ROW_LAYOUT)
            p_other = plgpu.load(px_smem.at[other], layout=plgpu.Layout.WGMMA)
            m_new = jnp.maximum(m_own, m_other)

            def rescale(p_half, m_half):
                # The same bf16 bits and the same factor on both sides, so both hold the same P.
                c = jnp.exp2(m_half - m_new)
                scaled = p_half.astype(jnp.float32) * lax.broadcast_in_dim(c, p_half.shape, [0])
                return scaled.astype(p16.dtype)

            p_mine, p_theirs = rescale(p16, m_own), rescale(p_other, m_other)
            alpha = jnp.exp2(m_i - m_new)
            # l from the fp32 P before any bf16 rounding (as v2): summing the twice-rounded p_mine put
            # lse ~1e-3 off the reference (v2: ~1e-6), and this is one row sum and one scale fewer converts.
            l_i = l_i * alpha + p32.sum(axis=1) * jnp.exp2(m_own - m_new)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            return full_p_times_v(acc, p_mine, p_theirs, slot), m_new, l_i

        def publish(p16, m_new):
            # P and its row maxima for the other consumer; one P buffer serves both directions because the
            # consumers take turns (module docstring, v3).
            px_smem[...] = p16
            mx_smem.at[half][...] = m_new
            plgpu.barrier_arrive(m_bar if half == 0 else p_bar)

        def take_other_page(j, carry):
            """P V for page j, which the other consumer scored: its P and max from shared memory (their row
            sums are taken here, so both consumers keep the full l)."""
            acc, m_i, l_i = carry
            slot = lax.rem(j, NUM_SLOTS)
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_wait(p_bar if half == 0 else m_bar)
            m_other = plgpu.load(mx_smem.at[other], layout=ROW_LAYOUT)
            p_other = plgpu.load(px_smem, layout=plgpu.Layout.WGMMA)
            alpha = jnp.exp2(m_i - m_other)
            l_i = l_i * alpha + p_other.astype(jnp.float32).sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            acc = pv_accumulate(acc, p_other, v_half(slot), p_stage, interpret)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc, m_other, l_i

        def turn_v3(t, carry):
            # Page i = 2t + half is this consumer's to score. Its QK goes first (it needs only the page), then
            # page i - 1 from the other consumer (its max is where page i's softmax starts), then page i.
            i = 2 * t + half
            slot = lax.rem(i, NUM_SLOTS)
            plgpu.barrier_wait(k_bars.at[slot])
            s = _masked_scores(q_smem, k_smem, slot, 0, PAGE_SIZE, (blk_lo + i) * PAGE_SIZE, limit, scale2)
            if half == 0:  # page 0 has no predecessor
                carry = lax.cond(i > 0, lambda c: take_other_page(i - 1, c), lambda c: c, carry)
            else:
                carry = take_other_page(i - 1, carry)
            acc, m_i, l_i = carry
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p16 = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])).astype(k_smem.dtype)
            publish(p16, m_new)
            l_i = l_i * alpha + p16.astype(jnp.float32).sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            acc = pv_accumulate(acc, p16, v_half(slot), p_stage, interpret)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, HALF), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_ROWS,), M_INIT, jnp.float32), ROW_LAYOUT)
        l_i = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS,), jnp.float32), ROW_LAYOUT)
        if variant == "v3":
            carry = lax.fori_loop(0, (n_steps + 1 - half) // 2, turn_v3, (acc, m_i, l_i))
            # The last page, when the other consumer scored it, still needs this consumer's P V.
            last_is_other = (n_steps >= 1) & (lax.rem(n_steps - 1, NUM_SLOTS) != half)
            acc, m_i, l_i = lax.cond(last_is_other, functools.partial(take_other_page, n_steps - 1),
                                     lambda c: c, carry)
        else:
            step = step_v9 if variant == "v9" else step_v1
            if pingpong and half == 1:
                schedule()
            acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))
            if pingpong and half == 0:
                schedule()

        if variant == "v9":  # the other may still read this consumer's last maxima until its last P V
            @pl.when(n_steps > 0)
            def _():
                plgpu.barrier_wait(consumed_bars.at[lax.rem(n_steps - 1, NUM_SLOTS)])

        if split_qk:  # the row sum is the two consumers' halves; they meet at done_bar anyway
            mx_smem.at[half][...] = l_i
        # Both consumers must be done reading the Q tile before it is reused to stage the output.
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)
        if split_qk:
            l_i = l_i + plgpu.load(mx_smem.at[other], layout=ROW_LAYOUT)
            # Consumer 0 stages the lse in row 1, which it has read already; consumer 1 now reads only row 0.
            lse_stage = mx_smem.at[1]
        elif variant == "v3":  # nothing reads the maxima after done_bar
            lse_stage = mx_smem.at[0]
        else:
            lse_stage = lse_smem
        empty = l_i == 0.0
        l_safe = jnp.where(empty, 1.0, l_i)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        out_smem = q_smem.at[:, pl.ds(half * HALF, HALF)]
        out_smem[...] = out.astype(q_smem.dtype)
        if half == 0:
            lse_stage[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
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


Partial = tuple[jax.Array, jax.Array]  # (lse, out) of one split, out normalized by its own sum


def _merge_pair(a: Partial, b: Partial) -> Partial:
    """Log-sum-exp merge of two normalized partials (lse, out); (-inf, 0) is the identity and two empty
    partials give (-inf, 0), not NaN. Associative, so XLA may reduce the splits in any order."""
    (xa, oa), (xb, ob) = a, b
    m = jnp.maximum(xa, xb)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    wa, wb = jnp.exp(xa - m), jnp.exp(xb - m)
    total = wa + wb
    safe = jnp.where(total > 0, total, 1.0)
    return jnp.where(total > 0, m + jnp.log(safe), -jnp.inf), (oa * wa + ob * wb) / safe


def merge_splits_one_reduce(out_parts: jax.Array, lse_parts: jax.Array, num_queries: int, num_heads: int,
                            valid_queries: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The product's split merge until 2026-12-05: `merge_splits`' contract as one XLA variadic reduce
    over S of (lse broadcast over the 512 columns, out) whose reducer is `_merge_pair`. One launch, but
    measured by GPU time on the H200: 27-29 us at B=1, H=128 with 32 splits (2.7x the kernel), 14 us at
    B=8, against 7.3 us for the two-pass form the product now runs (`mla_decode.merge_splits`). Kept to
    time against it (`benchmarks/split_bench.py`, `kernel_device_bench.py --only merge`)."""
    out, lse = split_partials(out_parts, lse_parts, num_queries, num_heads, valid_queries)
    if out.shape[1] == 1:
        return out[:, 0], lse[:, 0]
    out = out.astype(jnp.float32)
    lse_b = jnp.broadcast_to(lse[..., None], out.shape)
    lse_m, out_m = lax.reduce((lse_b, out), (jnp.float32(-jnp.inf), jnp.float32(0.0)), _merge_pair, (1,))
    return out_m.astype(out_parts.dtype), lse_m[..., 0]


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
    variant: str,
) -> tuple[jax.Array, jax.Array]:
    """`pallas_kernels.mla_decode.paged_mla_partials` by design `variant` (in `KERNEL_VARIANTS`; "v2" is
    the product kernel itself): the raw split partials out [B, S, R_pad, 512] and lse [B, S, R_pad] with
    rows R = Q * H padded to a multiple of 64 (every element is written, padding rows included)."""
    check_variant(variant)
    if variant == PRODUCT_VARIANT:
        return product_partials(q_latent, q_rope, kv_pages, block_table, q_start, kv_len,
                                softmax_scale=softmax_scale, num_splits=num_splits, interpret=interpret)
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
    split_qk = variant in SPLIT_QK_VARIANTS  # v9 here
    v3 = variant == "v3"
    exchange = split_qk or v3  # the consumers trade maxima and P through shared memory
    scratch = dict(
        q_smem=plgpu.SMEM((BLOCK_ROWS, KV_DIM), dtype, transforms=(tiling, swizzle)),
        k_smem=plgpu.SMEM((NUM_SLOTS, PAGE_SIZE, KV_DIM), dtype, transforms=(tiling, swizzle)),
        # v9 and v3 stage the lse in their exchange buffer instead (the 256 B that make their budget fit).
        lse_smem=None if exchange else plgpu.SMEM((BLOCK_ROWS,), jnp.float32),
        # Only interpret mode stages the full P tile through shared memory (mla_decode's docstring).
        p_smem=(
            plgpu.SMEM((2, BLOCK_ROWS, PAGE_SIZE), dtype, transforms=(tiling, swizzle)) if interpret else None
        ),
        # v9's exchange (v2's): each consumer's P half [64, 32] and its row maxima (then row sums); the P
        # halves come first so that they sit 1 KiB-aligned like every swizzled buffer.
        px_smem=(
            plgpu.SMEM((2, BLOCK_ROWS, HALF_PAGE), dtype,
                       transforms=(plgpu.TilingTransform((8, HALF_PAGE)), plgpu.SwizzleTransform(64)))
            if split_qk else
            # v3's one P tile [64, 64], written by the consumers in turn.
            plgpu.SMEM((BLOCK_ROWS, PAGE_SIZE), dtype, transforms=(tiling, swizzle)) if v3 else None
        ),
        mx_smem=plgpu.SMEM((2, BLOCK_ROWS), jnp.float32) if exchange else None,
        q_bar=plgpu.Barrier(num_barriers=1),
        k_bars=plgpu.Barrier(num_barriers=NUM_SLOTS),
        consumed_bars=plgpu.Barrier(num_arrivals=2, num_barriers=NUM_SLOTS),
        done_bar=plgpu.Barrier(num_arrivals=2),
        # v9: both consumers meet at p_bar (it has no m_bar); v3: m_bar says consumer 0's P is out, p_bar
        # consumer 1's.
        m_bar=plgpu.Barrier(num_arrivals=1 if v3 else 2) if exchange and variant != "v9" else None,
        p_bar=plgpu.Barrier(num_arrivals=1 if v3 else 2) if exchange else None,
        sched_bar=plgpu.Barrier(num_arrivals=2) if variant == "v8" else None,
    )
    body = functools.partial(
        _kernel, num_heads=nh, num_queries=nq, num_splits=num_splits,
        softmax_scale=float(softmax_scale), interpret=bool(interpret), variant=variant,
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
            approx_math=True, **({"reduction_scratch_bytes": REDUCTION_SCRATCH_BYTES} if exchange else {})),
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
    variant: str,
) -> tuple[jax.Array, jax.Array]:
    """`pallas_kernels.mla_decode.paged_mla_attention` by design `variant`; q_* are [B, Q, H, D];
    semantics of `mla_reference.paged_attention_reference`. Returns out [B, Q, H, 512] and lse [B, Q, H].
    `valid_queries` [B]: queries j >= valid_queries[b] are padding (out 0, lse -inf; see `merge_splits`)."""
    _, nq, nh, _ = q_latent.shape
    out_parts, lse_parts = paged_mla_partials(
        q_latent, q_rope, kv_pages, block_table, q_start, kv_len,
        softmax_scale=softmax_scale, num_splits=num_splits, interpret=interpret, variant=variant,
    )
    return merge_splits(out_parts, lse_parts, nq, nh, valid_queries)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "num_splits", "interpret", "variant"))
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
    variant: str,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode over a paged latent cache (Pallas Mosaic GPU).

    Same contract as `mla_reference.mla_decode_reference`: q_latent [B, H, 512] or [B, Q, H, 512] (Q
    newest tokens, causal among themselves), q_rope [..., 64], kv_pages [num_pages, 64, 576],
    block_table [B, max_pages] int32, seq_lens [B] int32 (>= Q, counting the Q new tokens).
    Returns out shaped like q_latent in q's dtype and lse [B, (Q,) H] float32 (natural log).
    `num_splits` overrides the split-KV heuristic; `interpret=True` runs Pallas' GPU interpreter,
    `None` (default) does so whenever the default backend is not a GPU.
    With splits > 1 the partial outputs are kept in q's dtype before the fp32 combine.
    `variant` picks the kernel design (`KERNEL_VARIANTS`, module docstring; "v2" is the product).
    """
    q_latent, q_rope, squeeze = as_4d(q_latent, q_rope)
    check_cache_args(kv_pages, block_table, q_latent.shape[0], seq_lens=seq_lens)
    seq_lens = seq_lens.astype(jnp.int32)
    out, lse = paged_mla_attention(
        q_latent, q_rope, kv_pages, block_table, seq_lens - q_latent.shape[1], seq_lens,
        softmax_scale=softmax_scale, num_splits=num_splits, interpret=interpret, variant=variant,
    )
    if squeeze:
        out, lse = out[:, 0], lse[:, 0]
    return out, lse
