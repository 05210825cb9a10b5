"""Quality of the embedded default model on its held-out split (issue 18).

Sections (each writes into one JSON; a wall-clock budget skips what no longer fits, and says so):
  kernels  held-out perplexity of BF16 and FP8 (e4m3, 128x128 blocks; UE8M0 and fp32 scales), prefilled
           through the paged absorbed cache with the kernels forced to Pallas and to the jnp reference
  mtp      MTP speculative decoding through the engine (spec_k 1 vs 0): acceptance, tokens/step, tok/s
  experts  n_activated_experts from the trained k down to 1: perplexity and engine decode tok/s (b=1)
  yarn     perplexity by position bucket at 1x / 4x / 16x the training length, YaRN off / shipped / 16x
Perplexity = exp(mean next-token cross-entropy over the full 129,280-token vocabulary).

    python benchmarks/quality_bench.py --heldout .train_data/heldout.npz --out q.json   # GPU: all sections
    python benchmarks/quality_bench.py --sections kernels --windows 4 --cpu ...          # CPU reference
    python benchmarks/quality_bench.py --plot q_gpu.json q_cpu.json --plot-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv3_jax  # noqa: E402
from dsv3_jax.api import ModelHandle  # noqa: E402
from dsv3_jax.config import YarnScaling  # noqa: E402
from dsv3_jax.formats.quantize import quantize_params  # noqa: E402
from dsv3_jax.model import kv_cache  # noqa: E402
from dsv3_jax.model.kv_cache import PageMeta  # noqa: E402
from dsv3_jax.model.trace_options import TraceOptions  # noqa: E402

TRAIN_LEN = 512  # the default model's training windows (= its YaRN original context)


# ------------------------------------------------------------------------------------------ data
def file_windows(stream: np.ndarray, length: int, n: int, bos: int = 0) -> np.ndarray:
    """Up to `n` windows of `length` tokens, each inside one held-out file (starting at its BOS), longest
    files first; fewer when fewer files are that long."""
    starts = np.flatnonzero(stream == bos)
    ends = np.append(starts[1:], len(stream))
    out = []
    for s, e in sorted(zip(starts, ends, strict=True), key=lambda se: se[0] - se[1]):
        for w in range(s, e - length + 1, length):
            out.append(stream[w:w + length])
            if len(out) == n:
                return np.stack(out).astype(np.int32)
    if not out:
        raise ValueError(f"no held-out file has {length} tokens")
    return np.stack(out).astype(np.int32)


def plain_windows(stream: np.ndarray, length: int, n: int) -> np.ndarray:
    w = len(stream) // length
    return stream[: w * length].reshape(w, length)[:n].astype(np.int32)


# ------------------------------------------------------------------------------------ perplexity
def ce_fn(handle: ModelHandle, cached: bool):
    """jitted (params, tokens [B, T]) -> next-token cross-entropy [B, T-1] (fp32), computed on device.

    cached: prefill through a fresh paged absorbed cache (the MLA kernel's path); else the cache-free
    forward."""
    model, cfg = handle.model, handle.config

    def f(params, toks):
        b, t = toks.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if cached:
            table = kv_cache.contiguous_table(b, t)
            dt = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.dtype(cfg.dtype)
            cache = kv_cache.allocate(cfg, 1 + table.size, kv_cache.PAGE_SIZE, "absorbed", dt)
            meta = PageMeta(jnp.asarray(table), jnp.full((b,), t, jnp.int32))
            logits = model.apply({"params": params}, toks, pos, cache, meta)[0]
        else:
            logits = model.apply({"params": params}, toks, pos)[0]
        lg = logits[:, :-1].astype(jnp.float32)
        tgt = jnp.take_along_axis(lg, toks[:, 1:, None], axis=-1)[..., 0]
        return jax.nn.logsumexp(lg, axis=-1) - tgt

    return jax.jit(f)


def token_ce(handle: ModelHandle, wins: np.ndarray, batch: int, *, cached: bool = True) -> np.ndarray:
    """Cross-entropy [N, T-1] of every window, `batch` windows per call (kernels: the handle's)."""
    f = ce_fn(handle, cached)
    out = [np.asarray(f(handle.params, jnp.asarray(wins[i:i + batch]))) for i in range(0, len(wins), batch)]
    return np.concatenate(out)


def ppl(ce: np.ndarray) -> float:
    return float(math.exp(float(np.mean(ce))))


def variant(base: ModelHandle, params=None, trace_options: TraceOptions | None = None,
            **cfg_changes) -> ModelHandle:
    return ModelHandle(base.config.replace(**cfg_changes), base.params if params is None else params,
                       base.attention, None, base.path, base.tokenizer, base.generation_defaults,
                       trace_options=base.trace_options if trace_options is None else trace_options)


# -------------------------------------------------------------------------------------- sections
def sec_kernels(h: ModelHandle, held: np.ndarray, n: int, batch: int, backends: list[str],
                weights: list[str]) -> dict:
    wins = plain_windows(held, TRAIN_LEN, n)
    # Quantized from the checkpoint form: the handle holds kv_b split in bf16 (model/kv_b.py), and the
    # official FP8 weights quantize kv_b too.
    stored = lambda: jax.tree.map(jnp.asarray, dsv3_jax.api._host_params(h.path, h.config))  # noqa: E731
    quant = {"bf16": lambda: None, "fp8-ue8m0": lambda: quantize_params(stored(), ue8m0=True),
             "fp8-fp32-scales": lambda: quantize_params(stored(), ue8m0=False)}
    rows = []
    for name in weights:
        params = quant[name]()
        for be in backends:
            if _late():
                return {"windows": len(wins), "seq": TRAIN_LEN, "rows": rows, "truncated": True}
            t0 = time.perf_counter()
            hv = variant(h, params, TraceOptions.resolve(be))
            rows.append({"weights": name, "backend": be, "ppl": ppl(token_ce(hv, wins, batch)),
                         "tokens": int(wins.shape[0] * (wins.shape[1] - 1)),
                         "seconds": time.perf_counter() - t0})
            print(rows[-1], flush=True)
    return {"windows": len(wins), "seq": TRAIN_LEN, "rows": rows}


def _engine_run(handle, prompts, new_tokens: int, spec_k: int) -> dict:
    from dsv3_jax.engine.core import Engine, EngineConfig

    b = len(prompts)
    pages = b * kv_cache.pages_for(len(prompts[0]) + new_tokens + spec_k + 1)
    ecfg = EngineConfig(num_pages=1 + pages, max_batch=b, max_batched_tokens=b * 64 + 64, chunk_size=64,
                        spec_k=spec_k, prefix_caching=False)
    eng = Engine(handle, ecfg)
    eng.generate(prompts, max_new_tokens=8)  # compile every shape this run uses (same engine: no retrace)
    steps0 = eng.stats["steps"]
    t0 = time.perf_counter()
    done = eng.generate(prompts, max_new_tokens=new_tokens)
    wall = time.perf_counter() - t0
    n_out = sum(len(r.output) for r in done)
    # Decode rate: tokens after each request's first, over the span from the first first-token to the end.
    first = min(r.first_token_at for r in done)
    last = max(r.token_times[-1] for r in done)
    prop = sum(r.spec_proposed for r in done)
    return {"batch": b, "spec_k": spec_k, "tokens": n_out, "wall_s": wall,
            "decode_tok_s": (n_out - b) / (last - first), "steps": eng.stats["steps"] - steps0,
            "acceptance": sum(r.spec_accepted for r in done) / prop if prop else float("nan"),
            "outputs": [r.output for r in done]}


_DEADLINE = [float("inf")]  # perf_counter() after which loops stop early (their rows say so)


def _late() -> bool:
    return time.perf_counter() > _DEADLINE[0]


def sec_mtp(h: ModelHandle, held: np.ndarray, new_tokens: int, batches: list[int]) -> dict:
    rows = []
    for b in batches:
        if _late():
            return {"new_tokens": new_tokens, "prompt_tokens": 64, "rows": rows, "truncated": True}
        prompts = [w[:64].tolist() for w in file_windows(held, 192, b)]
        if len(prompts) < b:
            prompts = [held[i * 997:i * 997 + 64].tolist() for i in range(b)]
        plain = _engine_run(h, prompts, new_tokens, 0)
        spec = _engine_run(h, prompts, new_tokens, 1)
        same = plain.pop("outputs") == spec.pop("outputs")
        rows.append({"batch": b, "acceptance": spec["acceptance"],
                     "tokens_per_step": spec["tokens"] / (b * max(spec["steps"], 1)),
                     "plain_tok_s": plain["decode_tok_s"], "mtp_tok_s": spec["decode_tok_s"],
                     "speedup": spec["decode_tok_s"] / plain["decode_tok_s"], "greedy_outputs_equal": same,
                     "plain": plain, "mtp": spec})
        print({k: v for k, v in rows[-1].items() if k not in ("plain", "mtp")}, flush=True)
    return {"new_tokens": new_tokens, "prompt_tokens": 64, "rows": rows}


def sec_experts(h: ModelHandle, held: np.ndarray, n: int, batch: int, new_tokens: int,
                decode: bool) -> dict:
    wins = plain_windows(held, TRAIN_LEN, n)
    prompt = [file_windows(held, 192, 1)[0][:64].tolist()]
    rows = []
    for k in range(h.config.num_experts_per_tok, 0, -1):
        if _late():
            return {"windows": len(wins), "rows": rows, "truncated": True}
        hv = variant(h, num_experts_per_tok=k)
        row = {"k": k, "ppl": ppl(token_ce(hv, wins, batch))}
        if decode:
            row["decode_tok_s"] = _engine_run(hv, prompt, new_tokens, 0)["decode_tok_s"]
        rows.append(row)
        print(row, flush=True)
    return {"windows": len(wins), "rows": rows}


def sec_yarn(h: ModelHandle, held: np.ndarray, lengths: list[int], n_tokens: int) -> dict:
    shipped = h.config.rope_scaling
    configs = {"off": None, "shipped": shipped,
               "x16": YarnScaling(factor=16.0, original_max_position_embeddings=TRAIN_LEN)}
    rows = []
    for length in lengths:
        wins = file_windows(held, length, max(1, n_tokens // length))
        edges = [b for b in (0, TRAIN_LEN, 4 * TRAIN_LEN, 16 * TRAIN_LEN) if b < length] + [length - 1]
        for name, rs in configs.items():
            if rs is None and name != "off":
                continue
            if _late():
                return {"train_len": TRAIN_LEN, "rows": rows, "truncated": True}
            hv = variant(h, rope_scaling=rs, max_position_embeddings=max(length, TRAIN_LEN))
            ce = token_ce(hv, wins, 1, cached=False)
            buckets = {f"{a}-{b}": ppl(ce[:, a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)}
            rows.append({"length": length, "rope": name, "factor": rs.factor if rs else 1.0,
                         "windows": len(wins), "ppl": ppl(ce), "buckets": buckets})
            print(rows[-1], flush=True)
    return {"train_len": TRAIN_LEN, "rows": rows}


# ---------------------------------------------------------------------------------------- plots
def plot(files: list[Path], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [json.loads(Path(f).read_text()) for f in files]
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    ax = axes[0]
    labels, vals = [], []
    for r in res:
        for row in r.get("kernels", {}).get("rows", []):
            labels.append(f"{row['weights']}\n{row['backend']} ({r['device_kind'].split()[-1]})")
            vals.append(row["ppl"])
    ax.barh(range(len(vals)), vals, color="tab:blue")
    ax.set_yticks(range(len(vals)), labels, fontsize=6)
    if vals:
        ax.set_xlim(min(vals) * 0.97, max(vals) * 1.01)
    ax.set_xlabel("held-out perplexity")
    ax.set_title("BF16 vs FP8, Pallas vs reference", fontsize=9)
    ax = axes[1]
    for r in res:
        rows = r.get("experts", {}).get("rows", [])
        if rows:
            ax.plot([x["k"] for x in rows], [x["ppl"] for x in rows], "o-", label=r["device_kind"])
            if "decode_tok_s" in rows[0]:
                ax2 = ax.twinx()
                ax2.plot([x["k"] for x in rows], [x["decode_tok_s"] for x in rows], "s--", color="tab:red")
                ax2.set_ylabel("decode tok/s, b=1 (red)")
    ax.set_xlabel("n_activated_experts")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("fewer activated experts", fontsize=9)
    ax = axes[2]
    for r in res:
        for row in r.get("yarn", {}).get("rows", []):
            if row["length"] != max(x["length"] for x in r["yarn"]["rows"]):
                continue
            ks = list(row["buckets"])
            ax.plot(range(len(ks)), [row["buckets"][k] for k in ks], "o-",
                    label=f"{row['rope']} (x{row['factor']:g})")
            ax.set_xticks(range(len(ks)), ks, fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("token positions")
    ax.set_ylabel("perplexity")
    ax.set_title("YaRN: longest windows, by position", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[3]
    for r in res:
        rows = r.get("mtp", {}).get("rows", [])
        if rows:
            xs = np.arange(len(rows))
            ax.bar(xs - 0.2, [x["plain_tok_s"] for x in rows], 0.4, label="plain")
            ax.bar(xs + 0.2, [x["mtp_tok_s"] for x in rows], 0.4, label="MTP k=1")
            ax.set_xticks(xs, [f"b={x['batch']}\nacc {x['acceptance']:.2f}, x{x['speedup']:.2f}" for x in rows])
            ax.set_yscale("log")
    ax.set_ylabel("decode tok/s")
    ax.set_title("MTP speculative decoding (engine)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "quality_default_model.png"
    fig.savefig(path, dpi=80)
    return [path]


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heldout", type=Path, help="npz with a 'heldout' token stream (train.py's corpus)")
    ap.add_argument("--out", type=Path, default=Path("quality_bench.json"))
    ap.add_argument("--sections", default="kernels,mtp,yarn,experts")
    ap.add_argument("--windows", type=int, default=32, help="512-token held-out windows for perplexity")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mtp-batches", default="1,32")
    ap.add_argument("--yarn-lengths", default="512,2048,8192")
    ap.add_argument("--yarn-tokens", type=int, default=16384, help="held-out tokens per YaRN length")
    ap.add_argument("--no-decode", action="store_true", help="experts: perplexity only")
    ap.add_argument("--cpu", action="store_true", help="float32 compute, reference kernels only")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop measuring after this (rows say so)")
    ap.add_argument("--kernel-weights", default="bf16,fp8-ue8m0,fp8-fp32-scales")
    ap.add_argument("--plot", type=Path, nargs="+", help="only plot these result JSONs")
    ap.add_argument("--plot-dir", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args(argv)
    if a.plot:
        print(plot(a.plot, a.plot_dir))
        return 0
    if a.heldout is None:
        ap.error("--heldout is required")
    t0 = time.perf_counter()
    _DEADLINE[0] = t0 + a.budget_s
    held = np.load(a.heldout)["heldout"].astype(np.int64)
    h = dsv3_jax.load(dtype="float32" if a.cpu else None, kernels="auto")
    res: dict = {"date": time.strftime("%Y-%m-%d"), "device_kind": jax.devices()[0].device_kind,
                 "command": " ".join(sys.argv), "dtype": h.config.dtype, "kernels_auto": h.trace_options.kernels,
                 "skipped": []}

    def save() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))

    backends = ["reference"] if a.cpu else ["pallas", "reference"]
    jobs = {
        "kernels": lambda: sec_kernels(h, held, a.windows, a.batch, backends, a.kernel_weights.split(",")),
        "mtp": lambda: sec_mtp(h, held, a.new_tokens, [int(x) for x in a.mtp_batches.split(",")]),
        "yarn": lambda: sec_yarn(h, held, [int(x) for x in a.yarn_lengths.split(",")], a.yarn_tokens),
        "experts": lambda: sec_experts(h, held, a.windows, a.batch, a.new_tokens, not a.no_decode),
    }
    for name in a.sections.split(","):
        if _late():
            res["skipped"].append(name)
            print(f"skipped {name}: budget", flush=True)
            continue
        ts = time.perf_counter()
        try:
            res[name] = jobs[name]()
        except Exception as e:  # noqa: BLE001 - report it and measure the rest
            res[f"{name}_error"] = repr(e)
            print(f"{name} failed: {e!r}", flush=True)
        res.setdefault("section_seconds", {})[name] = time.perf_counter() - ts
        save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
