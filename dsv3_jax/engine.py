"""The serving engine: continuous batching over a paged latent cache, chunked prefill, prefix caching,
preemption, cancellation, and MTP speculative decoding.

Owns: request state, the per-step scheduler (a token budget per step; running requests first, then
admission of waiting ones against free pages; long prompts split into chunks so one 100K prompt cannot
stall the batch), page allocation per request (through paging.PagePool), preemption when pages run
out (the newest running request is requeued and recomputed, never lost), and the one jitted device
step: model forward over every scheduled chunk, sampling / speculative verification, and the MTP draft.
Must not own model math (model.py), sampling rules (sampling.py) or page bookkeeping (paging.py).

Speculative decoding (k drafts from the MTP head, k <= 3 reusing the one MTP layer): each decode row
feeds [last token, d_1..d_k]; the main model scores all k+1 positions in one forward; drafts are
accepted left to right — greedy: while d_j equals the main model's argmax (exactly plain greedy);
sampled: with probability min(1, p(d_j) / q(d_j)), a rejection resampling from norm(max(p - q, 0))
(the standard rule: the output distribution is the target's). Rejected positions are rolled back by
moving the request's length; their cache slots are overwritten by later steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax import cache as kv_cache
from dsv3_jax.cache import PageMeta
from dsv3_jax.paging import OutOfPages, PagePool
from dsv3_jax.sampling import SamplingParams, probs_after_filtering, validate_sampling_params

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineConfig:
    num_pages: int = 256  # pages in the pool (page 0 is scratch)
    page_size: int = kv_cache.PAGE_SIZE
    max_batch: int = 32  # sequences per step
    token_budget: int = 512  # tokens per step (prefill chunks + decode tokens)
    chunk_size: int = 256  # longest prefill chunk of one request per step
    prefix_caching: bool = True
    spec_k: int = 0  # MTP draft tokens per step (0 = off, 1..3)


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    eos: frozenset[int]
    output: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose latents are in the cache (and valid)
    drafts: list[int] = dataclasses.field(default_factory=list)
    draft_probs: Any = None  # [k, V] device array of the MTP's filtered probs (sampled verification)
    finish_reason: str | None = None
    arrival: float = 0.0
    first_token_at: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    steps: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def metrics(self) -> dict[str, float]:
        ttft = (self.first_token_at - self.arrival) if self.first_token_at else float("nan")
        itl = float(np.median(np.diff(self.token_times))) if len(self.token_times) > 1 else float("nan")
        total = (self.token_times[-1] - self.arrival) if self.token_times else float("nan")
        nan = float("nan")
        rate = len(self.output) / total if total else 0.0
        return {"ttft_s": ttft, "inter_token_s": itl, "tokens_per_s": rate,
                "cached_prompt_tokens": self.cached_tokens, "preemptions": self.preemptions,
                "spec_acceptance": self.spec_accepted / self.spec_proposed if self.spec_proposed else nan,
                "tokens_per_step": len(self.output) / self.steps if self.steps else nan}


@dataclasses.dataclass
class StepEvent:
    rid: int
    new_tokens: list[int]
    finished: bool


class Engine:
    """Continuous batching over one model handle. Single-threaded: call `step()` or `run()`."""

    def __init__(self, handle: Any, config: EngineConfig | None = None):
        self.handle, self.cfg = handle, config or EngineConfig()
        c, mc = self.cfg, handle.config
        if not 0 <= c.spec_k <= 3:
            raise ValueError(f"spec_k must be in 0..3, got {c.spec_k}")
        if c.spec_k and "mtp" not in handle.params:
            raise ValueError("spec_k > 0 needs the checkpoint's MTP layer (num_nextn_predict_layers >= 1)")
        if c.chunk_size < 1 or c.token_budget < c.spec_k + 1 or c.max_batch < 1:
            raise ValueError("chunk_size, max_batch must be >= 1 and token_budget >= spec_k + 1")
        if handle.mesh is not None:  # every batch shard (data x expert) needs whole rows
            from dsv3_jax import sharding

            m = sharding.batch_multiple(handle.mesh)
            self.cfg = c = dataclasses.replace(c, max_batch=-(-c.max_batch // m) * m)
        self.pool = PagePool(c.num_pages, c.page_size, c.prefix_caching)
        from dsv3_jax.decode import place_cache

        self.cache = place_cache(handle, kv_cache.allocate(mc, c.num_pages, c.page_size, handle.attention,
                                                           jnp.dtype(mc.dtype), mtp=bool(c.spec_k)))
        ctx = min(mc.max_position_embeddings, (c.num_pages - 1) * c.page_size)
        self._max_pages = kv_cache.pages_for(ctx, c.page_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._ids = itertools.count()
        self.stats = {"steps": 0, "batch_sizes": [], "page_usage": [], "preemptions": 0}

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int = 0, eos: Sequence[int] = ()) -> int:
        mc = self.handle.config
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        validate_sampling_params(temperature, top_p, top_k)
        total = len(prompt) + max_new_tokens + self.cfg.spec_k
        if total > mc.max_position_embeddings:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) overflows the "
                             f"context of {mc.max_position_embeddings} tokens")
        need = kv_cache.pages_for(total, self.cfg.page_size)
        if need > self.pool.num_pages - 1:
            raise ValueError(f"request needs {need} pages of {self.cfg.page_size} tokens but the pool has "
                             f"{self.pool.num_pages - 1}: it could never run")
        r = Request(next(self._ids), prompt, max_new_tokens, float(temperature), float(top_p), int(top_k),
                    int(seed), frozenset(int(e) for e in eos), arrival=time.perf_counter())
        self.waiting.append(r)
        return r.rid

    def cancel(self, rid: int) -> bool:
        """Stop a request now and free its pages; True if it was waiting or running."""
        for q in (self.waiting, self.running):
            for r in list(q):
                if r.rid == rid:
                    q.remove(r)
                    self._finish(r, "cancelled")
                    return True
        return False

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        self.pool.release(r.pages)
        r.pages = []
        self.finished[r.rid] = r

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def _ensure_pages(self, r: Request, upto: int) -> bool:
        need = kv_cache.pages_for(upto, self.cfg.page_size) - len(r.pages)
        if need <= 0:
            return True
        try:
            r.pages += self.pool.allocate(need)
            return True
        except OutOfPages:
            return False

    def _preempt(self, victim: Request) -> None:
        """Requeue `victim` at the front, dropping its cache (recomputed on readmission)."""
        self.running.remove(victim)
        self.pool.release(victim.pages)
        victim.pages, victim.computed, victim.drafts, victim.draft_probs = [], 0, [], None
        victim.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(victim)

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, number of tokens to compute this step) under the token and batch budgets."""
        budget, plan = self.cfg.token_budget, []
        for r in list(self.running):
            if budget <= 0 or len(plan) >= self.cfg.max_batch:
                break
            if r not in self.running:  # preempted by an earlier row of this plan
                continue
            n = min(len(r.tokens) - r.computed, self.cfg.chunk_size, budget)
            if len(r.tokens) - r.computed == 1:
                n = 1 + len(r.drafts)  # decode: last token + its drafts
            while not self._ensure_pages(r, r.computed + n):
                victims = [v for v in self.running if v is not r and v not in (p for p, _ in plan)]
                if not victims:
                    victims = [v for v in self.running if v is not r]
                    if not victims:
                        raise OutOfPages("a single request does not fit the page pool")
                    plan = [(p, k) for p, k in plan if p is not victims[-1]]
                self._preempt(victims[-1])
            plan.append((r, n))
            budget -= n
        while self.waiting and budget > 0 and len(plan) < self.cfg.max_batch:
            r = self.waiting[0]
            if not r.pages:
                hit = self.pool.match_prefix(r.tokens, (len(r.tokens) - 1) // self.cfg.page_size)
                r.pages, r.computed = hit, len(hit) * self.cfg.page_size
                if not r.preemptions:
                    r.cached_tokens = r.computed
            n = min(len(r.tokens) - r.computed, self.cfg.chunk_size, budget)
            if not self._ensure_pages(r, r.computed + n):
                break  # admission control: wait for pages to free up
            self.waiting.popleft()
            self.running.append(r)
            plan.append((r, n))
            budget -= n
        return plan

    # ------------------------------------------------------------------ the device step
    def step(self) -> list[StepEvent]:
        plan = self._schedule()
        if not plan:
            if self.waiting:
                raise OutOfPages("no request can be scheduled: the page pool is too small")
            return []
        c = self.cfg
        k = c.spec_k
        # Static shapes (two compiles per engine): every row padded to max_batch, every block table to
        # the longest a request can need, and T either a decode step (k + 1) or a prefill chunk.
        b, maxp = c.max_batch, self._max_pages
        t = k + 1 if max(n for _, n in plan) <= k + 1 else max(c.chunk_size, k + 1)
        toks = np.zeros((b, t), np.int32)
        start = np.zeros(b, np.int32)
        lens = np.zeros(b, np.int32)
        ndraft = np.zeros(b, np.int32)
        final = np.zeros(b, bool)
        hint = np.zeros(b, np.int32)
        table = np.zeros((b, maxp), np.int32)
        temp, top_p, top_k = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.int32)
        seeds, counters = np.zeros(b, np.int32), np.zeros(b, np.int32)
        qprobs = None
        if k and any(r.draft_probs is not None for r, _ in plan):
            v = self.handle.config.vocab_size
            qprobs = [r.draft_probs if r.draft_probs is not None else jnp.zeros((k, v)) for r, _ in plan]
            qprobs = jnp.stack(qprobs + [jnp.zeros((k, v))] * (b - len(plan)))
        for i, (r, n) in enumerate(plan):
            toks[i, :n] = (r.tokens + r.drafts)[r.computed:r.computed + n]
            start[i], lens[i] = r.computed, n
            is_decode = r.computed + n >= len(r.tokens)
            ndraft[i] = len(r.drafts) if is_decode else 0
            final[i] = is_decode
            hint[i] = r.tokens[r.computed + n] if not is_decode else 0
            table[i, :len(r.pages)] = r.pages
            temp[i], top_p[i], top_k[i] = r.temperature, r.top_p, r.top_k
            seeds[i], counters[i] = r.seed, len(r.output)
        sp = SamplingParams(jnp.asarray(temp), jnp.asarray(top_p), jnp.asarray(top_k))
        with self.handle.mesh_context():  # the MoE runs expert-parallel when traced under a mesh
            out = self._device_step(k, qprobs is not None)(
                self.handle.params, self.cache, jnp.asarray(toks), jnp.asarray(start), jnp.asarray(lens),
                jnp.asarray(table), sp, jnp.asarray(seeds), jnp.asarray(counters), jnp.asarray(ndraft),
                jnp.asarray(final), jnp.asarray(hint), qprobs)
        self.cache = out["cache"]
        new_tokens, n_new = np.asarray(out["tokens"]), np.asarray(out["n_new"])
        drafts = np.asarray(out["drafts"]) if k else None
        now = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["batch_sizes"].append(len(plan))
        self.stats["page_usage"].append(self.pool.num_used / (self.pool.num_pages - 1))
        events = []
        for i, (r, n) in enumerate(plan):
            r.steps += final[i]
            if not final[i]:  # a prefill chunk that does not reach the prompt's end
                r.computed += n
                continue
            accepted = int(n_new[i]) - 1
            r.spec_proposed += int(ndraft[i])
            r.spec_accepted += accepted
            r.computed += n - int(ndraft[i]) + accepted  # roll back past the first rejection
            got = [int(x) for x in new_tokens[i, : n_new[i]]]
            emitted = []
            for tok in got:
                if tok in r.eos:
                    r.finish_reason = "stop"
                    break
                r.output.append(tok)
                emitted.append(tok)
                r.token_times.append(now)
                if len(r.output) >= r.max_new_tokens:
                    r.finish_reason = "length"
                    break
            if r.first_token_at is None and (emitted or r.finish_reason):
                r.first_token_at = now
            # Publish full computed pages (prompt and output) for prefix reuse.
            self.pool.register(r.tokens[: r.computed], r.pages)
            if k and not r.done:
                r.drafts = [int(x) for x in drafts[i]]
                # The draft distribution is needed only to verify sampled rows (greedy compares tokens).
                r.draft_probs = out["draft_probs"][i] if r.temperature > 0 else None
            if r.done:
                reason = r.finish_reason
                self.running.remove(r)
                self._finish(r, reason)
            events.append(StepEvent(r.rid, emitted, r.done))
        return events

    def _device_step(self, k: int, sampled_verify: bool):
        # Compiled steps live on the handle, so engines over the same model share them.
        steps = self.handle.__dict__.setdefault("_engine_steps", {})
        if (k, sampled_verify) not in steps:
            steps[(k, sampled_verify)] = self._build_step(k, sampled_verify)
        return steps[(k, sampled_verify)]

    def _build_step(self, k: int, sampled_verify: bool):
        model = self.handle.model

        def row_keys(seeds, counters, salt):
            def one(s, c):
                return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), c), salt)
            return jax.vmap(one)(seeds, counters)

        def step(params, cache, toks, start, lens, table, sp, seeds, counters, ndraft, final, hint, qprobs):
            b, t = toks.shape
            pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            meta = PageMeta(table, lens)
            logits, hidden, cache = model.apply({"params": params}, toks, pos, cache, meta)
            # Target logits for the last committed token and each draft: rows L-1-ndraft .. L-1.
            base = lens - 1 - ndraft
            idx = jnp.clip(base[:, None] + jnp.arange(k + 1)[None, :], 0, t - 1)  # [B, k+1]
            tgt = jnp.take_along_axis(logits, idx[:, :, None], axis=1)  # [B, k+1, V]
            p = jax.vmap(lambda lg: probs_after_filtering(lg, sp), in_axes=1, out_axes=1)(tgt)  # [B,k+1,V]
            greedy = sp.temperature <= 0
            out_tok = []
            alive = jnp.ones((b,), bool)
            n_new = jnp.zeros((b,), jnp.int32)
            for j in range(k + 1):
                key = row_keys(seeds, counters + j, 1)
                is_draft_slot = j < ndraft
                draft = jnp.take_along_axis(toks, jnp.clip(idx[:, j:j + 1] + 1, 0, t - 1), axis=1)[:, 0]
                pj = p[:, j]
                sampled = jax.vmap(lambda kk, pp: jax.random.categorical(kk, jnp.log(pp)))(key, pj)
                tok_plain = jnp.where(greedy, jnp.argmax(pj, -1), sampled).astype(jnp.int32)
                if sampled_verify and j < k:
                    q = qprobs[:, j]
                    pd = jnp.take_along_axis(pj, draft[:, None], 1)[:, 0]
                    qd = jnp.take_along_axis(q, draft[:, None], 1)[:, 0]
                    u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 7)))(key)
                    acc_s = u * qd <= pd
                    resid = jnp.maximum(pj - q, 0.0)
                    resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, pj)
                    rs = jax.vmap(lambda kk, rr: jax.random.categorical(jax.random.fold_in(kk, 9),
                                                                        jnp.log(rr)))(key, resid)
                    accept = jnp.where(greedy, draft == tok_plain, acc_s)
                    replacement = jnp.where(greedy, tok_plain, rs).astype(jnp.int32)
                else:
                    accept = draft == tok_plain
                    replacement = tok_plain
                accept = accept & is_draft_slot
                emit = jnp.where(accept, draft, jnp.where(is_draft_slot, replacement, tok_plain))
                out_tok.append(jnp.where(alive, emit, 0))
                n_new = n_new + alive.astype(jnp.int32)
                alive = alive & is_draft_slot & accept
            tokens = jnp.stack(out_tok, 1)  # [B, k+1]; the first n_new are valid
            res = {"tokens": tokens, "n_new": n_new, "cache": cache}
            if not k:
                return res
            # MTP: feed (hidden_i, token_{i+1}) for every committed position of this chunk, filling its
            # cache; the draft for the next step comes from the last one. Mid-prefill rows take the next
            # prompt token as token_{i+1}.
            accepted = n_new - 1
            commit = lens - ndraft + accepted  # committed tokens of this chunk
            bonus = jnp.take_along_axis(tokens, accepted[:, None], 1)[:, 0]
            nxt = jnp.where(final, bonus, hint)
            shifted = jnp.concatenate([toks[:, 1:], jnp.zeros((b, 1), toks.dtype)], 1)
            shifted = jnp.where(jnp.arange(t)[None, :] == (commit - 1)[:, None], nxt[:, None], shifted)
            mlog, mh, cache = model.apply({"params": params}, hidden, shifted, pos, cache,
                                          PageMeta(table, commit), method=model.mtp_logits)
            last = (commit - 1)[:, None]
            dl = jnp.take_along_axis(mlog, last[:, :, None], 1)[:, 0]
            dh = jnp.take_along_axis(mh, last[:, :, None], 1)
            dpos = jnp.take_along_axis(pos, last, 1)
            drafts, dprobs = [], []
            for j in range(k):
                q = probs_after_filtering(dl, sp)
                key = row_keys(seeds, counters + accepted + 1 + j, 2)
                s = jax.vmap(lambda kk, qq: jax.random.categorical(kk, jnp.log(qq)))(key, q)
                d = jnp.where(greedy, jnp.argmax(q, -1), s).astype(jnp.int32)
                drafts.append(d)
                dprobs.append(q)
                if j + 1 < k:  # recurse: the MTP layer again, on its own hidden and the draft
                    dpos = dpos + 1
                    one = PageMeta(table, jnp.ones_like(lens))
                    dl3, dh, cache = model.apply({"params": params}, dh, d[:, None], dpos, cache, one,
                                                 method=model.mtp_logits)
                    dl = dl3[:, 0]
            res.update(cache=cache, drafts=jnp.stack(drafts, 1), draft_probs=jnp.stack(dprobs, 1))
            return res

        return jax.jit(step, donate_argnums=(1,))

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

    def engine_stats(self) -> dict[str, float]:
        done = list(self.finished.values())
        prop = sum(r.spec_proposed for r in done)
        return {"steps": self.stats["steps"],
                "mean_batch": float(np.mean(self.stats["batch_sizes"])) if self.stats["batch_sizes"] else 0,
                "peak_page_usage": max(self.stats["page_usage"], default=0.0),
                "prefix_hit_rate": self.pool.hits / self.pool.lookups if self.pool.lookups else 0.0,
                "preemptions": self.stats["preemptions"],
                "mtp_acceptance": sum(r.spec_accepted for r in done) / prop if prop else float("nan")}
