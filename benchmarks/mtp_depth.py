"""MTP at depth (issue 32 item 3): spec_k = 0..3 through the engine, and what a verify step costs.

Two parts (--parts, default both), JSON to --out:
  * engine: the embedded default model (real trained weights with an MTP head; --tiny: the tiny preset with
    random weights) decodes B prompts (benchmarks/data/mtp_depth_prompts.json: 64-token windows of held-out
    stdlib files, tokenized ahead, so the GPU machine needs no tokenizer) x --new tokens, for B in --batches,
    greedy and sampled (--temperature), one engine per (spec_k, B), warmed before it is timed. Per run:
    decode tok/s (tokens after each request's first / the span from the first first-token to the last
    token), steps, mean accepted drafts per decode step (spec_k x acceptance) and, greedy, the tokens against
    plain greedy at the same B: where they differ, the top-2 margin of the teacher-forced logits at the first
    differing position (handle.forward over prompt + the plain tokens; a near-tie explains a difference, a
    large margin is a bug).
  * slice: the engine's own step program (engine/step.make_step, compiled and run by a DeviceExecutor as the
    engine does) for B decode rows of spec_k + 1 tokens at context --ctx on the full-width FP8 slice (1 dense
    + --moe-layers MoE + the MTP layer, random weights, e2e_bench's builders): wall ms per step (and GPU time
    from a profile on the GPU) for spec_k 0..3, greedy and sampled, and the ratio to spec_k 0.
The table (printed last): speedup at depth = (1 + mean accepted) / (verify step / plain step), from the
engine part's acceptance and the slice's step ratio, beside the engine's own tok/s ratio on the small model.
--tiny runs both parts on CPU at toy size (a smoke test of the code paths; CPU times are not figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv3_jax.api import ModelHandle  # noqa: E402
from dsv3_jax.config import ModelConfig  # noqa: E402
from dsv3_jax.engine import step  # noqa: E402
from dsv3_jax.engine.core import Engine, EngineConfig  # noqa: E402
from dsv3_jax.engine.executor import DeviceExecutor  # noqa: E402
from dsv3_jax.model import kv_cache  # noqa: E402
from dsv3_jax.model.transformer import Transformer  # noqa: E402

PROMPTS = Path(__file__).parent / "data" / "mtp_depth_prompts.json"


# ----------------------------------------------------------------------------------------- engine part
def embedded_handle(tiny: bool) -> tuple[ModelHandle, str]:
    """The embedded default model as dsv3_jax.load() reads it, without its tokenizer; --tiny: the tiny
    preset (with its MTP layer) at seeded random weights."""
    if tiny:
        cfg = ModelConfig.preset("tiny").replace(vocab_size=512, max_position_embeddings=512)
        model = Transformer(cfg, jnp.dtype(cfg.dtype))
        params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 1), jnp.int32), method=model.init_all))(
            jax.random.key(0))["params"]
        return ModelHandle(cfg, params), "tiny preset, random weights"
    from dsv3_jax import api

    d = api.DEFAULT_MODEL_DIR
    cfg = ModelConfig.from_json(d / "config.json")
    return (ModelHandle(cfg, jax.tree_util.tree_map(jnp.asarray, api._host_params(d, cfg))),
            "embedded default (dsv3-small, trained, MTP head)")


def prompts_for(batch: int, vocab: int, tiny: bool) -> list[list[int]]:
    if tiny:
        rng = np.random.default_rng(0)
        return [rng.integers(2, vocab, 16).tolist() for _ in range(batch)]
    ids = json.loads(PROMPTS.read_text())["ids"]
    if batch > len(ids):
        raise ValueError(f"{PROMPTS.name} holds {len(ids)} prompts, batch {batch} asked")
    return ids[:batch]


def make_engine(h: ModelHandle, prompts: list[list[int]], k: int, new: int, modes: tuple[str, ...],
                budget: int) -> tuple:
    """An engine sized for these prompts (one decode shape of B rows, one prefill shape of `budget` tokens),
    its programs compiled (in parallel) and each run once."""
    b = len(prompts)
    longest = max(len(p) for p in prompts) + new + k
    pages = b * -(-longest // kv_cache.PAGE_SIZE) + 1
    cfg = EngineConfig(num_pages=pages, max_batch=b, max_batched_tokens=max(budget, b * (k + 1)),
                       chunk_size=max(len(p) for p in prompts), spec_k=k, prefix_caching=False,
                       row_buckets=(b,))
    eng = Engine(h, cfg)
    warm = eng.warmup(modes=modes)
    for m in modes:  # first run of each program, outside the timing
        eng.generate(prompts, max_new_tokens=4, temperature=0.0 if m == "greedy" else 1.0, seed=1)
    return eng, warm


def engine_run(eng: Engine, prompts: list[list[int]], new: int, temperature: float) -> dict:
    k = eng.cfg.spec_k
    s0 = dict(eng.stats)
    t0 = time.perf_counter()
    done = eng.generate(prompts, max_new_tokens=new, temperature=temperature, seed=0)
    wall = time.perf_counter() - t0
    first = min(r.first_token_at for r in done)
    last = max(r.token_times[-1] for r in done)
    proposed = eng.stats["spec_proposed"] - s0["spec_proposed"]
    accepted = eng.stats["spec_accepted"] - s0["spec_accepted"]
    out = {"spec_k": k, "batch": len(prompts), "temperature": temperature, "wall_s": wall,
           "decode_tok_s": sum(len(r.output) - 1 for r in done) / (last - first),
           "output_tok_s": sum(len(r.output) for r in done) / wall, "steps": eng.stats["steps"] - s0["steps"],
           "acceptance": accepted / proposed if proposed else None,
           # drafts proposed per decode row-step are k: accepted per step = k x acceptance
           "accepted_per_step": k * accepted / proposed if proposed else 0.0,
           "compiles_during": eng.stats["compiles"] - s0["compiles"]}
    out["outputs"] = [r.output for r in done]
    return out


def fp32_handle(h: ModelHandle) -> ModelHandle:
    """The same weights computed in float32 (the margin without bf16's rounding of the logits)."""
    f32 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, h.params)
    return ModelHandle(h.config.replace(dtype="float32"), f32)


def margins(h: ModelHandle, prompts: list[list[int]], plain: list[list[int]], other: list[list[int]],
            h32: ModelHandle | None = None) -> list[dict]:
    """For each prompt whose tokens differ from plain greedy: the first differing position, the two tokens and
    the teacher-forced logits there: the top-2 margin, plain's token minus the other's, and the fraction of
    the plain continuation's positions with a top-2 margin at most this one (how rare such a near-tie is).
    The logits are the model's (bf16 on the default model: rounded to 0.125 between 16 and 32); with `h32`
    the same again from a float32 forward."""
    diffs = []
    for i, (a, b) in enumerate(zip(plain, other, strict=True)):
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if pos is not None:
            diffs.append((i, pos))
    if not diffs:
        return []
    seqs = np.asarray([prompts[i] + plain[i] for i, _ in diffs], np.int32)  # one length: one compile
    rows = [{"prompt": i, "position": pos, "plain_token": plain[i][pos], "other_token": other[i][pos]}
            for i, pos in diffs]
    for tag, handle in (("", h), ("_fp32", h32)):
        if handle is None:
            continue
        try:
            logits = handle.forward(seqs)
        except Exception as e:  # noqa: BLE001 - the differences stay reported without their margins
            for row in rows:
                row[f"margin_error{tag}"] = repr(e)[:300]
            continue
        for row, (i, pos), lg in zip(rows, diffs, logits, strict=True):
            p0 = len(prompts[i])
            gen = lg[p0 - 1:p0 - 1 + len(plain[i])]  # the logits that chose each plain token
            top = np.sort(gen, -1)[:, -2:]
            all_margins = top[:, 1] - top[:, 0]
            x = gen[pos]
            top2 = np.argsort(x)[-2:][::-1]
            row.update({f"top2{tag}": [int(t) for t in top2],
                        f"top2_margin{tag}": float(x[top2[0]] - x[top2[1]]),
                        f"plain_minus_other{tag}": float(x[plain[i][pos]] - x[other[i][pos]]),
                        f"margin_quantile{tag}": float(np.mean(all_margins <= all_margins[pos]))})
    return rows


def engine_part(args, res: dict, save) -> None:
    h, name = embedded_handle(args.tiny)
    h32 = fp32_handle(h) if jnp.dtype(h.config.dtype) != jnp.float32 else None
    res["engine"] = {"model": name, "new_tokens": args.new, "runs": [], "greedy_checks": []}
    temps = [0.0] + ([args.temperature] if args.temperature > 0 else [])
    modes = ("greedy", "full") if len(temps) > 1 else ("greedy",)
    for b in args.batches:
        prompts = prompts_for(b, h.config.vocab_size, args.tiny)
        plain = None
        for k in args.ks:
            eng, warm = make_engine(h, prompts, k, args.new, modes, args.max_batched_tokens)
            for t in temps:
                r = {**engine_run(eng, prompts, args.new, t), "warmup_s": warm}
                outs = r.pop("outputs")
                if t <= 0 and k == 0:
                    plain = outs
                elif t <= 0 and plain is not None:
                    same = [a == o for a, o in zip(plain, outs, strict=True)]
                    r["same_as_plain"] = sum(same) / len(same)
                    res["engine"]["greedy_checks"].append(
                        {"spec_k": k, "batch": b, "identical_prompts": sum(same), "prompts": len(same),
                         "differences": margins(h, prompts, plain, outs, h32)})
                res["engine"]["runs"].append(r)
                print(f"  engine b={b} T={t} k={k}: {r['decode_tok_s']:.0f} tok/s, accepted/step "
                      f"{r['accepted_per_step']:.2f}" + (f", same as plain {r['same_as_plain']:.2f}"
                                                         if "same_as_plain" in r else ""), flush=True)
                save()
            del eng


# ------------------------------------------------------------------------------------------ slice part
def slice_handle(moe_layers: int, tiny: bool) -> ModelHandle:
    import e2e_bench

    cfg = e2e_bench.slice_config(moe_layers, tiny).replace(num_nextn_predict_layers=1)
    _, params = e2e_bench.random_params(cfg, fp8=True)
    return ModelHandle(cfg, params)


def decode_rows(batch: int, k: int, ctx: int, vocab: int, temperature: float) -> list[step.RowPlan]:
    """`batch` decode rows, each the last committed token + k drafts at positions ctx .. ctx + k."""
    per = kv_cache.pages_for(ctx + k + 1, kv_cache.PAGE_SIZE)
    rng = np.random.default_rng(k)
    return [step.RowPlan(rid=i, slot=i, start=ctx, tokens=rng.integers(2, vocab, k + 1).tolist(), n=k + 1,
                         pending_last=False, final=True, ndraft=k, hint=0,
                         pages=list(range(1 + i * per, 1 + (i + 1) * per)), temperature=temperature,
                         top_p=1.0, top_k=0, seed=i, counter=1) for i in range(batch)]


def time_step(ex: DeviceExecutor, batch: step.StepBatch, reps: int) -> dict:
    def call():
        return ex.execute(batch.key, batch.ints, batch.floats)

    jax.block_until_ready(call())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t0)
    out = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts)}
    if jax.default_backend() == "gpu":
        from device_time import jax_device_time

        dev = jax_device_time(call, (), calls=20)
        out["device_ms"] = dev["median_ms"]
    return out


def slice_part(args, res: dict, save) -> None:
    t0 = time.perf_counter()
    h = slice_handle(args.moe_layers, args.tiny)
    mc = h.config
    res["slice"] = {"layers": mc.num_hidden_layers, "moe_layers": mc.n_moe_layers, "mtp_layers": 1,
                    "ctx": args.ctx, "weights_s": time.perf_counter() - t0, "steps": []}
    save()
    modes = [0.0] + ([args.temperature] if args.temperature > 0 else [])
    bmax = max(args.batches)
    work = []  # (executor, B, temperature, StepBatch)
    for k in args.ks:
        per = kv_cache.pages_for(args.ctx + k + 1, kv_cache.PAGE_SIZE)
        ex = DeviceExecutor(h, EngineConfig(num_pages=1 + bmax * per, max_batch=bmax, spec_k=k))
        for b in args.batches:
            shapes = step.StepShapes.make(max_rows=b, max_tokens=b * (k + 1), spec_k=k, decode_rows=(b,))
            for t in modes:
                work.append((ex, b, t, step.build(decode_rows(b, k, args.ctx, mc.vocab_size, t), spec_k=k,
                                                  shapes=shapes, width=ex.width, logprobs=False)))
    res["slice"]["compile_wall_s"] = compile_all(h, [(ex, sb.key) for ex, _, _, sb in work])
    save()
    for ex, b, t, sb in work:
        row = {"spec_k": sb.key.spec_k, "batch": b, "temperature": t, "tokens": sb.key.tokens,
               **time_step(ex, sb, args.reps)}
        res["slice"]["steps"].append(row)
        print(f"  slice b={b} T={t} k={sb.key.spec_k}: {row['median_ms']:.3f} ms", flush=True)
        save()


def compile_all(h: ModelHandle, jobs: list[tuple[DeviceExecutor, step.StepKey]]) -> float:
    """Every (executor, key) program: traced one after another, compiled on parallel threads (as
    DeviceExecutor.warmup does for one executor), placed where the executors look them up."""
    import concurrent.futures
    import os

    from dsv3_jax.engine.executor import compiled_programs

    t0 = time.perf_counter()
    lowered = [(ex, key, ex._lower(key)) for ex, key in jobs]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        done = list(pool.map(lambda j: j[0]._compile_lowered(j[2]), lowered))
    store = compiled_programs(h)
    for (ex, key, _), compiled in zip(lowered, done, strict=True):
        store[ex.compile_key(key)] = compiled
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ table
def summarize(res: dict) -> list[dict]:
    """Per (batch, temperature, spec_k > 0): accepted per step, the engine's tok/s ratio, the slice's step
    ratio and the speedup it implies at depth."""
    runs = {(r["batch"], r["temperature"], r["spec_k"]): r for r in res.get("engine", {}).get("runs", [])}
    steps = {(r["batch"], r["temperature"], r["spec_k"]): r for r in res.get("slice", {}).get("steps", [])}
    rows = []
    for b, t, k in sorted(runs):
        r = runs[(b, t, k)]
        if k == 0:
            continue
        row = {"batch": b, "temperature": t, "spec_k": k, "accepted_per_step": r["accepted_per_step"],
               "acceptance": r["acceptance"], "same_as_plain": r.get("same_as_plain")}
        base = runs.get((b, t, 0))
        if base:
            row["engine_speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
        s, s0 = steps.get((b, t, k)), steps.get((b, t, 0))
        if s and s0:
            key = "device_ms" if "device_ms" in s and "device_ms" in s0 else "median_ms"
            row["step_ratio"] = s["median_ms"] / s0["median_ms"]
            row["device_step_ratio"] = s[key] / s0[key] if key == "device_ms" else None
            row["speedup_at_depth"] = (1 + r["accepted_per_step"]) / row["step_ratio"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="engine,slice", help="engine, slice or both (comma-separated)")
    ap.add_argument("--ks", default="0,1,2,3", help="spec_k values (0 = plain, always run first)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request (engine part)")
    ap.add_argument("--temperature", type=float, default=0.6, help="the sampled runs' temperature (0: none)")
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="the engine's token budget per step (0: 2048 on a GPU, 256 elsewhere: the CPU's "
                         "reference attention gathers each token's whole page table)")
    ap.add_argument("--moe-layers", type=int, default=4, help="MoE layers of the slice (1 dense + n + MTP)")
    ap.add_argument("--ctx", type=int, default=1024, help="context of the slice's decode rows")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at toy size")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.ks = sorted({0, *(int(k) for k in args.ks.split(","))})
    args.batches = [int(b) for b in args.batches.split(",")]
    args.max_batched_tokens = args.max_batched_tokens or (2048 if jax.default_backend() == "gpu" else 256)
    if args.tiny:
        args.new, args.ctx, args.reps, args.moe_layers = min(args.new, 12), min(args.ctx, 64), 2, 1
    res: dict = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
                 "command": " ".join(sys.argv if argv is None else ["mtp_depth.py", *argv])}

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))

    parts = args.parts.split(",")
    for name, fn in (("engine", engine_part), ("slice", slice_part)):
        if name in parts:
            try:
                fn(args, res, save)
            except Exception as e:  # noqa: BLE001 - record, keep the other part
                res[f"{name}_error"] = repr(e)[:600]
                print(f"{name} part failed: {e!r}"[:600], flush=True)
            save()
    res["table"] = summarize(res)
    save()
    print(f"\nMTP at depth on {res['device']} ({res.get('engine', {}).get('model', '-')}; slice "
          f"{res.get('slice', {}).get('layers', '-')} layers + MTP)")
    print("| B | T | spec_k | accepted / step | same as plain | engine tok/s vs plain | slice step vs plain "
          "| speedup at depth |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in res["table"]:
        print(f"| {r['batch']} | {r['temperature']} | {r['spec_k']} | {f(r['accepted_per_step'])} | "
              f"{f(r['same_as_plain'])} | {f(r.get('engine_speedup'))}x | {f(r.get('step_ratio'))}x | "
              f"{f(r.get('speedup_at_depth'))}x |")
    for c in res.get("engine", {}).get("greedy_checks", []):
        gaps = sorted(abs(d["plain_minus_other"]) for d in c["differences"] if "plain_minus_other" in d)
        print(f"greedy k={c['spec_k']} b={c['batch']}: {c['identical_prompts']} of {c['prompts']} prompts "
              "identical to plain" + (f"; |plain - MTP| logit at the first difference: max {gaps[-1]:.4f}, "
                                      f"median {gaps[len(gaps) // 2]:.4f}" if gaps else ""))
        for d in sorted(c["differences"], key=lambda d: -abs(d.get("plain_minus_other", 1e9)))[:3]:
            head = (f"greedy k={c['spec_k']} b={c['batch']}: prompt {d['prompt']} differs at token "
                    f"{d['position']} (plain {d['plain_token']}, MTP {d['other_token']})")
            if "top2_margin" not in d:
                print(f"{head}: {d.get('margin_error')}")
                continue
            print(f"{head}: top-2 margin {d['top2_margin']:.4f}, "
                  f"plain - MTP {d['plain_minus_other']:.4f} (<= it at {100 * d['margin_quantile']:.1f}% of "
                  "positions)" + (f"; fp32 forward: plain - MTP {d['plain_minus_other_fp32']:.4f}, top-2 "
                                  f"{d['top2_fp32']}" if "top2_fp32" in d else ""))
    for name in ("engine", "slice"):
        if f"{name}_error" in res:
            print(f"{name} error: {res[name + '_error']}")
    return res


if __name__ == "__main__":
    main()
