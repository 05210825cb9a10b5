"""Tests for the FP8-page MLA kernel (`pallas_kernels.mla_decode_fp8`), reached as the model reaches it:
`mla_prefill.mla_prefill` / `mla_chunk_attention(use_kernel=True)` on `mla_common.Fp8Pages`.

CPU: lowering for Hopper at real shapes (Mosaic GPU's TMA, layout and shared-memory checks run there) with
the shared-memory bytes measured, and the Pallas GPU interpreter (NaN-filled scratch and outputs) against
the fp32 reference on the same FP8 pages. GPU (marked): real shapes against the reference.

The bound: both sides read the same e4m3 bytes and scales, so the format's error is not in it; the kernel
rounds q, the dequantized values, P and the output to bf16: max|out - ref| / max|ref| <= 2^-6 as in
benchmarks/kv_fp8_gpu.py (ERR_BOUND, derived in its docstring).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_decode_fp8
from pallas_kernels.mla_common import LATENT_DIM, PAGE_SIZE, ROPE_DIM, Fp8Pages, dequantize_kv, quantize_kv
from pallas_kernels.mla_prefill import mla_chunk_attention, mla_prefill
from pallas_kernels.mla_reference import mla_prefill_reference

SCALE = 192**-0.5
ERR_BOUND = 2.0**-6
SMEM_LIMIT = 232_448  # Hopper's opt-in shared memory per block (227 KiB), what Mosaic GPU checks against


def _pages(rng, num_pages):
    """FP8 pages of N(0, 1) latents with a per-token magnitude spread (so block scales differ)."""
    mag = np.exp2(rng.uniform(-2, 2, (num_pages, PAGE_SIZE, 1)))
    lat = rng.standard_normal((num_pages, PAGE_SIZE, LATENT_DIM)) * mag
    rope = rng.standard_normal((num_pages, PAGE_SIZE, ROPE_DIM))
    return quantize_kv(jnp.asarray(lat, jnp.float32), jnp.asarray(rope, jnp.float32))


def _queries(rng, b, t, h):
    ql = jnp.asarray(rng.standard_normal((b, t, h, LATENT_DIM)), jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((b, t, h, ROPE_DIM)), jnp.bfloat16)
    return ql, qr


def _reference(ql, qr, pages, table, start, chunk):
    kv = dequantize_kv(pages, ROPE_DIM, jnp.float32)
    return jax.jit(lambda *a: mla_prefill_reference(*a, softmax_scale=SCALE))(
        ql.astype(jnp.float32), qr.astype(jnp.float32), kv, table, start, chunk)


def _reference_by_rows(ql, qr, pages, table, start, chunk, rows: int = 16):
    """`_reference` over blocks of `rows` sequences, each on only the pages it reads: at B=128, S=32K the
    whole pool dequantized to fp32 is ~10 GB, more than a test worker's share of an H100."""
    outs, lses = [], []
    for i in range(0, table.shape[0], rows):
        used = table[i:i + rows]
        sub = Fp8Pages(*(x[used.reshape(-1)] for x in pages))
        sub_table = jnp.arange(used.size, dtype=jnp.int32).reshape(used.shape)
        rs = slice(i, i + rows)
        o, l = _reference(ql[rs], qr[rs], sub, sub_table, start[rs], chunk[rs])
        outs.append(np.asarray(o))
        lses.append(np.asarray(l))
    return np.concatenate(outs), np.concatenate(lses)


def _check(out, lse, ref_out, ref_lse, chunk):
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    valid = np.arange(out.shape[1])[None, :] < np.asarray(chunk)[:, None]
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert not out[~valid].any() and np.all(lse[~valid] == -np.inf)  # padding rows: 0 / -inf
    err = np.max(np.abs(out[valid] - ref_out[valid])) / np.max(np.abs(ref_out[valid]))
    assert err <= ERR_BOUND, f"max relative error {err:.2e}"
    # lse: the scores' bf16 rounding (q and the dequantized cache) at |scores| up to ~10 here.
    np.testing.assert_allclose(lse[valid], ref_lse[valid], atol=6e-2, rtol=5e-3)


def _fp8_args(b, h, s, t=1):
    sds = jax.ShapeDtypeStruct
    n = s // PAGE_SIZE
    pages = Fp8Pages(sds((b * n, PAGE_SIZE, LATENT_DIM), jnp.float8_e4m3fn),
                     sds((b * n, LATENT_DIM // 128, PAGE_SIZE), jnp.float32),
                     sds((b * n, PAGE_SIZE, ROPE_DIM), jnp.bfloat16))
    return (sds((b, t, h, LATENT_DIM), jnp.bfloat16), sds((b, t, h, ROPE_DIM), jnp.bfloat16), pages,
            sds((b, n), jnp.int32), sds((b,), jnp.int32), sds((b,), jnp.int32))


def _lower(args):
    f = jax.jit(lambda *a: mla_prefill(*a, softmax_scale=SCALE, interpret=False))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("h,t", [(16, 1), (128, 1), (16, 3)])
def test_fp8_kernel_lowers_for_hopper(h, t):
    """Real shapes (B=2, a 4K-token table; decode and MTP): Mosaic GPU's lowering checks the TMA copies
    of the three FP8 leaves, the swizzled tilings, the wgmma operands and the 227 KiB limit."""
    assert "mosaic_gpu" in _lower(_fp8_args(2, h, 4096, t))


def test_fp8_kernel_shared_memory_budget(monkeypatch):
    """The module docstring's budget: 224,768 bytes of buffers and reduction scratch; Mosaic's total
    (barriers and alignment included) measured by lowering against a zero bound, under the 232,448 of a
    Hopper block, with room for less than a second rope slot (8,192)."""
    import jax.experimental.mosaic.gpu.core as mgpu_core

    assert mla_decode_fp8.smem_bytes() == 224_768
    monkeypatch.setattr(mgpu_core, "_SMEM_SIZE_BOUND", 0)
    with pytest.raises(ValueError, match="exceeds available shared memory") as e:
        _lower(_fp8_args(2, 16, 4096))
    used = int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))
    assert mla_decode_fp8.smem_bytes() <= used <= SMEM_LIMIT < used + 8192, used


# (heads, queries, start positions, chunk lengths, splits): decode, ragged, MTP causal, chunk padding.
CASES = [
    (16, 1, [150, 40, 0], [1, 1, 1], 1),  # decode, ragged lengths incl. a single token, one split
    (16, 1, [299, 64], [1, 1], 2),  # 5 pages (every ring slot reused) in two splits; a split past a page end
    (16, 3, [130, 61], [3, 2], 2),  # MTP: 3 queries causal among themselves, one padding row
    (128, 2, [70, 10], [2, 1], None),  # H=128: four row tiles, automatic splits, padding
]


@pytest.mark.parametrize("h,t,start,chunk,splits", CASES)
def test_fp8_kernel_matches_reference_interpret(h, t, start, chunk, splits):
    rng = np.random.default_rng(h + t + len(start))
    b = len(start)
    ends = [s + c for s, c in zip(start, chunk)]
    npg = [-(-e // PAGE_SIZE) for e in ends]
    num_pages = sum(npg) + 2
    pages = _pages(rng, num_pages)
    perm = rng.permutation(num_pages)
    table = np.full((b, max(npg) + 1), num_pages + 5, np.int32)  # past the pool: clamped, never attended
    k = 0
    for i, n in enumerate(npg):
        table[i, :n] = perm[k : k + n]
        k += n
    table = jnp.asarray(table)
    ql, qr = _queries(rng, b, t, h)
    sp, cl = jnp.asarray(start, jnp.int32), jnp.asarray(chunk, jnp.int32)
    out, lse = mla_prefill(ql, qr, pages, table, sp, cl, softmax_scale=SCALE, interpret=True,
                           num_splits=splits)
    assert out.shape == ql.shape and out.dtype == jnp.bfloat16 and lse.shape == ql.shape[:-1]
    _check(out, lse, *_reference(ql, qr, pages, table, sp, cl), cl)


# Long rows among short ones with long-row splits forced at small sizes (a row is long past 2 pages a base
# split), through mla_decode's plans: (heads, lengths, SplitPlan fields).
FP8_LONG_CASES = [
    (16, [900, 40, 1300, 1], (1, 2, 3, 2)),  # two long rows, 3 long CTAs each; a short and a 1-token row
    (16, [900, 40], (1, 2, 3, 2, 20)),  # one long row takes all 6 long CTAs
    (128, [640, 0, 200], (1, 3, 2, 1, 6)),  # H=128 (two tiles), an empty row, two long rows
]


@pytest.mark.parametrize("h,lens,plan", FP8_LONG_CASES)
def test_fp8_long_row_splits_match_reference(h, lens, plan):
    """The FP8-page kernel runs mla_decode's work lists: long rows' pages shared by more CTAs and merged
    back (`attend_items`), decode rows (one query at the row's end), against the fp32 reference."""
    from pallas_kernels.mla_decode import SplitPlan

    rng = np.random.default_rng(sum(lens) + h)
    b = len(lens)
    npg = [max(1, -(-n // PAGE_SIZE)) for n in lens]
    num_pages = sum(npg)
    pages = _pages(rng, num_pages)
    perm = rng.permutation(num_pages)
    table = np.zeros((b, max(npg)), np.int32)
    k = 0
    for i, n in enumerate(npg):
        table[i, :n] = perm[k : k + n]
        k += n
    table = jnp.asarray(table)
    ql, qr = _queries(rng, b, 1, h)
    seq = jnp.asarray(lens, jnp.int32)
    start = jnp.maximum(seq - 1, 0)
    cl = (seq > 0).astype(jnp.int32)
    out, lse = jax.jit(lambda *a: mla_decode_fp8.paged_mla_fp8_attention(
        *a, softmax_scale=SCALE, interpret=True, plan=SplitPlan(*plan), valid_queries=cl))(
        ql, qr, pages, table, start, seq)
    _check(out, lse, *_reference(ql, qr, pages, table, start, cl), cl)


def test_fp8_kernel_clamps_page_ids_like_the_reference():
    """Page ids outside the pool read the nearest end page in both (mla_common.clamp_page_ids)."""
    rng = np.random.default_rng(3)
    pages = _pages(rng, 3)
    table = jnp.asarray([[-4, 7]], jnp.int32)
    ql, qr = _queries(rng, 1, 1, 16)
    sp, cl = jnp.asarray([100], jnp.int32), jnp.asarray([1], jnp.int32)
    out, lse = mla_chunk_attention(ql, qr, pages, table, sp, cl, softmax_scale=SCALE, use_kernel=True,
                                   interpret=True)
    _check(out, lse, *_reference(ql, qr, pages, table, sp, cl), cl)


def test_each_kernel_takes_only_its_cache():
    """mla_decode's kernel refuses FP8 pages (it would misread them) and the FP8-page kernel a value cache;
    mla_prefill routes each to its kernel (the tests above)."""
    from pallas_kernels.mla_decode import paged_mla_partials

    args = _fp8_args(2, 16, 256)
    ql, qr, pages, table, sp, cl = (jnp.zeros(a.shape, a.dtype) if not isinstance(a, Fp8Pages) else
                                    Fp8Pages(*(jnp.zeros(x.shape, x.dtype) for x in a)) for a in args)
    with pytest.raises(ValueError, match="FP8 pages go to the FP8-page kernel"):
        paged_mla_partials(ql, qr, pages, table, sp, cl, softmax_scale=SCALE,
                           interpret=False)
    values = jnp.zeros((pages.num_pages, PAGE_SIZE, LATENT_DIM + ROPE_DIM), jnp.bfloat16)
    with pytest.raises(ValueError, match="FP8 pages go to the FP8-page kernel"):
        mla_decode_fp8.paged_mla_fp8_partials(ql, qr, values, table, sp, cl,
                                              softmax_scale=SCALE, interpret=False)


def _device_pages(key, num_pages: int, block: int = 4096) -> Fp8Pages:
    """`_pages` drawn on the device `block` pages at a time (the fp32 draw of 64K pages is 8.6 GB)."""
    quantize = jax.jit(quantize_kv)
    parts = []
    for i, start in enumerate(range(0, num_pages, block)):
        k = jax.random.split(jax.random.fold_in(key, i), 3)
        m = min(block, num_pages - start)
        mag = jnp.exp2(jax.random.uniform(k[0], (m, PAGE_SIZE, 1), minval=-2.0, maxval=2.0))
        parts.append(quantize(jax.random.normal(k[1], (m, PAGE_SIZE, LATENT_DIM)) * mag,
                              jax.random.normal(k[2], (m, PAGE_SIZE, ROPE_DIM))))
    return Fp8Pages(*(jnp.concatenate(xs) for xs in zip(*parts)))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128])
@pytest.mark.parametrize("b,s", [(1, 32768), (64, 4096), (128, 4096), (128, 32768)])
def test_fp8_kernel_gpu_real_shapes(h, b, s):
    rng = np.random.default_rng(h * 7 + b)
    n = s // PAGE_SIZE
    k = jax.random.key(b + h)  # on the device: the pool is GBs at B=128, S=32K
    pages = _device_pages(k, b * n + 1)
    table = jnp.asarray(rng.permutation(np.arange(1, b * n + 1)).reshape(b, n), jnp.int32)
    ql, qr = _queries(rng, b, 1, h)
    sp = jnp.asarray(rng.integers(s // 2, s, b), jnp.int32).at[0].set(s - 1)
    cl = jnp.ones((b,), jnp.int32)
    out, lse = jax.jit(lambda *a: mla_chunk_attention(*a, softmax_scale=SCALE, use_kernel=True))(
        ql, qr, pages, table, sp, cl)
    _check(out, lse, *_reference_by_rows(ql, qr, pages, table, sp, cl), cl)
