"""`pallas_kernels.experimental.fp8_small_m` (the swap-AB dense FP8 GEMM for <= 64 rows, experimental):
interpret-mode results against the dequantize-then-matmul reference (unsplit, split over K, odd shapes),
Hopper lowering at DeepSeek-V3's attention-projection shapes, the split rule, bad input, and the GPU at
real shapes, run in a child process: the kernel has faulted the device there (CUDA_ERROR_MISALIGNED_ADDRESS),
which poisons the process that ran it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.experimental.fp8_small_m import SWAP_MAX_ROWS, fp8_gemm_swap_ab, swap_ab_splits
from pallas_kernels.fp8_quant import FP8_DTYPE, quantize_act
from pallas_kernels.fp8_reference import fp8_gemm_reference


def _inputs(m: int, k: int, n: int, seed: int = 0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    xq, xs = quantize_act(jax.random.normal(k1, (m, k), jnp.bfloat16))
    wq = (jax.random.normal(k2, (n, k), jnp.float32) * 2).astype(FP8_DTYPE)
    ws = jax.random.uniform(k3, (-(-n // 128), -(-k // 128)), jnp.float32, 0.5, 1.5) * 1e-2
    return xq, xs, wq, ws


def _rel_err(out, ref) -> float:
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize("m,k,n,splits", [
    (1, 256, 256, None),  # one row, padded to the 8-row wgmma N
    (13, 384, 384, 3),  # K split in 3: fp32 planes summed (and transposed) by XLA
    (64, 256, 128, None),  # the most rows it takes
    (8, 200, 200, None),  # K and N padded to whole blocks
])
def test_swap_ab_matches_reference(m, k, n, splits):
    args = _inputs(m, k, n, seed=m + k)
    out = fp8_gemm_swap_ab(*args, k_splits=splits, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert not bool(jnp.isnan(out.astype(jnp.float32)).any())
    assert _rel_err(out, fp8_gemm_reference(*args, out_dtype=jnp.float32)) <= 5e-3


def test_swap_ab_split_rule():
    assert swap_ab_splits(192, 12, sms=132) == 1  # N = 24576: 192 column tiles fill the SMs already
    assert swap_ab_splits(12, 56, sms=132) == 14  # N = 1536, K = 7168: 12 x 14 = 168 items
    assert swap_ab_splits(56, 128, sms=132) == 4  # N = 7168, K = 16384: 56 x 4 = 224
    assert swap_ab_splits(1, 3, sms=132) == 3  # never enough: the largest split that divides K


def test_swap_ab_rejects_bad_input():
    xq, xs, wq, ws = _inputs(SWAP_MAX_ROWS + 1, 128, 128)
    with pytest.raises(ValueError, match="at most 64 rows"):
        fp8_gemm_swap_ab(xq, xs, wq, ws, interpret=True)
    xq, xs, wq, ws = _inputs(4, 256, 128)
    with pytest.raises(ValueError, match="w_fp8"):
        fp8_gemm_swap_ab(xq, xs, wq[None], ws, interpret=True)
    with pytest.raises(ValueError, match="k_splits=3"):
        fp8_gemm_swap_ab(xq, xs, wq, ws, k_splits=3, interpret=True)
    for bad in (0, -1):  # 0 used to mean "automatic", -1 failed deep in the pipeline
        with pytest.raises(ValueError, match="k_splits must be a positive int"):
            fp8_gemm_swap_ab(xq, xs, wq, ws, k_splits=bad, interpret=True)


@pytest.mark.parametrize("m,k,n", [(1, 7168, 1536), (64, 1536, 24576), (64, 16384, 7168)])
def test_swap_ab_lowers_for_hopper_at_deepseek_shapes(m, k, n):
    """Ahead-of-time lowering for CUDA (no GPU needed): Mosaic GPU's layout inference (it rejects, e.g., an
    fp32 transposed store) and shared-memory check, unsplit and split."""
    sds = jax.ShapeDtypeStruct
    args = (sds((m, k), FP8_DTYPE), sds((m, k // 128), jnp.float32), sds((n, k), FP8_DTYPE),
            sds((n // 128, k // 128), jnp.float32))
    f = jax.jit(lambda *a: fp8_gemm_swap_ab(*a, interpret=False))
    assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Runs in a child process (`python -c`): prints "ok <relative error>" or raises.
_GPU_CHILD = """
import sys
import jax, jax.numpy as jnp
from tests.test_fp8_small_m import _inputs, _rel_err
from pallas_kernels.experimental.fp8_small_m import fp8_gemm_swap_ab
from pallas_kernels.fp8_reference import fp8_gemm_reference
m, k, n = map(int, sys.argv[1:4])
args = _inputs(m, k, n, seed=k + n)
out = jax.block_until_ready(fp8_gemm_swap_ab(*args))
assert out.shape == (m, n), out.shape
assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))), "non-finite output"
print("ok", _rel_err(out, fp8_gemm_reference(*args, out_dtype=jnp.float32)))
"""


# Measured on the H200 (2026-12-04): M = 1 and 8 fault with CUDA_ERROR_MISALIGNED_ADDRESS (see the module's
# docstring for the hypothesis), M = 64 passes. strict: a fix makes these xfails fail, so they get removed.
_FAULTS = pytest.mark.xfail(strict=True, reason="faults on the H200 at M < 64 (misaligned address)")


@pytest.mark.gpu
@pytest.mark.experimental
@pytest.mark.parametrize("m", [pytest.param(1, marks=_FAULTS), pytest.param(8, marks=_FAULTS), 64])
@pytest.mark.parametrize("k,n", [(7168, 1536), (1536, 24576), (16384, 7168)])
def test_swap_ab_gpu_at_deepseek_shapes(m, k, n):
    """In a child process: a device fault there fails this case only, with the child's last line."""
    root = pathlib.Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", _GPU_CHILD, str(m), str(k), str(n)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    lines = (proc.stdout + proc.stderr).strip().splitlines() or ["(no output)"]
    last = [ln for ln in proc.stdout.splitlines() if ln.startswith("ok ")]
    errors = [ln.strip() for ln in lines if "error" in ln.lower()]  # the last line may be a source location
    assert proc.returncode == 0 and last, (f"child exited {proc.returncode}: {lines[-1]}"
                                           + (f" ({errors[-1][:300]})" if errors else ""))
    err = float(last[-1].split()[1])
    assert err <= 1e-2, f"relative error {err:.2e}"
