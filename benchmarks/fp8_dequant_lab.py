"""Lab (issue 28 item 2): where the FP8-page MLA kernel's extra time goes, by swapping its dequantization.

Owns nothing in the product: it monkeypatches `pallas_kernels.mla_decode_fp8._dequantize_half` with
variants, retraces, and times each with the GPU clock on kv_fp8_gpu's goal shapes, beside the bf16 kernel:
  * current  - the product's (WGMMA layout, unoptimized 2-byte loads, f32 scale multiply);
  * 8bit     - WGMMA_8BIT layout (4-byte loads, scales per row in the same layout), same arithmetic;
  * noscale  - current without the scale multiply (wrong values: timing only);
  * 8bit_noscale - 8bit without the scale multiply (timing only);
  * skip     - no dequantization at all (wrong values: the cost of everything else);
  * qk8      - not a dequantization: the whole kernel swapped for `pallas_kernels.experimental.mla_fp8_qk`
               (FP8 Q K^T, two independent consumers; Q rounded to e4m3, so its check against the
               unquantized-Q reference carries that rounding too: reported, not held to the bound);
  * qk8s     - qk8 with Q as two e4m3 parts (value + residual, `q_split`): twice the FP8 Q K^T wgmmas.
Correct variants (current, 8bit) are also checked against the fp32 reference (kv_fp8_gpu.check).
`--tiny` runs the correct variants in the GPU interpreter on CPU.

    python3 benchmarks/fp8_dequant_lab.py [--variants current,8bit,noscale,skip] [--tiny]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

if "--tiny" in sys.argv:  # see kv_fp8_gpu: the GPU interpreter deadlocks on a single CPU device
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kv_fp8_gpu  # noqa: E402

from pallas_kernels import mla_decode_fp8 as fp8k  # noqa: E402
from pallas_kernels.experimental import mla_fp8_qk  # noqa: E402

_L8 = plgpu.Layout.WGMMA_8BIT


def _blocks(half: int) -> range:
    return range(half * fp8k.BLOCKS_PER_HALF, (half + 1) * fp8k.BLOCKS_PER_HALF)


def deq_8bit(lat, sc, kv, half: int) -> None:
    for j in _blocks(half):
        cols = pl.ds(fp8k.FP8_BLOCK * j, fp8k.FP8_BLOCK)
        x = plgpu.load(lat.at[:, cols], layout=_L8)
        s = plgpu.load(sc.at[j], layout=_L8.reduce(1))
        x = x.astype(jnp.float32) * lax.broadcast_in_dim(s, x.shape, [0])
        kv.at[:, cols][...] = x.astype(kv.dtype)


def deq_noscale(lat, sc, kv, half: int) -> None:
    for j in _blocks(half):
        cols = pl.ds(fp8k.FP8_BLOCK * j, fp8k.FP8_BLOCK)
        x = plgpu.load(lat.at[:, cols], layout=plgpu.Layout.WGMMA, optimized=False)
        kv.at[:, cols][...] = x.astype(jnp.float32).astype(kv.dtype)


def deq_8bit_noscale(lat, sc, kv, half: int) -> None:
    for j in _blocks(half):
        cols = pl.ds(fp8k.FP8_BLOCK * j, fp8k.FP8_BLOCK)
        kv.at[:, cols][...] = plgpu.load(lat.at[:, cols], layout=_L8).astype(jnp.float32).astype(kv.dtype)


def deq_skip(lat, sc, kv, half: int) -> None:
    del lat, sc, kv, half


VARIANTS = {"current": fp8k._dequantize_half, "8bit": deq_8bit, "noscale": deq_noscale,
            "8bit_noscale": deq_8bit_noscale, "skip": deq_skip}
CORRECT = ("current", "8bit")
# Whole-kernel swaps (the module attribute they replace), checked but not held to the dequantizing bound.
KERNELS = {"qk8": mla_fp8_qk.run_fp8qk_items,
           "qk8s": functools.partial(mla_fp8_qk.run_fp8qk_items, q_split=True)}
PRODUCT_RUN = fp8k.run_fp8_items


def check_qk8(h: int, b: int, s: int, q_split: bool) -> dict:
    """The qk8 kernel against the fp32 reference on the queries as it rounds them (held to
    kv_fp8_gpu.ERR_BOUND) and on the bf16 queries (reported: that error includes Q's e4m3 rounding)."""
    fp8, _, table, ql, qr, start, n = kv_fp8_gpu.inputs(h * 7 + b + s, h, b, s)
    out = np.asarray(jax.jit(kv_fp8_gpu.fp8_attention)(ql, qr, fp8, table, start, n), np.float32)
    ref = jax.jit(kv_fp8_gpu.fp32_reference)
    ql8, qr8 = mla_fp8_qk.dequantized_queries(ql, qr, q_split)
    errs = {}
    for key, (a, r) in {"own_queries": (ql8, qr8), "bf16_queries": (ql, qr)}.items():
        want = np.asarray(ref(a, r, fp8, table, start, n), np.float32)
        errs[key] = float(np.max(np.abs(out - want)) / np.max(np.abs(want)))
    assert np.isfinite(out).all(), f"H={h} B={b} S={s}: non-finite output"
    assert errs["own_queries"] <= kv_fp8_gpu.ERR_BOUND, f"H={h} B={b} S={s}: {errs}"
    return dict(h=h, b=b, s=s, max_rel_err=errs["own_queries"], max_rel_err_bf16_queries=errs["bf16_queries"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="current,8bit,noscale,8bit_noscale,skip")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--quick", action="store_true", help="GPU: one check, the H=128 and H=16 goal cells")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    checks = kv_fp8_gpu.TINY_CHECKS if args.tiny else [(16, 32, 4096), (128, 32, 32768), (128, 1, 4096)]
    timings = kv_fp8_gpu.TINY_TIMINGS if args.tiny else kv_fp8_gpu.TIMINGS[:3]
    if args.quick:  # one check and the two goal cells: a short device call
        checks, timings = checks[-1:], [kv_fp8_gpu.TIMINGS[1], kv_fp8_gpu.TIMINGS[0]]
    res: dict = dict(device=str(jax.devices()[0].device_kind), variants={})
    out = args.out or (os.path.join(os.environ["OUT"], "fp8_dequant_lab.json") if os.environ.get("OUT") else None)
    for name in args.variants.split(","):
        fp8k._dequantize_half = VARIANTS.get(name, VARIANTS["current"])
        fp8k.run_fp8_items = KERNELS.get(name, PRODUCT_RUN)
        jax.clear_caches()
        entry: dict = {}
        if name in CORRECT:
            entry["checks"] = [kv_fp8_gpu.check(*c) for c in checks]
        elif name in KERNELS:
            entry["checks"] = [check_qk8(*c, q_split=name == "qk8s") for c in checks]
        if not (args.tiny and name not in CORRECT and name not in KERNELS):
            entry["timings"] = [kv_fp8_gpu.timing(*t, args.tiny) for t in timings]
        res["variants"][name] = entry
        print(name, json.dumps(entry), flush=True)
        if out:  # after each variant: a run cut short keeps what it measured
            Path(out).write_text(json.dumps(res, indent=1))
    print(f"\n{'variant':>8} | " + " | ".join(f"H={h} B={b} S={s} ms (TF/s)" for h, b, s in timings))
    for name, e in res["variants"].items():
        if "timings" in e:
            print(f"{name:>8} | " + " | ".join(f"{r['fp8']['median_ms']:.3f} ({r['fp8_tflops']:.0f})"
                                            for r in e["timings"]))
    first = next(iter(res["variants"].values())).get("timings", [])
    print(f"{'bf16':>8} | " + " | ".join(f"{r['bf16']['median_ms']:.3f} ({r['bf16_tflops']:.0f})" for r in first))
    return res


if __name__ == "__main__":
    main()
