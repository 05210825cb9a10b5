"""FP8 parameter trees: which leaves an FP8 model keeps in e4m3, and quantizing a float tree to it.

Owns: the rule "every linear of attention, dense MLPs and experts is e4m3 with 128x128 block scales;
embeddings, norms, the router and the LM heads stay in the float dtype" (the official checkpoint's
layout), and `quantize_params` that applies it (used for BF16 -> FP8 and the FP8 tests/benchmarks).
Must not know about files.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_quant import quantize_weight

_FLOAT_KEEP = {"embed_tokens", "lm_head", "shared_head_head"}


def is_quantized_linear(path: tuple[str, ...], leaf: Any) -> bool:
    """Whether an FP8 model stores this leaf as e4m3 (`weight` of a linear, or `<proj>_weight`)."""
    if any(p in _FLOAT_KEEP for p in path):
        return False
    name = path[-1]
    if name == "weight":
        parent = path[-2] if len(path) > 1 else ""
        return leaf.ndim >= 2 and not parent.endswith(("norm", "layernorm"))
    return name in ("gate_proj_weight", "up_proj_weight", "down_proj_weight")


def scale_name(name: str) -> str:
    return "scale" if name == "weight" else name.replace("_weight", "_scale")


def quantize_params(tree: dict[str, Any], *, ue8m0: bool = False) -> dict[str, Any]:
    """A copy of `tree` with every quantizable linear as e4m3 + fp32 block scales beside it."""

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in node.items():
            if isinstance(v, dict):
                out[k] = walk(v, (*path, k))
            elif is_quantized_linear((*path, k), v):
                q, s = quantize_weight(jnp.asarray(v, jnp.float32), ue8m0=ue8m0)
                out[k], out[scale_name(k)] = q, s
            else:
                out[k] = v
        return out

    return walk(tree, ())


def float_twin(tree: dict[str, Any], dtype=jnp.float32) -> dict[str, Any]:
    """The dequantized float tree of an FP8 tree (for comparisons)."""
    from pallas_kernels.fp8_quant import dequantize_weight

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in node.items():
            if isinstance(v, dict):
                out[k] = walk(v)
            elif k == "scale" or k.endswith("_scale"):
                continue
            elif getattr(v, "dtype", None) == jnp.float8_e4m3fn:
                out[k] = dequantize_weight(v, node[scale_name(k)]).astype(dtype)
            else:
                out[k] = v
        return out

    return jax.tree_util.tree_map(lambda x: x, walk(tree))
