"""End-to-end benchmark on one GPU: a full-width DeepSeek-V3 slice with FP8 (default) or BF16 weights.

Measures, in one run (medians with min/max):
  * a correctness check first: the Pallas path (MLA kernel + FP8 GEMMs) vs the jnp reference path on
    the same weights and cache (logit relative error);
  * decode step time over a paged latent cache at several (batch, context) points, beside the HBM floor
    = bytes the step must touch (weights read, activated experts, lm_head, the cache) / the device copy
    bandwidth measured in the same run; and the same with the kernels forced off (pure XLA) where it fits;
  * prefill tokens/s beside the compute floor (activated FLOPs / the fp8 or bf16 GEMM rate measured here);
  * MTP speculative decoding on a small trained model (--mtp-compact): acceptance and tokens/s vs plain
    decoding at batch 1 and 32 through the serving engine.
Prints a table last and writes JSON (--out). Absolute times count only from the GPU.
BF16 slice (issue 15): ``--weights bf16 --moe-layers 2 --prefill-tokens 4096,16384
--decode-cases 1x1024,64x1024,256x1024`` (experts through ``pallas_kernels.grouped_gemm``).
"""

from __future__ import annotations

import argparse
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

from dsv3_jax.config import ModelConfig  # noqa: E402
from dsv3_jax.model import kv_cache  # noqa: E402
from dsv3_jax.model.kv_cache import PageMeta  # noqa: E402
from dsv3_jax.model.trace_options import TraceOptions  # noqa: E402
from dsv3_jax.model.transformer import Transformer  # noqa: E402


def slice_config(n_moe: int, tiny: bool) -> ModelConfig:
    if tiny:  # CPU smoke test of this script's code paths
        return ModelConfig.preset("tiny").replace(num_hidden_layers=1 + n_moe, first_k_dense_replace=1,
                                                  num_nextn_predict_layers=0, dtype="bfloat16",
                                                  vocab_size=1024)
    return ModelConfig.preset("deepseek-v3").replace(num_hidden_layers=1 + n_moe, first_k_dense_replace=1,
                                                     num_nextn_predict_layers=0)


def random_params(cfg: ModelConfig, seed: int = 0, fp8: bool = True):
    """Random weights generated leaf by leaf on device (no full-precision copy of the 45 GB of experts).

    FP8: e4m3 values with block scales. BF16: linears drawn with std 1/sqrt(fan_in) so activations stay
    O(1) through the slice and the logits are meaningful to compare between kernel paths.
    """
    model = Transformer(cfg, jnp.bfloat16, fp8=fp8)
    # init_all: the MTP layer's weights too when cfg has one (num_nextn_predict_layers)
    shapes = jax.eval_shape(
        lambda k: model.init(k, jnp.zeros((1, 1), jnp.int32), method=model.init_all)["params"], jax.random.key(0))
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for i, (path, s) in enumerate(leaves):
        name = path[-1].key
        key = jax.random.key(seed * 1000 + i)

        @jax.jit
        def make(k, s=s, name=name, path=path):
            if s.dtype == jnp.float8_e4m3fn:
                return (jax.random.normal(k, s.shape, jnp.bfloat16) * 64).astype(s.dtype)
            if name.endswith("scale"):
                return jnp.full(s.shape, 1.0 / 64 / math.sqrt(s.shape[-1] * 128), s.dtype)
            if name == "e_score_correction_bias":
                return jnp.zeros(s.shape, s.dtype)
            if any("norm" in str(getattr(p, "key", "")) for p in path):
                return jnp.ones(s.shape, s.dtype)
            if not fp8 and name.endswith("weight") and len(s.shape) >= 2 and "gate_weight" != name:
                return (jax.random.normal(k, s.shape, s.dtype) / math.sqrt(s.shape[-1])).astype(s.dtype)
            return (jax.random.normal(k, s.shape, jnp.float32) * 0.02).astype(s.dtype)

        out.append(make(key))
    return model, jax.tree_util.tree_unflatten(tree, out)


def random_fp8_params(cfg: ModelConfig, seed: int = 0):
    """The FP8 slice's random weights (see `random_params`)."""
    return random_params(cfg, seed, fp8=True)


def timeit(fn, reps: int) -> dict[str, float]:
    fn()  # compile + warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts)}


def copy_bandwidth() -> float:
    """Device copy bandwidth (read + write), bytes/s: torch if present (the DESIGN ceiling), else XLA."""
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
            y = torch.empty_like(x)
            for _ in range(3):
                y.copy_(x)
            torch.cuda.synchronize()
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                y.copy_(x)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            del x, y
            torch.cuda.empty_cache()
            return 2 * 2 * 1024**3 / statistics.median(ts)
    except Exception:  # noqa: BLE001 - torch missing or CPU-only: fall back to XLA's copy
        pass
    x = jnp.zeros((256 * 1024**2,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    t = timeit(lambda: f(x), 5)["median_ms"] / 1e3
    return 2 * x.nbytes / t


def fp8_rate() -> float:
    """fp8 dense GEMM rate (FLOP/s) via torch._scaled_mm when available (the DESIGN's ceiling)."""
    try:
        import torch

        n = 8192
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0, device="cuda")
        for _ in range(3):
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return 2 * n**3 / statistics.median(ts)
    except Exception:  # noqa: BLE001
        return 1285e12  # DESIGN.md's measured cuBLAS fp8 figure


def bf16_rate() -> float:
    """bf16 dense GEMM rate (FLOP/s), cuBLAS via torch at 8192^3 when available (the DESIGN's ceiling)."""
    try:
        import torch

        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            a @ b
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return 2 * n**3 / statistics.median(ts)
    except Exception:  # noqa: BLE001
        return 743e12  # DESIGN.md's measured cuBLAS bf16 figure


def step_bytes(cfg: ModelConfig, params, batch: int, ctx: int, cache_token_bytes: int | None = None) -> float:
    """Bytes one decode step must read: all non-expert weights, the experts a batch activates
    (expected count under uniform routing), lm_head, and the latent cache (`cache_token_bytes` per token
    per layer; default bf16 latent ++ rope)."""
    total, expert = 0, 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [getattr(p, "key", "") for p in path]
        if "embed_tokens" in names:
            continue  # a gather of `batch` rows
        nbytes = x.size * x.dtype.itemsize
        if any(n.endswith(("proj_weight", "proj_scale")) for n in names) and "moe_layers" in names:
            expert += nbytes
        else:
            total += nbytes
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    total += expert * touched / e
    per_token = cfg.latent_dim * 2 if cache_token_bytes is None else cache_token_bytes
    total += batch * ctx * per_token * cfg.num_hidden_layers
    return total


def decode_case(model, params, cfg, batch, ctx, reps, backend, cache_dtype=jnp.bfloat16):
    """The bare decode step: [B, 1] tokens at position ctx over a paged cache of random values in
    `cache_dtype` (a dtype, or layout.FP8 for the FP8 latent cache), argmax."""
    ps = kv_cache.PAGE_SIZE
    table = kv_cache.contiguous_table(batch, ctx + 1, ps)
    cache = kv_cache.allocate(cfg, 1 + table.size, ps, "absorbed", cache_dtype)
    # Drawn in fp32 and cast, so the FP8 leaves (e4m3 latent, fp32 scales) get values too.
    cache = jax.tree_util.tree_map(
        lambda c: (jax.random.normal(jax.random.key(1), c.shape, jnp.float32) * 0.5).astype(c.dtype), cache)
    meta = PageMeta(jnp.asarray(table), jnp.ones((batch,), jnp.int32))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
    pos = jnp.full((batch, 1), ctx, jnp.int32)

    m = model.clone(trace_options=TraceOptions(kernels=backend))
    f = jax.jit(lambda p, c: m.apply({"params": p}, toks, pos, c, meta)[0][:, -1].argmax(-1))
    return timeit(lambda: f(params, cache), reps)


def prefill_case(model, params, cfg, t: int, reps: int, rate_tflops: float) -> dict:
    """One t-token chunk (batch 1) into a fresh paged cache, beside its compute floor at `rate_tflops`."""
    ps = kv_cache.PAGE_SIZE
    table = jnp.asarray(kv_cache.contiguous_table(1, t, ps))
    cache = kv_cache.allocate(cfg, 1 + table.size, ps, "absorbed", jnp.bfloat16)
    toks = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    meta = PageMeta(table, jnp.full((1,), t, jnp.int32))
    f = jax.jit(lambda p, c: model.apply({"params": p}, toks, pos, c, meta)[0][:, -1])
    r = timeit(lambda: f(params, cache), reps)
    flops = 2 * cfg.param_count(activated=True) * t
    # Causal absorbed attention: scores over 576 and values over 512 per head, half the square.
    h, lat = cfg.num_attention_heads, cfg.latent_dim + cfg.kv_lora_rank
    flops += 2 * cfg.num_hidden_layers * h * lat * t * t / 2
    out = {"tokens": t, **r, "tokens_per_s": t / (r["median_ms"] / 1e3),
           "compute_floor_ms": 1e3 * flops / (rate_tflops * 1e12)}
    out["ratio_to_floor"] = r["median_ms"] / out["compute_floor_ms"]
    return out


def check_paths(model, params, cfg) -> dict[str, float]:
    """Pallas vs reference on the same weights: one 64-token prefill chunk into a fresh paged cache."""
    ps = kv_cache.PAGE_SIZE
    b, t = 2, 64
    table = jnp.asarray(kv_cache.contiguous_table(b, t, ps))
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    meta = PageMeta(table, jnp.full((b,), t, jnp.int32))
    out = {}
    for backend in ("pallas", "reference"):
        cache = kv_cache.allocate(cfg, 1 + table.size, ps, "absorbed", jnp.bfloat16)
        m = model.clone(trace_options=TraceOptions(kernels=backend))
        f = jax.jit(lambda p, c, m=m: m.apply({"params": p}, toks, pos, c, meta)[0])
        out[backend] = np.asarray(f(params, cache), np.float32)
    a, r = out["pallas"], out["reference"]
    return {"prefill_rel_err": float(np.linalg.norm(a - r) / np.linalg.norm(r)),
            "top1_agree": float((a.argmax(-1) == r.argmax(-1)).mean())}


def mtp_bench(compact: Path, corpus: Path, reps_tokens: int) -> list[dict]:
    from dsv3_jax import train
    from dsv3_jax.api import ModelHandle
    from dsv3_jax.engine.core import Engine, EngineConfig

    cfg = train.preset("small-mtp").replace(dtype="bfloat16")
    params = jax.tree_util.tree_map(jnp.asarray, train.import_compact(compact))
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 and
                                    x.ndim > 1 else x, params)
    params = train.tie_mtp(params)  # training shares the MTP embedding/head with the main model
    handle = ModelHandle(cfg, params)
    held = np.load(corpus)["heldout"].astype(np.int64)
    rows = []
    for batch in (1, 32):
        prompts = [held[i * 997:i * 997 + 64].tolist() for i in range(batch)]
        res = {}
        for k in (0, 1):
            ecfg = EngineConfig(num_pages=1 + batch * 4, max_batch=batch, max_batched_tokens=batch * 64 + 64,
                                chunk_size=64, spec_k=k, prefix_caching=False)
            Engine(handle, ecfg).generate(prompts, max_new_tokens=8)  # compile
            eng = Engine(handle, ecfg)
            t0 = time.perf_counter()
            done = eng.generate(prompts, max_new_tokens=reps_tokens)
            dt = time.perf_counter() - t0
            toks = sum(len(r.output) for r in done)
            res[k] = {"tok_s": toks / dt, "steps": eng.stats["steps"],
                      "acceptance": eng.engine_stats()["mtp_acceptance"]}
        rows.append({"batch": batch, "plain_tok_s": res[0]["tok_s"], "mtp_tok_s": res[1]["tok_s"],
                     "speedup": res[1]["tok_s"] / res[0]["tok_s"], "acceptance": res[1]["acceptance"],
                     "tokens_per_step": reps_tokens * batch / max(res[1]["steps"], 1) / batch})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny config")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip remaining cases after this")
    ap.add_argument("--mtp-compact", type=Path)
    ap.add_argument("--mtp-corpus", type=Path)
    ap.add_argument("--out", type=Path, default=Path("e2e_bench.json"))
    ap.add_argument("--weights", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--prefill-tokens", default="4096", help="comma-separated prefill chunk sizes (batch 1)")
    ap.add_argument("--decode-cases", default="", help="comma-separated BATCHxCTX; default: the FP8 sweep")
    ap.add_argument("--decode-first", action="store_true", help="decode cases before the prefills")
    args = ap.parse_args()
    t_start = time.perf_counter()
    res: dict = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
                 "command": " ".join(sys.argv)}

    def save():
        args.out.write_text(json.dumps(res, indent=1))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    if args.mtp_compact and args.mtp_corpus:  # small and quick: first, so it is never squeezed out
        try:
            res["mtp"] = mtp_bench(args.mtp_compact, args.mtp_corpus, 64)
        except Exception as e:  # noqa: BLE001 - report and keep measuring the rest
            res["mtp_error"] = repr(e)
        save()
    cfg = slice_config(args.moe_layers, args.tiny)
    fp8 = args.weights == "fp8"
    model, params = random_params(cfg, fp8=fp8)
    res["config"] = {"layers": cfg.num_hidden_layers, "moe_layers": cfg.n_moe_layers, "weights": args.weights,
                     "weight_gb": sum(x.nbytes for x in jax.tree_util.tree_leaves(params)) / 1e9}
    res["copy_bw_gbs"] = copy_bandwidth() / 1e9
    if fp8:
        res["fp8_tflops"] = fp8_rate() / 1e12
    else:
        res["bf16_tflops"] = bf16_rate() / 1e12
    rate = res["fp8_tflops" if fp8 else "bf16_tflops"]
    save()
    try:
        res["check"] = check_paths(model, params, cfg) if not args.tiny else {}
    except Exception as e:  # noqa: BLE001
        res["check_error"] = repr(e)
    save()

    def run_prefills():
        """One chunk of t tokens (batch 1) through the paged cache, for each t asked for."""
        for t in [int(v) for v in args.prefill_tokens.split(",")]:
            if left() < 100:
                res.setdefault("skipped", []).append(f"prefill {t}")
                continue
            t = min(t, 512) if args.tiny else t
            try:
                p = prefill_case(model, params, cfg, t, max(3, args.reps // 3), rate)
                res.setdefault("prefills", []).append(p)
                res["prefill"] = p  # the last one, under the FP8 runs' key
            except Exception as e:  # noqa: BLE001
                res.setdefault("prefill_errors", []).append(f"{t}: {repr(e)[:400]}")
                res["prefill_error"] = repr(e)[:400]
            save()

    def run_decodes():
        cases = [(1, 1024), (64, 8192), (1, 32768), (256, 1024), (8, 8192), (64, 32768), (64, 1024),
                 (1, 8192), (8, 1024), (256, 8192), (8, 32768)]
        if args.decode_cases:
            cases = [tuple(int(v) for v in c.split("x")) for c in args.decode_cases.split(",")]
        if args.tiny:
            cases = [(1, 128), (4, 256)]
        res["decode"] = []
        for b, ctx in cases:
            if left() < 45:
                res.setdefault("skipped", []).append(f"decode b={b} ctx={ctx}")
                continue
            row = {"batch": b, "ctx": ctx}
            try:
                row["pallas"] = decode_case(model, params, cfg, b, ctx, args.reps, "pallas" if not args.tiny
                                            else "reference")
                floor_ms = 1e3 * step_bytes(cfg, params, b, ctx) / (res["copy_bw_gbs"] * 1e9)
                row["floor_ms"] = floor_ms
                row["ratio_to_floor"] = row["pallas"]["median_ms"] / floor_ms
                if (b, ctx) == (1, 1024) and fp8 and left() > 90:  # bf16's reference is no peer
                    row["xla"] = decode_case(model, params, cfg, b, ctx, 3, "reference")
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
            res["decode"].append(row)
            save()

    for part in ((run_decodes, run_prefills) if args.decode_first else (run_prefills, run_decodes)):
        part()
    print(f"\ndevice {res['device']}  copy {res['copy_bw_gbs']:.0f} GB/s  {args.weights} {rate:.0f} TFLOP/s  "
          f"weights {res['config']['weight_gb']:.1f} GB  check {res.get('check') or res.get('check_error')}")
    print(f"{'batch':>6} {'ctx':>6} {'step ms':>9} {'min':>7} {'max':>7} {'floor ms':>9} {'ratio':>6} {'xla ms':>8}")
    for row in res.get("decode", []):
        if "error" in row:
            print(f"{row['batch']:>6} {row['ctx']:>6}  error {row['error'][:80]}")
            continue
        p = row["pallas"]
        x = row.get("xla", {}).get("median_ms", float("nan"))
        print(f"{row['batch']:>6} {row['ctx']:>6} {p['median_ms']:>9.2f} {p['min_ms']:>7.2f} {p['max_ms']:>7.2f} "
              f"{row['floor_ms']:>9.2f} {row['ratio_to_floor']:>6.2f} {x:>8.2f}")
    for p in res.get("prefills", []):
        print(f"prefill {p['tokens']} tok: {p['median_ms']:.1f} ms (min {p['min_ms']:.1f} max {p['max_ms']:.1f}), "
              f"{p['tokens_per_s']:.0f} tok/s, compute floor {p['compute_floor_ms']:.1f} ms "
              f"(x{p['ratio_to_floor']:.2f})")
    for e in res.get("prefill_errors", []):
        print("prefill error:", e[:300])
    for row in res.get("mtp", []):
        print(f"MTP batch {row['batch']}: acceptance {row['acceptance']:.2f}, {row['mtp_tok_s']:.0f} vs "
              f"{row['plain_tok_s']:.0f} tok/s plain (x{row['speedup']:.2f}), tokens/step {row['tokens_per_step']:.2f}")
    if "mtp_error" in res:
        print("MTP error:", res["mtp_error"][:300])


if __name__ == "__main__":
    main()
