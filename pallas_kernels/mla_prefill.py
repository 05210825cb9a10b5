"""Pallas Mosaic GPU kernel: absorbed MLA chunked prefill over a paged latent cache.

Owns `mla_prefill`. Signature (same as `mla_reference.mla_prefill_reference`):

    mla_prefill(q_latent [B, T, H, 512], q_rope [B, T, H, 64], kv_pages [num_pages, 64, 576],
                block_table [B, max_pages] int32, start_pos [B] int32, chunk_lens [B] int32,
                *, softmax_scale, interpret=False, num_splits=None) -> (out [B, T, H, 512], lse [B, T, H])

A chunk of T (padded) new tokens per sequence; token t sits at absolute position start_pos[b] + t and
its latent is already written into the pages, so it attends causally to the cached prefix and the chunk
(positions 0 .. start_pos[b] + t). Rows t >= chunk_lens[b] are padding: out 0, lse -inf. This is the
absorbed form (scores over the 576-wide latent, values the 512-wide latent, W_uv applied afterwards by
the caller); it reuses the decode kernel core in `mla_decode.py`, whose row tiles of (token, head)
pairs visit only the pages at or below their last token, so causal skipping comes for free.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mla_decode import paged_mla_attention
from pallas_kernels.mla_reference import _as_4d, mask_padding_rows


@functools.partial(jax.jit, static_argnames=("softmax_scale", "num_splits", "interpret"))
def mla_prefill(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_table: jax.Array,
    start_pos: jax.Array,
    chunk_lens: jax.Array,
    *,
    softmax_scale: float,
    interpret: bool = False,
    num_splits: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA chunked-prefill attention; see the module docstring for the contract."""
    if q_latent.ndim != 4:
        raise ValueError(f"q_latent must be [B, T, H, 512], got {q_latent.shape}")
    q_latent, q_rope, _ = _as_4d(q_latent, q_rope)
    start_pos = start_pos.astype(jnp.int32)
    chunk_lens = chunk_lens.astype(jnp.int32)
    out, lse = paged_mla_attention(
        q_latent, q_rope, kv_pages, block_table, start_pos, start_pos + chunk_lens,
        softmax_scale=softmax_scale, num_splits=num_splits, interpret=interpret,
    )
    return mask_padding_rows(out, lse, chunk_lens)
