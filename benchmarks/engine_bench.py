"""The serving engine against its own bare step, on one GPU, same weights, same run.

Model: the full-width DeepSeek-V3 slice with FP8 weights of `benchmarks/e2e_bench.py` (its builders,
imported). Measures, in one run:
  * the bare jitted decode step (e2e_bench's `decode_case`: [B, 1] tokens over a paged cache at context
    1K, argmax) at batch 1, 64, 256, beside the HBM floor (bytes it must read / the copy bandwidth);
  * the engine on the same loads: 1 request (1K prompt, 128 new tokens); B requests x (1K prompt, 128
    new) for B in (64, 256), all at once and with Poisson arrivals. Per load: output tok/s (whole run,
    and over the decode-only steps), ITL p50/p99, median TTFT, mean rows and tokens per step, and the
    ratio of decode-only throughput to batch / bare step time;
  * `--kv-cache-dtype fp8` (issue 28 item 4): the same loads with the FP8 latent cache (EngineConfig.
    kv_cache_dtype); run it beside a bf16 run (`--kv-cache-dtype bf16`) for the table, e.g. `--prompt 4096
    --batches 64,256`. The task "largest batch at --fit-context" sizes the pool with `dsv3_jax.plan.pool_plan`
    for one device at that context (the slice's weights, this dtype) and times the bare decode step at that
    batch over full contexts, so the bf16 and fp8 runs show the concurrency each cache buys;
  * optionally (--xla-variants) the bare batch-1 step under other XLA command-buffer flags, each in a
    subprocess (the flags are read when the backend starts).
The engine (and its page pool) is built at the first load, so bare and largest-fit cases that run before
it have the device's memory to themselves. Compile time is reported apart: the engine's `warmup()` runs
before the first load (seconds per compiled
shape in the JSON's `warmup`), and the 64- and max-batch-request loads must compile nothing after it (the
run exits non-zero if one did; any compile during a load is in its row). Greedy decoding, EOS off.
Prints a table last and writes JSON (--out). --tiny runs the same code on CPU with a tiny config.
On an 80 GB card the 4K-context b=256 cases need `XLA_PYTHON_CLIENT_MEM_FRACTION=0.9`: at JAX's default
0.75 the bare b=256 step ran out of memory on an H100 (2026-12-07; 50 GB of slice weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_bench  # noqa: E402

from dsv3_jax.api import ModelHandle  # noqa: E402
from dsv3_jax.engine.core import Engine, EngineConfig  # noqa: E402
from dsv3_jax.model import kv_cache, layout  # noqa: E402
from dsv3_jax.model.kv_cache import PageMeta  # noqa: E402
from dsv3_jax.model.trace_options import TraceOptions  # noqa: E402

# Before this work (issue 13, same slice and device, 2026-12-03): quoted, not re-measured here.
BEFORE = {"bare_b1_ms": 4.20, "bare_b1_floor_ms": 1.14, "engine_1req_itl_ms": 7.01, "engine_1req_tok_s": 121,
          "engine_1req_maxbatch32_itl_ms": 10.6, "engine_1req_maxbatch32_ttft_ms": 496, "bare_b64_ms": 13.7,
          "bare_b64_floor_ms": 10.2, "engine_64req_itl_ms": 240, "engine_64req_tok_s": 63,
          "engine_64req_mean_batch": 14, "engine_64req_ttft_s": 16}


def timed_warmup(eng: Engine) -> dict:
    """`eng.warmup()` (every step program the engine can use): wall seconds, and the seconds of each program
    from its tracing to its compile's end (programs compile in parallel, so these overlap)."""
    shapes: list[dict] = []
    c0 = eng.stats["compiles"]
    def progress(done: int, total: int, key, s: float) -> None:
        shapes.append({"shape": str(key), "s": round(s, 2)})
        print(f"  warmup {done}/{total}: {key} {s:.1f} s", flush=True)

    seconds = eng.warmup(progress=progress)
    return {"s": seconds, "compiles": eng.stats["compiles"] - c0, "loaded": eng.stats["programs_loaded"],
            "shapes": shapes}


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def run_load(eng: Engine, prompts: list[list[int]], new: int, rate: float | None, seed: int) -> dict:
    """Feed `prompts` (all at once, or Poisson arrivals at `rate`/s), step to completion, measure."""
    rng = np.random.default_rng(seed)
    arrivals = np.zeros(len(prompts)) if rate is None else np.cumsum(rng.exponential(1 / rate, len(prompts)))
    compiles0, compile_s0 = eng.stats["compiles"], eng.stats["compile_s"]
    steps0 = eng.stats["steps"]
    t0 = eng.clock()
    nxt, rids, step_ends = 0, [], []
    while nxt < len(prompts) or eng.has_work():
        now = eng.clock() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            rids.append(eng.add_request(prompts[nxt], max_new_tokens=new))
            nxt += 1
        if not eng.has_work():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        before = eng.stats["steps"]
        eng.step()
        if eng.stats["steps"] > before:  # a step was dispatched (not only a drain)
            step_ends.append(eng.clock())
    wall = eng.clock() - t0
    reqs = [eng.finished[r] for r in rids]
    assert all(len(r.output) == new for r in reqs), "every request must produce its tokens (EOS is off)"
    itl = np.concatenate([np.diff(r.token_times) for r in reqs])
    ttft = [r.first_token_at - r.arrival for r in reqs]
    s = eng.stats
    n_steps = s["steps"] - steps0
    rows, toks, padded = (np.array(list(s[k])[-n_steps:]) for k in ("batch_sizes", "tokens", "padded_tokens"))
    # Decode-only steps: as many tokens as rows. Their durations (between consecutive step returns,
    # pipelined) give the steady-state step time of the engine.
    dur = np.diff(np.array(step_ends))
    dec = (toks[1:] == rows[1:]) & (rows[1:] == len(prompts)) if rate is None else (toks[1:] == rows[1:])
    dec_tok_s = float(np.sum(rows[1:][dec]) / np.sum(dur[dec])) if dec.any() else None
    return {"requests": len(prompts), "new_tokens": new, "rate_per_s": rate, "wall_s": wall,
            "output_tok_s": len(reqs) * new / wall, "decode_only_steps": int(dec.sum()),
            "decode_only_tok_s": dec_tok_s,
            "decode_only_step_ms": float(np.median(dur[dec]) * 1e3) if dec.any() else None,
            "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
            "ttft_median_s": float(np.median(ttft)), "ttft_p99_s": pct(ttft, 99),
            "steps": len(rows), "mean_rows": float(rows.mean()), "mean_tokens": float(toks.mean()),
            "mean_padded_tokens": float(padded.mean()),
            "compiles_during": s["compiles"] - compiles0, "compile_s_during": s["compile_s"] - compile_s0}


# Command buffers (CUDA graphs) for the bare batch-1 step, set per compile (XLA DebugOptions).
CB_ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE,DYNAMIC_SLICE_FUSION"
XLA_VARIANTS = {
    "default": {},
    "command buffers off": {"xla_gpu_enable_command_buffer": ""},
    "command buffers all types, min graph 1": {"xla_gpu_enable_command_buffer": CB_ALL,
                                               "xla_gpu_graph_min_graph_size": 1},
    "all types + unrolled loops": {"xla_gpu_enable_command_buffer": CB_ALL, "xla_gpu_graph_min_graph_size": 1,
                                   "xla_gpu_command_buffer_unroll_loops": True},
    # A scanned layer's weights reach a cuBLAS GEMM or a custom call as a dynamic-slice of the stacked
    # parameter: without this XLA copies the slice out first (the BF16 slice's memcpy kernels, 2026-12-05).
    "dynamic-slice fusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
    # Dense dots as cuBLAS calls (Triton GEMM fusions off): the BF16 product default since 2026-12-06
    # (executor.BF16_GEMM_OPTIONS). Dynamic-slice fusion did not remove the BF16 slice's weight copies with
    # either GEMM choice (the same device time with and without it).
    "cuBLAS GEMMs": {"xla_gpu_enable_triton_gemm": False},
    "cuBLAS GEMMs + dynamic-slice fusion": {"xla_gpu_enable_triton_gemm": False,
                                            "xla_gpu_enable_dynamic_slice_fusion": True},
}


def pick_variants(spec: str | None) -> dict[str, dict]:
    """XLA_VARIANTS named in `spec` (comma list; "all" or None: every one), "default" always first."""
    if spec in (None, "all"):
        return dict(XLA_VARIANTS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in XLA_VARIANTS]
    if bad:
        raise SystemExit(f"unknown XLA variant(s) {bad}; known: {list(XLA_VARIANTS)}")
    return {n: XLA_VARIANTS[n] for n in ["default", *[n for n in names if n != "default"]]}


def bare_step(model, params, cfg, batch: int, ctx: int, reps: int, backend: str, options: dict) -> dict:
    """e2e_bench.decode_case's step ([B, 1] tokens at position ctx over a paged cache, argmax),
    compiled with XLA `options`."""
    ps = kv_cache.PAGE_SIZE
    table = kv_cache.contiguous_table(batch, ctx + 1, ps)
    cache = kv_cache.allocate(cfg, 1 + table.size, ps, "absorbed", jnp.bfloat16)
    cache = jax.tree_util.tree_map(lambda c: jax.random.normal(jax.random.key(1), c.shape, c.dtype) * 0.5, cache)
    meta = PageMeta(jnp.asarray(table), jnp.ones((batch,), jnp.int32))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
    pos = jnp.full((batch, 1), ctx, jnp.int32)
    m = model.clone(trace_options=TraceOptions(kernels=backend))
    f = jax.jit(lambda p, c: m.apply({"params": p}, toks, pos, c, meta)[0][:, -1].argmax(-1))
    lowered = f.lower(params, cache)
    t0 = time.perf_counter()
    comp = lowered.compile(compiler_options=options) if options else lowered.compile()
    compile_s = time.perf_counter() - t0
    return {**e2e_bench.timeit(lambda: comp(params, cache), reps), "compile_s": compile_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny config")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip remaining loads after this")
    ap.add_argument("--no-xla-variants", action="store_true", help="skip the command-buffer variants")
    ap.add_argument("--tasks", default="", help="comma-separated task names to run (default: all, by priority)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bf16", "fp8"))
    ap.add_argument("--fit-context", type=int, default=32768, help="context of the largest-batch task")
    ap.add_argument("--out", type=Path, default=Path("engine_bench.json"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    backend = "reference" if args.tiny else "pallas"
    cfg = e2e_bench.slice_config(args.moe_layers, args.tiny)
    model, params = e2e_bench.random_fp8_params(cfg)
    batches = [int(b) for b in args.batches.split(",") if b]
    res: dict = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
                 "command": " ".join(sys.argv), "before": BEFORE,
                 "config": {"layers": cfg.num_hidden_layers, "moe_layers": cfg.n_moe_layers},
                 "weights_s": time.perf_counter() - t_start}

    def save():
        args.out.write_text(json.dumps(res, indent=1))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    res["copy_bw_gbs"] = e2e_bench.copy_bandwidth() / 1e9
    cache_dtype = layout.kv_cache_dtype(cfg, args.kv_cache_dtype)
    token_bytes = layout.bytes_per_token(cfg, "absorbed", cache_dtype) // cfg.num_hidden_layers  # per layer
    res["bare"], res["loads"], res["xla_variants"] = [], [], []
    bare: dict[int, float] = {}

    def bare_case(b: int) -> None:
        r = e2e_bench.decode_case(model, params, cfg, b, args.prompt, args.reps, backend, cache_dtype)
        floor = 1e3 * e2e_bench.step_bytes(cfg, params, b, args.prompt, token_bytes) / (res["copy_bw_gbs"] * 1e9)
        res["bare"].append({"batch": b, **r, "floor_ms": floor, "ratio_to_floor": r["median_ms"] / floor})
        bare[b] = r["median_ms"]

    handle = ModelHandle(cfg, params)
    rng = np.random.default_rng(0)
    vocab = cfg.vocab_size
    max_req = max(batches)
    pages = max_req * -(-(args.prompt + args.new) // kv_cache.PAGE_SIZE) + 1
    # The engine's default step shapes (decode 4, 32, max_batch rows; the token budget): all warmed first.
    ecfg = EngineConfig(num_pages=pages, max_batch=max_req, max_batched_tokens=args.max_batched_tokens,
                        chunk_size=args.chunk, prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype)
    res["kv_cache_dtype"] = args.kv_cache_dtype
    res["engine_config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ecfg.__dict__.items()}
    engines: list[Engine] = []

    def main_engine() -> Engine:
        """The engine of the loads, built (its page pool allocated) at the first load only: the bare and
        largest-fit cases before it get the device's memory without the pool (at 256 rows on an H100, a
        bare case beside the pool ran out of memory on 2026-12-06)."""
        if not engines:
            engines.append(Engine(handle, ecfg))
            res["warmup"] = timed_warmup(engines[0])  # compile every step shape before the first load
            save()
        return engines[0]

    def load(b: int, rate: float | None, engine: Engine | None = None, tag: str | None = None) -> None:
        prompts = [rng.integers(2, vocab, args.prompt).tolist() for _ in range(b)]
        engine = engine or main_engine()
        try:
            row = run_load(engine, prompts, args.new, rate, seed=b)
            if bare.get(b) and row["decode_only_tok_s"] and rate is None:
                row["bare_tok_s"] = b / (bare[b] / 1e3)
                row["decode_vs_bare"] = row["decode_only_tok_s"] / row["bare_tok_s"]
            if b == 1 and 1 in bare:
                row["itl_vs_bare"] = row["itl_p50_ms"] / bare[1]
        except Exception as e:  # noqa: BLE001 - record and keep measuring
            row = {"requests": b, "rate_per_s": rate, "error": repr(e)[:400]}
        if tag:
            row["compiler_options"] = tag
        res["loads"].append(row)

    def variants() -> None:
        """Command buffers for batch 1: the bare step under each variant, then the 1-request load
        through an engine compiled with the best one."""
        for name, opts in XLA_VARIANTS.items():
            if left() < 30:
                res["xla_variants"].append({"variant": name, "skipped": True})
                continue
            try:
                res["xla_variants"].append({"variant": name, "options": opts, **bare_step(
                    model, params, cfg, 1, args.prompt, args.reps, backend, opts)})
            except Exception as e:  # noqa: BLE001
                res["xla_variants"].append({"variant": name, "options": opts, "error": repr(e)[:300]})
            save()
        ok = [v for v in res["xla_variants"] if "median_ms" in v]
        best = min(ok, key=lambda v: v["median_ms"]) if ok else None
        if best and best["options"] and left() > 45:
            cb = Engine(handle, dataclasses.replace(ecfg, compiler_options=best["options"]))
            load(1, None, cb, best["variant"])

    def mtp() -> None:
        """spec_k=1 vs 0 at batch 1 on the embedded trained default model (greedy, a stdlib prompt)."""
        from dsv3_jax import api
        from dsv3_jax.config import ModelConfig

        # The weights as dsv3_jax.load() reads them, without its tokenizer (not on the GPU machine): the
        # prompt was tokenized ahead (benchmarks/data/mtp_prompt_ids.json: stdlib source, in-domain).
        d = api.DEFAULT_MODEL_DIR
        mcfg = ModelConfig.from_json(d / "config.json")
        h = ModelHandle(mcfg, jax.tree_util.tree_map(jnp.asarray, api._host_params(d, mcfg)))
        prompt = json.loads((Path(__file__).parent / "data" / "mtp_prompt_ids.json").read_text())["ids"]
        out = {"model": "embedded default (dsv3-small, trained)", "prompt_tokens": len(prompt),
               "new_tokens": args.new}
        for k in (0, 1):
            e = Engine(h, EngineConfig(num_pages=64, max_batch=1, spec_k=k, prefix_caching=False))
            e.generate([prompt], max_new_tokens=8)  # compile
            r = e.generate([prompt], max_new_tokens=args.new)[0]
            span = r.token_times[-1] - r.first_token_at
            out[f"k{k}"] = {"decode_tok_s": (len(r.output) - 1) / span, "steps": r.steps,
                            "tokens_per_step": len(r.output) / r.steps,
                            "acceptance": r.metrics()["spec_acceptance"], "output": r.output}
        out["same_tokens"] = out["k0"].pop("output") == out["k1"].pop("output")
        out["speedup"] = out["k1"]["decode_tok_s"] / out["k0"]["decode_tok_s"]
        res["mtp"] = out

    def largest_fit() -> None:
        """As many requests at --fit-context as one device's pool holds (pool_plan, this cache dtype): the bare
        decode step at that batch over a cache of that many full contexts (random values), beside its floor."""
        from dsv3_jax import plan as planning
        from dsv3_jax.parallel.flags import attention_kernel_serves

        dev = jax.devices()[0]
        mem = (dev.memory_stats() or {}).get("bytes_limit") if hasattr(dev, "memory_stats") else None
        ctx = 256 if args.tiny else args.fit_context
        pp = planning.pool_plan(cfg, "tensor=1", dtype="fp8", max_model_len=ctx, device_memory=mem or 24 * 2**30,
                                cache_dtype=args.kv_cache_dtype, max_batched_tokens=args.max_batched_tokens,
                                max_batch=256, params_or_shapes=params,
                                attention_kernel=attention_kernel_serves(handle, args.kv_cache_dtype))
        n = max(1, min(pp.max_requests, 4 if args.tiny else 1024))
        row = {"context": ctx, "requests": n, "planned_requests": pp.max_requests,
               "pool_tokens": pp.kv_tokens_per_shard, "device_memory": mem}
        try:
            r = e2e_bench.decode_case(model, params, cfg, n, ctx - 1, args.reps, backend, cache_dtype)
            floor = 1e3 * e2e_bench.step_bytes(cfg, params, n, ctx, token_bytes) / (res["copy_bw_gbs"] * 1e9)
            row |= {**r, "tok_s": n / (r["median_ms"] / 1e3), "floor_ms": floor, "ratio_to_floor": r["median_ms"] / floor}
        except Exception as ex:  # noqa: BLE001 - record and keep measuring
            row["error"] = repr(ex)[:400]
        res["largest_fit"] = row

    # In priority order; each runs only if the time budget still allows it (the rest is listed skipped).
    tasks = [("bare b=1", 20, lambda: bare_case(1)), ("bare b=64", 30, lambda: bare_case(64)),
             ("1 request", 30, lambda: load(1, None)), ("64 at once", 40, lambda: load(64, None)),
             ("command-buffer variants", 60, variants), ("MTP spec_k=1 at batch 1", 40, mtp),
             (f"bare b={max_req}", 30, lambda: bare_case(max_req)),
             (f"{max_req} at once", 60, lambda: load(max_req, None)),
             ("64 poisson", 40, lambda: load(64, 16.0)),
             ("largest batch at --fit-context", 90, largest_fit),
             (f"{max_req} poisson", 60, lambda: load(max_req, max_req / 4.0))]
    done: set[str] = set()
    for name, need, fn in tasks:
        if name in done:
            continue
        done.add(name)
        chosen = not args.tasks or name in args.tasks.split(",")
        if not chosen or name.startswith("64") and 64 not in batches or left() < need:
            res.setdefault("skipped", []).append(name)
            continue
        fn()
        save()
    if engines:
        res["engine_stats"] = engines[0].engine_stats()
    res["total_s"] = time.perf_counter() - t_start
    # After warmup, the 64- and max-batch-request loads must run on programs compiled already.
    res["compile_check"] = [f"{r['requests']} requests" + (f" @{r['rate_per_s']:.0f}/s" if r.get("rate_per_s") else "")
                            + f": {r['compiles_during']} compiles ({r['compile_s_during']:.1f} s) after warmup"
                            for r in res["loads"] if r["requests"] in (64, max_req) and "compiler_options" not in r
                            and r.get("compiles_during", 0) != 0]
    save()
    st = res.get("engine_stats")  # absent when no load ran (no engine was built)
    compiled = (f"  engine compiles {st['compiles']} programs in {st['compile_s']:.0f} s (excluded from the figures)"
                if st else "  no engine built")
    print(f"\ndevice {res['device']}  copy {res['copy_bw_gbs']:.0f} GB/s  weights built in {res['weights_s']:.0f} s"
          + compiled)
    print(f"{'bare batch':>10} {'step ms':>8} {'min':>6} {'max':>6} {'floor':>6} {'ratio':>6}")
    for r in res["bare"]:
        print(f"{r['batch']:>10} {r['median_ms']:>8.2f} {r['min_ms']:>6.2f} {r['max_ms']:>6.2f} {r['floor_ms']:>6.2f} "
              f"{r['ratio_to_floor']:>6.2f}")
    print(f"{'load':>14} {'tok/s':>7} {'dec tok/s':>9} {'vs bare':>7} {'ITL p50':>7} {'p99':>7} {'TTFT med':>8} "
          f"{'rows':>5} {'tokens':>6} {'compiles':>8}")
    for r in res["loads"]:
        name = f"{r['requests']}" + (f" @{r['rate_per_s']:.0f}/s" if r.get("rate_per_s") else " at once")
        name += " (cb)" if r.get("compiler_options") else ""
        if "error" in r:
            print(f"{name:>14} error {r['error'][:90]}")
            continue
        vs = r.get("decode_vs_bare") or r.get("itl_vs_bare")
        dts = r["decode_only_tok_s"] or float("nan")
        print(f"{name:>14} {r['output_tok_s']:>7.0f} {dts:>9.0f} {vs or float('nan'):>7.2f} "
              f"{r['itl_p50_ms']:>7.2f} {r['itl_p99_ms']:>7.2f} {r['ttft_median_s']:>8.3f} {r['mean_rows']:>5.1f} "
              f"{r['mean_tokens']:>6.0f} {r['compiles_during']:>8}")
    for v in res.get("xla_variants", []):
        print(f"bare b=1, {v['variant']}: {v.get('median_ms', v.get('error', 'skipped'))}")
    if "mtp" in res:
        m = res["mtp"]
        print(f"MTP b=1 ({m['model']}): {m['k1']['decode_tok_s']:.0f} vs {m['k0']['decode_tok_s']:.0f} tok/s "
              f"(x{m['speedup']:.2f}), acceptance {m['k1']['acceptance']}, tokens/step {m['k1']['tokens_per_step']:.2f}, "
              f"same tokens {m['same_tokens']}")
    if "largest_fit" in res:
        f = res["largest_fit"]
        print(f"largest batch at {f['context']} tokens, {args.kv_cache_dtype} cache: pool {f['pool_tokens']:,} tokens, "
              f"{f['requests']} requests (planned {f['planned_requests']}): "
              + (f"error {f['error'][:80]}" if "error" in f else
                 f"bare step {f['median_ms']:.2f} ms ({f['min_ms']:.2f}-{f['max_ms']:.2f}), {f['tok_s']:.0f} tok/s"))
    if "warmup" in res:
        w = res["warmup"]
        print(f"engine warmup: {w['compiles']} programs in {w['s']:.1f} s (cold): "
              + ", ".join(f"{x['shape']} {x['s']:.1f} s" for x in w["shapes"]))
    print("skipped:", res.get("skipped", []))
    if res["compile_check"]:
        raise SystemExit("FAIL: compiled during a load after warmup: " + "; ".join(res["compile_check"]))


if __name__ == "__main__":
    main()
