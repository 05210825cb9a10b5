"""Multi-head Latent Attention (MLA) in its two forms.

Owns: the q/kv projections, YaRN rope on the 64 rope dims, and attention itself in
- *naive* form: kv_b expands the latent to per-head K [.., H, 192] and V [.., H, 128]; the cache keeps them;
- *absorbed* form: the cache keeps only [c ; k_rope] (576 values per token for V3); W_uk (kv_b's K half)
  is folded into q, and W_uv (its V half) is applied after attention.
Both forms give the same numbers; names follow the paper / official reference (wkv_a, kv_norm, q_pe).
kv_b is read in either parameter form: the checkpoint's `kv_b_proj` (split and dequantized in every
call) or the inference form every ModelHandle holds (kv_b.py: W_uk / W_uv split and dequantized once);
q_a and kv_a as two linears or fused into one (qkv_a.py, also done at load).
One sequence's prefill chunk alone in a step (`PageMeta.long_prefill`) reads the absorbed pool in naive
form instead (long_prefill.py: the prefix's latents expanded to per-head K/V, flash attention): at a long
prefix the faster algorithm.
With a cache, both forms read and write *pages* through cache.py's helpers (its layout; page 0 is
scratch; an FP8 pool, absorbed form only, gets its rows quantized by `kv_cache.latent_rows` on write
and dequantized by whichever attention reads it); a batch may be ragged (row b holds chunk_lens[b] real
tokens, or one token per row); absorbed attention over pages goes through `kernels.mla_attention` (the
Pallas MLA kernel when the module's `trace_options.kernels` is "pallas"; every linear gets the same
options).
Must not own cache allocation or page bookkeeping (cache.py, engine) or know about other layers.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kernel_dispatch as kernels
from dsv3_jax.model import kv_b, layout, long_prefill, qkv_a
from dsv3_jax.model.kv_cache import (
    PageMeta,
    absorbed_leaves,
    absorbed_pages,
    gather_pages,
    latent_rows,
    layer_view,
    read_values,
    write_leaves,
    write_pages,
)
from dsv3_jax.model.layers import Linear, RMSNorm
from dsv3_jax.model.rope import apply_rope, rope_angles
from dsv3_jax.model.trace_options import TraceOptions
from dsv3_jax.parallel import dp_attention
from pallas_kernels.mla_common import cache_widths

ATTENTION_FORMS = ("absorbed", "naive")


def _causal_softmax(scores: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """scores [B, H, T, S] fp32; a key is visible iff its position <= the query's position."""
    visible = k_pos[:, None, None, :] <= q_pos[:, None, :, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


class MLA(nn.Module):
    cfg: ModelConfig
    param_dtype: jnp.dtype = jnp.float32
    fp8: bool = False
    trace_options: TraceOptions = dataclasses.field(default_factory=TraceOptions.from_environment)

    def setup(self) -> None:
        c = self.cfg
        kw = dict(param_dtype=self.param_dtype, fp8=self.fp8, trace_options=self.trace_options)
        h = c.num_attention_heads
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, h * c.qk_head_dim, **kw)
        else:
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, self.param_dtype)
            self.q_b_proj = Linear(c.q_lora_rank, h * c.qk_head_dim, **kw)
        if self.has_variable("params", qkv_a.QKV_A):  # q_a and kv_a fused at load (qkv_a.fuse)
            # its rows as stored: a float tree fused unpadded and then quantized keeps its width
            rows = self.get_variable("params", qkv_a.QKV_A)["weight"].shape[-2]
            self.qkv_a_proj = Linear(c.hidden_size, rows, **kw)
        else:
            if c.q_lora_rank is not None:
                self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, **kw)
            self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.latent_dim, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, self.param_dtype)
        if self.has_variable("params", kv_b.W_UK):
            # kv_b's inference form (kv_b.split: dequantized once, laid out for the products)
            zeros, r = nn.initializers.zeros, c.kv_lora_rank
            self.w_uk = self.param(kv_b.W_UK, zeros, (h, r, c.qk_nope_head_dim), self.param_dtype)
            self.w_uv = self.param(kv_b.W_UV, zeros, (h, c.v_head_dim, r), self.param_dtype)
        else:
            self.kv_b_proj = Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), **kw)
        self.o_proj = Linear(h * c.v_head_dim, c.hidden_size, **kw)

    def project_q_kv(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q [.., H * qk_head_dim] before rope, kv_a's output [.., latent_dim] before its norm) from the
        block input x, through the fused q_a / kv_a linear when the tree holds it."""
        c = self.cfg
        if self.has_variable("params", qkv_a.QKV_A):
            q_a, kv = qkv_a.split_output(self.qkv_a_proj(x), c)
        else:
            q_a = None if c.q_lora_rank is None else self.q_a_proj(x)
            kv = self.kv_a_proj_with_mqa(x)
        q = self.q_proj(x) if q_a is None else self.q_b_proj(self.q_a_layernorm(q_a))
        return q, kv

    def absorb_weights(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(W_uk [H, R, dn], W_uv [H, dv, R]) in `dtype`: the inference form's leaves as they lie, or the
        checkpoint form's kv_b_proj split (and dequantized) here, at every call."""
        if self.has_variable("params", kv_b.W_UK):
            return kv_b.pinned(self.w_uk.astype(dtype)), kv_b.pinned(self.w_uv.astype(dtype))
        return kv_b.halves(self.kv_b_proj.matrix(dtype), self.cfg)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: dict | None = None,
                 meta: PageMeta | None = None, form: str = "absorbed",
                 layer: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
        """x [B, T, D] at positions [B, T] (row b at start_b + t).

        Without a cache, attention runs over x itself (a full causal forward). With a paged cache
        (`meta` gives block tables and valid chunk lengths), the new latents (absorbed) or K/V (naive)
        are written into the pages first, then the chunk attends to the sequence's whole prefix. With
        `layer` (int32 scalar), the cache leaves are a scanned stack [L, P, ...] and this is its layer
        `layer` (read and written in place through `cache.layer_view`).
        """
        if form not in ATTENTION_FORMS:
            raise ValueError(f"attention form must be one of {ATTENTION_FORMS}, got {form!r}")
        c = self.cfg
        b, t, _ = x.shape
        h, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim

        q, kv = self.project_q_kv(x)
        q = q.reshape(b, t, h, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        latent, k_pe = self.kv_a_layernorm(kv[..., : c.kv_lora_rank]), kv[..., c.kv_lora_rank:]
        cos, sin = rope_angles(c, positions)
        q_pe = apply_rope(q_pe, cos, sin, c.rope_interleave)
        k_pe = apply_rope(k_pe, cos, sin, c.rope_interleave)

        w_uk, w_uv = self.absorb_weights(x.dtype)
        start = positions[:, 0]
        scale = c.softmax_scale
        backend = self.trace_options.kernels
        # A scanned stack's leaves are [L, P, ...] (pages on axis 1) and the layer index travels along.
        pool = "pages" if layer is None else "layer_pages"
        lay, lay_layout = ((), ()) if layer is None else ((layer,), ("replicated",))

        if form == "absorbed" and cache is not None and meta.long_prefill:
            out, cache = self._long_prefill(cache, meta, start, latent, k_pe, q_nope, q_pe, w_uk, w_uv, layer)
        elif form == "absorbed":
            q_lat = jnp.einsum("bthd,hrd->bthr", q_nope, w_uk)
            if cache is not None:
                # The pool's leaves: `pages` ([B, T, 576] values new), or the FP8 cache's latent e4m3 /
                # scales / rope (the new tokens quantized here, on write).
                names = absorbed_leaves(cache)
                new_rows = latent_rows(latent, k_pe, cache)
                n = len(names)

                def paged(*args):
                    pools, new, (meta, start, q_lat, q_pe, *layer) = args[:n], args[n:2 * n], args[2 * n:]
                    lay = layer[0] if layer else None
                    # The reads below see the written pool, not the old pool plus the new rows: otherwise
                    # XLA may fuse the write into the read and keep the old pool alive (a full copy).
                    pools = jax.lax.optimization_barrier(tuple(write_leaves(
                        dict(zip(names, pools)), dict(zip(names, new)), meta, start, lay).values()))
                    flat = {}
                    for name, p in zip(names, pools):
                        flat[name], lmeta = layer_view(p, meta, lay)
                    o, _ = kernels.mla_attention(q_lat, q_pe, absorbed_pages(flat), lmeta.block_table, start,
                                                 lmeta.chunk_lens, softmax_scale=scale, backend=backend)
                    return (o, *pools)

                # Per batch shard on its own pages (DP attention); as is on one shard.
                o_lat, *pools = dp_attention.shard_local(
                    paged, (*(cache[k] for k in names), *(new_rows[k] for k in names), meta, start, q_lat,
                            q_pe.astype(q_lat.dtype), *lay),
                    (*(pool,) * n, *("rows",) * n, "meta", "rows", "heads", "heads", *lay_layout),
                    ("heads", *(pool,) * n))
                cache = dict(zip(names, pools))
            else:
                c_kv, k_rope = latent, k_pe
                scores = (jnp.einsum("bthr,bsr->bhts", q_lat, c_kv, preferred_element_type=jnp.float32)
                          + jnp.einsum("bthe,bse->bhts", q_pe, k_rope, preferred_element_type=jnp.float32))
                p = _causal_softmax(scores * scale, positions, positions)
                o_lat = jnp.einsum("bhts,bsr->bthr", p.astype(x.dtype), c_kv)
            out = jnp.einsum("bthr,hvr->bthv", o_lat.astype(x.dtype), w_uv)
        else:
            k_nope = jnp.einsum("btr,hrd->bthd", latent, w_uk)
            v = jnp.einsum("btr,hvr->bthv", latent, w_uv)
            k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], (b, t, h, dr))], axis=-1)
            if cache is not None:
                if layout.FP8_LATENT in cache:
                    raise ValueError("the FP8 KV cache needs attention='absorbed' (the naive form caches "
                                     "per-head K/V)")
                def paged(kp, vp, k, v, meta, start, *layer):
                    lay = layer[0] if layer else None
                    kp, vp = jax.lax.optimization_barrier((write_pages(kp, k, meta, start, lay),
                                                           write_pages(vp, v, meta, start, lay)))
                    fk, lmeta = layer_view(kp, meta, lay)
                    fv, _ = layer_view(vp, meta, lay)
                    return gather_pages(fk, lmeta.block_table), gather_pages(fv, lmeta.block_table), kp, vp

                k, v, kp, vp = dp_attention.shard_local(
                    paged, (cache["k_pages"], cache["v_pages"], k, v, meta, start, *lay),
                    (pool, pool, "heads", "heads", "meta", "rows", *lay_layout),
                    ("heads", "heads", pool, pool))
                cache = {"k_pages": kp, "v_pages": vp}
                k, v = k.astype(x.dtype), v.astype(x.dtype)
                k_pos = jnp.broadcast_to(jnp.arange(k.shape[1]), (b, k.shape[1]))
            else:
                k_pos = positions
            qf = jnp.concatenate([q_nope, q_pe], axis=-1)
            scores = jnp.einsum("bthd,bshd->bhts", qf, k, preferred_element_type=jnp.float32)
            p = _causal_softmax(scores * scale, positions, k_pos)
            out = jnp.einsum("bhts,bshv->bthv", p.astype(x.dtype), v)
        return self.o_proj(out.reshape(b, t, h * dv)), cache

    def _long_prefill(self, cache: dict, meta: PageMeta, start: jax.Array, latent: jax.Array, k_pe: jax.Array,
                      q_nope: jax.Array, q_pe: jax.Array, w_uk: jax.Array, w_uv: jax.Array,
                      layer: jax.Array | None) -> tuple[jax.Array, dict]:
        """The absorbed pool, one sequence's chunk as one token per row (`PageMeta.long_prefill`): the new
        rows are written as on the absorbed path, then attention runs in naive form over the pool
        (long_prefill.py). Returns (out [N, 1, H, dv] after W_uv, the written pool)."""
        if dp_attention.batch_shards() > 1:
            raise ValueError("the long-prefill path runs on one batch shard (the engine routes DP attention "
                             "to the absorbed path)")
        if meta.block_table.shape[0] != q_nope.shape[0] or q_nope.shape[1] != 1:
            raise ValueError(f"the long-prefill path takes one token per row, got q {q_nope.shape}")
        names = absorbed_leaves(cache)
        new_rows = latent_rows(latent, k_pe, cache)
        # Written before read, behind a barrier: as on the absorbed path (the reads see the written pool).
        pools = jax.lax.optimization_barrier(tuple(write_leaves(
            {k: cache[k] for k in names}, new_rows, meta, start, layer).values()))
        flat = {}
        for name, p in zip(names, pools):
            flat[name], lmeta = layer_view(p, meta, layer)
        pages = absorbed_pages(flat)
        page_size = cache_widths(pages)[1]
        out = long_prefill.chunk_attention(
            q_nope[:, 0], q_pe[:, 0], lambda ids: read_values(pages, ids, q_nope.dtype), lmeta.block_table[0],
            start[0], jnp.sum(meta.chunk_lens), w_uk, w_uv, page_size=page_size,
            softmax_scale=self.cfg.softmax_scale, backend=self.trace_options.kernels)
        return out[:, None], dict(zip(names, pools))
