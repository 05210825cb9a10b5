"""Reading weights: HF safetensors directories (directly) and converted Orbax checkpoints.

Owns: finding a checkpoint's files, turning them into the model's parameter tree in the requested dtype,
and the "is this a complete checkpoint" check. Must not own the model or meshes; placement onto
devices is given as a `shardings` tree by the caller.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from convert import hf_names
from convert.safetensors_io import TensorInfo, read_header, read_tensor
from dsv3_jax.config import ModelConfig

FP8 = jnp.float8_e4m3fn
COMPLETE_MARKER = "dsv3_manifest.json"  # written last by the converter


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or does not match its config."""


def hf_tensor_index(src: str | Path) -> dict[str, TensorInfo]:
    """All tensors of an HF directory (index.json or a single model.safetensors), headers validated."""
    src = Path(src)
    index = src / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (src / "model.safetensors").exists():
        weight_map, files = {}, ["model.safetensors"]
    else:
        raise CheckpointError(f"{src}: no model.safetensors.index.json or model.safetensors")
    out: dict[str, TensorInfo] = {}
    for f in files:
        tensors, _ = read_header(src / f)
        out.update(tensors)
    missing = [n for n, f in weight_map.items() if n not in out]
    if missing:
        raise CheckpointError(f"{src}: tensors listed in the index but absent from their shard: "
                              f"{', '.join(missing[:8])}")
    return out


def cast_tree(tree: dict[str, Any], dtype: jnp.dtype) -> dict[str, Any]:
    """Cast floating leaves to `dtype`, keeping FP8 weights, their fp32 scales and the router bias."""

    def cast(path, x):
        name = path[-1].key
        if x.dtype == FP8 or name.endswith("scale") or name == "e_score_correction_bias":
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


def load_hf_params(src: str | Path, cfg: ModelConfig, *, dtype: jnp.dtype,
                   include_mtp: bool = True) -> dict[str, Any]:
    """Parameter tree (numpy) from an HF directory; FP8 checkpoints stay e4m3 + scales."""
    index = hf_tensor_index(src)
    names = [n for n in index if include_mtp or hf_names.hf_target(n, cfg) is None
             or hf_names.hf_target(n, cfg).path[0] != "mtp"]
    tree = hf_names.assemble(cfg, names, lambda n: read_tensor(index[n]))
    tree = {k: v for k, v in tree.items() if include_mtp or k != "mtp"}
    return cast_tree(tree, dtype)


def tree_is_fp8(tree: dict[str, Any]) -> bool:
    return any(x.dtype == FP8 for x in jax.tree_util.tree_leaves(tree))


def load_params(path: str | Path, cfg: ModelConfig, *, dtype: jnp.dtype) -> dict[str, Any]:
    """The parameter tree of a checkpoint directory: a converted (Orbax) one or an HF one."""
    path = Path(path)
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return load_hf_params(path, cfg, dtype=dtype)
    raise CheckpointError(f"{path}: neither a converted checkpoint nor an HF safetensors directory")
