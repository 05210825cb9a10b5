"""One kernel call under Nsight Compute: warms a case up, then runs it once between cudaProfilerStart/Stop
so that `ncu --profile-from-start off` profiles exactly that call (GPU only).

Owns nothing but the choice of cases; the kernels and their inputs come from the benchmarks.

    ncu --profile-from-start off --clock-control none --set full -o mla_v2 \\
        python benchmarks/ncu_target.py mla --variant v2 --heads 128 --batch 128 --seq 4096
    ncu ... python benchmarks/ncu_target.py grouped --shape gate_up
    ncu ... python benchmarks/ncu_target.py dense --m 4096 --k 7168 --n 1536
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pallas_kernels.experimental.mla_variants import KERNEL_VARIANTS, PRODUCT_VARIANT  # noqa: E402
from pallas_kernels.experimental.mla_variants import mla_decode as lab_mla_decode  # noqa: E402
from pallas_kernels.fp8_gemm import fp8_gemm, fp8_grouped_gemm  # noqa: E402
from pallas_kernels.fp8_quant import quantize_act  # noqa: E402


def _profiled(fn, args) -> None:
    """Warm up (compile) twice, then one call inside the profiler's range."""
    import torch  # the profiler range is per process context; torch's cudart binding is at hand

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    torch.cuda.profiler.start()
    jax.block_until_ready(fn(*args))
    torch.cuda.profiler.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["mla", "grouped", "dense"])
    ap.add_argument("--variant", default=PRODUCT_VARIANT, choices=KERNEL_VARIANTS,
                    help="mla: the kernel design (the kernel lab's names; v2 is the product)")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--shape", default="gate_up", choices=["gate_up", "down"])
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--n", type=int, default=1536)
    a = ap.parse_args()
    if a.case == "mla":
        from mla_bench import SCALE, _decode_inputs

        inp = _decode_inputs(0, a.batch, a.heads, a.seq)
        fn = jax.jit(lambda *x: lab_mla_decode(*x, softmax_scale=SCALE, variant=a.variant))
        _profiled(fn, inp)
        return
    from moe_gemm_bench import SHAPES, E, group_sizes_for, random_fp8_weights

    if a.case == "grouped":
        k, n = SHAPES[a.shape]
        m, e = 65536, E
    else:
        m, k, n, e = a.m, a.k, a.n, 1
    kx, kw = jax.random.split(jax.random.key(0))
    xq, xs = quantize_act(jax.random.normal(kx, (m, k), jnp.bfloat16))
    wq, ws = random_fp8_weights(kw, e, n, k)
    if a.case == "grouped":
        gs = jnp.asarray(group_sizes_for(m, e, "uniform"))
        _profiled(jax.jit(fp8_grouped_gemm), (xq, xs, wq, ws, gs))
    else:
        _profiled(jax.jit(fp8_gemm), (xq, xs, wq[0], ws[0]))


if __name__ == "__main__":
    main()
