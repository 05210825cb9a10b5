"""Plain-`jnp` references for absorbed MLA attention over a paged latent cache.

Owns the semantics that the Pallas kernels in `mla_decode.py` and `mla_prefill.py` must match; the
kernels' tests and benchmarks compare against these. Nothing here is GPU specific.

Cache layout (shared with the kernels): `kv_pages [num_pages, page_size, 576]`, per token the 512-wide
latent `c` followed by the 64-wide shared `k_rope`. `block_table [B, max_pages] int32` maps a
sequence's logical page `i` (positions `i*page_size ... (i+1)*page_size - 1`) to a physical page.
Scores are `q_latent . c + q_rope . k_rope`, values are `c`; the output is the attention-weighted latent
(before W_uv) and `lse` is the natural-log log-sum-exp of the scaled scores.

The widths, page size, argument checks and the padding-row rule live in `mla_common.py`.

FP8 cache: `kv_pages` may be `mla_common.Fp8Pages` (latent [P, page_size, L] e4m3, scale [P, L/128,
page_size] fp32, rope [P, page_size, R] bf16; 656 bytes per token for DeepSeek-V3); every reference
dequantizes the gathered pages (`mla_common.dequantize_kv`) into q's dtype and then computes exactly as
for a value cache.

Cache slots past a sequence's length may hold any *finite* value: they are masked out of the softmax,
but a NaN there would still reach the output through `0 * NaN`.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.mla_common import (
    Fp8Pages,
    as_4d,
    cache_widths,
    check_cache_args,
    check_chunk_query,
    clamp_page_ids,
    dequantize_kv,
    is_fp8_cache,
    mask_padding_rows,
)


def paged_attention_reference(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_table: jax.Array,
    q_start: jax.Array,
    kv_len: jax.Array,
    *,
    softmax_scale: float,
) -> tuple[jax.Array, jax.Array]:
    """Core of both references: query j of sequence b sits at absolute position q_start[b] + j and
    attends to positions p with p <= q_start[b] + j and p < kv_len[b]. q_* are [B, Q, H, D].

    Matmuls run in the input dtype with fp32 accumulation (pass fp32 inputs for an fp32 reference).
    """
    b, nq, _, lat = q_latent.shape
    rope = q_rope.shape[-1]
    fp8 = is_fp8_cache(kv_pages)
    num_pages, page_size, width = cache_widths(kv_pages)
    if fp8 and kv_pages.latent.shape[-1] != lat:
        raise ValueError(f"FP8 kv_pages latent width {kv_pages.latent.shape[-1]} != q_latent {lat}")
    if width != lat + rope:
        raise ValueError(f"kv_pages width {width} (latent + rope) != q_latent {lat} + q_rope {rope}")
    # Any latent width (512 for DeepSeek-V3; tiny test models use less); the kernels need 512 + 64.
    ids = clamp_page_ids(block_table, num_pages)
    if fp8:  # dequantized page by page (scale block-major per page), then as a value cache
        pages = dequantize_kv(Fp8Pages(*(x[ids] for x in kv_pages)), rope, q_latent.dtype)
    else:
        pages = kv_pages[ids]
    kv = pages.reshape(b, -1, width)  # [B, S_max, 576], gathered pages
    scores = jnp.einsum("bqhc,bsc->bqhs", q_latent, kv[..., :lat], preferred_element_type=jnp.float32)
    scores += jnp.einsum("bqhr,bsr->bqhs", q_rope, kv[..., lat:], preferred_element_type=jnp.float32)
    scores *= softmax_scale
    pos = jnp.arange(block_table.shape[1] * page_size)
    limit = jnp.minimum(q_start[:, None] + 1 + jnp.arange(nq)[None, :], kv_len[:, None])  # [B, Q]
    mask = pos[None, None, :] < limit[:, :, None]  # [B, Q, S]
    scores = jnp.where(mask[:, :, None, :], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, Q, H]
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum(
        "bqhs,bsc->bqhc", probs.astype(kv.dtype), kv[..., :lat], preferred_element_type=jnp.float32
    )
    return out.astype(q_latent.dtype), lse


def mla_decode_reference(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    softmax_scale: float,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode: the Q newest tokens of each sequence (already in the cache) attend causally.

    q_latent [B, H, 512] or [B, Q, H, 512]; q_rope likewise with 64; seq_lens [B] counts the cached
    tokens including the Q new ones (so seq_lens >= Q). Query j attends to positions
    < seq_lens - Q + 1 + j. Returns out shaped like q_latent (q's dtype) and lse [B, H] / [B, Q, H]
    float32. `interpret` exists only to share the kernel's signature and is ignored.
    """
    del interpret
    q_latent, q_rope, squeeze = as_4d(q_latent, q_rope)
    check_cache_args(kv_pages, block_table, q_latent.shape[0], seq_lens=seq_lens)
    seq_lens = seq_lens.astype(jnp.int32)
    out, lse = paged_attention_reference(
        q_latent, q_rope, kv_pages, block_table, seq_lens - q_latent.shape[1], seq_lens,
        softmax_scale=softmax_scale,
    )
    if squeeze:
        out, lse = out[:, 0], lse[:, 0]
    return out, lse


def mla_prefill_reference(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_table: jax.Array,
    start_pos: jax.Array,
    chunk_lens: jax.Array,
    *,
    softmax_scale: float,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA chunked prefill: a chunk of T new tokens whose latents are already in the pages.

    q_latent [B, T, H, 512], q_rope [B, T, H, 64]; token t of sequence b is at absolute position
    start_pos[b] + t and attends to positions 0 .. start_pos[b] + t (cached prefix plus the chunk, causal).
    Rows t >= chunk_lens[b] are padding: their out is 0 and their lse is -inf.
    Returns out [B, T, H, 512] (q's dtype) and lse [B, T, H] float32. `interpret` is ignored.
    """
    del interpret
    check_chunk_query(q_latent)
    q_latent, q_rope, _ = as_4d(q_latent, q_rope)
    check_cache_args(kv_pages, block_table, q_latent.shape[0], start_pos=start_pos, chunk_lens=chunk_lens)
    start_pos = start_pos.astype(jnp.int32)
    chunk_lens = chunk_lens.astype(jnp.int32)
    out, lse = paged_attention_reference(
        q_latent, q_rope, kv_pages, block_table, start_pos, start_pos + chunk_lens,
        softmax_scale=softmax_scale,
    )
    return mask_padding_rows(out, lse, chunk_lens)

