"""FP8 block quantization and the FP8 GEMM kernels against their fp32 dequantize-then-matmul references.

CPU: the kernels run in Pallas Mosaic GPU interpret mode, which simulates TMA, barriers, wgmma and the
warp-specialized pipeline on the host; output buffers start as NaN there, so every row the kernel fails
to write shows up (the "poisoned output" check). GPU (``-m gpu``, on an H200): DeepSeek-V3 shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_gemm import (
    DECODE_CONFIG,
    DENSE_CONFIG,
    NARROW_CONFIG,
    PREFILL_CONFIG,
    SHORT_K_CONFIG,
    Fp8GemmConfig,
    _work_item,
    default_config,
    dense_config,
    fp8_gemm,
    fp8_grouped_gemm,
    fp8_grouped_linear,
    fp8_linear,
)
from pallas_kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_act,
    dequantize_weight,
    quantize_act,
    quantize_weight,
)
from pallas_kernels.fp8_reference import (
    fp8_gemm_reference,
    fp8_grouped_gemm_reference,
    fp8_grouped_linear_reference,
    fp8_linear_reference,
)
from pallas_kernels.group_tiles import dense_tile_metadata, tile_metadata


def _rand(seed, shape, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


def _roundtrip_bound(x, scale_full):
    # e4m3 keeps 3 mantissa bits: half an ulp is <= |x| / 16 for normals; subnormals step by scale*2^-9.
    return jnp.abs(x) / 16 + scale_full * 2.0**-9


# ---------------------------------------------------------------- quantization


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(4, 256), (3, 5, 300), (1, 7)])
def test_quantize_act_roundtrip(shape, ue8m0):
    x = _rand(0, shape, 3.0)
    q, s = quantize_act(x, ue8m0=ue8m0)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert s.shape == (*shape[:-1], -(-shape[-1] // 128)) and s.dtype == jnp.float32
    if ue8m0:
        np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))
    else:  # scale = amax / 448 exactly: the block's largest element maps to the largest fp8 value
        amax = jnp.max(jnp.abs(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, s.shape[-1] * 128 - shape[-1])])
                               .reshape(*s.shape, 128)), axis=-1)
        np.testing.assert_allclose(s, amax / FP8_MAX, rtol=1e-6)
    deq = dequantize_act(q, s)
    s_full = jnp.repeat(s, 128, axis=-1)[..., : shape[-1]]
    assert bool(jnp.all(jnp.abs(deq - x) <= _roundtrip_bound(x, s_full)))


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (2, 200, 300), (5, 130)])
def test_quantize_weight_roundtrip(shape, ue8m0):
    w = _rand(1, shape, 0.02)
    q, s = quantize_weight(w, ue8m0=ue8m0)
    nb, kb = -(-shape[-2] // 128), -(-shape[-1] // 128)
    assert q.shape == w.shape and s.shape == (*shape[:-2], nb, kb)
    deq = dequantize_weight(q, s)
    s_full = jnp.repeat(jnp.repeat(s, 128, axis=-2), 128, axis=-1)[..., : shape[-2], : shape[-1]]
    assert bool(jnp.all(jnp.abs(deq - w) <= _roundtrip_bound(w, s_full)))
    assert bool(jnp.all(jnp.abs(q.astype(jnp.float32)) <= FP8_MAX))


def test_quantize_zero_and_huge_blocks_stay_finite():
    x = jnp.concatenate([jnp.zeros((2, 128)), jnp.full((2, 128), 1e6)], axis=1)
    q, s = quantize_act(x)
    assert bool(jnp.all(jnp.isfinite(s))) and bool(jnp.all(s > 0))
    np.testing.assert_array_equal(q[:, :128].astype(jnp.float32), 0.0)
    np.testing.assert_allclose(dequantize_act(q, s), x, rtol=1 / 16)


def test_dequantize_rejects_wrong_scale_shape():
    q, s = quantize_weight(_rand(2, (256, 256)))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_weight(q, s[:1])
    qa, sa = quantize_act(_rand(3, (4, 256)))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_act(qa, sa[:, :1])


# ---------------------------------------------------------------- tile metadata


@pytest.mark.parametrize("sizes", [[70, 0, 1, 100, 3], [0, 0, 0, 0, 0], [128, 128, 0, 64], [1] * 9])
@pytest.mark.parametrize("tile_m", [64, 128])
def test_tile_metadata_covers_every_row_once(sizes, tile_m):
    m = 300
    meta, slots = tile_metadata(jnp.array(sizes, jnp.int32), m, tile_m)
    g, row0, lo, hi = np.asarray(meta)
    assert meta.shape == (4, slots)
    covered = np.zeros(m, int)
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    for gi, r0, a, b in zip(g, row0, lo, hi):
        if b <= a:
            continue
        assert r0 <= a < b <= r0 + tile_m and r0 % tile_m == 0
        if gi < len(sizes):
            assert starts[gi] <= a and b <= ends[gi]
        else:
            assert a >= ends[-1]  # the zero tail
        covered[a:b] += 1
    np.testing.assert_array_equal(covered, 1)


# ---------------------------------------------------------------- kernels (interpret mode on CPU)


def _grouped_inputs(m, k, n, e, seed=0):
    xq, xs = quantize_act(_rand(seed, (m, k), 2.0))
    wq, ws = quantize_weight(_rand(seed + 1, (e, n, k), 0.05))
    return xq, xs, wq, ws


def _assert_close(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize(
    "config,shape,sizes",
    [
        # empty groups, a one-row group, groups not filling a tile, tail rows past sum(group_sizes)
        (PREFILL_CONFIG, (200, 256, 256), [70, 0, 1, 100, 3]),
        # odd K and N (padded inside), leading empty groups, one group straddling two row tiles
        (DECODE_CONFIG, (90, 200, 200), [0, 0, 83, 0]),
        # split-K (fp32 partial planes, 64-column epilogue chunks), a zero tail in every plane
        (Fp8GemmConfig(wg_split="n", max_concurrent_steps=2, k_splits=4), (70, 512, 256),
         [3, 0, 1, 40, 0, 9]),
        # chained tile pipelines over several tiles per CTA (interpret mode runs 2 "SMs")
        (Fp8GemmConfig(wg_split="m", max_concurrent_steps=2, chain=True), (600, 256, 256),
         [100, 0, 300, 1, 150]),
        # 256 columns per warpgroup (two promotions per K step), bands of 3 row tiles (the last one
        # short), chained
        (Fp8GemmConfig(wg_split="m", max_concurrent_steps=2, chain=True, wg_n=256, band=3), (600, 256, 512),
         [100, 0, 300, 1, 150]),
        # decode tiling 64 x 512, N padded inside, bands of 2
        (Fp8GemmConfig(wg_split="n", max_concurrent_steps=2, wg_n=256, band=2), (90, 256, 600), [20, 0, 63]),
        # a 2-CTA cluster sharing the activation tile by TMA multicast; N padded to two tiles
        (Fp8GemmConfig(wg_split="m", max_concurrent_steps=2, wg_n=256, band=2, cluster_n=2), (300, 256, 300),
         [100, 0, 150, 7]),
    ],
)
def test_grouped_gemm_matches_reference(config, shape, sizes):
    m, k, n = shape
    xq, xs, wq, ws = _grouped_inputs(m, k, n, len(sizes))
    gs = jnp.array(sizes, jnp.int32)
    # Poison the rows past sum(group_sizes): their outputs must still be exactly zero.
    total = sum(sizes)
    xq = xq.at[total:].set(jnp.array(jnp.nan, FP8_DTYPE))
    out = fp8_grouped_gemm(xq, xs, wq, ws, gs, out_dtype=jnp.float32, config=config, interpret=True)
    ref = fp8_grouped_gemm_reference(xq.at[total:].set(0), xs, wq, ws, gs, out_dtype=jnp.float32)
    assert out.shape == (m, n)
    _assert_close(out, ref)
    np.testing.assert_array_equal(np.asarray(out[total:]), 0.0)


@pytest.mark.parametrize("band,ks,n_tiles,rows", [(1, 1, 5, 7), (3, 1, 5, 7), (4, 2, 3, 9), (8, 1, 2, 3)])
def test_work_order_visits_every_item_once(band, ks, n_tiles, rows):
    cfg = Fp8GemmConfig(band=band, k_splits=ks)
    seen = [tuple(int(v) for v in _work_item(jnp.int32(lin), 10, jnp.int32(rows), n_tiles, cfg))
            for lin in range(rows * n_tiles * ks)]
    assert sorted(seen) == [(s, 10 + m, n) for s in range(ks) for m in range(rows) for n in range(n_tiles)]
    if band > 1:  # inside a band, neighbouring items share a column (weight) tile
        assert seen[0][2] == seen[ks][2] and seen[0][1] != seen[ks][1]


@pytest.mark.parametrize("m,tile_m", [(1, 128), (64, 128), (128, 128), (4096, 128), (200, 64), (130, 128)])
def test_dense_row_tiles_are_host_constants_matching_tile_metadata(m, tile_m):
    meta, counts = dense_tile_metadata(m, tile_m)
    ref = np.asarray(tile_metadata(jnp.array([m], jnp.int32), max(m, tile_m), tile_m)[0])
    assert counts[0] == -(-m // tile_m) and counts[1] == 0  # padding rows are sliced off, not zeroed
    np.testing.assert_array_equal(meta, ref[:, :counts[0]])


def test_dense_gemm_program_has_no_tile_lookup():
    x = jax.ShapeDtypeStruct((64, 7168), FP8_DTYPE)
    xs = jax.ShapeDtypeStruct((64, 56), jnp.float32)
    w = jax.ShapeDtypeStruct((1536, 7168), FP8_DTYPE)
    ws = jax.ShapeDtypeStruct((12, 56), jnp.float32)
    f = jax.jit(lambda *a: fp8_gemm(*a, interpret=False))
    text = f.trace(x, xs, w, ws).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "searchsorted" not in text and "cumsum" not in text


def test_dense_gemm_and_linears_match_reference():
    x = _rand(5, (65, 256), 1.5).astype(jnp.bfloat16)
    wq, ws = quantize_weight(_rand(6, (128, 256), 0.05))
    out = fp8_linear(x, wq, ws, out_dtype=jnp.float32, interpret=True)  # quantize + fp8_gemm
    assert out.shape == (65, 128)
    _assert_close(out, fp8_linear_reference(x, wq, ws, out_dtype=jnp.float32))
    # grouped linear with a single-row second group
    wq3, ws3 = quantize_weight(_rand(7, (2, 128, 256), 0.05))
    gs = jnp.array([64, 1], jnp.int32)
    out = fp8_grouped_linear(x, wq3, ws3, gs, out_dtype=jnp.float32, interpret=True)
    _assert_close(out, fp8_grouped_linear_reference(x, wq3, ws3, gs, out_dtype=jnp.float32))


def test_dense_gemm_validates_and_reference_is_dequantized_matmul():
    x = _rand(8, (4, 256))
    wq, ws = quantize_weight(_rand(9, (128, 256), 0.05))
    xq, xs = quantize_act(x)
    ref = fp8_gemm_reference(xq, xs, wq, ws, out_dtype=jnp.float32)
    want = dequantize_act(xq, xs) @ dequantize_weight(wq, ws).T
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="w_fp8"):
        fp8_gemm(xq, xs, wq[None], ws, interpret=True)
    # Messages show the dense shapes the caller passed, not the one-group form the kernel runs.
    with pytest.raises(ValueError, match=r"w_scale must be \(1, 2\) for w_fp8 \(128, 256\), got \(1, 1\)"):
        fp8_gemm(xq, xs, wq, ws[:, :1], interpret=True)
    with pytest.raises(ValueError, match=r"w_fp8 must be \[N, K\] float8_e4m3fn, got \(128, 256\) bfloat16"):
        fp8_gemm(xq, xs, wq.astype(jnp.bfloat16), ws, interpret=True)


def test_grouped_gemm_rejects_bad_inputs():
    xq, xs, wq, ws = _grouped_inputs(8, 128, 128, 2)
    gs = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_grouped_gemm(xq, xs[:, :0], wq, ws, gs, interpret=True)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_grouped_gemm(xq, xs, wq, ws[:, :, :0], gs, interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        fp8_grouped_gemm(xq, xs, wq, ws, gs[:1], interpret=True)
    with pytest.raises(ValueError, match="x_fp8"):
        fp8_grouped_gemm(xq.astype(jnp.bfloat16), xs, wq, ws, gs, interpret=True)
    with pytest.raises(ValueError, match="wg_split"):
        Fp8GemmConfig(wg_split="k")
    # The reference names the same bad group sizes (it used to cast floats and take any length).
    for bad in (gs.astype(jnp.float32), gs[:1], gs[None]):
        with pytest.raises(ValueError, match="group_sizes must be integer"):
            fp8_grouped_gemm_reference(xq, xs, wq, ws, bad)


# ---------------------------------------------------------------- GPU, DeepSeek-V3 shapes


def _skewed_sizes(m, e, seed):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, e + 1) ** 1.1
    rng.shuffle(p)
    sizes = rng.multinomial(m, p / p.sum()).astype(np.int32)
    return sizes


def _sampled_rel_err(out, xq, xs, wq, ws, sizes, experts):
    offs = np.concatenate([[0], np.cumsum(sizes)])
    num = den = 0.0
    for e in experts:
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi == lo:
            continue
        ref = fp8_gemm_reference(xq[lo:hi], xs[lo:hi], wq[e], ws[e], out_dtype=jnp.float32)
        num += float(jnp.sum((out[lo:hi].astype(jnp.float32) - ref) ** 2))
        den += float(jnp.sum(ref**2))
    return (num / den) ** 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(7168, 4096), (2048, 7168)])
@pytest.mark.parametrize("m,config", [(16384, PREFILL_CONFIG), (512, DECODE_CONFIG), (512, PREFILL_CONFIG),
                                      (16384, Fp8GemmConfig("m", 4, wg_n=256, band=8, cluster_n=2)),
                                      (512, Fp8GemmConfig("m", 4, wg_n=256, band=2, chain=True)),
                                      (16384, NARROW_CONFIG)])
def test_grouped_gemm_deepseek_shapes_gpu(k, n, m, config):
    e = 256
    sizes = _skewed_sizes(m, e, seed=k + m)
    kx, kw1, kw2 = jax.random.split(jax.random.key(0), 3)
    xq, xs = quantize_act(jax.random.normal(kx, (m, k), jnp.bfloat16))
    wq = (jax.random.normal(kw1, (e, n, k), jnp.bfloat16) * 2).astype(FP8_DTYPE)
    ws = jax.random.uniform(kw2, (e, n // 128, k // 128), jnp.float32, 0.5, 1.5) * 1e-2
    out = jax.block_until_ready(fp8_grouped_gemm(xq, xs, wq, ws, jnp.asarray(sizes), config=config))
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    experts = sorted({int(np.argmax(sizes)), int(np.argmin(sizes)), 0, 3, 100, e - 1})
    assert _sampled_rel_err(out, xq, xs, wq, ws, sizes, experts) <= 1e-2


@pytest.mark.parametrize("config,m,k,n", [(PREFILL_CONFIG, 16384, 7168, 4096),
                                          (DECODE_CONFIG, 512, 2048, 7168),
                                          (Fp8GemmConfig("n", 4, k_splits=2), 64, 7168, 4096),
                                          (Fp8GemmConfig("n", 4, k_splits=8), 8, 2048, 7168),
                                          (Fp8GemmConfig("m", 4, chain=True), 16384, 7168, 4096),
                                          (SHORT_K_CONFIG, 4096, 1536, 24576),
                                          (Fp8GemmConfig("m", 4, wg_n=256, band=8, cluster_n=2, chain=True),
                                           16384, 2048, 7168)])
def test_grouped_gemm_lowers_for_hopper_at_deepseek_shapes(config, m, k, n):
    """Ahead-of-time lowering for CUDA (no GPU needed) runs Mosaic GPU's layout inference and its shared
    memory check for each tiling, split-K included."""
    x = jax.ShapeDtypeStruct((m, k), FP8_DTYPE)
    xs = jax.ShapeDtypeStruct((m, k // 128), jnp.float32)
    w = jax.ShapeDtypeStruct((256, n, k), FP8_DTYPE)
    ws = jax.ShapeDtypeStruct((256, n // 128, k // 128), jnp.float32)
    gs = jax.ShapeDtypeStruct((256,), jnp.int32)
    f = jax.jit(lambda *a: fp8_grouped_gemm(*a, config=config, interpret=False))
    assert "mosaic_gpu" in f.trace(x, xs, w, ws, gs).lower(lowering_platforms=("cuda",)).as_text()


def test_default_config_by_rows_per_expert():
    assert default_config(65536, 256) == PREFILL_CONFIG
    assert default_config(512, 256) == DECODE_CONFIG
    assert default_config(64, 256).k_splits == 1  # split-K measured slower for grouped decode


def test_dense_config_splits_k_until_every_sm_has_work():
    assert dense_config(4096, 7168, 7168) == DENSE_CONFIG  # 32 x 28 wide tiles: two waves and more
    assert dense_config(4096, 1536, 7168) == NARROW_CONFIG  # 192 wide tiles would leave a half wave
    one_row = dense_config(1, 1536, 7168)  # 6 column tiles, 56 K blocks: the largest split <= 16 is 14
    assert one_row.wg_split == "n" and one_row.k_splits == 14
    assert dense_config(64, 7168, 16384).k_splits == 8  # 28 tiles x 8 >= 132 SMs
    # 96 column tiles of 64 x 256 fill the SMs well enough: no split, and not the 128-row tile for 64 rows
    assert dense_config(64, 24576, 1536) == DECODE_CONFIG
    assert dense_config(1, 24576, 1536) == DECODE_CONFIG
    assert dense_config(4096, 24576, 1536) == SHORT_K_CONFIG  # 12 K blocks: three stages
    assert dense_config(8192, 8192, 8192) == DENSE_CONFIG


def test_grouped_reference_never_uses_ragged_dot_nor_dequantizes_every_expert():
    """The FP8 reference (the path off Hopper) is a segment matmul: one expert's weight per row tile."""
    sizes = [5, 0, 0, 40, 1, 0, 0, 0]
    xq, xs, wq, ws = _grouped_inputs(50, 256, 128, len(sizes))
    gs = jnp.array(sizes, jnp.int32)
    ref = functools.partial(fp8_grouped_gemm_reference, out_dtype=jnp.float32)
    jaxpr = jax.make_jaxpr(ref)(xq, xs, wq, ws, gs)
    assert "ragged_dot" not in str(jaxpr)
    # no fp32 array as large as every expert's weight anywhere in the program
    big = [v.aval.shape for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars
           if v.aval.dtype == jnp.float32 and v.aval.size >= wq.size]
    assert not big, big
    out = fp8_grouped_gemm_reference(xq, xs, wq, ws, gs, out_dtype=jnp.float32)
    x = np.asarray(dequantize_act(xq, xs), np.float64)
    w = np.asarray(dequantize_weight(wq, ws), np.float64)
    want = np.zeros((50, 128))
    r = 0
    for g, n in enumerate(sizes):
        want[r:r + n] = x[r:r + n] @ w[g].T
        r += n
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("m,k,n,e", [(4, 0, 8, 2), (4, 128, 8, 0), (4, 128, 0, 2), (0, 128, 8, 2)])
def test_empty_dimensions_give_zeros(m, k, n, e):
    """Empty K, no experts, no columns or no rows: zeros of [M, N] from the grouped and the dense GEMM."""
    from pallas_kernels.fp8_gemm import fp8_gemm, fp8_grouped_gemm

    kb, nb = -(-k // 128), -(-n // 128)
    x, xs = jnp.ones((m, k), FP8_DTYPE), jnp.ones((m, kb), jnp.float32)
    w, ws = jnp.ones((e, n, k), FP8_DTYPE), jnp.ones((e, nb, kb), jnp.float32)
    outs = [fp8_grouped_gemm(x, xs, w, ws, jnp.full((e,), m // max(e, 1), jnp.int32), interpret=True)]
    if e:
        outs.append(fp8_gemm(x, xs, w[0], ws[0], interpret=True))
    for out in outs:
        assert out.shape == (m, n) and out.dtype == jnp.bfloat16
        assert not bool(jnp.any(out != 0))
