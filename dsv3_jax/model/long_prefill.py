"""Naive-form attention for one sequence's prefill chunk over the absorbed (latent) page pool.

Why: at a long prefix the absorbed form is the slower algorithm. Per (query, key) pair and head it does
2 x (576 + 512) FLOP against the naive form's 2 x (192 + 128): 3.4x the work. Measured on an H100
(RESULTS.md, 2026-12-05), our absorbed chunk kernel over a 128K prefix took 2.5x cuDNN's naive-form
time. Expanding the prefix's latents into per-head K/V costs 2 x 512 x H x 256 FLOP per key, ~10% of the
attention of a 4,096-token chunk. So a long chunk expands its prefix block by block and runs flash
attention on the naive shapes, as vLLM and SGLang do for MLA prefill.

How: the pool is read block by block (`BLOCK_TOKENS` keys): its latents (dequantized when the pool is
FP8) go through W_uk / W_uv into K [S, H, 192] and V [S, H, 128]. The chunk attends to each block
without a mask, and to its own keys causally. The partial results are merged by their log-sum-exps.
The loop runs only over the blocks the prefix fills, so a chunk at prefix s costs O(s), whatever the
page table's width. The chunk's own keys are read back from the pool too, so an FP8 pool gives the same
rounded values the absorbed path reads.

The per-block attention is `kernel_dispatch.flash_attention`: cuDNN's flash attention on a GPU, a
plain-jnp reference elsewhere.

Owns: the block loop, the expansion, the merge and the path's transient memory (`transient_bytes`).
Must not write the pool, pick which steps take this path (engine: step.py / EngineConfig.long_prefill_from)
or know about layers or meshes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv3_jax.model import kernel_dispatch as kernels

BLOCK_TOKENS = 16384  # keys expanded at once: 1.3 GB of bf16 K/V at 128 heads; merges cost ~5% at 4K queries


def transient_bytes(heads: int, qk_head_dim: int, v_head_dim: int, chunk: int, max_keys: int) -> int:
    """Peak bytes `chunk_attention` holds beyond the step's other activations, on a device with `heads` heads:
    one block's K and V in bf16 and their fp32 products before the cast (at most `max_keys` keys), the
    chunk's own K/V likewise, and the fp32 output and merge state of the chunk's queries. The pool planner
    reserves it for engines that run the path (plan.activation_estimate)."""
    keys = min(BLOCK_TOKENS, max_keys) + chunk
    per_key = heads * (2 * (qk_head_dim + v_head_dim) + 4 * 2 * v_head_dim)
    return keys * per_key + chunk * heads * 4 * (3 * v_head_dim + 2)


def _merge(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two softmax-normalized partial outputs [N, H, dv] over disjoint keys, with their natural-log lse
    [N, H], as one (fp32): the MLA kernel's split merge (`mla_decode.merge_partials`) over the pair. An
    empty part has lse -inf and weighs nothing."""
    from pallas_kernels.mla_decode import merge_partials

    return merge_partials(jnp.stack([o_a, o_b], axis=1), jnp.stack([lse_a, lse_b], axis=1))


def _expand(values: jax.Array, w_uk: jax.Array, w_uv: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Cache values [S, R + r] -> K [S, H, dn + r] (k_nope from W_uk, the shared k_rope broadcast) and
    V [S, H, dv], in `dtype` (fp32 accumulation)."""
    r = w_uk.shape[1]
    c, k_rope = values[:, :r].astype(dtype), values[:, r:].astype(dtype)
    k_nope = jnp.einsum("sr,hrd->shd", c, w_uk, preferred_element_type=jnp.float32).astype(dtype)
    v = jnp.einsum("sr,hvr->shv", c, w_uv, preferred_element_type=jnp.float32).astype(dtype)
    h = w_uk.shape[0]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None, :], (c.shape[0], h, k_rope.shape[-1]))], -1)
    return k, v


def chunk_attention(q_nope: jax.Array, q_rope: jax.Array, read_pages, table: jax.Array, start: jax.Array,
                    n_valid: jax.Array, w_uk: jax.Array, w_uv: jax.Array, *, page_size: int,
                    softmax_scale: float, backend: str, block_tokens: int | None = None) -> jax.Array:
    """One sequence's chunk: query t (t < n_valid) at position start + t attends to positions
    0 .. start + t. Returns out [N, H, dv] in q's dtype (after W_uv: the naive form's output).

    q_nope [N, H, dn], q_rope [N, H, r]; `read_pages(ids [n]) -> values [n * page_size, R + r]` reads
    the pool (already holding the chunk's own keys); `table` [W] the sequence's page ids; start, n_valid
    int32 scalars; w_uk [H, R, dn], w_uv [H, dv, R] (kv_b.py's orientation). Rows t >= n_valid are
    padding (finite, discarded).
    """
    n, h, _ = q_nope.shape
    dv = w_uv.shape[1]
    dtype = q_nope.dtype
    q = jnp.concatenate([q_nope, q_rope.astype(dtype)], axis=-1)
    bp = max(1, (block_tokens or BLOCK_TOKENS) // page_size)  # pages per block
    self_pages = -(-(n + page_size - 1) // page_size)  # pages n tokens span from any offset within a page
    width = table.shape[0]
    # Padded so that every block's and the chunk's page window is a static-size slice (page 0 is scratch:
    # finite, and masked out by the lengths below).
    table = jnp.concatenate([table, jnp.zeros((bp + self_pages,), table.dtype)])

    def attend(k, v, q_len, kv_len, causal):
        return kernels.flash_attention(q, k, v, q_len, kv_len, causal=causal, softmax_scale=softmax_scale,
                                       backend=backend)

    # The prefix [0, start): whole blocks, no mask but the key count of the last one.
    def block(i, acc):
        o, lse = acc
        ids = jax.lax.dynamic_slice(table, (i * bp,), (bp,))
        k, v = _expand(read_pages(ids), w_uk, w_uv, dtype)
        kv_len = jnp.clip(start - i * bp * page_size, 0, bp * page_size)
        o_b, lse_b = attend(k, v, n_valid, kv_len, causal=False)
        return _merge(o, lse, o_b, lse_b)

    acc = (jnp.zeros((n, h, dv), jnp.float32), jnp.full((n, h), -jnp.inf, jnp.float32))
    blocks = (start + bp * page_size - 1) // (bp * page_size)
    o, lse = jax.lax.fori_loop(0, jnp.minimum(blocks, -(-width // bp)), block, acc)

    # The chunk's own keys [start, start + n_valid), causal (query t sees keys 0..t of the chunk).
    first = start // page_size
    ids = jax.lax.dynamic_slice(table, (first,), (self_pages,))
    values = jax.lax.dynamic_slice_in_dim(read_pages(ids), start - first * page_size, n, axis=0)
    k, v = _expand(values, w_uk, w_uv, dtype)
    o_s, lse_s = attend(k, v, n_valid, n_valid, causal=True)
    o, _ = _merge(o, lse, o_s, lse_s)
    return o.astype(dtype)
