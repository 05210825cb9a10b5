"""Next-token sampling on device: temperature, top-k, top-p and greedy, batched and usable inside jit.

Owns: `SamplingParams` (per-request arrays, so one batch mixes settings), their validation, the filtered
distribution (`probs_after_filtering`), `sample`, the engine's per-row keys (`row_keys`), speculative
verification (`speculative_sample`: accept drafts left to right, rejection-resample the first refused
one), per-token log-probabilities (`token_logprobs`, at most engine/api.MAX_LOGPROBS alternatives), and
a checkpoint's `generation_config.json` defaults: reading them and applying them to a request's values
(`apply_defaults`, the one place; request_stream.resolve calls it). Does not own the decode loop or
stop conditions.

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
