"""The engine's contract: what the request layer (request_stream.py), the server (serve/) and the
benchmarks may rely on, and nothing else.

Owns: `EngineConfig` (capacities and switches), `FinishReason` (why a request ended), `TokenLogprob`
and `StepEvent` (what a step reports per request), `MAX_LOGPROBS` (the top-n bound a request may ask
for), `pages_needed` and `check_request` (the one place a prompt, its length and its logprobs are
checked against the model: every layer above calls this, none re-implements it), and `EngineProtocol`,
the methods a driver calls. Rules the types below do not show:

- An engine is single-threaded: one thread calls every method (serve/runner.py owns that thread).
- `add_request` raises ValueError naming the argument for a request that could never run (empty
  prompt, token ids outside the vocabulary, prompt + max_new_tokens + spec_k beyond the context, more
  pages than one batch shard of the pool holds, logprobs outside 0..MAX_LOGPROBS); nothing is queued.
- `step()` returns the events the step finished; with pipelining a request's tokens arrive one device
  step after they were scheduled. Every request ends with exactly one event whose `finished` is True,
  carrying its `finish_reason` (and `error` when that is ERROR); a cancelled request's final event is
  produced by `cancel` itself (it returns True), not by a later step.
- `warmup()` compiles every program a load can use; a compile after it is counted in
  `engine_stats()["compiles_after_warmup"]` and logged.

Must not import the engine's implementation (core.py) or run anything: this module is read by people and
type checkers, and imported by code that never builds an engine.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dsv3_jax.model.kv_cache import PAGE_SIZE
from dsv3_jax.model.layout import canonical_kv_cache_dtype

MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (OpenAI's bound)


class FinishReason(enum.StrEnum):
    """Why a request ended. A StrEnum: it compares equal to, and serializes as, its value."""

    STOP = "stop"  # an end-of-sequence token (or, above the engine, a stop string)
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # the caller cancelled it (client disconnect, stop string)
    ERROR = "error"  # the step failed for this request (e.g. non-finite logits); `error` says why


@dataclasses.dataclass
class EngineConfig:
    num_pages: int = 256  # pages in the pool (page 0 of each batch shard is scratch)
    page_size: int = PAGE_SIZE
    max_batch: int = 256  # sequences per step
    max_batched_tokens: int = 2048  # token budget per step (prefill chunks + decode tokens)
    chunk_size: int = 512  # longest prefill chunk of one request per step
    # While a step carries decode rows, its prefill chunks attend at most this many (query, key) pairs
    # (scheduler.py): 2**21 = a 512-token chunk at a 4K prefix, ~16 tokens at 128K; 0 = no cap. Spread over
    # the GPU (the MLA kernel's long-row splits, mla_decode.split_plan) that is 2**21 x 128 heads x 2,176
    # FLOP = 0.58 TFLOP, ~1.2 ms a layer at any prefix; 2**20 halves that and doubles the long prompt's TTFT.
    # Measured on an H100 (2026-12-07, RESULTS.md): 32 decoders beside a 128K prompt at 2**20 kept their p99
    # ITL at 1.94x their p50 (goal 2x); the long prompt took 172 s. 2**21 stays the default: it halves the
    # prefill steps of short prompts under load (gpu_smoke's 64 x 1K load), and 2**20 has not been timed
    # there. `serve --prefill-attention-pairs` sets it.
    prefill_attention_pairs: int = 2**21
    # A step that holds only one sequence's prefill chunk, starting at a prefix of at least this many tokens,
    # attends in naive form (model/long_prefill.py: the prefix's latents expanded to per-head K/V, flash
    # attention): 3.4x fewer attention FLOPs than the absorbed form, the prefill path for long prompts.
    # Only chunks that fill the step shape a whole `chunk_size` chunk picks take it: one more program
    # (always the full mode). On an H100 a 128K prompt's TTFT was 9.8 s with it (2026-12-07), 53% of the
    # naive-form compute floor; 26.7 s without it (2026-12-05, absorbed). 0 = off
    # (`serve --long-prefill-from 0`).
    # The pool planner reserves its transient K/V block (long_prefill.transient_bytes: 5.2 GB at 128 heads
    # and 4K-token steps, 0.5 GB at 16 heads and 2K). Engines whose sequences cannot reach the prefix
    # (pool or context under it) compile nothing for it.
    long_prefill_from: int = 16384
    prefix_caching: bool = True
    spec_k: int = 0  # MTP draft tokens per step (0 = off, 1..3)
    pipeline: bool = True  # dispatch step k+1 before reading step k (off: one step at a time)
    # Step shapes (step.StepShapes): decode capacities of these row counts and max_batch (default 4, 32),
    # mixed/prefill capacities of these token counts and max_batched_tokens (default: the budget only).
    # Each pair compiles twice (greedy and full); the defaults give at most 8 programs.
    token_buckets: tuple[int, ...] = ()
    row_buckets: tuple[int, ...] = ()
    # XLA options for compiling the step, e.g. {"xla_gpu_enable_command_buffer": "FUSION,...,WHILE"}
    # (benchmarks/engine_bench.py measures such choices on the GPU).
    compiler_options: dict[str, Any] | None = None
    # The KV cache's dtype (vLLM's --kv-cache-dtype): "auto" the model's compute dtype, "bf16", or "fp8" (the
    # FP8 latent cache, 656 instead of 1,152 bytes per token per layer: layout.cache_layout); None: the
    # handle's (dsv3_jax.load(kv_cache_dtype=...), default "auto").
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        self.token_buckets = tuple(int(t) for t in self.token_buckets)
        self.row_buckets = tuple(int(r) for r in self.row_buckets)
        if self.kv_cache_dtype is not None:
            self.kv_cache_dtype = canonical_kv_cache_dtype(self.kv_cache_dtype)


@dataclasses.dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first; as many as the request asked


@dataclasses.dataclass
class StepEvent:
    rid: int
    new_tokens: list[int]
    finished: bool
    finish_reason: FinishReason | None = None  # set when finished
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    error: str | None = None  # set when finish_reason is ERROR


def pages_needed(prompt_len: int, max_new_tokens: int, spec_k: int, page_size: int) -> int:
    """Pages a request may hold at its longest (drafts included)."""
    return -(-(prompt_len + max_new_tokens + spec_k) // page_size)


def check_request(prompt: Sequence[int], max_new_tokens: int, *, vocab_size: int, context: int,
                  spec_k: int = 0, logprobs: int | None = None, what: str = "prompt") -> None:
    """Raise ValueError naming the problem for a request the model cannot take: empty prompt, token ids
    outside [0, vocab_size), a non-positive max_new_tokens, prompt + max_new_tokens + spec_k beyond
    `context` tokens, logprobs outside 0..MAX_LOGPROBS."""
    if len(prompt) == 0:
        raise ValueError(f"{what} is empty")
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral)
            or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"{what} has token ids outside [0, {vocab_size})")
    if len(prompt) + max_new_tokens + spec_k > context:
        extra = f" + {spec_k} draft tokens" if spec_k else ""
        raise ValueError(f"{what} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}){extra} "
                         f"overflows the context of {context} tokens")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, numbers.Integral)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS} (or None), got {logprobs!r}")


class EngineProtocol(Protocol):
    """What a driver (request_stream.py, serve/runner.py) calls; `core.Engine` implements it."""

    cfg: EngineConfig

    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int = 0, eos: Sequence[int] = (),
                    logprobs: int | None = None, processing: Any = None, constraint: Any = None) -> int:
        """`processing`: sampling.LogitsProcessing (penalties, logit_bias, min_p, min_tokens on the device);
        `constraint`: a structured-output matcher (structured.Constraint). Both optional."""
        ...

    def cancel(self, rid: int) -> bool: ...

    def step(self) -> list[StepEvent]: ...

    def has_work(self) -> bool: ...

    def warmup(self, max_rows: int | None = None, max_tokens: int | None = None,
               modes: Sequence[str] = ("greedy", "full"),
               progress: Callable[..., None] | None = None, workers: int | None = None) -> float: ...

    def engine_stats(self) -> dict[str, Any]: ...
