"""The request-stream layer: one request from its parameters to a stream of typed deltas. `handle.generate`
(api.py), the `generate` CLI (through it) and the server (serve/runner.py + serve/app.py) all use it.

Owns, for one request (prompt ids + parameters):
- resolving its parameters once (`resolve`: generation_config defaults -> explicit values, a
  `RequestParams`; `batch_params` does it for a batch given per prompt or once for all);
- checking it once before any engine sees it (`check`: engine/api.check_request and the sampling
  ranges against `Limits`, the model's and the engine's bounds; `RequestInvalid` names the field at
  fault). `Limits.room` is what "all that fits" means for a prompt. No other layer re-checks context,
  token range or logprobs (the engine's `add_request` applies the same contract as its own guard);
- turning its engine events into `Delta`s (`RequestStream`): token ids, text through the incremental
  detokenizer, stop strings (`StopMatcher`: no piece of a stop string is ever emitted; a hit ends the
  stream with `FinishReason.STOP` and the driver cancels the request in its engine), logprobs, and
  exactly one final delta carrying a `FinishReason` (engine/api.py);
- the offline driver (`stream`): one engine sized for a batch of prompts (`engine_config`), results
  with timings (`GenerationResult`).
Must not parse CLI flags, files or HTTP bodies, format the OpenAI wire (serve/), implement decoding
(engine/), or call an engine from more than one thread. Imports the engine, never the other way round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dsv3_jax.engine.api import (
    EngineConfig,
    FinishReason,
    StepEvent,
    TokenLogprob,
    check_request,
    pages_needed,
)
from dsv3_jax.engine.core import Engine
from dsv3_jax.engine.sampling import (
    LogitsProcessing,
    apply_defaults,
    validate_processing,
    validate_sampling_params,
)
from dsv3_jax.model import kv_cache
from dsv3_jax.parallel import sharding
from dsv3_jax.text.tokenizer import IncrementalDetokenizer, Tokenizer

# ------------------------------------------------------------------------------- parameters and checks


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's settings, every default already applied: sampling (temperature 0 = greedy), length,
    seed, stop strings, `logprobs` = how many top alternatives to return with each token's logprob (None:
    no logprobs), the token ids that end it (`eos`, empty: none; stop_token_ids join them), the logits
    processors (`processing`: penalties, logit_bias, min_p, min_tokens; engine/sampling.py), a structured
    output grammar (`structured`: structured.Grammar, None: free text) and whether a stop string that
    ends the text stays in it (`include_stop_str_in_output`)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    eos: tuple[int, ...] = ()
    processing: LogitsProcessing = LogitsProcessing()
    structured: Any = None  # structured.Grammar
    include_stop_str_in_output: bool = False

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `EngineProtocol.add_request` (processing and a fresh constraint only
        when the request has them). A structured request gets a new matcher on each call."""
        kw = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
              "top_k": self.top_k, "seed": self.seed, "eos": list(self.eos), "logprobs": self.logprobs}
        if self.processing.active:
            kw["processing"] = self.processing
        if self.structured is not None:
            kw["constraint"] = self.structured.constraint()
        return kw


def resolve(defaults: Mapping[str, Any], *, max_new_tokens: Any, temperature: Any = None, top_p: Any = None,
            top_k: Any = None, seed: Any = 0, stop: Sequence[str] = (), logprobs: Any = None,
            eos: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
            processing: LogitsProcessing | Mapping[str, Any] | None = None, structured: Any = None,
            include_stop_str_in_output: bool = False) -> RequestParams:
    """The one place a request's parameters are resolved: None takes the checkpoint's generation_config
    default (`defaults`, see sampling.apply_defaults); `stop_token_ids` end the request like `eos`;
    `processing` is a LogitsProcessing or its fields by name (None values: off; logit_bias as a
    {token: bias} mapping or pairs). Values are not checked here (`check` does)."""
    t, p, k = apply_defaults(defaults, temperature, top_p, top_k)
    if isinstance(processing, Mapping):
        given = {name: v for name, v in processing.items() if v is not None}
        bias = given.get("logit_bias", ())
        given["logit_bias"] = tuple((_plain(a), _plain(b)) for a, b in
                                    (bias.items() if isinstance(bias, Mapping) else bias))
        processing = LogitsProcessing(**given)
    ends = tuple(dict.fromkeys(int(e) for e in (*eos, *stop_token_ids)))
    return RequestParams(_plain(max_new_tokens), _plain(t), _plain(p), _plain(k), _plain(seed),
                         tuple(s for s in stop if s), _plain(logprobs), ends,
                         processing or LogitsProcessing(), structured, bool(include_stop_str_in_output))


def _plain(x: Any) -> Any:
    """numpy scalars as Python numbers (frozen params compare and print plainly); anything else as is."""
    return x.item() if isinstance(x, np.generic) else x


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request must fit: the model's vocabulary and context, the engine's draft tokens per step,
    and (a server's fixed page pool) the tokens one request may hold."""

    vocab_size: int
    context: int
    spec_k: int = 0
    pool_tokens: int | None = None

    @classmethod
    def of(cls, model_config: Any, engine_config: EngineConfig | None = None, *, spec_k: int = 0) -> Limits:
        """A model's limits; with `engine_config`, also its pool (page 0 is scratch) and its spec_k."""
        if engine_config is None:
            return cls(model_config.vocab_size, model_config.max_position_embeddings, spec_k)
        ec = engine_config
        return cls(model_config.vocab_size, model_config.max_position_embeddings, ec.spec_k,
                   (ec.num_pages - 1) * ec.page_size)

    @property
    def capacity(self) -> int:
        """Tokens one request may span: prompt + generated + drafts."""
        return self.context if self.pool_tokens is None else min(self.context, self.pool_tokens)

    def room(self, prompt_len: int) -> int:
        """New tokens a prompt of `prompt_len` tokens leaves room for (< 1: the prompt cannot run)."""
        return self.capacity - prompt_len - self.spec_k


class RequestInvalid(ValueError):
    """A request no engine could run. `field`: the parameter at fault ("prompt", "max_new_tokens",
    "logprobs", a logits processor's name, e.g. "min_p" or "logit_bias", or None for a sampling value,
    which the message names)."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


def check(prompt: Sequence[int], params: RequestParams, limits: Limits, *, what: str = "prompt") -> None:
    """Raise RequestInvalid for a request that could never run: engine/api.check_request (empty prompt,
    token ids outside the vocabulary, a non-positive max_new_tokens, prompt + max_new_tokens + drafts
    beyond `limits.capacity`, logprobs outside 0..MAX_LOGPROBS) and the sampling ranges (int32 seed)."""
    p = params
    try:
        validate_sampling_params(p.temperature, p.top_p, p.top_k, seed=p.seed)
    except ValueError as e:
        raise RequestInvalid(str(e), None) from None
    try:
        validate_processing(p.processing, limits.vocab_size, p.eos, p.max_new_tokens)
    except ValueError as e:  # each message starts with the field's name
        raise RequestInvalid(str(e), str(e).split()[0].rstrip(":")) from None
    bad = [e for e in p.eos if not 0 <= e < limits.vocab_size]
    if bad:
        raise RequestInvalid(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {limits.vocab_size})",
                             "stop_token_ids")
    kw = dict(vocab_size=limits.vocab_size, context=limits.capacity, spec_k=limits.spec_k, what=what)
    try:
        check_request(prompt, p.max_new_tokens, logprobs=p.logprobs, **kw)
    except ValueError as e:
        # The field at fault: the first argument whose addition makes the same check fail.
        field = "logprobs"
        for name, m in (("prompt", 1), ("max_new_tokens", p.max_new_tokens)):
            try:
                check_request(prompt, m, **kw)
            except ValueError:
                field = name
                break
        raise RequestInvalid(str(e), field) from None


def batch_params(n: int, defaults: Mapping[str, Any], *, max_new_tokens: Any = 64, temperature: Any = None,
                 top_p: Any = None, top_k: Any = None, seed: Any = 0, stop: Any = None, logprobs: Any = None,
                 eos: Sequence[int] = ()) -> list[RequestParams]:
    """`n` RequestParams (`resolve` each) from values given once for all prompts or as one-per-prompt
    lists (ValueError naming the argument on a length mismatch). A single integer seed gives prompt i
    the seed `seed + i`; `stop` is a string or list of strings for all, or a list of lists (or None)."""
    def each(name: str, value: Any) -> list[Any]:
        if isinstance(value, list | tuple) or (isinstance(value, np.ndarray) and value.ndim == 1):
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
    return [resolve(defaults, max_new_tokens=m, temperature=t, top_p=p, top_k=k, seed=s, stop=st,
                    logprobs=lp, eos=eos)
            for m, t, p, k, s, st, lp in zip(each("max_new_tokens", max_new_tokens),
                                             each("temperature", temperature), each("top_p", top_p),
                                             each("top_k", top_k), seeds, stops, each("logprobs", logprobs))]


# ------------------------------------------------------------------------------------------ the stream


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that could still start one (so
    no piece of a stop string is ever emitted, unless `include` keeps the stop string that ends the text);
    the pieces concatenate to the cut text."""

    def __init__(self, stops: Sequence[str] = (), include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self.stopped = False
        self._held = ""

    def feed(self, piece: str) -> str:
        """The part of `piece` (plus held text) that is safe to emit; sets `stopped` on a hit."""
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        buf = self._held + piece
        hits = [(i, -len(s)) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            i, minus_len = min(hits)  # the earliest; of those starting there, the longest
            return buf[: i - minus_len] if self.include else buf[:i]
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


@dataclasses.dataclass
class Delta:
    """What one engine event adds to a request's stream. The last delta of a stream has `finish_reason`."""

    token_ids: list[int]  # every token the engine produced in this event (text may stop short of them)
    text: str = ""  # "" without a tokenizer
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # one per token id when asked
    finish_reason: FinishReason | None = None
    error: str | None = None  # with ERROR: why
    rejected: bool = False  # with ERROR: the engine refused the request (the caller's fault, not a failure)
    by_stop_string: bool = False  # with STOP: a stop string ended it (not an end-of-sequence token)
    cached_tokens: int = 0  # final delta: prompt tokens the engine served from its prefix cache


class RequestStream:
    """One request's stream state: feed it the request's engine events (`on_event`), get `Delta`s.

    Single-threaded like the engine it follows. When `on_event` returns a final delta for an event that
    did not finish the request (a stop string was hit), the driver must `cancel` the request in its
    engine. `cancel`, `reject` and `fail` end a stream the engine will not finish itself.
    """

    def __init__(self, params: RequestParams, tokenizer: Tokenizer | None = None, *,
                 skip_special_tokens: bool = False):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this checkpoint has none)")
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stop = StopMatcher(params.stop, params.include_stop_str_in_output)
        # vLLM: stop strings are looked for only in text after the first min_tokens tokens.
        self.min_tokens = params.processing.min_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def on_event(self, ev: StepEvent) -> Delta:
        if self.done:
            raise RuntimeError(f"request {ev.rid}: event after the stream ended ({self.finish_reason})")
        d = Delta(list(ev.new_tokens))
        self.token_ids += d.token_ids
        if self.logprobs is not None and ev.logprobs:
            d.logprobs = list(ev.logprobs)
            self.logprobs += d.logprobs
        if self.detok is not None:
            pieces = []
            for k, tok in enumerate(d.token_ids):
                piece = self.detok.add(tok)
                before_min = len(self.token_ids) - len(d.token_ids) + k < self.min_tokens
                pieces.append(piece if before_min else self.stop.feed(piece))
                if self.stop.stopped:
                    break
            d.text = "".join(pieces)
        if self.stop.stopped:
            return self._end(d, FinishReason.STOP)
        if ev.finished:
            return self._end(d, ev.finish_reason, ev.error)
        self.text += d.text
        return d

    def cancel(self) -> Delta:
        """The final delta of a request cancelled by its caller (e.g. the client went away)."""
        return self._end(Delta([]), FinishReason.CANCELLED)

    def reject(self, message: str) -> Delta:
        """The final delta of a request its engine refused (`add_request` raised ValueError)."""
        return self._end(Delta([], rejected=True), FinishReason.ERROR, message)

    def fail(self, message: str) -> Delta:
        """The final delta of a request whose engine failed (or shut down) under it."""
        return self._end(Delta([]), FinishReason.ERROR, message)

    def _end(self, d: Delta, reason: FinishReason, error: str | None = None) -> Delta:
        if self.detok is not None and reason != FinishReason.ERROR and not self.stop.stopped:
            d.text += self.stop.feed(self.detok.flush())  # bytes the detokenizer held
        d.text += self.stop.flush()  # text the stop matcher held
        if self.stop.stopped:
            reason, d.by_stop_string = FinishReason.STOP, True
        self.text += d.text
        self.finish_reason = d.finish_reason = FinishReason(reason)
        self.error = d.error = error
        return d


# ------------------------------------------------------------------------------------ offline driver


class GenerationError(RuntimeError):
    """A request failed on device (e.g. non-finite logits); the message is one line."""


@dataclasses.dataclass
class GenerationResult:
    """One prompt's outcome. `finish_reason`: STOP (EOS or a stop string) or LENGTH.
    Times exclude compilation; `time_to_first_token_s` is None if no token came."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason
    time_to_first_token_s: float | None
    decode_tokens_per_s: float
    total_time_s: float
    metrics: dict[str, float | None] = dataclasses.field(default_factory=dict)  # engine per-request metrics
    logprobs: list[TokenLogprob] | None = None  # one per token id when asked: logprob + top alternatives

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def engine_config(handle: Any, prompts: Sequence[Sequence[int]], params: Sequence[RequestParams], *,
                  spec_k: int = 0, sizing: Mapping[str, Any] | None = None) -> EngineConfig:
    """An EngineConfig for running `prompts` at once: a pool that holds them all and enough row slots,
    in powers of two (repeated calls reuse the compiled steps); `sizing` (EngineConfig fields: the CLI's
    --max-batch / --max-batched-tokens, the plan-sized pool) overrides. DP attention: every batch shard's
    slice holds them all (each device keeps one slice, so per device this is the one-device pool)."""
    ps = kv_cache.PAGE_SIZE
    pages = sum(pages_needed(len(p), q.max_new_tokens, spec_k, ps) for p, q in zip(prompts, params))
    shards = 1 if handle.mesh is None else sharding.batch_multiple(handle.mesh)
    fields = {"num_pages": shards * (1 + _pow2(pages)), "max_batch": max(_pow2(len(prompts)), 64),
              **(sizing or {})}
    return EngineConfig(page_size=ps, spec_k=spec_k, **fields)


def stream(handle: Any, prompts: Sequence[Sequence[int]], params: Sequence[RequestParams], *,
           tokenizer: Tokenizer | None = None, spec_k: int = 0, sizing: Mapping[str, Any] | None = None,
           warmup_progress: Callable[..., None] | None = None,
           prefill_progress: Callable[[int, int], None] | None = None
           ) -> Iterator[tuple[int, str, GenerationResult | None]]:
    """Run `prompts` (with `params[i]` each) through one engine (`engine_config`); yield (prompt index,
    new text piece, result-or-None), the result when a prompt ends. Every request is checked (`check`)
    before the engine is built. A request that fails on device raises GenerationError (the others are
    cancelled).

    With `warmup_progress` (see `Engine.warmup`'s `progress`), every step program these prompts can
    use is compiled before the first step (the CLI shows it); otherwise programs compile on first use.
    `prefill_progress(done, total)`: called after every step while prompt tokens are pending (and once
    when none are left), with the prompt tokens scheduled into the cache so far and all prompts' total:
    a long prompt's progress before its first token (the CLI's progress line)."""
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        raise ValueError("no prompts given")
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} parameter sets for {len(prompts)} prompts")
    limits = Limits.of(handle.config, spec_k=spec_k)
    for i, (p, q) in enumerate(zip(prompts, params)):
        check(p, q, limits, what=f"prompt {i}")
    streams = [RequestStream(q, tokenizer) for q in params]
    ecfg = engine_config(handle, prompts, params, spec_k=spec_k, sizing=sizing)
    eng = Engine(handle, ecfg)
    if warmup_progress is not None:
        # A step holds at most one chunk (or decode row) of each prompt: the programs beyond never run.
        most = sum(max(min(len(p), ecfg.chunk_size), spec_k + 1) for p in prompts)
        modes = {"full" if q.temperature > 0 or q.logprobs is not None else "greedy" for q in params}
        eng.warmup(max_rows=len(prompts), max_tokens=most, modes=sorted(modes), progress=warmup_progress)
    rids = {eng.add_request(p, **q.engine_kwargs()): i for i, (p, q) in enumerate(zip(prompts, params))}
    t0 = eng.clock()
    total, pending = sum(len(p) for p in prompts), None
    while eng.has_work():
        events = eng.step()
        if prefill_progress is not None and pending != 0:
            pending = eng.prefill_tokens_pending()
            prefill_progress(total - pending, total)
        for ev in events:
            i = rids[ev.rid]
            s = streams[i]
            if s.done:
                continue  # its stop string was hit: the cancelled request's last word
            d = s.on_event(ev)
            if s.done and not ev.finished:
                eng.cancel(ev.rid)
            if d.finish_reason == FinishReason.ERROR:
                for rid in rids:
                    eng.cancel(rid)
                raise GenerationError(f"prompt {i}: {d.error}")
            if d.text:
                yield i, d.text, None
            if s.done:
                yield i, "", _result(eng, ev.rid, s, tokenizer is not None, t0)


def _result(eng: Engine, rid: int, s: RequestStream, has_text: bool, t0: float) -> GenerationResult:
    r = eng.finished[rid]
    metrics = r.metrics()
    total = eng.clock() - t0
    ttft = metrics["ttft_s"]
    n_dec = max(len(r.output) - 1, 0)
    rate = n_dec / (total - ttft) if n_dec and ttft is not None and total > ttft else 0.0
    lps = s.logprobs[: len(r.output)] if s.logprobs is not None else None
    return GenerationResult(r.prompt, r.output, s.text if has_text else None, s.finish_reason, ttft, rate,
                            total, metrics, lps)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
