"""Research hooks: what the model does inside for one prompt, read from a loaded `ModelHandle`.

Owns three read-only views, each a function of a handle and a prompt (no library edits needed):
- `router_stats`: the experts every MoE layer picked for every token (the `router_choice` values that
  moe.py sows) and the per-layer expert-load histogram;
- `attention_entropy`: the entropy of every head's attention distribution in every layer. The block
  inputs are captured with Flax's `capture_intermediates` (the `input_layernorm` outputs), then the MLA
  scores are recomputed from the layer's own weights (naive form: full per-head K, which gives the same
  probabilities as the absorbed form). As a self-check the recomputed attention output is compared with
  the model's own `self_attn` output (`AttentionEntropy.recompute_error`);
- `cache_pages`: the paged latent cache (layout.cache_layout) of a sequence after its prefill, restricted to
  the sequence's own pages.
Must not change model math, sampling or sharding; plotting is optional (matplotlib imported lazily).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.model import kv_cache, layout
from dsv3_jax.model.attention import MLA, _causal_softmax
from dsv3_jax.model.kv_cache import PageMeta
from dsv3_jax.model.rope import apply_rope, rope_angles
from dsv3_jax.parallel import sharding


# ------------------------------------------------------------------------------------------ helpers
def _prompt_ids(handle: Any, prompt: str | Sequence[int]) -> list[int]:
    """One prompt (text or token ids) -> validated token ids."""
    if isinstance(prompt, str):
        if handle.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: pass the prompt as a list of token ids")
        ids = handle.tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    cfg = handle.config
    if not ids:
        raise ValueError("prompt is empty")
    if min(ids) < 0 or max(ids) >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
    if len(ids) > cfg.max_position_embeddings:
        raise ValueError(f"prompt of {len(ids)} tokens exceeds the context ({cfg.max_position_embeddings})")
    return ids


def _batch(handle: Any, ids: list[int]) -> np.ndarray:
    """[B, T] tokens: the prompt, repeated so a mesh's batch shards each get a whole row."""
    rows = 1 if handle.mesh is None else sharding.batch_multiple(handle.mesh)
    return np.tile(np.asarray(ids, np.int32)[None], (rows, 1))


def _pieces(handle: Any, ids: list[int]) -> list[str] | None:
    if handle.tokenizer is None:
        return None
    return [handle.tokenizer.decode([t]) for t in ids]


def _layer_ids(handle: Any, stack: str) -> list[int]:
    """HF layer indices of a scanned stack (dense layers come first)."""
    c = handle.config
    return list(range(c.n_dense_layers)) if stack == layout.DENSE_LAYERS else \
        list(range(c.n_dense_layers, c.num_hidden_layers))


def _stacks(handle: Any) -> list[str]:
    return [s for s in layout.STACKS if s in handle.params]


def _run(handle: Any, fn, *args):
    """Call a jitted `fn(params, *args)` inside the handle's mesh (the MoE reads it at trace time)."""
    with handle.mesh_context():
        return fn(handle.params, *args)


def _heatmap(data: np.ndarray, *, ax: Any, xlabel: str, ylabel: str, title: str, yticks: list[int],
             cbar: str):
    import matplotlib.pyplot as plt

    if ax is None:
        size = (max(4.0, 0.25 * data.shape[1] + 2), max(2.5, 0.35 * data.shape[0] + 1))
        fig, ax = plt.subplots(figsize=size)
    else:
        fig = ax.figure
    im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_yticks(range(len(yticks)), [str(y) for y in yticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=cbar)
    return fig


# ------------------------------------------------------------------------------------ router stats
@dataclasses.dataclass
class RouterStats:
    """Routing of one prompt: `choices[l, t]` are the experts MoE layer `layers[l]` chose for token t."""

    token_ids: list[int]
    tokens: list[str] | None  # each token decoded on its own (None without a tokenizer)
    layers: list[int]  # HF layer indices of the MoE layers
    choices: np.ndarray  # [n_moe_layers, T, num_experts_per_tok] int expert ids
    n_experts: int

    @property
    def load(self) -> np.ndarray:
        """[n_moe_layers, n_experts]: how many of the prompt's tokens each expert received."""
        return np.stack([np.bincount(c.ravel(), minlength=self.n_experts) for c in self.choices])

    @property
    def imbalance(self) -> np.ndarray:
        """Per layer: the busiest expert's load over the mean load (1.0 is perfectly balanced)."""
        load = self.load
        return load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-9)

    def table(self) -> list[dict[str, Any]]:
        """One row per MoE layer: layer, tokens, experts used, busiest expert and its load, imbalance."""
        load, imb = self.load, self.imbalance
        return [{"layer": layer, "tokens": len(self.token_ids), "experts_used": int((load[i] > 0).sum()),
                 "busiest_expert": int(load[i].argmax()), "busiest_load": int(load[i].max()),
                 "imbalance": round(float(imb[i]), 3)} for i, layer in enumerate(self.layers)]

    def plot(self, ax: Any = None):
        """Heat map of the expert-load histogram (MoE layers x experts); returns the Figure."""
        return _heatmap(self.load, ax=ax, xlabel="expert", ylabel="layer", yticks=self.layers,
                        title=f"expert load ({len(self.token_ids)} tokens)", cbar="tokens routed")


@functools.cache
def _router_fn(model: nn.Module):
    def f(params, toks):
        _, state = model.apply({"params": params}, toks, mutable=["intermediates"])
        return state["intermediates"][layout.MOE_LAYERS]["mlp"]["router_choice"][0]  # [L, B, T, k]
    return jax.jit(f)


def router_stats(handle: Any, prompt: str | Sequence[int]) -> RouterStats:
    """Per-layer router choices and expert-load histogram for one prompt (a full causal forward)."""
    cfg = handle.config
    if not cfg.n_moe_layers:
        raise ValueError("this model has no MoE layers (first_k_dense_replace >= num_hidden_layers)")
    ids = _prompt_ids(handle, prompt)
    choices = _run(handle, _router_fn(handle.model), jnp.asarray(_batch(handle, ids)))
    choices = np.asarray(jax.device_get(choices))[:, 0]
    return RouterStats(ids, _pieces(handle, ids), _layer_ids(handle, layout.MOE_LAYERS), choices,
                       cfg.n_routed_experts)


# ------------------------------------------------------------------------------- attention entropy
def _attention_probs(mla: MLA, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MLA's attention probabilities [B, H, T, T] and output [B, T, D] for block input x [B, T, D].

    Runs on a bound MLA module so every projection, norm and (FP8) weight is the layer's own; the score
    math is the naive form (per-head K), which equals the absorbed form's.
    """
    c = mla.cfg
    b, t, _ = x.shape
    h, dn = c.num_attention_heads, c.qk_nope_head_dim
    q, kv = mla.project_q_kv(x)
    q = q.reshape(b, t, h, -1)
    latent = mla.kv_a_layernorm(kv[..., : c.kv_lora_rank])
    cos, sin = rope_angles(c, positions)
    q_pe = apply_rope(q[..., dn:], cos, sin, c.rope_interleave)
    k_pe = apply_rope(kv[..., c.kv_lora_rank:], cos, sin, c.rope_interleave)
    w_uk, w_uv = mla.absorb_weights(x.dtype)
    k_nope = jnp.einsum("btr,hrd->bthd", latent, w_uk)
    v = jnp.einsum("btr,hvr->bthv", latent, w_uv)
    scores = (jnp.einsum("bthd,bshd->bhts", q[..., :dn], k_nope, preferred_element_type=jnp.float32)
              + jnp.einsum("bthe,bse->bhts", q_pe, k_pe, preferred_element_type=jnp.float32))
    p = _causal_softmax(scores * c.softmax_scale, positions, positions)
    out = jnp.einsum("bhts,bshv->bthv", p.astype(x.dtype), v).reshape(b, t, -1)
    return p, mla.o_proj(out)


def _capture_block_io(mdl: nn.Module, method: str) -> bool:
    return method == "__call__" and mdl.name in ("input_layernorm", "self_attn")


@functools.cache
def _entropy_fn(model: nn.Module):
    cfg = model.cfg
    mla = MLA(cfg, model.param_dtype, model.fp8, model.trace_options)

    def f(params, toks):
        _, state = model.apply({"params": params}, toks, mutable=["intermediates"],
                               capture_intermediates=_capture_block_io)
        inter = state["intermediates"]
        b, t = toks.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        ents, errs = [], []
        for stack in layout.STACKS:
            if stack not in params:
                continue
            x = inter[stack]["input_layernorm"]["__call__"][0]  # [L, B, T, D]
            model_out = inter[stack]["self_attn"]["__call__"][0][0]  # (out, cache) -> out [L, B, T, D]

            def layer(p, x_l):
                probs, out = nn.apply(_attention_probs, mla)({"params": p}, x_l, pos)
                plogp = jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0)
                return -plogp.sum(-1)[0], out  # entropy [H, T] of row 0

            ent, out = jax.vmap(layer)(params[stack]["self_attn"], x)
            ents.append(ent)
            scale = jnp.maximum(jnp.abs(model_out).max(), 1e-6)
            errs.append(jnp.abs(out.astype(jnp.float32) - model_out.astype(jnp.float32)).max() / scale)
        return jnp.concatenate(ents), jnp.stack(errs).max()

    return jax.jit(f)


@dataclasses.dataclass
class AttentionEntropy:
    """Entropy (nats) of each head's attention over the visible keys, per layer and query position."""

    token_ids: list[int]
    tokens: list[str] | None
    layers: list[int]  # HF layer indices, all layers
    entropy: np.ndarray  # [num_hidden_layers, num_heads, T]; query t sees t + 1 keys
    recompute_error: float  # max |recomputed - model attention output| / max |model output|

    @property
    def max_entropy(self) -> np.ndarray:
        """[T]: log(t + 1), the entropy of uniform attention over query t's visible keys."""
        return np.log(np.arange(1, len(self.token_ids) + 1, dtype=np.float64))

    @property
    def mean(self) -> np.ndarray:
        """[layers, heads]: entropy averaged over the queries that see more than one key."""
        e = self.entropy[..., 1:] if self.entropy.shape[-1] > 1 else self.entropy
        return e.mean(-1)

    @property
    def normalized(self) -> np.ndarray:
        """[layers, heads]: mean entropy over mean maximum entropy (1.0: uniform, 0.0: one key)."""
        m = self.max_entropy[1:] if len(self.token_ids) > 1 else self.max_entropy
        return self.mean / max(float(m.mean()), 1e-9)

    def plot(self, ax: Any = None):
        """Heat map layers x heads of the mean entropy; returns the Figure."""
        return _heatmap(self.mean, ax=ax, xlabel="head", ylabel="layer", yticks=self.layers,
                        title=f"attention entropy (nats, {len(self.token_ids)} tokens)", cbar="nats")


def attention_entropy(handle: Any, prompt: str | Sequence[int]) -> AttentionEntropy:
    """Attention entropy per head per layer for one prompt, from the model's own weights."""
    ids = _prompt_ids(handle, prompt)
    ent, err = _run(handle, _entropy_fn(handle.model), jnp.asarray(_batch(handle, ids)))
    return AttentionEntropy(ids, _pieces(handle, ids), list(range(handle.config.num_hidden_layers)),
                            np.asarray(jax.device_get(ent), np.float64), float(err))


# ------------------------------------------------------------------------------------- cache pages
@dataclasses.dataclass
class CachePages:
    """One sequence's pages of the paged KV cache after its prefill (layout.cache_layout).

    `pages[stack][name]` holds only this sequence's pages, in logical order: absorbed form
    `pages` [L, n_pages, page_size, kv_lora_rank + rope]; naive form `k_pages` / `v_pages`
    [L, n_pages, page_size, H, dim]. `block_table[i]` is the physical page of logical page i.
    Slots past `n_tokens` are unwritten (zeros).
    """

    token_ids: list[int]
    form: str
    page_size: int
    block_table: np.ndarray  # [n_pages] physical page ids
    pages: dict[str, dict[str, np.ndarray]]
    layers: dict[str, list[int]]  # stack -> HF layer indices

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def n_pages(self) -> int:
        return len(self.block_table)

    def page_fill(self) -> list[int]:
        """Tokens held by each of the sequence's pages."""
        return [min(self.page_size, self.n_tokens - i * self.page_size) for i in range(self.n_pages)]

    def layer(self, layer: int, name: str | None = None) -> np.ndarray:
        """HF layer `layer`'s cached values as one contiguous [n_tokens, ...] array."""
        name = name or (layout.PAGES if self.form == "absorbed" else layout.K_PAGES)
        for stack, ids in self.layers.items():
            if layer in ids:
                arr = self.pages[stack][name][ids.index(layer)]
                return arr.reshape(-1, *arr.shape[2:])[: self.n_tokens]
        raise ValueError(f"layer must be in [0, {sum(map(len, self.layers.values()))}), got {layer}")

    def table(self) -> list[dict[str, Any]]:
        """One row per logical page: physical id, tokens held, bytes over all layers."""
        per_token = sum(a[0, 0, 0].nbytes * a.shape[0] for s in self.pages.values() for a in s.values())
        return [{"logical_page": i, "physical_page": int(p), "tokens": n, "bytes_all_layers": n * per_token}
                for i, (p, n) in enumerate(zip(self.block_table, self.page_fill()))]


@functools.cache
def _prefill_fn(model: nn.Module):
    def f(params, cache, table, toks, lengths):
        b, t = toks.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        _, _, cache = model.apply({"params": params}, toks, pos, cache, PageMeta(table, lengths))
        return cache
    return jax.jit(f)


def cache_pages(handle: Any, prompt: str | Sequence[int], *, page_size: int = kv_cache.PAGE_SIZE
                ) -> CachePages:
    """Prefill one prompt into a fresh paged cache (the handle's attention form) and return its pages."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    ids = _prompt_ids(handle, prompt)
    cfg = handle.config
    toks = _batch(handle, ids)
    cache, table = kv_cache.allocate_contiguous(cfg, toks.shape[0], len(ids), handle.attention,
                                                jnp.dtype(cfg.dtype), page_size=page_size)
    lengths = np.full((toks.shape[0],), len(ids), np.int32)
    cache = _run(handle, _prefill_fn(handle.model), cache, jnp.asarray(table), jnp.asarray(toks),
                 jnp.asarray(lengths))
    row = table[0]
    pages = {stack: {name: np.asarray(jax.device_get(arr))[:, row] for name, arr in cache[stack].items()}
             for stack in _stacks(handle)}
    return CachePages(ids, handle.attention, page_size, row.copy(), pages,
                      {s: _layer_ids(handle, s) for s in _stacks(handle)})
