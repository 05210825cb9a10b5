"""Next-token sampling on device: temperature, top-k, top-p and greedy, batched and usable inside jit.

Owns: `SamplingParams` (per-request arrays, so one batch mixes settings), their validation, the filtered
distribution (`probs_after_filtering`), `sample`, the engine's per-row keys (`row_keys`), speculative
verification (`speculative_sample`: accept drafts left to right, rejection-resample the first refused
one), per-token log-probabilities (`token_logprobs`, at most engine/api.MAX_LOGPROBS alternatives), and
a checkpoint's `generation_config.json` defaults: reading them and applying them to a request's values
(`apply_defaults`, the one place; request_stream.resolve calls it), and the logits processors
(`LogitsProcessing`: one request's repetition / presence / frequency penalties, min_p, logit_bias and
min_tokens, their validation and the sparse per-request table they become; `process_logits`: the device
math applied to a batch's logits inside the step, vLLM's semantics and order). Does not own the decode
loop, stop conditions or where the per-request counts live (step.py keeps them on the device).

Logits processors, in vLLM's order: the grammar bitmask (disallowed tokens -inf), min_tokens (the
request's stop tokens -inf until it has min_tokens output tokens) and logit_bias (added), then
repetition_penalty (tokens seen in the prompt or the output: positive logits divided by it, negative ones
multiplied), frequency_penalty (minus penalty x count in the output) and presence_penalty (minus penalty
if it occurs in the output); greedy takes the argmax of the result; sampling then scales by temperature,
drops tokens whose probability is below min_p x the most likely one's, then top-k / top-p as below.
Log-probabilities stay those of the raw logits (vLLM's default).

Order of operations, as in transformers and DeepSeek's reference: logits / temperature, keep the top_k
most likely tokens (0 = no limit), then keep the smallest set of those whose probability reaches top_p
(always at least one token), renormalize and draw. Temperature 0 means greedy: argmax of the raw logits.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.engine.api import MAX_LOGPROBS

GENERATION_CONFIG_FILE = "generation_config.json"

ScalarOrSeq = float | int | Sequence[float] | Sequence[int] | np.ndarray | jax.Array


INT32_MAX = 2**31 - 1


def _numbers(name: str, value: object, want: str) -> np.ndarray:
    """`value` (a number, numpy/jax scalar or a sequence of them) as a numeric array; booleans, strings
    and None are refused naming the argument."""
    if value is None or isinstance(value, str | bytes | bool | np.bool_):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be {want}, got {value!r}") from e
    if arr.dtype.kind not in "iuf" or arr.size == 0:
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return arr


def validate_sampling_params(temperature: ScalarOrSeq, top_p: ScalarOrSeq, top_k: ScalarOrSeq, *,
                             seed: int | None = None) -> None:
    """Raise ValueError naming the argument if any value is out of range (host-side check, not in jit).

    Python and numpy numbers (scalars or one per row) are accepted alike; booleans, strings, NaN/inf
    and integers beyond int32 (what the device arrays hold) are refused. `seed`, when given, must fit
    int32 too (the engine's per-request seed).
    """
    t = _numbers("temperature", temperature, "a finite number >= 0 (0 = greedy)").astype(np.float64)
    p = _numbers("top_p", top_p, "a number in (0, 1]").astype(np.float64)
    k = _numbers("top_k", top_k, "an integer >= 0 (0 = no limit)")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if k.dtype.kind == "f" and not (np.all(np.isfinite(k)) and np.all(k == np.round(k))):
        raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {top_k!r}")
    if np.any(k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {top_k!r}")
    if np.any(k > INT32_MAX):
        raise ValueError(f"top_k must be at most {INT32_MAX} (0 = no limit), got {top_k!r}")
    if seed is not None:
        if isinstance(seed, bool | np.bool_) or not isinstance(seed, int | np.integer):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not -(2**31) <= int(seed) <= INT32_MAX:
            raise ValueError(f"seed must lie in [-2**31, 2**31 - 1] (int32), got {seed!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, each an array of shape [B]; a pytree, so it can be passed to jit.

    temperature: float32, 0 = greedy. top_p: float32 in (0, 1], 1 = off. top_k: int32, 0 = off.
    Build with `SamplingParams.make`, which validates; the raw constructor does not.
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array

    @classmethod
    def make(
        cls,
        batch_size: int,
        temperature: ScalarOrSeq = 1.0,
        top_p: ScalarOrSeq = 1.0,
        top_k: ScalarOrSeq = 0,
    ) -> SamplingParams:
        """Validate and broadcast scalars or length-`batch_size` sequences to [batch_size] arrays."""
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        validate_sampling_params(temperature, top_p, top_k)

        def per_row(name: str, value: ScalarOrSeq, dtype: np.dtype) -> jax.Array:
            arr = np.asarray(value)
            if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != batch_size):
                raise ValueError(f"{name} must be a scalar or have shape [{batch_size}], got {arr.shape}")
            return jnp.asarray(np.broadcast_to(arr.astype(dtype), (batch_size,)))

        return cls(
            temperature=per_row("temperature", temperature, np.float32),
            top_p=per_row("top_p", top_p, np.float32),
            top_k=per_row("top_k", top_k, np.int32),
        )

    @classmethod
    def greedy(cls, batch_size: int) -> SamplingParams:
        return cls.make(batch_size, temperature=0.0)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


def _check_shapes(logits: jax.Array, params: SamplingParams) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [B, V], got {logits.shape}")
    for name in ("temperature", "top_p", "top_k"):
        shape = getattr(params, name).shape
        if shape != (logits.shape[0],):
            raise ValueError(f"params.{name} must have shape [{logits.shape[0]}] like logits, got {shape}")


def _filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled logits with every token outside the top-k / top-p set at -inf, vocab order."""
    batch, vocab = logits.shape
    temperature = params.temperature.astype(jnp.float32)[:, None]
    # Greedy rows are handled by the caller; any positive divisor keeps their arithmetic finite.
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)

    order = jnp.argsort(-scaled, axis=-1)  # stable: ties keep the lower id first, like argmax
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]

    top_k = params.top_k.astype(jnp.int32)[:, None]
    keep = (top_k <= 0) | (rank < top_k)

    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the strictly more likely tokens
    top_p = params.top_p.astype(jnp.float32)[:, None]
    # rank 0 is always kept; top_p >= 1 keeps everything even where the float cumsum reaches 1 early.
    keep = keep & ((mass_before < top_p) | (top_p >= 1.0) | (rank == 0))

    rows = jnp.arange(batch)[:, None]
    keep_vocab = jnp.zeros((batch, vocab), dtype=bool).at[rows, order].set(keep)
    return jnp.where(keep_vocab, scaled, -jnp.inf)


def probs_after_filtering(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution `sample` draws from, [B, V] float32: one-hot at the argmax for greedy rows."""
    _check_shapes(logits, params)
    probs = jax.nn.softmax(_filtered_logits(logits, params), axis=-1)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((params.temperature <= 0)[:, None], greedy, probs)


def _row_keys(key: jax.Array, batch: int) -> jax.Array:
    """One key per row: a single key is split; a batch of `batch` keys is used as is."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    single_ndim = 0 if typed else 1
    if key.ndim == single_ndim:
        return jax.random.split(key, batch)
    if key.ndim == single_ndim + 1 and key.shape[0] == batch:
        return key
    raise ValueError(f"key must be one PRNG key or {batch} keys (one per row), got shape {key.shape}")


def sample(logits: jax.Array, params: SamplingParams, key: jax.Array) -> jax.Array:
    """Draw one token per row from `logits` [B, V]; returns int32 [B].

    `key` is one PRNG key (split per row) or [B] keys; pass per-row keys to make a request's tokens
    independent of which other requests share its batch. Same keys and inputs give the same tokens.
    """
    _check_shapes(logits, params)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = _filtered_logits(logits, params)
    keys = _row_keys(key, logits.shape[0])
    drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, filtered).astype(jnp.int32)
    return jnp.where(params.temperature <= 0, greedy, drawn)


def row_keys(seeds: jax.Array, counters: jax.Array, salt: int) -> jax.Array:
    """One key per row from (request seed, index of the token being drawn, purpose salt): a request's
    draws depend only on its own seed and progress, never on which rows share its batch."""
    def one(s, c):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), c), salt)
    return jax.vmap(one)(seeds, counters)


def _categorical(keys: jax.Array, probs: jax.Array) -> jax.Array:
    return jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, probs).astype(jnp.int32)


def speculative_sample(logits: jax.Array, drafts: jax.Array, ndraft: jax.Array, params: SamplingParams,
                       seeds: jax.Array, counters: jax.Array, qprobs: jax.Array | None = None, *,
                       sampled: bool = True) -> tuple[jax.Array, jax.Array]:
    """Verify drafts and sample: logits [B, k+1, V] score the last committed token and each of the k
    drafts [B, k] (row b has ndraft[b] <= k real drafts). Returns (tokens [B, k+1], n_new [B]): the
    first n_new tokens are emitted (accepted drafts, then a replacement or bonus token).

    Greedy rows accept a draft while it equals the argmax (exactly plain greedy). Sampled rows accept
    d_j with probability min(1, p(d_j) / q(d_j)) (q = qprobs [B, k, V], the draft distribution) and
    else draw from norm(max(p - q, 0)): the output keeps the target distribution. Without qprobs,
    sampled drafts are compared like greedy ones. `sampled=False` (static: every row greedy) skips
    the filtering sorts.
    """
    b, j1, _ = logits.shape
    k = j1 - 1
    greedy = params.temperature <= 0
    if sampled:
        p = jax.vmap(lambda lg: probs_after_filtering(lg, params), in_axes=1, out_axes=1)(logits)
    out_tok, n_new, alive = [], jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)
    for j in range(k + 1):
        is_draft = j < ndraft
        draft = drafts[:, j] if j < k else jnp.zeros((b,), jnp.int32)
        if sampled:
            key = row_keys(seeds, counters + j, 1)
            pj = p[:, j]
            tok_plain = jnp.where(greedy, jnp.argmax(pj, -1), _categorical(key, pj)).astype(jnp.int32)
        else:
            tok_plain = jnp.argmax(logits[:, j], -1).astype(jnp.int32)
        accept, replacement = draft == tok_plain, tok_plain
        if sampled and qprobs is not None and j < k:
            q = qprobs[:, j]
            pd = jnp.take_along_axis(pj, draft[:, None], 1)[:, 0]
            qd = jnp.take_along_axis(q, draft[:, None], 1)[:, 0]
            u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 7)))(key)
            resid = jnp.maximum(pj - q, 0.0)
            resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, pj)
            rs = _categorical(jax.vmap(lambda kk: jax.random.fold_in(kk, 9))(key), resid)
            accept = jnp.where(greedy, accept, u * qd <= pd)
            replacement = jnp.where(greedy, tok_plain, rs)
        accept = accept & is_draft
        emit = jnp.where(accept, draft, jnp.where(is_draft, replacement, tok_plain))
        out_tok.append(jnp.where(alive, emit, 0))
        n_new = n_new + alive.astype(jnp.int32)
        alive = alive & accept
    return jnp.stack(out_tok, 1), n_new


def token_logprobs(logits: jax.Array, chosen: jax.Array, top: int = MAX_LOGPROBS
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """log_softmax of the raw logits [..., V] (before temperature and filtering, like vLLM's default):
    (logprob of `chosen` [...], top ids [..., top] int32, their logprobs [..., top]). A vocabulary
    smaller than `top` fills the places past V with id 0 at logprob -inf."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, min(top, lp.shape[-1]))
    if top > lp.shape[-1]:
        pad = [(0, 0)] * (lp.ndim - 1) + [(0, top - lp.shape[-1])]
        top_lp, top_ids = jnp.pad(top_lp, pad, constant_values=-jnp.inf), jnp.pad(top_ids, pad)
    return jnp.take_along_axis(lp, chosen[..., None], -1)[..., 0], top_ids.astype(jnp.int32), top_lp


# ------------------------------------------------------------------------------------ logits processors
TABLE_WIDTH = 512  # sparse per-request entries (logit_bias + stop tokens under min_tokens) the device keeps
MAX_LOGIT_BIAS = 300  # entries one request's logit_bias may hold (OpenAI's bound)
LOGIT_BIAS_RANGE = 100.0  # OpenAI: each bias lies in [-100, 100]


@dataclasses.dataclass(frozen=True)
class LogitsProcessing:
    """One request's logits processors (the module docstring gives their semantics and order). The
    defaults change nothing; a request whose values are all default has no processing (`active` False)
    and keeps the engine's fast paths."""

    repetition_penalty: float = 1.0  # > 0; 1 = off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    min_p: float = 0.0  # [0, 1]; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) are suppressed until this many are out

    @property
    def active(self) -> bool:
        return self != LogitsProcessing()

    @property
    def penalties(self) -> bool:
        """Whether it reads the request's token counts (then the device must see every token it has)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def table(self, stop_tokens: Sequence[int]) -> tuple[tuple[int, float], ...]:
        """The sparse entries the device keeps for this request: (token, bias) for logit_bias, and
        (token, -inf) for each stop token while min_tokens applies (applied only below min_tokens)."""
        stops = tuple((int(t), -np.inf) for t in sorted(set(stop_tokens))) if self.min_tokens > 0 else ()
        return tuple(self.logit_bias) + stops


def validate_processing(p: LogitsProcessing, vocab_size: int, stop_tokens: Sequence[int] = (),
                        max_new_tokens: int | None = None) -> None:
    """Raise ValueError naming the field (its wire name) for a value out of range."""
    def number(name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float | np.number) or not np.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        return float(v)

    if number("repetition_penalty", p.repetition_penalty) <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {p.repetition_penalty!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= number(name, getattr(p, name)) <= 2.0:
            raise ValueError(f"{name} must lie in [-2, 2], got {getattr(p, name)!r}")
    if not 0.0 <= number("min_p", p.min_p) <= 1.0:
        raise ValueError(f"min_p must lie in [0, 1], got {p.min_p!r}")
    if isinstance(p.min_tokens, bool) or not isinstance(p.min_tokens, int | np.integer) or p.min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
    if max_new_tokens is not None and p.min_tokens > max_new_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) exceeds max_tokens ({max_new_tokens})")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
    seen = set()
    for tok, bias in p.logit_bias:
        if isinstance(tok, bool) or not isinstance(tok, int | np.integer) or not 0 <= tok < vocab_size:
            raise ValueError(f"logit_bias: token id {tok!r} is outside the vocabulary [0, {vocab_size})")
        if tok in seen:
            raise ValueError(f"logit_bias: token id {tok} appears twice")
        seen.add(tok)
        if not -LOGIT_BIAS_RANGE <= number("logit_bias", bias) <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias: the bias of token {tok} must lie in [-100, 100], got {bias!r}")
    n = len(p.table(stop_tokens))
    if n > TABLE_WIDTH:
        raise ValueError(f"logit_bias ({len(p.logit_bias)}) and the stop tokens min_tokens suppresses "
                         f"({n - len(p.logit_bias)}) exceed the {TABLE_WIDTH} entries a request may hold")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProcessorInputs:
    """A batch's logits processors on the device, per row [S]: the penalties, min_p, whether min_tokens
    still suppresses stop tokens, and the request's sparse table ([S, TABLE_WIDTH] ids and values:
    a finite value is a bias, -inf a stop token applied only while `suppress`); `counts` [S, V] the
    row's output token counts and `seen` [S, V] whether a token occurs in its prompt."""

    repetition: jax.Array
    presence: jax.Array
    frequency: jax.Array
    min_p: jax.Array
    suppress: jax.Array
    table_ids: jax.Array
    table_vals: jax.Array
    counts: jax.Array
    seen: jax.Array


def unpack_bitmask(bitmask: jax.Array, vocab: int) -> jax.Array:
    """[..., ceil(V/32)] int32 (bit b of word w allows token 32 w + b: llguidance's layout) -> bool
    [..., V]."""
    bits = (bitmask[..., :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab] > 0


def process_logits(logits: jax.Array, temperature: jax.Array, p: ProcessorInputs,
                   bitmask: jax.Array | None = None) -> jax.Array:
    """The processed logits [S, J, V] float32 (each row's processors applied at all J positions; rows with
    defaults are unchanged). `bitmask` [S, ceil(V/32)]: allowed tokens (None: all)."""
    x = logits.astype(jnp.float32)
    s, _, v = x.shape
    if bitmask is not None:
        x = jnp.where(unpack_bitmask(bitmask, v)[:, None, :], x, -jnp.inf)
    rows = jnp.arange(s)[:, None]
    vals = jnp.where(jnp.isneginf(p.table_vals), jnp.where(p.suppress[:, None], -jnp.inf, 0.0), p.table_vals)
    add = jnp.zeros((s, v), jnp.float32).at[rows, p.table_ids].add(vals)
    x = x + add[:, None, :]
    counts = p.counts.astype(jnp.float32)
    occurs = p.counts > 0
    rep = p.repetition.astype(jnp.float32)[:, None, None]
    penalized = jnp.where(x > 0, x / rep, x * rep)
    x = jnp.where((occurs | p.seen)[:, None, :], penalized, x)
    x = x - (p.frequency[:, None] * counts + p.presence[:, None] * occurs)[:, None, :]
    # min_p after temperature: p_i >= min_p * p_max  <=>  x_i >= x_max + T * log(min_p)
    t = temperature.astype(jnp.float32)[:, None, None]
    mp = p.min_p.astype(jnp.float32)[:, None, None]
    floor = jnp.max(x, axis=-1, keepdims=True) + t * jnp.log(jnp.maximum(mp, 1e-30))
    drop = (mp > 0) & (t > 0) & (x < floor)
    return jnp.where(drop, -jnp.inf, x)


def load_generation_defaults(directory: str | os.PathLike) -> dict:
    """Sampling defaults from `<directory>/generation_config.json`; {} when the file is absent.

    Returns the keys present among temperature, top_p, top_k (DeepSeek-V3: temperature 0.6, top_p 0.95),
    with `do_sample: false` mapped to temperature 0 (greedy), plus `eos_token_ids` (a list) when the file
    names an eos_token_id. Values are validated.
    """
    from dsv3_jax.config import read_generation_config

    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.exists():
        return {}
    return read_generation_config(path)  # typed and range-checked there, errors name the field


def apply_defaults(defaults: Mapping[str, Any], temperature: Any, top_p: Any,
                   top_k: Any) -> tuple[Any, Any, Any]:
    """(temperature, top_p, top_k): each given value, else the checkpoint's default (`defaults` as
    `load_generation_defaults` returns them), else 1.0 / 1.0 / 0 (plain sampling). Temperature 0 is
    greedy. Not validated here (`validate_sampling_params`)."""
    return (defaults.get("temperature", 1.0) if temperature is None else temperature,
            defaults.get("top_p", 1.0) if top_p is None else top_p,
            defaults.get("top_k", 0) if top_k is None else top_k)
