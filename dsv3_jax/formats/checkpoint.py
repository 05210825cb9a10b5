"""Reading weights: HF safetensors directories (directly) and converted Orbax checkpoints.

Owns: finding a checkpoint's files, turning them into the model's parameter tree in the requested dtype,
the "is this a complete checkpoint" check, and refusing a damaged one in one error naming the thing:
the manifest's entries (typed, `params_dir` inside the checkpoint, leaf shapes matching config.json),
each leaf's array files (missing or truncated chunks named by leaf and file before the restore
starts), an HF directory's tensors
(validated by the converter's check: names, shapes, dtypes, index entries inside the directory).
Must not own the model or meshes; placement onto devices is given as a `shardings` tree by the caller.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelConfig
from dsv3_jax.formats import hf_names
from dsv3_jax.formats.paths import PathContainmentError, contained
from dsv3_jax.formats.safetensors_io import TensorInfo, read_tensor

FP8 = jnp.float8_e4m3fn
COMPLETE_MARKER = "dsv3_manifest.json"  # written last by the converter


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or does not match its config."""


def hf_tensor_index(src: str | Path, *, include_mtp: bool = True) -> dict[str, TensorInfo]:
    """All tensors of an HF directory (index.json or a single model.safetensors), validated as a whole
    against its config.json by the converter's own check (index entries inside the directory, headers,
    names, shapes, dtypes): a problem is a CheckpointError naming the tensor and the file."""
    from convert.validate import ValidationError, inspect_source

    try:
        return inspect_source(src, include_mtp=include_mtp).tensors
    except ValidationError as e:
        if len(e.problems) == 1:
            raise CheckpointError(f"{src}: cannot load this HF directory: {e.problems[0]}") from None
        raise CheckpointError(f"{src}: cannot load this HF directory, {len(e.problems)} problems:\n  - "
                              + "\n  - ".join(e.problems[:20])) from None


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
    index = hf_tensor_index(src, include_mtp=include_mtp)
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
    from dsv3_jax.formats import orbax_io

    path = Path(path)
    marker = path / COMPLETE_MARKER
    if not marker.exists():
        raise CheckpointError(f"{path}: no {COMPLETE_MARKER}: not a complete converted checkpoint (an "
                              "interrupted conversion never has one; rerun the converter with --resume)")
    manifest, root = read_manifest(path)
    leaves = {tuple(name.split(".")): (tuple(shape), dt) for name, (shape, dt, _) in manifest.items()}
    if not cfg.num_nextn_predict_layers:
        leaves = {p: v for p, v in leaves.items() if p[0] != "mtp"}
    elif not any(p[0] == "mtp" for p in leaves):
        raise CheckpointError(f"{path}: config declares an MTP layer but the checkpoint has none")

    _check_shapes_match_config(path, cfg, leaves)

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
    for p in want:  # metadata only: a missing or cut chunk is named here, not deep inside the restore
        shape, dt, chunks = manifest[".".join(p)]
        try:
            orbax_io.check_leaf_files(root, ".".join(p), tuple(shape), dt, tuple(chunks))
        except orbax_io.ChunkError as e:
            raise CheckpointError(f"{path}: {e}") from None
    try:
        return orbax_io.restore(root, want, {p: sharding_of(p) for p in want})
    except (ValueError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: restoring the parameters failed: {str(e).splitlines()[0]}") from e


def _check_shapes_match_config(path: Path, cfg: ModelConfig,
                               leaves: dict[tuple[str, ...], tuple[tuple[int, ...], str]]) -> None:
    """Refuse a checkpoint whose leaf shapes are not the ones its config.json implies (a config edited
    after conversion would otherwise fail at the first forward, deep inside Flax)."""
    from dsv3_jax import plan

    fp8 = any(dt == "float8_e4m3fn" for _, dt in leaves.values())
    tree = plan.param_shapes(cfg, "fp8" if fp8 else "bf16", bool(cfg.num_nextn_predict_layers))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    want = {tuple(k.key for k in kp): tuple(x.shape) for kp, x in flat}
    bad = [f"{'.'.join(p)}: stored {list(shape)}, config.json implies {list(want[p])}"
           for p, (shape, _) in sorted(leaves.items()) if p in want and tuple(shape) != want[p]]
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CheckpointError(f"{path}: the parameters do not match config.json (edited after conversion?): "
                              + "; ".join(bad[:3]) + more)


_LEAF_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def read_manifest(path: Path) -> tuple[dict[str, tuple[list[int], str, list[int]]], Path]:
    """({leaf name: (shape, dtype, chunks)}, params directory) of a converted checkpoint, every entry
    type-checked and the params directory contained in `path` (CheckpointError naming the entry)."""
    from dsv3_jax.formats import orbax_io

    marker = path / COMPLETE_MARKER
    try:
        m = json.loads(marker.read_text(encoding="utf-8"))
        leaves, params_dir = m["leaves"], m["params_dir"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker}: unreadable manifest ({type(e).__name__}: {e})") from None
    try:
        root = contained(path, params_dir, f"{marker}: params_dir")
    except PathContainmentError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(leaves, dict) or not leaves:
        raise CheckpointError(f"{marker}: 'leaves' must be a non-empty object")

    def dims(x: object) -> bool:
        return isinstance(x, list) and all(type(i) is int and i >= 0 for i in x)

    for name, entry in leaves.items():
        if not _LEAF_NAME.fullmatch(name):
            raise CheckpointError(f"{marker}: leaf name {name!r} is not a dotted parameter path")
        if (not isinstance(entry, list) or len(entry) != 3 or not dims(entry[0]) or not dims(entry[2])
                or len(entry[0]) != len(entry[2]) or entry[1] not in orbax_io.DTYPES_BY_NAME):
            raise CheckpointError(f"{marker}: leaf {name}: malformed entry {entry!r} (want [shape, dtype, "
                                  "chunks])")
    return leaves, root


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
