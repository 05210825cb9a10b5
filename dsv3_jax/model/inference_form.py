"""The parameter form every ModelHandle holds: the checkpoint's tree with MLA's weights prepared once, at
load, for the step's products instead of in every step.

The transforms, in order: kv_b split into W_uk / W_uv in the compute dtype (kv_b.py), then q_a and kv_a
fused into one linear (qkv_a.py). The model reads the checkpoint form too (tests, training, export), so
each transform is an optimization of the same numbers, never a different model.

Owns: which transforms make the inference form and their order, for arrays (`prepare`) and for shapes
(`shapes`: what the planner and the scale table count). Must not read files or know meshes beyond the
`sharding_of` a caller passes; each transform's leaves belong to its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kv_b, qkv_a


def prepare(params: dict, cfg: ModelConfig, dtype: Any,
            sharding_of: Callable[[str, int], Any] | None = None) -> dict:
    """`params` in inference form (`dtype`: the compute dtype kv_b's halves take). A tree already in it
    comes back as is. `sharding_of(path, ndim)`: the sharding each new leaf is computed into (a mesh's)."""
    return qkv_a.fuse(kv_b.split(params, cfg, dtype, sharding_of), cfg, sharding_of)


def shapes(tree: Any, cfg: ModelConfig, dtype: Any) -> Any:
    """`prepare`'s result as shapes, from any tree of leaves with shape and dtype."""
    return qkv_a.fuse_shapes(kv_b.split_shapes(tree, cfg, dtype), cfg)
