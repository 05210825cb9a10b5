"""Quality of the FP8 latent KV cache (issue 28) on the embedded default model's held-out split.

Held-out perplexity with the KV cache in the compute dtype, in bf16 and in FP8 (pallas_kernels/mla_common's
format: latent e4m3 with an fp32 scale per 128 values, rope bf16; and the same with the scales rounded up
to powers of two, UE8M0, the issue's alternative), each computed by prefilling every
window through a fresh paged absorbed cache of that dtype, so every key and value attention reads comes
from the cache (same windows for all rows); then greedy continuations of held-out prompts through the
engine, bf16 cache vs FP8 cache (tokens identical up to the first divergence, and in all).

    PYTHONPATH=. python benchmarks/kv_fp8_quality.py --windows 16 --out benchmarks/results/kv_fp8_quality_cpu.json
    PYTHONPATH=. python benchmarks/kv_fp8_quality.py --gpu ...   # bf16 compute, the handle's kernels
    ... --q-fp8 e4m3,split   # also the FP8 cache read with Q rounded as pallas_kernels.experimental.mla_fp8_qk
                             # rounds it (CPU: the reference on the rounded queries; GPU: that kernel)

The held-out split is train.py's file-level split of the installed standard library, tokenized as the
training corpus is (tests/test_default_model.py uses the same); windows are 512 tokens (the training
length) at evenly spaced offsets. Perplexity = exp(mean next-token cross-entropy over the full vocabulary).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv3_jax  # noqa: E402
from dsv3_jax import train as T  # noqa: E402
from dsv3_jax.engine.core import Engine, EngineConfig  # noqa: E402
from dsv3_jax.model import kv_cache, layout  # noqa: E402
from dsv3_jax.text.tokenizer import Tokenizer  # noqa: E402

WINDOW = 512
UE8M0_ROW = "fp8, UE8M0 scales (power-of-two; stored fp32 here)"


def heldout_stream() -> np.ndarray:
    tok = Tokenizer.default()
    files = [f for f in T.stdlib_files() if T.is_heldout(f, 40)]
    return np.concatenate(T.tokenize_files(tok, files)).astype(np.int32)


def windows(stream: np.ndarray, n: int, length: int = WINDOW) -> np.ndarray:
    starts = np.arange(n) * ((len(stream) - length) // n)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def ce_fn(handle, cache_dtype):
    """jitted (params, tokens [B, T]) -> next-token cross-entropy [B, T-1], prefilled through a paged cache
    of `cache_dtype` (as layout.cache_layout takes it: a dtype or "fp8")."""
    model, cfg = handle.model, handle.config

    def f(params, toks):
        b, t = toks.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        table = kv_cache.contiguous_table(b, t)
        cache = kv_cache.allocate(cfg, 1 + table.size, kv_cache.PAGE_SIZE, "absorbed", cache_dtype)
        meta = kv_cache.PageMeta(jnp.asarray(table), jnp.full((b,), t, jnp.int32))
        lg = model.apply({"params": params}, toks, pos, cache, meta)[0][:, :-1].astype(jnp.float32)
        tgt = jnp.take_along_axis(lg, toks[:, 1:, None], axis=-1)[..., 0]
        return jax.nn.logsumexp(lg, axis=-1) - tgt

    return jax.jit(f)


@contextlib.contextmanager
def pow2_kv_scales():
    """The cache write's quantization (`mla_common.quantize_kv`, looked up when the step is traced) with
    its scales rounded up to powers of two (UE8M0, as the weights' V3.1 scales are), for one measurement:
    the product keeps fp32 scales. Each `ce_fn` call traces anew, so the patch reaches the program."""
    from pallas_kernels import mla_common

    real = mla_common.quantize_kv
    mla_common.quantize_kv = functools.partial(real, pow2_scales=True)
    try:
        yield
    finally:
        mla_common.quantize_kv = real


@contextlib.contextmanager
def fp8_queries(variant: str, on_gpu: bool):
    """For one measurement, the FP8 cache read with Q in e4m3 (`variant` "e4m3") or as two e4m3 parts
    ("split"), as the experimental FP8-Q K^T kernel takes it: on the GPU that kernel replaces the product's
    FP8-page kernel; off it the reference attention gets the queries that kernel would see. Looked up when the
    step is traced, as `pow2_kv_scales`."""
    from dsv3_jax.model import kernel_dispatch
    from pallas_kernels import mla_decode_fp8
    from pallas_kernels.experimental import mla_fp8_qk
    from pallas_kernels.mla_common import is_fp8_cache

    split = {"e4m3": False, "split": True}[variant]
    real_attention, real_run = kernel_dispatch.mla_attention, mla_decode_fp8.run_fp8_items

    def rounded_queries(q_latent, q_rope, kv_pages, *args, **kw):
        if is_fp8_cache(kv_pages):
            ql, qr = mla_fp8_qk.dequantized_queries(q_latent, q_rope, split)
            q_latent, q_rope = ql.astype(q_latent.dtype), qr.astype(q_rope.dtype)
        return real_attention(q_latent, q_rope, kv_pages, *args, **kw)

    if on_gpu:
        mla_decode_fp8.run_fp8_items = functools.partial(mla_fp8_qk.run_fp8qk_items, q_split=split)
    else:
        kernel_dispatch.mla_attention = rounded_queries
    try:
        yield
    finally:
        kernel_dispatch.mla_attention, mla_decode_fp8.run_fp8_items = real_attention, real_run


def perplexity(handle, wins: np.ndarray, cache_dtype, batch: int) -> tuple[float, np.ndarray]:
    f = ce_fn(handle, cache_dtype)
    ce = np.concatenate([np.asarray(f(handle.params, jnp.asarray(wins[i:i + batch])))
                         for i in range(0, len(wins), batch)])
    return float(math.exp(float(ce.mean()))), ce


def greedy(handle, prompts: list[list[int]], new: int, kv: str) -> list[list[int]]:
    pages = sum(kv_cache.pages_for(len(p) + new + 1) for p in prompts)
    eng = Engine(handle, EngineConfig(num_pages=1 + pages, max_batch=len(prompts), kv_cache_dtype=kv,
                                      prefix_caching=False))
    rids = [eng.add_request(p, max_new_tokens=new) for p in prompts]
    while eng.has_work():
        eng.step()
    return [eng.finished[r].output for r in rids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts for the greedy comparison")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--gpu", action="store_true", help="bf16 compute, the handle's kernels (default: fp32 "
                                                        "compute, jnp reference: the CPU reference)")
    ap.add_argument("--q-fp8", default="", help="comma list of e4m3, split: extra FP8-cache rows with Q "
                                                 "rounded as the experimental FP8 Q K^T kernel rounds it")
    ap.add_argument("--skip-greedy", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("kv_fp8_quality.json"))
    a = ap.parse_args()

    dtype = "bfloat16" if a.gpu else "float32"
    h = dsv3_jax.load(dtype=dtype, kernels=None if a.gpu else "reference")
    stream = heldout_stream()
    wins = windows(stream, a.windows)
    rows = []
    caches = [(f"{dtype} (compute dtype)", jnp.dtype(dtype))] if dtype != "bfloat16" else []
    caches += [("bf16", jnp.dtype(jnp.bfloat16)), ("fp8 (e4m3 latent, fp32 scales / 128, bf16 rope)", layout.FP8),
               (UE8M0_ROW, layout.FP8)]
    q_rows = {f"fp8, Q {v} (experimental FP8 Q K^T)": v for v in filter(None, a.q_fp8.split(","))}
    caches += [(name, layout.FP8) for name in q_rows]
    ces = {}
    for name, cdt in caches:
        t0 = time.perf_counter()
        if name == UE8M0_ROW:
            ctx = pow2_kv_scales()
        elif name in q_rows:
            ctx = fp8_queries(q_rows[name], a.gpu)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            p, ce = perplexity(h, wins, cdt, a.batch)
        ces[name] = ce
        rows.append({"cache": name, "ppl": p, "tokens": int(ce.size), "seconds": time.perf_counter() - t0,
                     "bytes_per_token_per_layer": layout.bytes_per_token(h.config, "absorbed", cdt)
                     // h.config.num_hidden_layers})
        print(rows[-1], flush=True)
    base = next(r for r in rows if r["cache"] == "bf16")["ppl"]
    for r in rows:
        r["vs_bf16"] = r["ppl"] / base - 1
    # Greedy continuations of held-out prompts (the engine, bf16 vs fp8 cache).
    greedy_row = None
    if not a.skip_greedy:
        starts = np.arange(a.prompts) * ((len(stream) - a.prompt_len) // a.prompts) + 7
        prompts = [stream[s:s + a.prompt_len].tolist() for s in starts]
        g16 = greedy(h, prompts, a.new_tokens, "bf16")
        g8 = greedy(h, prompts, a.new_tokens, "fp8")
        same = sum(x == y for x, y in zip(g16, g8, strict=True))
        prefix = [next((i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
                  for x, y in zip(g16, g8, strict=True)]
        agree = float(np.mean([np.mean(np.asarray(x) == np.asarray(y)) for x, y in zip(g16, g8, strict=True)]))
        greedy_row = {"prompts": a.prompts, "new_tokens": a.new_tokens, "identical": same,
                      "first_divergence": prefix, "position_agreement": agree}
    out = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
           "host": platform.node(), "compute_dtype": dtype, "windows": int(len(wins)), "window": WINDOW,
           "rows": rows, "greedy": greedy_row, "command": " ".join(sys.argv)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(f"\n{len(wins)} held-out windows x {WINDOW} tokens, {dtype} compute, {jax.devices()[0].device_kind}")
    print(f"{'KV cache':<52} {'B/token/layer':>13} {'perplexity':>10} {'vs bf16':>8}")
    for r in rows:
        print(f"{r['cache']:<52} {r['bytes_per_token_per_layer']:>13} {r['ppl']:>10.4f} {100 * r['vs_bf16']:>+7.3f}%")
    if greedy_row:
        print(f"greedy, {a.prompts} held-out prompts x {a.new_tokens} tokens: {greedy_row['identical']} "
              f"identical, first divergence {greedy_row['first_divergence']}, position agreement "
              f"{greedy_row['position_agreement']:.3f}")


if __name__ == "__main__":
    main()
