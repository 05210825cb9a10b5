"""Generation on top of the serving engine: what `handle.generate` and the CLI call.

Owns: prompt validation against the context, sizing an engine for a batch of prompts, stop strings
(cancelling the request in the engine), streaming text through the incremental detokenizer, results
with timings, and placing page pools on a handle's mesh. Decoding itself (batched prefill, decode steps
on device, sampling, MTP) is the engine's. Must not parse CLI flags or files.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from dsv3_jax import cache as kv_cache
from dsv3_jax.sampling import validate_sampling_params
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
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # engine per-request metrics

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stream(handle: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
           sampling: Sequence[dict[str, float]], seed: int = 0, eos_ids: Sequence[int] = (),
           stop: Sequence[str] = (), tokenizer: Tokenizer | None = None, spec_k: int = 0
           ) -> Iterator[tuple[int, str, GenerationResult | None]]:
    """Run `prompts` through a serving engine sized for them; yield (prompt index, new text piece,
    result-or-None), the result when a prompt ends. `sampling[i]` holds temperature/top_p/top_k."""
    from dsv3_jax.engine import Engine, EngineConfig

    cfg = handle.config
    prompts = [list(map(int, p)) for p in prompts]
    _validate(cfg, prompts, max_new_tokens)
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (this checkpoint has none)")
    ps = kv_cache.PAGE_SIZE
    pages = sum(kv_cache.pages_for(len(p) + max_new_tokens + spec_k, ps) for p in prompts)
    # Power-of-two pool and batch sizes: repeated calls reuse the compiled step.
    ecfg = EngineConfig(num_pages=1 + _pow2(pages), page_size=ps, max_batch=_pow2(len(prompts)),
                        token_budget=_pow2(len(prompts)) * 256, chunk_size=256, spec_k=spec_k)
    eng = Engine(handle, ecfg)
    rids = {eng.add_request(p, max_new_tokens=max_new_tokens, seed=seed + i, eos=eos_ids, **sampling[i]): i
            for i, p in enumerate(prompts)}
    detok = {r: IncrementalDetokenizer(tokenizer) if tokenizer else None for r in rids}
    texts = {r: "" for r in rids}
    stopped: set[int] = set()
    t0 = time.perf_counter()
    while eng.has_work():
        for ev in eng.step():
            i, d = rids[ev.rid], detok[ev.rid]
            finish = None
            for tok in ev.new_tokens:
                piece = d.add(tok) if d else ""
                cut = _stop_cut(texts[ev.rid], piece, stop)
                if cut is not None:
                    piece, finish = cut, "stop"
                texts[ev.rid] += piece
                if piece:
                    yield i, piece, None
                if finish:
                    break
            if finish and not ev.finished:
                eng.cancel(ev.rid)
                stopped.add(ev.rid)
            if ev.finished or finish:
                yield from _result(eng, ev.rid, i, texts, d, tokenizer, stopped, t0)


def _result(eng, rid, i, texts, d, tokenizer, stopped, t0):
    r = eng.finished[rid]
    reason = "stop" if rid in stopped else r.finish_reason
    if d and reason == "length":
        tail = d.flush()
        texts[rid] += tail
        if tail:
            yield i, tail, None
    m = r.metrics()
    total = time.perf_counter() - t0
    ttft = m["ttft_s"]
    n_dec = max(len(r.output) - 1, 0)
    rate = n_dec / (total - ttft) if n_dec and total > ttft else 0.0
    yield i, "", GenerationResult(r.prompt, r.output, texts[rid] if tokenizer else None, reason, ttft, rate,
                                  total, m)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _validate(cfg: Any, prompts: list[list[int]], max_new_tokens: int) -> None:
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


def sampling_settings(defaults: dict[str, Any], temperature: float | None, top_p: float | None,
                      top_k: int | None) -> dict[str, float]:
    """Flags override the checkpoint's generation_config defaults; temperature 0 is greedy."""
    t = defaults.get("temperature", 1.0) if temperature is None else temperature
    p = defaults.get("top_p", 1.0) if top_p is None else top_p
    k = defaults.get("top_k", 0) if top_k is None else top_k
    validate_sampling_params(t, p, k)
    return {"temperature": float(t), "top_p": float(p), "top_k": int(k)}
