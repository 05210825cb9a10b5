"""The DeepSeek-V3 decoder: embeddings, dense and MoE blocks applied with `nn.scan`, head, MTP module.

Owns: the block structure (pre-norm MLA + MLP/MoE with residuals), the two scanned stacks (the first
`first_k_dense_replace` dense layers, then the homogeneous MoE layers: compile time does not grow with
58 layers), the final norm and LM head, and the MTP module (layer `num_hidden_layers` in HF numbering).
Every setting the trace depends on beyond config, dtypes, `fp8` and the attention `form` is the
`trace_options` attribute (trace_options.py: kernel backend, MoE dispatch and capacity), handed to every
block, attention, MoE and linear; so the module itself (hashable, compared by value) determines its trace.
Must not own cache allocation (cache.py), weight loading (checkpoint.py) or sharding (sharding.py).

Parameter tree (Linen names; layers stacked on axis 0):
  embed_tokens/embedding [V, D], norm/weight [D], lm_head/weight [V, D]
  dense_layers/{input_layernorm, post_attention_layernorm, self_attn/*, mlp/{gate,up,down}_proj}
  moe_layers/{input_layernorm, post_attention_layernorm, self_attn/*, mlp/{gate_weight,
      e_score_correction_bias, {gate,up,down}_proj_weight [L, E, out, in], shared_experts/*}}
  mtp/{embed_tokens, enorm, hnorm, eh_proj, block/*, shared_head_norm, shared_head_head}
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import layout
from dsv3_jax.model.attention import MLA
from dsv3_jax.model.kv_cache import PageMeta
from dsv3_jax.model.layers import MLP, Linear, RMSNorm
from dsv3_jax.model.moe import MoE
from dsv3_jax.model.trace_options import TraceOptions


def _at(x: jax.Array, select: jax.Array | None) -> jax.Array:
    """x [B, T, D], or the tokens at flat indices `select` of its [B*T] ([*select.shape, D])."""
    return x if select is None else x.reshape(-1, x.shape[-1])[select]


class Block(nn.Module):
    """x + MLA(norm(x)), then + MLP-or-MoE(norm(x)).

    Carry in, carry out: (x, cache, layer) -> ((x, cache, layer + 1), None), the form nn.scan runs. In
    a scanned stack `cache` is the whole stack's cache (leaves [L, P, ...]) and `layer` this layer's
    index: it travels in the carry and is written in place, never sliced out and stacked back (that
    copied the whole pool every step; see `cache.layer_view`). Called alone (the MTP block), `layer` is
    None and `cache` that block's own."""

    cfg: ModelConfig
    is_moe: bool
    param_dtype: jnp.dtype = jnp.float32
    fp8: bool = False
    form: str = "absorbed"
    trace_options: TraceOptions = dataclasses.field(default_factory=TraceOptions.from_environment)

    @nn.compact
    def __call__(self, carry: tuple, positions: jax.Array, meta: PageMeta | None):
        x, cache, layer = carry
        c, opts = self.cfg, self.trace_options
        h, cache = MLA(c, self.param_dtype, self.fp8, opts, name="self_attn")(
            RMSNorm(c.hidden_size, c.rms_norm_eps, self.param_dtype, name="input_layernorm")(x),
            positions, cache, meta, self.form, layer)
        x = x + h
        hn = RMSNorm(c.hidden_size, c.rms_norm_eps, self.param_dtype, name="post_attention_layernorm")(x)
        if self.is_moe:
            valid = None if meta is None else meta.token_valid(x.shape[1])
            x = x + MoE(c, self.param_dtype, self.fp8, opts, name="mlp")(hn, valid)
        else:
            x = x + MLP(c.hidden_size, c.intermediate_size, self.param_dtype, self.fp8, opts, name="mlp")(hn)
        return (x, cache, None if layer is None else layer + 1), None


def _stack(cfg: ModelConfig, is_moe: bool, length: int, param_dtype, fp8: bool, form: str,
           trace_options: TraceOptions, name: str):
    scanned = nn.scan(Block, variable_axes={"params": 0, "intermediates": 0},
                      split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast), length=length)
    return scanned(cfg, is_moe, param_dtype, fp8, form, trace_options, name=name)


class MTP(nn.Module):
    """h'_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) -> one MoE block -> own norm and head.

    h_i is the main model's last hidden state *after* its final norm (what vLLM and SGLang feed the
    draft); the result predicts token i+2.
    """

    cfg: ModelConfig
    param_dtype: jnp.dtype = jnp.float32
    fp8: bool = False
    form: str = "absorbed"
    trace_options: TraceOptions = dataclasses.field(default_factory=TraceOptions.from_environment)

    @nn.compact
    def __call__(self, hidden: jax.Array, next_tokens: jax.Array, positions: jax.Array,
                 cache: dict | None = None, meta: PageMeta | None = None, select: jax.Array | None = None):
        c = self.cfg
        d = c.hidden_size
        emb = nn.Embed(c.vocab_size, d, param_dtype=self.param_dtype, name="embed_tokens")(next_tokens)
        e = RMSNorm(d, c.rms_norm_eps, self.param_dtype, name="enorm")(emb.astype(hidden.dtype))
        h = RMSNorm(d, c.rms_norm_eps, self.param_dtype, name="hnorm")(hidden)
        opts = self.trace_options
        x = Linear(2 * d, d, self.param_dtype, self.fp8, opts, name="eh_proj")(jnp.concatenate([e, h], -1))
        (x, cache, _), _ = Block(c, True, self.param_dtype, self.fp8, self.form, opts, name="block")(
            (x, cache, None), positions, meta)
        x = RMSNorm(d, c.rms_norm_eps, self.param_dtype, name="shared_head_norm")(x)
        head = Linear(d, c.vocab_size, self.param_dtype, False, opts, name="shared_head_head")
        logits = head(_at(x, select))
        return logits.astype(jnp.float32), x, cache


class Transformer(nn.Module):
    """The model. `trace_options` defaults to `TraceOptions.from_environment()` (kernels as DSV3_KERNELS or
    "auto" pick them on this machine), resolved when the module is built; pass one to choose."""

    cfg: ModelConfig
    param_dtype: jnp.dtype = jnp.float32
    fp8: bool = False
    form: str = "absorbed"
    trace_options: TraceOptions = dataclasses.field(default_factory=TraceOptions.from_environment)

    def setup(self) -> None:
        c, opts = self.cfg, self.trace_options
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, param_dtype=self.param_dtype)
        if c.n_dense_layers:
            self.dense_layers = _stack(c, False, c.n_dense_layers, self.param_dtype, self.fp8, self.form,
                                       opts, layout.DENSE_LAYERS)
        if c.n_moe_layers:
            self.moe_layers = _stack(c, True, c.n_moe_layers, self.param_dtype, self.fp8, self.form,
                                     opts, layout.MOE_LAYERS)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.param_dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, self.param_dtype, False, opts)
        if c.num_nextn_predict_layers:
            self.mtp = MTP(c, self.param_dtype, self.fp8, self.form, opts)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, cache: dict | None = None,
                 meta: PageMeta | None = None, select: jax.Array | None = None):
        """tokens [B, T] at positions [B, T] (default 0..T-1) -> (logits fp32 [B, T, V], hidden, cache).

        `hidden` is the final-normed hidden state (the MTP module's input). With a paged cache and its
        `meta`, the new tokens' latents (absorbed) or K/V (naive) are written at positions[:, 0] onwards
        (a ragged token batch is [N, 1]: one token per row, each with its own position and page row).
        `select` (int32, any shape) picks flat token indices of [B*T]: the LM head then runs on those
        tokens only and logits are [*select.shape, V] (the engine needs a few positions per sequence).
        """
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        dtype = jnp.dtype(self.cfg.dtype)
        x = self.embed_tokens(tokens).astype(dtype)
        new_cache = {}
        for name in layout.STACKS:
            if not hasattr(self, name):
                continue
            stack = None if cache is None else cache[name]
            (x, stack, _), _ = getattr(self, name)((x, stack, jnp.zeros((), jnp.int32)), positions, meta)
            new_cache[name] = stack
        hidden = self.norm(x)
        logits = self.lm_head(_at(hidden, select)).astype(jnp.float32)
        if cache is not None and layout.MTP in cache:
            new_cache[layout.MTP] = cache[layout.MTP]
        return logits, hidden, (new_cache if cache is not None else None)

    def mtp_logits(self, hidden: jax.Array, next_tokens: jax.Array, positions: jax.Array,
                   cache: dict | None = None, meta: PageMeta | None = None, select: jax.Array | None = None):
        """The MTP draft: logits for token i+2 from hidden_i and token i+1, plus its hidden and cache
        (`select` as in `__call__`)."""
        mtp_cache = None if cache is None else cache[layout.MTP]
        logits, h, mtp_cache = self.mtp(hidden, next_tokens, positions, mtp_cache, meta, select)
        if cache is not None:
            cache = {**cache, layout.MTP: mtp_cache}
        return logits, h, cache

    def init_all(self, tokens: jax.Array):
        """Touch every parameter (main model and MTP) so `init` creates the whole tree."""
        logits, hidden, _ = self(tokens)
        if self.cfg.num_nextn_predict_layers:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            self.mtp_logits(hidden, tokens, positions)
        return logits
