"""What structured outputs cost per token (issue 31 item 4): llguidance's mask computation on the host vs the
engine's step, on the embedded default model (the real DeepSeek-V3.1 tokenizer, 129,280-token vocabulary).

Three runs of the same prompts through one engine (each after a warm-up run of its own mode, so no compile
is timed): plain sampling (the full program), the same requests held to a JSON schema (the masked program
plus the host's bitmask fill and matcher advance per token), and the same constrained requests alone.
Reported per generated token: host mask time (`Constraint.fill_bitmask`, from the engine's own counter and
a counting wrapper), advance time, the engine's wall time per step, and tokens/s. A constrained row waits for
its previous token before its next mask (core.py), so a batch of only constrained rows runs one step at a
time (no pipelining): ms/step and tok/s show that cost next to the plain run.

    python benchmarks/structured_cost.py [--requests 4] [--tokens 48] [--out DIR]

Prints a table last; writes structured_cost.json under --out (default $OUT or benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax

from dsv3_jax import api, structured
from dsv3_jax.engine.api import EngineConfig
from dsv3_jax.engine.core import Engine

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "ok": {"type": "boolean"}}, "required": ["name", "count", "tags", "ok"], "additionalProperties": False}


class Counting(structured.Constraint):
    """A constraint that times its own fill_bitmask and advance calls."""

    fill_s: list[float] = []
    advance_s: list[float] = []

    def fill_bitmask(self, out):
        t0 = time.perf_counter()
        super().fill_bitmask(out)
        Counting.fill_s.append(time.perf_counter() - t0)

    def advance(self, token):
        t0 = time.perf_counter()
        ok = super().advance(token)
        Counting.advance_s.append(time.perf_counter() - t0)
        return ok


def run(eng: Engine, prompts, tokens: int, grammar=None) -> dict:
    steps0, mask0 = eng.stats["steps"], eng.stats["mask_s"]
    rids = [eng.add_request(p, max_new_tokens=tokens, temperature=0.8, seed=i, eos=[],
                            constraint=Counting(grammar) if grammar is not None else None)
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    while eng.has_work():
        eng.step()
    wall = time.perf_counter() - t0
    out = sum(len(eng.finished[r].output) for r in rids)
    steps = eng.stats["steps"] - steps0  # dispatched device steps
    return {"tokens": out, "wall_s": wall, "steps": steps, "tokens_per_s": out / wall,
            "ms_per_step": 1e3 * wall / steps, "engine_mask_s": eng.stats["mask_s"] - mask0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    h = api.load()
    tok = h.tokenizer
    t0 = time.perf_counter()
    grammar = structured.compile_format("json_schema", SCHEMA, tok, vocab_size=h.config.vocab_size,
                                        eos=h.eos_ids(), field="response_format")
    compile_s = time.perf_counter() - t0
    eng = Engine(h, EngineConfig(num_pages=128, max_batch=max(4, a.requests), max_batched_tokens=256,
                                 chunk_size=256, row_buckets=(a.requests,)))
    prompts = [tok.encode(f"# record {i} as JSON\nrecord = ") for i in range(a.requests)]
    for g in (None, grammar):  # compile the full and masked programs outside the timed runs
        run(eng, prompts, 4, g)
    plain = run(eng, prompts, a.tokens)
    Counting.fill_s, Counting.advance_s = [], []
    constrained = run(eng, prompts, a.tokens, grammar)
    fills, advances = list(Counting.fill_s), list(Counting.advance_s)
    alone = run(eng, prompts[:1], a.tokens, grammar)
    res = {"date": time.strftime("%Y-%m-%d"), "device": f"{jax.devices()[0].platform} ({platform.processor() or '?'}"
           f", {os.cpu_count()} cores)", "requests": a.requests, "max_new_tokens": a.tokens,
           "grammar_compile_s (incl. llguidance tokenizer, once per tokenizer)": compile_s,
           "mask_fill_us_median": 1e6 * statistics.median(fills), "mask_fill_us_max": 1e6 * max(fills),
           "advance_us_median": 1e6 * statistics.median(advances), "fills": len(fills),
           "plain": plain, "constrained": constrained, "constrained_alone": alone}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured_cost.json").write_text(json.dumps(res, indent=2))
    print(f"grammar compile {compile_s:.2f} s (the llguidance tokenizer once per tokenizer, then ~1 ms)")
    print(f"{'run':<20}{'tokens':>8}{'steps':>7}{'ms/step':>9}{'tok/s':>8}{'mask us/tok':>13}"
          f"{'mask/wall':>11}")
    for name, r in (("plain sampled", plain), ("json_schema", constrained), ("json_schema alone", alone)):
        per_tok = 1e6 * r["engine_mask_s"] / max(r["tokens"], 1)
        share = r["engine_mask_s"] / r["wall_s"]
        print(f"{name:<20}{r['tokens']:>8}{r['steps']:>7}{r['ms_per_step']:>9.1f}{r['tokens_per_s']:>8.1f}"
              f"{per_tok:>13.0f}{share:>10.1%}")
    print(f"fill_bitmask median {res['mask_fill_us_median']:.0f} us (max {res['mask_fill_us_max']:.0f}), "
          f"advance median {res['advance_us_median']:.0f} us, over {len(fills)} fills")


if __name__ == "__main__":
    main()
