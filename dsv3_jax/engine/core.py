"""The serving engine: continuous batching over a paged latent cache with ragged token steps, chunked
prefill, prefix caching, preemption, cancellation, logprobs, a non-finite guard and MTP speculation.

Owns: the public contract (`Engine`, `EngineConfig`, `StepEvent`, `TokenLogprob`: this docstring and
theirs), request validation and pages-needed, the step loop  schedule (scheduler.py) -> lay out the host
batch (step.py) -> execute on device -> commit results, the compiled steps (one per
`step.StepKey`: the engine's fixed `step.StepShapes` in two modes at one page-table width, at most 8 by
default, all compiled by `warmup()` before serving, in parallel, and timed; compile time is reported apart
from step times), the device-resident cache and per-request state, and the JAX persistent compilation
cache setting.
Must not own model math (model.py), sampling rules (sampling.py), the batch layout (step.py), the
schedule (scheduler.py) or page bookkeeping (paging.py).

Host work off the critical path: without speculation, step k+1 is dispatched before step k's results
are read (a decode row's input token is read on device from the slot the previous step wrote), so the
host lays out and enqueues the next step while the device runs; only the sampled ids (and logprobs
when asked) come back. `step()` therefore returns events one device step late; `run()` drains.
Speculative steps (spec_k > 0) run synchronously: the next schedule needs the acceptance count.

Speculative decoding (k drafts from the MTP head, k <= 3 reusing the one MTP layer): each decode row
feeds [last token, d_1..d_k]; the main model scores all k+1 positions in one forward; drafts are
accepted left to right (sampling.speculative_sample); rejected positions are rolled back by moving the
request's length; their cache slots are overwritten by later steps.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.engine import program_cache, step
from dsv3_jax.engine.api import (
    EngineConfig,
    FinishReason,
    StepEvent,
    TokenLogprob,
    check_request,
    pages_needed,
)
from dsv3_jax.engine.paging import OutOfPages, PagePool
from dsv3_jax.engine.sampling import validate_sampling_params
from dsv3_jax.engine.scheduler import Request, Scheduler
from dsv3_jax.model import kernel_dispatch as kernels
from dsv3_jax.model import kv_cache, moe
from dsv3_jax.parallel import lockstep, sharding

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ compilation cache
CACHE_ENV = "DSV3_JAX_CACHE_DIR"  # a directory, or "off"


def compilation_cache_dir() -> Path | None:
    """Where compiled steps persist across runs: $DSV3_JAX_CACHE_DIR, else the user cache directory
    ($XDG_CACHE_HOME or ~/.cache)/dsv3_jax/xla; None when set to "off"."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dsv3_jax" / "xla"


def enable_compilation_cache() -> Path | None:
    """Turn on JAX's persistent compilation cache (once; a directory the user configured wins)."""
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    d = compilation_cache_dir()
    if d is None:
        return None
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    try:  # JAX decides once, at its first compile, whether the cache is on: let it decide again
        from jax._src import compilation_cache

        if compilation_cache._cache_checked and not compilation_cache._cache_used:
            compilation_cache.reset_cache()
    except (ImportError, AttributeError):  # another JAX version: the setting applies from the next process
        log.info("compilation cache set to %s; it applies to programs compiled from now on", d)
    return d


# Compiled steps per model handle, keyed explicitly (step key, shapes, kernel and dispatch choice);
# engines over the same handle share them. Dropped when the handle is garbage collected.
_COMPILED: dict[int, dict[tuple, Any]] = {}


def _compiled_for(handle: Any) -> dict[tuple, Any]:
    hid = id(handle)
    if hid not in _COMPILED:
        _COMPILED[hid] = {}
        weakref.finalize(handle, _COMPILED.pop, hid, None)
    return _COMPILED[hid]


class Engine:
    """Continuous batching over one model handle. Single-threaded: call `step()` or `run()`."""

    def __init__(self, handle: Any, config: EngineConfig | None = None):
        self.handle, self.cfg = handle, config or EngineConfig()
        c, mc = self.cfg, handle.config
        if not 0 <= c.spec_k <= 3:
            raise ValueError(f"spec_k must be in 0..3, got {c.spec_k}")
        if c.spec_k and "mtp" not in handle.params:
            raise ValueError("spec_k > 0 needs the checkpoint's MTP layer (num_nextn_predict_layers >= 1)")
        if c.chunk_size < 1 or c.max_batched_tokens < c.spec_k + 1 or c.max_batch < 1:
            raise ValueError("chunk_size, max_batch must be >= 1 and max_batched_tokens >= spec_k + 1")
        self._shards = 1
        if handle.mesh is not None:
            # DP attention: batch shard s holds its sequences' pages only (slice s of the pool), and the
            # flat token batch is split over data x expert, so token capacities are multiples of m.
            m = sharding.batch_multiple(handle.mesh)
            self._shards = m
            c.num_pages = -(-c.num_pages // m) * m
        self.shapes = step.StepShapes.make(max_rows=c.max_batch, max_tokens=c.max_batched_tokens,
                                           spec_k=c.spec_k, decode_rows=c.row_buckets,
                                           token_caps=c.token_buckets, multiple=self._shards)
        # One page-table width: the most pages a sequence can hold (the pool's shard or the context),
        # rounded to 8 columns. Kernels loop to each row's live length, so width costs only the table.
        longest = min(c.num_pages // self._shards - 1,
                      kv_cache.pages_for(mc.max_position_embeddings + c.spec_k, c.page_size))
        self.width = -(-max(longest, 1) // 8) * 8
        self._programs = program_cache.ProgramStore(enable_compilation_cache())
        # Multi-host: the other processes build this engine too, before any device array exists
        # (placing arrays on a mesh that spans processes is collective).
        lockstep.announce(c)
        self.pool = PagePool(c.num_pages, c.page_size, c.prefix_caching, shards=self._shards)
        self.cache = sharding.place_cache(handle, kv_cache.allocate(
            mc, c.num_pages, c.page_size, handle.attention, jnp.dtype(mc.dtype), mtp=bool(c.spec_k)))
        self.state = step.init_state(c.max_batch + 1, c.spec_k, mc.vocab_size)
        if handle.mesh is not None:
            self.state = jax.device_put(self.state, jax.sharding.NamedSharding(handle.mesh,
                                                                               jax.sharding.PartitionSpec()))
        self.sched = Scheduler(self.pool, max_batch=c.max_batch, max_batched_tokens=c.max_batched_tokens,
                               chunk_size=c.chunk_size, spec_k=c.spec_k, num_slots=c.max_batch)
        self.finished: dict[int, Request] = {}
        self._inflight: tuple | None = None
        self._warm = False  # set by warmup(): a compile after it is a bug (logged, counted)
        self._clear_program = None  # clear_pages compiled by warmup()
        self._sync_next = False
        self._compile_s = 0.0
        leaves, tree = jax.tree.flatten((self.cache, self.state))
        self._sig = (str(tree), tuple((x.shape, str(x.dtype)) for x in leaves), id(handle.mesh))
        # Counters, plus the most recent per-step records (bounded: a server runs for days).
        recent = 1 << 16
        self.stats: dict[str, Any] = {"steps": 0, "batch_sizes": deque(maxlen=recent),
                                      "tokens": deque(maxlen=recent), "padded_tokens": deque(maxlen=recent),
                                      "sum_rows": 0, "sum_tokens": 0, "sum_padded": 0, "peak_page_usage": 0.0,
                                      "preemptions": 0, "compiles": 0, "compile_s": 0.0,
                                      "compiles_after_warmup": 0, "programs_loaded": 0,
                                      "spec_proposed": 0, "spec_accepted": 0}

    # ------------------------------------------------------------------ queues (scheduler's)
    @property
    def waiting(self):
        return self.sched.waiting

    @property
    def running(self):
        return self.sched.running

    def clock(self) -> float:
        """Wall time minus time spent compiling: request timings exclude compiles."""
        return time.perf_counter() - self._compile_s

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int = 0, eos: Sequence[int] = (),
                    logprobs: int | None = None) -> int:
        prompt = [int(t) for t in prompt]
        mc = self.handle.config
        check_request(prompt, max_new_tokens, vocab_size=mc.vocab_size, context=mc.max_position_embeddings,
                      spec_k=self.cfg.spec_k, logprobs=logprobs)
        validate_sampling_params(temperature, top_p, top_k, seed=seed)  # seeds live in int32 arrays
        need = pages_needed(len(prompt), max_new_tokens, self.cfg.spec_k, self.cfg.page_size)
        if need > self.pool.pages_per_shard - 1:
            where = f" per batch shard (of {self.pool.shards})" if self.pool.shards > 1 else ""
            raise ValueError(f"request needs {need} pages of {self.cfg.page_size} tokens but the pool has "
                             f"{self.pool.pages_per_shard - 1}{where}: it could never run")
        r = Request(next(self.sched.ids), prompt, max_new_tokens, float(temperature), float(top_p),
                    int(top_k), int(seed), frozenset(int(e) for e in eos), logprobs=logprobs,
                    arrival=self.clock())
        self.waiting.append(r)
        return r.rid

    def cancel(self, rid: int) -> bool:
        """Stop a request now and free its pages; True if it was waiting or running."""
        for r in (*self.waiting, *self.running):
            if r.rid == rid:
                self._finish(r, FinishReason.CANCELLED)
                return True
        return False

    def _finish(self, r: Request, reason: FinishReason, error: str | None = None) -> None:
        r.finish_reason, r.error = reason, error
        if reason == FinishReason.ERROR and r.pages:
            # Its pages may hold NaN: zero them so the next owner's masked slots stay finite.
            pages = np.zeros(self.width, np.int32)  # one shape: compiled by warmup()
            pages[:len(r.pages)] = r.pages
            self.clear_pages(pages)
        self.sched.remove(r)
        self.finished[r.rid] = r

    def has_work(self) -> bool:
        """True while a step may still produce events (an in-flight step counts if a row is live)."""
        return bool(self.waiting or self.running
                    or (self._inflight and any(not r.done for r, _ in self._inflight[1])))

    # ------------------------------------------------------------------ the step loop
    def step(self) -> list[StepEvent]:
        """Schedule, dispatch and (one step later when pipelined) commit; returns finished work."""
        events: list[StepEvent] = []
        if self._inflight and (self._sync_next or not self._pipelined()):
            events += self._drain()
        self._sync_next = False
        plan, starved = self.sched.schedule(can_preempt=self._inflight is None)
        self.stats["preemptions"] = self.sched.preemptions
        if starved:
            self._sync_next = True  # the next schedule runs without a step in flight, so it may preempt
        if not plan:
            if self._inflight:
                return events + self._drain()
            if self.waiting and not self.running:
                raise OutOfPages("no request can be scheduled: the page pool is too small")
            return events
        batch = step.build([row for _, row in plan], spec_k=self.cfg.spec_k, shapes=self.shapes,
                           width=self.width, logprobs=any(r.logprobs is not None for r, _ in plan),
                           num_shards=self._shards, scratch_slot=self.cfg.max_batch)
        for r, row in plan:
            r.computed += row.n
            r.pending += row.final
        outs = self._execute(batch)
        st = self.stats
        st["steps"] += 1
        for name, total, v in (("batch_sizes", "sum_rows", len(plan)),
                               ("tokens", "sum_tokens", batch.n_scheduled),
                               ("padded_tokens", "sum_padded", batch.key.tokens)):
            st[name].append(v)
            st[total] += v
        st["peak_page_usage"] = max(st["peak_page_usage"], self.pool.num_used / self.pool.capacity)
        prev, self._inflight = self._inflight, (batch, plan, outs)
        if prev is not None:
            events += self._commit(prev)
        if not self._pipelined():
            events += self._drain()
        return events

    def _pipelined(self) -> bool:
        return self.cfg.pipeline and not self.cfg.spec_k

    def _drain(self) -> list[StepEvent]:
        prev, self._inflight = self._inflight, None
        return self._commit(prev) if prev is not None else []

    def _execute(self, batch: step.StepBatch):
        out_ints, out_floats = self.execute(batch.key, batch.ints, batch.floats)
        out_ints.copy_to_host_async()
        if batch.key.logprobs:
            out_floats.copy_to_host_async()
        return out_ints, out_floats

    def execute(self, key: step.StepKey, ints: np.ndarray, floats: np.ndarray):
        """Run the compiled step `key` on packed host inputs; (out_ints, out_floats) device arrays.
        Multi-host followers (lockstep.follow) call this with process 0's inputs."""
        lockstep.step(key, ints, floats)
        fn = self._compiled(key)
        with self.handle.mesh_context():
            out_ints, out_floats, self.cache, self.state = fn(self.handle.params, self.cache, self.state,
                                                              self._put(ints), self._put(floats))
        return out_ints, out_floats

    def clear_pages(self, pages: np.ndarray) -> None:
        """Zero physical pages (int32 [n]; 0 entries touch only scratch) in every cache leaf."""
        lockstep.clear(pages)
        if self._clear_program is not None and pages.shape == (self.width,):
            self.cache = self._clear_program(self.cache, self._put(pages))
        else:
            self.cache = _clear_pages(self.cache, jnp.asarray(pages))

    def _replicated(self) -> jax.sharding.Sharding:
        if self.handle.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.sharding.NamedSharding(self.handle.mesh, jax.sharding.PartitionSpec())

    def _put(self, x: np.ndarray) -> jax.Array:
        if self.handle.mesh is None:
            return jnp.asarray(x)
        return jax.make_array_from_callback(x.shape, self._replicated(), lambda idx: x[idx])

    def _compile_key(self, key: step.StepKey) -> tuple:
        # Every trace-time setting the program depends on: kernel backend, MoE dispatch and capacity.
        opts = tuple(sorted((self.cfg.compiler_options or {}).items()))
        return (key, self._sig, kernels.backend(), moe._forced_dispatch.get(), moe.CAPACITY_FACTOR, opts)

    def _lower(self, key: step.StepKey):
        ints = jax.ShapeDtypeStruct((step.packed_size(step.int_fields(key)),), jnp.int32)
        floats = jax.ShapeDtypeStruct((step.packed_size(step.float_fields(key)),), jnp.float32)
        if self.handle.mesh is not None:
            rep = jax.sharding.NamedSharding(self.handle.mesh, jax.sharding.PartitionSpec())
            ints = jax.ShapeDtypeStruct(ints.shape, ints.dtype, sharding=rep)
            floats = jax.ShapeDtypeStruct(floats.shape, floats.dtype, sharding=rep)
        fn = jax.jit(step.make_step(self.handle.model, key), donate_argnums=(1, 2))
        with self.handle.mesh_context():
            return fn.lower(self.handle.params, self.cache, self.state, ints, floats)

    def _compile_lowered(self, lowered):
        opts = dict(self.cfg.compiler_options or {})
        with self.handle.mesh_context():
            return lowered.compile(compiler_options=opts) if opts else lowered.compile()

    def _record_compile(self, key: step.StepKey, seconds: float) -> None:
        self._compile_s += seconds
        self.stats["compiles"] += 1
        self.stats["compile_s"] += seconds
        if self._warm:
            self.stats["compiles_after_warmup"] += 1
            log.warning("compiled step %s after warmup (%.1f s): outside the warmed set", key, seconds)
        else:
            log.info("compiled step %s in %.1f s", key, seconds)

    def _compiled(self, key: step.StepKey):
        store = _compiled_for(self.handle)
        ck = self._compile_key(key)
        if ck not in store:
            t0 = time.perf_counter()
            store[ck] = self._compile_lowered(self._lower(key))
            self._record_compile(key, time.perf_counter() - t0)
        return store[ck]

    def step_keys(self, max_rows: int | None = None, max_tokens: int | None = None,
                  modes: Sequence[str] = ("greedy", "full")) -> list[step.StepKey]:
        """The step programs a load of at most `max_rows` sequences per step and `max_tokens` tokens per
        batch shard can use (default: any load this engine admits), in `modes` ("greedy": argmax only;
        "full": some row samples or asks for logprobs)."""
        c = self.cfg
        bad = set(modes) - {"greedy", "full"}
        if bad:
            raise ValueError(f"modes must be 'greedy' and/or 'full', got {sorted(bad)}")
        pairs = self.shapes.reachable(min(max_tokens or c.max_batched_tokens, c.max_batched_tokens),
                                      min(max_rows or c.max_batch, c.max_batch))
        d = self._shards
        return [step.StepKey(n * d, s * d, self.width, c.spec_k, m == "full")
                for n, s in pairs for m in ("greedy", "full") if m in modes]

    def warmup(self, max_rows: int | None = None, max_tokens: int | None = None,
               modes: Sequence[str] = ("greedy", "full"),
               progress: Callable[[int, int, step.StepKey, float], None] | None = None,
               workers: int | None = None) -> float:
        """Compile every step program `step_keys(max_rows, max_tokens, modes)` lists (default: all that
        any load can use, so no load compiles afterwards) and the page-clearing program; returns the
        seconds spent. Tracing runs here one program after another (it reads this thread's settings:
        kernel backend, MoE dispatch); XLA compiles them on `workers` threads meanwhile (default: one
        per program, up to the CPU count). `progress(done, total, key, seconds)` is called as each
        program finishes, in completion order. A program an earlier process compiled loads from the
        program store (program_cache: no tracing), else XLA's persistent cache spares the compile."""
        lockstep.warmup(max_rows, max_tokens, tuple(modes))
        store = _compiled_for(self.handle)
        keys = [k for k in self.step_keys(max_rows, max_tokens, modes) if self._compile_key(k) not in store]
        t_start = time.perf_counter()
        done = 0
        workers = workers or max(1, min(len(keys), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {}
            for key in keys:
                t0 = time.perf_counter()
                loaded = self._programs.load(self._program_id(key), self._devices())
                if loaded is not None:
                    store[self._compile_key(key)] = loaded
                    self.stats["programs_loaded"] += 1
                    done += 1
                    log.info("loaded step %s in %.1f s", key, time.perf_counter() - t0)
                    if progress is not None:
                        progress(done, len(keys), key, time.perf_counter() - t0)
                    continue
                lowered = self._lower(key)
                futures[pool.submit(self._compile_timed, lowered, t0)] = key
            for fut in concurrent.futures.as_completed(futures):
                key = futures[fut]
                compiled, seconds = fut.result()
                store[self._compile_key(key)] = compiled
                self._programs.save(self._program_id(key), compiled)
                self.stats["compiles"] += 1
                self.stats["compile_s"] += seconds
                done += 1
                log.info("compiled step %s in %.1f s", key, seconds)
                if progress is not None:
                    progress(done, len(keys), key, seconds)
        if self._clear_program is None:  # compiled, not run: a multi-host run must not execute it alone
            pages = jax.ShapeDtypeStruct((self.width,), jnp.int32, sharding=self._replicated())
            with self.handle.mesh_context():
                self._clear_program = _clear_pages.lower(self.cache, pages).compile()
        wall = time.perf_counter() - t_start
        self._compile_s += wall
        self._warm = True
        return wall

    def _devices(self) -> list:
        mesh = self.handle.mesh
        return [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)

    def _program_id(self, key: step.StepKey) -> str:
        h = self.handle
        return program_cache.program_id((self._compile_key(key)[0], *self._compile_key(key)[2:], h.attention),
                                        (h.params, self.cache, self.state), h.mesh, h.config)

    def _compile_timed(self, lowered, t0: float):
        compiled = self._compile_lowered(lowered)
        return compiled, time.perf_counter() - t0

    # ------------------------------------------------------------------ commit
    def _commit(self, inflight: tuple) -> list[StepEvent]:
        batch, plan, (out_ints, out_floats) = inflight
        key = batch.key
        out = step.unpack_outputs(key, np.asarray(out_ints), np.asarray(out_floats) if key.logprobs else None)
        now = self.clock()
        events = []
        ps = self.cfg.page_size
        for (r, row), i in zip(plan, batch.row_index, strict=True):
            if r.done or r.slot != row.slot:  # finished, cancelled or preempted since it was scheduled
                continue
            r.pending -= row.final
            if not out["finite"][i]:
                self._finish(r, FinishReason.ERROR, f"non-finite logits at position {row.start + row.n - 1} "
                             f"(numerical overflow or corrupt weights); request stopped")
                events.append(StepEvent(r.rid, [], True, FinishReason.ERROR, error=r.error))
                continue
            if not row.final:  # a prefill chunk short of the prompt's end
                self._register(r, row.start + row.n, ps)
                continue
            n_new = int(out["n_new"][i])
            accepted = n_new - 1
            r.steps += 1
            r.spec_proposed += row.ndraft
            r.spec_accepted += accepted
            self.stats["spec_proposed"] += row.ndraft
            self.stats["spec_accepted"] += accepted
            r.computed -= row.ndraft - accepted  # roll back past the first rejected draft
            emitted, lps = [], []
            for jj, tok in enumerate(out["tokens"][i, :n_new].tolist()):
                if tok in r.eos:
                    r.finish_reason = FinishReason.STOP
                    break
                r.output.append(tok)
                emitted.append(tok)
                r.token_times.append(now)
                if r.logprobs is not None:
                    n_top = min(r.logprobs, self.handle.config.vocab_size)
                    top = list(zip(out["top_ids"][i, jj, :n_top].tolist(),
                                   out["top_logprobs"][i, jj, :n_top].tolist(), strict=True))
                    lps.append(TokenLogprob(tok, float(out["logprob"][i, jj]), top))
                if len(r.output) >= r.max_new_tokens:
                    r.finish_reason = FinishReason.LENGTH
                    break
            r.output_logprobs += lps
            if r.first_token_at is None and (emitted or r.finish_reason):
                r.first_token_at = now
            self._register(r, row.start + row.n - row.ndraft + accepted, ps)
            if self.cfg.spec_k and not r.done:
                r.drafts = out["drafts"][i].tolist()
            if r.done:
                reason, r.finish_reason = r.finish_reason, None
                self._finish(r, reason)
            events.append(StepEvent(r.rid, emitted, r.done, r.finish_reason,
                                    lps if r.logprobs is not None else None))
        return events

    def _register(self, r: Request, upto: int, ps: int) -> None:
        """Publish newly filled pages (prompt and output) for prefix reuse; hashing runs only when a page
        fills, not every step."""
        full = min(upto, r.known) // ps
        if full > r.registered_pages:
            self.pool.register(r.tokens[:full * ps], r.pages)
            r.registered_pages = full

    # ------------------------------------------------------------------ driving
    def run(self) -> Iterator[StepEvent]:
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> list[Request]:
        """Add all prompts, run to completion, return the finished requests in prompt order."""
        rids = [self.add_request(p, **kwargs) for p in prompts]
        for _ in self.run():
            pass
        return [self.finished[r] for r in rids]

    def engine_stats(self) -> dict[str, Any]:
        """Counters over the engine's life (JSON-safe: None where undefined)."""
        s = self.stats
        prop = s["spec_proposed"]
        n = max(s["steps"], 1)
        return {"steps": s["steps"], "mean_batch": s["sum_rows"] / n, "mean_tokens": s["sum_tokens"] / n,
                "mean_padded_tokens": s["sum_padded"] / n, "peak_page_usage": s["peak_page_usage"],
                "prefix_hit_rate": self.pool.hits / self.pool.lookups if self.pool.lookups else 0.0,
                "preemptions": self.sched.preemptions,
                "mtp_acceptance": s["spec_accepted"] / prop if prop else None,
                "compiles": s["compiles"], "compile_s": s["compile_s"],
                "compiles_after_warmup": s["compiles_after_warmup"], "programs_loaded": s["programs_loaded"]}


@jax.jit
def _clear_pages(cache: dict, pages: jax.Array) -> dict:
    return kv_cache.clear_pages(cache, pages)
