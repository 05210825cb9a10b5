"""kv_b's inference form: its halves W_uk and W_uv, dequantized once and laid out for the step's products.

Why: a checkpoint holds kv_b as one linear, [H * (dn + dv), R] (FP8 with 128x128 block scales in the
official weights). Attention needs W_uk [H, dn, R] folded into q and W_uv [H, dv, R] after attention.
Read from the checkpoint form, every step of every layer dequantizes and transposes the whole kv_b. The
optimized HLO of the FP8 slice's decode step shows two transposing fusions a layer, each reading the
layer's 16.8 MB of FP8 kv_b: ~19 us a layer on an H100 (RESULTS.md, 2026-12-07). vLLM and SGLang do that
work once, at load; so does `split` here.

The form: in each `self_attn` subtree, `kv_b_proj` ({weight[, scale]}) is replaced by two leaves,
`W_UK` [.., H, R, dn] and `W_UV` [.., H, dv, R], in the compute dtype: each with its product's
contracting axis last, the operand layout XLA's GPU products asked for (from the transposes it
inserted), and pinned so in the step (`pinned`), so the step reads them as they lie. A stacked subtree
keeps its layer axis first. The values are the checkpoint form's, dequantized with the same function the
step used (`kernel_dispatch.dequantize_weight`): the same numbers.

Owns: the names of the two leaves, the split (arrays, and shapes for the planner) and the halves'
orientation (`halves`). Must not change any other leaf, read files or know meshes (a caller that
places the leaves passes `sharding_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kernel_dispatch as kernels
from dsv3_jax.model import layout

KV_B = "kv_b_proj"  # the checkpoint form's linear, in each self_attn subtree
W_UK = "w_uk"  # [.., H, R, dn]: kv_b's K half (folded into q in absorbed form)
W_UV = "w_uv"  # [.., H, dv, R]: kv_b's V half (applied after attention)


def halves(matrix: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """kv_b as a float matrix [.., H * (dn + dv), R] -> (W_uk [.., H, R, dn], W_uv [.., H, dv, R]):
    each with its product's contracting axis last."""
    h, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
    w = matrix.reshape(*matrix.shape[:-2], h, dn + cfg.v_head_dim, cfg.kv_lora_rank)
    return jnp.swapaxes(w[..., :dn, :], -1, -2), w[..., dn:, :]


def pinned(w: jax.Array) -> jax.Array:
    """`w` (one layer's half) pinned to its row-major layout. Why: left free, XLA's layout assignment
    gave a layer's half the layout its product wanted with the size-1 layer axis inside it, and carried
    that back to the whole stack: one transpose of every layer's half in every step, hoisted out of the
    layer loop (H100, 2026-12-07: 46 us a step at two layers)."""
    return with_layout_constraint(w, Layout(major_to_minor=tuple(range(w.ndim))))


def _from_linear(linear: dict, cfg: ModelConfig, dtype: Any) -> dict[str, jax.Array]:
    w = linear["weight"]
    matrix = (kernels.dequantize_weight(w, linear["scale"], dtype) if "scale" in linear
              else w.astype(dtype))
    w_uk, w_uv = halves(matrix, cfg)
    return {W_UK: w_uk, W_UV: w_uv}


def split(params: dict, cfg: ModelConfig, dtype: Any,
          sharding_of: Callable[[str, int], Any] | None = None) -> dict:
    """The parameter tree in inference form: every kv_b_proj (stacks and the MTP layer) as W_UK / W_UV in
    `dtype`, computed on the devices kv_b lies on. A tree already split comes back as is; only kv_b's
    new leaves are new arrays. `sharding_of(path, ndim)` (the leaf's '/'-joined path) is the sharding each
    new leaf is computed into (a mesh's); None leaves the choice to the compiler."""
    def convert(path: str, linear: dict) -> dict:
        out_shardings = None
        if sharding_of is not None:
            ndim = linear["weight"].ndim + 1
            out_shardings = {k: sharding_of(f"{path}/{k}", ndim) for k in (W_UK, W_UV)}
        return jax.jit(lambda lin: _from_linear(lin, cfg, dtype), out_shardings=out_shardings)(linear)

    return layout.replace_in_attention(params, (KV_B,), lambda path, d: convert(path, d[KV_B]))


def split_shapes(tree: Any, cfg: ModelConfig, dtype: Any) -> Any:
    """`split`'s result as ShapeDtypeStructs in place of the new leaves, from any tree of leaves with
    shape and dtype (arrays, ShapeDtypeStructs, layout.ArrayInfo): what the planner counts."""
    def convert(path: str, linear: dict) -> dict:
        specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in linear.items()}
        return jax.eval_shape(lambda lin: _from_linear(lin, cfg, dtype), specs)

    return layout.replace_in_attention(tree, (KV_B,), lambda path, d: convert(path, d[KV_B]))

