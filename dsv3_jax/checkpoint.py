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
    from tqdm.auto import tqdm  # a widget in notebooks, a bar on terminals

    tree: dict[str, Any] = {}
    total = sum(index[n].nbytes for n in names)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {Path(src).name}", leave=False,
              disable=total < 256 * 2**20) as bar:  # no bar for tiny test checkpoints
        for path, leaf in hf_names.iter_leaves(cfg, names, lambda n: read_tensor(index[n])):
            hf_names.set_path(tree, path, leaf)
            bar.update(leaf.nbytes)
    tree = {k: v for k, v in tree.items() if include_mtp or k != "mtp"}
    return cast_tree(tree, dtype)


def tree_is_fp8(tree: dict[str, Any]) -> bool:
    return any(x.dtype == FP8 for x in jax.tree_util.tree_leaves(tree))


def _keeps_dtype(path: tuple[str, ...], stored: str) -> bool:
    """FP8 weights, their fp32 scales and the fp32 router bias are restored as stored (cf. cast_tree)."""
    return stored == "float8_e4m3fn" or path[-1].endswith("scale") or path[-1] == "e_score_correction_bias"


def load_converted(path: str | Path, cfg: ModelConfig, *, dtype: jnp.dtype,
                   shardings: Any = None) -> dict[str, Any]:
    """The parameter tree (jax.Arrays) of a directory written by `convert`, restored with Orbax.

    `shardings`: None (every leaf on the default device), one `jax.sharding.Sharding` for all leaves,
    or a nested dict shaped like the parameter tree. Each process reads only the chunks its devices
    hold. Leaves are restored in `dtype` except FP8 weights, scales and the router bias. The MTP leaves
    are skipped when `cfg.num_nextn_predict_layers` is 0.
    """
    from convert import orbax_io

    path = Path(path)
    marker = path / COMPLETE_MARKER
    if not marker.exists():
        raise CheckpointError(f"{path}: no {COMPLETE_MARKER}: not a complete converted checkpoint (an "
                              "interrupted conversion never has one; rerun the converter with --resume)")
    try:
        manifest = json.loads(marker.read_text())
        leaves = {tuple(name.split(".")): (tuple(shape), dt) for name, (shape, dt, _) in
                  manifest["leaves"].items()}
        root = path / manifest["params_dir"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{marker}: unreadable manifest ({e!r})") from e
    if not cfg.num_nextn_predict_layers:
        leaves = {p: v for p, v in leaves.items() if p[0] != "mtp"}
    elif not any(p[0] == "mtp" for p in leaves):
        raise CheckpointError(f"{path}: config declares an MTP layer but the checkpoint has none")

    def sharding_of(p: tuple[str, ...]) -> Any:
        if shardings is None:
            return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        if isinstance(shardings, jax.sharding.Sharding):
            return shardings
        node = shardings
        for k in p:
            if not isinstance(node, dict) or k not in node:
                raise CheckpointError(f"shardings has no entry for parameter {'/'.join(p)}")
            node = node[k]
        return node

    want = {p: (shape, jnp.dtype(dt) if _keeps_dtype(p, dt) else jnp.dtype(dtype))
            for p, (shape, dt) in leaves.items()}
    return orbax_io.restore(root, want, {p: sharding_of(p) for p in want})


def load_params(path: str | Path, cfg: ModelConfig, *, dtype: jnp.dtype,
                shardings: Any = None) -> dict[str, Any]:
    """The parameter tree of a checkpoint directory: a converted (Orbax) one or an HF one.

    A converted directory is recognized by its manifest (written last by the converter); a directory
    holding converter output without it (an interrupted run) is refused. `shardings` as in
    `load_converted` (None: default device; HF trees are placed with `jax.device_put`).
    """
    path = Path(path)
    if (path / COMPLETE_MARKER).exists():
        return load_converted(path, cfg, dtype=dtype, shardings=shardings)
    if (path / "params").is_dir() or (path / "convert_plan.json").exists():
        raise CheckpointError(f"{path}: an incomplete converted checkpoint (no {COMPLETE_MARKER}; the "
                              "conversion was interrupted): rerun the converter with --resume")
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        tree = load_hf_params(path, cfg, dtype=dtype)
        return tree if shardings is None else jax.device_put(tree, shardings)
    raise CheckpointError(f"{path}: neither a converted checkpoint nor an HF safetensors directory")
