"""KV caches: allocation and layout of the per-layer caches the attention reads and writes.

Owns: the cache pytree for both attention forms — absorbed: latent [L, B, S, kv_lora_rank + rope]
(576 values per token per layer for V3); naive: k [L, B, S, H, 192] and v [L, B, S, H, 128] — split
into the scanned stacks (dense_layers, moe_layers) and the MTP layer. Contiguous per-sequence slots;
the engine's paged pool keeps the same per-token layout. Must not know the model's math.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv3_jax.config import ModelConfig


def _layer_cache(cfg: ModelConfig, layers: tuple[int, ...], batch: int, max_len: int, form: str, dtype):
    if form == "absorbed":
        return {"latent": jnp.zeros((*layers, batch, max_len, cfg.latent_dim), dtype)}
    if form == "naive":
        h = cfg.num_attention_heads
        return {"k": jnp.zeros((*layers, batch, max_len, h, cfg.qk_head_dim), dtype),
                "v": jnp.zeros((*layers, batch, max_len, h, cfg.v_head_dim), dtype)}
    raise ValueError(f"cache form must be 'absorbed' or 'naive', got {form!r}")


def allocate(cfg: ModelConfig, batch: int, max_len: int, form: str = "absorbed", dtype=None,
             mtp: bool = False) -> dict:
    """A zeroed cache for `batch` sequences of up to `max_len` tokens."""
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
    dtype = jnp.dtype(dtype or cfg.dtype)
    cache = {}
    if cfg.n_dense_layers:
        cache["dense_layers"] = _layer_cache(cfg, (cfg.n_dense_layers,), batch, max_len, form, dtype)
    if cfg.n_moe_layers:
        cache["moe_layers"] = _layer_cache(cfg, (cfg.n_moe_layers,), batch, max_len, form, dtype)
    if mtp and cfg.num_nextn_predict_layers:
        cache["mtp"] = _layer_cache(cfg, (), batch, max_len, form, dtype)
    return cache
