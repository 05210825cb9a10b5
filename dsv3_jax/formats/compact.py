"""The compact weight form (`compact.part-NNN` files): how the embedded default model ships.

One safetensors blob cut into parts of bounded size: the training tree (MTP embedding and head shared
with the main model, so not stored; lm_head absent when tied to the embedding) flattened to `a/b/c`
names, floats in the stored dtype (the router bias fp32), the embedding / head rows of the used tokens
only (`used_ids`) plus one shared row for all others (`embed_fill` / `lm_head_fill`), and the full
`vocab_size` (and `tied_head`) in the header metadata.

Owns: writing the parts (`write_parts`, given the flattened rows train.py's exporters choose), reading
them back to the full-vocabulary training tree (`import_compact`), and the training tree <-> the model's
full tree (`tie_mtp` / `untie_mtp`: the MTP copies of embedding and head). `dsv3_jax.load` reads the
default model through this module; train.py writes it. Must not know training (which rows to keep is
train.py's `VocabMap` / `restrict_vocab`) or run the model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from dsv3_jax.formats.safetensors_io import read_header, read_tensor, write_safetensors

PART_GLOB = "compact.part-*"
# The MTP layer's copies of the main model's embedding and head (DeepSeek-V3 shares them).
TIED = (("mtp", "embed_tokens", "embedding"), ("mtp", "shared_head_head", "weight"))


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def tie_mtp(params: dict[str, Any]) -> dict[str, Any]:
    """The model's full tree: the MTP embedding / head are the main model's (DeepSeek-V3 shares them);
    a tree trained with a tied head (no lm_head) gets the embedding as its head."""
    if "lm_head" not in params:
        params = {**params, "lm_head": {"weight": params["embed_tokens"]["embedding"]}}
    if "mtp" not in params or "embed_tokens" in params["mtp"]:
        return params
    mtp = {**params["mtp"], "embed_tokens": {"embedding": params["embed_tokens"]["embedding"]},
           "shared_head_head": {"weight": params["lm_head"]["weight"]}}
    return {**params, "mtp": mtp}


def untie_mtp(params: dict[str, Any]) -> dict[str, Any]:
    """A full tree back to the training form (refusing one whose MTP copies differ from the main's)."""
    if "mtp" not in params or "embed_tokens" not in params["mtp"]:
        return params
    for path, main in zip(TIED, (("embed_tokens", "embedding"), ("lm_head", "weight")), strict=True):
        if not np.array_equal(np.asarray(_get(params, path)), np.asarray(_get(params, main))):
            raise ValueError(f"{'/'.join(path)} differs from {'/'.join(main)}: not a shared-head model")
    mtp = {k: v for k, v in params["mtp"].items() if k not in ("embed_tokens", "shared_head_head")}
    return {**params, "mtp": mtp}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict tree as {"a/b/c": leaf}."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, v in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def write_parts(flat: dict[str, np.ndarray], meta: dict[str, str], dst: Path, part_bytes: int,
                dtype: str) -> list[Path]:
    """`flat` (names as `flatten` gives them, rows already chosen) as `compact.part-NNN` files of <=
    part_bytes in `dst`: floats in `dtype`, the router bias and `used_ids` as they are."""
    np_dt = np.dtype(jnp.dtype(dtype))
    flat = {k: v if k.endswith("e_score_correction_bias") or k == "used_ids" else v.astype(np_dt)
            for k, v in flat.items()}
    dst.mkdir(parents=True, exist_ok=True)
    blob_path = dst / "compact.safetensors.tmp"
    write_safetensors(blob_path, flat, meta)
    blob = blob_path.read_bytes()
    blob_path.unlink()
    files = []
    for i in range(0, len(blob), part_bytes):
        f = dst / f"compact.part-{i // part_bytes:03d}"
        f.write_bytes(blob[i:i + part_bytes])
        files.append(f)
    return files


def has_compact(src: str | Path) -> bool:
    """Whether `src` holds compact part files."""
    return any(Path(src).glob(PART_GLOB))


def import_compact(src: str | Path) -> dict[str, Any]:
    """The training params (numpy, full vocabulary, with lm_head) from the part files in `src`."""
    parts = sorted(Path(src).glob(PART_GLOB))
    if not parts:
        raise FileNotFoundError(f"no compact.part-* files in {src}")
    with tempfile.TemporaryDirectory() as tmp:
        blob = Path(tmp) / "compact.safetensors"
        blob.write_bytes(b"".join(p.read_bytes() for p in parts))
        infos, meta = read_header(blob)
        flat = {k: read_tensor(v) for k, v in infos.items()}
    vocab = int(meta["vocab_size"])
    used_ids = flat.pop("used_ids")

    def expand(rows: np.ndarray, fill: np.ndarray | None) -> np.ndarray:
        full = np.broadcast_to(fill if fill is not None else np.zeros_like(rows[0]),
                               (vocab, rows.shape[1])).copy()
        full[used_ids] = rows
        return full

    emb_fill, head_fill = flat.pop("embed_fill", None), flat.pop("lm_head_fill", None)
    flat["embed_tokens/embedding"] = expand(flat["embed_tokens/embedding"], emb_fill)
    if meta.get("tied_head") == "1":
        flat["lm_head/weight"] = flat["embed_tokens/embedding"].copy()
    else:
        flat["lm_head/weight"] = expand(flat["lm_head/weight"], head_fill)
    return unflatten(flat)
