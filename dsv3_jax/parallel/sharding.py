"""Meshes and the one table that maps the model's logical axes onto them.

Owns: building a `jax.sharding.Mesh` with the axes `data`, `tensor`, `expert` from a spec string
("data=2,tensor=2,expert=2"), checking it against the device count and the model (heads, experts,
vocabulary and FFN widths must divide their axes), and the logical-axis rules: `LOGICAL_RULES` says
which mesh axes each logical axis of `layout.LOGICAL_AXES` lives on; `ACTIVATION_AXES` names the logical
axes of the activations. The logical axes of every parameter and cache leaf are declared in
model/layout.py (`param_layout`, `cache_layout`, looked up by leaf name for any tree of that layout);
parameter and cache shardings are derived from them through LOGICAL_RULES and nowhere else.
Must not own model math, leaf shapes or names (layout.py), or the MoE collectives (moe.py reads the mesh).

The layout, in one paragraph (DeepSeek-V3 inference, SGLang-style "DP attention + EP"):
- `tensor` splits attention heads (q_b / kv_b outputs, o_proj input), the vocabulary of the embedding
  and LM head, the dense MLP and shared-expert FFN width, and each routed expert's FFN width.
- `expert` splits the routed experts. Outside the MoE it is *also* a batch axis: MLA's latent cache has
  no head axis, so the expert group runs attention data-parallel (each device its own sequences) instead
  of replicating it. Tokens travel to their experts' devices inside the MoE (moe.py).
- `data` splits the batch (sequences, and with them the latent cache).
So activations and caches are batch-sharded over ("data", "expert") and replicated over `tensor`.
The router (E x D, 0.3% of a MoE layer) stays replicated: every device routes its own tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import layout

# Mesh axes, outermost first: data crosses hosts most cheaply; tensor talks most, so it is innermost
# (neighbouring devices, NVLink).
AXES = ("data", "expert", "tensor")

MeshAxes = str | tuple[str, ...] | None

# ------------------------------------------------------------------------------------------------------
# THE table: logical axis (layout.LOGICAL_AXES, every one) -> mesh axes. Change a sharding here and
# nowhere else.
LOGICAL_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "expert"),  # sequences: activations and the latent cache (DP attention)
    "seq": None,
    "cache_pages": ("data", "expert"),  # a paged pool: each batch shard owns a slice of pages
    "page_slot": None,
    "layers": None,  # the nn.scan stacking axis
    "embed": None,  # hidden size D: the residual stream stays whole on every device
    "vocab": "tensor",  # vocabulary-parallel embedding and LM head
    "heads": "tensor",  # head-major flattened q_b / kv_b outputs, o_proj input, naive-cache heads
    "head_dim": None,
    "q_lora": None,
    "kv_latent": None,  # kv_lora_rank (+ rope): the absorbed cache's 576 values
    "qkv_a": None,  # q_lora and kv_latent fused (model/qkv_a.py): replicated like both
    "mlp": "tensor",  # dense MLP width
    "shared_mlp": "tensor",  # shared-expert width
    "experts": "expert",  # routed experts
    "expert_mlp": "tensor",  # a routed expert's FFN width (moe.py psums over tensor)
    "router": None,  # router rows (E) and correction bias: replicated, see module docstring
    "norm": None,
    "concat_embed": None,  # MTP eh_proj input [embed ; hidden]
}

ACTIVATION_AXES: dict[str, tuple[str | None, ...]] = {
    "tokens": ("batch", "seq"),
    "hidden": ("batch", "seq", "embed"),
    "logits": ("batch", "seq", "vocab"),
    "moe_tokens": ("batch", "embed"),  # flattened [B*T, D] inside the MoE
}


class MeshError(ValueError):
    """A mesh spec is malformed, does not match the devices, or does not divide the model."""


# ------------------------------------------------------------------------------------------- meshes
def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """"data=2,tensor=2,expert=2" (or a dict) -> sizes of all three axes (missing ones are 1).

    One axis may be -1: it takes whatever the device count leaves (resolved by `make_mesh`).
    """
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise MeshError(f"mesh spec {spec!r}: expected 'axis=size' items like 'tensor=8', "
                                f"got {part!r}")
            name, _, size = part.partition("=")
            try:
                items.append((name.strip(), int(size)))
            except ValueError:
                raise MeshError(f"mesh spec {spec!r}: size of axis {name.strip()!r} is not an integer: "
                                f"{size!r}") from None
    else:
        raise MeshError(f"mesh must be a spec string like 'data=2,tensor=4', a dict or a Mesh, got "
                        f"{type(spec).__name__}")
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for name, size in items:
        if name not in AXES:
            raise MeshError(f"mesh spec {spec!r}: unknown axis {name!r}; the axes are {', '.join(AXES)}")
        if name in seen:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if size != -1 and size < 1:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} must be >= 1 (or -1), got {size}")
        seen.add(name)
        sizes[name] = size
    if sum(s == -1 for s in sizes.values()) > 1:
        raise MeshError(f"mesh spec {spec!r}: at most one axis may be -1")
    return sizes


def resolve_sizes(spec: str | Mapping[str, int], n_devices: int) -> dict[str, int]:
    """Parse `spec` and check it uses exactly `n_devices` devices (filling a -1 axis)."""
    sizes = parse_mesh_spec(spec)
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        free = next(a for a, s in sizes.items() if s == -1)
        if n_devices % known:
            raise MeshError(f"mesh spec {spec!r}: {n_devices} devices are not divisible by the other "
                            f"axes' product {known}, so axis {free!r} cannot be filled")
        sizes[free] = n_devices // known
    used = math.prod(sizes.values())
    if used != n_devices:
        raise MeshError(f"mesh spec {spec!r} needs {used} devices ({_fmt(sizes)}) but {n_devices} are "
                        f"available; make the axis sizes multiply to {n_devices} (or pass devices=)")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | Mesh, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with axes ("data", "expert", "tensor") from a spec, over `devices` (default: all)."""
    if isinstance(spec, Mesh):
        check_mesh_axes(spec)
        return spec
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_sizes(spec, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices)


def check_mesh_axes(mesh: Any) -> None:
    names = tuple(getattr(mesh, "axis_names", ()))
    if set(names) != set(AXES):
        raise MeshError(f"mesh axes must be exactly {AXES}, got {names}; build it with "
                        f"dsv3_jax.parallel.sharding.make_mesh('data=..,tensor=..,expert=..')")


def axis_sizes(mesh: Any) -> dict[str, int]:
    """{"data": .., "expert": .., "tensor": ..} of a Mesh / AbstractMesh (1 for absent axes)."""
    shape = dict(mesh.shape) if mesh is not None and not getattr(mesh, "empty", False) else {}
    return {a: int(shape.get(a, 1)) for a in AXES}


def _fmt(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in ("data", "tensor", "expert"))


def describe(mesh: Any) -> str:
    return _fmt(axis_sizes(mesh))


def mesh_size(rule: MeshAxes, sizes: Mapping[str, int]) -> int:
    if rule is None:
        return 1
    return math.prod(sizes[a] for a in ((rule,) if isinstance(rule, str) else rule))


def batch_multiple(mesh: Any) -> int:
    """Batches must be a multiple of this (the number of batch shards: data x expert)."""
    return mesh_size(LOGICAL_RULES["batch"], axis_sizes(mesh))


def validate(cfg: ModelConfig, mesh_or_sizes: Any, *, fp8: bool = False) -> None:
    """Raise MeshError if an axis does not divide what it splits (heads, experts, vocab, FFN widths)."""
    s = mesh_or_sizes if isinstance(mesh_or_sizes, Mapping) else axis_sizes(mesh_or_sizes)
    t, e = s["tensor"], s["expert"]
    checks = [
        ("tensor", t, "num_attention_heads", cfg.num_attention_heads),
        ("tensor", t, "vocab_size", cfg.vocab_size),
        ("tensor", t, "intermediate_size", cfg.intermediate_size),
        ("tensor", t, "moe_intermediate_size", cfg.moe_intermediate_size),
        ("tensor", t, "moe_intermediate_size * n_shared_experts",
         cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1)),
        ("expert", e, "n_routed_experts", cfg.n_routed_experts),
    ]
    for axis, size, field, value in checks:
        if value % size:
            raise MeshError(f"mesh axis {axis}={size} does not divide {field}={value} "
                            f"(mesh {_fmt(s)}); pick a {axis} size that divides {value}")
    if fp8 and t > 1:
        # Each device dequantizes its own slice: slices must hold whole 128-wide scale blocks.
        for field, value in (("moe_intermediate_size", cfg.moe_intermediate_size),
                             ("intermediate_size", cfg.intermediate_size),
                             ("num_attention_heads * qk_head_dim", cfg.num_attention_heads * cfg.qk_head_dim),
                             ("num_attention_heads * v_head_dim", cfg.num_attention_heads * cfg.v_head_dim)):
            if (value // t) % 128:
                raise MeshError(f"FP8 weights: tensor={t} splits {field}={value} into slices of "
                                f"{value // t}, not a multiple of the 128-wide scale blocks")


# ------------------------------------------------------------------------------------ specs from axes
def logical_to_spec(axes: Sequence[str | None]) -> P:
    """Logical axes -> PartitionSpec through LOGICAL_RULES; a mesh axis may be used only once."""
    spec, used = [], []
    for a in axes:
        if a is not None and a not in LOGICAL_RULES:
            raise KeyError(f"logical axis {a!r} has no entry in LOGICAL_RULES")
        rule = None if a is None else LOGICAL_RULES[a]
        flat = () if rule is None else ((rule,) if isinstance(rule, str) else tuple(rule))
        if any(m in used for m in flat):
            raise ValueError(f"logical axes {tuple(axes)} use mesh axis {flat} twice")
        used.extend(flat)
        spec.append(rule)
    return P(*spec)


def _leaf_specs(tree: Any, axes_of) -> Any:
    """PartitionSpecs of a tree: an ArrayInfo leaf by its declared logical axes, any other leaf (array,
    ShapeDtypeStruct) by `axes_of('/'-joined path, ndim)`, the layout's lookup by leaf name."""
    def spec(path, x):
        axes = x.logical_axes if layout.is_info(x) else axes_of(layout.path_str(path), len(x.shape))
        return logical_to_spec(axes)

    return jax.tree_util.tree_map_with_path(spec, tree, is_leaf=layout.is_info)


def param_specs(params_or_shapes: Any) -> Any:
    """Tree of PartitionSpecs matching a parameter tree (arrays, ShapeDtypeStructs or the layout)."""
    return _leaf_specs(params_or_shapes, layout.param_axes)


def param_sharding(mesh: Mesh, path: str, ndim: int) -> NamedSharding:
    """The NamedSharding of the parameter at '/'-joined `path` with `ndim` dimensions (by its name)."""
    return NamedSharding(mesh, logical_to_spec(layout.param_axes(path, ndim)))


def param_shardings(cfg: ModelConfig, mesh: Mesh, params_or_shapes: Any) -> Any:
    """Tree of NamedShardings for a parameter tree, after checking that `mesh` divides `cfg`."""
    fp8 = any(getattr(x, "dtype", None) == jax.numpy.float8_e4m3fn
              for x in jax.tree_util.tree_leaves(params_or_shapes, is_leaf=layout.is_info))
    validate(cfg, mesh, fp8=fp8)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params_or_shapes))


def cache_specs(cache_or_shapes: Any) -> Any:
    """Tree of PartitionSpecs matching a cache tree (arrays, ShapeDtypeStructs or the layout)."""
    return _leaf_specs(cache_or_shapes, layout.cache_axes)


def cache_shardings(cfg: ModelConfig, mesh: Mesh, cache_or_shapes: Any) -> Any:
    """Tree of NamedShardings for a cache tree (layout.cache_layout): pages over data x expert."""
    validate(cfg, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cache_or_shapes))


def place_cache(handle: Any, cache: dict) -> dict:
    """Put a page pool on a handle's mesh: pages split over the batch axes where they divide,
    replicated otherwise (correct either way; the split only saves memory). No mesh: unchanged."""
    if handle.mesh is None:
        return cache
    try:
        return jax.device_put(cache, cache_shardings(handle.config, handle.mesh, cache))
    except (ValueError, MeshError):
        return jax.device_put(cache, NamedSharding(handle.mesh, P()))


def activation_sharding(mesh: Mesh, name: str) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(ACTIVATION_AXES[name]))


def shard_shape(shape: Sequence[int], spec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Per-device shape of an array of `shape` under `spec` on a mesh with axis `sizes` (no devices)."""
    out = []
    for i, n in enumerate(shape):
        rule = spec[i] if i < len(spec) else None
        k = mesh_size(rule, sizes)
        if n % k:
            raise MeshError(f"dimension {i} of size {n} is not divisible by {rule}={k}")
        out.append(n // k)
    return tuple(out)


def constrain(x: jax.Array, name: str) -> jax.Array:
    """with_sharding_constraint to ACTIVATION_AXES[name] under `jax.set_mesh`; a no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(axis_sizes(mesh).values()) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(ACTIVATION_AXES[name]))
