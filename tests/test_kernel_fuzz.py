"""Seeded random configurations of every public kernel against its reference.

The hand-picked cases in `test_mla_kernels.py`, `test_grouped_gemm.py`, `test_fp8_kernels.py` and
`test_fp8_small_m.py` (the experimental swap-AB kernel) cover each mechanism once; these draw shapes, ragged
lengths, split counts and group sizes at random (a fixed seed per case, shown in the test id and
the failure message), where combinations nobody thought of live: a 40-case run of this kind found that an
MLA split of more pages than ring slots failed in the GPU interpreter. Off a GPU the kernels run in Pallas'
interpreter (which checks barriers and bounds); on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.experimental.fp8_small_m import SWAP_MAX_ROWS, fp8_gemm_swap_ab
from pallas_kernels.fp8_gemm import fp8_gemm, fp8_grouped_gemm
from pallas_kernels.fp8_quant import quantize_act, quantize_weight
from pallas_kernels.fp8_reference import fp8_gemm_reference, fp8_grouped_gemm_reference
from pallas_kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.mla_prefill import mla_prefill
from pallas_kernels.mla_reference import mla_decode_reference, mla_prefill_reference
from tests.test_mla_kernels import SCALE, _assert_close, _f32, _make_cache, _queries

MLA_SEEDS = range(6)
GEMM_SEEDS = range(8)


def _mla_case(seed: int) -> dict:
    rng = np.random.default_rng(1000 + seed)
    heads = int(rng.choice([16, 32, 64, 128]))
    nq = int(rng.choice([1, 1, 2])) if heads < 128 else 1  # at most two 64-row tiles (interpreter time)
    batch = int(rng.integers(1, 4))
    return dict(
        rng=rng, heads=heads, nq=nq, lens=rng.integers(nq, 400, size=batch).tolist(),
        splits=[None, 1, 2, 3, 5][int(rng.integers(0, 5))], prefill=bool(rng.integers(0, 2)),
    )


def mla_inputs(seed: int) -> tuple[dict, np.random.Generator, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Case `seed`'s configuration, its generator (drawn on by the test) and its operands: the pool, the
    page table and the queries (`tests/test_kernel_lowering.py` lowers the same shapes for Hopper)."""
    c = _mla_case(seed)
    rng, lens, b = c.pop("rng"), c["lens"], len(c["lens"])
    kv, table = _make_cache(rng, lens)
    ql, qr = _queries(rng, (b, c["nq"], c["heads"]))
    return c, rng, kv, table, ql, qr


@pytest.mark.parametrize("seed", MLA_SEEDS)
def test_mla_random_configuration(seed):
    c, rng, kv, table, ql, qr = mla_inputs(seed)
    lens = c["lens"]
    kv_ref = jnp.nan_to_num(kv.astype(jnp.float32))  # pages no sequence owns are NaN: never to be read
    if c["prefill"]:
        chunk = [int(rng.integers(1, c["nq"] + 1)) for _ in lens]
        start = jnp.asarray([n - k for n, k in zip(lens, chunk)], jnp.int32)
        cl = jnp.asarray(chunk, jnp.int32)
        out, lse = mla_prefill(ql, qr, kv, table, start, cl, softmax_scale=SCALE, num_splits=c["splits"])
        ref_out, ref_lse = mla_prefill_reference(*_f32(ql, qr), kv_ref, table, start, cl, softmax_scale=SCALE)
        valid = np.arange(c["nq"])[None, :] < np.asarray(chunk)[:, None]
        assert np.all(np.asarray(out, np.float32)[~valid] == 0), c
        assert np.all(np.asarray(lse)[~valid] == -np.inf), c
        out, lse = np.asarray(out, np.float32)[valid], np.asarray(lse)[valid]
        ref_out, ref_lse = np.asarray(ref_out)[valid], np.asarray(ref_lse)[valid]
    else:
        seq = jnp.asarray(lens, jnp.int32)
        out, lse = mla_decode(ql, qr, kv, table, seq, softmax_scale=SCALE, num_splits=c["splits"])
        ref_out, ref_lse = mla_decode_reference(*_f32(ql, qr), kv_ref, table, seq, softmax_scale=SCALE)
    try:
        _assert_close(out, lse, ref_out, ref_lse, lse_atol=1e-4, lse_rtol=0)
    except AssertionError as e:
        raise AssertionError(f"{c}: {e}") from None


def _group_sizes(rng, rows: int, groups: int) -> np.ndarray:
    """Random sizes summing to at most `rows`: empty groups and a zero tail (rows past the sum) included."""
    cuts = np.sort(rng.integers(0, rows + 1, size=groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [rows]]))
    if rng.random() < 0.4:
        sizes[-1] = max(0, sizes[-1] - int(rng.integers(1, 4)))
    return sizes


def gemm_case(seed: int) -> dict:
    """Case `seed`'s configuration and fp32 operands: kind ("dense", "swap_ab", "fp8_grouped",
    "bf16_grouped"), rows, k, n, x [rows, k], w [n, k] or [groups, n, k], and for the grouped kinds
    group_sizes (`tests/test_kernel_lowering.py` lowers the same shapes for Hopper)."""
    rng = np.random.default_rng(2000 + seed)
    kind = ["dense", "swap_ab", "fp8_grouped", "bf16_grouped"][seed % 4]
    rows = int(rng.choice([1, 3, 8, 17, 64, 65, 130]))
    rows = min(rows, SWAP_MAX_ROWS) if kind == "swap_ab" else rows
    k = int(rng.choice([128, 200, 256, 384, 1024]))
    n = int(rng.choice([100, 128, 256, 384]))
    groups = int(rng.integers(1, 6))
    case = dict(kind=kind, rows=rows, k=k, n=n)
    case["x"] = rng.standard_normal((rows, k))
    if kind in ("dense", "swap_ab"):
        case["w"] = rng.standard_normal((n, k)) * 0.05
    else:
        case["group_sizes"] = _group_sizes(rng, rows, groups).tolist()
        case["w"] = rng.standard_normal((groups, n, k)) * 0.05
    return case


@pytest.mark.parametrize("seed", GEMM_SEEDS)
def test_gemm_random_configuration(seed):
    c = gemm_case(seed)
    kind, rows, n = c["kind"], c["rows"], c["n"]
    case = {key: c[key] for key in ("kind", "rows", "k", "n", "group_sizes") if key in c}
    x = jnp.asarray(c["x"], jnp.float32)
    if kind in ("dense", "swap_ab"):
        xq, xs = quantize_act(x)
        wq, ws = quantize_weight(jnp.asarray(c["w"], jnp.float32))
        kernel = fp8_gemm if kind == "dense" else fp8_gemm_swap_ab
        out, ref = kernel(xq, xs, wq, ws), fp8_gemm_reference(xq, xs, wq, ws)
    else:
        gs = jnp.asarray(c["group_sizes"], jnp.int32)
        w = jnp.asarray(c["w"], jnp.float32)
        if kind == "fp8_grouped":
            xq, xs = quantize_act(x)
            wq, ws = jax.vmap(quantize_weight)(w)
            out, ref = fp8_grouped_gemm(xq, xs, wq, ws, gs), fp8_grouped_gemm_reference(xq, xs, wq, ws, gs)
        else:
            xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
            out, ref = grouped_gemm(xb, wb, gs), grouped_gemm_reference(xb, wb, gs)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape == (rows, n), case
    assert not np.isnan(out).any(), case
    # Same operands, fp32 accumulation on both sides: only summation order and the bf16 output differ.
    err = np.linalg.norm(out - ref) / max(float(np.linalg.norm(ref)), 1e-30)
    assert err <= 1e-2, f"{case}: relative error {err:.2e}"
    if "group_sizes" in case:  # rows past the groups come back as zeros
        assert np.all(out[int(np.sum(case["group_sizes"])):] == 0), case
