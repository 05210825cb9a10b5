"""Tests for the MLA attention kernels (`pallas_kernels.mla_decode`, `mla_prefill`) and their references.

CPU: the Pallas kernels run under the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`, which fills
kernel outputs and shared memory with NaN first, so an element the kernel fails to write shows up as
NaN) against the `jnp` references evaluated in fp32. GPU (marked): real DeepSeek shapes. The product
kernel only; the kernel lab (`pallas_kernels.experimental.mla_variants`) is `tests/test_mla_variants.py`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_common import KV_DIM, PAGE_SIZE
from pallas_kernels.mla_decode import merge_splits, mla_decode, paged_mla_partials, query_tiles
from pallas_kernels.mla_prefill import mla_chunk_attention, mla_prefill
from pallas_kernels.mla_reference import (
    mla_decode_reference,
    mla_prefill_reference,
    paged_attention_reference,
)

PAGE = PAGE_SIZE
SCALE = 192**-0.5


def _make_cache(rng, lens, *, dtype=jnp.bfloat16, extra_pages=3, poison_unused=True):
    """Shuffled page table covering `lens`; pages no sequence owns are NaN (must never be read)."""
    pages_per_seq = [max(1, math.ceil(n / PAGE)) for n in lens]
    max_pages = max(pages_per_seq) + 1  # one table column past every sequence's last page
    num_pages = sum(pages_per_seq) + extra_pages
    perm = rng.permutation(num_pages)
    table = np.full((len(lens), max_pages), perm[-1], np.int32)  # unused entries -> an unowned page
    kv = rng.standard_normal((num_pages, PAGE, KV_DIM)).astype(np.float32)
    used = set()
    k = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = perm[k : k + n]
        used.update(perm[k : k + n].tolist())
        k += n
    if poison_unused:
        for p in range(num_pages):
            if p not in used:
                kv[p] = np.nan
    return jnp.asarray(kv, dtype), jnp.asarray(table)


def _queries(rng, shape, dtype=jnp.bfloat16):
    lat = jnp.asarray(rng.standard_normal((*shape, 512)), dtype)
    rope = jnp.asarray(rng.standard_normal((*shape, 64)), dtype)
    return lat, rope


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


def _assert_close(out, lse, ref_out, ref_lse, tol=2e-2, lse_atol=2e-2, lse_rtol=2e-3):
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert not np.isnan(out).any() and not np.isnan(np.asarray(lse)).any()
    err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert err <= tol, f"relative error {err:.3e}"
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=lse_atol, rtol=lse_rtol)


# Decode cases for the CPU interpreter (tests/test_mla_variants.py runs the kernel lab's designs on them).
DECODE_CASES = [
    (16, None, [1, 70, 200], None),  # ragged incl. 1 and non-multiples of 64, auto splits
    (16, None, [130, 5], 3),  # more splits than some sequences have pages (empty splits)
    (8, 3, [3, 64, 150], 2),  # several query tokens, causal among themselves
    (128, None, [100, 64], 1),  # two 64-head row tiles, one split
    (16, None, [300, 20], 1),  # 5 pages in one split: more pages than slots, every slot reused
    (128, 2, [70, 130], 2),  # MTP at H=128: four row tiles, two splits
]


def decode_case(heads, nq, lens, splits, decode=mla_decode):
    """One of DECODE_CASES through `decode` (mla_decode's signature) in the interpreter, checked for
    shapes and dtypes; returns its (out, lse) and the fp32 reference's."""
    rng = np.random.default_rng(len(lens) * 1000 + heads)
    kv, table = _make_cache(rng, lens)
    b = len(lens)
    shape = (b, heads) if nq is None else (b, nq, heads)
    ql, qr = _queries(rng, shape)
    seq = jnp.asarray(lens, jnp.int32)
    out, lse = decode(ql, qr, kv, table, seq, softmax_scale=SCALE, interpret=True, num_splits=splits)
    assert out.shape == ql.shape and out.dtype == ql.dtype and lse.shape == ql.shape[:-1]
    assert lse.dtype == jnp.float32
    ref_out, ref_lse = mla_decode_reference(*_f32(ql, qr), jnp.nan_to_num(kv.astype(jnp.float32)), table, seq,
                                            softmax_scale=SCALE)
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("heads,nq,lens,splits", DECODE_CASES)
def test_decode_matches_reference(heads, nq, lens, splits):
    out, lse, ref_out, ref_lse = decode_case(heads, nq, lens, splits)
    # The row sum l (hence lse, which weights the split merge) comes from fp32 P: ~1e-6 off here.
    _assert_close(out, lse, ref_out, ref_lse, lse_atol=1e-4, lse_rtol=0)


def partials_case(partials=paged_mla_partials):
    """Raw partials of `partials` (paged_mla_partials' signature) in the interpreter, 2 sequences (one of a
    single page) x 2 tokens x 16 heads in 3 splits, checked: every element written (no NaN although
    outputs start as NaN), and the single-page sequence's later, empty splits say so (lse -inf, out 0)."""
    rng = np.random.default_rng(7)
    lens = [1, 190]
    kv, table = _make_cache(rng, lens)
    ql, qr = _queries(rng, (2, 2, 16))
    seq = jnp.asarray(lens, jnp.int32)
    q_start = jnp.maximum(seq - 2, 0)
    out_p, lse_p = jax.jit(
        lambda *a: partials(*a, softmax_scale=SCALE, num_splits=3, interpret=True)
    )(ql, qr, kv, table, q_start, seq)
    assert out_p.shape == (2, 3, 64, 512) and lse_p.shape == (2, 3, 64)
    assert not np.isnan(np.asarray(out_p, np.float32)).any()
    assert not np.isnan(np.asarray(lse_p)).any()
    # Sequence 0 has one page: its later splits are empty and say so with lse = -inf and out = 0.
    assert np.all(np.asarray(lse_p)[0, 1:] == -np.inf)
    assert np.all(np.asarray(out_p, np.float32)[0, 1:] == 0)


def test_every_partial_element_is_written():
    """Raw kernel outputs (all splits, padding rows included) hold no NaN although they start as NaN."""
    partials_case()


def test_prefill_matches_reference():
    rng = np.random.default_rng(11)
    start = [0, 70, 100]
    chunk = [4, 3, 1]
    t = 4  # 4 tokens x 16 heads = one 64-row tile
    kv, table = _make_cache(rng, [s + c for s, c in zip(start, chunk)])
    ql, qr = _queries(rng, (3, t, 16))
    sp, cl = jnp.asarray(start, jnp.int32), jnp.asarray(chunk, jnp.int32)
    out, lse = mla_prefill(ql, qr, kv, table, sp, cl, softmax_scale=SCALE, interpret=True)
    ref_out, ref_lse = mla_prefill_reference(*_f32(ql, qr), jnp.nan_to_num(kv.astype(jnp.float32)), table,
                                             sp, cl, softmax_scale=SCALE)
    valid = np.arange(t)[None, :] < np.asarray(chunk)[:, None]
    assert np.all(np.asarray(out, np.float32)[~valid] == 0) and np.all(np.asarray(lse)[~valid] == -np.inf)
    _assert_close(np.asarray(out, np.float32)[valid], np.asarray(lse)[valid],
                  np.asarray(ref_out)[valid], np.asarray(ref_lse)[valid])


def test_reference_matches_dense_softmax():
    """The paged reference equals plain softmax attention over the contiguous sequence."""
    rng = np.random.default_rng(3)
    lens = [37, 129]
    kv, table = _make_cache(rng, lens, dtype=jnp.float32, poison_unused=False)
    ql, qr = _queries(rng, (2, 2, 4), jnp.float32)
    seq = jnp.asarray(lens, jnp.int32)
    out, lse = mla_decode_reference(ql, qr, kv, table, seq, softmax_scale=SCALE)
    for b, n in enumerate(lens):
        cache = np.asarray(kv)[np.asarray(table)[b]].reshape(-1, KV_DIM)[:n]
        for j in range(2):
            visible = n - 2 + 1 + j
            qb, rb = np.asarray(ql)[b, j], np.asarray(qr)[b, j]
            s = qb @ cache[:visible, :512].T + rb @ cache[:visible, 512:].T
            s *= SCALE
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m)
            np.testing.assert_allclose(np.asarray(lse)[b, j], (m + np.log(p.sum(-1, keepdims=True)))[:, 0],
                                       rtol=1e-5, atol=1e-5)
            want = (p / p.sum(-1, keepdims=True)) @ cache[:visible, :512]
            np.testing.assert_allclose(np.asarray(out)[b, j], want, rtol=1e-4, atol=1e-4)


def test_bad_shapes_raise():
    rng = np.random.default_rng(0)
    kv, table = _make_cache(rng, [10])
    ql, qr = _queries(rng, (1, 4))
    with pytest.raises(ValueError, match="q_rope"):
        mla_decode(ql, ql, kv, table, jnp.asarray([10]), softmax_scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="kv_pages"):
        mla_decode(ql, qr, kv[..., :512], table, jnp.asarray([10]), softmax_scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="page_size"):
        mla_decode(ql, qr, kv[:, :32], table, jnp.asarray([10]), softmax_scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="block_table"):
        mla_decode_reference(ql, qr, kv, table[:, :, None], jnp.asarray([10]), softmax_scale=SCALE)
    # Wrong types and lengths are named, in kernel and reference alike (they used to be cast or ignored).
    for fn in (mla_decode, mla_decode_reference):
        with pytest.raises(ValueError, match="block_table must be integers"):
            fn(ql, qr, kv, table.astype(jnp.float32), jnp.asarray([10]), softmax_scale=SCALE)
        with pytest.raises(ValueError, match="seq_lens must be integers"):
            fn(ql, qr, kv, table, jnp.asarray([10.0]), softmax_scale=SCALE)
        with pytest.raises(ValueError, match=r"seq_lens must be \[B=1\]"):
            fn(ql, qr, kv, table, jnp.asarray([10, 5]), softmax_scale=SCALE)
    with pytest.raises(ValueError, match="chunk_lens must be integers"):
        mla_prefill(ql[:, None], qr[:, None], kv, table, jnp.asarray([9]), jnp.asarray([1.0]),
                    softmax_scale=SCALE)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="num_splits must be a positive int"):
            mla_decode(ql, qr, kv, table, jnp.asarray([10]), softmax_scale=SCALE, num_splits=bad)


def test_out_of_range_pages_and_lengths_read_only_the_pool():
    """Page ids outside the pool take the nearest end page and positions past the table's capacity do not
    exist (`mla_common.clamp_page_ids`), in kernel and reference alike: the kernel reads nothing outside
    the pool or the table (the GPU interpreter raises on such a read; on a GPU it is a stray read)."""
    rng = np.random.default_rng(4)
    kv, table = _make_cache(rng, [150, 60], poison_unused=False)
    table = table.at[0, 1].set(10_000).at[1, 0].set(-3)
    ql, qr = _queries(rng, (2, 16))
    seq = jnp.asarray([10_000, 60], jnp.int32)  # sequence 0 claims far more than its 3 table columns
    out, lse = mla_decode(ql, qr, kv, table, seq, softmax_scale=SCALE, num_splits=2, interpret=True)
    ref_out, ref_lse = mla_decode_reference(*_f32(ql, qr, kv), table, seq, softmax_scale=SCALE)
    _assert_close(out, lse, ref_out, ref_lse, lse_atol=1e-4, lse_rtol=0)


# ----------------------------------------------------------------------------------------------- GPU


def gpu_case(rng_key, b, h, nq, max_len, ragged=True, decode=mla_decode):
    """Random cache with ragged lengths up to max_len; returns `decode`'s (mla_decode's signature) and the
    fp32 reference's results."""
    rng = np.random.default_rng(rng_key)
    lens = rng.integers(max(nq, 1), max_len + 1, size=b) if ragged else np.full(b, max_len)
    lens[0] = max_len
    kv, table = _make_cache(rng, lens.tolist(), extra_pages=1, poison_unused=False)
    ql, qr = _queries(rng, (b, nq, h) if nq > 1 else (b, h))
    seq = jnp.asarray(lens, jnp.int32)
    out, lse = decode(ql, qr, kv, table, seq, softmax_scale=SCALE)
    ref = jax.jit(lambda *a: mla_decode_reference(*a, softmax_scale=SCALE))
    ref_out, ref_lse = ref(*_f32(ql, qr, kv), table, seq)
    return out, lse, ref_out, ref_lse


@pytest.mark.gpu
@pytest.mark.parametrize("h", [128, 16])
@pytest.mark.parametrize("b,max_len", [(1, 32768), (8, 16384), (64, 4096), (128, 1024), (128, 1)])
def test_decode_gpu_real_shapes(b, h, max_len):
    out, lse, ref_out, ref_lse = gpu_case(b * 7 + h, b, h, 1, max_len)
    _assert_close(out, lse, ref_out, ref_lse)


# Ragged lengths, MTP, one short sequence (a partial page) and odd page counts; tests/test_mla_variants.py
# runs the kernel lab's designs on the same shapes.
GPU_EDGE_SHAPES = [(128, 64, 1, 4096), (16, 128, 1, 4096), (128, 8, 2, 16384), (16, 1, 1, 100),
                   (128, 3, 1, 64 * 7 + 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("h,b,nq,max_len", GPU_EDGE_SHAPES)
def test_decode_gpu_edge_shapes(h, b, nq, max_len):
    out, lse, ref_out, ref_lse = gpu_case(b * 5 + h + nq, b, h, nq, max_len)
    _assert_close(out, lse, ref_out, ref_lse)


@pytest.mark.gpu
def test_decode_gpu_mtp_and_prefill():
    out, lse, ref_out, ref_lse = gpu_case(5, 16, 128, 2, 4096)
    _assert_close(out, lse, ref_out, ref_lse)
    rng = np.random.default_rng(9)
    start, chunk = [0, 1000, 3000], [512, 300, 77]
    kv, table = _make_cache(rng, [s + c for s, c in zip(start, chunk)], poison_unused=False)
    ql, qr = _queries(rng, (3, 512, 128))
    sp, cl = jnp.asarray(start, jnp.int32), jnp.asarray(chunk, jnp.int32)
    out, lse = mla_prefill(ql, qr, kv, table, sp, cl, softmax_scale=SCALE)
    ref_out, ref_lse = jax.jit(lambda *a: mla_prefill_reference(*a, softmax_scale=SCALE))(
        *_f32(ql, qr, kv), table, sp, cl)
    valid = np.arange(512)[None, :] < np.asarray(chunk)[:, None]
    _assert_close(np.asarray(out, np.float32)[valid], np.asarray(lse)[valid],
                  np.asarray(ref_out)[valid], np.asarray(ref_lse)[valid])


@pytest.mark.gpu
@pytest.mark.parametrize("decode_len", [4096, 9000])
def test_long_rows_among_short_gpu(decode_len):
    """The stall step's shape at a 32K prefix on the GPU, default plan (`split_plan`: 1 base split, long
    rows sharing a tile's 66 CTAs by pages): 32 rows at 4K (short) or 9K (long rows too, not extended:
    unequal long CTAs per slot), 22 long rows, H=128, T=1, against the reference."""
    from pallas_kernels.mla_decode import paged_mla_attention, split_plan

    rng = np.random.default_rng(29)
    lens = [decode_len] * 32 + [32768 - 21 + i for i in range(22)]
    kv, table = _make_cache(rng, lens, extra_pages=1, poison_unused=False)
    assert split_plan(len(lens), 2, table.shape[1])[:3] == (1, 44, 3)
    ql, qr = _queries(rng, (len(lens), 1, 128))
    seq = jnp.asarray(lens, jnp.int32)
    attn = jax.jit(lambda *a: paged_mla_attention(*a, softmax_scale=SCALE))
    out, lse = attn(ql, qr, kv, table, seq - 1, seq)
    ref_out, ref_lse = jax.jit(lambda *a: paged_attention_reference(*a, softmax_scale=SCALE))(
        *_f32(ql, qr, kv), table, seq - 1, seq)
    _assert_close(out, lse, ref_out, ref_lse)


def test_paged_reference_is_shared_core():
    """Decode and prefill references are the same core with q_start = seq_lens - Q / start_pos."""
    rng = np.random.default_rng(5)
    kv, table = _make_cache(rng, [80], dtype=jnp.float32, poison_unused=False)
    ql, qr = _queries(rng, (1, 3, 2), jnp.float32)
    out_d, lse_d = mla_decode_reference(ql, qr, kv, table, jnp.asarray([80]), softmax_scale=SCALE)
    out_p, lse_p = mla_prefill_reference(ql, qr, kv, table, jnp.asarray([77]), jnp.asarray([3]),
                                         softmax_scale=SCALE)
    out_c, lse_c = paged_attention_reference(ql, qr, kv, table, jnp.asarray([77]), jnp.asarray([80]),
                                             softmax_scale=SCALE)
    np.testing.assert_allclose(out_d, out_p, rtol=1e-6)
    np.testing.assert_allclose(lse_d, lse_c, rtol=1e-6)


def test_package_level_names_are_the_kernels():
    """The issue's contract: `pallas_kernels.mla_decode(...)` etc. are callable at package level."""
    import pallas_kernels
    from pallas_kernels import fp8_gemm, fp8_quant, fp8_reference

    assert pallas_kernels.fp8_grouped_gemm is fp8_gemm.fp8_grouped_gemm
    assert pallas_kernels.quantize_weight is fp8_quant.quantize_weight
    assert pallas_kernels.fp8_grouped_gemm_reference is fp8_reference.fp8_grouped_gemm_reference
    assert pallas_kernels.mla_prefill is mla_prefill
    assert pallas_kernels.mla_decode_reference is mla_decode_reference
    rng = np.random.default_rng(7)
    kv, table = _make_cache(rng, [5, 90])
    ql, qr = _queries(rng, (2, 16))
    seq = jnp.asarray([5, 90], jnp.int32)
    out, lse = pallas_kernels.mla_decode(ql, qr, kv, table, seq, softmax_scale=SCALE, interpret=True)
    ref_out, ref_lse = pallas_kernels.mla_decode_reference(
        *_f32(ql, qr), jnp.nan_to_num(kv.astype(jnp.float32)), table, seq, softmax_scale=SCALE)
    _assert_close(out, lse, ref_out, ref_lse)


# ------------------------------------------------------------------------------ hygiene and routing


def test_decode_interpret_none_runs_on_cpu():
    """One interpret policy: interpret=None means the interpreter off a GPU, so a plain call runs here."""
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU interpret=None compiles the kernel (the GPU tests cover that)")
    rng = np.random.default_rng(21)
    lens = [3, 70]
    kv, table = _make_cache(rng, lens)
    ql, qr = _queries(rng, (2, 16))
    seq = jnp.asarray(lens, jnp.int32)
    out, lse = mla_decode(ql, qr, kv, table, seq, softmax_scale=SCALE)  # no interpret argument
    ref_out, ref_lse = mla_decode_reference(*_f32(ql, qr), jnp.nan_to_num(kv.astype(jnp.float32)), table, seq,
                                            softmax_scale=SCALE)
    _assert_close(out, lse, ref_out, ref_lse)


def test_merge_splits_is_the_log_sum_exp_merge():
    """The split merge against a numpy merge, with empty splits, fully empty rows and padding queries
    (valid_queries)."""
    rng = np.random.default_rng(4)
    b, s, nq, nh = 2, 5, 3, 8
    out_p = rng.standard_normal((b, s, 64, 512)).astype(np.float32)
    lse_p = 3 * rng.standard_normal((b, s, 64)).astype(np.float32)
    lse_p[0, 2:] = -np.inf  # empty splits
    lse_p[1, :, :nh] = -np.inf  # query 0 of sequence 1 sees nothing at all
    out_p[lse_p == -np.inf] = 0.0  # what the kernel writes for an empty split
    valid = np.asarray([3, 2], np.int32)
    out, lse = merge_splits(jnp.asarray(out_p), jnp.asarray(lse_p), nq, nh, jnp.asarray(valid))
    rows = nq * nh
    m = lse_p[:, :, :rows].max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse_p[:, :, :rows] - m)
    tot = w.sum(axis=1)
    with np.errstate(divide="ignore"):
        want_lse = np.where(tot > 0, np.log(tot) + m[:, 0], -np.inf).reshape(b, nq, nh)
    want_out = (np.einsum("bsr,bsrc->brc", w, out_p[:, :, :rows]) / np.where(tot > 0, tot, 1.0)[..., None])
    want_out = want_out.reshape(b, nq, nh, 512)
    want_out[1, 2:], want_lse[1, 2:] = 0.0, -np.inf  # padding queries of sequence 1
    assert out.shape == (b, nq, nh, 512) and lse.shape == (b, nq, nh) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(lse)[1, 0] == -np.inf) and np.all(np.asarray(out)[1, 0] == 0)
    # One split: no merge, only the padding rows dropped and the padding queries masked.
    out1, lse1 = merge_splits(jnp.asarray(out_p[:, :1]), jnp.asarray(lse_p[:, :1]), nq, nh,
                              jnp.asarray(valid))
    want1 = out_p[:, 0, :rows].reshape(b, nq, nh, 512).copy()
    want1[1, 2:] = 0.0
    np.testing.assert_array_equal(np.asarray(out1), want1)
    assert np.all(np.asarray(lse1)[1, 2:] == -np.inf)
    np.testing.assert_array_equal(np.asarray(lse1)[0], lse_p[0, 0, :rows].reshape(nq, nh))


def test_chunk_adaptor_and_model_dispatch_route_to_kernel_and_reference(caplog):
    """`mla_chunk_attention` gives kernel and reference the same arguments;
    `dsv3_jax.model.kernel_dispatch.mla_attention` routes through it (backend "pallas" runs the kernel here in
    the interpreter) and still falls back to the reference, logged, for shapes the kernel cannot take."""
    import logging

    from dsv3_jax.model import kernel_dispatch as kernels

    rng = np.random.default_rng(13)
    kv, table = _make_cache(rng, [40, 90], poison_unused=False)
    ql, qr = _queries(rng, (2, 1, 16), jnp.float32)  # a decode step: T = 1 at start_pos = len - 1
    sp, cl = jnp.asarray([39, 89], jnp.int32), jnp.ones((2,), jnp.int32)
    args = (ql, qr, kv, table, sp, cl)
    out_k, lse_k = mla_chunk_attention(*args, softmax_scale=SCALE, use_kernel=True)
    out_r, lse_r = mla_chunk_attention(*args, softmax_scale=SCALE, use_kernel=False)
    assert out_k.dtype == kv.dtype and out_r.dtype == jnp.float32  # kernel in the cache's dtype
    _assert_close(out_k, lse_k, out_r, lse_r)
    out_m, lse_m = kernels.mla_attention(*args, softmax_scale=SCALE, backend="pallas")
    np.testing.assert_array_equal(np.asarray(out_m, np.float32), np.asarray(out_k, np.float32))
    small = (ql[..., :32], qr[..., :8], kv[..., :40], table, sp, cl)  # a tiny model's widths
    kernels._log_mla_shape_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dsv3_jax.model.kernel_dispatch"):
        out_s, _ = kernels.mla_attention(*small, softmax_scale=SCALE, backend="pallas")
    assert "MLA kernel needs" in caplog.text
    ref_s, _ = mla_chunk_attention(*small, softmax_scale=SCALE, use_kernel=False)
    np.testing.assert_array_equal(np.asarray(out_s), np.asarray(ref_s))


def test_no_module_imports_a_private_name_from_another():
    """Kernel hygiene: a `_name` of one module is its own; shared helpers live in a public place (the
    experimental kernels included)."""
    import ast
    from pathlib import Path

    import pallas_kernels

    bad = []
    for path in sorted(Path(pallas_kernels.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                bad += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                # module._private (e.g. `mla_reference._as_4d`); self/cls attributes are a class's own.
                if node.attr.startswith("_") and not node.attr.startswith("__") and node.value.id not in (
                        "self", "cls"):
                    bad.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert not bad, bad


def _entry_ops(fn, *shapes) -> list[str]:
    """Names of the ops XLA (this backend) runs in the entry computation of jit(fn), minus plumbing."""
    import re

    text = jax.jit(fn).lower(*shapes).compile().as_text()
    entry = text[text.index("ENTRY"):]
    ops = []
    for line in entry[: entry.index("\n}")].splitlines()[1:]:
        m = re.search(r"= (?:\([^=]*?\)|\S+) ([\w-]+)\(", line)
        if m and m.group(1) not in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
            ops.append(m.group(1))
    return ops


def test_glue_around_the_kernel_is_small():
    """Item 1's launch budget at batch 1-8: the q tile is one op; the split merge is plain reductions and
    no dot (8 fusions on CPU; by GPU time this two-pass form is ~4x faster than the earlier single variadic
    reduce, so launches alone are not the measure: `mla_decode.merge_splits`)."""
    sds = jax.ShapeDtypeStruct
    prep = _entry_ops(query_tiles, sds((8, 1, 16, 512), jnp.bfloat16), sds((8, 1, 16, 64), jnp.bfloat16))
    assert len(prep) == 1, prep
    merge = _entry_ops(lambda o, lse, c: merge_splits(o, lse, 1, 16, c), sds((8, 16, 64, 512), jnp.bfloat16),
                       sds((8, 16, 64), jnp.float32), sds((8,), jnp.int32))
    assert "dot" not in merge and len(merge) <= 8, merge


def decode_lowers_for_hopper(heads, decode=mla_decode):
    """`decode` (mla_decode's signature) at DeepSeek's decode shape (B=64, S=4K), lowered for CUDA."""
    sds = jax.ShapeDtypeStruct
    b, s = 64, 4096
    args = (sds((b, heads, 512), jnp.bfloat16), sds((b, heads, 64), jnp.bfloat16),
            sds((b * s // PAGE, PAGE, KV_DIM), jnp.bfloat16), sds((b, s // PAGE), jnp.int32),
            sds((b,), jnp.int32))
    f = jax.jit(lambda *a: decode(*a, softmax_scale=SCALE, interpret=False))
    assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("heads", [128, 16])
def test_decode_kernel_lowers_for_hopper(heads):
    """Ahead-of-time lowering for CUDA needs no GPU and runs Mosaic GPU's layout inference, dialect lowering
    and its 227 KiB shared-memory check: the exchange buffers fit next to the Q tile and the two pages
    (module docstring's budget), and the wgmma / load / concatenate layouts are well formed."""
    decode_lowers_for_hopper(heads)


# ------------------------------------------------------------------------------ split plan (long rows)


def test_split_plan_at_the_shapes_that_matter():
    """The static rule (`split_plan`) at the engine's shapes: H=128, T=1 is 2 row tiles a row."""
    from pallas_kernels.mla_decode import SplitPlan, choose_num_splits, split_plan

    # The stall step: 32 decode rows + a 22-token chunk (or the 128/512-token programs holding them), a
    # 2,048-page table: one base split (as before) and 44 long-row slots of 3 extra splits.
    for b in (54, 128, 512, 4096):
        assert split_plan(b, 2, 2048) == SplitPlan(1, 44, 3, 128, 66), b
    assert choose_num_splits(54, 2, 2048) == 1  # the old rule alone: a 128K row = one CTA of 2,048 pages
    # B=1 decode at 128K: 66 splits of 31-32 pages fill the GPU; no long slots.
    assert split_plan(1, 2, 2048)[:3] == (66, 0, 0)
    # Steady decode on a short-context engine (64-page table): the old rule, nothing added.
    assert split_plan(32, 2, 64)[:3] == (2, 0, 0) and split_plan(40, 2, 64)[:3] == (1, 0, 0)
    # A wide-table engine's decode program (40 rows): long slots exist (a row may be 128K) but cost only
    # when used; H=16 (1 tile) gets more slots; a prefill chunk's tiles fill the GPU alone: none.
    assert split_plan(40, 2, 2560)[:3] == (1, 40, 3)
    assert split_plan(128, 1, 2048)[:3] == (1, 88, 3)
    assert split_plan(1, 1024, 2048)[:3] == (1, 0, 0)


def test_long_rows_share_their_pages_and_short_rows_are_untouched():
    """At the stall step's lengths (32 rows of 64 pages, 22, 15, 8 or 1 of 2,048, padding rows of 0) the
    work list covers every (row, tile)'s pages exactly once, a CTA walks at most 683 (22 rows: 3 CTAs a
    tile, 132 in all), 512 (15 rows: 4, 120), 256 (8 rows: 8, 128) or 32 pages (1 row: 64, 128) where one
    walked 2,048 (1 row: 66 shares of 32 pages, the last 2 empty), and the short rows are walked as before."""
    from pallas_kernels.mla_decode import (
        item_pages,
        long_row_windows,
        row_pages,
        split_plan,
        work_items,
    )

    width, b = 2048, 128
    for chunk, most, ctas in ((22, 683, 132), (15, 512, 120), (8, 256, 128), (1, 32, 128)):
        lens = np.array([4096] * 32 + [131072 - chunk + i + 1 for i in range(chunk)] + [0] * (b - 32 - chunk),
                        np.int32)
        kv_len = jnp.asarray(lens)
        pages = row_pages(kv_len - (lens > 0), kv_len, 1, width)
        assert np.asarray(pages).tolist() == [64] * 32 + [2048] * chunk + [0] * (b - 32 - chunk)
        plan = split_plan(b, 2, width)
        long = long_row_windows(pages, plan, width)
        assert np.asarray(long.idx).tolist() == list(range(32, 32 + chunk)) + [b] * (plan.long_rows - chunk)
        items = np.asarray(work_items(b, plan, width, long))
        assert items.shape == (b * plan.num_splits + plan.long_rows * plan.long_splits, 5)
        tile_pages = np.repeat(np.asarray(pages)[:, None], 2, axis=1)
        walk = item_pages(items, tile_pages)  # [I, 2, 2]
        of_long = np.isin(items[:, 0], np.arange(32, 32 + chunk))
        assert walk[of_long][..., 1].max() == most
        long_ctas = (of_long[:, None] & (walk[..., 1] > 0)).sum()
        assert long_ctas == ctas  # the long rows' CTAs: one wave
        for row in range(b):  # each row's tiles: the items' windows tile [0, pages) without overlap
            mine = items[:, 0] == row
            for t in range(2):
                spans = sorted((f, f + c) for f, c in walk[mine, t] if c)
                covered = [p for lo, hi in spans for p in range(lo, hi)]
                assert covered == list(range(tile_pages[row, t])), (row, t)
        assert (walk[:32, :, 1] == 64).all()
        old = item_pages(work_items(b, plan._replace(long_rows=0), width), tile_pages)
        assert old[..., 1].max() == 2048


def test_more_long_rows_than_slots_takes_the_longest_and_shares_by_pages():
    from pallas_kernels.mla_decode import SplitPlan, long_row_windows

    pages = jnp.asarray([300, 10, 400, 500, 0], jnp.int32)
    head, idx, extra = long_row_windows(pages, SplitPlan(1, 2, 3), 512)
    assert np.asarray(idx).tolist() == [3, 2]  # the two longest long rows; row 0 stays whole
    # Both want far more than the 6 long CTAs allow: 3 each (L // 2), a quarter of the pages a CTA.
    assert np.asarray(extra).tolist() == [3, 3]
    assert np.asarray(head).tolist() == [512, 512, 100, 125, 512]
    # 6 CTAs to fill, shared by pages: 500 -> 3 CTAs (2 long), 400 -> 2 (1 long).
    head, idx, extra = long_row_windows(pages, SplitPlan(1, 2, 3, fill=6), 512)
    assert np.asarray(extra).tolist() == [2, 1] and np.asarray(head).tolist() == [512, 512, 200, 167, 512]
    # Many long rows and few CTAs: none extended (the base split takes everything).
    head, _, extra = long_row_windows(pages, SplitPlan(1, 2, 3, fill=2), 512)
    assert np.asarray(head).tolist() == [512] * 5 and np.asarray(extra).tolist() == [0, 0]


def _mix_walk(ndec: int, dec_len: int, chunk: int, prefix: int, b: int, width: int):
    """A ragged step's attention rows as the engine lays them out (ndec decode rows at dec_len, then a chunk
    of `chunk` tokens ending at `prefix`, padding to b rows), the default split plan's work list, and what
    each CTA walks: (items [I, 5], tile pages [b, 2], walk [I, 2, 2], one wave's even share, plan)."""
    from pallas_kernels.mla_decode import item_pages, long_row_windows, row_pages, split_plan, work_items

    lens = np.zeros(b, np.int32)
    lens[:ndec] = dec_len
    lens[ndec:ndec + chunk] = prefix - chunk + 1 + np.arange(chunk)
    kv_len = jnp.asarray(lens)
    pages = row_pages(jnp.maximum(kv_len - 1, 0), kv_len, 1, width)
    plan = split_plan(b, 2, width)
    long = long_row_windows(pages, plan, width) if plan.long_rows else None
    items = np.asarray(work_items(b, plan, width, long))
    tile_pages = np.repeat(np.asarray(pages)[:, None], 2, axis=1)
    balanced = -(-int(np.asarray(pages).sum()) // plan.fill)
    return items, tile_pages, item_pages(items, tile_pages), balanced, plan


def test_decode_rows_past_8k_do_not_starve_a_long_chunk():
    """The 128K stall run of 2026-12-06: once the 32 decode rows passed 8K tokens (129 pages) they counted
    as long rows too, 43 of them shared a tile's 66 CTAs equally (one each), and each of the chunk's rows
    was walked by one CTA a tile: 1,563-1,920 pages where 240-261 were walked while the decoders were at
    4K. Shared by pages, the chunk's rows keep their CTAs and the decode rows their one each."""
    for decode_ctx in (4096, 9000, 13000):
        for chunk, prefix, b in ((11, 100_000, 128), (8, 122_880, 40), (16, 65_536, 128), (22, 131_072, 128)):
            items, tile_pages, walk, balanced, _ = _mix_walk(32, decode_ctx, chunk, prefix, b, 2560)
            assert walk[..., 1].max() <= 1.6 * balanced, (decode_ctx, chunk, walk[..., 1].max(), balanced)
            for row in (0, 32, 31 + chunk):  # a decode row and the chunk's first and last: covered once
                mine = items[:, 0] == row
                for t in range(2):
                    spans = sorted((f, f + c) for f, c in walk[mine, t] if c)
                    assert [p for lo, hi in spans for p in range(lo, hi)] == list(range(tile_pages[row, t]))


def test_no_cta_walks_much_more_than_a_balanced_share_in_engine_mixes():
    """Over the engine's mixes (1-64 decode rows at 1K-64K beside a chunk of 1-64 tokens at a 16K-160K
    prefix, in the 40/128/512-row programs) no CTA walks more than twice a wave's even share of the pages
    (or LONG_ROW_PAGES, under which a row is not split): whole CTAs a row and one wave make ~1.94x the
    worst case (32 rows at 64K beside one 128K row: each decode row's share is 1.94 CTAs, it gets 1)."""
    import itertools

    worst = 0.0
    for dec, prefix, chunk, ndec in itertools.product((1024, 8193, 16384, 65536), (16384, 131072, 163840),
                                                      (1, 16, 64), (1, 32, 64)):
        b = next(x for x in (40, 128, 512) if x >= ndec + chunk)
        _, _, walk, balanced, plan = _mix_walk(ndec, dec, chunk, prefix, b, 2624)
        worst = max(worst, walk[..., 1].max() / max(balanced, plan.long_pages))
    assert 1.0 <= worst <= 2.0, worst


# Mixed short and long rows through the kernel with long-row splits forced at small sizes (a row is long
# past 2 pages a base split): (heads, queries, lengths, plan).
LONG_CASES = [
    (16, None, [70, 900, 5, 1500, 1], (2, 2, 3, 2)),  # two long rows, short ones, a 1-token row
    (16, None, [900, 1100, 1300], (1, 1, 3, 2)),  # more long rows than slots: the rest stay whole
    (128, None, [200, 640, 0], (1, 3, 2, 1)),  # H=128 (two tiles), an empty row, a free slot
    (128, 2, [130, 700], (2, 2, 3, 1)),  # MTP at H=128: four tiles of different causal extent
    (16, None, [900, 40, 1300], (1, 2, 3, 2, 7)),  # fill 7: 3 CTAs a long row, 2 of the 3 long splits
    (16, None, [900, 40], (1, 2, 3, 2, 20)),  # one long row takes 6 of the 6 long CTAs (more than 3)
    (16, None, [900, 40, 1300], (1, 3, 3, 2, 10)),  # two long rows, 4 long CTAs each, 1 of 9 unused
]


@pytest.mark.parametrize("heads,nq,lens,plan", LONG_CASES)
def test_long_row_splits_match_reference(heads, nq, lens, plan):
    from pallas_kernels.mla_decode import SplitPlan, paged_mla_attention

    rng = np.random.default_rng(sum(lens) + heads)
    kv, table = _make_cache(rng, lens)
    b, q = len(lens), nq or 1
    ql, qr = _queries(rng, (b, q, heads))
    seq = jnp.asarray(lens, jnp.int32)
    start = jnp.maximum(seq - q, 0)
    fn = jax.jit(lambda *a: paged_mla_attention(*a, softmax_scale=SCALE, interpret=True,
                                                plan=SplitPlan(*plan)))
    out, lse = fn(ql, qr, kv, table, start, seq)
    ref_out, ref_lse = paged_attention_reference(*_f32(ql, qr), jnp.nan_to_num(kv.astype(jnp.float32)), table,
                                                 start, seq, softmax_scale=SCALE)
    empty = np.asarray(seq) == 0
    if empty.any():  # a row with nothing to attend to: out 0, lse -inf (whatever the reference says)
        assert np.all(np.asarray(lse)[empty] == -np.inf) and np.all(np.asarray(out, np.float32)[empty] == 0)
        keep = ~empty
        out, lse, ref_out, ref_lse = out[keep], lse[keep], ref_out[keep], ref_lse[keep]
    _assert_close(out, lse, ref_out, ref_lse, lse_atol=1e-4, lse_rtol=0)
