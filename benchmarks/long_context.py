"""Long context through the serving engine on one GPU (issue 29): 32K-160K prompts, no stall, the MLA
prefill-chunk kernel at long prefixes, each figure beside its floor or peer measured in the same run.

Model: the full-width DeepSeek-V3 slice with FP8 weights the other GPU benchmarks use (1 dense + 4 MoE
layers, `e2e_bench.slice_config` / `random_fp8_params`, imported), context 163,840. Sections, in order
of priority (a wall-clock budget skips what no longer fits and says so; --tasks picks some):

  kernel  (c) the absorbed MLA prefill-chunk kernel (`mla_chunk_attention`, the engine's path) for
          chunks of 512-4K new tokens over a 128K cached prefix, H=128: TFLOP/s in its own (absorbed,
          576/512) FLOPs, beside torch SDPA (FlashAttention-style, causal lower-right) on the naive-form
          shapes of the same attention (qk 192, v 128 per head): the time each takes for the same
          attention, and the peer's TFLOP/s in naive-form FLOPs. Beside them the engine's naive-form
          long-prefill path (model/long_prefill.py: expansion + cuDNN flash attention), in naive-form FLOPs.
  long    (a) one request of 32K, 64K, 128K (and 160K last, if the budget allows) prompt tokens through
          the engine alone: TTFT beside the prefill compute floor = body FLOPs (activated parameters
          without embedding and head, 2 per token) at the fp8 GEMM rate + attention FLOPs at the bf16
          GEMM rate, the attention counted as the engine computes it (absorbed form, causal pairs x
          (576 + 512) x 2 per head and layer; the naive-form count, 3.4x smaller, is in the JSON); then
          decode ITL at that context (batch 1) beside its HBM floor (`e2e_bench.step_bytes` at the
          device copy bandwidth). With --long-prefill-from, lone chunks past it take the naive-form path
          and the TTFT's share of the naive-form floor is the figure to read.
  stall   (b) 32 requests decoding at a 4K context while a 128K prompt arrives: their ITL p50 / p99 / max
          during the long prefill against their p50 just before it (goal: p99 <= 2x), the long prompt's
          TTFT beside its TTFT alone, and the steps' token counts (the prefill attention cap at work:
          EngineConfig.prefill_attention_pairs, see dsv3_jax/engine/scheduler.py).
  stallparts  (only when asked: --tasks stallparts) what one step of (b) is made of, without the 128K
          prefill: the same engine's step program (`step.build` rows -> `Executor.execute`, the program
          the engine runs) and, alone, its per-layer MLA attention call exactly as the ragged step issues
          it (`engine_attention`), for a decode-only step (the decoders at --decode-ctx) and for mixed
          steps (those rows plus one prefill chunk of C tokens at prefix P, --parts-cases "C@P,...", the
          prefix's pages in the pool filled with random values); GPU time (benchmarks/device_time) and
          host clock. The added step time beside the added attention time x layers shows the attention's
          share of what a capped chunk adds to the decoders' step. Compiles only the step programs its
          cases pick (two: a 32+8-token step still fits the 40-token decode program), no full warmup and
          no rate measurements: 75 s on one H100 (2026-12-06, five cases; most of it weights and
          compiles). Then the engine loop itself at the first case whose prefix passes --decode-ctx
          (`sec_stallloop`): the decoders and the long request admitted from the prefix cache at their
          contexts (`seed_prefix`, no 128K prefill), --parts-engine-steps `Engine.step()` calls timed per
          phase (StepTrace: schedule, build, dispatch, the wait for the device, the commit's host work)
          without and with the long request: does a step of (b) cost its program's time, or more?

One engine serves (a), (b) and the parts: warmed once for (a) and (b) (every step program compiled
before the first request, compile time reported apart; a compile during a load is counted in its row),
greedy, EOS off, prefix caching on (every prompt is fresh random tokens, so nothing hits). Timings use the engine's clock
(compile time excluded). Prints a short table last; details go to the JSON (--out).

    python3 benchmarks/long_context.py --out $OUT/long_context.json            # one H200, <= 5 min
    python3 benchmarks/long_context.py --tiny --out /tmp/long_context.json     # CPU, toy sizes
    python3 benchmarks/long_context.py --tasks stallparts --token-buckets 128,512 --out $OUT/parts.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_bench  # noqa: E402  (the slice, its weights, floors and rates)
from engine_bench import timed_warmup  # noqa: E402

from dsv3_jax.api import ModelHandle  # noqa: E402
from dsv3_jax.engine import step  # noqa: E402
from dsv3_jax.engine.core import Engine, EngineConfig  # noqa: E402
from dsv3_jax.engine.executor import batch_shards  # noqa: E402
from dsv3_jax.engine.scheduler import attention_pairs, chunk_tokens_within  # noqa: E402
from dsv3_jax.model import kernel_dispatch, kv_cache, layout, long_prefill  # noqa: E402
from dsv3_jax.model.kv_cache import PageMeta, absorbed_leaves, absorbed_pages, layer_view  # noqa: E402
from pallas_kernels.mla_prefill import mla_chunk_attention  # noqa: E402

ABSORBED, NAIVE = 576 + 512, 192 + 128  # per-head widths of QK + PV in each MLA form


def pct(xs, q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


# ------------------------------------------------------------------------------------------ floors
def prefill_flops(cfg, n: int, start: int = 0, width: int = ABSORBED) -> tuple[float, float]:
    """(body FLOPs, attention FLOPs) of prefilling n tokens after `start` cached ones: the body is every
    activated parameter but the embedding (a gather) and the head (one row per chunk), 2 per token."""
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    body = 2.0 * (cfg.param_count(activated=True) - embed) * n
    attn = 2.0 * cfg.num_hidden_layers * cfg.num_attention_heads * width * attention_pairs(start, n)
    return body, attn


# ------------------------------------------------------------------------------------------ (c)
def torch_sdpa_peer(prefix: int, chunk: int, heads: int, reps: int) -> dict:
    """torch SDPA (FlashAttention-style kernels) on the naive-form shapes: q [1, H, chunk, 192] over
    k [1, H, prefix + chunk, 192], v [.., 128], causal aligned bottom-right (the chunk's last query sees
    every key). Each of torch's fused GPU backends that takes the shapes is timed (CUDA events); the
    fastest is the peer. On CPU, torch's default choice, timed with perf_counter."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = prefix + chunk
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, heads, chunk, 192, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, heads, s, 192, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, heads, s, 128, device=dev, dtype=torch.bfloat16, generator=g)
    mask = causal_lower_right(chunk, s)

    def timed() -> dict:
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
        f()
        ts = []
        for _ in range(reps):
            if dev == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
        return {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts)}

    if dev == "cpu":
        return {**timed(), "device": dev, "backend": "default"}
    tried: dict = {}
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                tried[name] = timed()
        except Exception as e:  # noqa: BLE001 - this backend refuses the shapes (e.g. qk 192 != v 128)
            tried[name] = {"error": repr(e)[:200]}
    ok = {n: t for n, t in tried.items() if "median_ms" in t}
    if not ok:
        raise RuntimeError(f"no torch SDPA backend took the shapes: {tried}")
    best = min(ok, key=lambda n: ok[n]["median_ms"])
    return {**ok[best], "device": dev, "backend": best, "backends": tried}


def kernel_case(prefix: int, chunk: int, heads: int, reps: int, use_kernel: bool) -> dict:
    """The engine's chunk attention (absorbed, paged) for `chunk` new tokens after `prefix` cached."""
    ps = kv_cache.PAGE_SIZE
    s = prefix + chunk
    table = jnp.asarray(kv_cache.contiguous_table(1, s, ps))
    k1, k2, k3 = jax.random.split(jax.random.key(chunk), 3)
    kv = jax.random.normal(k1, (1 + table.size, ps, 576), jnp.bfloat16)
    ql = jax.random.normal(k2, (1, chunk, heads, 512), jnp.bfloat16)
    qr = jax.random.normal(k3, (1, chunk, heads, 64), jnp.bfloat16)
    start, lens = jnp.full((1,), prefix, jnp.int32), jnp.full((1,), chunk, jnp.int32)
    f = jax.jit(lambda *a: mla_chunk_attention(*a, softmax_scale=192**-0.5, use_kernel=use_kernel)[0])
    return e2e_bench.timeit(lambda: f(ql, qr, kv, table, start, lens), reps)


def naive_case(prefix: int, chunk: int, heads: int, reps: int, backend: str) -> dict:
    """The engine's long-prefill path (model/long_prefill.py: the prefix's latents expanded block by block,
    flash attention per block, cuDNN on a GPU) for `chunk` new tokens after `prefix` cached, H heads."""
    ps = kv_cache.PAGE_SIZE
    s = prefix + chunk
    table = jnp.asarray(kv_cache.contiguous_table(1, s, ps))[0]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(chunk + 1), 4)
    kv = jax.random.normal(k1, (1 + table.size, ps, 576), jnp.bfloat16)
    qn = jax.random.normal(k2, (chunk, heads, 128), jnp.bfloat16)
    qr = jax.random.normal(k3, (chunk, heads, 64), jnp.bfloat16)
    w = jax.random.normal(k4, (2, heads, 128, 512), jnp.bfloat16) * 0.05
    f = jax.jit(lambda qn, qr, kv, w: long_prefill.chunk_attention(
        qn, qr, lambda ids: kv_cache.read_values(kv, ids, jnp.bfloat16), table, jnp.int32(prefix),
        jnp.int32(chunk), w[0], w[1], page_size=ps, softmax_scale=192**-0.5, backend=backend))
    return e2e_bench.timeit(lambda: f(qn, qr, kv, w), reps)


def sec_kernel(args, res: dict, left) -> None:
    rows = res.setdefault("kernel", [])
    use_kernel = not args.tiny
    for chunk in args.kernel_chunks:
        if left() < 15:
            res["skipped"].append(f"kernel chunk {chunk}")
            continue
        pairs = args.heads * attention_pairs(args.kernel_prefix, chunk)
        row = {"prefix": args.kernel_prefix, "chunk": chunk, "heads": args.heads,
               "path": "pallas" if use_kernel else "reference (CPU)"}
        try:
            k = kernel_case(args.kernel_prefix, chunk, args.heads, args.reps, use_kernel)
            row["ours"] = {**k, "tflops": 2 * pairs * ABSORBED / (k["median_ms"] / 1e3) / 1e12}
        except Exception as e:  # noqa: BLE001 - record and keep measuring
            row["ours_error"] = repr(e)[:300]
        try:
            nv = naive_case(args.kernel_prefix, chunk, args.heads, args.reps, "pallas" if use_kernel else "reference")
            expand = 2.0 * args.heads * 256 * 512 * (args.kernel_prefix + chunk)  # W_uk, W_uv over every key
            row["ours_naive"] = {**nv, "tflops": 2 * pairs * NAIVE / (nv["median_ms"] / 1e3) / 1e12,
                                 "expansion_tflop": expand / 1e12}
        except Exception as e:  # noqa: BLE001 - record and keep measuring
            row["ours_naive_error"] = repr(e)[:300]
        try:
            t = torch_sdpa_peer(args.kernel_prefix, chunk, args.heads, args.reps)
            row["torch_sdpa_naive"] = {**t, "tflops": 2 * pairs * NAIVE / (t["median_ms"] / 1e3) / 1e12}
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # JAX needs the memory back for the engine
        except Exception as e:  # noqa: BLE001 - torch missing or its kernels refuse the shapes
            row["torch_error"] = repr(e)[:300]
        if "ours" in row and "torch_sdpa_naive" in row:
            row["time_ours_over_torch"] = row["ours"]["median_ms"] / row["torch_sdpa_naive"]["median_ms"]
        if "ours_naive" in row and "torch_sdpa_naive" in row:
            row["time_naive_over_torch"] = row["ours_naive"]["median_ms"] / row["torch_sdpa_naive"]["median_ms"]
        rows.append(row)
        print("kernel", row, flush=True)


# ------------------------------------------------------------------------------------------ (a), (b)
def drive(eng: Engine, until, record: list | None = None, trace: StepTrace | None = None) -> None:
    """Step until `until()`; `record` gets (clock, tokens, rows) per dispatched step; `trace` (if given)
    times each `eng.step()` call's phases."""
    while not until():
        before = eng.stats["steps"]
        if trace is not None:
            trace.begin()
        eng.step()
        if trace is not None:
            trace.end(eng)
        if record is not None and eng.stats["steps"] > before:
            record.append((eng.clock(), eng.stats["tokens"][-1], eng.stats["batch_sizes"][-1]))


def itl_gaps(token_times: list[list[float]], a: float, b: float,
             exclude: tuple[float, float] | None = None) -> np.ndarray:
    """The inter-token gaps of these requests (their token clocks) that end in (a, b], less those that
    overlap `exclude`'s window (e.g. a profiler's: its start, its traced steps and its stop)."""
    out = []
    for times in token_times:
        t = np.asarray(times)
        keep = (t[1:] > a) & (t[1:] <= b)
        if exclude is not None:
            keep &= ~((t[1:] > exclude[0]) & (t[:-1] < exclude[1]))
        out.append(np.diff(t)[keep])
    return np.concatenate(out) if out else np.zeros(0)


class StepTrace:
    """Where each `Engine.step()` call's wall time goes, from the host: the scheduler, the batch layout, the
    dispatch (`_execute`: enqueue, returns before the device finishes) and the commit of the previous step
    (which waits for its results: with pipelining, the device's step time shows up there). Wraps the
    engine's methods on this instance only (benchmark instrumentation; the engine is not changed), plus
    the program each step ran (its StepKey's token and row capacities)."""

    PHASES = ("schedule", "build", "execute", "wait", "commit")

    def __init__(self, eng: Engine):
        self.rows: list[dict] = []
        self._cur: dict = {}
        # Optional: a value recorded with each step call (the stall sets the long prompt's progress, so the
        # steps can be told apart by prefix: `by_mark`).
        self.mark: Callable[[], int] | None = None
        self._wrapped: list[tuple[object, str]] = []
        self._wrap(eng.sched, "schedule", "schedule")
        self._wrap(eng, "_execute", "execute")
        self._wrap(eng, "_commit", "commit")
        self._wait_before_commit(eng)
        self._wrap_build()

    def _wait_before_commit(self, eng: Engine) -> None:
        """Split the commit: "wait" is the block on the step's outputs (the device finishing it), "commit"
        the host work after (unpacking, the rows' bookkeeping, page registration)."""
        timed_commit = eng._commit

        def commit(inflight, *a, **k):
            t0 = time.perf_counter()
            jax.block_until_ready(inflight[2][0])  # the step's int outputs (what _commit reads first)
            self._cur["wait"] = self._cur.get("wait", 0.0) + time.perf_counter() - t0
            return timed_commit(inflight, *a, **k)
        eng._commit = commit

    def _timed(self, fn, phase: str):
        @functools.wraps(fn)
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._cur[phase] = self._cur.get(phase, 0.0) + time.perf_counter() - t0
        return run

    def _wrap(self, obj, name: str, phase: str) -> None:
        setattr(obj, name, self._timed(getattr(obj, name), phase))
        self._wrapped.append((obj, name))

    def _wrap_build(self) -> None:
        # core.py calls `step.build` through the module: patched for the trace's life (close() restores).
        from dsv3_jax.engine import step as step_mod
        self._step_mod, self._build = step_mod, step_mod.build
        timed = self._timed(step_mod.build, "build")
        def build(*a, **k):
            b = timed(*a, **k)
            self._cur["program"] = f"{b.key.tokens}/{b.key.rows}"
            return b
        step_mod.build = build

    def close(self) -> None:
        """Restore the engine (its instance attributes shadow the class's methods) and `step.build`."""
        self._step_mod.build = self._build
        for obj, name in self._wrapped:
            obj.__dict__.pop(name, None)

    def begin(self) -> None:
        self._cur = {"t0": time.perf_counter()}
        if self.mark is not None:  # read before the step (the stall: the prefix this step's chunk starts at)
            self._cur["mark"] = self.mark()

    def end(self, eng: Engine) -> None:
        c = self._cur
        c["wall"] = time.perf_counter() - c.pop("t0")
        c["clock"] = eng.clock()
        self.rows.append(c)

    def by_mark(self, bucket: int, exclude: tuple[float, float] | None = None) -> list[dict]:
        """Step calls grouped by their mark in buckets of `bucket` (rows without a mark left out): per
        bucket its first mark, the calls, and the p50 wall and wait (ms). For the stall, by prefix: a cost
        that appears only past some prefix (or decoder context) shows as a step in this list, where the
        whole run's p50 hides it (as the long-row rule's did, 2026-12-06)."""
        groups: dict[int, list[dict]] = {}
        for r in self.rows:
            if "mark" in r and not (exclude and exclude[0] < r["clock"] <= exclude[1]):
                groups.setdefault(r["mark"] // bucket, []).append(r)
        return [{"from": k * bucket, "calls": len(v),
                 "wall_p50_ms": float(np.median([1e3 * r["wall"] for r in v])),
                 "wait_p50_ms": float(np.median([1e3 * r.get("wait", 0.0) for r in v]))}
                for k, v in sorted(groups.items())]

    def summary(self, a: float, b: float, exclude: tuple[float, float] | None = None) -> dict:
        """Medians (ms) of each phase and the wall over the step calls that ended in (a, b] (and not in
        `exclude`'s window), and the programs they ran (count per token/row capacity)."""
        rows = [r for r in self.rows if a < r["clock"] <= b
                and not (exclude and exclude[0] < r["clock"] <= exclude[1])]
        if not rows:
            return {"calls": 0}
        out: dict = {"calls": len(rows)}
        for ph in (*self.PHASES, "wall"):
            v = [1e3 * r.get(ph, 0.0) for r in rows]
            out[f"{ph}_ms"] = {"p50": float(np.median(v)), "p90": float(np.percentile(v, 90)),
                               "mean": float(np.mean(v))}
        progs: dict[str, int] = {}
        for r in rows:
            progs[r.get("program", "none")] = progs.get(r.get("program", "none"), 0) + 1
        out["programs"] = progs
        return out


def busy_and_gaps(events: list[tuple[int, int, str]], min_gap_ns: int = 500_000
                   ) -> tuple[int, list[tuple[float, str, str]]]:
    """Kernel intervals (start_ns, end_ns, name), sorted by start -> the busy time (their union, ns) and the
    idle gaps longer than `min_gap_ns` as (ms, the kernel before, the kernel after): where the device
    waited, and between what."""
    busy, gaps = 0, []
    end, last = events[0][0], events[0][2]
    for s, e, n in events:
        if s - end > min_gap_ns:
            gaps.append(((s - end) / 1e6, last[:50], n[:50]))
        if e > end:
            busy += e - max(s, end)
            end, last = e, n
    return busy, gaps


def gpu_busy(trace_dir: str) -> dict:
    """From a `jax.profiler` trace: the GPU's busy time (union of kernel intervals on its stream lines),
    the span from the first kernel's start to the last's end, and the top kernels by total time. Busy
    well below the span means the device waited for the host."""
    import glob
    import os

    from jax.profiler import ProfileData

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {"error": "no trace written"}
    events = []
    for plane in ProfileData.from_file(paths[0]).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
    if not events:
        return {"error": "no GPU kernels in the trace"}
    events.sort()
    busy, gaps = busy_and_gaps(events)
    per: dict[str, float] = {}
    for s, e, n in events:
        per[n[:60]] = per.get(n[:60], 0.0) + (e - s) / 1e6
    top = sorted(per.items(), key=lambda kv: -kv[1])[:8]
    span = max(e for _, e, _ in events) - events[0][0]
    return {"busy_ms": busy / 1e6, "span_ms": span / 1e6, "busy_share": busy / span if span else None,
            "kernels": len(events), "top_kernels_ms": dict(top), "idle_gaps_over_0.5ms": len(gaps),
            "idle_gaps_ms": sum(g for g, _, _ in gaps),
            "largest_gaps": [{"ms": g, "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:6]]}


def sec_long(args, res: dict, eng: Engine, cfg, params, rng, left, length: int) -> None:
    rows = res.setdefault("long", [])
    # The TTFT grows ~quadratically: skip a length the last one says will not fit the time left.
    if rows and "ttft_s" in rows[-1]:
        est = rows[-1]["ttft_s"] * (length / rows[-1]["prompt"]) ** 2 * 1.2
        if est > left() - 10:
            res["skipped"].append(f"long {length} (estimated {est:.0f} s, {left():.0f} s left)")
            return
    body, attn = prefill_flops(cfg, length)
    _, attn_naive = prefill_flops(cfg, length, width=NAIVE)
    floor = body / res["fp8_flops"] + attn / res["bf16_flops"]
    row = {"prompt": length, "new": args.new, "compute_floor_s": floor,
           "body_tflop": body / 1e12, "attention_tflop": attn / 1e12, "attention_tflop_naive": attn_naive / 1e12,
           "compute_floor_naive_attention_s": body / res["fp8_flops"] + attn_naive / res["bf16_flops"]}
    c0, steps0 = eng.stats["compiles"], eng.stats["steps"]
    long0 = eng.stats.get("long_prefill_steps", 0)
    try:
        rid = eng.add_request(rng.integers(2, cfg.vocab_size, length).tolist(), max_new_tokens=args.new)
        drive(eng, lambda: not eng.has_work())
        r = eng.finished[rid]
        gaps = np.diff(r.token_times)
        itl = float(np.median(gaps))
        hbm = e2e_bench.step_bytes(cfg, params, 1, length) / res["copy_bw"]
        row.update(ttft_s=r.first_token_at - r.arrival, steps=eng.stats["steps"] - steps0,
                   itl_ms=1e3 * itl, itl_min_ms=1e3 * float(gaps.min()), itl_max_ms=1e3 * float(gaps.max()),
                   hbm_floor_ms=1e3 * hbm, compiles_during=eng.stats["compiles"] - c0)
        row["ttft_over_floor"] = row["ttft_s"] / floor
        row["prefill_share_of_floor"] = floor / row["ttft_s"]
        row["prefill_share_of_naive_floor"] = row["compute_floor_naive_attention_s"] / row["ttft_s"]
        row["long_prefill_steps"] = eng.stats.get("long_prefill_steps", 0) - long0
        row["itl_over_floor"] = itl / hbm
    except Exception as e:  # noqa: BLE001 - record and keep measuring
        row["error"] = repr(e)[:400]
    rows.append(row)
    print("long", row, flush=True)


def sec_stall(args, res: dict, eng: Engine, cfg, rng, left) -> None:
    # The long prompt's time beside decoders: ~2x its time alone (the cap's trade), estimated from the
    # longest prompt measured alone (TTFT ~ length^2); halve the long prompt while that does not fit.
    alone = {r["prompt"]: r["ttft_s"] for r in res.get("long", []) if "ttft_s" in r}
    ref = max(alone, default=None)
    while ref and alone[ref] * (args.stall_len / ref) ** 2 * 2.5 > left() - 30 and args.stall_len > ref:
        res["skipped"].append(f"stall at {args.stall_len:,} (estimated {alone[ref] * (args.stall_len / ref) ** 2 * 2.5:.0f}"
                              f" s, {left():.0f} s left): halved")
        args.stall_len //= 2
    out: dict = {"decoders": args.decoders, "decode_ctx": args.decode_ctx, "long_prompt": args.stall_len,
                 "prefill_attention_pairs": eng.cfg.prefill_attention_pairs, "chunk_size": eng.cfg.chunk_size,
                 "max_batched_tokens": eng.cfg.max_batched_tokens}
    c0 = eng.stats["compiles"]
    rids = [eng.add_request(rng.integers(2, cfg.vocab_size, args.decode_ctx).tolist(),
                            max_new_tokens=args.decoder_new) for _ in range(args.decoders)]
    def reqs() -> list:
        live = {r.rid: r for r in (*eng.waiting, *eng.running)}
        return [eng.finished.get(i) or live[i] for i in rids]

    drive(eng, lambda: all(len(r.output) >= 4 for r in reqs()))  # prefilled, decoding
    trace = StepTrace(eng)
    t_base = eng.clock()
    drive(eng, lambda: eng.clock() - t_base > args.baseline_s, trace=trace)
    t_arrive = eng.clock()
    long_rid = eng.add_request(rng.integers(2, cfg.vocab_size, args.stall_len).tolist(), max_new_tokens=1)
    steps: list = []
    done = lambda: long_rid in eng.finished or any(len(r.output) >= r.max_new_tokens for r in reqs())  # noqa: E731
    long_req = next(r for r in eng.waiting if r.rid == long_rid)
    trace.mark = lambda: long_req.computed  # the long prompt's progress at each step (its prefix)
    # Drive to the middle of the long prompt, profile --stall-profile-steps steps of the device there (is
    # it busy, or waiting for the host?), then drive to the end.
    drive(eng, lambda: done() or long_req.computed >= args.stall_len // 2, steps, trace)
    profiled = None  # the profiler's window: its steps are slower (tracing), left out of the ITL figures
    # GPU only: the CPU has no device plane to read, and XLA:CPU programs loaded from the persistent
    # cache fail to run under the profiler (NOT_FOUND: a fusion's function), seen 2026-12-06.
    if args.stall_profile_steps and not done() and jax.default_backend() == "gpu":
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            t_p0 = eng.clock()
            jax.profiler.start_trace(d)
            n0 = len(steps)
            drive(eng, lambda: done() or len(steps) - n0 >= args.stall_profile_steps, steps, trace)
            jax.effects_barrier()
            jax.profiler.stop_trace()
            profiled = (t_p0, eng.clock())
            out["profile_mid_prefill"] = {"steps": len(steps) - n0, "wall_ms": 1e3 * (eng.clock() - t_p0),
                                          "prefix_at_start": args.stall_len // 2, **gpu_busy(d)}
    drive(eng, done, steps, trace)
    t_done = eng.clock()
    trace.mark = None
    ok = long_rid in eng.finished
    # Decoding alone again after the long prompt: the decoders' contexts grew by as many tokens as steps ran
    # (~8.8K in the 128K run), so this, not the 4K "before", is the same-context reference for the steps
    # during.
    drive(eng, lambda: not ok or eng.clock() - t_done > args.baseline_s
          or any(len(r.output) >= r.max_new_tokens for r in reqs()), trace=trace)
    t_after = eng.clock()
    trace.close()

    times = [r.token_times for r in reqs()]
    base, during = itl_gaps(times, t_base, t_arrive), itl_gaps(times, t_arrive, t_done, profiled)
    out["profiled_gaps_left_out"] = len(itl_gaps(times, t_arrive, t_done)) - len(during)
    lr = eng.finished.get(long_rid)
    out.update(long_finished=ok, long_ttft_s=(lr.first_token_at - lr.arrival) if ok else None,
               long_ttft_alone_s=alone.get(args.stall_len), baseline_gaps=len(base), during_gaps=len(during),
               itl_p50_before_ms=1e3 * pct(base, 50), itl_p99_before_ms=1e3 * pct(base, 99),
               itl_p50_during_ms=1e3 * pct(during, 50), itl_p99_during_ms=1e3 * pct(during, 99),
               itl_max_during_ms=1e3 * float(during.max()), compiles_during=eng.stats["compiles"] - c0,
               decoder_ctx_at_end=args.decode_ctx + max(len(r.output) for r in reqs()))
    out["p99_during_over_p50_before"] = out["itl_p99_during_ms"] / out["itl_p50_before_ms"]
    after = itl_gaps(times, t_done, t_after)
    if len(after):
        out.update(after_gaps=len(after), itl_p50_after_ms=1e3 * pct(after, 50),
                   p99_during_over_p50_after=out["itl_p99_during_ms"] / (1e3 * pct(after, 50)),
                   decoder_ctx_after=args.decode_ctx + max(len(r.output) for r in reqs()))
    # The long prompt's chunk in each step that carried it (every other row decodes one token).
    chunks = [t - (r - 1) for _, t, r in steps if r > args.decoders]
    out["steps_during"] = len(steps)
    out["step_phases_before"] = trace.summary(t_base, t_arrive)
    out["step_phases_during"] = trace.summary(t_arrive, t_done, profiled)
    out["step_phases_after"] = trace.summary(t_done, t_after)
    out["step_wall_by_prefix"] = trace.by_mark(max(args.stall_len // 8, 1), profiled)
    out["long_chunk_tokens"] = {"first": chunks[0], "median": float(np.median(chunks)), "last": chunks[-1],
                                "steps": len(chunks)} if chunks else None
    for i in rids:
        eng.cancel(i)
    res["stall"] = out
    print("stall", out, flush=True)


# ------------------------------------------------------------------------------------------ stallparts
def parse_cases(spec: str) -> list[tuple[int, int]]:
    """--parts-cases "C@P,..." -> [(chunk tokens C, prefix P)]."""
    out = []
    for item in (x for x in spec.split(",") if x.strip()):
        c, p = item.split("@")
        out.append((int(c), int(p)))
    return out


def stallparts_rows(a, vocab: int) -> dict[str, list[step.RowPlan]]:
    """The rows of each step of the parts, as the scheduler hands them to `step.build`: "decode" is
    a.decoders decode rows (1 token at position a.decode_ctx, pipelined: the input token is the one the
    previous step sampled, read on device from the row's slot); "C@P" is those rows, then (decode rows
    first, as the scheduler orders them) one prefill row of C prompt tokens at positions P .. P + C - 1
    that is not the prompt's last chunk. Decoder i owns the pages 1 + i*n .. (i+1)*n, the long row the
    run after them, each as many as the engine would have allocated (the pages up to its last token)."""
    rng = np.random.default_rng(7)
    ps = kv_cache.PAGE_SIZE
    per = kv_cache.pages_for(a.decode_ctx + 1, ps)
    cases = parse_cases(a.parts_cases)
    base = 1 + a.decoders * per
    long_pages = list(range(base, base + kv_cache.pages_for(max((p + c for c, p in cases), default=1), ps)))

    def plan(rid: int, start: int, n: int, pages: list[int], **kw) -> step.RowPlan:
        return step.RowPlan(rid=rid, slot=rid, start=start, n=n, ndraft=0, pages=pages, temperature=0.0,
                            top_p=1.0, top_k=0, seed=0, **kw)

    dec = [plan(i, a.decode_ctx, 1, list(range(1 + i * per, 1 + (i + 1) * per)), tokens=[], pending_last=True,
                final=True, hint=0, counter=16, prompt_len=a.decode_ctx - 16) for i in range(a.decoders)]
    out = {"decode": dec}
    for c, p in cases:
        toks = rng.integers(2, vocab, c + 1).tolist()
        out[f"{c}@{p}"] = dec + [plan(a.decoders, p, c, long_pages[:kv_cache.pages_for(p + c, ps)],
                                      tokens=toks[:c], pending_last=False, final=False, hint=toks[c],
                                      counter=0, prompt_len=p + c + 1)]
    return out


def engine_attention(stack: dict, tok_table: jax.Array, positions: jax.Array, valid: jax.Array,
                     q_lat: jax.Array, q_pe: jax.Array, layer: jax.Array, *, softmax_scale: float,
                     backend: str) -> jax.Array:
    """One layer's MLA attention exactly as the engine's ragged step issues it (model/attention.py, the
    absorbed form over the paged cache, one batch shard): every flat token is a kernel row (B = N, T = 1)
    with its row's page table (`tok_table` [N, W] = step.py's table[row_of], built once per step, so not
    here), start = its position, chunk_lens = valid (padding tokens: 0), q [N, 1, H, 512 | 64] in the
    compute dtype, over layer `layer` of a scanned stack's pool through `layer_view` (the flat pages,
    the table's ids offset by layer x pages), through `kernel_dispatch.mla_attention`. Returns the
    latent output before W_uv."""
    meta = PageMeta(tok_table, valid)
    flat = {}
    for name in absorbed_leaves(stack):
        flat[name], lmeta = layer_view(stack[name], meta, layer)
    out, _ = kernel_dispatch.mla_attention(q_lat, q_pe.astype(q_lat.dtype), absorbed_pages(flat),
                                           lmeta.block_table, positions, lmeta.chunk_lens,
                                           softmax_scale=softmax_scale, backend=backend)
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _fill_random(cache: dict, pages: jax.Array, key: jax.Array) -> dict:
    """Random values in `pages` of every cache leaf (every layer): what the attention reads is not zeros
    (tensor-core power, and so the clock, depends on the data)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(cache)
    out = []
    for i, (path, x) in enumerate(leaves):
        stacked = getattr(path[0], "key", None) in layout.STACKS
        shape = (x.shape[0], pages.shape[0], *x.shape[2:]) if stacked else (pages.shape[0], *x.shape[1:])
        v = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.5
        v = (jnp.abs(v) if x.dtype == jnp.float32 else v).astype(x.dtype)  # FP8 scales stay positive
        out.append(x.at[:, pages].set(v) if stacked else x.at[pages].set(v))
    return jax.tree_util.tree_unflatten(tree, out)


def _gpu_time(fn, args: tuple, calls: int) -> dict:
    """benchmarks/device_time on a GPU; {} elsewhere (the CPU trace has no device plane)."""
    if jax.default_backend() != "gpu":
        return {}
    from device_time import jax_device_time

    try:
        d = jax_device_time(fn, args, calls=calls)
    except Exception as e:  # noqa: BLE001 - keep the host-clock figures
        return {"gpu_error": repr(e)[:300]}
    return {"gpu_ms": d["median_ms"], "gpu_min_ms": d["min_ms"], "gpu_max_ms": d["max_ms"],
            "kernel_totals": d["kernel_totals"]}


def _kernel_deltas(base: dict, other: dict, n: int = 10) -> list[dict]:
    """The kernels whose GPU time per step differs most between two step measurements (by name; note
    that Mosaic GPU names every Pallas kernel alike: MLA, FP8 GEMMs and grouped GEMMs share one name)."""
    kb, ko = base.get("kernel_totals", {}), other.get("kernel_totals", {})
    rows = [{"name": k, "ms_base": kb.get(k, {}).get("ms_per_call", 0.0), "ms": ko.get(k, {}).get("ms_per_call", 0.0),
             "launches_base": kb.get(k, {}).get("launches_per_call", 0.0),
             "launches": ko.get(k, {}).get("launches_per_call", 0.0)} for k in sorted({*kb, *ko})]
    for r in rows:
        r["delta_ms"] = r["ms"] - r["ms_base"]
    return sorted(rows, key=lambda r: -abs(r["delta_ms"]))[:n]


def sec_stallparts(args, res: dict, eng: Engine, cfg, left) -> None:
    """The parts of one step of (b) (module docstring): per case the attention call alone (per layer) and
    the whole step program, GPU time and host clock."""
    t0 = time.perf_counter()
    ex = eng.executor
    rows = stallparts_rows(args, cfg.vocab_size)
    batches = {name: step.build(r, spec_k=eng.cfg.spec_k, shapes=eng.shapes, width=eng.width, logprobs=False,
                                num_shards=batch_shards(eng.handle), scratch_slot=eng.cfg.max_batch,
                                mask_words=eng.mask_words) for name, r in rows.items()}
    keys = sorted({b.key for b in batches.values()})
    # The engine's own compile path (both programs on parallel threads; nothing if a warmup did it).
    compile_s = ex.warmup(keys)
    pages = sorted({p for r in rows.values() for row in r for p in row.pages})
    if pages[-1] >= eng.cfg.num_pages:
        raise ValueError(f"the parts need pages up to {pages[-1]} but the pool has {eng.cfg.num_pages}: "
                         f"shorter --parts-cases prefixes or a longer --lengths")
    ex.cache = _fill_random(ex.cache, jnp.asarray(pages, jnp.int32), jax.random.key(3))
    stack_name = layout.MOE_LAYERS if layout.MOE_LAYERS in ex.cache else layout.DENSE_LAYERS
    layer = jnp.int32(min(1, ex.cache[stack_name][absorbed_leaves(ex.cache[stack_name])[0]].shape[0] - 1))
    backend = eng.handle.model.trace_options.kernels
    attend = jax.jit(functools.partial(engine_attention, softmax_scale=cfg.softmax_scale, backend=backend))
    dt = jnp.dtype(cfg.dtype)
    h, r_lat, r_rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out: dict = {"layers": cfg.num_hidden_layers, "heads": h, "kernels": backend, "decoders": args.decoders,
                 "decode_ctx": args.decode_ctx, "page_table_width": eng.width,
                 "prefill_attention_pairs": eng.cfg.prefill_attention_pairs,
                 "attention_layer": f"{stack_name}[{int(layer)}]",
                 "programs": [list(k[:2]) for k in keys], "compile_s": compile_s, "cases": []}
    res["stallparts"] = out
    base = None
    for name, sb in batches.items():
        if left() < 10:
            res["skipped"].append(f"stallparts {name}")
            continue
        v = {f: sb.view(f) for f in ("table", "row_of", "positions", "valid")}
        n = sb.key.tokens
        k1, k2 = jax.random.split(jax.random.key(n))
        q_lat = jax.random.normal(k1, (n, 1, h, r_lat), dt)
        q_pe = jax.random.normal(k2, (n, 1, h, r_rope), dt)
        att_args = (ex.cache[stack_name], jnp.asarray(v["table"][v["row_of"]]), jnp.asarray(v["positions"]),
                    jnp.asarray(v["valid"]), q_lat, q_pe, layer)
        row: dict = {"case": name, "rows": len(sb.rows), "tokens": sb.n_scheduled,
                     "program": [sb.key.tokens, sb.key.rows]}
        if name != "decode":
            c, p = parse_cases(name)[0]
            row.update(chunk=c, prefix=p, chunk_pairs=attention_pairs(p, c),
                       cap_chunk_at_prefix=chunk_tokens_within(p, eng.cfg.prefill_attention_pairs))
        try:
            att = {**e2e_bench.timeit(functools.partial(attend, *att_args), args.reps),
                   **_gpu_time(attend, att_args, args.parts_calls)}
            att.pop("kernel_totals", None)
            row["attention"] = att
        except Exception as e:  # noqa: BLE001 - record and keep measuring
            row["attention_error"] = repr(e)[:400]
        del att_args  # holds the cache the step below donates
        ints, floats = jnp.asarray(sb.ints), jnp.asarray(sb.floats)  # on device once: no copy in the loop
        call = functools.partial(ex.execute, sb.key, ints, floats)  # the engine's dispatch of this step
        try:
            row["step"] = {**e2e_bench.timeit(call, args.reps), **_gpu_time(call, (), args.parts_calls)}
        except Exception as e:  # noqa: BLE001 - record and keep measuring
            row["step_error"] = repr(e)[:400]
        if name == "decode":
            base = row
        elif base is not None and "step" in row and "step" in base:
            row["top_kernel_deltas"] = _kernel_deltas(base["step"], row["step"])
            # Added over the decode-only step: the whole step, and the attention call x layers.
            for clock in ("gpu_ms", "median_ms"):
                a, a0 = row.get("attention", {}).get(clock), base.get("attention", {}).get(clock)
                st, st0 = row["step"].get(clock), base["step"].get(clock)
                if None not in (a, a0, st, st0):
                    row[f"added_{clock}"] = {"step": st - st0, "attention_x_layers": (a - a0) * cfg.num_hidden_layers}
        out["cases"].append(row)
        print("stallparts", name, {part: {k: x for k, x in row.get(part, {}).items() if k != "kernel_totals"}
                                   for part in ("attention", "step")}, flush=True)
    for row in out["cases"]:
        row.get("step", {}).pop("kernel_totals", None)
    out["s"] = time.perf_counter() - t0


def seed_prefix(eng: Engine, tokens: list[int], n_tokens: int) -> None:
    """Publish the first `n_tokens` (whole pages) of `tokens` in the engine's prefix cache, on pages that
    hold whatever they hold: a request with this prompt is then admitted with them computed (a benchmark
    shortcut to a long request's midpoint without its prefill; the values are not these tokens')."""
    ps = eng.pool.page_size
    pages = eng.pool.allocate(n_tokens // ps)
    eng.pool.register(tokens[:len(pages) * ps], pages)
    eng.pool.release(pages)  # idle and cached: taken back by the admission's match_prefix


def sec_stallloop(args, res: dict, eng: Engine, cfg, left) -> None:
    """The engine loop itself at one stallparts case: the decoders and the long request are admitted from
    the prefix cache (`seed_prefix`) at --decode-ctx and at the case's prefix P, then `Engine.step()` runs
    --parts-engine-steps times without and with the long request (its chunks as the scheduler sizes them),
    each call's phases timed (StepTrace). Beside stallparts' step program for the same rows, this says
    whether a step of (b) costs its program's time or more (host, pipeline, transfers)."""
    cases = [(c, p) for c, p in parse_cases(args.parts_cases) if p > args.decode_ctx]
    if not cases or args.parts_engine_steps <= 0:
        return
    _, prefix = cases[0]
    prefix -= prefix % eng.pool.page_size
    rng = np.random.default_rng(11)
    vocab, n = cfg.vocab_size, args.parts_engine_steps
    prompts = [rng.integers(2, vocab, args.decode_ctx + 1).tolist() for _ in range(args.decoders)]
    for pr in prompts:
        seed_prefix(eng, pr, args.decode_ctx)
    c0 = eng.stats["compiles"]
    rids = [eng.add_request(pr, max_new_tokens=2 * n + 16) for pr in prompts]
    live = lambda: [r for r in eng.running if r.rid in rids]  # noqa: E731
    drive(eng, lambda: len(live()) == len(rids) and all(len(r.output) >= 2 for r in live()))
    trace = StepTrace(eng)
    try:
        steps0: list = []
        t0 = eng.clock()
        drive(eng, lambda: len(steps0) >= n, steps0, trace)
        t1 = eng.clock()
        cap = chunk_tokens_within(prefix, eng.cfg.prefill_attention_pairs)
        long_prompt = rng.integers(2, vocab, prefix + cap * (n + 8) + 1).tolist()
        seed_prefix(eng, long_prompt, prefix)
        long_rid = eng.add_request(long_prompt, max_new_tokens=1)
        steps1: list = []
        drive(eng, lambda: len(steps1) >= n + 1 or long_rid in eng.finished, steps1, trace)
        t2 = eng.clock()
        profile = None
        if jax.default_backend() == "gpu" and args.stall_profile_steps and long_rid not in eng.finished:
            # The device's view of the same loop: busy per step, and the idle gaps between kernels.
            import tempfile

            with tempfile.TemporaryDirectory() as d:
                steps2: list = []
                t3 = eng.clock()
                jax.profiler.start_trace(d)
                drive(eng, lambda: len(steps2) >= min(8, args.stall_profile_steps) or long_rid in eng.finished,
                      steps2)
                jax.effects_barrier()
                jax.profiler.stop_trace()
                profile = {"steps": len(steps2), "wall_ms": 1e3 * (eng.clock() - t3), **gpu_busy(d)}
    finally:
        trace.close()
    long_req = next((r for r in eng.running if r.rid == long_rid), None)
    out = {"prefix": prefix, "decoders": args.decoders, "steps": n, "cap_chunk_at_prefix": cap,
           "long_cached_tokens": long_req.cached_tokens if long_req else None,
           "long_computed_at_end": long_req.computed if long_req else None,
           "chunk_tokens": [t - (r - 1) for _, t, r in steps1 if r > args.decoders],
           "compiles_during": eng.stats["compiles"] - c0,
           "decode_only": trace.summary(t0, t1), "with_long": trace.summary(t1, t2),
           "profile_with_long": profile}
    for rid in [*rids, long_rid]:
        eng.cancel(rid)
    res["stallloop"] = out
    print("stallloop", out, flush=True)


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with --tiny's toy sizes applied."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU run at toy sizes (tests/test_long_context.py)")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--lengths", default="32768,65536,131072,163808", help="(a) prompt lengths, in order")
    ap.add_argument("--new", type=int, default=32, help="(a) tokens decoded after each long prompt")
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=4096)
    ap.add_argument("--decoder-new", type=int, default=12000, help="(b) budget of each decoder")
    ap.add_argument("--stall-len", type=int, default=131072)
    ap.add_argument("--stall-profile-steps", type=int, default=16,
                    help="(b) steps profiled on the device at the long prompt's midpoint (0: none)")
    ap.add_argument("--baseline-s", type=float, default=2.0, help="(b) decoding alone measured this long")
    ap.add_argument("--kernel-prefix", type=int, default=131072)
    ap.add_argument("--kernel-chunks", default="512,1024,2048,4096")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--prefill-attention-pairs", type=int, default=EngineConfig.prefill_attention_pairs)
    ap.add_argument("--long-prefill-from", type=int, default=EngineConfig.long_prefill_from,
                    help="EngineConfig.long_prefill_from: a lone chunk past this prefix attends in naive form (0: off)")
    ap.add_argument("--token-buckets", default="512",
                    help="mixed-step token capacities below --max-batched-tokens (a capped step with decode rows "
                         "runs the smallest that holds it: 128 keeps a 32-decoder + ~20-token step small)")
    ap.add_argument("--parts-cases", default="22@131072,15@131072,8@131072,1@131072,22@4096",
                    help="stallparts: mixed steps, each the decoders + one chunk of C tokens at prefix P (C@P): "
                         "22 is (b)'s median chunk under the default cap, 15 the cap's chunk at 128K, 8 about "
                         "the chunk under half the cap; 1 and a short prefix separate the step's shape from the "
                         "long prefix")
    ap.add_argument("--parts-calls", type=int, default=20, help="stallparts: calls per GPU-time trace")
    ap.add_argument("--parts-engine-steps", type=int, default=48,
                    help="stallparts: Engine.step() calls timed at the first case with a prefix past --decode-ctx, "
                         "without and with the long request (0: none)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=285.0, help="skip what no longer fits after this")
    ap.add_argument("--tasks", default="kernel,long,stall", help="kernel, long, stall, stallparts (comma-separated)")
    ap.add_argument("--out", type=Path, default=Path("long_context.json"))
    a = ap.parse_args(argv)
    if a.tiny:  # toy sizes for the CPU test, same code paths (the jnp reference instead of Pallas)
        a.lengths, a.new, a.decoders, a.decode_ctx, a.decoder_new = "256,512", 4, 2, 64, 400
        a.stall_len, a.baseline_s, a.kernel_prefix, a.kernel_chunks, a.heads = 384, 0.2, 256, "32,64", 16
        a.chunk_size, a.max_batched_tokens, a.reps, a.budget_s, a.moe_layers = 128, 128, 1, 1e9, 1
        a.prefill_attention_pairs = min(a.prefill_attention_pairs, 4096)
        a.parts_cases = "22@384,1@384,22@64"
    a.kernel_chunks = [int(c) for c in str(a.kernel_chunks).split(",")]
    return a


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The one engine configuration of every section: a pool for the decoders' whole budgets and two of the
    longest prompt, room for 8 more rows than the decoders, the chunking and buckets of the command line."""
    ps = kv_cache.PAGE_SIZE
    longest = max([int(x) for x in a.lengths.split(",")] + [a.stall_len]) + a.new
    pages = (a.decoders * -(-(a.decode_ctx + a.decoder_new) // ps) + 2 * -(-longest // ps) + 8)
    return EngineConfig(num_pages=pages, max_batch=a.decoders + 8, max_batched_tokens=a.max_batched_tokens,
                        chunk_size=a.chunk_size, prefill_attention_pairs=a.prefill_attention_pairs,
                        long_prefill_from=a.long_prefill_from,
                        row_buckets=(a.decoders + 8,) if a.tiny else (1,),
                        token_buckets=() if a.tiny else tuple(int(t) for t in a.token_buckets.split(",") if t))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    left = lambda: a.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    tasks = set(a.tasks.split(","))
    # stallparts alone needs neither the ceilings nor every program compiled (it compiles its own two).
    full_engine = bool(tasks & {"long", "stall"}) or "stallparts" not in tasks
    res: dict = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
                 "command": " ".join(sys.argv), "skipped": []}

    def save() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1, default=str))

    if "kernel" in tasks:
        sec_kernel(a, res, left)
        save()
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = e2e_bench.slice_config(a.moe_layers, a.tiny)
    if a.tiny:
        cfg = cfg.replace(max_position_embeddings=1024)
    model, params = e2e_bench.random_fp8_params(cfg)
    res["config"] = {"layers": cfg.num_hidden_layers, "moe_layers": cfg.n_moe_layers,
                     "context": cfg.max_position_embeddings, "weights": "fp8",
                     "weight_gb": sum(x.nbytes for x in jax.tree_util.tree_leaves(params)) / 1e9}
    if full_engine:
        # Ceilings measured here (the DESIGN's figures stand in on CPU, where they mean nothing).
        res["copy_bw"] = 4.11e12 if a.tiny else e2e_bench.copy_bandwidth()
        res["fp8_flops"] = 1285e12 if a.tiny else e2e_bench.fp8_rate()
        res["bf16_flops"] = 743e12 if a.tiny else e2e_bench.bf16_rate()
    handle = ModelHandle(cfg, params)
    ecfg = engine_config(a)
    eng = Engine(handle, ecfg)
    res["engine_config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ecfg.__dict__.items()}
    if full_engine:
        res["warmup"] = timed_warmup_greedy(eng)
    save()
    if "stallparts" in tasks:
        if left() < 30:
            res["skipped"].append("stallparts")
        else:
            try:
                sec_stallparts(a, res, eng, cfg, left)
            except Exception as e:  # noqa: BLE001 - record it
                res["stallparts_error"] = repr(e)[:400]
            try:
                sec_stallloop(a, res, eng, cfg, left)
            except Exception as e:  # noqa: BLE001 - record it
                res["stallloop_error"] = repr(e)[:400]
        save()
    rng = np.random.default_rng(0)
    # (a) below the stall's long prompt first (their TTFTs size what fits), then (b), then the rest of (a).
    first = [n for n in lengths if n < a.stall_len]
    if "long" in tasks:
        for length in first:
            if left() < 20:
                res["skipped"].append(f"long {length}")
                continue
            sec_long(a, res, eng, cfg, params, rng, left, length)
            save()
    if "stall" in tasks:
        if left() < 40:
            res["skipped"].append("stall")
        else:
            try:
                sec_stall(a, res, eng, cfg, rng, left)
            except Exception as e:  # noqa: BLE001 - record it
                res["stall_error"] = repr(e)[:400]
        save()
    if "long" in tasks:
        for length in [n for n in lengths if n not in first]:
            if left() < 20:
                res["skipped"].append(f"long {length}")
                continue
            sec_long(a, res, eng, cfg, params, rng, left, length)
            save()
    res["total_s"] = time.perf_counter() - t_start
    res["engine_stats"] = eng.engine_stats()
    save()
    report(res)
    return 0


def timed_warmup_greedy(eng: Engine) -> dict:
    """engine_bench.timed_warmup restricted to the greedy programs (every request here is greedy)."""
    real = eng.warmup
    eng.warmup = lambda progress=None: real(modes=("greedy",), progress=progress)  # type: ignore[method-assign]
    try:
        return timed_warmup(eng)
    finally:
        del eng.warmup


def report(res: dict) -> None:
    if "warmup" in res:
        print(f"\ndevice {res['device']}  copy {res['copy_bw'] / 1e9:.0f} GB/s  fp8 {res['fp8_flops'] / 1e12:.0f} / "
              f"bf16 {res['bf16_flops'] / 1e12:.0f} TFLOP/s  warmup {res['warmup']['s']:.0f} s "
              f"({res['warmup']['compiles']} programs)  total {res['total_s']:.0f} s")
    else:  # stallparts alone: no ceilings measured, no full warmup
        print(f"\ndevice {res['device']}  total {res['total_s']:.0f} s")
    for k in res.get("kernel", []):
        o, t = k.get("ours", {}), k.get("torch_sdpa_naive", {})
        print(f"(c) chunk {k['chunk']:>5} over {k['prefix']:,}: ours {o.get('median_ms', float('nan')):8.2f} ms "
              f"{o.get('tflops', float('nan')):6.1f} TF/s | torch SDPA naive {t.get('median_ms', float('nan')):8.2f} ms "
              f"{t.get('tflops', float('nan')):6.1f} TF/s | ours/torch time {k.get('time_ours_over_torch', float('nan')):.2f}"
              + (f"  {k.get('ours_error', '')}{k.get('torch_error', '')}"[:120] if "ours" not in k or not t else ""))
        nv = k.get("ours_naive")
        if nv:
            print(f"    ours, naive form (long_prefill): {nv['median_ms']:8.2f} ms {nv['tflops']:6.1f} TF/s (naive FLOPs) "
                  f"| naive/torch time {k.get('time_naive_over_torch', float('nan')):.2f}")
        elif "ours_naive_error" in k:
            print(f"    ours, naive form: error {k['ours_naive_error'][:150]}")
    if "long" in res or "warmup" in res:
        print(f"{'(a) prompt':>10} {'TTFT s':>8} {'floor s':>8} {'share':>6} {'ITL ms':>7} {'floor':>6} {'ratio':>6} "
              f"{'compiles':>8}")
    for r in res.get("long", []):
        if "error" in r:
            print(f"{r['prompt']:>10} error {r['error'][:100]}")
            continue
        print(f"{r['prompt']:>10} {r['ttft_s']:>8.2f} {r['compute_floor_s']:>8.2f} {r['prefill_share_of_floor']:>6.2f} "
              f"{r['itl_ms']:>7.2f} {r['hbm_floor_ms']:>6.2f} {r['itl_over_floor']:>6.2f} {r['compiles_during']:>8}"
              f"  naive-form floor {r['compute_floor_naive_attention_s']:.2f} s, share "
              f"{r['prefill_share_of_naive_floor']:.2f}; {r['long_prefill_steps']} long-prefill steps")
    s = res.get("stall")
    if s:
        print(f"(b) {s['decoders']} decoding at {s['decode_ctx']} + a {s['long_prompt']:,}-token prompt: ITL p50 "
              f"{s['itl_p50_before_ms']:.2f} ms before; during p50 {s['itl_p50_during_ms']:.2f} p99 "
              f"{s['itl_p99_during_ms']:.2f} max {s['itl_max_during_ms']:.2f} ms -> p99/p50 "
              f"{s['p99_during_over_p50_before']:.2f} (goal <= 2); long TTFT {s['long_ttft_s'] or float('nan'):.1f} s "
              f"(alone {s['long_ttft_alone_s'] or float('nan'):.1f} s); cap {s['prefill_attention_pairs']:,} pairs, "
              f"chunk {s['chunk_size']}, budget {s['max_batched_tokens']}"
              + (f"; {s['profiled_gaps_left_out']} gaps in the profiler's window left out"
                 if s.get("profiled_gaps_left_out") else ""))
        if "itl_p50_after_ms" in s:
            print(f"    after it, decoding alone at {s['decoder_ctx_after']:,} context: ITL p50 {s['itl_p50_after_ms']:.2f} "
                  f"ms -> p99 during / p50 after {s['p99_during_over_p50_after']:.2f}")
        for when in ("before", "during", "after"):
            ph = s.get(f"step_phases_{when}") or {}
            if ph.get("calls"):
                print(f"    step() {when}: {ph['calls']} calls, p50 ms: " + ", ".join(
                    f"{k} {ph[f'{k}_ms']['p50']:.2f}" for k in (*StepTrace.PHASES, "wall")) + f"; programs {ph['programs']}")
        if s.get("step_wall_by_prefix"):
            print("    step() wall / wait p50 ms by the long prompt's prefix: " + ", ".join(
                f"{b['from']:,}+ {b['wall_p50_ms']:.1f} / {b['wait_p50_ms']:.1f} ({b['calls']})"
                for b in s["step_wall_by_prefix"]))
        pm = s.get("profile_mid_prefill")
        if pm:
            print(f"    profile at the midpoint: {pm.get('steps')} steps in {pm.get('wall_ms', 0):.1f} ms wall, GPU busy "
                  f"{pm.get('busy_ms', float('nan')):.1f} ms of a {pm.get('span_ms', float('nan')):.1f}-ms span {pm.get('error', '')}")
    if "stall_error" in res:
        print("(b) error:", res["stall_error"][:200])
    print("skipped:", res["skipped"])
    report_parts(res)


def report_parts(res: dict) -> None:
    """The stallparts table (GPU ms where a GPU measured them, else the host clock's, marked)."""
    p = res.get("stallparts")
    if "stallparts_error" in res:
        print("stallparts error:", res["stallparts_error"][:300])
    if not p:
        return
    n = p["layers"]
    gpu = any("gpu_ms" in c.get("step", {}) for c in p["cases"])
    clock = "gpu_ms" if gpu else "median_ms"
    print(f"stallparts: {p['decoders']} decoders at {p['decode_ctx']} (+ one chunk C@P), {n} layers, H={p['heads']}, "
          f"{p['kernels']} kernels, page table {p['page_table_width']} pages, programs {p['programs']}, compile "
          f"{p['compile_s']:.0f} s; times are {'GPU (profiler)' if gpu else 'HOST CLOCK (no GPU)'} ms, wall = host "
          f"clock around a blocking call")
    print(f"{'case':>10} {'rows':>4} {'tok/prog':>8} {'attn/layer':>10} {f'x{n} layers':>10} {'step':>8} "
          f"{'step wall':>9} {'+step':>7} {f'+attn x{n}':>9} {'attn share':>10}")
    for c in p["cases"]:
        att, st, add = c.get("attention", {}), c.get("step", {}), c.get(f"added_{clock}", {})

        def f(x: float | None, w: int) -> str:
            return f"{x:>{w}.2f}" if x is not None else f"{'-':>{w}}"

        a, d_step, d_att = att.get(clock), add.get("step"), add.get("attention_x_layers")
        share = d_att / d_step if d_step and d_att is not None else None  # of the step's added time
        print(f"{c['case']:>10} {c['rows']:>4} {c['tokens']:>4}/{c['program'][0]:<4}{f(a, 10)} "
              f"{f(a * n if a is not None else None, 10)} {f(st.get(clock), 8)} {f(st.get('median_ms'), 9)} "
              f"{f(d_step, 7)} {f(d_att, 9)} {f(share, 10)}"
              + (f"  {c.get('attention_error', '')}{c.get('step_error', '')}"[:160]
                 if "attention_error" in c or "step_error" in c else ""))
    loop = res.get("stallloop")
    if "stallloop_error" in res:
        print("stallloop error:", res["stallloop_error"][:300])
    if loop:
        ch = loop["chunk_tokens"]
        print(f"engine loop at prefix {loop['prefix']:,} ({loop['steps']} Engine.step() calls each, host clock ms, "
              f"p50): decode only {loop['decode_only']['wall_ms']['p50']:.2f} | with the long request "
              f"{loop['with_long']['wall_ms']['p50']:.2f} (chunks {min(ch, default=0)}-{max(ch, default=0)} tokens; "
              f"schedule {loop['with_long']['schedule_ms']['p50']:.2f}, build {loop['with_long']['build_ms']['p50']:.2f}, "
              f"execute {loop['with_long']['execute_ms']['p50']:.2f}, wait {loop['with_long']['wait_ms']['p50']:.2f}, "
              f"commit {loop['with_long']['commit_ms']['p50']:.2f}); "
              f"programs {loop['with_long']['programs']}")


if __name__ == "__main__":
    raise SystemExit(main())
