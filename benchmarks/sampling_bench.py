"""The sampling filter's cost on the GPU: the product's sort against a sort-free candidate (a lab, not the product).

Owns `filter_by_radix`, a candidate for `engine/sampling._filtered_logits`: the same top-k / top-p sets
(vLLM's and transformers' semantics, ties to the lower token id) found without sorting the vocabulary and
without data-dependent control flow (its docstring says how). On the H100 (2026-12-07, RESULTS.md) sampling
added 3.2 ms to a 32-row step of the 5-layer slice and 10.7 ms at MTP k = 3, every filter sorting 129,280
logits per row; a runtime branch around the sort was taken back (XLA's GPU conditional blocks the host),
and a first sort-free candidate (32-step bisections) won only at 32 rows (RESULTS.md). This file times the
product's sort and the candidate by GPU time (`device_time.jax_device_time`) at the engine's row counts,
after checking that they keep the same tokens. The product adopts the candidate only if it wins here.

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

# Radix selection over the uint32 order keys: each pass decides 4 bits (a 16-bin histogram), 8 passes.
_DIGIT_BITS = 4
_BINS = 1 << _DIGIT_BITS
_SHIFTS = tuple(range(32 - _DIGIT_BITS, -1, -_DIGIT_BITS))  # 28, 24, ..., 0: the top digit first


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys ordered as the float32 values (-inf lowest; NaN-free input; -0.0 and 0.0 one key)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32) + 0.0, jnp.uint32)  # -0.0 + 0.0 is +0.0
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _digit_histogram(keys: jax.Array, prefix: jax.Array, shift: int, weights: jax.Array) -> jax.Array:
    """Per row, `weights` [B, V] summed over the keys whose bits above `shift + 4` equal `prefix`'s, binned
    by their 4-bit digit at `shift`: [B, 16]. One pass over the row (a reduction over V of 16 bins)."""
    digit = (keys >> shift) & (_BINS - 1)
    w = weights
    if shift + _DIGIT_BITS < 32:
        high = shift + _DIGIT_BITS
        w = jnp.where((keys >> high) == (prefix[:, None] >> high), w, jnp.zeros_like(w))
    bins = digit[..., None] == jnp.arange(_BINS, dtype=jnp.uint32)
    return jnp.sum(jnp.where(bins, w[..., None], jnp.zeros_like(w[..., None])), axis=1)


def _above(hist: jax.Array) -> jax.Array:
    """[B, 16] -> for each bin, the sum over the higher bins."""
    return jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1] - hist


def _kth_largest_key(keys: jax.Array, k: jax.Array) -> jax.Array:
    """Per row the k-th largest key (1 <= k <= V), digit by digit from the top: in each pass the digit
    whose bin holds the k-th key of the current prefix's group; no loop, branch or sort."""
    prefix = jnp.zeros(keys.shape[:1], jnp.uint32)
    need = k
    for shift in _SHIFTS:
        hist = _digit_histogram(keys, prefix, shift, jnp.ones(keys.shape, jnp.int32))
        above = _above(hist)
        digit = jnp.argmax((above < need[:, None]) & (need[:, None] <= above + hist), axis=1)
        need = need - jnp.take_along_axis(above, digit[:, None], axis=1)[:, 0]
        prefix = prefix | (digit.astype(jnp.uint32) << shift)
    return prefix


def _lowest_key_with_mass_above_below(keys: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per row the smallest key L with the probability mass of the keys above L below top_p (> 0). Such
    keys are an upper range, so in each pass the lowest digit whose highest key qualifies (the mass above
    the group and above the digit's bin below top_p) holds L. L is a token's key unless the whole mass is
    below top_p (then L lies under every token with mass, and the caller keeps them all, as it should): a
    digit bin with no token between two tokens has the lower token's mass above it, which is >= top_p."""
    prefix = jnp.zeros(keys.shape[:1], jnp.uint32)
    mass_before = jnp.zeros(keys.shape[:1], jnp.float32)
    for shift in _SHIFTS:
        above = _above(_digit_histogram(keys, prefix, shift, probs))
        digit = jnp.argmax(mass_before[:, None] + above < top_p[:, None], axis=1)
        mass_before = mass_before + jnp.take_along_axis(above, digit[:, None], axis=1)[:, 0]
        prefix = prefix | (digit.astype(jnp.uint32) << shift)
    return prefix


def _first_ties(tied: jax.Array, allowed: jax.Array) -> jax.Array:
    """Of the `tied` tokens [B, V], those whose place among them in token-id order is below `allowed` [B]."""
    place = jnp.cumsum(tied.astype(jnp.int32), axis=-1) - tied.astype(jnp.int32)
    return tied & (place < allowed[:, None])


def filter_by_radix(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """`sampling._filtered_logits` without a sort: temperature-scaled logits, -inf outside each row's set.

    The sets are those of a stable descending sort (ties to the lower token id; rank 0 always kept; top_p
    over the top-k set renormalized), found without sorting the vocabulary, on order keys of the scaled
    logits (`_order_keys`) by radix selection (8 passes of 16-bin histograms each, no data-dependent
    control flow: on the GPU a data-dependent loop or branch stops the host until the device catches up,
    which would serialize the engine's dispatch-ahead): the k-th largest key, every key above it kept with
    the first of its tied tokens by id; then the lowest key whose strictly-higher mass is below top_p, the
    last group kept, its tokens by id while their mass before stays below top_p.
    Sums run in another order than a sorted prefix sum, so a token whose mass before is within float
    rounding of top_p may fall on the other side; `check` counts such rows."""
    batch, vocab = logits.shape
    temperature = params.temperature.astype(jnp.float32)[:, None]
    # Greedy rows are handled by the caller; any positive divisor keeps their arithmetic finite.
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    keys = _order_keys(scaled)

    # top-k: every key above the k-th largest, and the first of its ties by token id.
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab).astype(jnp.int32)
    v_k = _kth_largest_key(keys, k)
    above_k = keys > v_k[:, None]
    in_k = above_k | _first_ties(keys == v_k[:, None], k - jnp.sum(above_k, axis=-1))

    # top-p over the top-k set: probabilities renormalized there; `last` is the lowest key kept.
    probs = jax.nn.softmax(jnp.where(in_k, scaled, -jnp.inf), axis=-1)
    top_p = params.top_p.astype(jnp.float32)
    last = _lowest_key_with_mass_above_below(keys, probs, top_p)
    above_last = in_k & (keys > last[:, None])
    mass_above = jnp.sum(jnp.where(above_last, probs, 0.0), axis=-1)
    tied = in_k & (keys == last[:, None])
    p_last = jnp.max(jnp.where(tied, probs, 0.0), axis=-1)
    place = jnp.cumsum(tied.astype(jnp.int32), axis=-1) - tied.astype(jnp.int32)
    tied_kept = tied & ((mass_above[:, None] + place * p_last[:, None] < top_p[:, None]) | (place == 0))
    # top_p >= 1 keeps the whole top-k set even where float sums reach 1 early.
    keep = jnp.where((top_p >= 1.0)[:, None], in_k, in_k & (above_last | tied_kept))
    return jnp.where(keep, scaled, -jnp.inf)


def cases(rows: int, vocab: int, seed: int) -> list[tuple[str, jax.Array, SamplingParams]]:
    """The filter settings timed: none (top_p 1), DeepSeek's default (T 0.6, top_p 0.95), top_k 50, both;
    logits as bf16 values (many exact ties), like the model's."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 4.0, jnp.bfloat16).astype(jnp.float32)
    settings = {"no cut": dict(top_p=1.0, top_k=0), "top_p 0.95": dict(top_p=0.95, top_k=0),
                "top_k 50": dict(top_p=1.0, top_k=50), "top_k 50 + top_p 0.8": dict(top_p=0.8, top_k=50)}
    return [(name, logits, SamplingParams.make(rows, temperature=0.6, **kw)) for name, kw in settings.items()]


def check(logits: jax.Array, params: SamplingParams) -> dict:
    """Rows whose kept sets differ between the product's sort and the candidate, and tokens kept by one only."""
    a = np.isfinite(np.asarray(jax.jit(sampling._filtered_logits)(logits, params)))
    b = np.isfinite(np.asarray(jax.jit(filter_by_radix)(logits, params)))
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
            for who, fn in (("sort (product)", sampling._filtered_logits), ("radix", filter_by_radix)):
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
            row["radix / sort"] = round(row["radix"]["median_ms"] / row["sort (product)"]["median_ms"],
                                            3)
            results.append(row)
            print(f"rows {rows:4d} {name:<22} sort {row['sort (product)']['median_ms']:8.3f} ms   radix "
                  f"{row['radix']['median_ms']:8.3f} ms  ratio {row['radix / sort']:.2f}  rows differing "
                  f"{row['rows_differing']}  kept {row['kept_mean']:.0f}", flush=True)
    meta = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
            "timing": "GPU time (profiler)" if gpu else "wall clock (CPU: not a figure)"}
    a.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
