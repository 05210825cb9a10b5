"""Generation on top of the serving engine: what `handle.generate` and the CLI call.

Owns: per-prompt generation settings (`PromptParams`: what one server request carries), sizing an engine
for a batch of prompts, stop strings (`StopMatcher`, shared with the server; a hit cancels the request in
the engine), streaming text through the incremental detokenizer, and results with timings and logprobs.
Decoding itself (ragged steps on device, sampling, MTP), request validation and pages-needed are the
engine's; placing page pools on a mesh is sharding.py's. Imports the engine, never the other way
round. Must not parse CLI flags or files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from dsv3_jax.engine.api import EngineConfig, TokenLogprob, check_request, pages_needed
from dsv3_jax.engine.core import Engine
from dsv3_jax.engine.sampling import MAX_LOGPROBS, validate_sampling_params
from dsv3_jax.model import kv_cache
from dsv3_jax.parallel import sharding
from dsv3_jax.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass(frozen=True)
class PromptParams:
    """One prompt's settings: sampling (temperature 0 = greedy), length, seed, stop strings, and
    `logprobs` = how many top alternatives to return with each token's logprob (None: no logprobs)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        kw = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
              "top_k": self.top_k, "seed": self.seed}
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
        return kw


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that could still start one (so
    no piece of a stop string is ever emitted); the pieces concatenate to the cut text."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""

    def feed(self, piece: str) -> str:
        """The part of `piece` (plus held text) that is safe to emit; sets `stopped` on a hit."""
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        buf = self._held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)]
        keep = held_tail(buf, self.stops)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


def held_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers` (may still grow)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class GenerationError(RuntimeError):
    """A request failed on device (e.g. non-finite logits); the message is one line."""


@dataclasses.dataclass
class GenerationResult:
    """One prompt's outcome. `finish_reason`: "stop" (EOS or a stop string) or "length".
    Times exclude compilation; `time_to_first_token_s` is None if no token came."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    time_to_first_token_s: float | None
    decode_tokens_per_s: float
    total_time_s: float
    metrics: dict[str, float | None] = dataclasses.field(default_factory=dict)  # engine per-request metrics
    logprobs: list[TokenLogprob] | None = None  # one per token id when asked: logprob + top alternatives

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stream(handle: Any, prompts: Sequence[Sequence[int]], params: Sequence[PromptParams], *,
           eos_ids: Sequence[int] = (), tokenizer: Tokenizer | None = None, spec_k: int = 0,
           warmup_progress: Callable[..., None] | None = None
           ) -> Iterator[tuple[int, str, GenerationResult | None]]:
    """Run `prompts` (with `params[i]` each) through a serving engine sized for them; yield
    (prompt index, new text piece, result-or-None), the result when a prompt ends.

    With `warmup_progress` (see `Engine.warmup`'s `progress`), every step program these prompts can
    use is compiled before the first step (the CLI shows it); otherwise programs compile on first use."""
    cfg = handle.config
    prompts = [list(map(int, p)) for p in prompts]
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} parameter sets for {len(prompts)} prompts")
    _validate(cfg, prompts, params)
    if any(p.stop for p in params) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (this checkpoint has none)")
    ps = kv_cache.PAGE_SIZE
    pages = sum(pages_needed(len(p), q.max_new_tokens, spec_k, ps) for p, q in zip(prompts, params))
    # Power-of-two pool and row-slot sizes: repeated calls reuse the compiled steps.
    # DP attention: every batch shard's slice can hold them all (each device keeps one slice, so per
    # device this is the one-device pool).
    shards = 1 if handle.mesh is None else sharding.batch_multiple(handle.mesh)
    sizing = {"num_pages": shards * (1 + _pow2(pages)), "max_batch": max(_pow2(len(prompts)), 64),
              **getattr(handle, "engine_defaults", {})}  # flags and the plan-sized pool (parallel_cli)
    ecfg = EngineConfig(page_size=ps, spec_k=spec_k, **sizing)
    eng = Engine(handle, ecfg)
    if warmup_progress is not None:
        # A step holds at most one chunk (or decode row) of each prompt: the programs beyond never run.
        most = sum(max(min(len(p), ecfg.chunk_size), spec_k + 1) for p in prompts)
        modes = {"full" if q.temperature > 0 or q.logprobs is not None else "greedy" for q in params}
        eng.warmup(max_rows=len(prompts), max_tokens=most, modes=sorted(modes), progress=warmup_progress)
    rids = {eng.add_request(p, eos=eos_ids, **q.engine_kwargs()): i
            for i, (p, q) in enumerate(zip(prompts, params))}
    detok = {r: IncrementalDetokenizer(tokenizer) if tokenizer else None for r in rids}
    stops = {r: StopMatcher(params[i].stop) for r, i in rids.items()}
    texts = {r: "" for r in rids}
    lps: dict[int, list[TokenLogprob] | None] = {r: [] if params[i].logprobs is not None else None
                                                 for r, i in rids.items()}
    stopped: set[int] = set()
    t0 = eng.clock()
    while eng.has_work():
        for ev in eng.step():
            if ev.rid in stopped:
                continue  # its stop string was hit; this is the cancelled request's last word
            i, d, m = rids[ev.rid], detok[ev.rid], stops[ev.rid]
            if lps[ev.rid] is not None and ev.logprobs:
                lps[ev.rid] += ev.logprobs
            for tok in ev.new_tokens:
                piece = m.feed(d.add(tok)) if d else ""
                texts[ev.rid] += piece
                if piece:
                    yield i, piece, None
                if m.stopped:
                    break
            if m.stopped:
                stopped.add(ev.rid)
                if not ev.finished:
                    eng.cancel(ev.rid)
            if ev.finish_reason == "error":
                for rid in rids:
                    eng.cancel(rid)
                raise GenerationError(f"prompt {i}: {ev.error}")
            if ev.finished or m.stopped:
                yield from _result(eng, ev.rid, i, texts, d, m, tokenizer, stopped, lps[ev.rid], t0)


def _result(eng, rid, i, texts, d, m, tokenizer, stopped, lps, t0):
    r = eng.finished[rid]
    reason = "stop" if rid in stopped else r.finish_reason
    if d and rid not in stopped:
        tail = m.feed(d.flush()) + m.flush()  # bytes held by the detokenizer, text held by the stop matcher
        if m.stopped:
            reason = "stop"
        texts[rid] += tail
        if tail:
            yield i, tail, None
    metrics = r.metrics()
    total = eng.clock() - t0
    ttft = metrics["ttft_s"]
    n_dec = max(len(r.output) - 1, 0)
    rate = n_dec / (total - ttft) if n_dec and ttft is not None and total > ttft else 0.0
    yield i, "", GenerationResult(r.prompt, r.output, texts[rid] if tokenizer else None, reason, ttft, rate,
                                  total, metrics, lps[: len(r.output)] if lps is not None else None)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _validate(cfg: Any, prompts: list[list[int]], params: Sequence[PromptParams]) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, (p, q) in enumerate(zip(prompts, params)):
        check_request(p, q.max_new_tokens, vocab_size=cfg.vocab_size, context=cfg.max_position_embeddings,
                      what=f"prompt {i}")


def prompt_params(n: int, defaults: dict[str, Any], *, max_new_tokens: Any = 64, temperature: Any = None,
                  top_p: Any = None, top_k: Any = None, seed: Any = 0, stop: Any = None,
                  logprobs: Any = None) -> list[PromptParams]:
    """`n` PromptParams from values given once for all prompts or as one-per-prompt lists (ValueError
    naming the argument on a length mismatch); sampling defaults from generation_config (`defaults`)."""
    def each(name: str, value: Any) -> list[Any]:
        if isinstance(value, list | tuple) or (hasattr(value, "ndim") and value.ndim == 1):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} values for {n} prompts")
            return list(value)
        return [value] * n

    if isinstance(stop, str) or stop is None:
        stops = [(stop,) if stop else ()] * n
    elif all(isinstance(s, str) for s in stop):
        stops = [tuple(stop)] * n
    else:
        stops = [(x,) if isinstance(x, str) else tuple(x or ()) for x in each("stop", stop)]
    seeds = [int(seed) + i for i in range(n)] if isinstance(seed, int | np.integer) else each("seed", seed)
    out = []
    for i, (m, t, p, k, lp) in enumerate(zip(each("max_new_tokens", max_new_tokens),
                                             each("temperature", temperature), each("top_p", top_p),
                                             each("top_k", top_k), each("logprobs", logprobs))):
        s = sampling_settings(defaults, t, p, k)
        validate_sampling_params(s["temperature"], s["top_p"], s["top_k"], seed=seeds[i])  # int32 seeds
        if not isinstance(m, int | np.integer) or isinstance(m, bool) or m < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {m!r}")
        if lp is not None and not (isinstance(lp, int | np.integer) and 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS} (or None), got {lp!r}")
        out.append(PromptParams(int(m), s["temperature"], s["top_p"], s["top_k"], int(seeds[i]), stops[i],
                                None if lp is None else int(lp)))
    return out


def sampling_settings(defaults: dict[str, Any], temperature: float | None, top_p: float | None,
                      top_k: int | None) -> dict[str, float]:
    """Flags override the checkpoint's generation_config defaults; temperature 0 is greedy."""
    t = defaults.get("temperature", 1.0) if temperature is None else temperature
    p = defaults.get("top_p", 1.0) if top_p is None else top_p
    k = defaults.get("top_k", 0) if top_k is None else top_k
    validate_sampling_params(t, p, k)
    return {"temperature": float(t), "top_p": float(p), "top_k": int(k)}
