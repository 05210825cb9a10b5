"""Generation on top of the serving engine: what `handle.generate` and the CLI call.

Owns: sizing an engine for a batch of prompts, stop strings (cancelling the request in the engine),
streaming text through the incremental detokenizer, and results with timings. Decoding itself (ragged
steps on device, sampling, MTP), request validation and pages-needed are the engine's; placing page
pools on a mesh is sharding.py's. Imports the engine, never the other way round. Must not parse CLI
flags or files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from dsv3_jax import cache as kv_cache
from dsv3_jax import sharding
from dsv3_jax.engine import Engine, EngineConfig, pages_needed, validate_request
from dsv3_jax.sampling import validate_sampling_params
from dsv3_jax.tokenizer import IncrementalDetokenizer, Tokenizer


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stream(handle: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
           sampling: Sequence[dict[str, float]], seed: int = 0, eos_ids: Sequence[int] = (),
           stop: Sequence[str] = (), tokenizer: Tokenizer | None = None, spec_k: int = 0
           ) -> Iterator[tuple[int, str, GenerationResult | None]]:
    """Run `prompts` through a serving engine sized for them; yield (prompt index, new text piece,
    result-or-None), the result when a prompt ends. `sampling[i]` holds temperature/top_p/top_k."""
    cfg = handle.config
    prompts = [list(map(int, p)) for p in prompts]
    _validate(cfg, prompts, max_new_tokens)
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (this checkpoint has none)")
    ps = kv_cache.PAGE_SIZE
    pages = sum(pages_needed(len(p), max_new_tokens, spec_k, ps) for p in prompts)
    # Power-of-two pool and row-slot sizes: repeated calls reuse the compiled steps.
    # DP attention: every batch shard's slice can hold them all (each device keeps one slice, so per
    # device this is the one-device pool).
    shards = 1 if handle.mesh is None else sharding.batch_multiple(handle.mesh)
    sizing = {"num_pages": shards * (1 + _pow2(pages)), "max_batch": max(_pow2(len(prompts)), 64),
              **getattr(handle, "engine_defaults", {})}  # flags and the plan-sized pool (parallel_cli)
    ecfg = EngineConfig(page_size=ps, spec_k=spec_k, **sizing)
    eng = Engine(handle, ecfg)
    rids = {eng.add_request(p, max_new_tokens=max_new_tokens, seed=seed + i, eos=eos_ids, **sampling[i]): i
            for i, p in enumerate(prompts)}
    detok = {r: IncrementalDetokenizer(tokenizer) if tokenizer else None for r in rids}
    texts = {r: "" for r in rids}
    stopped: set[int] = set()
    t0 = eng.clock()
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
            if ev.finish_reason == "error":
                for rid in rids:
                    eng.cancel(rid)
                raise GenerationError(f"prompt {i}: {ev.error}")
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
    total = eng.clock() - t0
    ttft = m["ttft_s"]
    n_dec = max(len(r.output) - 1, 0)
    rate = n_dec / (total - ttft) if n_dec and ttft is not None and total > ttft else 0.0
    yield i, "", GenerationResult(r.prompt, r.output, texts[rid] if tokenizer else None, reason, ttft, rate,
                                  total, m)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _validate(cfg: Any, prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        validate_request(cfg, p, max_new_tokens, what=f"prompt {i}")


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
