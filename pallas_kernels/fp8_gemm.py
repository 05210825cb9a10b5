"""FP8 block-scaled GEMMs for Hopper in Pallas Mosaic GPU: the MoE experts' grouped GEMM and a dense one.

Owns ``fp8_grouped_gemm`` (rows of ``x`` sorted by expert, weights ``[E, N, K]`` in HF's ``[out, in]``
layout), ``fp8_gemm`` (the same kernel with one group) and the ``*_linear`` conveniences that quantize a
bf16 activation first. Numerics follow DeepSeek-V3 / DeepGEMM: each 128-wide K block is multiplied on
the tensor cores into a fresh fp32 accumulator, then promoted into the running fp32 sum with
``x_scale[row, kb] * w_scale[nb, kb]`` applied on the CUDA cores, so the result equals
dequantize-then-matmul up to fp32 rounding. No model knowledge here: arrays in, arrays out.

Kernel shape: persistent CTAs (one per SM) walk (row tile, column tile) work items, in bands of a few
row tiles so that the SMs busy at one time share weight tiles in L2; each CTA runs three warpgroups, one
issuing TMA loads (warp specialization) and two issuing wgmma, each on a 64 x 128 or 64 x 256 block
(``Fp8GemmConfig``; prefill and large dense GEMMs use the 128 x 256 CTA tile, decode 64 x 256). The B
operand is the weight tile ``(N, K)`` read K-major, which is what FP8 wgmma requires. Row tiles never
straddle two experts: the tile list is built outside the kernel (``group_tiles.tile_metadata``, shared
with the bf16 ``grouped_gemm``; for the dense GEMM on the host) so each tile knows its expert and its
valid row range, and the epilogue stores only those rows (``group_tiles.store_rows``, a power-of-two
ladder of TMA stores).
Rows at or past ``sum(group_sizes)`` are written as zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_quant import BLOCK, FP8_DTYPE, num_blocks, quantize_act
from pallas_kernels.group_tiles import (
    GROUP,
    HI,
    LO,
    ROW0,
    check_group_sizes,
    dense_tile_metadata,
    num_sms,
    pad_axis,
    padded_rows,
    round_up,
    run_tile_pipeline,
    store_rows,
    tile_counts,
    tile_metadata,
)
from pallas_kernels.interpret import resolve_interpret

_WG_M = 64  # rows per compute warpgroup (wgmma's M)
_SCALE_N = 128  # columns per weight-scale block, and per wgmma (one promotion each)
_BK = 128  # K per pipeline step: one scale block
_NUM_COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """Tiling of the kernel.

    wg_split: how the two compute warpgroups share a CTA tile. ``"m"``: each warpgroup ``64 x wg_n`` on
      its own 64 rows (prefill, many rows per expert). ``"n"``: each warpgroup ``64 x wg_n`` on its own
      columns (decode: few rows per expert, so fewer wasted rows and more weight bytes per CTA).
    wg_n: columns per warpgroup, 128 or 256. At 256 a K step is two wgmmas (one per 128-column scale
      block), each promoted with its own weight scale before the next is issued, so only one 64x128
      product is live in registers beside the 64x256 sum (192 of the 232 registers per thread). Wider
      tiles read fewer bytes per FLOP from L2.
    max_concurrent_steps: TMA pipeline depth (K blocks in flight).
    k_splits: slices of K computed as separate work items into fp32 partial planes ``[k_splits, M, N]``,
      summed in one XLA reduction after the kernel (1: no split). For few rows per step, where the
      (row tile, column tile) items alone cannot keep every SM streaming weights.
    chain: run one CTA's tile pipelines back to back (the loader fetches the next tile's first K blocks
      while the current tile's epilogue runs, no drain and refill per tile); needs the K blocks per
      slice to be a multiple of the depth, otherwise each tile drains.
    band: work order. 1: a row tile's column tiles run one after another (row-major). ``b > 1``: bands
      of ``b`` row tiles, inside a band the row tiles of one column tile run together, so the SMs working
      at one time share a few weight tiles and a few activation tiles in L2 instead of sweeping the whole
      weight (a dense 8192^3 GEMM: 64 MiB of fp8 weight per two row tiles, more than the 50 MiB L2).
    cluster_n: CTAs per cluster along N, 1 or 2. At 2 the two CTAs of a cluster take the same row tile
      and neighbouring column tiles, and one TMA multicast brings the shared activation tile (and its
      scales) to both, halving those L2 reads. Any grouping works: both tiles have the same expert.
    """

    wg_split: str = "m"
    max_concurrent_steps: int = 4
    k_splits: int = 1
    chain: bool = False
    wg_n: int = 128
    band: int = 1
    cluster_n: int = 1

    def __post_init__(self):
        if self.wg_split not in ("m", "n"):
            raise ValueError(f"wg_split must be 'm' or 'n', got {self.wg_split!r}")
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps must be >= 1, got {self.max_concurrent_steps}")
        if self.k_splits < 1:
            raise ValueError(f"k_splits must be >= 1, got {self.k_splits}")
        if self.wg_n not in (128, 256):
            raise ValueError(f"wg_n must be 128 or 256, got {self.wg_n}")
        if self.band < 1:
            raise ValueError(f"band must be >= 1, got {self.band}")
        if self.cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2, got {self.cluster_n}")

    @property
    def tile_m(self) -> int:
        return _WG_M * (_NUM_COMPUTE_WGS if self.wg_split == "m" else 1)

    @property
    def tile_n(self) -> int:
        return self.wg_n * (_NUM_COMPUTE_WGS if self.wg_split == "n" else 1)


# Measured on the H200 at 65,536 rows over 256 experts (benchmarks/RESULTS.md, "round three"): the
# 128x256 tile in bands of 2 row tiles is 1.19-1.28x the 128x128 row-major tile.
PREFILL_CONFIG = Fp8GemmConfig(wg_split="m", max_concurrent_steps=4, wg_n=256, band=2)
DECODE_CONFIG = Fp8GemmConfig(wg_split="n", max_concurrent_steps=4)  # 6 stages exceed 227 KiB smem
# Dense GEMMs with many tiles: 128x256 in bands of 8 row tiles (8192^3: 1.29x the 128x128 row-major
# tile, whose order streams the whole weight from HBM for every two row tiles).
DENSE_CONFIG = Fp8GemmConfig(wg_split="m", max_concurrent_steps=4, wg_n=256, band=8)
# Dense GEMMs with too few 128x256 tiles for two waves (M=4096 x N=1536: 192 tiles on 132 SMs).
NARROW_CONFIG = Fp8GemmConfig(wg_split="m", max_concurrent_steps=4)
# Dense GEMMs with many tiles but short K (at most SHORT_K_BLOCKS 128-wide blocks): three stages, bands of
# two. Measured by GPU time on the H200 at 4096 x 1536 -> 24576: 1,096 TFLOP/s against DENSE_CONFIG's 1,045
# (benchmarks/RESULTS.md, round four; the wall-clock sweep of round three ranked them the same way).
SHORT_K_CONFIG = Fp8GemmConfig(wg_split="m", max_concurrent_steps=3, wg_n=256, band=2)
SHORT_K_BLOCKS = 16
# The widest N one CTA tile of a default tiling covers (tile_n x cluster_n): `_launch` pads N up to its
# tile in every call (a copy of the whole weight), so a weight whose N is a multiple of this is never
# padded per call. Model code that builds a weight at load (dsv3_jax/model/qkv_a.py) pads it to this once.
N_ALIGN = 256


def default_config(num_rows: int, num_groups: int) -> Fp8GemmConfig:
    """Pick the prefill tiling when groups average at least 64 rows, the decode tiling otherwise.

    Split-K is not used for the grouped GEMM: measured on the H200 at 8-128 rows over 256 experts it was
    never faster than the unsplit decode tiling (the experts' column tiles already fill the SMs)."""
    return PREFILL_CONFIG if num_rows >= 64 * num_groups else DECODE_CONFIG


def _num_items(cfg: Fp8GemmConfig, num_rows: int, n: int) -> int:
    return -(-num_rows // cfg.tile_m) * -(-n // cfg.tile_n)


def dense_config(num_rows: int, n: int, k: int) -> Fp8GemmConfig:
    """Tiling of the dense GEMM (one group):
    - ``DENSE_CONFIG`` when its tiles make two waves over the SMs (``SHORT_K_CONFIG`` when K is short);
    - ``NARROW_CONFIG`` for more rows than one decode tile while its tiles fill at least half the SMs;
    - otherwise (a few rows: decode's projections) the 64 x 256 decode tiling: unsplit when its column
      tiles fill half the SMs (N = 24576: split-K's fp32 partials cost more than the idle SMs; measured
      by GPU time at M = 1 and 64, 13.5 / 12.4 us unsplit against 15.7-27.8 split and 18.4 / 21.1 for
      the 128 x 128 tile), else with K split until the items cover every SM, using the smallest split
      (at most 16, dividing the K blocks) that does, else the largest there is (N = 1536 and 7168:
      1.3-2.7x faster than unsplit)."""
    if _num_items(DENSE_CONFIG, num_rows, n) >= 2 * num_sms():
        return SHORT_K_CONFIG if num_blocks(k) <= SHORT_K_BLOCKS else DENSE_CONFIG
    if num_rows > DECODE_CONFIG.tile_m and 2 * _num_items(NARROW_CONFIG, num_rows, n) >= num_sms():
        return NARROW_CONFIG
    items = _num_items(DECODE_CONFIG, num_rows, n)
    if 2 * items >= num_sms():
        return DECODE_CONFIG
    splits = [d for d in range(1, 17) if num_blocks(k) % d == 0]
    enough = [d for d in splits if items * d >= num_sms()]
    return dataclasses.replace(DECODE_CONFIG, k_splits=enough[0] if enough else splits[-1])


def _epilogue_cols(dtype) -> int:
    """Columns per epilogue store: one scale block's 128 for 2-byte outputs, 64 for fp32 partials
    (keeps the split-K decode tiling inside shared memory)."""
    return _SCALE_N if jnp.dtype(dtype).itemsize <= 2 else _SCALE_N // 2


def _aligned(offset, multiple: int):
    """``offset`` with its alignment told to the compiler (static offsets need no hint)."""
    return offset if isinstance(offset, int) else pl.multiple_of(offset, multiple)


def _work_item(lin, first_tile, num_row_tiles, n_tiles: int, cfg: Fp8GemmConfig):
    """(K slice, row tile, column tile) of work item ``lin`` among ``num_row_tiles`` row tiles starting
    at ``first_tile``: K slice fastest, then the band order of ``cfg.band`` (see Fp8GemmConfig)."""
    split, rest = lin % cfg.k_splits, lin // cfg.k_splits
    if cfg.band == 1:
        return split, first_tile + rest // n_tiles, rest % n_tiles
    band = rest // (cfg.band * n_tiles)
    start = band * cfg.band
    rows_here = jnp.minimum(cfg.band, num_row_tiles - start)  # the last band may be short
    local = rest - band * cfg.band * n_tiles
    return split, first_tile + start + local % rows_here, local // rows_here


def _kernel_body(
    counts_gmem,
    meta_gmem,
    ws_gmem,
    x_gmem,
    xs_gmem,
    w_gmem,
    out_gmem,
    *,
    cfg: Fp8GemmConfig,
    n_tiles: int,
    k_steps: int,
):
    """``out_gmem`` is ``[k_splits, M, N]``; ``k_steps`` counts the 128-wide K blocks of one slice."""
    tm, tn, wg_n = cfg.tile_m, cfg.tile_n, cfg.wg_n
    n_parts = wg_n // _SCALE_N  # wgmmas (and scale promotions) per warpgroup per K step
    ks = cfg.k_splits
    k_len = k_steps * _BK
    out_dtype = out_gmem.dtype
    epi = _epilogue_cols(out_dtype)
    swizzle = 128  # 128 fp8 bytes per K row of a tile
    fp8_tf = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))

    stages = min(cfg.max_concurrent_steps, k_steps)
    chain = cfg.chain and k_steps % stages == 0
    # The activation tile and its scales are multicast to the cluster's CTAs (same row tile).
    shared = ("cluster",) if cfg.cluster_n > 1 else None

    def make_pipeline(step, ctx, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tm, _BK), lambda k: (0, k), transforms=fp8_tf, collective_axes=shared),
                plgpu.BlockSpec((tn, _BK), lambda k: (0, k), transforms=fp8_tf),
                plgpu.BlockSpec((1, tm), lambda k: (k, 0), collective_axes=shared),
            ],
            wg_axis="wg",
            num_compute_wgs=_NUM_COMPUTE_WGS,
            max_concurrent_steps=stages,
            compute_context=ctx,
            pipeline_state=state,
        )

    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=make_pipeline(ignore, ignore).get_allocations(
            x_gmem.at[:, pl.ds(0, k_len)], w_gmem.at[0, :, pl.ds(0, k_len)], xs_gmem.at[pl.ds(0, k_steps)]),
        out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, _WG_M, epi), out_dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        n_real = counts_gmem[0]
        n_tail = counts_gmem[1]
        # This warpgroup's first row and first column inside a CTA tile.
        wg_r0 = wg * _WG_M if cfg.wg_split == "m" else 0
        wg_c0 = wg * wg_n if cfg.wg_split == "n" else 0

        def tile(lin, first_tile, num_row_tiles):
            """This warpgroup's view of work item ``lin`` (a cluster's item: this CTA's column tile)."""
            split, mi, ni = _work_item(lin, first_tile, num_row_tiles, n_tiles // cfg.cluster_n, cfg)
            if cfg.cluster_n > 1:
                ni = ni * cfg.cluster_n + lax.axis_index("cluster")
            row0 = pl.multiple_of(meta_gmem[ROW0, mi], tm)  # tiles start on tile_m boundaries
            col0 = ni * tn + wg_c0
            return dict(g=meta_gmem[GROUP, mi], row0=row0, lo=meta_gmem[LO, mi], hi=meta_gmem[HI, mi], ni=ni,
                        split=split, wg_row0=row0 + wg_r0, n_blk=col0 // _SCALE_N, col0=col0)

        def store(accs, t):
            """Write this warpgroup's valid rows of the tile (a ladder of power-of-two TMA stores), in
            ``epi``-column chunks through shared memory."""
            o_smem = out_smem.at[wg]
            r_lo = jnp.clip(t["lo"] - t["wg_row0"], 0, _WG_M)
            size = jnp.clip(t["hi"] - t["wg_row0"], 0, _WG_M) - r_lo
            for j, acc in enumerate(accs):
                for c in range(_SCALE_N // epi):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores done reading
                    o_smem[...] = acc[:, c * epi:(c + 1) * epi].astype(out_dtype)
                    plgpu.commit_smem()
                    store_rows(o_smem, out_gmem.at[t["split"]], t["wg_row0"], r_lo, size,
                               t["col0"] + j * _SCALE_N + c * epi, _WG_M)

        def zero_accs():
            zero = jnp.full((_WG_M, _SCALE_N), 0, dtype=jnp.float32)
            return tuple(plgpu.layout_cast(zero, plgpu.Layout.WGMMA) for _ in range(n_parts))

        items = n_tiles // cfg.cluster_n * ks  # per row tile, per cluster

        @plgpu.nd_loop((n_real * items,), collective_axes="sm")
        def _matmuls(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            t = tile(lin, 0, n_real)
            g, kb0 = t["g"], t["split"] * k_steps
            wg_rows = pl.ds(_aligned(wg_r0, _WG_M), _WG_M)

            def ctx(eval_pipeline):
                store(eval_pipeline(zero_accs()), t)

            def step(idxs, x_smem, w_smem, xs_smem, accs):
                (k,) = idxs
                # Scales are loaded before the wgmmas are issued so their latency hides behind them.
                x_scale = plgpu.load(xs_smem.at[0, wg_rows], layout=plgpu.Layout.WGMMA.reduce(1))
                scales = [x_scale * ws_gmem[g, t["n_blk"] + j, kb0 + k] for j in range(n_parts)]
                out = []
                for j in range(n_parts):
                    b_rows = pl.ds(_aligned(wg_c0 + j * _SCALE_N, _SCALE_N), _SCALE_N)
                    b = w_smem.at[b_rows].transpose((1, 0))

                    def block_product(acc_ref, b=b):
                        plgpu.wgmma(acc_ref, x_smem.at[wg_rows], b)
                        return acc_ref[...]

                    part = pl.run_scoped(block_product, plgpu.ACC((_WG_M, _SCALE_N), jnp.float32))
                    out.append(accs[j] + part * lax.broadcast_in_dim(scales[j], (_WG_M, _SCALE_N), [0]))
                return tuple(out)

            k0 = pl.multiple_of(kb0 * _BK, _BK)
            refs = (x_gmem.at[pl.ds(t["row0"], tm), pl.ds(k0, k_len)],
                    w_gmem.at[g, pl.ds(t["ni"] * tn, tn), pl.ds(k0, k_len)],
                    xs_gmem.at[pl.ds(kb0, k_steps), pl.ds(t["row0"], tm)])
            run_tile_pipeline(make_pipeline, step, ctx, refs, allocs, info, chain)

        @plgpu.nd_loop((n_tail * items,), collective_axes="sm")
        def _zero_tail(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            t = tile(lin, n_real, n_tail)

            @pl.when(wg < _NUM_COMPUTE_WGS)
            def _():
                store(zero_accs(), t)

        plgpu.wait_smem_to_gmem(0)


def _check_inputs(x_fp8, x_scale, w_fp8, w_scale, group_sizes, *, grouped: bool = True) -> None:
    """Grouped weights are [E, N, K] with scales [E, Nb, Kb]; with ``grouped=False`` the caller passed
    [N, K] / [Nb, Kb] and added the group axis, so messages show the shapes it passed."""
    def shown(shape):
        return shape if grouped else shape[1:]

    if x_fp8.ndim != 2 or x_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"x_fp8 must be [M, K] float8_e4m3fn, got {x_fp8.shape} {x_fp8.dtype}")
    if w_fp8.ndim != 3 or w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"w_fp8 must be {'[E, N, K]' if grouped else '[N, K]'} float8_e4m3fn, got "
                         f"{shown(w_fp8.shape)} {w_fp8.dtype}")
    m, k = x_fp8.shape
    e, n, k2 = w_fp8.shape
    if k != k2:
        raise ValueError(f"K mismatch: x_fp8 {x_fp8.shape} vs w_fp8 {shown(w_fp8.shape)}")
    if x_scale.shape != (m, num_blocks(k)):
        raise ValueError(f"x_scale must be {(m, num_blocks(k))} for x_fp8 {x_fp8.shape}, got {x_scale.shape}")
    want_ws = (e, num_blocks(n), num_blocks(k))
    if w_scale.shape != want_ws:
        raise ValueError(f"w_scale must be {shown(want_ws)} for w_fp8 {shown(w_fp8.shape)}, got "
                         f"{shown(w_scale.shape)}")
    check_group_sizes(group_sizes, e)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def fp8_grouped_gemm(
    x_fp8: jax.Array,
    x_scale: jax.Array,
    w_fp8: jax.Array,
    w_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    config: Fp8GemmConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped FP8 GEMM: ``out[r] = x[r] @ w[e(r)].T`` with DeepSeek block scales.

    Args:
      x_fp8: ``[M, K]`` float8_e4m3fn, rows sorted by group (expert).
      x_scale: ``[M, ceil(K/128)]`` float32 per-token, per-128-channel scales.
      w_fp8: ``[E, N, K]`` float8_e4m3fn (HF ``[out, in]`` per expert).
      w_scale: ``[E, ceil(N/128), ceil(K/128)]`` float32 (HF ``weight_scale_inv``).
      group_sizes: ``[E]`` int rows per group; rows at or past the sum are output as zeros.
      out_dtype: output dtype.
      config: tiling; by default picked from the average rows per group.
      interpret: run in Pallas GPU interpret mode; None: when the backend is not a GPU
        (``pallas_kernels.interpret``).

    Returns:
      ``[M, N]`` in ``out_dtype``.
    """
    _check_inputs(x_fp8, x_scale, w_fp8, w_scale, group_sizes)
    m, e = x_fp8.shape[0], w_fp8.shape[0]
    if 0 in (m, e, *w_fp8.shape[1:]):  # no rows, no groups, no columns or an empty sum: all zeros
        return jnp.zeros((m, w_fp8.shape[1]), out_dtype)

    def row_tiles(padded_rows: int, tile_m: int):
        meta, _ = tile_metadata(group_sizes, padded_rows, tile_m)
        # Padding rows (padded_rows > m) belong to the zero tail: the group sizes sum to at most m.
        return meta, tile_counts(meta, e)

    return _launch(x_fp8, x_scale, w_fp8, w_scale, row_tiles, out_dtype=jnp.dtype(out_dtype),
                   cfg=config or default_config(m, e), interpret=resolve_interpret(interpret))


def _launch(x_fp8, x_scale, w_fp8, w_scale, row_tiles, *, out_dtype, cfg: Fp8GemmConfig, interpret: bool):
    """Pad, lay out the scales, and run the kernel; ``row_tiles(padded_rows, tile_m)`` gives the row
    tiles' ``(meta, counts)`` (``group_tiles.tile_metadata`` / ``tile_counts``)."""
    m, k = x_fp8.shape
    n = w_fp8.shape[1]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    # Pad only odd shapes (DeepSeek's are all multiples of 128): K to a whole scale block, N to a
    # whole tile, M to whole 8-row TMA tiles and at least one row tile (``padded_rows``; a partial row
    # tile at the end reads zeros past it). Padding is zeros, which adds nothing to the products.
    kp, np_ = round_up(k, _BK), round_up(n, cfg.tile_n * cfg.cluster_n)
    mp = padded_rows(m, cfg.tile_m)
    x = pad_axis(pad_axis(x_fp8, 1, kp), 0, mp)
    w = pad_axis(w_fp8, 1, np_) if np_ != n else w_fp8
    w = pad_axis(w, 2, kp)
    ws = pad_axis(w_scale.astype(jnp.float32), 1, np_ // _SCALE_N)
    # Scales transposed to [Kb, M] so one TMA copy brings a K block's scales for a whole row tile.
    xs = pad_axis(x_scale.astype(jnp.float32).T, 1, round_up(mp, cfg.tile_m))
    meta, counts = row_tiles(mp, cfg.tile_m)
    if (kp // _BK) % cfg.k_splits:
        raise ValueError(f"k_splits={cfg.k_splits} does not divide K={kp} into whole {_BK}-wide blocks")
    kernel_dtype = jnp.dtype(jnp.float32) if cfg.k_splits > 1 else out_dtype
    body = functools.partial(_kernel_body, cfg=cfg, n_tiles=np_ // cfg.tile_n,
                             k_steps=kp // _BK // cfg.k_splits)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((cfg.k_splits, mp, np_), kernel_dtype),
        # Persistent: one CTA per SM (clusters of cluster_n CTAs); two "SMs" when interpreted.
        grid=((2 if interpret else num_sms()) // cfg.cluster_n,),
        grid_names=("sm",),
        cluster=(cfg.cluster_n,) if cfg.cluster_n > 1 else (),
        cluster_names=("cluster",) if cfg.cluster_n > 1 else (),
        num_threads=_NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    planes = kernel(counts, meta, ws, x, xs, w)[:, :m, :n]  # sliced first: the sum reads only real rows
    return planes[0] if cfg.k_splits == 1 else jnp.sum(planes, axis=0).astype(out_dtype)


def check_dense_inputs(x_fp8: jax.Array, x_scale: jax.Array, w_fp8: jax.Array, w_scale: jax.Array) -> None:
    """One clear error for arguments a dense FP8 GEMM (``fp8_gemm``, ``fp8_small_m``) cannot take."""
    if w_fp8.ndim != 2:
        raise ValueError(f"w_fp8 must be [N, K], got shape {w_fp8.shape}")
    if w_scale.ndim != 2:
        raise ValueError(f"w_scale must be [ceil(N/128), ceil(K/128)], got shape {w_scale.shape}")
    _check_inputs(x_fp8, x_scale, w_fp8[None], w_scale[None], jnp.zeros((1,), jnp.int32), grouped=False)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def fp8_gemm(
    x_fp8: jax.Array,
    x_scale: jax.Array,
    w_fp8: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    config: Fp8GemmConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Dense FP8 GEMM ``x [M, K] @ w [N, K].T`` with block scales: the grouped kernel with one group,
    its row tiles computed on the host (``group_tiles.dense_tile_metadata``)."""
    check_dense_inputs(x_fp8, x_scale, w_fp8, w_scale)
    m = x_fp8.shape[0]
    if 0 in (m, *w_fp8.shape):  # no rows, no columns or an empty sum over K: all zeros
        return jnp.zeros((m, w_fp8.shape[0]), out_dtype)

    def row_tiles(padded_rows: int, tile_m: int):
        del padded_rows  # rows past m are padding, sliced off: no zero tail needed
        meta, counts = dense_tile_metadata(m, tile_m)
        return jnp.asarray(meta), jnp.asarray(counts)

    return _launch(x_fp8, x_scale, w_fp8[None], w_scale[None], row_tiles, out_dtype=jnp.dtype(out_dtype),
                   cfg=config or dense_config(m, w_fp8.shape[0], w_fp8.shape[1]),
                   interpret=resolve_interpret(interpret))


def fp8_linear(
    x: jax.Array,
    w_fp8: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype: jnp.dtype | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """A linear layer of an FP8 checkpoint: quantize ``x [..., K]`` (1x128 groups), then :func:`fp8_gemm`."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_act(x.reshape(-1, k), block=BLOCK)
    out = fp8_gemm(xq, xs, w_fp8, w_scale, out_dtype=out_dtype or x.dtype, interpret=interpret)
    return out.reshape(*lead, w_fp8.shape[0])


def fp8_grouped_linear(
    x: jax.Array,
    w_fp8: jax.Array,
    w_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype | None = None,
    config: Fp8GemmConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Experts' GEMM from bf16 rows sorted by expert: quantize ``x [M, K]``, then :func:`fp8_grouped_gemm`."""
    xq, xs = quantize_act(x, block=BLOCK)
    return fp8_grouped_gemm(
        xq, xs, w_fp8, w_scale, group_sizes, out_dtype=out_dtype or x.dtype, config=config,
        interpret=interpret,
    )
