"""Pallas Mosaic GPU kernel: absorbed MLA chunked prefill over a paged latent cache, and the one adaptor
that routes a chunk to this kernel or to its reference.

Owns `mla_prefill` and `mla_chunk_attention`. Signature (same as `mla_reference.mla_prefill_reference`):

    mla_prefill(q_latent [B, T, H, 512], q_rope [B, T, H, 64], kv_pages [num_pages, 64, 576],
                block_table [B, max_pages] int32, start_pos [B] int32, chunk_lens [B] int32,
                *, softmax_scale, interpret=None, num_splits=None) -> (out [B, T, H, 512], lse [B, T, H])

kv_pages may also be `mla_common.Fp8Pages` (then q must be bf16): the FP8-page kernel `mla_decode_fp8` runs.

A chunk of T (padded) new tokens per sequence; token t sits at absolute position start_pos[b] + t and
its latent is already written into the pages, so it attends causally to the cached prefix and the chunk
(positions 0 .. start_pos[b] + t). Rows t >= chunk_lens[b] are padding: out 0, lse -inf. This is the
absorbed form (scores over the 576-wide latent, values the 512-wide latent, W_uv applied afterwards by
the caller); it reuses the decode kernel core in `mla_decode.py` (`mla_decode_fp8.py` for FP8 pages),
whose row tiles of (token, head) pairs visit only the pages at or below their last token, so causal
skipping comes for free. Padding rows are masked inside the split merge (`mla_decode.merge_splits`),
not by a separate op.

`mla_chunk_attention` takes the same arguments for kernel and reference (decode is a chunk of T = 1 at
start_pos = length - 1) and owns the dtype handling around each, so callers
(`dsv3_jax.model.kernel_dispatch`, tests, benchmarks) only choose `use_kernel`.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mla_common import as_4d, check_cache_args, check_chunk_query, is_fp8_cache
from pallas_kernels.mla_decode import paged_mla_attention
from pallas_kernels.mla_decode_fp8 import paged_mla_fp8_attention
from pallas_kernels.mla_reference import mla_prefill_reference


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
    interpret: bool | None = None,
    num_splits: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA chunked-prefill attention; see the module docstring for the contract.
    `interpret=None` runs Pallas' GPU interpreter whenever the default backend is not a GPU."""
    check_chunk_query(q_latent)
    q_latent, q_rope, _ = as_4d(q_latent, q_rope)
    check_cache_args(kv_pages, block_table, q_latent.shape[0], start_pos=start_pos, chunk_lens=chunk_lens)
    start_pos = start_pos.astype(jnp.int32)
    chunk_lens = chunk_lens.astype(jnp.int32)
    attend = paged_mla_fp8_attention if is_fp8_cache(kv_pages) else paged_mla_attention
    return attend(
        q_latent, q_rope, kv_pages, block_table, start_pos, start_pos + chunk_lens,
        softmax_scale=softmax_scale, num_splits=num_splits, interpret=interpret, valid_queries=chunk_lens,
    )


def mla_chunk_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_table: jax.Array,
    start_pos: jax.Array,
    chunk_lens: jax.Array,
    *,
    softmax_scale: float,
    use_kernel: bool,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A chunk of new tokens over a paged latent cache, by the kernel or by the reference.

    Arguments as `mla_prefill`. The kernel computes in the cache's dtype (q is cast to it, out comes
    back in it); the reference computes in q_latent's dtype (q_rope and the cache are cast to it, so
    fp32 queries give an fp32 reference). Checking that the kernel can take the shapes is the caller's
    choice of `use_kernel` (`mla_common.kernel_shape_error`); the kernel raises if it cannot. An FP8
    cache (`mla_common.Fp8Pages`) is read as it is by both: the kernel is then `mla_decode_fp8`'s, in bf16.
    """
    fp8 = is_fp8_cache(kv_pages)
    if use_kernel:
        dt = jnp.bfloat16 if fp8 else kv_pages.dtype
        return mla_prefill(q_latent.astype(dt), q_rope.astype(dt), kv_pages, block_table, start_pos,
                           chunk_lens, softmax_scale=softmax_scale, interpret=interpret)
    return mla_prefill_reference(q_latent, q_rope.astype(q_latent.dtype),
                                 kv_pages if fp8 else kv_pages.astype(q_latent.dtype),
                                 block_table, start_pos, chunk_lens, softmax_scale=softmax_scale)
