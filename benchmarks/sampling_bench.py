"""The sampling filter's cost on the GPU: the product's sort against a sort-free candidate (a lab, not the product).

Owns `filter_by_bisection`, a candidate for `engine/sampling._filtered_logits`: the same top-k / top-p sets
(vLLM's and transformers' semantics, ties to the lower token id) found without sorting the vocabulary and
without data-dependent control flow. On the H100 (2026-12-07, RESULTS.md) sampling added 3.2 ms to a
32-row step of the 5-layer slice and 10.7 ms at MTP k = 3, and every filter sorts 129,280 logits per row;
a runtime branch around the sort was taken back because XLA's GPU conditional blocks the host. This file
times both filters by GPU time (`device_time.jax_device_time`) at the engine's row counts, after checking
that they keep the same tokens. The product adopts the candidate only if it wins here.

How the candidate works, per row, on order-preserving uint32 keys of the scaled logits (`_order_keys`):
- top-k: the k-th largest key by a fixed 32-step bisection over the key space (count of keys above the
  midpoint), then every key above it and the first of the tied keys at it by token id (one prefix sum);
- top-p: the same bisection on the probability mass above the midpoint (probabilities renormalized over the
  top-k set) finds the lowest key whose strictly-higher mass is below top_p; every token at or above the
  lowest such key present is kept, and that last group's tied tokens by id while their mass before stays below
  top_p. Rank 0 is always kept (its mass before is 0); top_p >= 1 keeps the whole top-k set.
Sums run in another order than the sorted prefix sum, so a token whose mass before is within float rounding
of top_p may fall on the other side; `check` counts such rows.

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

from dsv3_jax.engine.sampling import SamplingParams  # noqa: E402

KEY_BITS = 32  # bisection steps: one per bit of the uint32 key space


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys ordered as the float32 values (-inf lowest; NaN-free input; -0.0 and 0.0 one key, as the
    sort's comparison has them equal)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32) + 0.0, jnp.uint32)  # -0.0 + 0.0 is +0.0
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _lowest_key_where(pred_above, batch: int) -> jax.Array:
    """Per row, the smallest uint32 T with pred_above(T) true ([B] uint32), for a predicate that is monotone
    in T and true at the top of the key space: a fixed number of halvings, no data-dependent loop."""
    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred_above(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo = jnp.zeros((batch,), jnp.uint32)
    hi = jnp.full((batch,), 0xFFFFFFFF, jnp.uint32)
    # Unrolled: a loop on the GPU could cost a host round trip per step where XLA does not know its trip count.
    return jax.lax.fori_loop(0, KEY_BITS, step, (lo, hi), unroll=True)[1]


def _first_ties(tied: jax.Array, allowed: jax.Array) -> jax.Array:
    """Of the `tied` tokens [B, V], those whose place among them in token-id order is below `allowed` [B]."""
    place = jnp.cumsum(tied.astype(jnp.int32), axis=-1) - tied.astype(jnp.int32)
    return tied & (place < allowed[:, None])


def filter_by_bisection(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """`sampling._filtered_logits` without a sort: temperature-scaled logits [B, V], -inf outside each row's
    top-k / top-p set (the module docstring says how)."""
    batch, vocab = logits.shape
    temperature = params.temperature.astype(jnp.float32)[:, None]
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    keys = _order_keys(scaled)

    # top-k: v_k, the k-th largest key, is the lowest T with fewer than k keys above it.
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab).astype(jnp.int32)
    v_k = _lowest_key_where(lambda t: jnp.sum(keys > t[:, None], axis=-1) < k, batch)
    above_k = keys > v_k[:, None]
    in_k = above_k | _first_ties(keys == v_k[:, None], k - jnp.sum(above_k, axis=-1))

    # top-p over the top-k set: probabilities renormalized there (as the sorted softmax does).
    z = jnp.where(in_k, scaled, -jnp.inf)
    probs = jax.nn.softmax(z, axis=-1)
    top_p = params.top_p.astype(jnp.float32)
    t_p = _lowest_key_where(lambda t: jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1) < top_p, batch)
    # The last group kept: the lowest key at or above t_p among the top-k set, its tokens by id.
    last = jnp.min(jnp.where(in_k & (keys >= t_p[:, None]), keys, jnp.uint32(0xFFFFFFFF)), axis=-1)
    above_last = in_k & (keys > last[:, None])
    mass_above = jnp.sum(jnp.where(above_last, probs, 0.0), axis=-1)
    tied = in_k & (keys == last[:, None])
    p_last = jnp.max(jnp.where(tied, probs, 0.0), axis=-1)
    place = jnp.cumsum(tied.astype(jnp.int32), axis=-1) - tied.astype(jnp.int32)
    tied_kept = tied & ((mass_above[:, None] + place * p_last[:, None] < top_p[:, None]) | (place == 0))
    in_p = above_last | tied_kept
    keep = jnp.where((top_p >= 1.0)[:, None], in_k, in_k & in_p)
    return jnp.where(keep, scaled, -jnp.inf)


def filter_by_sort(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The filter by a full sort of the vocabulary (the product's `_filtered_logits` until 2026-12-07): the
    peer the candidate is timed against and the definition of the sets it must keep."""
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
    """Rows whose kept sets differ between the sort and the candidate, and tokens kept by one only."""
    a = np.isfinite(np.asarray(jax.jit(filter_by_sort)(logits, params)))
    b = np.isfinite(np.asarray(jax.jit(filter_by_bisection)(logits, params)))
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
            for who, fn in (("sort", filter_by_sort), ("bisection", filter_by_bisection)):
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
            row["bisection / sort"] = round(row["bisection"]["median_ms"] / row["sort"]["median_ms"], 3)
            results.append(row)
            print(f"rows {rows:4d} {name:<22} sort {row['sort']['median_ms']:8.3f} ms  bisection "
                  f"{row['bisection']['median_ms']:8.3f} ms  ratio {row['bisection / sort']:.2f}  rows differing "
                  f"{row['rows_differing']}  kept {row['kept_mean']:.0f}", flush=True)
    meta = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
            "timing": "GPU time (profiler)" if gpu else "wall clock (CPU: not a figure)"}
    a.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
