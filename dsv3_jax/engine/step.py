"""One engine step as data: the ragged token batch (host side) and the jitted device step that runs it.

Owns: the batch layout, the set of step shapes (`StepShapes`), packing it into two flat host buffers,
and the device function.

Layout (vLLM/SGLang style, token-flattened): a step computes N tokens for S sequences (rows), each row
holding a contiguous run of the flat tokens: a decode row 1 (+ k drafts) tokens, a prefill chunk up to
chunk_size. Nothing is padded per row, so a 512-token chunk next to 63 decode rows costs 575 tokens, not
64 x 512. Tokens past the scheduled count are padding: they write only page 0 (scratch), attend to
nothing and are routed to no expert. Attention runs with one token per kernel row (B = N, T = 1); for
128 heads that is what the MLA kernel's 64-row tiles did for a chunk anyway.
A step that holds only one sequence's prefill chunk past `EngineConfig.long_prefill_from` is keyed
`long_prefill`: the same layout, but attention runs in naive form over the pool (model/long_prefill.py,
`PageMeta.long_prefill`), the faster algorithm at a long prefix. It always runs in the full mode (one
program for the path, not a greedy/full pair).

Step shapes are a fixed, small set (`StepShapes`), because one shape of the full-width model costs ~26 s
of GPU compile: decode capacities (S rows of spec_k + 1 tokens) for a few row counts, and mixed/prefill
capacities (N tokens, max_batch rows) up to the token budget; each in two modes (greedy: argmax only;
full: sampling filters, logprobs and the logits processors, which sort the vocabulary), and a third,
compiled only when a constrained (structured output) request runs: full plus a grammar bitmask input.
The page-table width W is one per engine (the longest sequence it admits). Live counts travel as
data (`valid`, `row_len`, lengths), so every load the scheduler can produce runs on one of these
programs and `Engine.warmup()` compiles them all.

Batch shards (data-parallel attention, later): tokens and rows are grouped by batch shard in equal
segments, shard s owning flat tokens [s*N/D, (s+1)*N/D) and rows [s*S/D, (s+1)*S/D), each padded to
the same capacity; one shard today (`num_shards` exists so the layout is tested now).

A token's input id is either known on the host (`tokens`) or is the token the previous, still-running
step sampled for that sequence: then `src` names the request's slot in the device-resident
`last_token` buffer, so step k+1 can be dispatched before step k's results are read.

Logits processors (sampling.LogitsProcessing: penalties, logit_bias, min_tokens, min_p) run in the full
mode from per-slot state on the device: `counts` [slots, V] (output tokens), `seen` [slots, V] (prompt
tokens) and a sparse table per slot ([slots, TABLE_WIDTH] ids and values: logit_bias and the stop tokens
min_tokens suppresses). Every token a step computes marks them (positions before the row's prompt length
into `seen`, the rest into `counts`), so a decode row's sampled token is counted when it is fed back,
before the next draw; a row's first step after admission (`fresh`) clears its slot and uploads its table
(`upload_*`, at most TABLE_WIDTH entries per step: the scheduler admits within it). Requests with
penalties must pass every token through the step (no prefix-cache reuse, no MTP drafts: scheduler.py and
core.py see to it). The bitmask of a constrained row is [ceil(V/32)] int32 per row (llguidance's layout).

The device step returns only small arrays (sampled ids, counts, a finite flag per row, drafts, and
logprobs when asked) packed into one int32 (and one float32) buffer; the cache and the per-slot state
stay on device (donated; executor.py holds them). Must not own scheduling policy (scheduler.py),
request state (core.py), device arrays or compiled programs (executor.py) or sampling rules (sampling.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.engine import mtp_draft
from dsv3_jax.engine.api import MAX_LOGPROBS
from dsv3_jax.engine.sampling import (
    TABLE_WIDTH,
    LogitsProcessing,
    ProcessorInputs,
    SamplingParams,
    process_logits,
    speculative_sample,
    token_logprobs,
    unpack_bitmask,
)
from dsv3_jax.model.kv_cache import PageMeta


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


DEFAULT_DECODE_ROWS = (4, 32)  # decode capacities below max_batch: b=1 chat, small batches


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The (tokens N, rows S) capacities of one batch-shard segment that an engine compiles, ascending.

    Decode capacities are (r * (spec_k + 1), r) for r in the decode row counts and max_batch; mixed and
    prefill capacities are (n, max_batch) for n in the token capacities above the largest decode one, the
    token budget last. The largest shape holds max_batch rows and the whole budget, so every step the
    scheduler can build fits one of them. N is a multiple of `multiple` (the batch-shard count of a mesh).
    """

    pairs: tuple[tuple[int, int], ...]

    @classmethod
    def make(cls, *, max_rows: int, max_tokens: int, spec_k: int, decode_rows: tuple[int, ...] = (),
             token_caps: tuple[int, ...] = (), multiple: int = 1) -> StepShapes:
        j = spec_k + 1
        rows = sorted({min(max(int(r), 1), max_rows) for r in (decode_rows or DEFAULT_DECODE_ROWS)}
                      | {max_rows})
        decode = [(_round_up(r * j, multiple), r) for r in rows]
        top = decode[-1][0]
        toks = sorted({_round_up(int(t), multiple) for t in token_caps} | {_round_up(max_tokens, multiple)})
        return cls(tuple(decode + [(t, max_rows) for t in toks if t > top]))

    def pick(self, tokens: int, rows: int) -> tuple[int, int]:
        """The smallest capacity holding `tokens` and `rows` (ValueError if none: a scheduler bug)."""
        for n, s in self.pairs:
            if n >= tokens and s >= rows:
                return n, s
        raise ValueError(f"no step shape holds {tokens} tokens in {rows} rows (shapes {self.pairs})")

    def reachable(self, max_tokens: int, max_rows: int) -> list[tuple[int, int]]:
        """The capacities some step of at most `max_tokens` tokens and `max_rows` rows picks: for each
        shape, the smallest holding its own corner clipped to the bounds (any (t, r) picks the shape
        that is the smallest holding its corner, so this set is complete)."""
        out = []
        for n, s in self.pairs:
            t = max(1, min(n, max_tokens))
            p = self.pick(t, max(1, min(s, max_rows, t)))
            if p not in out:
                out.append(p)
        return out


class StepKey(NamedTuple):
    """Everything static about a step: one compiled program per distinct key."""

    tokens: int  # N, flat tokens
    rows: int  # S, sequences
    width: int  # W, page-table columns
    spec_k: int  # drafts per decode row
    full: bool  # sampling filters, logprobs and processors (some row samples, asks for logprobs or processes)
    mask_words: int = 0  # > 0: a grammar bitmask of this many int32 words per row (ceil(V/32)); implies full
    # One sequence's prefill chunk alone: attention in naive form over the pool (model/long_prefill.py)
    long_prefill: bool = False

    @property
    def sampled(self) -> bool:
        return self.full

    @property
    def logprobs(self) -> bool:
        return self.full


def int_fields(key: StepKey) -> list[tuple[str, tuple[int, ...]]]:
    n, s, w, j = key.tokens, key.rows, key.width, key.spec_k + 1
    f = [("tokens", (n,)), ("src", (n,)), ("positions", (n,)), ("row_of", (n,)), ("valid", (n,)),
         ("table", (s, w)), ("slot", (s,)), ("logit_idx", (s, j)), ("ndraft", (s,)), ("final", (s,)),
         ("hint", (s,)), ("row_start", (s,)), ("row_len", (s,)), ("top_k", (s,)), ("seeds", (s,)),
         ("counters", (s,))]
    if key.full:
        u = TABLE_WIDTH
        f += [("fresh", (s,)), ("prompt_len", (s,)), ("suppress", (s,)), ("processed", (s,)),
              ("upload_slot", (u,)), ("upload_pos", (u,)), ("upload_tok", (u,))]
    if key.mask_words:
        f.append(("bitmask", (s, key.mask_words)))
    return f


def float_fields(key: StepKey) -> list[tuple[str, tuple[int, ...]]]:
    s = key.rows
    f = [("temperature", (s,)), ("top_p", (s,))]
    if key.full:
        f += [("repetition", (s,)), ("presence", (s,)), ("frequency", (s,)), ("min_p", (s,)),
              ("upload_val", (TABLE_WIDTH,))]
    return f


@dataclasses.dataclass
class StepBatch:
    """The host side of one step: `key` plus numpy arrays named by int_fields / float_fields.

    `ints` and `floats` are the packed buffers that go to the device (and, multi-host, that process 0
    would broadcast); `rows` lists (request id, tokens computed) in row order for the commit.
    """

    key: StepKey
    ints: np.ndarray
    floats: np.ndarray
    rows: list[tuple[int, int]]
    row_index: list[int]  # row position of rows[i] in the [S] arrays (shard segments leave gaps)
    n_scheduled: int  # real tokens (the rest of key.tokens is padding)

    def view(self, name: str) -> np.ndarray:
        return _unpack(self.ints, int_fields(self.key), np)[name] if name in dict(int_fields(self.key)) \
            else _unpack(self.floats, float_fields(self.key), np)[name]


# Each input field starts on a 256-byte boundary of its packed buffer (64 four-byte values). XLA may hand
# a kernel a slice of the packed parameter in place, and Mosaic GPU kernels refuse operands that are not
# 256-byte aligned ("Input buffer 2 is not 256-byte aligned" from the MLA kernel's page table).
INPUT_ALIGN = 64


def _offsets(fields, align: int) -> tuple[tuple[int, ...], int]:
    """Start of each field in the packed buffer (each a multiple of `align`), and the buffer's length."""
    return _offsets_cached(tuple(shape for _, shape in fields), align)


@functools.lru_cache(maxsize=1024)
def _offsets_cached(shapes: tuple[tuple[int, ...], ...], align: int) -> tuple[tuple[int, ...], int]:
    # Called several times per engine step (build, unpack, outputs): cached, and math.prod, not np.prod.
    starts, off = [], 0
    for shape in shapes:
        starts.append(off)
        off += -(-math.prod(shape) // align) * align
    return tuple(starts), off


def packed_size(fields, align: int = INPUT_ALIGN) -> int:
    """Length of the packed buffer holding `fields` (what `build` fills and the step unpacks)."""
    return _offsets(fields, align)[1]


def _unpack(buf, fields, xp, align: int = INPUT_ALIGN) -> dict[str, Any]:
    """Views of the packed `buf` by field name; outputs (packed densely on device) pass `align=1`."""
    starts, _ = _offsets(fields, align)
    return {name: buf[off:off + math.prod(shape)].reshape(shape)
            for (name, shape), off in zip(fields, starts, strict=True)}


@dataclasses.dataclass
class RowPlan:
    """One scheduled sequence: its `n` new tokens at positions start .. start+n-1, how to get each."""

    rid: int
    slot: int  # the request's slot in the device-resident per-request state
    start: int
    tokens: list[int]  # host-known token ids of the chunk (the first `n - pending_last` of it)
    n: int
    pending_last: bool  # the chunk's last token is the one the running step samples (read on device)
    final: bool  # the chunk reaches the sequence's end: sample after it
    ndraft: int
    hint: int  # the token after the chunk when not final (MTP input), else 0
    pages: list[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    counter: int  # index (in the output) of the token this row samples
    shard: int = 0
    processing: LogitsProcessing | None = None  # the request's logits processors (None: none)
    fresh: bool = False  # the request's first row since admission: clear its slot's counts, upload `upload`
    prompt_len: int = 0  # positions before it are prompt tokens (counted as `seen`), the rest output
    upload: tuple[tuple[int, float], ...] = ()  # with fresh: its sparse table (LogitsProcessing.table)
    constrained: bool = False  # a grammar bitmask applies when it samples (the engine fills `bitmask`)


def long_prefill_key(tokens: int, rows: int, width: int, spec_k: int) -> StepKey:
    """The one program of the long-prefill path (one batch shard, unmasked): always the full mode, a
    superset (a greedy row's argmax is the same), so the path costs one program, not a greedy/full pair:
    ~20 s of GPU compile each (2026-12-07)."""
    return StepKey(tokens, rows, width, spec_k, True, 0, True)


def build(rows: list[RowPlan], *, spec_k: int, shapes: StepShapes, width: int, logprobs: bool,
          num_shards: int = 1, scratch_slot: int = 0, mask_words: int = 0,
          long_prefill: tuple[int, tuple[int, int]] | None = None) -> StepBatch:
    """Lay out scheduled rows as a flat, shard-grouped token batch in the smallest of `shapes` that holds
    them, with a page table `width` columns wide (see the module docstring). `mask_words`: the bitmask
    width a constrained row needs (ceil(V/32)); the bitmask field exists only when a sampling row is
    constrained, all ones (every token allowed) until the engine fills the constrained rows'.
    `long_prefill` (from, shape): a step of one row, a prefill chunk starting at position >= from whose
    tokens pick `shape`, is keyed `long_prefill` (naive-form attention; one batch shard only; full mode)."""
    per_tok = [sum(r.n for r in rows if r.shard == s) for s in range(num_shards)]
    per_row = [sum(1 for r in rows if r.shard == s) for s in range(num_shards)]
    n_seg, s_seg = shapes.pick(max(max(per_tok), 1), max(max(per_row), 1))
    longest = max((len(r.pages) for r in rows), default=0)
    if longest > width:
        raise ValueError(f"a row holds {longest} pages but the page table is {width} wide")
    masked = mask_words if any(r.constrained and r.final for r in rows) else 0
    full = logprobs or masked or any(r.temperature > 0 or r.processing is not None for r in rows)
    long = (long_prefill is not None and num_shards == 1 and len(rows) == 1 and not masked
            and rows[0].ndraft == 0 and rows[0].start >= long_prefill[0]
            and (n_seg, s_seg) == long_prefill[1])
    key = (long_prefill_key(n_seg, s_seg, width, spec_k) if long
           else StepKey(n_seg * num_shards, s_seg * num_shards, width, spec_k, bool(full), masked))
    n, s, j = key.tokens, key.rows, spec_k + 1
    ints = np.zeros(packed_size(int_fields(key)), np.int32)
    floats = np.zeros(packed_size(float_fields(key)), np.float32)
    a, f = _unpack(ints, int_fields(key), np), _unpack(floats, float_fields(key), np)
    a["src"][:] = -1
    a["slot"][:] = scratch_slot
    f["top_p"][:] = 1.0
    if key.full:
        f["repetition"][:] = 1.0
        a["upload_slot"][:] = scratch_slot
        uploaded = 0
    if masked:
        a["bitmask"][:] = -1
    next_tok = [sh * n_seg for sh in range(num_shards)]
    next_row = [sh * s_seg for sh in range(num_shards)]
    row_index = []
    for r in rows:
        i, t0 = next_row[r.shard], next_tok[r.shard]
        next_row[r.shard] += 1
        next_tok[r.shard] += r.n
        row_index.append(i)
        sl = slice(t0, t0 + r.n)
        known = len(r.tokens)
        a["tokens"][t0:t0 + known] = r.tokens
        if r.pending_last:
            a["src"][t0 + r.n - 1] = r.slot
        a["positions"][sl] = np.arange(r.start, r.start + r.n)
        a["row_of"][sl] = i
        a["valid"][sl] = 1
        a["table"][i, :len(r.pages)] = r.pages
        a["slot"][i] = r.slot
        # Logits for the last committed token and each draft (decode), or the chunk's last token.
        base = t0 + r.n - 1 - r.ndraft
        a["logit_idx"][i] = np.minimum(base + np.arange(j), t0 + r.n - 1)
        a["ndraft"][i], a["final"][i], a["hint"][i] = r.ndraft, r.final, r.hint
        a["row_start"][i], a["row_len"][i] = t0, r.n
        a["top_k"][i], a["seeds"][i], a["counters"][i] = r.top_k, r.seed, r.counter
        f["temperature"][i], f["top_p"][i] = r.temperature, r.top_p
        if key.full:
            p = r.processing
            # only a processed request's slot state is ever read: others need no clearing
            a["fresh"][i], a["prompt_len"][i] = r.fresh and p is not None, r.prompt_len
            if p is not None:
                a["processed"][i] = 1
                a["suppress"][i] = r.counter < p.min_tokens
                f["repetition"][i], f["presence"][i] = p.repetition_penalty, p.presence_penalty
                f["frequency"][i], f["min_p"][i] = p.frequency_penalty, p.min_p
            if r.fresh and r.upload:
                m = len(r.upload)
                if uploaded + m > TABLE_WIDTH:
                    raise ValueError(f"rows upload {uploaded + m} table entries; a step holds {TABLE_WIDTH}")
                up = slice(uploaded, uploaded + m)
                a["upload_slot"][up], a["upload_pos"][up] = r.slot, np.arange(m)
                a["upload_tok"][up] = [t for t, _ in r.upload]
                f["upload_val"][up] = [v for _, v in r.upload]
                uploaded += m
    # Padding tokens and rows point at row 0 / token 0 (finite, discarded) and never write a real page.
    del n, s
    return StepBatch(key, ints, floats, [(r.rid, r.n) for r in rows], row_index, sum(per_tok))


# ---------------------------------------------------------------------------------------- device
def out_fields(key: StepKey) -> list[tuple[str, tuple[int, ...]]]:
    s, j = key.rows, key.spec_k + 1
    f = [("tokens", (s, j)), ("n_new", (s,)), ("finite", (s,))]
    if key.spec_k:
        f.append(("drafts", (s, key.spec_k)))
    if key.logprobs:
        f.append(("top_ids", (s, j, MAX_LOGPROBS)))
    return f


def out_float_fields(key: StepKey) -> list[tuple[str, tuple[int, ...]]]:
    s, j = key.rows, key.spec_k + 1
    return [("logprob", (s, j)), ("top_logprobs", (s, j, MAX_LOGPROBS))] if key.logprobs else []


def unpack_outputs(key: StepKey, ints: np.ndarray, floats: np.ndarray | None) -> dict[str, np.ndarray]:
    out = _unpack(ints, out_fields(key), np, align=1)
    if floats is not None:
        out.update(_unpack(floats, out_float_fields(key), np, align=1))
    return out


def init_state(num_slots: int, spec_k: int, vocab: int) -> dict[str, jax.Array]:
    """Device-resident per-request state: the last sampled token (and the MTP draft distribution), and what
    the logits processors read (module docstring): token counts, prompt tokens, the sparse table."""
    state = {"last_token": jnp.zeros((num_slots,), jnp.int32),
             "counts": jnp.zeros((num_slots, vocab), jnp.int32),
             "seen": jnp.zeros((num_slots, vocab), jnp.bool_),
             "table_ids": jnp.zeros((num_slots, TABLE_WIDTH), jnp.int32),
             "table_vals": jnp.zeros((num_slots, TABLE_WIDTH), jnp.float32)}
    if spec_k:
        state["draft_probs"] = jnp.zeros((num_slots, spec_k, vocab), jnp.float32)
    return state


def make_step(model: Any, key: StepKey):
    """The device step for `key`: (params, cache, state, ints, floats) -> (out_ints, out_floats, cache,
    state). Jit it with the cache and state donated."""
    k = key.spec_k

    def step(params, cache, state, ints, floats):
        a = _unpack(ints, int_fields(key), jnp)
        f = _unpack(floats, float_fields(key), jnp)
        n = key.tokens
        last = state["last_token"]
        toks = jnp.where(a["src"] >= 0, last[jnp.maximum(a["src"], 0)], a["tokens"])
        valid = a["valid"] > 0
        tok_table = a["table"][a["row_of"]]  # [N, W]: each token's page-table row
        meta = PageMeta(tok_table, a["valid"], long_prefill=key.long_prefill)
        logits, hidden, cache = model.apply({"params": params}, toks[:, None], a["positions"][:, None],
                                            cache, meta, a["logit_idx"])  # [S, k+1, V]
        ndraft, final = a["ndraft"], a["final"] > 0
        j = jnp.arange(k + 1)[None, :]
        finite = jnp.all(jnp.isfinite(logits) | (j > ndraft[:, None])[..., None], axis=(1, 2))
        sp = SamplingParams(f["temperature"], f["top_p"], a["top_k"])
        raw = logits
        if key.full:
            state = _update_processor_state(state, a, f, toks, valid)
            logits = _processed_logits(logits, state, a, f, a["bitmask"] if key.mask_words else None)
        drafts_in = toks[jnp.minimum(a["logit_idx"] + 1, n - 1)][:, :k]  # the token after each scored one
        qprobs = state["draft_probs"][a["slot"]] if k and key.sampled else None
        tokens, n_new = speculative_sample(logits, drafts_in, ndraft, sp, a["seeds"], a["counters"], qprobs,
                                           sampled=key.sampled)
        rows = jnp.arange(key.rows)
        emitted_last = tokens[rows, n_new - 1]
        scratch = state["last_token"].shape[0] - 1
        state = {**state, "last_token": last.at[jnp.where(final, a["slot"], scratch)].set(emitted_last)}
        outs = [tokens, n_new, finite.astype(jnp.int32)]
        fl = []
        if k:
            commit = a["row_len"] - ndraft + n_new - 1
            nxt = jnp.where(final, emitted_last, a["hint"])
            live = final & (a["row_len"] > 0)
            drafts, dprobs, cache = mtp_draft.propose(
                model, params, cache, hidden=hidden, tokens=toks, positions=a["positions"],
                tok_table=tok_table, valid=valid, row_of=a["row_of"], row_start=a["row_start"],
                commit=commit, next_token=nxt, table=a["table"], live=live, sp=sp, seeds=a["seeds"],
                counters=a["counters"] + n_new - 1, k=k, sampled=key.sampled)
            outs.append(drafts)
            if key.sampled:
                dst = jnp.where(final, a["slot"], scratch)
                state["draft_probs"] = state["draft_probs"].at[dst].set(dprobs)
        if key.logprobs:
            lp, top_ids, top_lp = token_logprobs(raw, tokens)
            outs.append(top_ids)
            fl = [lp, top_lp]
        out_ints = jnp.concatenate([o.astype(jnp.int32).reshape(-1) for o in outs])
        out_floats = jnp.concatenate([o.reshape(-1) for o in fl]) if fl else jnp.zeros((0,), jnp.float32)
        return out_ints, out_floats, cache, state

    return step


_PROCESSOR_STATE = ("counts", "seen", "table_ids", "table_vals")


def _update_processor_state(state: dict, a: dict, f: dict, toks: jax.Array, valid: jax.Array) -> dict:
    """The per-slot processor state after this step's bookkeeping (module docstring): fresh slots cleared
    (a loop over the fresh rows only, so a step without admissions writes no [slots, V] rows), their
    tables uploaded, every computed token counted."""
    scratch = state["last_token"].shape[0] - 1
    slot = a["slot"]
    fresh = a["fresh"] > 0
    fresh_slots = slot[jnp.argsort(~fresh, stable=True)]  # the fresh rows' slots first

    def clear(i, arrays):
        return tuple(jax.lax.dynamic_update_slice(x, jnp.zeros((1, x.shape[1]), x.dtype), (fresh_slots[i], 0))
                     for x in arrays)

    counts, seen, ids, vals = jax.lax.fori_loop(0, jnp.sum(fresh), clear,
                                                tuple(state[k] for k in _PROCESSOR_STATE))
    ids = ids.at[a["upload_slot"], a["upload_pos"]].set(a["upload_tok"])
    vals = vals.at[a["upload_slot"], a["upload_pos"]].set(f["upload_val"])
    tok_slot = jnp.where(valid, slot[a["row_of"]], scratch)
    is_out = a["positions"] >= a["prompt_len"][a["row_of"]]
    counts = counts.at[jnp.where(is_out, tok_slot, scratch), toks].add(1)
    seen = seen.at[jnp.where(is_out, scratch, tok_slot), toks].set(True)
    return {**state, "counts": counts, "seen": seen, "table_ids": ids, "table_vals": vals}


def _processed_logits(logits: jax.Array, state: dict, a: dict, f: dict, bitmask: jax.Array | None
                      ) -> jax.Array:
    """The rows' logits after their processors (sampling.process_logits). A step whose rows have none
    (default sampled requests) skips the [rows, V] gathers and math at run time (lax.cond); the grammar
    bitmask applies either way."""
    slot = a["slot"]

    def processed(x):
        proc = ProcessorInputs(f["repetition"], f["presence"], f["frequency"], f["min_p"], a["suppress"] > 0,
                               state["table_ids"][slot], state["table_vals"][slot], state["counts"][slot],
                               state["seen"][slot])
        return process_logits(x, f["temperature"], proc, bitmask)

    def plain(x):
        x = x.astype(jnp.float32)
        if bitmask is None:
            return x
        return jnp.where(unpack_bitmask(bitmask, x.shape[-1])[:, None, :], x, -jnp.inf)

    return jax.lax.cond(jnp.any(a["processed"] > 0), processed, plain, logits)
