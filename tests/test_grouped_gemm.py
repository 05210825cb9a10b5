"""The bf16/fp16 grouped GEMM (``pallas_kernels.grouped_gemm``), its reference and its dispatch.

CPU: the kernel runs in Pallas Mosaic GPU interpret mode, where output buffers start as NaN, so every
row the kernel fails to write shows up (the poisoned-output check); rows past ``sum(group_sizes)`` are
poisoned in the input too and must come back exactly zero. Both the kernel and the jnp reference are
checked against a plain numpy loop over groups. GPU (``-m gpu``, on an H200): DeepSeek-V3 shapes.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from dsv3_jax.model import kernel_dispatch as kernels
from pallas_kernels.group_tiles import tile_counts, tile_metadata
from pallas_kernels.grouped_gemm import (
    DECODE_CONFIG,
    PREFILL_CONFIG,
    GroupedGemmConfig,
    default_config,
    grouped_gemm,
    grouped_gemm_reference,
)


def _inputs(m, k, n, g, seed=0, dtype=jnp.bfloat16):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (g, n, k), jnp.float32) * 0.05).astype(dtype)
    return x, w


def _numpy_grouped(x, w, sizes):
    """The contract, spelled out: a loop over groups; rows past the groups are zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[1]))
    r = 0
    for g, s in enumerate(sizes):
        s = max(0, min(s, x.shape[0] - r))
        out[r:r + s] = x[r:r + s] @ w[g].T
        r += s
    return out


def _assert_close(out, want, rtol=1e-5):
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out)), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    np.testing.assert_allclose(out, want, rtol=rtol, atol=rtol * np.abs(want).max())


# ---------------------------------------------------------------- kernel, interpret mode on CPU


@pytest.mark.parametrize(
    "config,shape,sizes",
    [
        # empty groups, a one-row group, groups not filling a tile, tail rows past sum(group_sizes)
        (PREFILL_CONFIG, (150, 128, 256), [70, 0, 1, 50, 3]),
        # K and N not multiples of 64/128 (zero-padded inside), leading empty groups, one group spanning
        # two row tiles, CTAs with a single tile
        (DECODE_CONFIG, (90, 200, 136), [0, 0, 83, 0]),
        # one group holding every row; warpgroups stacked along M; tile pipelines chained over 3 tiles
        (GroupedGemmConfig(wg_m=64, wg_n=64, wg_split="m", max_concurrent_steps=2), (300, 128, 64),
         [0, 300, 0]),
        # split-K: four K slices summed from fp32 partial planes; a zero tail in every plane
        (GroupedGemmConfig(wg_m=64, wg_n=64, wg_split="n", max_concurrent_steps=2, k_splits=4),
         (70, 512, 128), [3, 0, 1, 40, 0, 9]),
    ],
)
def test_kernel_matches_loop_over_groups(config, shape, sizes):
    m, k, n = shape
    x, w = _inputs(m, k, n, len(sizes))
    total = sum(sizes)
    x = x.at[total:].set(jnp.nan)  # rows past the groups must never be read into an output
    gs = jnp.array(sizes, jnp.int32)
    out = grouped_gemm(x, w, gs, out_dtype=jnp.float32, config=config, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    _assert_close(out, _numpy_grouped(x.at[total:].set(0), w, sizes))
    np.testing.assert_array_equal(np.asarray(out[total:]), 0.0)


def test_kernel_unchained_bf16_out_and_gradient():
    """Tiles drained one by one (chain off), bf16 output, and jax.grad through the kernel."""
    sizes = [5, 0, 60, 1]
    x, w = _inputs(80, 64, 128, len(sizes), seed=3)
    gs = jnp.array(sizes, jnp.int32)
    cfg = GroupedGemmConfig(wg_m=64, wg_n=64, wg_split="n", max_concurrent_steps=2, chain=False)
    out, vjp = jax.vjp(lambda a, b: grouped_gemm(a, b, gs, config=cfg, interpret=True), x, w)
    assert out.dtype == jnp.bfloat16
    _assert_close(out.astype(jnp.float32), _numpy_grouped(x, w, sizes), rtol=1e-2)
    ct = jnp.ones_like(out)
    _, vjp_ref = jax.vjp(lambda a, b: grouped_gemm_reference(a, b, gs), x, w)
    for a, b in zip(vjp(ct), vjp_ref(ct)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)


def test_kernel_rejects_bad_inputs():
    x, w = _inputs(8, 64, 64, 2)
    gs = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="x must be"):
        grouped_gemm(x.astype(jnp.float32), w, gs, interpret=True)
    with pytest.raises(ValueError, match="w must be"):
        grouped_gemm(x, w.astype(jnp.float16), gs, interpret=True)
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm(x, w[:, :, :32], gs, interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_gemm(x, w, gs[:1], interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_gemm(x, w, gs.astype(jnp.float32), interpret=True)
    for bad in (gs.astype(jnp.float32), gs[:1]):  # the reference names them too (it cast floats)
        with pytest.raises(ValueError, match="group_sizes must be integer"):
            grouped_gemm_reference(x, w, bad)
    with pytest.raises(ValueError, match="wg_split"):
        GroupedGemmConfig(wg_split="k")
    with pytest.raises(ValueError, match="wg_n"):
        GroupedGemmConfig(wg_n=96)
    with pytest.raises(ValueError, match="shared memory"):
        grouped_gemm(x, w, gs, config=GroupedGemmConfig(max_concurrent_steps=8), interpret=True)
    assert grouped_gemm(x[:0], w, jnp.zeros((2,), jnp.int32), interpret=True).shape == (0, 64)


def test_configs_fit_shared_memory_and_default_choice():
    for cfg in (PREFILL_CONFIG, DECODE_CONFIG):
        assert cfg.smem_bytes(jnp.bfloat16) <= 227 * 1024
    assert default_config(65536, 256) == PREFILL_CONFIG
    assert default_config(512, 256) == DECODE_CONFIG
    assert dataclasses.replace(DECODE_CONFIG, k_splits=2).smem_bytes(jnp.float32) <= 227 * 1024
    with pytest.raises(ValueError, match="k_splits"):
        GroupedGemmConfig(k_splits=0)


def test_split_k_that_does_not_divide_k_is_refused():
    x, w = _inputs(8, 192, 64, 2)  # three 64-wide K steps
    with pytest.raises(ValueError, match="does not divide"):
        grouped_gemm(x, w, jnp.array([4, 4], jnp.int32), config=GroupedGemmConfig(k_splits=2), interpret=True)


@pytest.mark.parametrize("config,m,k,n", [(PREFILL_CONFIG, 65536, 7168, 4096),
                                          (DECODE_CONFIG, 512, 2048, 7168),
                                          (dataclasses.replace(DECODE_CONFIG, k_splits=2), 64, 7168, 4096)])
def test_kernel_lowers_for_hopper_at_deepseek_shapes(config, m, k, n):
    """Ahead-of-time lowering for CUDA needs no GPU and runs Mosaic GPU's own layout inference, dialect
    lowering and 227 KiB shared-memory check: the kernel's Hopper program is well formed (only the PTX
    passes and the run itself are left to the GPU tests)."""
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, n, k), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((256,), jnp.int32)
    f = jax.jit(lambda a, b, c: grouped_gemm(a, b, c, config=config, interpret=False))
    text = f.trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ---------------------------------------------------------------- reference


@pytest.mark.parametrize(
    "m,sizes",
    [(40, [0, 7, 0, 1, 20]), (33, [0, 0, 0]), (512, [1] * 16 + [400, 200])],
)
def test_reference_is_a_loop_over_groups(m, sizes):
    x, w = _inputs(m, 48, 24, len(sizes), seed=m, dtype=jnp.float32)
    out = grouped_gemm_reference(x, w, jnp.array(sizes, jnp.int32))
    assert out.shape == (m, 24) and out.dtype == jnp.float32
    _assert_close(out, _numpy_grouped(x, w, sizes))


def test_reference_does_not_densify_or_use_ragged_dot():
    x, w = _inputs(512, 64, 32, 64, dtype=jnp.float32)
    gs = jnp.full((64,), 8, jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda a, b: grouped_gemm_reference(a, b, gs))(x, w))
    assert "ragged_dot" not in jaxpr
    # Work is bounded by the tiles' rows (at most ~2M), never G x M.
    meta, slots = tile_metadata(gs, 512, 8)
    assert slots * 8 <= 2 * 512 + 64 * 8
    np.testing.assert_array_equal(tile_counts(meta, 64), [64, 0])


# ---------------------------------------------------------------- dispatch


def test_dispatch_runs_the_kernel_for_bf16_and_never_ragged_dot(caplog):
    sizes = [3, 0, 61]
    x, w = _inputs(70, 64, 64, 3, seed=5)
    gs = jnp.array(sizes, jnp.int32)
    want = _numpy_grouped(x, w, sizes)
    for backend in ("pallas", "reference"):
        jaxpr = str(jax.make_jaxpr(lambda *a, b=backend: kernels.grouped_matmul(*a, backend=b))(x, w, gs))
        out = kernels.grouped_matmul(x, w, gs, backend=backend)
        assert "ragged_dot" not in jaxpr
        assert ("wgmma" in jaxpr) == (backend == "pallas")  # the kernel (interpreted here)
        assert out.dtype == jnp.bfloat16
        _assert_close(out.astype(jnp.float32), want, rtol=1e-2)
    # fp32 compute has no kernel: the reference runs, and says so (once per dtype).
    kernels._log_grouped_dtype_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dsv3_jax.model.kernel_dispatch"):
        xf = x.astype(jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda *a: kernels.grouped_matmul(*a, backend="pallas"))(xf, w, gs))
        out = kernels.grouped_matmul(xf, w, gs, backend="pallas")
    assert "wgmma" not in jaxpr and "ragged_dot" not in jaxpr
    assert any("grouped GEMM kernel takes bf16/fp16" in r.getMessage() for r in caplog.records)
    _assert_close(out, _numpy_grouped(x.astype(jnp.float32), w.astype(jnp.float32), sizes), rtol=1e-4)
    assert pallas_kernels.grouped_gemm is grouped_gemm


# ---------------------------------------------------------------- GPU, DeepSeek-V3 shapes


def _load(m, e, kind, seed):
    if kind == "uniform":
        sizes = np.full(e, m // e)
        sizes[: m - sizes.sum()] += 1
        return sizes.astype(np.int32)
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, e + 1) ** 1.1
    rng.shuffle(p)
    return rng.multinomial(m, p / p.sum()).astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(7168, 4096), (2048, 7168)])
@pytest.mark.parametrize("m,load", [(64, "zipf"), (512, "uniform"), (4096, "zipf"), (65536, "uniform"),
                                    (65536, "zipf")])
def test_grouped_gemm_deepseek_shapes_gpu(k, n, m, load):
    e = 256
    sizes = _load(m, e, load, seed=k + m)
    kx, kw = jax.random.split(jax.random.key(m))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (e, n, k), jnp.bfloat16) * 0.02
    out = jax.block_until_ready(grouped_gemm(x, w, jnp.asarray(sizes)))
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    offs = np.concatenate([[0], np.cumsum(sizes)])
    num = den = 0.0
    for g in sorted({int(np.argmax(sizes)), int(np.argmin(sizes)), 0, 3, 100, e - 1}):
        lo, hi = int(offs[g]), int(offs[g + 1])
        if hi == lo:
            continue
        ref = jnp.dot(x[lo:hi].astype(jnp.float32), w[g].astype(jnp.float32).T,
                      precision=jax.lax.Precision.HIGHEST)
        num += float(jnp.sum((out[lo:hi].astype(jnp.float32) - ref) ** 2))
        den += float(jnp.sum(ref**2))
    assert (num / den) ** 0.5 <= 1e-2


@pytest.mark.parametrize("m,k,n,g", [(4, 0, 8, 2), (4, 64, 8, 0), (4, 64, 0, 2), (0, 64, 8, 2)])
def test_empty_dimensions_give_zeros(m, k, n, g):
    """An empty K (empty sums), no groups (every row past them), no columns or no rows: zeros of
    [M, N], not an error from inside the kernel's tiling."""
    out = grouped_gemm(jnp.ones((m, k), jnp.bfloat16), jnp.ones((g, n, k), jnp.bfloat16),
                       jnp.full((g,), m // max(g, 1), jnp.int32), interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert not bool(jnp.any(out != 0))
