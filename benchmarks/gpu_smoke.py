"""The speed part of the GPU gate (`benchmarks/gpu_check.sh`): a few figures, each against a committed baseline.

Figures (medians over a few repeats, min/max beside them), measured with the existing benchmarks'
functions, imported:
  * the engine on the 5-layer FP8 slice of `e2e_bench.py` (full-width DeepSeek-V3 shapes, 1 dense + 4 MoE
    layers, random weights): `Engine.warmup()` first (seconds, cold: a fresh compilation cache), then
    1 request and 64 concurrent requests (1K prompt, 64 new tokens; `engine_bench.run_load`): ITL p50
    and output tok/s. The loads must compile nothing after the warmup (`stats["compiles"]` unchanged);
    the cold warmup must stay under its bound on the H200 (`COLD_WARMUP_MAX_S`), elsewhere within the
    tolerance of the card's baseline;
  * the MLA decode kernel at H=128 B=64 S=4K, the FP8 grouped GEMM at prefill (65,536 rows, both expert
    shapes) and the BF16 grouped GEMM at decode (512 rows): GPU time per call (`device_time.py`), each
    result checked against its reference first;
  * the bare batch-1 decode step (`e2e_bench.decode_case`, context 1K) beside its HBM floor.
A figure fails when it is more than --tolerance (15%) worse than the device's baseline,
`benchmarks/baseline_<card>.json` (`baseline_h200.json`, `baseline_h100.json`: `default_baseline`); the run
also fails when a check fails (kernel error bound, compiles after warmup, a part that raised) or when a
test part of gpu_check.sh failed (`--prior NAME=RC`). Without a baseline file it prints the figures, says
"no baseline" and exits 2, unless --write-baseline (writes it from this run; refused when one of this
run's checks failed, written but exit 1 when only a test part failed).
Prints a table last; full JSON to $OUT/gpu_smoke.json when $OUT is set (else benchmarks/results/).

    PYTHONPATH=$PWD python3 benchmarks/gpu_smoke.py [--write-baseline]        # one H200, ~3 min
    JAX_PLATFORMS=cpu python3 benchmarks/gpu_smoke.py --tiny --baseline /tmp/b.json --write-baseline
    python3 benchmarks/gpu_smoke.py --from-json $OUT/gpu_smoke.json            # judge saved figures again

--tiny runs the same code paths on CPU in well under a minute: the `tiny` preset config, small shapes, the
kernels' references, wall-clock timing (its figures are not performance figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
# Cold warmup, and nothing left in the user's cache: a fresh compilation cache unless one is given.
os.environ.setdefault("DSV3_JAX_CACHE_DIR", tempfile.mkdtemp(prefix="dsv3_gpu_smoke_xla_"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

BASELINE_DIR = ROOT / "benchmarks"


def default_baseline(device_kind: str) -> Path:
    """The committed baseline of this card: "NVIDIA H200" -> baseline_h200.json, "NVIDIA H100 80GB HBM3" ->
    baseline_h100.json (the model's first word after the vendor, lower case). Figures of one card are
    never judged against another's."""
    words = [w for w in device_kind.lower().split() if w not in ("nvidia", "tesla")]
    return BASELINE_DIR / f"baseline_{re.sub(r'[^a-z0-9]', '', words[0]) if words else 'unknown'}.json"
TOLERANCE = 0.15
ERR_BOUND = 2e-2  # relative error vs fp32 the GPU kernel tests accept (mla_bench.ERR_BOUND)

# The run's sizes: full (the H200 gate) and tiny (the CPU check of this script).
SIZES = {
    "full": dict(moe_layers=4, prompt=1024, new=64, concurrent=64, max_batched_tokens=4096, chunk=1024,
                 load_reps=(3, 2), bare_ctx=1024, bare_reps=10, kernel_calls=20, mla=(128, 64, 4096),
                 prefill_rows=65536, decode_rows=512, gemm_shapes=None),
    "tiny": dict(moe_layers=1, prompt=32, new=8, concurrent=64, max_batched_tokens=256, chunk=64,
                 load_reps=(2, 2), bare_ctx=64, bare_reps=3, kernel_calls=3, mla=(16, 2, 256),
                 prefill_rows=256, decode_rows=64, gemm_shapes={"gate_up": (128, 256), "down": (256, 128)}),
}


def spread(xs) -> dict:
    xs = [float(x) for x in xs]
    return {"median": float(np.median(xs)), "min": min(xs), "max": max(xs), "n": len(xs)}


class Run:
    """Figures (compared with the baseline) and checks (pass/fail on their own) of one smoke run."""

    def __init__(self, out: Path):
        self.out = out
        self.res: dict = {"device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
                          "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                          "figures": {}, "checks": [], "parts": {}}

    def figure(self, name: str, s: dict, unit: str, better: str | None, **extra) -> None:
        """better: "lower" / "higher" (gated against the baseline) or None (reported only)."""
        self.res["figures"][name] = {"value": s["median"], "min": s["min"], "max": s["max"], "n": s.get("n", 1),
                                     "unit": unit, "better": better, **extra}
        self.save()

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.res["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.save()

    def part(self, name: str, fn) -> None:
        """Run one part; an exception fails its check and the run goes on to the next part."""
        t0 = time.perf_counter()
        try:
            fn()
            self.check(f"{name} ran", True, "")
        except Exception as e:  # noqa: BLE001 - record, then measure the rest
            traceback.print_exc()
            self.check(f"{name} ran", False, f"{type(e).__name__}: {str(e)[:300]}")
        self.res["parts"][name] = round(time.perf_counter() - t0, 1)
        print(f"[{name}: {self.res['parts'][name]:.0f} s]", flush=True)
        self.save()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.res, indent=1))


# ------------------------------------------------------------------------------------------- parts
def kernel_timer(on_gpu: bool, calls: int):
    """GPU time per call from the profiler on a GPU (as kernel_device_bench), wall clock elsewhere."""
    from device_time import jax_device_time
    from mla_bench import _time

    if on_gpu:
        return lambda fn, args: jax_device_time(fn, args, calls=calls)
    return lambda fn, args: _time(fn, args, calls, 1)


def t_spread(t: dict) -> dict:
    return {"median": t["median_ms"], "min": t["min_ms"], "max": t["max_ms"]}


def mla_part(run: Run, z: dict, pallas: bool, timer) -> None:
    """kernel_device_bench.mla's case, one shape: the default decode kernel vs the fp32 reference."""
    from mla_bench import SCALE, _decode_inputs, _rel_err

    from pallas_kernels.mla_decode import mla_decode
    from pallas_kernels.mla_reference import mla_decode_reference

    h, b, s = z["mla"]
    inp = _decode_inputs(b * 131 + s + h, b, h, s)
    ref = jax.jit(lambda *a: mla_decode_reference(*a, softmax_scale=SCALE))
    rout, _ = ref(*[x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in inp])
    kern = mla_decode if pallas else mla_decode_reference
    fn = jax.jit(lambda *a: kern(*a, softmax_scale=SCALE))
    out, lse = fn(*inp)
    err = _rel_err(out, rout)
    finite = bool(jnp.isfinite(out).all() & jnp.isfinite(lse).all())
    run.check(f"mla H={h} B={b} S={s} matches fp32", finite and err <= ERR_BOUND, f"rel err {err:.2e}, finite {finite}")
    t = timer(fn, inp)
    run.figure(f"mla decode H={h} B={b} S={s} ms", t_spread(t), "ms", "lower",
               tflops=2.0 * b * h * s * (576 + 512) / t["median_ms"] / 1e9, rel_err=err)


def grouped_parts(run: Run, z: dict, pallas: bool, timer) -> None:
    """FP8 grouped GEMM at prefill rows (kernel_device_bench.grouped's case) and BF16 at decode rows
    (moe_gemm_bench's bf16 decode case), uniform loads over 256 experts, each checked on sampled experts."""
    from moe_gemm_bench import SHAPES, E, check_sample, check_sample_bf16, group_sizes_for, random_fp8_weights

    from pallas_kernels.fp8_gemm import fp8_grouped_gemm
    from pallas_kernels.fp8_quant import quantize_act
    from pallas_kernels.fp8_reference import fp8_grouped_gemm_reference
    from pallas_kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference

    shapes = z["gemm_shapes"] or SHAPES
    f8 = jax.jit(fp8_grouped_gemm if pallas else fp8_grouped_gemm_reference)
    fb = jax.jit(grouped_gemm if pallas else grouped_gemm_reference)
    for shape, (k, n) in shapes.items():  # FP8, prefill
        m = z["prefill_rows"]
        kx, kw = jax.random.split(jax.random.key(m + n + k))
        xq, xs = quantize_act(jax.random.normal(kx, (m, k), jnp.bfloat16))
        wq, ws = random_fp8_weights(kw, E, n, k)
        gs = group_sizes_for(m, E, "uniform")
        args = (xq, xs, wq, ws, jnp.asarray(gs))
        err = check_sample(f8(*args), xq, xs, wq, ws, gs, [0, 1, E - 1])
        run.check(f"fp8 grouped {shape} M={m} matches fp32", err <= ERR_BOUND, f"rel err {err:.2e}")
        t = timer(f8, args)
        run.figure(f"fp8 grouped prefill {shape} M={m} ms", t_spread(t), "ms", "lower",
                   tflops=2.0 * m * n * k / t["median_ms"] / 1e9, rel_err=err)
        del xq, xs, wq, ws, args
    for shape, (k, n) in shapes.items():  # BF16, decode
        m = z["decode_rows"]
        kx, kw = jax.random.split(jax.random.key(m * 7 + k))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = jax.random.normal(kw, (E, n, k), jnp.bfloat16) * 0.02
        gs = group_sizes_for(m, E, "uniform")
        args = (x, w, jnp.asarray(gs))
        err = check_sample_bf16(fb(*args), x, w, gs, [0, 1, 7, E - 1])
        run.check(f"bf16 grouped {shape} M={m} matches fp32", err <= ERR_BOUND, f"rel err {err:.2e}")
        t = timer(fb, args)
        active = int((gs > 0).sum())
        run.figure(f"bf16 grouped decode {shape} M={m} ms", t_spread(t), "ms", "lower",
                   weight_tbps=2.0 * active * n * k / t["median_ms"] / 1e9, rel_err=err)
        del x, w, args


# Issue 26's bounds for the slice, set on one H200. The cold one is a host figure (tracing and Mosaic GPU
# lowering are serial Python: ~10 s of the ~13 s per program) and holds only on the card it was set on
# (the H100 machine's host took 102.6 s on 2026-12-06); elsewhere the cold warmup is judged against the
# card's baseline like any figure. The cached bound (a program store load) holds on any card.
COLD_WARMUP_MAX_S = {"NVIDIA H200": 90.0}
CACHED_WARMUP_MAX_S = 15.0


def slice_parts(run: Run, z: dict, tiny: bool, warmup_only: bool = False) -> None:
    """The FP8 slice: the bare batch-1 step beside its HBM floor, then the engine (warmup, loads).
    `warmup_only`: the engine's warmup alone, from the persistent compilation cache a previous process
    filled (gpu_check.sh runs this as a second process: what a server restart costs)."""
    import e2e_bench
    import engine_bench

    from dsv3_jax.api import ModelHandle
    from dsv3_jax.engine.core import Engine, EngineConfig
    from dsv3_jax.model import kv_cache

    t0 = time.perf_counter()
    cfg = e2e_bench.slice_config(z["moe_layers"], tiny)
    model, params = e2e_bench.random_fp8_params(cfg)
    jax.block_until_ready(params)
    run.res["slice"] = {"layers": cfg.num_hidden_layers, "moe_layers": cfg.n_moe_layers,
                        "weight_gb": sum(x.nbytes for x in jax.tree_util.tree_leaves(params)) / 1e9,
                        "build_s": time.perf_counter() - t0}
    backend = "reference" if tiny else "pallas"

    def bare() -> None:
        bw = e2e_bench.copy_bandwidth()
        r = e2e_bench.decode_case(model, params, cfg, 1, z["bare_ctx"], z["bare_reps"], backend)
        floor = 1e3 * e2e_bench.step_bytes(cfg, params, 1, z["bare_ctx"]) / bw
        run.figure("bare b=1 decode step ms", t_spread(r), "ms", "lower", floor_ms=floor,
                   ratio_to_floor=r["median_ms"] / floor, copy_gbs=bw / 1e9)
        run.figure("bare b=1 step / HBM floor", {"median": r["median_ms"] / floor, "min": r["min_ms"] / floor,
                                                 "max": r["max_ms"] / floor}, "x", None)

    def engine() -> None:
        c = z["concurrent"]
        pages = c * kv_cache.pages_for(z["prompt"] + z["new"], kv_cache.PAGE_SIZE) + 1
        # The engine's default step shapes (decode 4, 32 and c rows; the token budget), all warmed: the
        # cold warmup figure is what a server start costs.
        ecfg = EngineConfig(num_pages=pages, max_batch=c, max_batched_tokens=z["max_batched_tokens"],
                            chunk_size=z["chunk"], prefix_caching=False)
        eng = Engine(ModelHandle(cfg, params), ecfg)
        run.res["engine_config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ecfg.__dict__.items()}
        w = engine_bench.timed_warmup(eng)
        run.res["warmup"] = w
        device = str(jax.devices()[0].device_kind)
        kind, bound = ("cached", CACHED_WARMUP_MAX_S) if warmup_only else ("cold", COLD_WARMUP_MAX_S.get(device))
        # Gated against the baseline only where no absolute bound holds (and never in --tiny: CPU noise).
        gated = "lower" if bound is None and not tiny else None
        run.figure(f"engine warmup s ({kind})", {"median": w["s"], "min": w["s"], "max": w["s"]}, "s", gated,
                   compiles=w["compiles"], per_program_s=[x["s"] for x in w["shapes"]])
        if not tiny and bound is not None:
            run.check(f"engine warmup ({kind}) <= {bound:.0f} s", w["s"] <= bound,
                      f"{w['s']:.1f} s: {w['compiles']} programs compiled, {w['loaded']} loaded")
        if warmup_only:
            return
        rng = np.random.default_rng(0)
        compiles0 = eng.stats["compiles"]
        rows = {}
        for b, reps in zip((1, c), z["load_reps"], strict=True):
            rows[b] = []
            for i in range(reps):
                prompts = [rng.integers(2, cfg.vocab_size, z["prompt"]).tolist() for _ in range(b)]
                rows[b].append(engine_bench.run_load(eng, prompts, z["new"], None, seed=b + i))
        run.res["loads"] = rows
        n = eng.stats["compiles"] - compiles0
        run.check("engine loads compile nothing after warmup", n == 0,
                  f"{n} compiles ({eng.stats['compile_s']:.1f} s in all) during the loads; warmup compiled "
                  f"{w['compiles']}")
        for b, rs in rows.items():
            tag = "1 request" if b == 1 else f"{b} requests"
            run.figure(f"engine {tag} ITL p50 ms", spread([r["itl_p50_ms"] for r in rs]), "ms", "lower")
            run.figure(f"engine {tag} tok/s", spread([r["output_tok_s"] for r in rs]), "tok/s", "higher",
                       decode_only_tok_s=[r["decode_only_tok_s"] for r in rs],
                       ttft_median_s=[r["ttft_median_s"] for r in rs], itl_p99_ms=[r["itl_p99_ms"] for r in rs])
        run.res["engine_stats"] = eng.engine_stats()

    if not warmup_only:
        run.part("bare step", bare)
    run.part("engine", engine)


# ------------------------------------------------------------------------------------------- judging
def judge(res: dict, base: dict | None, tol: float) -> tuple[list[tuple], bool]:
    """Rows (figure, value, baseline, ratio, verdict) and whether everything passed."""
    rows, ok = [], True
    bf = (base or {}).get("figures", {})
    for name, f in res["figures"].items():
        v = f"{f['value']:.4g} [{f['min']:.4g}-{f['max']:.4g}] {f['unit']}"
        b = bf.get(name)
        if not f["better"]:
            rows.append((name, v, "-", "-", "INFO"))
            continue
        if b is None:
            rows.append((name, v, "-", "-", "NEW" if base else "-"))
            continue
        ratio = f["value"] / b["value"] if b["value"] else float("inf")
        worse = ratio > 1 + tol if f["better"] == "lower" else ratio < 1 - tol
        ok &= not worse
        rows.append((name, v, f"{b['value']:.4g}", f"{ratio:.3f}", "FAIL" if worse else "PASS"))
    for name in bf:
        if name not in res["figures"] and bf[name].get("better"):
            rows.append((name, "missing", f"{bf[name]['value']:.4g}", "-", "FAIL"))
            ok = False
    for c in res["checks"]:
        rows.append((c["name"], c["detail"] or "ok", "-", "-", "PASS" if c["ok"] else "FAIL"))
        ok &= c["ok"]
    for name, rc in res.get("prior", {}).items():
        rows.append((f"test part: {name}", f"exit {rc}", "-", "-", "PASS" if rc == 0 else "FAIL"))
        ok &= rc == 0
    return rows, ok


def print_table(rows: list[tuple]) -> None:
    w = [max(len(str(r[i])) for r in [("figure", "value", "baseline", "ratio", "")] + rows) for i in range(4)]
    w[0], w[1] = min(w[0], 48), min(w[1], 60)
    print(f"\n{'figure':<{w[0]}}  {'value':<{w[1]}}  {'baseline':>{w[2]}}  {'ratio':>{w[3]}}  result")
    for r in rows:
        print(f"{str(r[0])[:w[0]]:<{w[0]}}  {str(r[1])[:w[1]]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}  {r[4]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU check of this script: tiny config, references")
    ap.add_argument("--baseline", type=Path, help="default: benchmarks/baseline_<card>.json for this device (none with --tiny)")
    ap.add_argument("--write-baseline", action="store_true", help="write the baseline from this run")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="a figure this much worse fails")
    ap.add_argument("--prior", action="append", default=[], metavar="NAME=RC",
                    help="exit status of an earlier gate part (gpu_check.sh); non-zero fails the run")
    ap.add_argument("--from-json", type=Path, help="judge the figures of an earlier run instead of measuring")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: kernels,slice")
    ap.add_argument("--out", type=Path, help="JSON path (default $OUT/gpu_smoke.json, else benchmarks/results/)")
    ap.add_argument("--warmup-only", action="store_true",
                    help="only the slice engine's warmup (a second process: from the compilation cache); "
                         "checked against its bound, not against the baseline")
    args = ap.parse_args()
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results") \
        / "gpu_smoke.json"
    baseline_path = args.baseline or (None if args.tiny else default_baseline(str(jax.devices()[0].device_kind)))
    mode = "tiny" if args.tiny else "full"
    run = Run(out)
    if args.from_json:
        run.res = json.loads(args.from_json.read_text())
        mode = run.res.get("mode", mode)
    else:
        z = SIZES[mode]
        run.res.update(mode=mode, sizes=z, tolerance=args.tolerance)
        on_gpu = jax.default_backend() == "gpu"
        pallas = on_gpu and not args.tiny
        print(f"gpu_smoke ({mode}) on {run.res['device']}: kernels {'pallas' if pallas else 'reference'}, "
              f"timing {'GPU time (profiler)' if on_gpu else 'wall clock'}", flush=True)
        timer = kernel_timer(on_gpu, z["kernel_calls"])
        t0 = time.perf_counter()
        skip = set(args.skip.split(","))
        if "kernels" not in skip:  # first: their buffers are freed before the 45 GB slice is built
            run.part("mla kernel", lambda: mla_part(run, z, pallas, timer))
            run.part("grouped gemm", lambda: grouped_parts(run, z, pallas, timer))
        if "slice" not in skip:
            slice_parts(run, z, args.tiny, args.warmup_only)
        run.res["total_s"] = round(time.perf_counter() - t0, 1)
    run.res["prior"] = {p.split("=")[0]: int(p.split("=")[1]) for p in args.prior}
    run.res["tolerance"] = args.tolerance
    run.save()

    base = None
    if args.warmup_only:
        rows, ok = judge(run.res, None, args.tolerance)
        print_table(rows)
        return 0 if ok else 1
    if baseline_path and baseline_path.exists() and not args.write_baseline:
        base = json.loads(baseline_path.read_text())
    rows, ok = judge(run.res, base, args.tolerance)
    if base and (base.get("device"), base.get("mode")) != (run.res["device"], mode):
        rows.append(("baseline matches this run", f"baseline {base.get('device')} {base.get('mode')}, run "
                     f"{run.res['device']} {mode}", "-", "-", "FAIL"))
        ok = False
    run.res["verdict"] = {"ok": ok, "baseline": str(baseline_path) if base else None, "rows": rows}
    run.save()
    print_table(rows)
    print(f"JSON: {out}")
    if args.write_baseline:
        if not baseline_path:
            print("--write-baseline with --tiny needs --baseline PATH")
            return 2
        if not all(c["ok"] for c in run.res["checks"]):  # a failed test part alone does not void the figures
            print(f"FAIL: a check of this run failed; baseline {baseline_path} not written")
            return 1
        keep = ("device", "platform", "mode", "date", "command", "sizes", "slice", "engine_config")
        b = {k: run.res[k] for k in keep if k in run.res}
        b["figures"] = {k: {x: f[x] for x in ("value", "min", "max", "unit", "better")}
                        for k, f in run.res["figures"].items() if f["better"]}
        text = json.dumps(b, indent=1) + "\n"
        baseline_path.write_text(text)
        print(f"wrote baseline {baseline_path}")
        if os.environ.get("OUT") and not args.out:  # the device run's copy comes back through $OUT
            (Path(os.environ["OUT"]) / baseline_path.name).write_text(text)
        if not ok:
            print("FAIL: a test part failed (the baseline was written: the figures' own checks passed)")
        return 0 if ok else 1
    if base is None:
        print(f"no baseline ({baseline_path or 'none given'}): figures printed, nothing compared; "
              f"run with --write-baseline to create it")
        return 2
    print("PASS" if ok else f"FAIL (a figure more than {args.tolerance:.0%} worse than the baseline, or a check)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
