"""YaRN at 16x the training length on the embedded default model (issue 29 item 4), on CPU.

The default model (dsv3_jax/default_model) was trained on 512-token windows with plain RoPE and ships
YaRN x4 (max_position_embeddings 2048). This script scores held-out text in windows of `--length`
tokens (default 8,192 = 16x the training length), each window inside one held-out standard-library file,
under several rope settings, and reports perplexity by position bucket:

  off      rope scaling removed (plain RoPE, as trained), context opened to --length
  shipped  the shipped YaRN x4 (original context 512), context opened to --length
  x16      YaRN factor 16 over the same 512-token original context (covers 8,192 positions)

Held-out text: the files `dsv3_jax.train.is_heldout` puts in the held-out split (the split the model
never trained on; the same rule `python -m dsv3_jax.train --save-corpus` applies), tokenized here with
the model's tokenizer, [BOS] + file + [EOS] as in training. The forward runs the naive MLA form through
a paged cache in `--chunk`-token chunks (each chunk attends to the whole cached prefix), so a window of
8,192 tokens never materializes an 8K x 8K score matrix. Perplexity = exp(mean next-token CE) over the
full vocabulary. Prints a table last and writes JSON (--out).

`--context-use` (the one long-context check this model's weights support; retrieval needs skills it was
never taught): for each window and rope, the CE of the second half (positions L/2+1 .. L-1) after its own
first half versus after the first half of another window (another file): the same target tokens at the
same positions, so the difference is what the far context is worth to the model under that rope, by
distance from the boundary.

    .venv/bin/python benchmarks/yarn_quality.py --windows 2 --out benchmarks/results/yarn_quality.json
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

import quality_bench  # noqa: E402  (file_windows, variant, ppl: the quality benchmark's helpers)

import dsv3_jax  # noqa: E402
from dsv3_jax import train  # noqa: E402
from dsv3_jax.config import YarnScaling  # noqa: E402
from dsv3_jax.model import kv_cache  # noqa: E402
from dsv3_jax.model.kv_cache import PageMeta  # noqa: E402

TRAIN_LEN = quality_bench.TRAIN_LEN


def heldout_stream(tokenizer, every: int = 40) -> tuple[np.ndarray, int]:
    """The held-out split of the standard library as one token stream (and its file count)."""
    files = [f for f in train.stdlib_files() if train.is_heldout(f, every)]
    return np.concatenate(train.tokenize_files(tokenizer, files)).astype(np.int64), len(files)


def chunked_ce(handle, window: np.ndarray, chunk: int) -> np.ndarray:
    """Next-token CE [T-1] of one window, prefilled `chunk` tokens at a time through a paged cache."""
    cfg, model = handle.config, handle.model
    t = len(window)
    table = jnp.asarray(kv_cache.contiguous_table(1, t))
    cache = kv_cache.allocate(cfg, 1 + table.size, kv_cache.PAGE_SIZE, handle.attention, jnp.float32)

    @jax.jit
    def step(params, cache, toks, start):
        pos = (start + jnp.arange(chunk, dtype=jnp.int32))[None]
        meta = PageMeta(table, jnp.full((1,), chunk, jnp.int32))
        logits, _, cache = model.apply({"params": params}, toks, pos, cache, meta)
        lg = logits[0].astype(jnp.float32)
        return jax.nn.logsumexp(lg, axis=-1), lg, cache

    toks = jnp.asarray(window, jnp.int32)[None]
    ce = []
    for s in range(0, t, chunk):
        lse, lg, cache = step(handle.params, cache, toks[:, s:s + chunk], jnp.int32(s))
        nxt = window[s + 1:s + chunk + 1]
        lg = np.asarray(lg)[:len(nxt)]
        ce.append(np.asarray(lse)[:len(nxt)] - lg[np.arange(len(nxt)), nxt])
    return np.concatenate(ce)


def context_use(h, wins: list[np.ndarray], chunk: int, log) -> dict:
    """Second-half CE of each window after its own first half vs after another window's first half
    (window i takes window i+1's, cyclically). Positions scored: L/2+1 .. L-1 of the window, i.e. every
    prediction whose input token lies in the second half. Returns per-window and pooled means by the
    distance from the boundary."""
    if len(wins) < 2:
        raise ValueError("--context-use needs at least 2 windows (a foreign first half comes from another)")
    half = len(wins[0]) // 2
    own, foreign = [], []
    for i, w in enumerate(wins):
        swapped = np.concatenate([wins[(i + 1) % len(wins)][:half], w[half:]])
        ts = time.perf_counter()
        own.append(chunked_ce(h, w, chunk)[half:])  # CE[k] predicts token k + 1: inputs from half on
        foreign.append(chunked_ce(h, swapped, chunk)[half:])
        log(f"context use window {i}: own {own[-1].mean():.4f} vs foreign {foreign[-1].mean():.4f} nats "
            f"({time.perf_counter() - ts:.0f} s)")
    o, f = np.stack(own), np.stack(foreign)
    edges = sorted({min(e, o.shape[1]) for e in (0, 64, 512, 1024, 2048, o.shape[1])})  # short windows: fewer
    spans = {f"{half + lo}-{half + hi}": (lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)}
    return {"windows": len(wins), "boundary": half,
            "own_ce": float(o.mean()), "foreign_ce": float(f.mean()),
            "own_ppl": quality_bench.ppl(o), "foreign_ppl": quality_bench.ppl(f),
            "per_window_gain_nats": [float(x) for x in (f - o).mean(axis=1)],
            "by_distance": {k: {"own_ppl": quality_bench.ppl(o[:, lo:hi]),
                                "foreign_ppl": quality_bench.ppl(f[:, lo:hi]),
                                "gain_nats": float((f[:, lo:hi] - o[:, lo:hi]).mean())}
                            for k, (lo, hi) in spans.items()}}


def buckets(length: int) -> list[tuple[int, int]]:
    edges = [0, 512]
    while edges[-1] * 2 < length:
        edges.append(edges[-1] * 2)
    edges.append(length - 1)
    return list(zip(edges[:-1], edges[1:], strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=8192, help="tokens per window (16x training = 8192)")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--ropes", default="off,x16,shipped", help="comma-separated: off, shipped, x16")
    ap.add_argument("--budget-s", type=float, default=600.0, help="no new (window, rope) after this")
    ap.add_argument("--context-use", action="store_true",
                    help="instead of perplexity by position: second-half CE after the own vs a foreign first half")
    ap.add_argument("--out", type=Path, default=Path("yarn_quality.json"))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.length % a.chunk:
        ap.error("--length must be a multiple of --chunk")
    h = dsv3_jax.load(dtype="float32", kernels="reference", attention="naive")
    held, n_files = heldout_stream(h.tokenizer)
    wins = quality_bench.file_windows(held, a.length, a.windows)
    shipped = h.config.rope_scaling
    ropes = {"off": None, "shipped": shipped,
             "x16": YarnScaling(factor=16.0, original_max_position_embeddings=TRAIN_LEN)}
    res: dict = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
                 "command": " ".join(sys.argv), "train_len": TRAIN_LEN,
                 "shipped": {"factor": shipped.factor if shipped else None,
                             "max_position_embeddings": h.config.max_position_embeddings},
                 "heldout_files": n_files, "heldout_tokens": len(held), "length": a.length,
                 "windows": len(wins), "rows": [], "skipped": []}
    if a.context_use:
        res["context_use"] = {}
        for name in a.ropes.split(","):
            hv = quality_bench.variant(h, rope_scaling=ropes[name], max_position_embeddings=a.length)
            r = context_use(hv, wins, a.chunk, lambda m, name=name: print(f"{name} {m}", flush=True))
            res["context_use"][name] = r
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res, indent=1))
            print(f"{name}: second half ppl {r['own_ppl']:.3f} after its own first half, {r['foreign_ppl']:.3f} "
                  f"after another file's; by distance: " + ", ".join(
                      f"{k} {v['own_ppl']:.2f}/{v['foreign_ppl']:.2f}" for k, v in r["by_distance"].items()))
        res["seconds"] = time.perf_counter() - t0
        a.out.write_text(json.dumps(res, indent=1))
        return 0
    edges = buckets(a.length)
    for name in a.ropes.split(","):
        ce_all = []
        for i, w in enumerate(wins):
            if time.perf_counter() - t0 > a.budget_s:
                res["skipped"].append(f"{name} window {i}")
                continue
            hv = quality_bench.variant(h, rope_scaling=ropes[name], max_position_embeddings=a.length)
            ts = time.perf_counter()
            ce_all.append(chunked_ce(hv, w, a.chunk))
            print(f"{name} window {i}: ppl {quality_bench.ppl(ce_all[-1]):.2f} "
                  f"({time.perf_counter() - ts:.0f} s)", flush=True)
        if not ce_all:
            continue
        ce = np.stack(ce_all)
        res["rows"].append({"rope": name, "factor": ropes[name].factor if ropes[name] else 1.0,
                            "windows": len(ce_all), "ppl": quality_bench.ppl(ce),
                            "buckets": {f"{lo}-{hi}": quality_bench.ppl(ce[:, lo:hi]) for lo, hi in edges}})
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    res["seconds"] = time.perf_counter() - t0
    a.out.write_text(json.dumps(res, indent=1))
    names = [f"{lo}-{hi}" for lo, hi in edges]
    print(f"\n{a.length}-token windows x {len(wins)} from {n_files} held-out files; perplexity by position")
    print(f"{'rope':>8} " + " ".join(f"{n:>10}" for n in names) + f" {'whole':>8}")
    for r in res["rows"]:
        print(f"{r['rope']:>8} " + " ".join(f"{r['buckets'][n]:>10.2f}" for n in names) + f" {r['ppl']:>8.2f}")
    if res["skipped"]:
        print("skipped (budget):", res["skipped"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
