"""The MTP draft loop of speculative decoding, over a ragged token batch (inside the jitted step).

Owns: feeding the MTP module (model.py) with (hidden_i, token_{i+1}) for every committed token of the
step so its own cache stays filled, and proposing k draft tokens per row: the first from the last
committed position, the next ones by running the one MTP layer again on its own hidden state and the
previous draft (k <= 3 reuses the single layer, as DeepSeek's inference does). Must not own the
verification rule (sampling.speculative_sample), the schedule or the batch layout (step.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dsv3_jax.engine.sampling import SamplingParams, probs_after_filtering, row_keys
from dsv3_jax.model.kv_cache import PageMeta


def propose(model: Any, params: Any, cache: dict, *, hidden: jax.Array, tokens: jax.Array,
            positions: jax.Array, tok_table: jax.Array, valid: jax.Array, row_of: jax.Array,
            row_start: jax.Array, commit: jax.Array, next_token: jax.Array, table: jax.Array,
            live: jax.Array, sp: SamplingParams, seeds: jax.Array, counters: jax.Array, k: int,
            sampled: bool) -> tuple[jax.Array, jax.Array | None, dict]:
    """Drafts [S, k] (and their filtered distributions [S, k, V] when `sampled`) plus the new cache.

    Flat inputs of the step ([N]): final-normed `hidden` [N, 1, D], `tokens`, `positions`, their page
    rows `tok_table` [N, W], `valid`, `row_of` (the token's row). Per row ([S]): `row_start` (first flat
    index), `commit` (tokens of the row now committed, >= 1 for real rows), `next_token` (the token after
    the last committed one: the step's bonus token, or the next prompt token mid-prefill), `table`
    [S, W], `live` (rows that draft: decode rows still running), `counters` (index of the next token).
    """
    n = tokens.shape[0]
    last = row_start + commit - 1  # flat index of each row's last committed token
    in_row = jnp.arange(n) - row_start[row_of]
    mtp_valid = valid & (in_row < commit[row_of])
    # token_{i+1} beside each token i: the next flat token, except at each row's last committed one.
    shifted = jnp.concatenate([tokens[1:], jnp.zeros((1,), tokens.dtype)])
    shifted = shifted.at[jnp.where(commit > 0, last, n)].set(next_token, mode="drop")
    sel = jnp.clip(last, 0, n - 1)
    logits, h, cache = model.apply({"params": params}, hidden, shifted[:, None], positions[:, None], cache,
                                   PageMeta(tok_table, mtp_valid.astype(jnp.int32)), sel,
                                   method=model.mtp_logits)
    dh = h.reshape(n, -1)[sel][:, None]  # [S, 1, D]
    dpos = positions[sel]
    drafts, dprobs = [], []
    for j in range(k):
        if sampled:
            q = probs_after_filtering(logits, sp)
            key = row_keys(seeds, counters + 1 + j, 2)
            s = jax.vmap(lambda kk, qq: jax.random.categorical(kk, jnp.log(qq)))(key, q)
            d = jnp.where(sp.temperature <= 0, jnp.argmax(q, -1), s).astype(jnp.int32)
            dprobs.append(q)
        else:
            d = jnp.argmax(logits, -1).astype(jnp.int32)
        drafts.append(d)
        if j + 1 < k:  # recurse: the MTP layer again, on its own hidden and the draft, one token per row
            dpos = dpos + 1
            meta = PageMeta(table, live.astype(jnp.int32))
            logits3, dh, cache = model.apply({"params": params}, dh, d[:, None], dpos[:, None], cache, meta,
                                             method=model.mtp_logits)
            logits = logits3[:, 0]
    return jnp.stack(drafts, 1), (jnp.stack(dprobs, 1) if sampled else None), cache
