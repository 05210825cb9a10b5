"""Benchmark of the MLA attention kernels against the XLA-einsum references (GPU).

Owns the measurement only: for decode, B in {1, 8, 64, 128} x S in {1K, 4K, 16K, 32K} x H in {128, 16}
(one query token, every sequence at length S, shuffled pages), the Pallas kernel and the `jnp` reference
(same paged inputs, bf16 with fp32 accumulation) are timed in the same run; a short prefill section
times the absorbed kernel against the absorbed and naive (qk 192 / v 128) XLA forms. Each figure is the
median (min/max too) of `--reps` timings of `--inner` back-to-back calls. Before timing, every kernel
result is checked for NaN and against the fp32 reference (relative Frobenius error) where that
reference is affordable. `--merge-cost` also times the decode kernel without its split-KV merge
(`paged_mla_partials`: q prep + launch) in the same run and prints the difference, the merge's cost
(the launch overhead that matters at B = 1-8). `--variants v1,v2` times each decode kernel design on the
same inputs (`KERNEL_VARIANTS` of the kernel lab, `pallas_kernels.experimental.mla_variants`, where "v2"
is the product kernel; the default times the product alone), checks each against the fp32 reference
(flagged above 2e-2) and prints the time ratio last/first per row. Prints a table and writes JSON.

    python benchmarks/mla_bench.py --out benchmarks/results/mla_bench.json
    python benchmarks/mla_bench.py --batches 1 8 --seqs 1024 4096 --merge-cost --skip-prefill  # launch cost
    python benchmarks/mla_bench.py --variants v1,v2 --heads 128 --batches 64 128 --seqs 4096 --skip-prefill
    python benchmarks/mla_bench.py --interpret --batches 1 --seqs 128 --heads 16 --prefill-lens 64 --reps 1 \\
        --inner 1   # CPU smoke run
"""

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.experimental.mla_variants import KERNEL_VARIANTS, PRODUCT_VARIANT  # noqa: E402
from pallas_kernels.experimental.mla_variants import mla_decode as lab_mla_decode  # noqa: E402
from pallas_kernels.mla_common import KV_DIM, LATENT_DIM, PAGE_SIZE, ROPE_DIM  # noqa: E402
from pallas_kernels.mla_decode import paged_mla_partials  # noqa: E402
from pallas_kernels.mla_prefill import mla_chunk_attention  # noqa: E402
from pallas_kernels.mla_reference import mla_decode_reference  # noqa: E402

PAGE = PAGE_SIZE
SCALE = 192**-0.5
ERR_BOUND = 2e-2  # relative error vs fp32 the GPU tests accept


def _time(fn, args, reps: int, inner: int) -> dict:
    jax.block_until_ready(fn(*args))  # compile + warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            r = fn(*args)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t0) / inner)
    return dict(median_ms=1e3 * statistics.median(ts), min_ms=1e3 * min(ts), max_ms=1e3 * max(ts))


def _decode_inputs(key: int, b: int, h: int, s: int):
    rng = np.random.default_rng(key)
    n_pages = b * math.ceil(s / PAGE)
    table = rng.permutation(n_pages).reshape(b, -1).astype(np.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    kv = jax.random.normal(k1, (n_pages, PAGE, KV_DIM), jnp.bfloat16)
    ql = jax.random.normal(k2, (b, h, LATENT_DIM), jnp.bfloat16)
    qr = jax.random.normal(k3, (b, h, ROPE_DIM), jnp.bfloat16)
    return ql, qr, kv, jnp.asarray(table), jnp.full((b,), s, jnp.int32)


def _rel_err(x, ref) -> float:
    x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _partials_only(ql, qr, kv, table, seq, *, interpret):
    """The kernel launch with its q prep but without the split merge (the `--merge-cost` baseline)."""
    return paged_mla_partials(ql[:, None], qr[:, None], kv, table, seq - 1, seq, softmax_scale=SCALE,
                              interpret=interpret)


def bench_decode(args, results: list, deadline: float) -> None:
    interpret = args.interpret or None  # None: the one policy (interpreter off a GPU)
    variants = args.variants
    kerns = {v: jax.jit(lambda *a, v=v: lab_mla_decode(*a, softmax_scale=SCALE, interpret=interpret,
                                                       variant=v))
             for v in variants}
    part = jax.jit(functools.partial(_partials_only, interpret=interpret))
    ref = jax.jit(lambda *a: mla_decode_reference(*a, softmax_scale=SCALE))
    bs, ss = args.batches, args.seqs
    vcols = " | ".join(f"{v + ' ms':>9} {'TF/s':>6} {'GB/s':>6} {'rel_err':>8}" for v in variants)
    ratio_col = f" | {variants[-1] + '/' + variants[0]:>7}" if len(variants) > 1 else ""
    print(f"{'H':>4} {'B':>4} {'S':>6} | {vcols} | {'xla ms':>8} {'TF/s':>6} {'GB/s':>6} | {'speedup':>7}"
          + ratio_col + (f" | {'no-merge ms':>11} {'merge us':>8}" if args.merge_cost else ""), flush=True)
    for h in args.heads:
        for b in bs:
            for s in ss:
                if time.time() > deadline:
                    print("time budget spent; stopping decode sweep", flush=True)
                    return
                inp = _decode_inputs(b * 131 + s + h, b, h, s)
                rout = None
                if b * s <= 64 * 4096:  # fp32 reference only where it is cheap
                    rout, _ = ref(*[x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in inp])
                flops = 2.0 * b * h * s * (576 + 512)
                byts = b * s * 576 * 2.0
                per_variant = {}
                for v in variants:  # same inputs for every variant
                    out, lse = kerns[v](*inp)
                    nan = bool(jnp.isnan(out).any() | jnp.isnan(lse).any())
                    err = None if rout is None else _rel_err(out, rout)
                    t = _time(kerns[v], inp, args.reps, args.inner)
                    t.update(nan=nan, rel_err_vs_fp32=err, err_ok=None if err is None else err <= ERR_BOUND)
                    per_variant[v] = t
                    del out, lse
                tr = _time(ref, inp, args.reps, args.inner)
                for t in (*per_variant.values(), tr):
                    t["tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
                    t["gbps"] = byts / (t["median_ms"] * 1e-3) / 1e9
                tk = per_variant[variants[0]]
                row = dict(kind="decode", H=h, B=b, S=s, nan=tk["nan"], rel_err_vs_fp32=tk["rel_err_vs_fp32"],
                           kernel=tk, variants=per_variant, xla=tr)
                cells = []
                flags = ""
                for v, t in per_variant.items():
                    err = t["rel_err_vs_fp32"]
                    cells.append(f"{t['median_ms']:>9.4f} {t['tflops']:>6.1f} {t['gbps']:>6.0f} "
                                 f"{'-' if err is None else f'{err:.1e}':>8}")
                    flags += f"  {v}: NaN!" if t["nan"] else ""
                    flags += f"  {v}: rel_err > {ERR_BOUND}!" if t["err_ok"] is False else ""
                extra = ""
                if len(variants) > 1:
                    ratio = per_variant[variants[-1]]["median_ms"] / tk["median_ms"]
                    row["time_ratio_last_over_first"] = ratio
                    extra += f" | {ratio:>7.3f}"
                if args.merge_cost:  # same run: the kernel without the split merge that follows it
                    tp = _time(part, inp, args.reps, args.inner)
                    row["kernel_without_merge"] = tp
                    extra += f" | {tp['median_ms']:>11.4f} {1e3 * (tk['median_ms'] - tp['median_ms']):>8.1f}"
                results.append(row)
                print(f"{h:>4} {b:>4} {s:>6} | {' | '.join(cells)} | {tr['median_ms']:>8.4f} {tr['tflops']:>6.1f} "
                      f"{tr['gbps']:>6.0f} | {tr['median_ms'] / tk['median_ms']:>7.2f}{extra}{flags}", flush=True)
                del inp, rout


def _naive_prefill(q_nope, q_pe, k_nope, k_pe, v):
    """Naive-form causal MLA attention in XLA (per-head K/V, qk 192 / v 128), chunk = whole sequence."""
    s = jnp.einsum("bthd,bshd->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
    s += jnp.einsum("bthr,bsr->bhts", q_pe, k_pe, preferred_element_type=jnp.float32)
    t = q_nope.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    p = jax.nn.softmax(jnp.where(mask, s * SCALE, -jnp.inf), axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(v.dtype)


def bench_prefill(args, results: list, deadline: float) -> None:
    h = 128
    # The model's adaptor: the same arguments for kernel and reference (bf16 in, so both compute in bf16).
    kern = jax.jit(lambda *a: mla_chunk_attention(*a, softmax_scale=SCALE, use_kernel=True,
                                                  interpret=args.interpret or None))
    ref = jax.jit(lambda *a: mla_chunk_attention(*a, softmax_scale=SCALE, use_kernel=False))
    print(f"\nprefill H=128 B=1, chunk = whole sequence\n{'T':>6} | {'absorbed kernel ms':>18} {'TF/s':>6} | "
          f"{'absorbed xla ms':>15} | {'naive xla ms':>12} {'TF/s':>6}", flush=True)
    for t in args.prefill_lens:
        if time.time() > deadline:
            return
        ql, qr, kv, table, _ = _decode_inputs(t, 1, h, t)
        ql = jax.random.normal(jax.random.key(1), (1, t, h, 512), jnp.bfloat16)
        qr = jax.random.normal(jax.random.key(2), (1, t, h, 64), jnp.bfloat16)
        sp, cl = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
        inp = (ql, qr, kv, table, sp, cl)
        out, _ = kern(*inp)
        rout, _ = ref(*inp)
        err = _rel_err(out, rout)
        tk = _time(kern, inp, args.reps, 2)
        tr = _time(ref, inp, args.reps, 2)
        ks = jax.random.split(jax.random.key(3), 5)
        naive_in = (
            jax.random.normal(ks[0], (1, t, h, 128), jnp.bfloat16),
            jax.random.normal(ks[1], (1, t, h, 64), jnp.bfloat16),
            jax.random.normal(ks[2], (1, t, h, 128), jnp.bfloat16),
            jax.random.normal(ks[3], (1, t, 64), jnp.bfloat16),
            jax.random.normal(ks[4], (1, t, h, 128), jnp.bfloat16),
        )
        tn = _time(jax.jit(_naive_prefill), naive_in, args.reps, 2)
        pairs = h * t * (t + 1) / 2  # causal (query, key) pairs
        f_abs, f_naive = 2 * pairs * (576 + 512), 2 * pairs * (192 + 128)
        tk["tflops"] = f_abs / (tk["median_ms"] * 1e-3) / 1e12
        tn["tflops"] = f_naive / (tn["median_ms"] * 1e-3) / 1e12
        results.append(dict(kind="prefill", H=h, B=1, T=t, rel_err_vs_bf16_xla=err, kernel=tk,
                            xla_absorbed=tr, xla_naive=tn))
        print(f"{t:>6} | {tk['median_ms']:>18.3f} {tk['tflops']:>6.1f} | {tr['median_ms']:>15.3f} | "
              f"{tn['median_ms']:>12.3f} {tn['tflops']:>6.1f}   (rel err vs xla {err:.1e})", flush=True)


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in KERNEL_VARIANTS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--variants takes a comma-separated subset of {KERNEL_VARIANTS}, "
                                         f"got {text!r}")
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="mla_bench.json")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=400.0, help="no new configuration after this")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--interpret", action="store_true", help="CPU smoke run of the script (GPU interpreter)")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--variants", type=_variants, default=[PRODUCT_VARIANT],
                   help=f"comma-separated decode kernel designs timed on the same inputs, e.g. v1,v2 (the "
                        f"ratio column is last/first; {PRODUCT_VARIANT}, the default, is the product kernel); "
                        f"speedup is the first against xla")
    p.add_argument("--merge-cost", action="store_true",
                   help="also time the decode kernel without its split merge; prints the merge's cost in us")
    args = p.parse_args()
    deadline = time.time() + args.budget_s
    dev = jax.devices()[0]
    results: list = []
    meta = dict(device=dev.device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"), argv=sys.argv)
    print(meta, flush=True)
    try:
        bench_decode(args, results, deadline)
        if not args.skip_prefill:
            bench_prefill(args, results, deadline + 60)
    finally:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
