"""Paged KV caches: allocation from the declared layout, page metadata and the page read/write helpers.

The cache layout (leaf names, shapes, dtypes, logical axes) is declared once in `layout.cache_layout`:
absorbed form `pages [L, P, page_size, kv_lora_rank + rope]` (576 values per token per layer for V3) or,
FP8, the three leaves `layout.FP8_LEAVES` (latent e4m3, fp32 scales block-major per page, rope bf16),
naive form `k_pages` / `v_pages`, one subtree per scanned stack plus the MTP layer; `allocate` is its
zeros and `layout.bytes_per_token` its cost. A sequence's logical page i (positions i*page_size ...)
lives in physical page `block_table[b, i]`; physical page 0 is scratch that is never handed out (padding
tokens are written there). The page size is `PAGE_SIZE` (the MLA kernels keep their own copy,
`pallas_kernels.mla_common.PAGE_SIZE`, since kernels import nothing from dsv3_jax; a test ties the two).
`latent_rows` puts new tokens in the pool's format (an FP8 pool quantizes them: the step's cache write
does, in prefill and decode alike) and `absorbed_pages` gives the attention read its pool (one array or
`mla_common.Fp8Pages`); `write_pages` / `gather_pages` / `read_values` (a run of pages as token values, FP8
dequantized: the long-prefill read) are the only code that indexes pages (`layer_view`
hands them one layer of a scanned stack without slicing it out); `clear_pages` zeroes pages (a request
whose numbers went non-finite must not leave NaN where the next owner's masked slots would read it;
zero FP8 pages, scales included, read as zeros). `contiguous_table` gives each
sequence its own fixed run of pages; the engine allocates pages on demand.
Owns: `PAGE_SIZE`, `PageMeta`, allocation and every page index. Must not declare cache shapes (layout.py),
know the model's math or scheduling policy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import layout

PAGE_SIZE = 64  # the MLA kernel's page; one TMA load of 64 x 576 bf16


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PageMeta:
    """Per-call page metadata: block_table [B, max_pages] int32, chunk_lens [B] int32 (valid new tokens).

    Row b's tokens t < chunk_lens[b] are real; the rest are padding (written to page 0, masked out of
    attention and of the MoE's token sort). `long_prefill` (static: a different trace) says the batch
    is one sequence's prefill chunk laid out as one token per row: rows 0 .. n-1 are its tokens in order
    (row 0 at the chunk's start, every row holding the sequence's block table), the rest padding; the
    absorbed attention then takes the naive-form path (model/long_prefill.py).
    """

    block_table: jax.Array
    chunk_lens: jax.Array
    long_prefill: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def token_valid(self, t: int) -> jax.Array:
        """[B, t] bool: which of a [B, t] chunk's tokens are real."""
        return jnp.arange(t)[None, :] < self.chunk_lens[:, None]


def allocate(cfg: ModelConfig, num_pages: int, page_size: int = PAGE_SIZE, form: str = "absorbed",
             dtype=None, mtp: bool = False) -> dict:
    """A zeroed page pool of `num_pages` pages (page 0 included) for every layer: `layout.cache_layout`."""
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
    declared = layout.cache_layout(cfg, num_pages, page_size, form, dtype, mtp)
    return jax.tree.map(lambda i: jnp.zeros(i.shape, i.dtype), declared, is_leaf=layout.is_info)


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


def contiguous_table(batch: int, max_len: int, page_size: int = PAGE_SIZE) -> np.ndarray:
    """Block tables giving sequence b the pages 1 + b*n ... (b+1)*n (n = pages for max_len)."""
    n = pages_for(max_len, page_size)
    return (1 + np.arange(batch)[:, None] * n + np.arange(n)[None, :]).astype(np.int32)


def allocate_contiguous(cfg: ModelConfig, batch: int, max_len: int, form: str = "absorbed", dtype=None,
                        mtp: bool = False, page_size: int = PAGE_SIZE) -> tuple[dict, np.ndarray]:
    """A pool sized for `batch` sequences of up to `max_len` tokens, and their block tables."""
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
    table = contiguous_table(batch, max_len, page_size)
    return allocate(cfg, 1 + table.size, page_size, form, dtype, mtp), table


# ----------------------------------------------------------------------------- page reads and writes
def absorbed_leaves(pool: dict) -> tuple[str, ...]:
    """The absorbed cache leaves a pool subtree holds: (`layout.PAGES`,) or `layout.FP8_LEAVES`."""
    return layout.FP8_LEAVES if layout.FP8_LATENT in pool else (layout.PAGES,)


def latent_rows(latent: jax.Array, k_rope: jax.Array, pool: dict) -> dict[str, jax.Array]:
    """New tokens' cache entries, [B, T, ...] per absorbed leaf of `pool` (token-major, as `write_pages`
    takes them): [c ; k_rope] values under `PAGES` (cast to the pool's dtype on write), or for an FP8 pool
    each token quantized (pallas_kernels.mla_common.quantize_kv: latent e4m3, its fp32 scales per 128
    values [B, T, nb], rope bf16)."""
    if absorbed_leaves(pool) == layout.FP8_LEAVES:
        from pallas_kernels.mla_common import quantize_kv

        q = quantize_kv(latent, k_rope)  # the chunk's T tokens as the "page" axis: scale [B, nb, T]
        return {layout.FP8_LATENT: q.latent, layout.FP8_SCALE: jnp.swapaxes(q.scale, -1, -2),
                layout.FP8_ROPE: q.rope}
    return {layout.PAGES: jnp.concatenate([latent, k_rope], axis=-1)}


def absorbed_pages(pool: dict) -> jax.Array:
    """What `kernel_dispatch.mla_attention` reads from a pool subtree (flat leaves, `layer_view`): the
    `PAGES` array, or the FP8 leaves as one `mla_common.Fp8Pages`."""
    if absorbed_leaves(pool) == layout.FP8_LEAVES:
        from pallas_kernels.mla_common import Fp8Pages

        return Fp8Pages(*(pool[n] for n in layout.FP8_LEAVES))
    return pool[layout.PAGES]


def write_pages(pages: jax.Array, new: jax.Array, meta: PageMeta, start: jax.Array,
                layer: jax.Array | None = None, slot_last: bool = False) -> jax.Array:
    """Scatter new [B, T, ...] into pages [P, page_size, ...] at positions start + t (t < chunk_lens); with
    `layer`, into layer `layer` of a stacked leaf [L, P, page_size, ...] (returned stacked). `slot_last`:
    the leaf is [P, n, page_size] (the FP8 scales, block-major per page) and new is [B, T, n].

    Padding tokens (t >= chunk_lens[b]) go to page 0, the pool's never-allocated scratch page.
    Why the stacked form writes the stack itself rather than `layer_view`'s flat view: a write through a
    reshape is in place only inside a scan's loop; a one-layer stack (no loop left after XLA's
    simplification) copied its whole pool every step.
    """
    b, t = new.shape[:2]
    ps = pages.shape[-1] if slot_last else pages.shape[1 if layer is None else 2]
    pos = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    logical = jnp.minimum(pos // ps, meta.block_table.shape[1] - 1)
    page = jnp.take_along_axis(meta.block_table, logical, axis=1)
    page = jnp.where(meta.token_valid(t), page, 0)
    lead = () if layer is None else (layer,)
    # [page, :, slot] with [B, T] index arrays: numpy puts the broadcast [B, T] first, [B, T, n] = new.
    idx = (*lead, page, slice(None), pos % ps) if slot_last else (*lead, page, pos % ps)
    return pages.at[idx].set(new.astype(pages.dtype))


def write_leaves(pool: dict, new: dict, meta: PageMeta, start: jax.Array,
                 layer: jax.Array | None = None) -> dict:
    """`write_pages` for each leaf of `new` (from `latent_rows`) into `pool`'s leaf of that name."""
    return {n: write_pages(pool[n], x, meta, start, layer, slot_last=n == layout.FP8_SCALE)
            for n, x in new.items()}


def layer_view(pages: jax.Array, meta: PageMeta, layer: jax.Array | None) -> tuple[jax.Array, PageMeta]:
    """Layer `layer`'s pages of a stacked leaf [L, P, ...] as one pool [L * P, ...] (a free reshape) and
    `meta` with its block table moved to that layer's page ids (layer * P + page); (pages, meta) as they
    are when `layer` is None (an unstacked leaf, the MTP layer's).

    Why: slicing `pages[layer]` out of the scanned stack, and stacking the written slices back, copies
    the whole pool every layer of every step (measured on CPU: a 1-token step 6 ms over 64 pages, 124 ms
    over 4,096); reads and writes through the flat view touch only the pages the batch uses, and the
    stack is updated in place (written through `write_pages(..., layer)`, read through this view). Page 0
    (and each layer's page `layer * P`) stays scratch."""
    if layer is None:
        return pages, meta
    flat = pages.reshape(-1, *pages.shape[2:])
    return flat, dataclasses.replace(meta, block_table=meta.block_table + layer * pages.shape[1])


def read_values(pages, ids: jax.Array, dtype) -> jax.Array:
    """Absorbed pages `ids` [n] of a pool (`absorbed_pages`: one array or FP8 pages, dequantized) as one run
    of token values [n * page_size, latent + rope] in `dtype`."""
    from pallas_kernels.mla_common import Fp8Pages, dequantize_kv, is_fp8_cache

    if is_fp8_cache(pages):
        vals = dequantize_kv(Fp8Pages(*(x[ids] for x in pages)), dtype=dtype)
    else:
        vals = pages[ids].astype(dtype)
    return vals.reshape(-1, vals.shape[-1])


def gather_pages(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """[P, ps, ...] pages -> [B, max_pages * ps, ...] per-sequence contiguous view."""
    g = pages[block_table]
    return g.reshape(g.shape[0], -1, *pages.shape[2:])


def clear_pages(cache: dict, pages: jax.Array) -> dict:
    """Zero physical `pages` [n] (int32; 0 entries touch only the scratch page) in every leaf."""
    def clear(path, x):
        stacked = getattr(path[0], "key", None) in layout.STACKS
        return x.at[:, pages].set(0) if stacked else x.at[pages].set(0)

    return jax.tree_util.tree_map_with_path(clear, cache)
