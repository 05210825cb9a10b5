"""Cached batched generation: prefill prompts of different lengths, then decode steps on device.

Owns: prompt validation against the context, the jitted prefill and decode-step functions (model +
sampler in one call, the cache donated), stop handling (EOS, stop strings, max_new_tokens), streaming
through the incremental detokenizer, and per-request timings. The cache is contiguous per sequence;
the serving engine's paged cache keeps the same per-token layout. Must not parse CLI flags or files.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax import cache as kv_cache
from dsv3_jax.cache import PageMeta
from dsv3_jax.sampling import SamplingParams, sample, validate_sampling_params
from dsv3_jax.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass
class GenerationResult:
    """One prompt's outcome. `finish_reason`: "stop" (EOS or a stop string) or "length"."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    time_to_first_token_s: float
    decode_tokens_per_s: float
    total_time_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _bucket(n: int, step: int) -> int:
    """Round up so a few shapes cover all prompt lengths (each new shape costs a compile)."""
    return -(-n // step) * step


class Decoder:
    """Jitted prefill/decode for one model handle; reused across `generate` calls (compiles once)."""

    def __init__(self, handle: Any):
        self.handle = handle
        self.model = handle.model
        self.cfg = handle.config

    @functools.cached_property
    def _prefill(self):
        def prefill(params, cache, table, tokens, lengths, sp, keys):
            b, t = tokens.shape
            pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            logits, _, cache = self.model.apply({"params": params}, tokens, pos, cache,
                                                PageMeta(table, lengths))
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
            return sample(last, sp, keys), cache

        return jax.jit(prefill, donate_argnums=(1,))

    @functools.cached_property
    def _step(self):
        def step(params, cache, table, tokens, pos, sp, keys):
            meta = PageMeta(table, jnp.ones_like(pos))
            logits, _, cache = self.model.apply({"params": params}, tokens[:, None], pos[:, None],
                                                cache, meta)
            return sample(logits[:, 0], sp, keys), cache

        return jax.jit(step, donate_argnums=(1,))

    def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: SamplingParams,
               seed: int = 0, eos_ids: Sequence[int] = (), stop: Sequence[str] = (),
               tokenizer: Tokenizer | None = None) -> Iterator[tuple[int, str, GenerationResult | None]]:
        """Yield (prompt index, new text piece, result-or-None); the result comes when a prompt ends."""
        cfg = self.cfg
        prompts = [list(map(int, p)) for p in prompts]
        self._validate(prompts, max_new_tokens)
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this checkpoint has none)")
        n_real = len(prompts)
        if self.handle.mesh is not None:  # every batch shard (data x expert) needs whole rows
            from dsv3_jax import sharding

            pad = -n_real % sharding.batch_multiple(self.handle.mesh)
            prompts = prompts + [[cfg.bos_token_id]] * pad
            sampling = SamplingParams(*(jnp.concatenate([a, jnp.repeat(a[-1:], pad)]) for a in
                                        (sampling.temperature, sampling.top_p, sampling.top_k)))
        b = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        t_pad = min(_bucket(int(lengths.max()), 16), cfg.max_position_embeddings)
        max_len = min(_bucket(int(lengths.max()) + max_new_tokens, kv_cache.PAGE_SIZE),
                      cfg.max_position_embeddings)
        toks = np.zeros((b, t_pad), np.int32)
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = p
        cache, table = kv_cache.allocate_contiguous(cfg, b, max_len, self.handle.attention,
                                                    jnp.dtype(cfg.dtype))
        cache = place_cache(self.handle, cache)
        table = jnp.asarray(table)
        base = jax.random.key(seed)
        row_keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(b))

        def keys_at(step: int):
            return jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)

        detok = [IncrementalDetokenizer(tokenizer) if tokenizer else None for _ in range(b)]
        out: list[list[int]] = [[] for _ in range(b)]
        texts = ["" for _ in range(b)]
        done = [i >= n_real for i in range(b)]  # padding rows never report
        first_at = [0.0] * b
        eos = set(int(e) for e in eos_ids)
        t0 = time.perf_counter()
        with self.handle.mesh_context():  # the MoE runs expert-parallel when traced under a mesh
            nxt, cache = self._prefill(self.handle.params, cache, table, jnp.asarray(toks),
                                       jnp.asarray(lengths), sampling, keys_at(0))
        pos = lengths.copy()
        step = 0
        while True:
            host = np.asarray(nxt)
            now = time.perf_counter()
            for i in range(b):
                if done[i]:
                    continue
                tok = int(host[i])
                if step == 0:
                    first_at[i] = now - t0
                finish = None
                if tok in eos:
                    finish = "stop"
                else:
                    out[i].append(tok)
                    piece = detok[i].add(tok) if detok[i] else ""
                    cut = _stop_cut(texts[i], piece, stop)
                    if cut is not None:
                        piece, finish = cut, "stop"
                    texts[i] += piece
                    if piece:
                        yield i, piece, None
                if finish is None and len(out[i]) >= max_new_tokens:
                    finish = "length"
                if finish is not None:
                    done[i] = True
                    if detok[i] and finish == "length":
                        tail = detok[i].flush()
                        texts[i] += tail
                        if tail:
                            yield i, tail, None
                    total = time.perf_counter() - t0
                    n_dec = max(len(out[i]) - 1, 0)
                    rate = n_dec / (total - first_at[i]) if n_dec and total > first_at[i] else 0.0
                    yield i, "", GenerationResult(prompts[i], out[i], texts[i] if tokenizer else None,
                                                  finish, first_at[i], rate, total)
            if all(done):
                return
            step += 1
            with self.handle.mesh_context():
                nxt, cache = self._step(self.handle.params, cache, table, jnp.asarray(host),
                                        jnp.asarray(pos), sampling, keys_at(step))
            pos = pos + 1

    def _validate(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        cfg = self.cfg
        if not prompts:
            raise ValueError("no prompts given")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= cfg.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size})")
            if len(p) >= cfg.max_position_embeddings:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the context is "
                                 f"{cfg.max_position_embeddings} tokens")
            if len(p) + max_new_tokens > cfg.max_position_embeddings:
                raise ValueError(f"prompt {i} ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) "
                                 f"overflows the context of {cfg.max_position_embeddings} tokens")


def place_cache(handle: Any, cache: dict) -> dict:
    """Put a page pool on the handle's mesh: pages split over the batch axes where they divide,
    replicated otherwise (correct either way; the split only saves memory)."""
    if handle.mesh is None:
        return cache
    from dsv3_jax import sharding

    try:
        return jax.device_put(cache, sharding.cache_shardings(handle.config, handle.mesh, cache))
    except (ValueError, sharding.MeshError):
        rep = jax.sharding.NamedSharding(handle.mesh, jax.sharding.PartitionSpec())
        return jax.device_put(cache, rep)


def _stop_cut(text_so_far: str, piece: str, stop: Sequence[str]) -> str | None:
    """If a stop string completes inside text_so_far + piece, the part of `piece` before it."""
    if not stop or not piece:
        return None
    full = text_so_far + piece
    start = max(0, len(text_so_far) - max(len(s) for s in stop) + 1)
    hits = [full.find(s, start) for s in stop if s]
    hits = [h for h in hits if h >= 0]
    if not hits:
        return None
    return full[: min(hits)][len(text_so_far):]


def make_sampling(batch: int, defaults: dict[str, Any], temperature: float | None, top_p: float | None,
                  top_k: int | None) -> SamplingParams:
    """Flags override the checkpoint's generation_config defaults; temperature 0 is greedy."""
    t = defaults.get("temperature", 1.0) if temperature is None else temperature
    p = defaults.get("top_p", 1.0) if top_p is None else top_p
    k = defaults.get("top_k", 0) if top_k is None else top_k
    validate_sampling_params(t, p, k)
    return SamplingParams.make(batch, temperature=t, top_p=p, top_k=k)
