"""Dense FP8 block-scaled GEMM for a few rows (decode), with the operands swapped, for Hopper in Pallas
Mosaic GPU.

Owns ``fp8_gemm_swap_ab`` and its split rule ``swap_ab_splits``; numerics and argument checks are those of
``fp8_gemm.fp8_gemm`` (same arguments, same result up to fp32 summation order), which owns the default
path. Experimental (``pallas_kernels.experimental``): not used by the model. On the H200 it faults the
device (CUDA_ERROR_MISALIGNED_ADDRESS) at M = 1 and 8 at all three DeepSeek shapes
(tests/test_fp8_small_m.py::test_swap_ab_gpu_at_deepseek_shapes, run in child processes); M = 64 passed.

Hypothesis for the fault (from the code, not yet confirmed on the GPU): the per-stage activation-scale
buffer is a ``(1, rows)`` fp32 TMA block, ``4 * rows`` bytes, and the pipeline's stages sit back to back
in shared memory. A TMA destination in shared memory must be 128-byte aligned; at rows = 8 (M = 1..8
padded to wgmma's N of 8) a stage is 32 bytes, so stages 1..3 of each ring start 32, 64, 96 bytes into
it, while at rows = 64 a stage is 256 bytes and every start is aligned. (The product kernel's scale
block is ``(1, tile_m)`` with tile_m = 64 or 128, always a multiple of 128 bytes.) Padding the scale
block to 32 columns (128 bytes) while keeping the activation tile at 8 rows would test it.

Why: with M <= 64 rows, the normal tiling puts the rows in the wgmma M dimension, which is always 64, so
the activation tile is padded to 64 rows and every CTA owns 256 output columns (96 CTAs at N = 24576, 6 at
N = 1536, then split over K with fp32 partial planes). Here the kernel computes ``out^T = W x^T``: each
compute warpgroup takes 64 weight rows as the wgmma A operand and the few activation rows as the B operand
(wgmma N: the rows padded only to a multiple of 8), so a CTA owns 128 output columns (twice the CTAs at the
same N, fewer K splits) and reads an activation tile of 8-64 rows instead of 64.

Kernel shape: grid (column tile, K slice), three warpgroups: one issues the TMA loads of a
``max_concurrent_steps``-deep pipeline (``plgpu.emit_pipeline_warp_specialized``), two multiply. Per K
block, each compute warpgroup multiplies its weight rows [64, 128] by the activation tile [rows, 128]^T
into a fresh fp32 product, then promotes it into the running sum with ``w_scale`` (one scalar: the CTA's
128 rows are one scale block) times ``x_scale`` (one value per column of the product, i.e. per activation
row). The epilogue stores the [64, rows] sum transposed into shared memory, so one TMA copy writes the
[rows, 64] block of ``out``. With K split in S slices the kernel writes fp32 planes [S, N, rows] (not
transposed: see ``_kernel``) that one XLA reduction sums, as the normal tiling does.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_gemm import check_dense_inputs
from pallas_kernels.group_tiles import num_sms, pad_axis, round_up
from pallas_kernels.interpret import resolve_interpret

SWAP_MAX_ROWS = 64  # rows this kernel takes (the wgmma N it pads them to stays <= 64)
_WG_ROWS = 64  # weight rows per compute warpgroup: wgmma M
_TILE_N = 2 * _WG_ROWS  # output columns per CTA: one 128-row weight-scale block
_BK = 128  # K per pipeline step: one scale block
_ROW_ALIGN = 8  # wgmma N granularity
_MAX_SPLITS = 16


def swap_ab_splits(n_tiles: int, k_blocks: int, sms: int | None = None) -> int:
    """K slices for ``n_tiles`` column tiles: none while the tiles fill half the SMs, else the smallest
    divisor of ``k_blocks`` (at most 16) that gives every SM an item, else the largest divisor there is."""
    sms = sms or num_sms()
    if 2 * n_tiles >= sms:
        return 1
    splits = [d for d in range(1, _MAX_SPLITS + 1) if k_blocks % d == 0]
    enough = [d for d in splits if n_tiles * d >= sms]
    return enough[0] if enough else splits[-1]


def _kernel(ws_gmem, x_gmem, xs_gmem, w_gmem, out_gmem, *, k_steps: int, stages: int, planes: bool):
    """``out_gmem``: ``[1, rows, N]`` in the output dtype, or with ``planes`` (K split) fp32 ``[S, N, rows]``:
    Mosaic stores a wgmma-layout array transposed into shared memory only at 16 bits, so the fp32 partial
    planes keep the kernel's own orientation and the XLA reduction that sums them transposes too."""
    rows = x_gmem.shape[0]
    out_dtype = out_gmem.dtype
    fp8_tf = (plgpu.TilingTransform((8, _BK)), plgpu.SwizzleTransform(128))
    ni = lax.axis_index("n")
    split = lax.axis_index("s")
    kb0 = split * k_steps
    k0 = pl.multiple_of(kb0 * _BK, _BK)
    k_len = k_steps * _BK

    def make_pipeline(step, ctx):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((_TILE_N, _BK), lambda k: (0, k), transforms=fp8_tf),
                plgpu.BlockSpec((rows, _BK), lambda k: (0, k), transforms=fp8_tf),
                plgpu.BlockSpec((1, rows), lambda k: (k, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=ctx,
        )

    ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the body
    refs = (w_gmem.at[pl.ds(ni * _TILE_N, _TILE_N), pl.ds(k0, k_len)], x_gmem.at[:, pl.ds(k0, k_len)],
            xs_gmem.at[pl.ds(kb0, k_steps)])

    @functools.partial(
        pl.run_scoped,
        allocs=make_pipeline(ignore, ignore).get_allocations(*refs),
        out_smem=plgpu.SMEM((2, _WG_ROWS, rows) if planes else (2, rows, _WG_ROWS), out_dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        w_rows = pl.ds(pl.multiple_of(wg * _WG_ROWS, _WG_ROWS), _WG_ROWS)

        def ctx(eval_pipeline):
            zero = plgpu.layout_cast(jnp.zeros((_WG_ROWS, rows), jnp.float32), plgpu.Layout.WGMMA)
            acc = eval_pipeline(zero)
            o_smem = out_smem.at[wg]
            col0 = pl.multiple_of(ni * _TILE_N + wg * _WG_ROWS, _WG_ROWS)
            if planes:
                o_smem[...] = acc
                dst = out_gmem.at[split, pl.ds(col0, _WG_ROWS)]
            else:
                o_smem.T[...] = acc.astype(out_dtype)  # [64 weight rows, rows] -> out block [rows, 64]
                dst = out_gmem.at[0, :, pl.ds(col0, _WG_ROWS)]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, dst)
            plgpu.wait_smem_to_gmem(0)

        def step(idxs, w_smem, x_smem, xs_smem, acc):
            (k,) = idxs
            # Scales are read before the wgmma is issued so their latency hides behind it.
            row_scale = plgpu.load(xs_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0)) * ws_gmem[ni, kb0 + k]

            def block_product(acc_ref):
                plgpu.wgmma(acc_ref, w_smem.at[w_rows], x_smem.T)
                return acc_ref[...]

            part = pl.run_scoped(block_product, plgpu.ACC((_WG_ROWS, rows), jnp.float32))
            return acc + part * lax.broadcast_in_dim(row_scale, (_WG_ROWS, rows), [1])

        make_pipeline(step, ctx)(*refs, allocations=allocs)


@functools.partial(jax.jit, static_argnames=("out_dtype", "k_splits", "stages", "interpret"))
def fp8_gemm_swap_ab(
    x_fp8: jax.Array,
    x_scale: jax.Array,
    w_fp8: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
    k_splits: int | None = None,
    stages: int = 6,
    interpret: bool | None = None,
) -> jax.Array:
    """``x [M, K] @ w [N, K].T`` with DeepSeek block scales for M <= 64, weights as the wgmma A operand.

    Arguments as ``fp8_gemm.fp8_gemm`` (``x_scale [M, ceil(K/128)]``, ``w_scale [ceil(N/128), ceil(K/128)]``);
    ``k_splits`` defaults to ``swap_ab_splits``; ``stages`` is the TMA pipeline depth (6 fit shared memory
    with the fp32 epilogue at 64 rows). Returns ``[M, N]`` in ``out_dtype``."""
    check_dense_inputs(x_fp8, x_scale, w_fp8, w_scale)
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    if m > SWAP_MAX_ROWS:
        raise ValueError(f"fp8_gemm_swap_ab takes at most {SWAP_MAX_ROWS} rows, got x_fp8 {x_fp8.shape}")
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    rows = round_up(m, _ROW_ALIGN)
    kp, np_ = round_up(k, _BK), round_up(n, _TILE_N)
    kb = kp // _BK
    if k_splits is not None and (not isinstance(k_splits, numbers.Integral) or k_splits < 1):
        raise ValueError(f"k_splits must be a positive int or None (automatic), got {k_splits!r}")
    ks = k_splits if k_splits is not None else swap_ab_splits(np_ // _TILE_N, kb)
    if kb % ks:
        raise ValueError(f"k_splits={ks} does not divide K={kp} into whole {_BK}-wide blocks")
    k_steps = kb // ks
    x = pad_axis(pad_axis(x_fp8, 1, kp), 0, rows)
    w = pad_axis(pad_axis(w_fp8, 0, np_), 1, kp)
    ws = pad_axis(pad_axis(w_scale.astype(jnp.float32), 0, np_ // _TILE_N), 1, kb)
    xs = pad_axis(pad_axis(x_scale.astype(jnp.float32), 1, kb).T, 1, rows)  # [Kb, rows]: one copy per block
    split = ks > 1
    out_type = (jax.ShapeDtypeStruct((ks, np_, rows), jnp.float32) if split
                else jax.ShapeDtypeStruct((1, rows, np_), out_dtype))
    interpret = resolve_interpret(interpret)
    out = plgpu.kernel(
        functools.partial(_kernel, k_steps=k_steps, stages=min(stages, k_steps), planes=split),
        out_type=out_type,
        grid=(np_ // _TILE_N, ks),
        grid_names=("n", "s"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(ws, x, xs, w)
    if split:  # sliced first so the sum reads only real rows and columns
        return jnp.sum(out[:, :n, :m], axis=0).T.astype(out_dtype)
    return out[0, :m, :n]
