"""MLA's first projections fused: q_a_proj and kv_a_proj_with_mqa as one linear, `qkv_a_proj`.

Why: both read the block's input x. As two linears, a decode step runs two GEMMs a layer, each with its
own glue, and kv_a's 576 output rows are not a whole kernel tile: the FP8 kernel pads that weight (a
4-5 MB copy) in every call (`pallas_kernels.fp8_gemm._launch`). One linear runs one GEMM whose column
tiles fill more SMs. vLLM and SGLang fuse the same pair at load (`fused_qkv_a_proj_with_mqa`).

The form: each self_attn dict holding both linears (the stacks' and the MTP block's) holds instead
`qkv_a_proj` {weight [.., W, D][, scale]}: rows [0, q_lora_rank) are q_a's, the next `latent_dim` kv_a's,
the rest (FP8 only: W rounded up to `fp8_gemm.N_ALIGN`, so no call pads it) zeros with scale 1. The
numbers are the checkpoint's: a concatenation, bit for bit (`split_output` takes the two outputs back).
FP8 block scales concatenate only when q_lora_rank is whole 128-row blocks (DeepSeek-V3: 1536); other
FP8 configs keep the two linears (`fusable`; logged once). Without q_lora (the V2-Lite layout) there is
no q_a to fuse.

Owns: the fused leaf's name and width, its row layout (`split_output`) and the fusion (arrays and
shapes). Must not change any other leaf, read files or know meshes: q_lora and kv_latent are replicated,
and so is the fused leaf (layout.PARAM_AXES).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import layout

log = logging.getLogger(__name__)

Q_A = "q_a_proj"
KV_A = "kv_a_proj_with_mqa"
QKV_A = "qkv_a_proj"  # the fused linear
SCALE_BLOCK = 128  # rows per FP8 weight-scale block (the checkpoints' 128x128 blocks)


def _n_align() -> int:
    from pallas_kernels.fp8_gemm import N_ALIGN

    return N_ALIGN


def fusable(cfg: ModelConfig, fp8: bool) -> bool:
    """Whether q_a and kv_a fuse: q_a exists, and for FP8 weights its rows are whole scale blocks."""
    if cfg.q_lora_rank is None:
        return False
    if fp8 and cfg.q_lora_rank % SCALE_BLOCK:
        _log_not_fused(cfg.q_lora_rank)
        return False
    return True


def width(cfg: ModelConfig, fp8: bool) -> int:
    """Rows of the fused weight: q_lora_rank + latent_dim, FP8 rounded up to the kernel's N_ALIGN."""
    w = cfg.q_lora_rank + cfg.latent_dim
    return -(-w // _n_align()) * _n_align() if fp8 else w


def split_output(y: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The fused linear's output [.., W] -> (q_a's [.., q_lora_rank], kv_a's [.., latent_dim])."""
    q = cfg.q_lora_rank
    return y[..., :q], y[..., q: q + cfg.latent_dim]


def _fused(q_a: dict, kv_a: dict, rows: int) -> dict[str, jax.Array]:
    """{weight[, scale]}: the two linears' rows stacked, zero rows (scale 1) up to `rows`."""
    def stack(a, b, fill, per_row: int):
        both = jnp.concatenate([a, b], axis=-2)
        pad = -(-rows // per_row) - both.shape[-2]
        if pad == 0:
            return both
        widths = [(0, 0)] * both.ndim
        widths[-2] = (0, pad)
        return jnp.pad(both, widths, constant_values=fill)

    out = {"weight": stack(q_a["weight"], kv_a["weight"], 0, 1)}
    if "scale" in q_a:
        out["scale"] = stack(q_a["scale"], kv_a["scale"], 1, SCALE_BLOCK)
    return out


def fuse(params: dict, cfg: ModelConfig, sharding_of: Callable[[str, int], Any] | None = None) -> dict:
    """The parameter tree with every (q_a_proj, kv_a_proj_with_mqa) pair as `qkv_a_proj`, computed on the
    devices the pair lies on; a tree without the pair (already fused, or not `fusable`) comes back as is.
    `sharding_of(path, ndim)` (the leaf's '/'-joined path) is the sharding each new leaf is computed into
    (a mesh's); None leaves the choice to the compiler."""
    fp8 = "scale" in _first_q_a(params)
    if not fusable(cfg, fp8):
        return params
    rows = width(cfg, fp8)

    def convert(path: str, pair: dict) -> dict:
        out_shardings = None
        if sharding_of is not None:
            out_shardings = {QKV_A: {k: sharding_of(f"{path}/{QKV_A}/{k}", v.ndim)
                                     for k, v in pair[Q_A].items()}}
        return jax.jit(lambda p: {QKV_A: _fused(p[Q_A], p[KV_A], rows)}, out_shardings=out_shardings)(pair)

    return layout.replace_in_attention(params, (Q_A, KV_A), convert)


def fuse_shapes(tree: Any, cfg: ModelConfig) -> Any:
    """`fuse`'s result as ShapeDtypeStructs in place of the new leaf, from any tree of leaves with shape
    and dtype (arrays, ShapeDtypeStructs, layout.ArrayInfo): what the planner counts."""
    fp8 = "scale" in _first_q_a(tree)
    if not fusable(cfg, fp8):
        return tree
    rows = width(cfg, fp8)

    def convert(path: str, pair: dict) -> dict:
        specs = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), pair, is_leaf=layout.is_info)
        return jax.eval_shape(lambda p: {QKV_A: _fused(p[Q_A], p[KV_A], rows)}, specs)

    return layout.replace_in_attention(tree, (Q_A, KV_A), convert)


def _first_q_a(tree: Any) -> dict:
    """The first q_a_proj linear under a self_attn dict of `tree` ({} when there is none): it tells
    whether the weights are FP8."""
    if not isinstance(tree, dict):
        return {}
    attn = tree.get(layout.ATTENTION)
    if isinstance(attn, dict) and Q_A in attn:
        return attn[Q_A]
    return next((found for sub in tree.values() if (found := _first_q_a(sub))), {})


@functools.cache
def _log_not_fused(q_lora_rank: int) -> None:
    log.info("qkv_a: q_lora_rank %d is not whole %d-row scale blocks: the FP8 q_a and kv_a stay two linears",
             q_lora_rank, SCALE_BLOCK)
