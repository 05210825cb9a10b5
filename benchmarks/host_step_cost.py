"""The engine's host work per step, without a device: the stall scenario of long_context.py on a host-only
executor, to see whether scheduling, batch layout and commit grow with the long prompt's prefix or the
decoders' output.

The engine core (scheduler, step.build, commit, prefix-cache registration) runs as in a server; the executor
(`HostOnlyExecutor`) returns a next token for every row at once and compiles nothing, so each
`Engine.step()` call's wall time is host work only. Scenario (defaults = the GPU stall run of 2026-12-06):
--decoders requests of --decode-ctx prompt tokens decode while one --long-prompt token request is prefilled
in chunks capped at --prefill-attention-pairs; the pool and step shapes are the slice engine's (5-layer
DeepSeek-V3 config: only the config is used, no weights). Reported per band of the long request's prefix:
the median and p90 host ms per step, and per phase (scheduler, step.build, commit). JSON to --out.

    python3 benchmarks/host_step_cost.py [--long-prompt 131072] [--out FILE]

On a GPU the engine pipelines: a step's host work overlaps the previous step's device time, so this is the
budget a step's device time (17-19 ms in the stall run) must cover for the overlap to hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from long_context import StepTrace  # noqa: E402

from dsv3_jax.config import ModelConfig  # noqa: E402
from dsv3_jax.engine import step as step_mod  # noqa: E402
from dsv3_jax.engine.core import Engine, EngineConfig  # noqa: E402
from dsv3_jax.model import kv_cache  # noqa: E402


class _HostArray(np.ndarray):
    """A numpy array that answers the engine's device-array calls (`copy_to_host_async`)."""

    def copy_to_host_async(self) -> None:
        return None


class HostOnlyExecutor:
    """The executor protocol without a device: every row's next token is 7 (never EOS here), compiles
    nothing, clears nothing."""

    def __init__(self, config: EngineConfig, max_position: int):
        longest = min(config.num_pages - 1, kv_cache.pages_for(max_position, config.page_size))
        self.width = -(-longest // 8) * 8
        self.stats = {"compiles": 0, "compile_s": 0.0, "compiles_after_warmup": 0, "programs_loaded": 0}
        self.compile_wall_s = 0.0

    def execute(self, key: step_mod.StepKey, ints: np.ndarray, floats: np.ndarray):
        out = {"tokens": np.full((key.rows, key.spec_k + 1), 7, np.int32), "n_new": np.ones(key.rows, np.int32),
               "finite": np.ones(key.rows, np.int32)}
        flat = np.concatenate([out[name].reshape(-1) for name, _ in step_mod.out_fields(key)])
        return flat.view(_HostArray), np.zeros(0, np.float32).view(_HostArray)

    def clear_pages(self, pages: np.ndarray) -> None:
        return None

    def warmup(self, keys, progress=None, workers=None) -> float:
        return 0.0


def slice_handle(moe_layers: int) -> types.SimpleNamespace:
    """What the engine core reads from a handle: the config (no weights, no mesh)."""
    cfg = ModelConfig.preset("deepseek-v3").replace(num_hidden_layers=1 + moe_layers, first_k_dense_replace=1,
                                                    num_nextn_predict_layers=0)
    return types.SimpleNamespace(config=cfg, params={}, mesh=None, executor_factory=None)


def run(args) -> dict:
    handle = slice_handle(args.moe_layers)
    cfg = EngineConfig(num_pages=args.num_pages, page_size=64, max_batch=args.decoders + 8,
                       max_batched_tokens=4096, chunk_size=4096,
                       prefill_attention_pairs=args.prefill_attention_pairs, token_buckets=(128, 512),
                       row_buckets=(1,))
    eng = Engine(handle, cfg, executor=HostOnlyExecutor(cfg, handle.config.max_position_embeddings))
    rng = np.random.default_rng(0)
    vocab = handle.config.vocab_size
    budget = handle.config.max_position_embeddings - args.decode_ctx
    for _ in range(args.decoders):
        eng.add_request(rng.integers(8, vocab, args.decode_ctx).tolist(), max_new_tokens=budget)
    while any(len(r.output) < 2 for r in eng.running) or eng.waiting:
        eng.step()
    long_rid = eng.add_request(rng.integers(8, vocab, args.long_prompt).tolist(), max_new_tokens=1)
    trace = StepTrace(eng)  # long_context's per-phase timing of Engine.step(), the same phases as the GPU run
    rows = []
    try:
        while long_rid not in eng.finished:
            long_req = next((r for r in (*eng.running, *eng.waiting) if r.rid == long_rid), None)
            trace.begin()
            eng.step()
            trace.end(eng)
            ph = trace.rows[-1]
            rows.append({"prefix": long_req.computed if long_req else args.long_prompt, "ms": 1e3 * ph["wall"],
                         **{k: 1e3 * ph.get(k, 0.0) for k in ("schedule", "build", "commit")}})
    finally:
        trace.close()
    bands = []
    edges = np.linspace(0, args.long_prompt, args.bands + 1)
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        last = hi == edges[-1]  # the last band also holds the steps after the prompt's last chunk
        sel = [r for r in rows if lo <= r["prefix"] < hi or (last and r["prefix"] >= hi)]
        if not sel:
            continue
        band = {"prefix_from": int(lo), "prefix_to": int(hi), "steps": len(sel)}
        for key in ("ms", "schedule", "build", "commit"):
            v = np.asarray([r.get(key, 0.0) for r in sel])
            band[key] = {"p50": float(np.median(v)), "p90": float(np.percentile(v, 90))}
        bands.append(band)
    decoder_out = max(len(r.output) for r in eng.running if r.rid != long_rid)
    return {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "steps": len(rows), "decoder_output_at_end": decoder_out, "bands": bands}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=4096)
    ap.add_argument("--long-prompt", type=int, default=131072)
    ap.add_argument("--prefill-attention-pairs", type=int, default=2**20)
    ap.add_argument("--num-pages", type=int, default=12170, help="the GPU stall run's pool")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--bands", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    res = run(args)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(f"{res['steps']} steps with the long prompt; decoders' output at the end: {res['decoder_output_at_end']}")
    print("| long prefix | steps | host ms p50 (p90) | schedule | build | commit |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for b in res["bands"]:
        print(f"| {b['prefix_from']:,}-{b['prefix_to']:,} | {b['steps']} | {b['ms']['p50']:.2f} ({b['ms']['p90']:.2f}) "
              f"| {b['schedule']['p50']:.2f} | {b['build']['p50']:.2f} | {b['commit']['p50']:.2f} |")
    return res


if __name__ == "__main__":
    main()
