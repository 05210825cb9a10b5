"""The MLA kernel's split-KV layout and merge on the GPU, old against new (issues 29 and 32).

Three measurements, GPU time by `device_time.jax_device_time` (sum of every kernel of a call: the Pallas
kernel, the work-list op, the merge), JSON to --out:
- stall: the attention call of the engine's stall step in isolation. B rows of T=1, H=128, a table
  `--width` pages wide: 32 decode rows at 4K and 22 rows of a chunk at a 128K prefix (positions 131,050
  .. 131,071, one sequence's pages), the rest padding (kv_len 0) up to each B of `--batches` (54 = the
  rows themselves; 128 and 512 = the engine's mixed programs that carry them). "old": every row in
  `choose_num_splits` equal shares (what ran before: one CTA walks a chunk row's 2,048 pages); "new":
  `split_plan` (long rows shared by more CTAs). Also the host-side estimate: the most pages one CTA walks.
- merge: `merge_splits` alone at B=1, H=128, for each of `--merge-splits`: the lab's earlier one-reduce
  form against the product's two-pass form.
- decode: B=1, H=128, T=1 at `--decode-len` tokens (default 131,072), the product's default plan, against
  its HBM floor (the latent pages once / the copy bandwidth measured here) and its compute floor at the
  kernel's own rate (the absorbed form: 2 row tiles each reading every page).
`--tiny`: the same code at toy sizes on CPU (Pallas interpreter, host clock), for the CPU test.

Usage (GPU, ~2-3 min): python3 benchmarks/split_bench.py --out $OUT/split_bench.json
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

from pallas_kernels.experimental.mla_variants import merge_splits_one_reduce  # noqa: E402
from pallas_kernels.mla_common import KV_DIM, PAGE_SIZE  # noqa: E402
from pallas_kernels.mla_decode import (  # noqa: E402
    BLOCK_ROWS,
    DEFAULT_NUM_SMS,
    LONG_ROW_PAGES,
    choose_num_splits,
    item_pages,
    long_row_windows,
    merge_splits,
    paged_mla_attention,
    row_pages,
    split_plan,
    work_items,
)

SCALE = 192**-0.5
FLOP_PER_PAGE_TILE = 2 * BLOCK_ROWS * PAGE_SIZE * (KV_DIM + 512)  # QK (576) + PV (512), one 64-row tile


def _timer(tiny: bool):
    if not tiny:
        from device_time import jax_device_time

        return jax_device_time

    def host(fn, args) -> dict:  # CPU: one call by the host clock (the code path, not a measurement)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        ms = (time.perf_counter() - t0) * 1e3
        return dict(median_ms=ms, min_ms=ms, max_ms=ms, out=out)

    return host


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def stall_inputs(batch: int, heads: int, width: int, decode_len: int, decoders: int, chunk: int, prefix: int,
                 seed: int = 0):
    """Queries, pages and lengths of the stall step (module docstring); rows past decoders + chunk are
    padding (kv_len 0). Pages: each decoder its own, the chunk rows one sequence's."""
    rng = np.random.default_rng(seed)
    dec_pages = -(-decode_len // PAGE_SIZE)
    long_pages = -(-prefix // PAGE_SIZE)
    assert long_pages <= width and decoders + chunk <= batch
    num_pages = decoders * dec_pages + long_pages + 1
    kv = jax.random.normal(jax.random.key(seed), (num_pages, PAGE_SIZE, KV_DIM), jnp.bfloat16)
    table = np.zeros((batch, width), np.int32)
    for r in range(decoders):
        table[r, :dec_pages] = 1 + r * dec_pages + np.arange(dec_pages)
    table[decoders:decoders + chunk, :long_pages] = 1 + decoders * dec_pages + np.arange(long_pages)
    kv_len = np.zeros(batch, np.int32)
    kv_len[:decoders] = decode_len
    kv_len[decoders:decoders + chunk] = prefix - chunk + 1 + np.arange(chunk)
    q_start = np.maximum(kv_len - 1, 0)
    ql = jnp.asarray(rng.standard_normal((batch, 1, heads, 512)), jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((batch, 1, heads, 64)), jnp.bfloat16)
    valid = jnp.asarray(kv_len > 0, jnp.int32)
    return ql, qr, kv, jnp.asarray(table), jnp.asarray(q_start), jnp.asarray(kv_len), valid


def most_pages_per_cta(q_start, kv_len, heads: int, width: int, plan, new: bool) -> int:
    """Host estimate: the most pages one CTA walks under the old (equal shares) or new plan (T=1)."""
    b = q_start.shape[0]
    tiles = -(-heads // BLOCK_ROWS)
    pages = row_pages(q_start, kv_len, 1, width)
    if new:
        items = work_items(b, plan, width, long_row_windows(pages, plan, width) if plan.long_rows else None)
    else:
        items = work_items(b, plan._replace(long_rows=0, long_splits=0), width)
    tile_pages = np.repeat(np.asarray(pages)[:, None], tiles, axis=1)
    return int(item_pages(items, tile_pages)[..., 1].max())


def bench_stall(a, timer, res: dict) -> None:
    out = []
    for b in a.batches:
        ql, qr, kv, table, q_start, kv_len, valid = stall_inputs(b, a.heads, a.width, a.decode_ctx, a.decoders,
                                                                 a.chunk, a.prefix)
        tiles = -(-a.heads // BLOCK_ROWS)
        plan = split_plan(b, tiles, a.width, a.num_sms, a.long_pages)
        old_splits = choose_num_splits(b, tiles, a.width, a.num_sms)
        assert old_splits == plan.num_splits
        interp = True if a.tiny else None
        fns = {
            "old": jax.jit(functools.partial(paged_mla_attention, softmax_scale=SCALE, num_splits=old_splits,
                                             interpret=interp)),
            "new": jax.jit(functools.partial(paged_mla_attention, softmax_scale=SCALE, interpret=interp,
                                             plan=plan)),
        }
        args = (ql, qr, kv, table, q_start, kv_len)
        row = dict(batch=b, heads=a.heads, width=a.width, old_splits=old_splits, plan=plan._asdict())
        outs = {}
        for name, fn in fns.items():
            f = jax.jit(lambda *x, fn=fn, valid=valid: fn(*x, valid_queries=valid))
            t = timer(f, args)
            outs[name] = (t["out"] if "out" in t else f(*args))[0]
            row[name] = dict(median_ms=round(t["median_ms"], 4), min_ms=round(t["min_ms"], 4),
                             max_ms=round(t["max_ms"], 4), kernels=t.get("kernels"),
                             most_pages_per_cta=most_pages_per_cta(q_start, kv_len, a.heads, a.width, plan,
                                                                   name == "new"))
        row["new_vs_old_rel_err"] = round(_rel_err(outs["new"], outs["old"]), 6)
        row["speedup"] = round(row["old"]["median_ms"] / row["new"]["median_ms"], 3)
        chunk_flop = tiles * FLOP_PER_PAGE_TILE * float(np.sum(np.asarray(row_pages(q_start, kv_len, 1, a.width))))
        row["attention_tflop"] = round(chunk_flop / 1e12, 4)
        row["new_tflops"] = round(chunk_flop / row["new"]["median_ms"] / 1e9, 1)
        out.append(row)
        print(f"{'stall' if a.chunk else 'steady'} B={b}: old {row['old']['median_ms']:.3f} ms (CTA <= {row['old']['most_pages_per_cta']} "
              f"pages), new {row['new']['median_ms']:.3f} ms (CTA <= {row['new']['most_pages_per_cta']} pages), "
              f"{row['speedup']}x, err {row['new_vs_old_rel_err']}", flush=True)
    res["stall"] = out


def bench_steady(a, timer, res: dict) -> None:
    """Steady decode on a wide-table engine: `--steady-batch` rows at 4K, no long row; old vs new must be
    equal in time (the new layout's cost when unused: long-slot CTAs that exit at once, the long merge)."""
    saved = a.batches, a.chunk
    a.batches, a.chunk = [a.steady_batch], 0
    sub: dict = {}
    try:
        bench_stall(a, timer, sub)
    finally:
        a.batches, a.chunk = saved
    res["steady"] = sub["stall"]


def bench_merge(a, timer, res: dict) -> None:
    out = []
    tiles = -(-a.heads // BLOCK_ROWS)
    for ns in a.merge_splits:
        k1, k2 = jax.random.split(jax.random.key(ns))
        out_p = jax.random.normal(k1, (1, ns, tiles * BLOCK_ROWS, 512), jnp.bfloat16)
        lse_p = 3 * jax.random.normal(k2, (1, ns, tiles * BLOCK_ROWS), jnp.float32)
        row = dict(batch=1, heads=a.heads, splits=ns)
        outs = {}
        for name, fn in (("old_one_reduce", merge_splits_one_reduce), ("new_two_pass", merge_splits)):
            f = jax.jit(lambda o, x, fn=fn: fn(o, x, 1, a.heads))
            t = timer(f, (out_p, lse_p))
            outs[name] = t["out"] if "out" in t else f(out_p, lse_p)
            row[name] = dict(median_ms=round(t["median_ms"], 4), min_ms=round(t["min_ms"], 4),
                             max_ms=round(t["max_ms"], 4), kernels=t.get("kernels"))
        row["out_rel_err"] = round(_rel_err(outs["new_two_pass"][0], outs["old_one_reduce"][0]), 7)
        row["lse_max_abs_err"] = float(np.max(np.abs(np.asarray(outs["new_two_pass"][1])
                                                     - np.asarray(outs["old_one_reduce"][1]))))
        out.append(row)
        print(f"merge splits={ns}: one-reduce {row['old_one_reduce']['median_ms'] * 1e3:.1f} us, two-pass "
              f"{row['new_two_pass']['median_ms'] * 1e3:.1f} us, err {row['out_rel_err']}", flush=True)
    res["merge"] = out


def bench_decode(a, timer, res: dict) -> None:
    n = a.decode_len
    pages = -(-n // PAGE_SIZE)
    width = max(a.width, pages)
    kv = jax.random.normal(jax.random.key(1), (pages + 1, PAGE_SIZE, KV_DIM), jnp.bfloat16)
    table = jnp.asarray(np.arange(1, pages + 1, dtype=np.int32)[None, :].repeat(1, 0))
    table = jnp.pad(table, ((0, 0), (0, width - pages)))
    rng = np.random.default_rng(2)
    ql = jnp.asarray(rng.standard_normal((1, 1, a.heads, 512)), jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((1, 1, a.heads, 64)), jnp.bfloat16)
    kv_len = jnp.asarray([n], jnp.int32)
    f = jax.jit(functools.partial(paged_mla_attention, softmax_scale=SCALE, interpret=True if a.tiny else None))
    args = (ql, qr, kv, table, kv_len - 1, kv_len)
    t = timer(f, args)
    tiles = -(-a.heads // BLOCK_ROWS)
    bw = 3.0e12 if a.tiny else _copy_bandwidth()
    cache_bytes = n * KV_DIM * 2
    floor_ms = cache_bytes / bw * 1e3
    flop = tiles * pages * FLOP_PER_PAGE_TILE
    row = dict(tokens=n, heads=a.heads, width=width, plan=split_plan(1, tiles, width)._asdict(),
               median_ms=round(t["median_ms"], 4), min_ms=round(t["min_ms"], 4), max_ms=round(t["max_ms"], 4),
               kernels=t.get("kernels"), copy_bw=bw, hbm_floor_ms=round(floor_ms, 4),
               time_over_hbm_floor=round(t["median_ms"] / floor_ms, 3), tflop=round(flop / 1e12, 4),
               tflops=round(flop / t["median_ms"] / 1e9, 1))
    res["decode"] = row
    print(f"decode B=1 {n:,} tokens: {row['median_ms']:.4f} ms, HBM floor {floor_ms:.4f} ms "
          f"({row['time_over_hbm_floor']}x), {row['tflops']} TFLOP/s of absorbed work", flush=True)


def _copy_bandwidth() -> float:
    from e2e_bench import copy_bandwidth

    return copy_bandwidth()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU (interpreter, host clock)")
    ap.add_argument("--tasks", default="stall,steady,merge,decode")
    ap.add_argument("--steady-batch", type=int, default=40, help="steady: decode rows (the stall bench's 40)")
    ap.add_argument("--batches", default="54,128,512", help="stall: row counts (rows past 54 are padding)")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--width", type=int, default=2048, help="page-table columns (2,048 = 128K)")
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=22, help="stall: chunk tokens at the long prefix")
    ap.add_argument("--prefix", type=int, default=131072, help="stall: the chunk's last position + 1")
    ap.add_argument("--merge-splits", default="32,66")
    ap.add_argument("--decode-len", type=int, default=131072)
    ap.add_argument("--num-sms", type=int, default=DEFAULT_NUM_SMS, help="split_plan's SM count")
    ap.add_argument("--long-pages", type=int, default=LONG_ROW_PAGES, help="split_plan's long-row test")
    ap.add_argument("--out", type=Path, default=Path("split_bench.json"))
    a = ap.parse_args(argv)
    if a.tiny:  # a long row among short ones still, at interpreter sizes (H=16: one row tile)
        a.batches, a.heads, a.width, a.decoders, a.decode_ctx, a.steady_batch = "4", 16, 12, 2, 64, 3
        a.chunk, a.prefix, a.merge_splits, a.decode_len, a.num_sms, a.long_pages = 2, 600, "4", 300, 4, 2
    a.batches = [int(x) for x in str(a.batches).split(",")]
    a.merge_splits = [int(x) for x in str(a.merge_splits).split(",")]
    timer = _timer(a.tiny)
    res: dict = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
                 "command": " ".join(sys.argv)}
    tasks = set(a.tasks.split(","))
    for name, fn in (("stall", bench_stall), ("steady", bench_steady), ("merge", bench_merge),
                     ("decode", bench_decode)):
        if name in tasks:
            fn(a, timer, res)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
