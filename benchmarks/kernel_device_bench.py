"""Issue 17's kernels and their peers timed by GPU time (`device_time.py`), not by the host clock (GPU only).

Owns the case list and the table: MLA decode designs (H=128 TFLOP/s, H=16 TB/s of cache; `--mla-variants`
names them as the kernel lab `pallas_kernels.experimental.mla_variants` does, v2 being the product), the FP8
grouped GEMM at 65,536 rows beside torch's fp8 rowwise grouped GEMM, and the dense FP8 GEMM at the attention
shapes (M = 1, 64, 4096) and 8192^3 beside cuBLAS fp8 (with `--experimental`, at M <= 64 also the swap-AB
kernel, `pallas_kernels.experimental.fp8_small_m`, which has faulted the device: off by default), and the whole FP8 linear from bf16 activations (`linear`: quantization and GEMM in one program) beside torch's
fp8 rowwise linear and its bf16 GEMM. Every figure is the median (min/max in the JSON) of the per-call GPU
time over back-to-back calls; each of our results is checked against its reference first.
Ours and the torch peers run as separate processes (`--side`): after torch's profiler has run, JAX's
trace of the same process comes back empty.
Inputs and checks come from `mla_bench.py` and `moe_gemm_bench.py`.

    python benchmarks/kernel_device_bench.py --out $OUT/ours.json                    # everything, ours
    python benchmarks/kernel_device_bench.py --only grouped,dense --side peer --out $OUT/peer.json
    python benchmarks/kernel_device_bench.py --only mla --mla-variants v1,v8
    python benchmarks/kernel_device_bench.py --only dense --configs m/4,m/4/w256/b8  # extra tilings
    python benchmarks/kernel_device_bench.py --only linear --rows 1,64 --side peer
    python benchmarks/kernel_device_bench.py --only dense,linear --rows 1,64 --experimental  # + swap-AB
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_time import jax_device_time, torch_device_time  # noqa: E402
from mla_bench import SCALE, _decode_inputs, _rel_err  # noqa: E402
from moe_gemm_bench import (  # noqa: E402
    DENSE_SHAPES,
    SHAPES,
    E,
    check_sample,
    config_label,
    group_sizes_for,
    parse_config,
    random_fp8_weights,
)

from pallas_kernels.experimental.fp8_small_m import SWAP_MAX_ROWS, fp8_gemm_swap_ab  # noqa: E402
from pallas_kernels.experimental.mla_variants import PRODUCT_VARIANT  # noqa: E402
from pallas_kernels.experimental.mla_variants import mla_decode as lab_mla_decode  # noqa: E402
from pallas_kernels.fp8_gemm import default_config, dense_config, fp8_gemm, fp8_grouped_gemm  # noqa: E402
from pallas_kernels.fp8_quant import quantize_act  # noqa: E402
from pallas_kernels.mla_reference import mla_decode_reference  # noqa: E402

MLA_CASES = ((128, 64, 4096), (128, 128, 4096), (128, 64, 32768), (128, 128, 32768), (16, 128, 32768))


def _row(results: list, case: str, who: str, t: dict, flops: float, nbytes: float, **extra) -> None:
    med = t["median_ms"]
    r = dict(case=case, variant=who, median_ms=round(med, 4), min_ms=round(t["min_ms"], 4),
             max_ms=round(t["max_ms"], 4), tflops=round(flops / med / 1e9, 1), tbps=round(nbytes / med / 1e9, 3),
             kernels=t.get("kernels"), **extra)
    results.append(r)
    print(f"{case:<34} {who:<40} {med:9.4f} ms ({t['min_ms']:.4f}-{t['max_ms']:.4f}) {r['tflops']:7.1f} TF/s "
          f"{r['tbps']:6.2f} TB/s" + "".join(f" {k}={v}" for k, v in extra.items()), flush=True)


def mla(results: list, variants: list[str], cases=MLA_CASES, splits=(None,)) -> None:
    """Each design (kernel lab names, v2 the product) at each case; `splits` (None: `choose_num_splits`)
    sweeps the split-KV count, whose merge (`merges`) is most of a small batch's time."""
    ref = jax.jit(lambda *a: mla_decode_reference(*a, softmax_scale=SCALE))
    for h, b, s in cases:
        inp = _decode_inputs(b * 131 + s + h, b, h, s)
        flops, nbytes = 2.0 * b * h * s * (576 + 512), b * s * 576 * 2.0
        rout = None
        if b * s <= 128 * 4096:
            rout, _ = ref(*[x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in inp])
        for v in variants:
            for ns in splits:
                fn = jax.jit(lambda *a, v=v, ns=ns: lab_mla_decode(*a, softmax_scale=SCALE, variant=v, num_splits=ns))
                out, _ = fn(*inp)
                err = None if rout is None else round(_rel_err(out, rout), 5)
                who = f"pallas {v}" + ("" if ns is None else f" splits={ns}")
                _row(results, f"mla H={h} B={b} S={s}", who, jax_device_time(fn, inp), flops, nbytes,
                     rel_err=err, nan=bool(jnp.isnan(out).any()))
        del inp


def mla_prefill_chunk(results: list, variants: list[str], t: int = 4096, h: int = 128) -> None:
    """One sequence's whole-prompt chunk (T = t tokens from position 0, causal) through the kernel core."""
    from pallas_kernels.experimental.mla_variants import paged_mla_attention

    ql, qr, kv, table, _ = _decode_inputs(t + h, 1, h * t, t)  # [1, t*h, ...] queries, t tokens of pages
    ql, qr = ql.reshape(1, t, h, -1), qr.reshape(1, t, h, -1)
    start, lens = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
    flops = 2.0 * h * (t * (t + 1) / 2) * (576 + 512)  # causal: token j sees j + 1 positions
    outs = {}
    for v in variants:
        fn = jax.jit(lambda *a, v=v: paged_mla_attention(*a, softmax_scale=SCALE, variant=v))
        args = (ql, qr, kv, table, start, lens)
        outs[v] = fn(*args)[0]
        err = None if v == variants[0] else round(_rel_err(outs[v], outs[variants[0]]), 5)
        _row(results, f"mla prefill chunk H={h} T={t}", f"pallas {v}", jax_device_time(fn, args), flops, 0.0,
             err_vs_first=err)


MERGE_CASES = ((128, 1, 4096), (128, 8, 4096), (16, 1, 32768), (16, 8, 32768))


def merges(results: list, cases=MERGE_CASES, splits=(None,)) -> None:
    """The split-KV merge alone, the kernel lab's earlier `merge_splits_one_reduce` against the product's
    two-pass `merge_splits`,
    on partials shaped as the kernel writes them for decode at (H, B, S) (splits from `choose_num_splits`,
    or each of `splits`)."""
    from pallas_kernels.experimental.mla_variants import merge_splits_one_reduce
    from pallas_kernels.mla_decode import BLOCK_ROWS, choose_num_splits, merge_splits

    for (h, b, s), want in ((c, n) for c in cases for n in splits):
        tiles = -(-h // BLOCK_ROWS)
        ns = want or choose_num_splits(b, tiles, s // 64)
        k1, k2 = jax.random.split(jax.random.key(h + b + s))
        out_p = jax.random.normal(k1, (b, ns, tiles * BLOCK_ROWS, 512), jnp.bfloat16)
        lse_p = 3 * jax.random.normal(k2, (b, ns, tiles * BLOCK_ROWS), jnp.float32)
        ref = None
        for name, fn in (("merge_splits_one_reduce", merge_splits_one_reduce), ("merge_splits", merge_splits)):
            f = jax.jit(lambda o, x, fn=fn, h=h: fn(o, x, 1, h))
            out, _ = f(out_p, lse_p)
            err = None if ref is None else round(_rel_err(out, ref), 6)
            ref = out if ref is None else ref
            _row(results, f"merge H={h} B={b} S={s} splits={ns}", name, jax_device_time(f, (out_p, lse_p)), 0.0,
                 out_p.size * 2.0, err_vs_first=err)


def _torch_fp8(xq, wq):
    import torch

    a8 = torch.from_dlpack(xq.view(jnp.uint8)).view(torch.float8_e4m3fn)
    w8 = torch.from_dlpack(wq.view(jnp.uint8)).view(torch.float8_e4m3fn)
    return torch, a8, w8


def grouped(results: list, configs, side: str) -> None:
    for shape, (k, n) in SHAPES.items():
        m = 65536
        kx, kw = jax.random.split(jax.random.key(m + n + k))
        xq, xs = quantize_act(jax.random.normal(kx, (m, k), jnp.bfloat16))
        wq, ws = random_fp8_weights(kw, E, n, k)
        gs = group_sizes_for(m, E, "uniform")
        case, flops = f"grouped {shape} M=65536 uniform", 2.0 * m * n * k
        for cfg in [default_config(m, E), *configs] if side == "ours" else []:
            fn = jax.jit(lambda a, b, c, d, g, cfg=cfg: fp8_grouped_gemm(a, b, c, d, g, config=cfg))
            args = (xq, xs, wq, ws, jnp.asarray(gs))
            err = round(check_sample(fn(*args), xq, xs, wq, ws, gs, [0, 1, E - 1]), 5)
            _row(results, case, "pallas " + config_label(cfg), jax_device_time(fn, args), flops, E * n * k,
                 rel_err=err)
        if side == "ours":
            continue
        torch, a8, w8 = _torch_fp8(xq, wq)
        offs = torch.tensor(np.cumsum(gs), dtype=torch.int32, device="cuda")
        sa = torch.from_dlpack(jnp.max(xs, axis=1)).float().contiguous()
        sb = torch.ones(E, n, device="cuda", dtype=torch.float32)
        b8 = w8.transpose(-2, -1)
        peer = functools.partial(torch._scaled_grouped_mm, a8, b8, sa, sb, offs=offs, out_dtype=torch.bfloat16)
        _row(results, case, "torch _scaled_grouped_mm fp8 rowwise", torch_device_time(peer), flops, E * n * k)
        del peer, a8, w8, b8
        torch.cuda.empty_cache()


def dense(results: list, configs, side: str, rows=(1, 64, 4096), experimental: bool = False) -> None:
    shapes = [(m, k, n) for m in rows for k, n in DENSE_SHAPES] + [(8192, 8192, 8192)]
    for m, k, n in shapes:
        kx, kw = jax.random.split(jax.random.key(m + n))
        xq, xs = quantize_act(jax.random.normal(kx, (m, k), jnp.bfloat16))
        wq, ws = random_fp8_weights(kw, 1, n, k)
        case, flops = f"dense M={m} K={k} N={n}", 2.0 * m * n * k
        for cfg in [dense_config(m, n, k), *configs] if side == "ours" else []:
            fn = jax.jit(lambda a, b, c, d, cfg=cfg: fp8_gemm(a, b, c, d, config=cfg))
            args = (xq, xs, wq[0], ws[0])
            try:
                err = round(check_sample(fn(*args), xq, xs, wq, ws, np.array([m]), [0]), 5)
                _row(results, case, "pallas " + config_label(cfg), jax_device_time(fn, args), flops, n * k,
                     rel_err=err)
            except Exception as ex:  # noqa: BLE001 - a tiling that does not fit this shape; report, go on
                print(f"{case}: {config_label(cfg)} FAILED: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
        if side == "ours" and experimental and m <= SWAP_MAX_ROWS:  # the swap-AB candidate (few rows)
            fn = jax.jit(fp8_gemm_swap_ab)
            args = (xq, xs, wq[0], ws[0])
            err = round(check_sample(fn(*args), xq, xs, wq, ws, np.array([m]), [0]), 5)
            _row(results, case, "pallas swap-AB", jax_device_time(fn, args), flops, n * k, rel_err=err)
        if side == "ours":
            continue
        torch, a8, w8 = _torch_fp8(xq, wq[0])
        one = torch.ones((), device="cuda", dtype=torch.float32)
        b8 = w8.t()
        peer = functools.partial(torch._scaled_mm, a8, b8, one, one, out_dtype=torch.bfloat16)
        _row(results, case, "torch _scaled_mm fp8 (cuBLAS)", torch_device_time(peer), flops, n * k)


CUBLAS = {"xla_gpu_enable_triton_gemm": False}  # XLA's dots as cuBLAS calls (executor.BF16_GEMM_OPTIONS)


def weight_dequant_linear(x: jax.Array, w_fp8: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [M, K] bf16 @ (w_fp8 [N, K] times its 128x128 block scales).T in bf16 with fp32 accumulation: a
    weight-only FP8 linear as plain XLA (no activation quantization), for XLA to fuse the dequantization into
    its GEMM (a Triton fusion reads one byte a weight) or, under CUBLAS, to materialize it."""
    n, k = w_fp8.shape
    s = jnp.repeat(jnp.repeat(w_scale, 128, 0)[:n], 128, 1)[:, :k]
    w = (w_fp8.astype(jnp.float32) * s).astype(jnp.bfloat16)
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)


def linear(results: list, side: str, rows=(1, 64), experimental: bool = False) -> None:
    """A whole FP8 linear from bf16 activations, as the model runs it: the activation quantization in the
    same program as the GEMM, so XLA may fuse the padding and scale layout into the quantization (the
    `dense` rows time the GEMM alone, from pre-quantized inputs, where that glue is separate kernels).
    Ours: `fp8_linear` (the default routing), the weight-only dequantized dot as plain XLA (`weight_dequant_linear`,
    Triton fusion and cuBLAS) and, with `experimental`, quantize + swap-AB. Peers: torch's fp8 rowwise linear
    (row amax, cast, `_scaled_mm` with per-row scales: coarser than our 1x128 blocks) and the bf16 GEMM
    of a BF16 checkpoint (`x @ w.T`, cuBLAS)."""
    from pallas_kernels.fp8_gemm import fp8_linear
    from pallas_kernels.fp8_reference import fp8_linear_reference

    for m in rows:
        for k, n in DENSE_SHAPES:
            kx, kw = jax.random.split(jax.random.key(m + n + k))
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            wq, ws = random_fp8_weights(kw, 1, n, k)
            case, flops = f"linear M={m} K={k} N={n}", 2.0 * m * n * k
            if side == "ours":
                args = (x, wq[0], ws[0])
                ref = jax.jit(fp8_linear_reference)(*args)
                few = experimental and m <= SWAP_MAX_ROWS
                swap = (lambda a, w, s: fp8_gemm_swap_ab(*quantize_act(a), w, s)) if few else None
                for who, f, opts in (("pallas fp8_linear (default)", fp8_linear, None),
                                     ("pallas quantize + swap-AB", swap, None),
                                     ("xla weight-dequant dot (Triton fusion)", weight_dequant_linear, None),
                                     ("xla weight-dequant dot (cuBLAS)", weight_dequant_linear, CUBLAS)):
                    if f is None:
                        continue
                    fn = jax.jit(f) if opts is None else jax.jit(f).lower(*args).compile(opts)
                    out = fn(*args)
                    _row(results, case, who, jax_device_time(fn, args), flops, n * k,
                         rel_err=round(_rel_err(out, ref), 5))
                continue
            import torch

            xt = torch.from_dlpack(x)
            wt = torch.from_dlpack(
                (wq[0].astype(jnp.float32) * jnp.repeat(jnp.repeat(ws[0], 128, 0), 128, 1)[:n, :k])
                .astype(jnp.bfloat16))
            w8 = wt.to(torch.float8_e4m3fn)  # |w| stays inside e4m3's range here; the layout is what counts
            b8, sb = w8.t(), torch.ones(1, n, device="cuda", dtype=torch.float32)

            def rowwise(xt=xt, b8=b8, sb=sb):
                sa = xt.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
                a8 = (xt.float() / sa).to(torch.float8_e4m3fn)
                return torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16)

            _row(results, case, "torch fp8 rowwise linear (quantize + _scaled_mm)", torch_device_time(rowwise),
                 flops, n * k)
            _row(results, case, "torch bf16 x @ w.T (cuBLAS)",
                 torch_device_time(functools.partial(torch.matmul, xt, wt.t())), flops, 2 * n * k)
            del wt, w8, b8
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernel_device_bench.json")
    ap.add_argument("--only", default="mla,grouped,dense", help="comma list of mla, merge, prefill, grouped, dense, linear")
    ap.add_argument("--mla-variants", default=PRODUCT_VARIANT,
                    help="mla/prefill: comma list of kernel designs (the kernel lab's names; v2 is the product)")
    ap.add_argument("--mla-cases", default="", help="H:B:S,... (default: MLA_CASES; merge: MERGE_CASES)")
    ap.add_argument("--mla-splits", default="auto", help="mla/merge: split-KV counts, e.g. auto,4,8,16")
    ap.add_argument("--configs", default="", help="extra FP8 tilings (moe_gemm_bench labels) for grouped/dense")
    ap.add_argument("--rows", default="1,64,4096", help="dense/linear: M values")
    # JAX's CUPTI tracer fails once torch's profiler has run in the process, so each side is its own run.
    ap.add_argument("--side", default="ours", choices=["ours", "peer"], help="grouped/dense: ours or the torch peer")
    ap.add_argument("--experimental", action="store_true",
                    help="dense/linear: also time pallas_kernels.experimental (swap-AB; it may fault the device)")
    a = ap.parse_args()
    configs = [parse_config(c) for c in a.configs.split(",") if c]
    results: list = []
    meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                argv=sys.argv, timing="GPU time per call from profiler traces (device_time.py)")
    only = a.only.split(",")
    try:
        cases = [tuple(int(x) for x in c.split(":")) for c in a.mla_cases.split(",") if c]
        splits = tuple(None if n == "auto" else int(n) for n in a.mla_splits.split(","))
        if "mla" in only:
            mla(results, a.mla_variants.split(","), cases or MLA_CASES, splits)
        if "merge" in only:
            merges(results, cases or MERGE_CASES, splits)
        if "prefill" in only:
            mla_prefill_chunk(results, a.mla_variants.split(","))
        if "grouped" in only:
            grouped(results, configs, a.side)
        if "dense" in only:
            dense(results, configs, a.side, tuple(int(r) for r in a.rows.split(",")), a.experimental)
        if "linear" in only:
            linear(results, a.side, tuple(int(r) for r in a.rows.split(",")), a.experimental)
    finally:
        Path(a.out).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
