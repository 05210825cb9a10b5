"""Benchmark of the MoE expert GEMM at DeepSeek-V3 shapes: our Pallas FP8 and BF16 grouped GEMMs beside peers.

Regimes (issue 7): prefill, M = 8192 tokens x 8 experts = 65,536 rows over E = 256 experts with uniform
and skewed loads; decode, M = 64..1024 rows over 256 experts. Shapes: gate+up K=7168 -> N=4096 and
down K=2048 -> N=7168. Peers in the same run: torch ``_scaled_grouped_mm`` (fp8 rowwise scales),
torch ``_grouped_mm`` (bf16), ``jax.lax.ragged_dot`` (bf16) and cuBLAS dense fp8 ``torch._scaled_mm``.
Each of our timings comes with a correctness check against an fp32 dequantize-then-matmul on a sample of
experts. Prints a table and writes JSON (``--out``).

BF16 (``--bf16``, issue 15): ``pallas_kernels.grouped_gemm`` tiling variants beside torch ``_grouped_mm``
bf16 on the same operands, prefill 65,536 rows (uniform and Zipf) and decode 256-1,024 rows; each timed
variant is checked against fp32 on a sample of experts; decode reports weight bytes streamed per second.

Issue 17: ``--small-m`` (8-128 rows per step, and ``--rows 256,512,1024``; split-K variants; the dense
FP8 GEMM at the attention projections' shapes beside cuBLAS) and ``--prefill`` (65,536 rows, chained
tile pipelines vs not, dense 8192^3). Timing: our calls are timed as back-to-back calls synchronised
once per sample (``inner``; 20 in ``--small-m``, 5 in the FP8 sweep), so the device, not the host's
dispatch, sets the figure, as CUDA events do for torch.

Run on an H200: ``PYTHONPATH=. python3 benchmarks/moe_gemm_bench.py --out $OUT/moe_gemm_bench.json``
(add ``--bf16`` for the BF16 kernel only).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_gemm import (
    DECODE_CONFIG,
    DENSE_CONFIG,
    NARROW_CONFIG,
    PREFILL_CONFIG,
    Fp8GemmConfig,
    fp8_gemm,
    fp8_grouped_gemm,
)
from pallas_kernels.fp8_quant import FP8_DTYPE, quantize_act
from pallas_kernels.grouped_gemm import DECODE_CONFIG as BF16_DECODE
from pallas_kernels.grouped_gemm import PREFILL_CONFIG as BF16_PREFILL
from pallas_kernels.grouped_gemm import GroupedGemmConfig, grouped_gemm

E = 256
INNER = 5  # back-to-back calls per timing sample in the main FP8 sweep (device-bound, as torch's events)
SHAPES = {"gate_up": (7168, 4096), "down": (2048, 7168)}


def group_sizes_for(m: int, e: int, load: str, seed: int = 0) -> np.ndarray:
    """Rows per expert summing to m: 'uniform' (equal split) or 'skewed' (Zipf-like, some experts empty)."""
    rng = np.random.default_rng(seed)
    if load == "uniform":
        p = np.ones(e)
    else:
        p = 1.0 / np.arange(1, e + 1) ** 1.1
        rng.shuffle(p)
    counts = rng.multinomial(m, p / p.sum()) if load != "uniform" else np.full(e, m // e)
    counts[0] += m - counts.sum()
    return counts.astype(np.int32)


def time_jax(fn, *args, iters: int = 10, warmup: int = 2, inner: int = 1) -> float:
    """Median wall-clock ms of ``fn(*args)`` (see ``time_jax_spread`` for ``inner``)."""
    return time_jax_spread(fn, *args, iters=iters, warmup=warmup, inner=inner)[0]


def time_torch(fn, iters: int = 10, warmup: int = 2, inner: int = 1) -> float:
    """Median CUDA-event ms of ``fn()`` (each sample: ``inner`` back-to-back calls, divided by ``inner``)."""
    return time_torch_spread(fn, iters=iters, warmup=warmup, inner=inner)[0]


def time_torch_spread(fn, iters: int = 10, warmup: int = 2, inner: int = 1) -> tuple[float, float, float]:
    """(median, min, max) CUDA-event ms of ``fn()``, each sample ``inner`` back-to-back calls / ``inner``."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / inner)
    return statistics.median(ts), min(ts), max(ts)


def random_fp8_weights(key, e: int, n: int, k: int):
    """Random e4m3 weights and block scales, made on device without an fp32 [E, N, K] intermediate."""
    k1, k2 = jax.random.split(key)
    w = (jax.random.normal(k1, (e, n, k), jnp.bfloat16) * 2.0).astype(FP8_DTYPE)
    ws = jax.random.uniform(k2, (e, -(-n // 128), -(-k // 128)), jnp.float32, 0.5, 1.5) * 1e-2
    return w, ws


def check_sample(out, xq, xs, wq, ws, gs: np.ndarray, experts) -> float:
    """Relative Frobenius error of ``out`` against fp32 dequantize-then-matmul on the given experts' rows."""
    offs = np.concatenate([[0], np.cumsum(gs)])
    num, den = 0.0, 0.0
    for e in experts:
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi == lo:
            continue
        x = xq[lo:hi].astype(jnp.float32) * jnp.repeat(xs[lo:hi], 128, axis=1)[:, : xq.shape[1]]
        s = jnp.repeat(jnp.repeat(ws[e], 128, axis=0), 128, axis=1)[: wq.shape[1], : wq.shape[2]]
        w = wq[e].astype(jnp.float32) * s
        ref = jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST)
        d = out[lo:hi].astype(jnp.float32) - ref
        num += float(jnp.sum(d * d))
        den += float(jnp.sum(ref * ref))
    return (num / max(den, 1e-30)) ** 0.5


def row(name, variant, ms, flops, wbytes, rel_err=None, **extra):
    r = {
        "case": name,
        "variant": variant,
        "ms": round(ms, 4),
        "tflops": round(flops / ms / 1e9, 1),
        "weight_tbps": round(wbytes / ms / 1e9, 3),
        "rel_err": rel_err,
    }
    r.update(extra)
    print(f"{name:34s} {variant:34s} {ms:9.3f} ms {r['tflops']:8.1f} TFLOP/s {r['weight_tbps']:6.2f} TB/s"
          + (f"  rel_err={rel_err:.2e}" if rel_err is not None else ""), flush=True)
    return r


def bench_case(name, m, k, n, load, configs, results, torch_peers: bool, ragged_iters: int):
    gs = group_sizes_for(m, E, load)
    active = int((gs > 0).sum())
    key = jax.random.key(hash(name) % 2**31)
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    xq, xs = quantize_act(x)
    wq, ws = random_fp8_weights(kw, E, n, k)
    gs_j = jnp.asarray(gs)
    flops = 2.0 * m * n * k
    wbytes = active * n * k  # fp8 weight bytes of experts that have rows
    sample = [int(np.argmax(gs)), int(np.argmin(gs)), 1, 7, E - 1]
    for cfg in configs:
        f = jax.jit(lambda a, b, c, d, g, cfg=cfg: fp8_grouped_gemm(a, b, c, d, g, config=cfg))
        try:
            out = jax.block_until_ready(f(xq, xs, wq, ws, gs_j))
            err = check_sample(out, xq, xs, wq, ws, gs, sample)
            ms = time_jax(f, xq, xs, wq, ws, gs_j, inner=INNER)
            label = f"pallas fp8 {cfg.wg_split}/{cfg.max_concurrent_steps}" + ("/chain" if cfg.chain else "")
            results.append(row(name, label, ms, flops, wbytes, err))
        except Exception as ex:  # noqa: BLE001 - report and carry on with the other variants
            print(f"{name}: pallas {cfg} FAILED: {type(ex).__name__}: {str(ex)[:2000]}", flush=True)
            results.append({"case": name, "variant": f"pallas fp8 {cfg}", "error": str(ex)[:500]})
        del f
    if ragged_iters:
        try:
            wb = (wq.astype(jnp.bfloat16)).swapaxes(1, 2)  # [E, K, N] bf16
            f = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g))
            ms = time_jax(f, x, wb, gs_j, iters=ragged_iters, warmup=1)
            results.append(row(name, "jax.lax.ragged_dot bf16", ms, flops, 2 * wbytes))
            del wb
        except Exception as ex:  # noqa: BLE001
            print(f"{name}: ragged_dot FAILED: {str(ex)[:300]}", flush=True)
    if torch_peers:
        torch_case(name, x, xq, xs, wq, gs, flops, wbytes, results)


def torch_case(name, x, xq, xs, wq, gs, flops, wbytes, results):
    import torch

    dev = "cuda"
    tx = torch.from_dlpack(x).to(dev)
    offs = torch.tensor(np.cumsum(gs), dtype=torch.int32, device=dev)
    w8 = torch.from_dlpack(wq.view(jnp.uint8)).view(torch.float8_e4m3fn)  # [E, N, K]
    b8 = w8.transpose(-2, -1)  # [E, K, N], column-major as _scaled_grouped_mm wants
    a8 = torch.from_dlpack(xq.view(jnp.uint8)).view(torch.float8_e4m3fn)
    sa = torch.from_dlpack(jnp.max(xs, axis=1)).float().contiguous()
    sb = torch.ones(w8.shape[0], w8.shape[1], device=dev, dtype=torch.float32)
    try:
        ms = time_torch(lambda: torch._scaled_grouped_mm(a8, b8, sa, sb, offs=offs, out_dtype=torch.bfloat16),
                        inner=INNER)
        results.append(row(name, "torch _scaled_grouped_mm fp8 rowwise", ms, flops, wbytes))
    except Exception as ex:  # noqa: BLE001
        print(f"{name}: torch _scaled_grouped_mm FAILED: {str(ex)[:300]}", flush=True)
    try:
        wbf = w8.to(torch.bfloat16).transpose(-2, -1)
        ms = time_torch(lambda: torch._grouped_mm(tx, wbf, offs=offs), inner=INNER)
        results.append(row(name, "torch _grouped_mm bf16", ms, flops, 2 * wbytes))
    except Exception as ex:  # noqa: BLE001
        print(f"{name}: torch _grouped_mm FAILED: {str(ex)[:300]}", flush=True)
    torch.cuda.empty_cache()


def dense_case(results, m=8192, n=8192, k=8192):
    import torch

    name = f"dense {m}x{n}x{k}"
    kx, kw = jax.random.split(jax.random.key(1))
    xq, xs = quantize_act(jax.random.normal(kx, (m, k), jnp.bfloat16))
    wq, ws = random_fp8_weights(kw, 1, n, k)
    flops = 2.0 * m * n * k
    for cfg in (PREFILL_CONFIG, dataclasses.replace(PREFILL_CONFIG, chain=True)):
        f = jax.jit(lambda a, b, c, d, cfg=cfg: fp8_gemm(a, b, c, d, config=cfg))
        out = jax.block_until_ready(f(xq, xs, wq[0], ws[0]))
        err = check_sample(out, xq, xs, wq, ws, np.array([m]), [0])
        results.append(row(name, "pallas fp8_gemm 128x128" + ("/chain" if cfg.chain else ""),
                           time_jax(f, xq, xs, wq[0], ws[0], inner=INNER), flops, n * k, err))
    a8 = torch.from_dlpack(xq.view(jnp.uint8)).view(torch.float8_e4m3fn)
    b8 = torch.from_dlpack(wq[0].view(jnp.uint8)).view(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda", dtype=torch.float32)
    ms = time_torch(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), inner=INNER)
    results.append(row(name, "torch _scaled_mm fp8 (cuBLAS, tensorwise)", ms, flops, n * k))


def time_jax_spread(fn, *args, iters: int = 10, warmup: int = 2, inner: int = 1) -> tuple[float, float, float]:
    """(median, min, max) wall-clock ms of ``fn(*args)``. Each sample is ``inner`` back-to-back calls
    synchronised once, divided by ``inner``: with ``inner`` > 1 the host's dispatch overlaps the device
    work, so sub-millisecond kernels are timed by the device, as CUDA events time torch's."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(ts), min(ts), max(ts)


def check_sample_bf16(out, x, w, gs: np.ndarray, experts) -> float:
    """Relative Frobenius error of ``out`` against an fp32 matmul on the given experts' rows."""
    offs = np.concatenate([[0], np.cumsum(gs)])
    num, den = 0.0, 0.0
    for e in experts:
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi == lo:
            continue
        ref = jnp.dot(x[lo:hi].astype(jnp.float32), w[e].astype(jnp.float32).T,
                      precision=jax.lax.Precision.HIGHEST)
        d = out[lo:hi].astype(jnp.float32) - ref
        num += float(jnp.sum(d * d))
        den += float(jnp.sum(ref * ref))
    return (num / max(den, 1e-30)) ** 0.5


def bf16_case(name, m, k, n, load, configs, results, torch_peer: bool):
    """Our bf16 grouped GEMM (each config) and torch ``_grouped_mm`` bf16 on the same operands."""
    gs = group_sizes_for(m, E, load)
    active = int((gs > 0).sum())
    kx, kw = jax.random.split(jax.random.key(hash(name) % 2**31))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (E, n, k), jnp.bfloat16) * 0.02
    gs_j = jnp.asarray(gs)
    flops = 2.0 * m * n * k
    wbytes = 2 * active * n * k  # bf16 weight bytes of experts that have rows
    sample = sorted({int(np.argmax(gs)), int(np.argmin(gs)), 1, 7, E - 1} & set(range(E)))
    best = None
    for cfg in configs:
        label = f"pallas bf16 {cfg.wg_m}x{cfg.wg_n}/{cfg.wg_split}/{cfg.max_concurrent_steps}" + \
            ("/chain" if cfg.chain else "")
        f = jax.jit(lambda a, b, g, cfg=cfg: grouped_gemm(a, b, g, config=cfg))
        try:
            out = jax.block_until_ready(f(x, w, gs_j))
            err = check_sample_bf16(out, x, w, gs, sample)
            finite = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
            del out
            med, lo, hi = time_jax_spread(f, x, w, gs_j)
            results.append(row(name, label, med, flops, wbytes, err, min_ms=round(lo, 4), max_ms=round(hi, 4),
                               finite=finite, dtype="bf16"))
            if best is None or med < best[0]:
                best = (med, cfg)
        except Exception as ex:  # noqa: BLE001 - report and carry on with the other variants
            print(f"{name}: {label} FAILED: {type(ex).__name__}: {str(ex)[:3000]}", flush=True)
            results.append({"case": name, "variant": label, "error": str(ex)[:1000], "dtype": "bf16"})
        del f
    if torch_peer:
        import torch

        tx = torch.from_dlpack(x)
        offs = torch.tensor(np.cumsum(gs), dtype=torch.int32, device="cuda")
        tw = torch.from_dlpack(w).transpose(-2, -1)  # [E, K, N] view of the same [E, N, K] bytes
        try:
            ts = []
            for _ in range(3):  # three medians of 10, reported as median with the spread
                ts.append(time_torch(lambda: torch._grouped_mm(tx, tw, offs=offs)))
            results.append(row(name, "torch _grouped_mm bf16", statistics.median(ts), flops, wbytes,
                               min_ms=round(min(ts), 4), max_ms=round(max(ts), 4), dtype="bf16"))
        except Exception as ex:  # noqa: BLE001
            print(f"{name}: torch _grouped_mm FAILED: {str(ex)[:300]}", flush=True)
        del tx, tw
        torch.cuda.empty_cache()
    return best


def smoke(results) -> bool:
    """Compile and check every kernel variant on small ragged shapes (both kernels share the row-tile
    code): a failing variant is reported before any long benchmark starts."""
    from pallas_kernels.fp8_reference import fp8_grouped_gemm_reference
    from pallas_kernels.grouped_gemm import grouped_gemm_reference

    sizes = np.array([100, 0, 1, 300, 64, 0, 3, 0], np.int32)  # 468 of 520 rows; a zero tail
    m, k, n = 520, 512, 768
    kx, kw = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (len(sizes), n, k), jnp.bfloat16) * 0.05
    gs = jnp.asarray(sizes)
    ref = np.asarray(grouped_gemm_reference(x, w, gs, out_dtype=jnp.float32))
    ok = True
    cfgs = [BF16_PREFILL, BF16_DECODE, GroupedGemmConfig(128, 128, "n", 4, chain=False),
            GroupedGemmConfig(128, 128, "m", 4), GroupedGemmConfig(64, 128, "n", 5, chain=False)]
    for cfg in cfgs:
        try:
            out = np.asarray(grouped_gemm(x, w, gs, config=cfg).astype(jnp.float32))
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            good = bool(np.isfinite(out).all()) and err < 1e-2 and not out[sizes.sum():].any()
        except Exception as ex:  # noqa: BLE001
            err, good = repr(ex)[:3000], False
        print(f"smoke bf16 {cfg}: rel_err {err} {'ok' if good else 'FAILED'}", flush=True)
        results.append({"case": "smoke", "variant": str(cfg), "rel_err": err, "ok": good})
        ok &= good
    xq, xs = quantize_act(x)
    wq, ws = random_fp8_weights(kw, len(sizes), n, k)
    out = np.asarray(fp8_grouped_gemm(xq, xs, wq, ws, gs).astype(jnp.float32))
    r8 = np.asarray(fp8_grouped_gemm_reference(xq, xs, wq, ws, gs, out_dtype=jnp.float32))
    err = float(np.linalg.norm(out - r8) / np.linalg.norm(r8))
    good = bool(np.isfinite(out).all()) and err < 1e-2 and not out[sizes.sum():].any()
    print(f"smoke fp8 grouped: rel_err {err} {'ok' if good else 'FAILED'}", flush=True)
    results.append({"case": "smoke", "variant": "fp8 default", "rel_err": err, "ok": good})
    return ok and good


def bf16_main(results, save_fn, torch_peer: bool) -> None:
    """Issue 15's BF16 regimes, most telling first (a run cut short still has them): tiling variants
    where the choice matters, the default elsewhere."""
    prefill_variants = [BF16_PREFILL, GroupedGemmConfig(128, 128, "n", 4, chain=False),
                        GroupedGemmConfig(128, 128, "m", 4)]
    decode_variants = [BF16_DECODE, GroupedGemmConfig(64, 128, "n", 5, chain=False)]
    best = {}
    for shape, (k, n) in SHAPES.items():
        cfgs = prefill_variants if not best else sorted({BF16_PREFILL, *best.values()}, key=str)
        won = bf16_case(f"bf16 prefill {shape} M=65536 uniform", 65536, k, n, "uniform", cfgs, results,
                        torch_peer)
        if won:
            best[shape] = won[1]
        save_fn()
    for m, cfgs in ((512, decode_variants), (256, [BF16_DECODE]), (1024, [BF16_DECODE])):
        for shape, (k, n) in SHAPES.items():
            bf16_case(f"bf16 decode {shape} M={m}", m, k, n, "uniform", cfgs, results, torch_peer)
            save_fn()
    for shape, (k, n) in SHAPES.items():
        bf16_case(f"bf16 prefill {shape} M=65536 zipf", 65536, k, n, "skewed", [BF16_PREFILL], results,
                  torch_peer)
        bf16_case(f"bf16 decode {shape} M=64 zipf", 64, k, n, "skewed", [BF16_DECODE], results, torch_peer)
        save_fn()


SMALL_M_INNER = 20  # back-to-back calls per timing sample in --small-m


def small_m_case(results, m: int, shape: str, k: int, n: int, bf16_cfgs, fp8_cfgs, torch_peer: bool) -> None:
    """One decode case: the bf16 and FP8 kernels' variants and torch's peers on the same rows (Zipf loads
    below 256 rows, uniform from 256 on, as in the main sweep)."""
    load = "skewed" if m < E else "uniform"
    name = f"small-M {shape} M={m} {'zipf' if load == 'skewed' else load}"
    gs = group_sizes_for(m, E, load)
    active = int((gs > 0).sum())
    kx, kw = jax.random.split(jax.random.key(m * 7 + k))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    gs_j = jnp.asarray(gs)
    flops = 2.0 * m * n * k
    sample = sorted({int(np.argmax(gs)), 1, 7, E - 1})
    if bf16_cfgs:
        w = jax.random.normal(kw, (E, n, k), jnp.bfloat16) * 0.02
        for cfg in bf16_cfgs:
            label = f"pallas bf16 {cfg.wg_m}x{cfg.wg_n}/{cfg.wg_split}/{cfg.max_concurrent_steps}/ks{cfg.k_splits}"
            f = jax.jit(lambda a, b, g, cfg=cfg: grouped_gemm(a, b, g, config=cfg))
            try:
                out = jax.block_until_ready(f(x, w, gs_j))
                err = check_sample_bf16(out, x, w, gs, sample)
                med, lo, hi = time_jax_spread(f, x, w, gs_j, inner=SMALL_M_INNER)
                sync = time_jax_spread(f, x, w, gs_j)[0]
                results.append(row(name, label, med, flops, 2 * active * n * k, err, min_ms=round(lo, 4),
                                   max_ms=round(hi, 4), ms_sync=round(sync, 4), dtype="bf16"))
            except Exception as ex:  # noqa: BLE001 - report and carry on
                print(f"{name}: {label} FAILED: {type(ex).__name__}: {str(ex)[:2000]}", flush=True)
                results.append({"case": name, "variant": label, "error": str(ex)[:1000]})
        if torch_peer:
            import torch

            tx = torch.from_dlpack(x)
            offs = torch.tensor(np.cumsum(gs), dtype=torch.int32, device="cuda")
            tw = torch.from_dlpack(w).transpose(-2, -1)
            med, lo, hi = time_torch_spread(lambda: torch._grouped_mm(tx, tw, offs=offs), inner=SMALL_M_INNER)
            results.append(row(name, "torch _grouped_mm bf16", med, flops, 2 * active * n * k,
                               min_ms=round(lo, 4), max_ms=round(hi, 4), dtype="bf16"))
            del tx, tw
        del w
    if not fp8_cfgs:
        return
    # fp8
    xq, xs = quantize_act(x)
    wq, ws = random_fp8_weights(kw, E, n, k)
    for cfg in fp8_cfgs:
        label = f"pallas fp8 {cfg.wg_split}/{cfg.max_concurrent_steps}/ks{cfg.k_splits}"
        f = jax.jit(lambda a, b, c, d, g, cfg=cfg: fp8_grouped_gemm(a, b, c, d, g, config=cfg))
        try:
            out = jax.block_until_ready(f(xq, xs, wq, ws, gs_j))
            err = check_sample(out, xq, xs, wq, ws, gs, sample)
            med, lo, hi = time_jax_spread(f, xq, xs, wq, ws, gs_j, inner=SMALL_M_INNER)
            sync = time_jax_spread(f, xq, xs, wq, ws, gs_j)[0]
            results.append(row(name, label, med, flops, active * n * k, err, min_ms=round(lo, 4),
                               max_ms=round(hi, 4), ms_sync=round(sync, 4), dtype="fp8"))
        except Exception as ex:  # noqa: BLE001
            print(f"{name}: {label} FAILED: {type(ex).__name__}: {str(ex)[:2000]}", flush=True)
            results.append({"case": name, "variant": label, "error": str(ex)[:1000]})
    if torch_peer:
        import torch

        offs = torch.tensor(np.cumsum(gs), dtype=torch.int32, device="cuda")
        b8 = torch.from_dlpack(wq.view(jnp.uint8)).view(torch.float8_e4m3fn).transpose(-2, -1)
        a8 = torch.from_dlpack(xq.view(jnp.uint8)).view(torch.float8_e4m3fn)
        sa = torch.from_dlpack(jnp.max(xs, axis=1)).float().contiguous()
        sb = torch.ones(E, n, device="cuda", dtype=torch.float32)
        try:
            med, lo, hi = time_torch_spread(
                lambda: torch._scaled_grouped_mm(a8, b8, sa, sb, offs=offs, out_dtype=torch.bfloat16),
                inner=SMALL_M_INNER)
            results.append(row(name, "torch _scaled_grouped_mm fp8 rowwise", med, flops, active * n * k,
                               min_ms=round(lo, 4), max_ms=round(hi, 4), dtype="fp8"))
        except Exception as ex:  # noqa: BLE001
            print(f"{name}: torch fp8 FAILED: {str(ex)[:300]}", flush=True)
        del a8, b8
        torch.cuda.empty_cache()
    del wq, ws


def small_m_main(results, save_fn, torch_peer: bool, rows=(64, 8, 128), kinds=("bf16", "fp8"),
                 dense: bool = True) -> None:
    """Issue 17 item 3: few rows per step (decode at batch 1-16: 8-128 rows over 256 experts) for both
    kernels, split-K variants beside the unsplit decode tiling, torch peers in the same run. Every
    timing here is a median of 10 samples of 20 back-to-back calls (device-bound for jax and torch
    alike); ``ms_sync`` is one synchronised call (what a lone call costs with dispatch)."""
    from pallas_kernels.group_tiles import tile_metadata

    if list(kinds) == ["dense"]:  # only the dense FP8 GEMM's shapes
        dense_small_m(results, torch_peer)
        save_fn()
        return
    bf16_cfgs = [BF16_DECODE, dataclasses.replace(BF16_DECODE, k_splits=2),
                 dataclasses.replace(BF16_DECODE, k_splits=4),
                 GroupedGemmConfig(64, 64, "n", 6, k_splits=2)]
    fp8_cfgs = [DECODE_CONFIG, Fp8GemmConfig("n", 4, k_splits=2), Fp8GemmConfig("n", 4, k_splits=4),
                Fp8GemmConfig("m", 4, k_splits=4)]
    gs_meta = jnp.asarray(group_sizes_for(64, E, "skewed"))
    tile_end = jnp.cumsum(gs_meta)
    slots = jnp.arange(64 + E, dtype=jnp.int32)
    for method in ("scan", "compare_all"):  # before/after of the tile lookup inside tile_metadata
        f = jax.jit(lambda te, t, method=method: jnp.searchsorted(te, t, side="right", method=method))
        med, lo, hi = time_jax_spread(f, tile_end, slots, inner=SMALL_M_INNER)
        results.append({"case": "searchsorted 320 slots", "variant": method, "ms": round(med, 4),
                        "min_ms": round(lo, 4), "max_ms": round(hi, 4)})
        print(f"searchsorted {method}: {med * 1e3:.1f} us (min {lo * 1e3:.1f}, max {hi * 1e3:.1f})", flush=True)
    f_meta = jax.jit(lambda g: tile_metadata(g, 64, 64)[0])
    med, lo, hi = time_jax_spread(f_meta, gs_meta, inner=SMALL_M_INNER)
    results.append({"case": "tile_metadata M=64 E=256", "variant": "jnp (compare_all)", "ms": round(med, 4),
                    "min_ms": round(lo, 4), "max_ms": round(hi, 4)})
    print(f"tile_metadata alone: {med * 1e3:.1f} us (min {lo * 1e3:.1f}, max {hi * 1e3:.1f})", flush=True)
    bf16_cfgs = bf16_cfgs if "bf16" in kinds else []
    fp8_cfgs = fp8_cfgs if "fp8" in kinds else []
    for i, m in enumerate(rows):
        for shape, (k, n) in SHAPES.items():
            small_m_case(results, m, shape, k, n, bf16_cfgs[:1] if m > 128 else bf16_cfgs,
                         fp8_cfgs[:1] if m > 128 else fp8_cfgs, torch_peer)
            save_fn()
        if dense and i == 1:
            dense_small_m(results, torch_peer)
            save_fn()


# The attention projections' real (K, N): q_a 7168->1536, q_b 1536->24576, o 16384->7168.
DENSE_SHAPES = ((7168, 1536), (1536, 24576), (16384, 7168))


def dense_small_m(results, torch_peer: bool) -> None:
    """Issue 17 item 4 at real shapes: the dense FP8 GEMM with its default tiling (``dense_config``) beside
    the two unsplit tilings and cuBLAS fp8 (tensorwise) on the same bytes."""
    from pallas_kernels.fp8_gemm import dense_config

    for m in (1, 64, 4096):
        for k, n in DENSE_SHAPES:
            name = f"dense fp8 M={m} K={k} N={n}"
            kx, kw = jax.random.split(jax.random.key(m + n))
            xq, xs = quantize_act(jax.random.normal(kx, (m, k), jnp.bfloat16))
            wq, ws = random_fp8_weights(kw, 1, n, k)
            flops = 2.0 * m * n * k
            cfgs = {dense_config(m, n, k), NARROW_CONFIG, DENSE_CONFIG}
            for cfg in sorted(cfgs, key=str):
                label = "pallas fp8_gemm " + config_label(cfg)
                f = jax.jit(lambda a, b, c, d, cfg=cfg: fp8_gemm(a, b, c, d, config=cfg))
                try:
                    out = jax.block_until_ready(f(xq, xs, wq[0], ws[0]))
                    err = check_sample(out, xq, xs, wq, ws, np.array([m]), [0])
                    med, lo, hi = time_jax_spread(f, xq, xs, wq[0], ws[0], inner=SMALL_M_INNER)
                    results.append(row(name, label, med, flops, n * k, err, min_ms=round(lo, 4),
                                       max_ms=round(hi, 4), default=cfg == dense_config(m, n, k)))
                except Exception as ex:  # noqa: BLE001
                    print(f"{name}: {label} FAILED: {type(ex).__name__}: {str(ex)[:2000]}", flush=True)
                    results.append({"case": name, "variant": label, "error": str(ex)[:1000]})
            if torch_peer:
                import torch

                a8 = torch.from_dlpack(xq.view(jnp.uint8)).view(torch.float8_e4m3fn)
                b8 = torch.from_dlpack(wq[0].view(jnp.uint8)).view(torch.float8_e4m3fn).t()
                one = torch.ones((), device="cuda", dtype=torch.float32)
                try:
                    med, lo, hi = time_torch_spread(
                        lambda a8=a8, b8=b8, one=one: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                        inner=SMALL_M_INNER)
                    results.append(row(name, "torch _scaled_mm fp8 (cuBLAS, tensorwise)", med, flops, n * k,
                                       min_ms=round(lo, 4), max_ms=round(hi, 4)))
                except Exception as ex:  # noqa: BLE001
                    print(f"{name}: torch _scaled_mm FAILED: {str(ex)[:300]}", flush=True)


def config_label(cfg: Fp8GemmConfig) -> str:
    """A short name for an FP8 tiling: split/stages, then only what differs from the defaults."""
    return (f"{cfg.wg_split}/{cfg.max_concurrent_steps}" + (f"/w{cfg.wg_n}" if cfg.wg_n != 128 else "")
            + (f"/b{cfg.band}" if cfg.band != 1 else "") + (f"/c{cfg.cluster_n}" if cfg.cluster_n != 1 else "")
            + ("/chain" if cfg.chain else "") + (f"/ks{cfg.k_splits}" if cfg.k_splits != 1 else ""))


def parse_config(label: str) -> Fp8GemmConfig:
    """The inverse of ``config_label``: ``m/4/w256/b2/c2/chain/ks2``."""
    split, stages, *opts = label.split("/")
    kw: dict = {}
    for o in opts:
        if o == "chain":
            kw["chain"] = True
        else:
            key = {"w": "wg_n", "b": "band", "c": "cluster_n", "ks": "k_splits"}[o.rstrip("0123456789")]
            kw[key] = int(o.lstrip("wbcks"))
    return Fp8GemmConfig(split, int(stages), **kw)


# Issue 17, round three: the tile width per warpgroup and the band work order, at large M.
TILE_CONFIGS = (
    Fp8GemmConfig("m", 4),
    Fp8GemmConfig("m", 4, band=8),
    Fp8GemmConfig("m", 4, band=2, cluster_n=2),
    Fp8GemmConfig("m", 4, wg_n=256),
    Fp8GemmConfig("m", 4, wg_n=256, band=2),
    Fp8GemmConfig("m", 4, wg_n=256, band=8),
    Fp8GemmConfig("m", 3, wg_n=256, band=2),
    Fp8GemmConfig("m", 4, wg_n=256, band=2, chain=True),
    Fp8GemmConfig("m", 4, wg_n=256, band=2, cluster_n=2),
    Fp8GemmConfig("m", 4, wg_n=256, band=8, cluster_n=2),
)


def tiles_main(results, save_fn, torch_peer: bool, configs=TILE_CONFIGS, only=None) -> None:
    """Each tiling at large M: the grouped GEMM at 65,536 uniform rows (gate_up, down) beside torch's
    fp8 rowwise grouped GEMM, and the dense GEMM at 8192^3 and at M=4096 on the attention shapes beside
    cuBLAS fp8, all in one run. Median of 10 samples of ``INNER`` back-to-back calls, with min/max."""
    import torch

    cases = [(f"prefill {shape} M=65536 uniform", 65536, k, n, E) for shape, (k, n) in SHAPES.items()]
    cases += [("dense 8192x8192x8192", 8192, 8192, 8192, 0)]
    cases += [(f"dense fp8 M=4096 K={k} N={n}", 4096, k, n, 0) for k, n in DENSE_SHAPES]
    cases = [c for c in cases if not only or any(o in c[0] for o in only)]
    for name, m, k, n, e in cases:
        kx, kw = jax.random.split(jax.random.key(m + n + k))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        xq, xs = quantize_act(x)
        wq, ws = random_fp8_weights(kw, max(e, 1), n, k)
        gs = group_sizes_for(m, e, "uniform") if e else np.array([m], np.int32)
        flops, wbytes = 2.0 * m * n * k, max(e, 1) * n * k
        for cfg in configs:
            if e:
                f = jax.jit(lambda a, b, c, d, g, cfg=cfg: fp8_grouped_gemm(a, b, c, d, g, config=cfg))
                args = (xq, xs, wq, ws, jnp.asarray(gs))
            else:
                f = jax.jit(lambda a, b, c, d, cfg=cfg: fp8_gemm(a, b, c, d, config=cfg))
                args = (xq, xs, wq[0], ws[0])
            label = "pallas fp8 " + config_label(cfg)
            try:
                out = jax.block_until_ready(f(*args))
                err = check_sample(out, xq, xs, wq, ws, gs, [0, 1, E - 1] if e else [0])
                med, lo, hi = time_jax_spread(f, *args, inner=INNER)
                results.append(row(name, label, med, flops, wbytes, err, min_ms=round(lo, 4), max_ms=round(hi, 4)))
            except Exception as ex:  # noqa: BLE001 - report and carry on with the other variants
                print(f"{name}: {label} FAILED: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
                results.append({"case": name, "variant": label, "error": str(ex)[:500]})
            del f
        if torch_peer:
            a8 = torch.from_dlpack(xq.view(jnp.uint8)).view(torch.float8_e4m3fn)
            w8 = torch.from_dlpack(wq.view(jnp.uint8)).view(torch.float8_e4m3fn)
            if e:
                offs = torch.tensor(np.cumsum(gs), dtype=torch.int32, device="cuda")
                sa = torch.from_dlpack(jnp.max(xs, axis=1)).float().contiguous()
                sb = torch.ones(e, n, device="cuda", dtype=torch.float32)
                peer, fn = "torch _scaled_grouped_mm fp8 rowwise", functools.partial(
                    torch._scaled_grouped_mm, a8, w8.transpose(-2, -1), sa, sb, offs=offs,
                    out_dtype=torch.bfloat16)
            else:
                one = torch.ones((), device="cuda", dtype=torch.float32)
                peer, fn = "torch _scaled_mm fp8 (cuBLAS, tensorwise)", functools.partial(
                    torch._scaled_mm, a8, w8[0].t(), one, one, out_dtype=torch.bfloat16)
            try:
                med, lo, hi = time_torch_spread(fn, inner=INNER)
                results.append(row(name, peer, med, flops, wbytes, min_ms=round(lo, 4), max_ms=round(hi, 4)))
            except Exception as ex:  # noqa: BLE001
                print(f"{name}: {peer} FAILED: {str(ex)[:300]}", flush=True)
            torch.cuda.empty_cache()
        del x, xq, xs, wq, ws
        save_fn()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="moe_gemm_bench.json")
    ap.add_argument("--quick", action="store_true", help="one prefill and one decode case, no peers")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="only the BF16 grouped GEMM (issue 15)")
    ap.add_argument("--smoke", action="store_true", help="compile and check each variant on small shapes")
    ap.add_argument("--small-m", action="store_true", help="only few-rows decode (issue 17 item 3)")
    ap.add_argument("--prefill", action="store_true",
                    help="only FP8 prefill (uniform, 65,536 rows) and dense 8192^3, chained vs not, with peers")
    ap.add_argument("--tiles", action="store_true",
                    help="only the tile width / work order sweep at large M, grouped and dense, with peers")
    ap.add_argument("--configs", default="", help="--tiles: FP8 tilings as labels, e.g. m/4/w256/b2,m/4")
    ap.add_argument("--cases", default="", help="--tiles: only cases whose name contains one of these")
    ap.add_argument("--rows", default="64,8,128", help="--small-m: rows per step (above 128: defaults only)")
    ap.add_argument("--kinds", default="bf16,fp8", help="--small-m: which kernels (bf16, fp8; or only 'dense')")
    ap.add_argument("--no-dense", action="store_true", help="--small-m: skip the dense FP8 GEMM shapes")
    args = ap.parse_args()
    results: list[dict] = []
    meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d")}
    print(meta, flush=True)
    if args.smoke:
        ok = smoke(results)
        save(args.out, meta, results)
        raise SystemExit(0 if ok else 1)
    if args.prefill:
        chained = [PREFILL_CONFIG, dataclasses.replace(PREFILL_CONFIG, chain=True),
                   Fp8GemmConfig("m", 5, chain=False)]
        for shape, (k, n) in SHAPES.items():
            bench_case(f"prefill {shape} M=65536 uniform", 65536, k, n, "uniform", chained, results,
                       not args.no_torch, ragged_iters=0)
            save(args.out, meta, results)
        try:
            dense_case(results)
        except Exception as ex:  # noqa: BLE001 - keep what was measured
            print(f"dense case FAILED: {type(ex).__name__}: {str(ex)[:2000]}", flush=True)
        save(args.out, meta, results)
        return
    if args.tiles:
        configs = [parse_config(c) for c in args.configs.split(",")] if args.configs else TILE_CONFIGS
        cases = args.cases.split(",") if args.cases else None
        tiles_main(results, lambda: save(args.out, meta, results), not args.no_torch, configs, cases)
        save(args.out, meta, results)
        return
    if args.small_m:
        small_m_main(results, lambda: save(args.out, meta, results), not args.no_torch,
                     rows=[int(r) for r in args.rows.split(",")], kinds=args.kinds.split(","),
                     dense=not args.no_dense)
        save(args.out, meta, results)
        return
    if args.bf16:
        bf16_main(results, lambda: save(args.out, meta, results), not args.no_torch)
        save(args.out, meta, results)
        return
    torch_peers = not (args.no_torch or args.quick)
    prefill_cfgs = [PREFILL_CONFIG, Fp8GemmConfig("m", 5), Fp8GemmConfig("n", 4)]
    decode_cfgs = [DECODE_CONFIG, Fp8GemmConfig("m", 4)]
    if args.quick:
        prefill_cfgs, decode_cfgs = [PREFILL_CONFIG], [DECODE_CONFIG]
    if torch_peers:
        try:
            dense_case(results)
        except Exception as ex:  # noqa: BLE001 - keep going to the grouped cases
            print(f"dense case FAILED: {type(ex).__name__}: {str(ex)[:2000]}", flush=True)
    for shape, (k, n) in SHAPES.items():
        for load in ("uniform", "skewed"):
            bench_case(f"prefill {shape} M=65536 {load}", 65536, k, n, load, prefill_cfgs, results,
                       torch_peers, ragged_iters=0)  # XLA densifies: 224 GB, OOM
            save(args.out, meta, results)
            if args.quick:
                break
        for m in (64, 256, 512, 1024):
            if args.quick and m != 512:
                continue
            bench_case(f"decode {shape} M={m}", m, k, n, "uniform" if m >= E else "skewed", decode_cfgs,
                       results, torch_peers, ragged_iters=0 if args.quick else 3)
            save(args.out, meta, results)
    save(args.out, meta, results)


def save(path: str, meta: dict, results: list[dict]) -> None:
    with open(path, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
