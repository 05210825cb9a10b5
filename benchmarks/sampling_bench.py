"""The sampling filter's cost on the GPU: the product's sort-free filter against the full sort it replaced.

Owns `filter_by_sort`, the top-k / top-p filter by a stable sort of the vocabulary (the product's until
2026-12-07): the definition the product's `engine/sampling._filtered_logits` (bisection on order keys, no
sort and no data-dependent control flow; its docstring says how) is checked against (`check`, and
tests/test_sampling_bench.py), and its timing peer. On the H100 (2026-12-07, RESULTS.md) sampling added
3.2 ms to a 32-row step of the 5-layer slice and 10.7 ms at MTP k = 3 while every filter sorted 129,280
logits per row. This file times both by GPU time (`device_time.jax_device_time`) at the engine's row
counts, after checking that they keep the same tokens.

    python benchmarks/sampling_bench.py --out $OUT/sampling.json        # on the GPU, ~1 min
    python benchmarks/sampling_bench.py --vocab 4096 --rows 1,8           # CPU smoke (wall clock)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv3_jax.engine import sampling  # noqa: E402
from dsv3_jax.engine.sampling import SamplingParams  # noqa: E402


def filter_by_sort(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The filter by a full sort of the vocabulary (the product's `_filtered_logits` until 2026-12-07): the
    peer the product's filter is timed against and the definition of the sets it must keep."""
    batch, vocab = logits.shape
    temperature = params.temperature.astype(jnp.float32)[:, None]
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    order = jnp.argsort(-scaled, axis=-1)  # stable: ties keep the lower id first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (params.top_k[:, None] <= 0) | (rank < params.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the strictly more likely tokens
    top_p = params.top_p.astype(jnp.float32)[:, None]
    keep = keep & ((mass_before < top_p) | (top_p >= 1.0) | (rank == 0))
    keep_vocab = jnp.zeros((batch, vocab), dtype=bool).at[jnp.arange(batch)[:, None], order].set(keep)
    return jnp.where(keep_vocab, scaled, -jnp.inf)


def cases(rows: int, vocab: int, seed: int) -> list[tuple[str, jax.Array, SamplingParams]]:
    """The filter settings timed: none (top_p 1), DeepSeek's default (T 0.6, top_p 0.95), top_k 50, both;
    logits as bf16 values (many exact ties), like the model's."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 4.0, jnp.bfloat16).astype(jnp.float32)
    settings = {"no cut": dict(top_p=1.0, top_k=0), "top_p 0.95": dict(top_p=0.95, top_k=0),
                "top_k 50": dict(top_p=1.0, top_k=50), "top_k 50 + top_p 0.8": dict(top_p=0.8, top_k=50)}
    return [(name, logits, SamplingParams.make(rows, temperature=0.6, **kw)) for name, kw in settings.items()]


def check(logits: jax.Array, params: SamplingParams) -> dict:
    """Rows whose kept sets differ between the sort and the product's filter, and tokens kept by one only."""
    a = np.isfinite(np.asarray(jax.jit(filter_by_sort)(logits, params)))
    b = np.isfinite(np.asarray(jax.jit(sampling._filtered_logits)(logits, params)))
    return {"rows_differing": int((a != b).any(axis=-1).sum()), "tokens_differing": int((a != b).sum()),
            "kept_mean": float(a.sum(axis=-1).mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32,128", help="rows per call (the engine's decode capacities x (k+1))")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--out", type=Path, default=Path("sampling_bench.json"))
    a = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        for name, logits, params in cases(rows, a.vocab, rows):
            row = {"rows": rows, "vocab": a.vocab, "filter": name, **check(logits, params)}
            for who, fn in (("sort", filter_by_sort), ("bisection (product)", sampling._filtered_logits)):
                f = jax.jit(fn)
                f(logits, params).block_until_ready()
                if gpu:
                    from device_time import jax_device_time

                    t = jax_device_time(f, (logits, params))
                else:
                    ts = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        f(logits, params).block_until_ready()
                        ts.append(1e3 * (time.perf_counter() - t0))
                    t = {"median_ms": float(np.median(ts)), "min_ms": min(ts), "max_ms": max(ts)}
                row[who] = {k: round(t[k], 4) for k in ("median_ms", "min_ms", "max_ms")}
            row["bisection / sort"] = round(row["bisection (product)"]["median_ms"] / row["sort"]["median_ms"],
                                            3)
            results.append(row)
            print(f"rows {rows:4d} {name:<22} sort {row['sort']['median_ms']:8.3f} ms  bisection "
                  f"{row['bisection (product)']['median_ms']:8.3f} ms  ratio {row['bisection / sort']:.2f}  rows differing "
                  f"{row['rows_differing']}  kept {row['kept_mean']:.0f}", flush=True)
    meta = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
            "timing": "GPU time (profiler)" if gpu else "wall clock (CPU: not a figure)"}
    a.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
