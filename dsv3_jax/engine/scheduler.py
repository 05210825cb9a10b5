"""Request state and the per-step schedule: which sequences compute how many tokens this step.

Owns: `Request` (a sequence's host state), the queues (waiting, running), admission against free
pages (with prefix-cache lookup), per-request page allocation (through paging.PagePool), preemption
when pages run out (the newest running request is requeued and recomputed, never lost), and the
schedule itself: under a token budget (`max_batched_tokens`) and a row budget (`max_batch`), decode
rows first (1 token, or 1 + k drafts), then prefill chunks of running requests, then admission of
waiting ones; long prompts are split into `chunk_size` chunks so one 100K prompt cannot stall the
batch, and while a step carries decode rows its prefill chunks together attend at most
`prefill_attention_pairs` (query, key) pairs (`chunk_tokens_within`): a chunk's attention grows with its
prefix, so a fixed chunk that is cheap at 4K costs ~30x more at 128K and would stretch every decode row's
step; under the cap a chunk at a 128K prefix is ~16 tokens and the decoders' step stays near its own
time (the long prompt's time to first token grows instead; benchmarks/long_context.py measures both).
Steps without decode rows take whole `chunk_size` chunks. The result is a list of `step.RowPlan`s,
plain host data: laying it out (step.py), executing it and committing results (core.py) are separate.
Must not touch device arrays.

Logits processors and constraints (step.py's module docstring): a request's first row after admission is
marked `fresh` (its slot's counts are cleared and its sparse table uploaded, at most
step.TABLE_WIDTH entries per step: admission waits a step beyond that); a request with penalties
skips the prefix cache (the device counts the tokens it computes, so it must compute all of them); a
constrained request is scheduled only once its previous token is committed (its next bitmask depends on
that token), so it advances every other step while other rows keep the pipeline full, and the host fills
its bitmask while the device runs the step in between.

Pipelining: a request whose previous row is still running on the device has one *pending* token
(sampled there, not yet read). The schedule treats it as known-but-remote: the row reads it on device.
Preemption never happens while a step is in flight (`can_preempt=False`): a row that cannot get pages
is left out and the engine drains the in-flight step before the next schedule.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from typing import Any

import numpy as np

from dsv3_jax.engine.paging import OutOfPages, PagePool
from dsv3_jax.engine.sampling import TABLE_WIDTH
from dsv3_jax.engine.step import RowPlan
from dsv3_jax.model import kv_cache


@dataclasses.dataclass(eq=False)  # a request is itself: `in`, `remove` by identity
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    eos: frozenset[int]
    logprobs: int | None = None  # None: off; n: the chosen token's logprob and the top n alternatives
    output: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[Any] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1  # row of the device-resident per-request state while running
    shard: int = 0  # batch shard (DP attention) holding its pages while it has any
    computed: int = 0  # tokens whose latents are in the cache or being written by a dispatched step
    pending: int = 0  # tokens sampled by a dispatched step and not yet committed (0 or 1)
    drafts: list[int] = dataclasses.field(default_factory=list)
    registered_pages: int = 0  # full pages already published to the prefix cache
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # prefix-cache chain so far
    finish_reason: str | None = None
    error: str | None = None
    arrival: float = 0.0
    first_token_at: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    steps: int = 0
    processing: Any = None  # sampling.LogitsProcessing, or None
    table: tuple = ()  # processing.table(eos): uploaded when admitted
    constraint: Any = None  # structured-output matcher (fill_bitmask / advance), or None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, a: int, b: int) -> list[int]:
        """tokens[a:b] (prompt, then output, then drafts) without building the whole list: a 128K
        prompt is sliced every step of its prefill, and every decode row's last token every step (copying
        its output to concatenate the drafts cost 0.54 ms a step for 32 rows of 8,500 output tokens)."""
        p, o = len(self.prompt), len(self.output)
        if b <= p:
            return self.prompt[a:b]
        out = self.prompt[a:] if a < p else []
        a_out, b_out = max(a - p, 0), b - p
        out += self.output[a_out:min(b_out, o)]
        if b_out > o:
            out += self.drafts[max(a_out - o, 0):b_out - o]
        return out

    def metrics(self) -> dict[str, float | None]:
        """Per-request timings (engine clock: compile time excluded); None where undefined."""
        ttft = (self.first_token_at - self.arrival) if self.first_token_at is not None else None
        gaps = np.diff(self.token_times)
        itl = float(np.median(gaps)) if len(gaps) else None
        total = (self.token_times[-1] - self.arrival) if self.token_times else None
        return {"ttft_s": ttft, "inter_token_s": itl,
                "tokens_per_s": len(self.output) / total if total else 0.0,
                "cached_prompt_tokens": self.cached_tokens, "preemptions": self.preemptions,
                "spec_acceptance": self.spec_accepted / self.spec_proposed if self.spec_proposed else None,
                "tokens_per_step": len(self.output) / self.steps if self.steps else None}


def attention_pairs(start: int, n: int) -> int:
    """(query, key) pairs a chunk of n tokens at positions start .. start + n - 1 attends (causal: the
    token at position p sees p + 1 keys); the engine's attention runs one kernel row per token, so its
    cost is proportional to this."""
    return n * start + n * (n + 1) // 2


def chunk_tokens_within(start: int, pairs: int) -> int:
    """The most tokens a chunk starting at `start` may hold so that it attends at most `pairs` pairs
    (0 when not even one token fits)."""
    b = 2 * start + 1
    n = int((math.isqrt(b * b + 8 * max(pairs, 0)) - b) // 2)
    while n > 0 and attention_pairs(start, n) > pairs:  # isqrt rounding
        n -= 1
    while attention_pairs(start, n + 1) <= pairs:
        n += 1
    return n


class Scheduler:
    def __init__(self, pool: PagePool, *, max_batch: int, max_batched_tokens: int, chunk_size: int,
                 spec_k: int, num_slots: int, prefill_attention_pairs: int = 0):
        """`prefill_attention_pairs`: while a step carries decode rows, its prefill chunks together attend
        at most this many (query, key) pairs (each prefill row still gets >= 1 token while any pairs are
        left, so a prefill always progresses); 0: no cap."""
        if prefill_attention_pairs < 0:
            raise ValueError(f"prefill_attention_pairs must be >= 0 (0: no cap), "
                             f"got {prefill_attention_pairs}")
        self.pool = pool
        self.max_batch, self.budget, self.chunk = max_batch, max_batched_tokens, chunk_size
        self.attention_cap = prefill_attention_pairs
        self.spec_k = spec_k
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.preemptions = 0
        self.ids = itertools.count()

    # ------------------------------------------------------------------ pages and slots
    def ensure_pages(self, r: Request, upto: int) -> bool:
        need = kv_cache.pages_for(upto, self.pool.page_size) - len(r.pages)
        if need <= 0:
            return True
        try:
            r.pages += self.pool.allocate(need, shard=r.shard)
            return True
        except OutOfPages:
            return False

    def release(self, r: Request) -> None:
        self.pool.release(r.pages)
        r.pages = []
        if r.slot >= 0:
            self.free_slots.append(r.slot)
            r.slot = -1

    def remove(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self.release(r)

    def preempt(self, victim: Request) -> None:
        """Requeue `victim` at the front, dropping its cache (recomputed on readmission)."""
        self.running.remove(victim)
        self.release(victim)
        victim.computed, victim.drafts, victim.registered_pages = 0, [], 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

    # ------------------------------------------------------------------ the schedule
    def _row(self, r: Request, n: int, fresh: bool = False) -> RowPlan:
        end = r.known + r.pending  # the sequence's length including the pending token
        start = r.computed
        final = start + n >= end
        chunk = r.token_slice(start, start + n if not r.pending else min(start + n, r.known))
        pending_last = bool(r.pending) and start + n == end
        ndraft = len(r.drafts) if final and r.drafts else 0
        hint = r.token_slice(start + n, start + n + 1)[0] if not final and start + n < r.known else 0
        return RowPlan(r.rid, r.slot, start, chunk, n, pending_last, final, ndraft, hint, list(r.pages),
                       r.temperature, r.top_p, r.top_k, r.seed, len(r.output) + r.pending, r.shard,
                       r.processing, fresh, len(r.prompt), r.table if fresh else (), r.constraint is not None)

    def pick_shard(self, r: Request) -> int:
        """DP attention: the batch shard for a request being admitted: the fewest running sequences,
        then the most obtainable pages, then the longest cached prefix of its tokens."""
        if self.pool.shards == 1:
            return 0
        load = [0] * self.pool.shards
        for q in self.running:
            load[q.shard] += 1
        cap = (r.known - 1) // self.pool.page_size
        return min(range(self.pool.shards), key=lambda s: (load[s], -self.pool.free_in(s),
                                                           -self.pool.cached_prefix(r.tokens, cap, s), s))

    def schedule(self, can_preempt: bool = True) -> tuple[list[tuple[Request, RowPlan]], bool]:
        """Rows for one step and whether some row was left out for want of pages (then the engine
        should drain the in-flight step before the next schedule so preemption can run)."""
        budget, plan, starved = self.budget, [], False
        planned: set[int] = set()

        def remaining(r: Request) -> int:
            return r.known + r.pending - r.computed

        def wants(r: Request) -> bool:
            if r.constraint is not None and r.pending:
                return False  # its bitmask needs the token still on the device
            return len(r.output) + r.pending < r.max_new_tokens and remaining(r) > 0

        decode = [r for r in self.running if wants(r) and remaining(r) == 1]
        prefill = [r for r in self.running if wants(r) and remaining(r) > 1]
        # The attention cap on prefill chunks holds only in steps that carry decode rows (whose time it
        # protects); `pairs_left` is None when uncapped.
        pairs_left: list[int | None] = [None]

        def chunk(r: Request, start: int) -> int:
            n = min(remaining(r), self.chunk, budget)
            if pairs_left[0] is not None:
                n = min(n, max(chunk_tokens_within(start, pairs_left[0]), 1 if pairs_left[0] > 0 else 0))
            return n

        def spend(start: int, n: int) -> None:
            if pairs_left[0] is not None:
                pairs_left[0] = max(pairs_left[0] - attention_pairs(start, n), 0)

        for r in decode + prefill:
            if budget <= 0 or len(plan) >= self.max_batch:
                break
            if r not in self.running:  # preempted by an earlier row of this plan
                continue
            if (remaining(r) > 1 and pairs_left[0] is None and self.attention_cap
                    and any(remaining(p) == 1 for p, _ in plan)):
                pairs_left[0] = self.attention_cap  # the plan holds decode rows (they come first)
            n = 1 + len(r.drafts) if remaining(r) == 1 else chunk(r, r.computed)
            if n <= 0:
                continue
            while not self.ensure_pages(r, r.computed + n):
                if not can_preempt:
                    starved = True
                    break
                victims = [v for v in self.running if v is not r and v.rid not in planned]
                if not victims:
                    victims = [v for v in self.running if v is not r]
                    if not victims:
                        raise OutOfPages("a single request does not fit the page pool")
                    plan = [(p, row) for p, row in plan if p is not victims[-1]]
                    planned.discard(victims[-1].rid)
                self.preempt(victims[-1])
            else:
                if remaining(r) > 1:
                    spend(r.computed, n)
                plan.append((r, self._row(r, n)))
                planned.add(r.rid)
                budget -= n
        if pairs_left[0] is None and self.attention_cap and any(remaining(r) == 1 for r, _ in plan):
            pairs_left[0] = self.attention_cap
        table_left = TABLE_WIDTH  # sparse-table entries this step may upload
        while (self.waiting and budget > 0 and len(plan) < self.max_batch and not starved
               and len(self.running) < self.max_batch):
            r = self.waiting[0]
            if len(r.table) > table_left:
                break  # its table uploads next step
            if not r.pages:
                r.shard = self.pick_shard(r)
                # Penalties count every token on the device as it is computed: nothing from the cache.
                reuse = 0 if r.processing is not None and r.processing.penalties else \
                    (r.known - 1) // self.pool.page_size
                hit = self.pool.match_prefix(r.tokens, reuse, shard=r.shard) if reuse else []
                r.pages, r.computed = hit, len(hit) * self.pool.page_size
                r.registered_pages = len(hit)
                if not r.preemptions:
                    r.cached_tokens = r.computed
            n = chunk(r, r.computed)
            if n <= 0:
                break  # this step's prefill attention is spent; admit it next step
            if not self.ensure_pages(r, r.computed + n):
                break  # admission control: wait for pages to free up
            self.waiting.popleft()
            r.slot = self.free_slots.pop()
            self.running.append(r)
            spend(r.computed, n)
            plan.append((r, self._row(r, n, fresh=True)))
            table_left -= len(r.table)
            budget -= n
        return plan, starved
