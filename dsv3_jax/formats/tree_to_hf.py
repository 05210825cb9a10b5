"""The inverse of hf_names: dsv3_jax's parameter tree -> HF DeepSeek-V3 tensors and a safetensors directory.

Owns: naming every leaf slice of a (possibly FP8) tree with its HF tensor name (including the MTP layer
`model.layers.{num_hidden_layers}.*`), in the dtype an HF checkpoint of the config stores, and writing
those tensors as size-bounded shards plus `model.safetensors.index.json`. The name <-> slot mapping
itself is hf_names' (`expected_hf_tensors` + `hf_target`), so reading and writing cannot drift apart.
Must not know about training, tokenizers or config.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dsv3_jax.config import ModelConfig
from dsv3_jax.formats import hf_names
from dsv3_jax.formats.safetensors_io import DTYPES, write_safetensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _leaf(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = tree
    for k in path:
        if not isinstance(node, dict) or k not in node:
            raise KeyError(f"parameter tree has no leaf {'/'.join(path)}")
        node = node[k]
    return node


def _is_fp8(tree: dict[str, Any]) -> bool:
    import jax

    return any(np.dtype(x.dtype) == DTYPES["F8_E4M3"] for x in jax.tree_util.tree_leaves(tree))


def iter_hf_tensors(params: dict[str, Any], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy array) for every tensor an HF checkpoint of `cfg` holds, in HF order.

    The MTP layer is included when `params` has an "mtp" subtree. Each array is cast to the dtype the
    HF layout stores (cfg.dtype; F32 router bias; FP8 weights + F32 `weight_scale_inv` stay as they are).
    """
    include_mtp = "mtp" in params
    if include_mtp and not cfg.num_nextn_predict_layers:
        raise ValueError("params has an 'mtp' subtree but cfg.num_nextn_predict_layers is 0")
    expected = hf_names.expected_hf_tensors(cfg, fp8=_is_fp8(params), include_mtp=include_mtp)
    cache: dict[tuple[str, ...], np.ndarray] = {}
    for name, (shape, dtype) in expected.items():
        target = hf_names.hf_target(name, cfg)
        if target is None:  # cannot happen for names expected_hf_tensors produced; guards a drift
            raise KeyError(f"hf_names has no target for its own tensor {name}")
        if target.path not in cache:
            cache[target.path] = np.asarray(_leaf(params, target.path))
        arr = cache[target.path][target.index] if target.index else cache[target.path]
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{name}: tree slice {'/'.join(target.path)}{list(target.index)} has shape "
                             f"{tuple(arr.shape)}, the config needs {tuple(shape)}")
        yield name, np.ascontiguousarray(arr.astype(DTYPES[dtype], copy=False))


def tree_to_hf(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """All HF tensors of `params` as a name -> numpy dict (see `iter_hf_tensors`)."""
    return dict(iter_hf_tensors(params, cfg))


def write_hf_weights(params: dict[str, Any], cfg: ModelConfig, dst: str | Path, *,
                     max_shard_bytes: int = 2 * 1024**3) -> list[Path]:
    """Write `params` as HF safetensors into directory `dst`; returns the files written.

    One `model.safetensors` when everything fits in `max_shard_bytes`, else shards
    `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` (weight_map + total_size).
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size, total = 0, 0
    for name, arr in iter_hf_tensors(params, cfg):
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
        total += arr.nbytes
    if len(shards) == 1:
        write_safetensors(dst / SINGLE_FILE, shards[0], {"format": "pt"})
        return [dst / SINGLE_FILE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        f = dst / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(f, shard, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, f.name))
        files.append(f)
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2))
    return [*files, dst / INDEX_FILE]
