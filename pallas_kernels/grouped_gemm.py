"""BF16/FP16 grouped GEMM for Hopper in Pallas Mosaic GPU (the MoE experts of a BF16 checkpoint).

Owns ``grouped_gemm`` (rows of ``x [M, K]`` sorted by group times ``w[g].T`` for ``w [G, N, K]`` in HF's
``[out, in]`` layout, read as is: no transpose copy) and its plain-``jnp`` reference
``grouped_gemm_reference``. Arrays in, arrays out; no model knowledge. The row-tile bookkeeping (which
rows a tile holds, writing back only those) is ``group_tiles``' and shared with the FP8 kernel.

Kernel shape: persistent CTAs (one per SM) walk (row tile, column tile) work items of the groups that
have rows; empty groups get no tile, so they cost nothing. Each CTA runs three warpgroups: one issues
TMA loads of the x tile ``(tile_m, 64)`` and the weight tile ``(tile_n, 64)`` (128-byte swizzle), two
issue wgmma with the weight tile as the transposed (K-major) B operand and accumulate the whole K loop
in fp32 registers. With ``chain`` the tile pipelines of one CTA run back to back (the loader fetches the
next tile's first K blocks while the current tile's epilogue runs). The epilogue writes the tile's
valid rows through shared memory in 64-column chunks with TMA stores. Rows at or past
``sum(group_sizes)`` come back as zeros. Gradients (``jax.grad``) go through the reference.

Split-K (``k_splits > 1``, a tiling option; the defaults do not use it): each work item covers one slice of K
and writes fp32 partial sums to its own ``[k_splits, M, N]`` plane, summed (and cast) in one XLA
reduction after the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.group_tiles import (
    GROUP,
    HI,
    LO,
    ROW0,
    check_group_sizes,
    num_sms,
    pad_axis,
    padded_rows,
    round_up,
    run_tile_pipeline,
    segment_matmul,
    store_rows,
    tile_counts,
    tile_metadata,
)
from pallas_kernels.interpret import resolve_interpret

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_BK = 64  # K per pipeline step: 64 two-byte values = one 128-byte swizzle row
_NUM_COMPUTE_WGS = 2
_SMEM_LIMIT = 227 * 1024  # Hopper's largest dynamic shared memory per block


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiling of the kernel.

    wg_m, wg_n: the output block one compute warpgroup accumulates (wg_m in {64, 128}; wg_n a multiple
      of 64, at most 256).
    wg_split: how the two compute warpgroups share a CTA tile: ``"m"`` stacks them along rows (CTA tile
      ``2 wg_m x wg_n``), ``"n"`` along columns (``wg_m x 2 wg_n``: fewer wasted rows when groups are small).
    max_concurrent_steps: TMA pipeline depth (K blocks in flight).
    chain: run one CTA's tile pipelines back to back (no drain between tiles); needs the number of K
      steps to be a multiple of the depth, otherwise each tile drains.
    k_splits: slices of K computed as separate work items into fp32 partial planes (1: no split).
      K (in 64-wide steps) must divide evenly; the wrapper refuses a split that does not.
    """

    wg_m: int = 128
    wg_n: int = 128
    wg_split: str = "n"
    max_concurrent_steps: int = 4
    chain: bool = True
    k_splits: int = 1

    def __post_init__(self):
        if self.wg_split not in ("m", "n"):
            raise ValueError(f"wg_split must be 'm' or 'n', got {self.wg_split!r}")
        if self.wg_m not in (64, 128):
            raise ValueError(f"wg_m must be 64 or 128, got {self.wg_m}")
        if self.wg_n % 64 or not 64 <= self.wg_n <= 256:
            raise ValueError(f"wg_n must be a multiple of 64 in [64, 256], got {self.wg_n}")
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps must be >= 1, got {self.max_concurrent_steps}")
        if self.k_splits < 1:
            raise ValueError(f"k_splits must be >= 1, got {self.k_splits}")

    @property
    def tile_m(self) -> int:
        return self.wg_m * (_NUM_COMPUTE_WGS if self.wg_split == "m" else 1)

    @property
    def tile_n(self) -> int:
        return self.wg_n * (_NUM_COMPUTE_WGS if self.wg_split == "n" else 1)

    def smem_bytes(self, out_dtype) -> int:
        """Shared memory the kernel asks for: the pipeline's stages and the epilogue's chunks."""
        stages = self.max_concurrent_steps * (self.tile_m + self.tile_n) * _BK * 2
        return stages + _NUM_COMPUTE_WGS * self.wg_m * 128  # epilogue chunks: 128 bytes per row

    def kernel_out_dtype(self, out_dtype) -> jnp.dtype:
        """What the kernel itself writes: fp32 partial sums under split-K, else the output dtype."""
        return jnp.dtype(jnp.float32) if self.k_splits > 1 else jnp.dtype(out_dtype)


# Warpgroups stacked along M (CTA 256x128): on the H200 605 TFLOP/s on gate_up and 472 on down at
# 65,536 rows, against 531 / 446 side by side along N (benchmarks/RESULTS.md, 2026-12-03).
PREFILL_CONFIG = GroupedGemmConfig(wg_m=128, wg_n=128, wg_split="m", max_concurrent_steps=4)
DECODE_CONFIG = GroupedGemmConfig(wg_m=64, wg_n=128, wg_split="n", max_concurrent_steps=4)


def default_config(num_rows: int, num_groups: int) -> GroupedGemmConfig:
    """The prefill tiling when groups average at least 96 rows, the decode tiling otherwise.

    ``k_splits`` stays 1: measured on the H200 at 8-128 rows over 256 experts, splitting K was never
    faster (the experts' column tiles already fill the SMs; benchmarks/RESULTS.md, issue 17)."""
    return PREFILL_CONFIG if num_rows >= 96 * num_groups else DECODE_CONFIG


def _epi_cols(out_dtype) -> int:
    """Epilogue chunk width: 128 bytes of output per row."""
    return 128 // jnp.dtype(out_dtype).itemsize


def _kernel_body(counts_gmem, meta_gmem, x_gmem, w_gmem, out_gmem, *, cfg: GroupedGemmConfig,
                 n_tiles: int, k_steps: int):
    """``out_gmem`` is ``[k_splits, M, N]``; ``k_steps`` counts the 64-wide steps of one K slice."""
    tm, tn, wm, wn = cfg.tile_m, cfg.tile_n, cfg.wg_m, cfg.wg_n
    ks = cfg.k_splits
    k_len = k_steps * _BK  # K columns per slice
    out_dtype = out_gmem.dtype
    epi = _epi_cols(out_dtype)
    tf = (plgpu.TilingTransform((8, _BK)), plgpu.SwizzleTransform(128))
    stages = min(cfg.max_concurrent_steps, k_steps)
    chain = cfg.chain and k_steps % stages == 0

    def make_pipeline(step, ctx, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tm, _BK), lambda k: (0, k), transforms=tf),
                plgpu.BlockSpec((tn, _BK), lambda k: (0, k), transforms=tf),
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
        allocs=make_pipeline(ignore, ignore).get_allocations(x_gmem.at[:, pl.ds(0, k_len)],
                                                             w_gmem.at[0, :, pl.ds(0, k_len)]),
        out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, wm, epi), out_dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        n_real = counts_gmem[0]
        n_tail = counts_gmem[1]

        def tile(lin):
            """(group, row0, lo, hi, column tile, this warpgroup's first row and first column, K slice).

            Work items run K slice fastest, then column tile, then row tile."""
            split, lin = lin % ks, lin // ks
            mi, ni = lin // n_tiles, lin % n_tiles
            row0 = pl.multiple_of(meta_gmem[ROW0, mi], tm)  # tiles start on tile_m boundaries
            if cfg.wg_split == "m":
                wg_row0, col0 = row0 + wg * wm, ni * tn
            else:
                wg_row0, col0 = row0, ni * tn + wg * wn
            return (meta_gmem[GROUP, mi], row0, meta_gmem[LO, mi], meta_gmem[HI, mi], ni, wg_row0, col0,
                    split)

        def store(acc, lo, hi, wg_row0, col0, split):
            """Write this warpgroup's rows [lo, hi) of the tile, one 128-byte-wide column chunk at a time."""
            o_smem = out_smem.at[wg]
            out_plane = out_gmem.at[split]
            r_lo = jnp.clip(lo - wg_row0, 0, wm)
            size = jnp.clip(hi - wg_row0, 0, wm) - r_lo
            for c in range(wn // epi):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's stores done reading
                o_smem[...] = acc[:, c * epi:(c + 1) * epi].astype(out_dtype)
                plgpu.commit_smem()
                store_rows(o_smem, out_plane, wg_row0, r_lo, size, col0 + c * epi, wm)

        @plgpu.nd_loop((n_real * n_tiles * ks,), collective_axes="sm")
        def _matmuls(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            g, row0, lo, hi, ni, wg_row0, col0, split = tile(lin)

            def ctx(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    store(acc_ref[...], lo, hi, wg_row0, col0, split)

            def step(_, x_smem, w_smem, acc_ref):
                if cfg.wg_split == "m":
                    a, b = x_smem.at[pl.ds(pl.multiple_of(wg * wm, wm), wm)], w_smem
                else:
                    a, b = x_smem, w_smem.at[pl.ds(pl.multiple_of(wg * wn, wn), wn)]
                plgpu.wgmma(acc_ref, a, b.transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            k0 = pl.multiple_of(split * k_len, _BK)
            refs = (x_gmem.at[pl.ds(row0, tm), pl.ds(k0, k_len)],
                    w_gmem.at[g, pl.ds(ni * tn, tn), pl.ds(k0, k_len)])
            run_tile_pipeline(make_pipeline, step, ctx, refs, allocs, info, chain)

        @plgpu.nd_loop((n_tail * n_tiles * ks,), collective_axes="sm")
        def _zero_tail(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            _, _, lo, hi, _, wg_row0, col0, split = tile(lin + n_real * n_tiles * ks)

            @pl.when(wg < _NUM_COMPUTE_WGS)
            def _():
                zeros = plgpu.layout_cast(jnp.full((wm, wn), 0, dtype=jnp.float32), plgpu.Layout.WGMMA)
                store(zeros, lo, hi, wg_row0, col0, split)

        plgpu.wait_smem_to_gmem(0)


def _check_inputs(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if x.ndim != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [M, K] bfloat16 or float16, got {x.shape} {x.dtype}")
    if w.ndim != 3 or w.dtype != x.dtype:
        raise ValueError(f"w must be [G, N, K] of x's dtype {x.dtype}, got {w.shape} {w.dtype}")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"K mismatch: x {x.shape} vs w {w.shape} ([G, N, K])")
    check_group_sizes(group_sizes, w.shape[0])


def _run_kernel(x, w, group_sizes, out_dtype, cfg: GroupedGemmConfig, interpret: bool) -> jax.Array:
    m, k = x.shape
    _, n, _ = w.shape
    if cfg.smem_bytes(out_dtype) > _SMEM_LIMIT:
        raise ValueError(f"config {cfg} needs {cfg.smem_bytes(out_dtype)} bytes of shared memory with "
                         f"{jnp.dtype(out_dtype).name} output; Hopper has {_SMEM_LIMIT}")
    # DeepSeek's shapes need no padding: K is a multiple of 64 and N of the tile. Odd shapes are padded
    # with zeros (a copy of the operands), which adds nothing to the products. M is padded only to whole
    # 8-row TMA tiles and at least one row tile (``padded_rows``); partial tiles at the end read past it
    # (TMA fills zeros) and store only valid rows.
    kp, np_, mp = round_up(k, _BK), round_up(n, cfg.tile_n), padded_rows(m, cfg.tile_m)
    if (kp // _BK) % cfg.k_splits:
        raise ValueError(f"k_splits={cfg.k_splits} does not divide K={kp} into whole {_BK}-wide steps")
    xp = pad_axis(pad_axis(x, 1, kp), 0, mp)
    wp = pad_axis(pad_axis(w, 2, kp), 1, np_)
    meta, _ = tile_metadata(group_sizes, mp, cfg.tile_m)  # padding rows belong to the zero tail
    counts = tile_counts(meta, w.shape[0])
    body = functools.partial(_kernel_body, cfg=cfg, n_tiles=np_ // cfg.tile_n,
                             k_steps=kp // _BK // cfg.k_splits)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((cfg.k_splits, mp, np_), cfg.kernel_out_dtype(out_dtype)),
        grid=(2 if interpret else num_sms(),),
        grid_names=("sm",),
        num_threads=_NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    planes = kernel(counts, meta, xp, wp)[:, :m, :n]  # sliced first: the sum reads only real rows
    return planes[0] if cfg.k_splits == 1 else jnp.sum(planes, axis=0).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_gemm(x, w, group_sizes, out_dtype, cfg, interpret):
    return _run_kernel(x, w, group_sizes, out_dtype, cfg, interpret)


def _grouped_gemm_fwd(x, w, group_sizes, out_dtype, cfg, interpret):
    return _run_kernel(x, w, group_sizes, out_dtype, cfg, interpret), (x, w, group_sizes)


def _grouped_gemm_bwd(out_dtype, cfg, interpret, res, ct):
    # Training is not this kernel's job: cotangents come from the reference (exact, not fast).
    x, w, group_sizes = res
    _, vjp = jax.vjp(lambda a, b: grouped_gemm_reference(a, b, group_sizes, out_dtype=out_dtype), x, w)
    dx, dw = vjp(ct)
    return dx, dw, None


_grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_gemm(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype | None = None,
    config: GroupedGemmConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped GEMM: ``out[r] = x[r] @ w[g(r)].T`` for rows sorted by group, fp32 accumulation.

    Args:
      x: ``[M, K]`` bfloat16 or float16, rows sorted by group.
      w: ``[G, N, K]`` of x's dtype (HF ``[out, in]`` per group).
      group_sizes: ``[G]`` int rows per group; rows at or past the sum come back as zeros.
      out_dtype: output dtype (default: x's).
      config: tiling; by default picked from the average rows per group.
      interpret: run in Pallas GPU interpret mode; None: when the backend is not a GPU
        (``pallas_kernels.interpret``).

    Returns:
      ``[M, N]`` in ``out_dtype``.
    """
    _check_inputs(x, w, group_sizes)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m, n = x.shape[0], w.shape[1]
    if 0 in (m, n, x.shape[1], w.shape[0]):  # no rows, no columns, an empty sum or no groups: all zeros
        return jnp.zeros((m, n), out_dtype)
    cfg = config or default_config(m, w.shape[0])
    return _grouped_gemm(x, w, group_sizes.astype(jnp.int32), out_dtype, cfg, resolve_interpret(interpret))


def grouped_gemm_reference(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """Plain-jnp grouped GEMM with :func:`grouped_gemm`'s contract, computed in fp32.

    A segment matmul over row tiles that never straddle two groups (``group_tiles.segment_matmul``):
    each tile multiplies its rows by its own group's weight only (no dense all-groups product, no
    ``ragged_dot``), so the work is at most about twice the rows' own. Any float dtypes; differentiable
    in ``x`` and ``w``.
    """
    m, k = x.shape
    g, n, k2 = w.shape
    if k != k2:
        raise ValueError(f"K mismatch: x {x.shape} vs w {w.shape} ([G, N, K])")
    check_group_sizes(group_sizes, g)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    out = segment_matmul(x.astype(jnp.float32), group_sizes, lambda gi: w[gi].astype(jnp.float32), n)
    return out.astype(out_dtype)
