"""What the MLA kernels (`mla_decode.py`, `mla_prefill.py`) and their reference (`mla_reference.py`) share.

Owns: the cache widths (`LATENT_DIM` 512 + `ROPE_DIM` 64 = `KV_DIM` 576 values per token), the kernel's
`PAGE_SIZE` (64 tokens; `dsv3_jax.model.kv_cache.PAGE_SIZE` must equal it, a test ties the two since kernels
import nothing from dsv3_jax), the argument checks (`as_4d`, `check_cache_args`, `kernel_shape_error`,
`check_kernel_args`), `clamp_page_ids` (the rule for ids outside the pool) and `mask_padding_rows`, the
rule for a chunk's padding rows. The reference keeps the semantics, the kernel modules the kernels; this
module imports neither, so nothing imports a private helper across modules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LATENT_DIM = 512  # the compressed latent c (DeepSeek-V3 kv_lora_rank)
ROPE_DIM = 64  # the shared rotary key k_rope (qk_rope_head_dim)
KV_DIM = LATENT_DIM + ROPE_DIM  # values per cached token: c ++ k_rope
PAGE_SIZE = 64  # tokens per cache page the kernels take: one TMA load of 64 x 576 per pipeline step
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma operands


def as_4d(q_latent: jax.Array, q_rope: jax.Array) -> tuple[jax.Array, jax.Array, bool]:
    """[B, H, D] -> [B, 1, H, D] (4-D passes); returns whether the input was 3-D. Checks the pair agrees."""
    if q_latent.ndim != q_rope.ndim or q_latent.ndim not in (3, 4):
        raise ValueError(
            f"q_latent/q_rope must both be [B, H, D] or [B, Q, H, D], got {q_latent.shape} and {q_rope.shape}"
        )
    squeeze = q_latent.ndim == 3
    if squeeze:
        q_latent, q_rope = q_latent[:, None], q_rope[:, None]
    if q_rope.shape[-1] >= q_latent.shape[-1]:
        raise ValueError(f"q_rope ({q_rope.shape[-1]}) must be narrower than q_latent ({q_latent.shape[-1]})")
    if q_latent.shape[:-1] != q_rope.shape[:-1]:
        raise ValueError(f"q_latent {q_latent.shape} and q_rope {q_rope.shape} disagree before the last dim")
    return q_latent, q_rope, squeeze


def check_chunk_query(q_latent: jax.Array) -> None:
    """A chunk (prefill) query must be [B, T, H, D]; a 3-D one is a decode query."""
    if q_latent.ndim != 4:
        raise ValueError(f"q_latent must be [B, T, H, {LATENT_DIM}], got {q_latent.shape}")


def check_cache_args(kv_pages: jax.Array, block_table: jax.Array, batch: int, **lengths: jax.Array) -> None:
    """Shape and dtype checks shared by references and kernels: the pool, the page table, and each
    per-sequence length or position in `lengths` (by its argument name) as [B] integers."""
    if kv_pages.ndim != 3:
        raise ValueError(f"kv_pages must be [num_pages, page_size, latent + rope], got {kv_pages.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B={batch}, max_pages], got {block_table.shape}")
    for name, x in (("block_table", block_table), *lengths.items()):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {x.dtype}")
        if name != "block_table" and x.shape != (batch,):
            raise ValueError(f"{name} must be [B={batch}], got {x.shape}")


def clamp_page_ids(block_table: jax.Array, num_pages: int) -> jax.Array:
    """The rule for page ids outside [0, num_pages): the nearest end page. Kernels and references both
    apply it, so a bad table reads only the pool and both give the same result (a kernel has no way to
    raise on a traced id, and an unclamped id is a read outside the pool on the GPU)."""
    return jnp.clip(block_table, 0, num_pages - 1)


def kernel_shape_error(latent: int, rope: int, kv_shape: tuple[int, ...]) -> str | None:
    """Why the kernels cannot take these widths / this page size (None when they can). The reference
    takes any latent width and page size; the kernels need DeepSeek's 512 + 64 and `PAGE_SIZE`."""
    if latent != LATENT_DIM or rope != ROPE_DIM or kv_shape[-1] != KV_DIM:
        return (f"the Pallas kernel needs q_latent/q_rope/kv_pages widths {LATENT_DIM}/{ROPE_DIM}/{KV_DIM}, "
                f"got {latent}/{rope}/{kv_shape[-1]}")
    if kv_shape[1] != PAGE_SIZE:
        return f"the Pallas kernel needs page_size {PAGE_SIZE}, got kv_pages {tuple(kv_shape)}"
    return None


def check_kernel_args(q_latent: jax.Array, q_rope: jax.Array, kv_pages: jax.Array, block_table: jax.Array,
                      **lengths: jax.Array) -> None:
    """All checks the kernels make on [B, Q, H, D] queries before launching (`lengths` as in
    `check_cache_args`)."""
    check_cache_args(kv_pages, block_table, q_latent.shape[0], **lengths)
    err = kernel_shape_error(q_latent.shape[-1], q_rope.shape[-1], kv_pages.shape)
    if err:
        raise ValueError(err)
    if q_latent.dtype not in KERNEL_DTYPES or kv_pages.dtype != q_latent.dtype:
        raise ValueError(
            f"q_latent, q_rope and kv_pages must share a 16-bit float dtype, got {q_latent.dtype}, "
            f"{q_rope.dtype}, {kv_pages.dtype}"
        )


def mask_padding_rows(out: jax.Array, lse: jax.Array, chunk_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Zero out / -inf the rows t >= chunk_lens[b] of [B, T, H, ...] results."""
    valid = jnp.arange(out.shape[1])[None, :] < chunk_lens[:, None]  # [B, T]
    out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(valid[:, :, None], lse, -jnp.inf)
    return out, lse
