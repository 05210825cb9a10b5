"""The serving engine's core: continuous batching over a paged latent cache with ragged token steps,
chunked prefill, prefix caching, preemption, cancellation, logprobs, a non-finite guard and MTP
speculation. The contract it implements is engine/api.py.

Owns: requests and scheduling: validation (api.check_request and the pool's bound), the page pool
(paging.py) and the scheduler (scheduler.py) it drives, the step loop  schedule -> lay out the host batch
(step.build) -> `executor.execute` -> commit results, pipelining, cancellation, preemption, MTP
acceptance bookkeeping, events and the engine's counters; which step programs a load can use
(`step_keys`: the engine's fixed `step.StepShapes` in two modes at the executor's page-table width, at
most 8 by default) and asking the executor to compile them (`warmup`).
The device side is injected: an `executor.Executor` holds the cache, the per-slot state and the
compiled steps (`Engine(handle, config, executor)`; None builds `handle.executor_factory(handle, config)`
when the handle has one, as a multi-host run's process 0 does (parallel/lockstep.py), else an
`executor.DeviceExecutor`). Must not own device arrays or compiled programs (executor.py), model math
(model/), sampling rules (sampling.py), the batch layout (step.py), the schedule policy (scheduler.py),
page bookkeeping (paging.py), or know about multi-host (parallel/lockstep.py wraps the executor).

Host work off the critical path: without speculation, step k+1 is dispatched before step k's results
are read (a decode row's input token is read on device from the slot the previous step wrote), so the
host lays out and enqueues the next step while the device runs; only the sampled ids (and logprobs
when asked) come back. `step()` therefore returns events one device step late; `run()` drains.
Speculative steps (spec_k > 0) run synchronously: the next schedule needs the acceptance count.

Logits processors and structured outputs: `add_request(processing=sampling.LogitsProcessing(...))` runs
penalties, logit_bias, min_p and min_tokens on the device inside the step (step.py keeps the per-slot
counts); `constraint=` (structured.Constraint or anything with `fill_bitmask(out)`, `advance(token)` and
`error`) limits each sampled token to a grammar: the host fills the row's bitmask while the previous step
runs (a constrained row waits for its token to be committed, scheduler.py) and advances the matcher with
each committed token. Such requests never take MTP drafts (their next token's mask and counts depend on
the one before).

Speculative decoding (k drafts from the MTP head, k <= 3 reusing the one MTP layer): each decode row
feeds [last token, d_1..d_k]; the main model scores all k+1 positions in one forward; drafts are
accepted left to right (sampling.speculative_sample); rejected positions are rolled back by moving the
request's length; their cache slots are overwritten by later steps.
"""

from __future__ import annotations

import time
from collections import ChainMap, deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from dsv3_jax.engine import step
from dsv3_jax.engine.api import (
    EngineConfig,
    FinishReason,
    StepEvent,
    TokenLogprob,
    check_request,
    pages_needed,
)
from dsv3_jax.engine.executor import DeviceExecutor, Executor, batch_shards
from dsv3_jax.engine.paging import OutOfPages, PagePool, page_hashes
from dsv3_jax.engine.sampling import LogitsProcessing, validate_processing, validate_sampling_params
from dsv3_jax.engine.scheduler import Request, Scheduler


class Engine:
    """Continuous batching over one model handle. Single-threaded: call `step()` or `run()`."""

    def __init__(self, handle: Any, config: EngineConfig | None = None, executor: Executor | None = None):
        """`executor`: the device side (cache, state, compiled steps) built for this `config` (with
        num_pages a multiple of the mesh's batch shards); None builds it here, through
        `handle.executor_factory` when the handle has one (a multi-host leader's), else DeviceExecutor."""
        self.handle, self.cfg = handle, config or EngineConfig()
        c = self.cfg
        if not 0 <= c.spec_k <= 3:
            raise ValueError(f"spec_k must be in 0..3, got {c.spec_k}")
        if c.spec_k and "mtp" not in handle.params:
            raise ValueError("spec_k > 0 needs the checkpoint's MTP layer (num_nextn_predict_layers >= 1)")
        if c.chunk_size < 1 or c.max_batched_tokens < c.spec_k + 1 or c.max_batch < 1:
            raise ValueError("chunk_size, max_batch must be >= 1 and max_batched_tokens >= spec_k + 1")
        # DP attention: batch shard s holds its sequences' pages only (slice s of the pool), and the
        # flat token batch is split over data x expert, so token capacities are multiples of m.
        self._shards = batch_shards(handle)
        c.num_pages = -(-c.num_pages // self._shards) * self._shards
        self.shapes = step.StepShapes.make(max_rows=c.max_batch, max_tokens=c.max_batched_tokens,
                                           spec_k=c.spec_k, decode_rows=c.row_buckets,
                                           token_caps=c.token_buckets, multiple=self._shards)
        if executor is None:
            executor = (handle.executor_factory or DeviceExecutor)(handle, c)
        self.executor: Executor = executor
        self.width = executor.width
        if c.long_prefill_from < 0:
            raise ValueError(f"long_prefill_from must be >= 0 (0: off), got {c.long_prefill_from}")
        # (from, shape): the naive-form long-prefill programs (EngineConfig.long_prefill_from), for the shape
        # a whole chunk of one sequence picks; none when no sequence can reach the prefix, or under DP
        # attention (the path runs on one batch shard).
        reach = self.width * c.page_size > c.long_prefill_from
        whole_chunk = self.shapes.pick(min(c.chunk_size, c.max_batched_tokens), 1)
        self.long_prefill = ((c.long_prefill_from, whole_chunk)
                             if c.long_prefill_from and reach and self._shards == 1 else None)
        self.pool = PagePool(c.num_pages, c.page_size, c.prefix_caching, shards=self._shards)
        self.sched = Scheduler(self.pool, max_batch=c.max_batch, max_batched_tokens=c.max_batched_tokens,
                               chunk_size=c.chunk_size, spec_k=c.spec_k, num_slots=c.max_batch,
                               prefill_attention_pairs=c.prefill_attention_pairs)
        self.finished: dict[int, Request] = {}
        self._inflight: tuple | None = None
        self._sync_next = False
        # Counters, plus the most recent per-step records (bounded: a server runs for days); the
        # executor's compile counters (compiles, compile_s, compiles_after_warmup, programs_loaded) read
        # through the same mapping.
        recent = 1 << 16
        self._counters: dict[str, Any] = {
            "steps": 0, "batch_sizes": deque(maxlen=recent), "tokens": deque(maxlen=recent),
            "padded_tokens": deque(maxlen=recent), "sum_rows": 0, "sum_tokens": 0, "sum_padded": 0,
            "peak_page_usage": 0.0, "preemptions": 0, "spec_proposed": 0, "spec_accepted": 0,
            "long_prefill_steps": 0,  # steps run by the naive-form long-prefill programs
            "mask_s": 0.0}  # host seconds spent filling grammar bitmasks
        self.mask_words = -(-handle.config.vocab_size // 32)
        self.stats: ChainMap[str, Any] = ChainMap(self._counters, executor.stats)

    # ------------------------------------------------------------------ queues (scheduler's)
    @property
    def waiting(self):
        return self.sched.waiting

    @property
    def running(self):
        return self.sched.running

    def clock(self) -> float:
        """Wall time minus time spent compiling: request timings exclude compiles."""
        return time.perf_counter() - self.executor.compile_wall_s

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int = 0, eos: Sequence[int] = (),
                    logprobs: int | None = None, processing: LogitsProcessing | None = None,
                    constraint: Any = None) -> int:
        """Queue a request; `processing`: its logits processors (None or all defaults: none); `constraint`:
        a structured-output matcher (module docstring). Returns its id."""
        prompt = [int(t) for t in prompt]
        mc = self.handle.config
        check_request(prompt, max_new_tokens, vocab_size=mc.vocab_size, context=mc.max_position_embeddings,
                      spec_k=self.cfg.spec_k, logprobs=logprobs)
        validate_sampling_params(temperature, top_p, top_k, seed=seed)  # seeds live in int32 arrays
        eos_set = frozenset(int(e) for e in eos)
        if processing is not None and not processing.active:
            processing = None
        if processing is not None:
            validate_processing(processing, mc.vocab_size, eos_set, max_new_tokens)
        need = pages_needed(len(prompt), max_new_tokens, self.cfg.spec_k, self.cfg.page_size)
        if need > self.pool.pages_per_shard - 1:
            where = f" per batch shard (of {self.pool.shards})" if self.pool.shards > 1 else ""
            raise ValueError(f"request needs {need} pages of {self.cfg.page_size} tokens but the pool has "
                             f"{self.pool.pages_per_shard - 1}{where}: it could never run")
        r = Request(next(self.sched.ids), prompt, max_new_tokens, float(temperature), float(top_p),
                    int(top_k), int(seed), eos_set, logprobs=logprobs, arrival=self.clock(),
                    processing=processing, table=processing.table(eos_set) if processing else (),
                    constraint=constraint)
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
            self.executor.clear_pages(pages)
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
                           num_shards=self._shards, scratch_slot=self.cfg.max_batch,
                           mask_words=self.mask_words, long_prefill=self.long_prefill)
        self._counters["long_prefill_steps"] += batch.key.long_prefill
        if batch.key.mask_words:  # while the previous step runs on the device (pipelined)
            t0 = time.perf_counter()
            bitmask = batch.view("bitmask")
            for (r, row), i in zip(plan, batch.row_index, strict=True):
                if r.constraint is not None and row.final:
                    r.constraint.fill_bitmask(bitmask[i])
            self.stats["mask_s"] += time.perf_counter() - t0
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
        out_ints, out_floats = self.executor.execute(batch.key, batch.ints, batch.floats)
        out_ints.copy_to_host_async()
        if batch.key.logprobs:
            out_floats.copy_to_host_async()
        return out_ints, out_floats

    def step_keys(self, max_rows: int | None = None, max_tokens: int | None = None,
                  modes: Sequence[str] = ("greedy", "full")) -> list[step.StepKey]:
        """The step programs a load of at most `max_rows` sequences per step and `max_tokens` tokens per
        batch shard can use (default: any load this engine admits), in `modes` ("greedy": argmax only;
        "full": some row samples, asks for logprobs or has logits processors; "masked": full with a
        constrained row's grammar bitmask, used only by structured-output requests)."""
        c = self.cfg
        bad = set(modes) - {"greedy", "full", "masked"}
        if bad:
            raise ValueError(f"modes must be among 'greedy', 'full', 'masked', got {sorted(bad)}")
        pairs = self.shapes.reachable(min(max_tokens or c.max_batched_tokens, c.max_batched_tokens),
                                      min(max_rows or c.max_batch, c.max_batch))
        d = self._shards
        keys = [step.StepKey(n * d, s * d, self.width, c.spec_k, m != "greedy",
                             self.mask_words if m == "masked" else 0)
                for n, s in pairs for m in ("greedy", "full", "masked") if m in modes]
        unmasked = {"greedy", "full"} & set(modes)
        if self.long_prefill is not None and self.long_prefill[1] in pairs and unmasked:
            keys.append(step.long_prefill_key(*self.long_prefill[1], self.width, c.spec_k))
        return keys

    def warmup(self, max_rows: int | None = None, max_tokens: int | None = None,
               modes: Sequence[str] = ("greedy", "full"),
               progress: Callable[[int, int, step.StepKey, float], None] | None = None,
               workers: int | None = None) -> float:
        """Compile every step program `step_keys(max_rows, max_tokens, modes)` lists (default: all that
        any load can use, so no load compiles afterwards) and the page-clearing program; returns the
        seconds spent (executor.DeviceExecutor.warmup: compiled in parallel, or loaded from the program
        store). `progress(done, total, key, seconds)` is called as each program finishes; `workers`
        threads compile (default: one per program, up to the CPU count)."""
        return self.executor.warmup(self.step_keys(max_rows, max_tokens, modes), progress, workers)

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
                if r.constraint is not None and not r.constraint.advance(tok):
                    r.finish_reason, r.error = FinishReason.ERROR, f"structured output: {r.constraint.error}"
                    break
                r.output.append(tok)
                emitted.append(tok)
                r.token_times.append(now)
                if r.logprobs is not None:
                    n_top = min(r.logprobs, self.handle.config.vocab_size)
                    top = list(zip(out["top_ids"][i, jj, :n_top].tolist(),
                                   out["top_logprobs"][i, jj, :n_top].tolist(), strict=True))
                    lps.append(TokenLogprob(tok, float(out["logprob"][i, jj]), top))
                if r.constraint is not None and r.constraint.done:
                    r.finish_reason = FinishReason.STOP  # the grammar is complete: only EOS could follow
                    break
                if len(r.output) >= r.max_new_tokens:
                    r.finish_reason = FinishReason.LENGTH
                    break
            r.output_logprobs += lps
            if r.first_token_at is None and (emitted or r.finish_reason):
                r.first_token_at = now
            self._register(r, row.start + row.n - row.ndraft + accepted, ps)
            if self.cfg.spec_k and not r.done and r.processing is None and r.constraint is None:
                r.drafts = out["drafts"][i].tolist()
            if r.done:
                reason, r.finish_reason = r.finish_reason, None
                self._finish(r, reason, r.error)
            events.append(StepEvent(r.rid, emitted, r.done, r.finish_reason,
                                    lps if r.logprobs is not None else None, r.error))
        return events

    def _register(self, r: Request, upto: int, ps: int) -> None:
        """Publish newly filled pages (prompt and output) for prefix reuse; hashing runs only when a page
        fills, not every step."""
        full = min(upto, r.known) // ps
        if full > r.registered_pages:
            r.page_hashes = page_hashes(r.token_slice(0, full * ps), ps, r.page_hashes[:full])
            self.pool.register((), r.pages, r.page_hashes[:full])
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
                "compiles_after_warmup": s["compiles_after_warmup"], "programs_loaded": s["programs_loaded"],
                "mask_s": s["mask_s"],
                "prefill_tokens_pending": self.prefill_tokens_pending()}

    def prefill_tokens_pending(self) -> int:
        """A long prompt's progress: prompt tokens of running and waiting requests not yet scheduled into
        the cache (a preempted request's count again)."""
        return sum(max(len(r.prompt) - r.computed, 0) for r in (*self.waiting, *self.running))

