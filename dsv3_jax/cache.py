"""Paged KV caches: the page arrays every attention layer reads and writes, and their metadata.

Owns the cache layout. Absorbed form: `pages [L, P, page_size, kv_lora_rank + rope]` (576 values per
token per layer for V3); naive form: `k_pages [L, P, page_size, H, 192]`, `v_pages [L, P, page_size, H,
128]`. One pytree per scanned stack (dense_layers, moe_layers) plus the MTP layer. A sequence's
logical page i (positions i*page_size ...) lives in physical page `block_table[b, i]`; physical page 0
is scratch that is never handed out (padding tokens are written there). `contiguous_table` gives each
sequence its own fixed run of pages (what plain generation uses); the engine allocates pages on demand.
Must not know the model's math or scheduling policy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.config import ModelConfig

PAGE_SIZE = 64  # the MLA kernel's page; one TMA load of 64 x 576 bf16


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PageMeta:
    """Per-call page metadata: block_table [B, max_pages] int32, chunk_lens [B] int32 (valid new tokens)."""

    block_table: jax.Array
    chunk_lens: jax.Array


def _layer_pages(cfg: ModelConfig, layers: tuple[int, ...], num_pages: int, page_size: int, form: str,
                 dtype) -> dict:
    if form == "absorbed":
        return {"pages": jnp.zeros((*layers, num_pages, page_size, cfg.latent_dim), dtype)}
    if form == "naive":
        h = cfg.num_attention_heads
        return {"k_pages": jnp.zeros((*layers, num_pages, page_size, h, cfg.qk_head_dim), dtype),
                "v_pages": jnp.zeros((*layers, num_pages, page_size, h, cfg.v_head_dim), dtype)}
    raise ValueError(f"cache form must be 'absorbed' or 'naive', got {form!r}")


def allocate(cfg: ModelConfig, num_pages: int, page_size: int = PAGE_SIZE, form: str = "absorbed",
             dtype=None, mtp: bool = False) -> dict:
    """A zeroed page pool of `num_pages` pages (page 0 included) for every layer."""
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
    dtype = jnp.dtype(dtype or cfg.dtype)
    cache = {}
    if cfg.n_dense_layers:
        cache["dense_layers"] = _layer_pages(cfg, (cfg.n_dense_layers,), num_pages, page_size, form, dtype)
    if cfg.n_moe_layers:
        cache["moe_layers"] = _layer_pages(cfg, (cfg.n_moe_layers,), num_pages, page_size, form, dtype)
    if mtp and cfg.num_nextn_predict_layers:
        cache["mtp"] = _layer_pages(cfg, (), num_pages, page_size, form, dtype)
    return cache


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
