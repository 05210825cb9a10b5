"""Every parameter and cache array declared once: shape, dtype and logical axes (`ArrayInfo`).

Owns: the names of the trees' leaves (one constant per name: the scanned stacks `DENSE_LAYERS` /
`MOE_LAYERS`, the `MTP` subtree, the cache leaves `PAGES`, `K_PAGES`, `V_PAGES` and the FP8 cache's
`FP8_LATENT`, `FP8_SCALE`, `FP8_ROPE`), the logical-axis
vocabulary (`LOGICAL_AXES`), the logical axes of every parameter and cache leaf by name
(`PARAM_AXES`, `CACHE_AXES`, looked up through `param_axes` / `cache_axes`), and the two declarations:
- `param_layout(cfg, dtype, include_mtp, fp8=...)`: the parameter tree of ArrayInfo, leaf for leaf the
  tree the Flax `Transformer` initializes (same names, shapes, dtypes: FP8 linears with their fp32
  block scales, the fp32 router bias; scanned stacks carry the layer axis first);
- `cache_layout(cfg, num_pages, page_size, form, dtype, mtp)`: the paged KV cache tree of ArrayInfo.
  Absorbed form: `pages [L, P, page_size, kv_lora_rank + rope]` (576 values per token per layer for
  V3); naive form: `k_pages [L, P, page_size, H, 192]`, `v_pages [L, P, page_size, H, 128]`; one
  subtree per scanned stack plus the MTP layer's (no layer axis). The cache dtype may be "fp8"
  (`kv_cache_dtype` resolves `--kv-cache-dtype`): absorbed form as three typed leaves in the format
  pallas_kernels/mla_common.py owns (shared with the kernels): `fp8_latent [L, P, page_size, 512]`
  float8_e4m3fn, `fp8_scale [L, P, 4, page_size]` float32 (block-major per page), `fp8_rope
  [L, P, page_size, 64]` bfloat16: 656 bytes per token per layer.
Everything else derives from these: `kv_cache.allocate` (zeros of the cache layout), `bytes_per_token`,
parallel/sharding.py's shardings (logical axes -> mesh axes through its one rules table), and plan.py's
bytes per device. Must not allocate arrays, know meshes, or hold model math.

In the spirit of jax-llm-examples' `deepseek_r1_jax` (ArrayInfo: shape, dtype, logical axes); here the
Flax modules still create the parameters, and a test holds the two trees equal.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dsv3_jax.config import ModelConfig

# ------------------------------------------------------------------------------------- leaf names
DENSE_LAYERS = "dense_layers"  # the scanned stack of the first `first_k_dense_replace` layers
MOE_LAYERS = "moe_layers"  # the scanned stack of the MoE layers
STACKS = (DENSE_LAYERS, MOE_LAYERS)  # subtrees whose leaves carry the layer axis first
MTP = "mtp"  # the multi-token-prediction module (parameters and its own cache)
ATTENTION = "self_attn"  # every block's attention subtree (the stacks' and the MTP block's)
PAGES = "pages"  # absorbed cache: [c ; k_rope] per token
K_PAGES = "k_pages"  # naive cache: per-head K
V_PAGES = "v_pages"  # naive cache: per-head V
FORMS = ("absorbed", "naive")
FP8_LATENT = "fp8_latent"  # FP8 absorbed cache: latent c in e4m3, [P, page_size, kv_lora_rank]
FP8_SCALE = "fp8_scale"  # its fp32 scales, one per 128 latent values, block-major per page [P, nb, page_size]
FP8_ROPE = "fp8_rope"  # its k_rope in bf16, [P, page_size, rope]
CACHE_LEAVES = {"absorbed": (PAGES,), "naive": (K_PAGES, V_PAGES)}
FP8_LEAVES = (FP8_LATENT, FP8_SCALE, FP8_ROPE)  # the absorbed form's leaves with kv_cache_dtype "fp8"

# ------------------------------------------------------------------------------ logical axes
# The one vocabulary of logical axes; parallel/sharding.LOGICAL_RULES maps each to mesh axes.
LOGICAL_AXES = (
    "batch",  # sequences (activations)
    "seq",  # positions within a sequence (activations)
    "cache_pages",  # a paged pool's page axis
    "page_slot",  # a token's slot within its page
    "layers",  # the nn.scan stacking axis
    "embed",  # hidden size D
    "vocab",  # vocabulary of the embedding and the LM heads
    "heads",  # head-major flattened q_b / kv_b outputs, o_proj input, naive-cache heads
    "head_dim",  # one head's K or V width (naive cache)
    "q_lora",  # q_lora_rank
    "kv_latent",  # kv_lora_rank (+ rope): the absorbed cache's 576 values
    "qkv_a",  # the fused q_a / kv_a output rows (qkv_a.py): q_lora_rank + kv_latent (+ padding)
    "mlp",  # dense MLP width
    "shared_mlp",  # shared-expert width
    "experts",  # routed experts
    "expert_mlp",  # a routed expert's FFN width
    "router",  # router rows (E) and correction bias
    "norm",  # RMSNorm weights
    "concat_embed",  # MTP eh_proj input [embed ; hidden]
)

# Parameter name (a suffix of its '/'-joined path) -> logical axes, *without* the scan axis (added for
# leaves under the STACKS). Linear weights are [out, in]; FP8 scales ("<x>/scale", "<x>_scale") share
# their weight's axes (one scale per 128x128 block); every RMSNorm weight is "norm/weight".
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed_tokens/embedding": ("vocab", "embed"),
    "lm_head/weight": ("vocab", "embed"),
    "shared_head_head/weight": ("vocab", "embed"),
    "norm/weight": ("norm",),  # every RMSNorm: norm, *_layernorm, enorm, hnorm, shared_head_norm
    "self_attn/q_proj/weight": ("heads", "embed"),
    "self_attn/q_a_proj/weight": ("q_lora", "embed"),
    "self_attn/q_b_proj/weight": ("heads", "q_lora"),
    "self_attn/kv_a_proj_with_mqa/weight": ("kv_latent", "embed"),
    "self_attn/qkv_a_proj/weight": ("qkv_a", "embed"),  # q_a and kv_a fused at load (qkv_a.py)
    "self_attn/kv_b_proj/weight": ("heads", "kv_latent"),
    "self_attn/w_uk": ("heads", "kv_latent", "head_dim"),  # kv_b's inference form (kv_b.py)
    "self_attn/w_uv": ("heads", "head_dim", "kv_latent"),
    "self_attn/o_proj/weight": ("embed", "heads"),
    "mlp/gate_proj/weight": ("mlp", "embed"),
    "mlp/up_proj/weight": ("mlp", "embed"),
    "mlp/down_proj/weight": ("embed", "mlp"),
    "shared_experts/gate_proj/weight": ("shared_mlp", "embed"),
    "shared_experts/up_proj/weight": ("shared_mlp", "embed"),
    "shared_experts/down_proj/weight": ("embed", "shared_mlp"),
    "mlp/gate_weight": ("router", "embed"),
    "mlp/e_score_correction_bias": ("router",),
    "mlp/gate_proj_weight": ("experts", "expert_mlp", "embed"),
    "mlp/up_proj_weight": ("experts", "expert_mlp", "embed"),
    "mlp/down_proj_weight": ("experts", "embed", "expert_mlp"),
    "eh_proj/weight": ("embed", "concat_embed"),
}

# Cache leaf name -> logical axes of a paged pool [P, page_size, ...], without the scan axis. A pool is
# split by pages over the batch axes: the engine gives a sequence of batch shard s pages from shard s's
# slice [s*P/n, (s+1)*P/n), so attention stays local (parallel/dp_attention.py).
CACHE_AXES: dict[str, tuple[str, ...]] = {
    PAGES: ("cache_pages", "page_slot", "kv_latent"),
    K_PAGES: ("cache_pages", "page_slot", "heads", "head_dim"),
    V_PAGES: ("cache_pages", "page_slot", "heads", "head_dim"),
    # The FP8 leaves split pages like PAGES; the scale's block axis is the latent axis in blocks of 128.
    FP8_LATENT: ("cache_pages", "page_slot", "kv_latent"),
    FP8_SCALE: ("cache_pages", "kv_latent", "page_slot"),
    FP8_ROPE: ("cache_pages", "page_slot", "kv_latent"),
}


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """One array as declared: its shape, dtype and one logical axis name per dimension."""

    shape: tuple[int, ...]
    dtype: Any
    logical_axes: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "logical_axes", tuple(self.logical_axes))
        if len(self.logical_axes) != len(self.shape):
            raise ValueError(f"ArrayInfo: shape {self.shape} has {len(self.shape)} dims but "
                             f"{len(self.logical_axes)} logical axes {self.logical_axes}")
        unknown = [a for a in self.logical_axes if a not in LOGICAL_AXES]
        if unknown:
            raise ValueError(f"ArrayInfo: logical axes {unknown} are not in layout.LOGICAL_AXES")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def struct(self, sharding: Any = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)


def is_info(x: Any) -> bool:
    return isinstance(x, ArrayInfo)


def structs(tree: Any, shardings: Any = None) -> Any:
    """A tree of ArrayInfo as ShapeDtypeStructs (with the matching tree of shardings, if given)."""
    if shardings is None:
        return jax.tree.map(lambda i: i.struct(), tree, is_leaf=is_info)
    return jax.tree.map(lambda i, s: i.struct(s), tree, shardings, is_leaf=is_info)


def tree_nbytes(tree: Any) -> int:
    """Bytes of a tree of ArrayInfo, ShapeDtypeStruct or array leaves."""
    leaves = jax.tree.leaves(tree, is_leaf=is_info)
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)


# --------------------------------------------------------------------------- lookup by leaf name
def path_str(path: Sequence[Any]) -> str:
    """A jax key path (or a tuple of names) as 'a/b/c'."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def replace_in_attention(tree: Any, names: tuple[str, ...],
                         convert: Callable[[str, dict[str, Any]], dict[str, Any]], path: str = "") -> Any:
    """`tree` with, in every self_attn dict holding all of `names` (the stacks' and the MTP block's),
    those entries replaced by the items of `convert('/'-joined path of that dict, {name: entry})`; every
    other leaf is the same object. How the inference form (inference_form.py) rewrites attention."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for name, sub in tree.items():
        sub_path = f"{path}/{name}" if path else name
        if name == ATTENTION and isinstance(sub, dict) and all(n in sub for n in names):
            rest = {k: v for k, v in sub.items() if k not in names}
            out[name] = {**rest, **convert(sub_path, {n: sub[n] for n in names})}
        else:
            out[name] = replace_in_attention(sub, names, convert, sub_path)
    return out


def param_axes(path: str, ndim: int) -> tuple[str, ...]:
    """Logical axes of the parameter at '/'-joined `path` with `ndim` dimensions (PARAM_AXES by the
    longest matching suffix; the layer axis first under the STACKS)."""
    parts = path.split("/")
    name = path
    if name.endswith("/scale"):
        name = name[: -len("scale")] + "weight"
    elif name.endswith("_scale"):
        name = name[: -len("_scale")] + "_weight"
    if parts[-2:-1] and parts[-2].endswith("norm") and parts[-1] == "weight":
        name = "norm/weight"
    best = max((k for k in PARAM_AXES if name == k or name.endswith("/" + k)), key=len, default=None)
    if best is None:
        raise KeyError(f"parameter {path!r} has no entry in layout.PARAM_AXES")
    axes = (("layers",) if parts[0] in STACKS else ()) + PARAM_AXES[best]
    if len(axes) != ndim:
        raise ValueError(f"parameter {path!r}: {ndim} dims but layout.PARAM_AXES[{best!r}] names {len(axes)}")
    return axes


def cache_axes(path: str, ndim: int) -> tuple[str, ...]:
    """Logical axes of the cache leaf at '/'-joined `path` with `ndim` dimensions."""
    parts = path.split("/")
    if parts[-1] not in CACHE_AXES:
        raise KeyError(f"cache leaf {path!r} has no entry in layout.CACHE_AXES")
    axes = (("layers",) if parts[0] in STACKS else ()) + CACHE_AXES[parts[-1]]
    if len(axes) != ndim:
        raise ValueError(f"cache leaf {path!r}: {ndim} dims, layout.CACHE_AXES names {len(axes)}")
    return axes


# ------------------------------------------------------------------------------------ parameters
def _blocks(n: int) -> int:
    return -(-n // 128)


def param_layout(cfg: ModelConfig, dtype: Any = jnp.bfloat16, include_mtp: bool = True, *,
                 fp8: bool = False) -> dict[str, Any]:
    """The parameter tree of ArrayInfo for `Transformer(cfg, dtype, fp8)`.

    `dtype`: the parameters' dtype (the model's `param_dtype`). `fp8`: every linear of attention, the
    dense MLPs, the experts and the MTP `eh_proj` is float8_e4m3fn with an fp32 `scale` per 128x128
    block (the LM heads, embeddings, norms and router keep `dtype`); the router's correction bias is
    always fp32. `include_mtp`: the MTP module's subtree, when the config has one.
    """
    c = cfg
    dtype = jnp.dtype(dtype)
    d, h = c.hidden_size, c.num_attention_heads

    def linear(in_dim: int, out_dim: int, quantized: bool = fp8) -> dict:
        if quantized:
            return {"weight": ((out_dim, in_dim), jnp.float8_e4m3fn),
                    "scale": ((_blocks(out_dim), _blocks(in_dim)), jnp.float32)}
        return {"weight": ((out_dim, in_dim), dtype)}

    def norm(dim: int) -> dict:
        return {"weight": ((dim,), dtype)}

    def mlp(hidden: int) -> dict:
        return {"gate_proj": linear(d, hidden), "up_proj": linear(d, hidden), "down_proj": linear(hidden, d)}

    def attention() -> dict:
        a: dict[str, Any] = {}
        if c.q_lora_rank is None:
            a["q_proj"] = linear(d, h * c.qk_head_dim)
        else:
            a["q_a_proj"] = linear(d, c.q_lora_rank)
            a["q_a_layernorm"] = norm(c.q_lora_rank)
            a["q_b_proj"] = linear(c.q_lora_rank, h * c.qk_head_dim)
        a["kv_a_proj_with_mqa"] = linear(d, c.latent_dim)
        a["kv_a_layernorm"] = norm(c.kv_lora_rank)
        a["kv_b_proj"] = linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim))
        a["o_proj"] = linear(h * c.v_head_dim, d)
        return a

    def moe() -> dict:
        e, i = c.n_routed_experts, c.moe_intermediate_size
        m: dict[str, Any] = {"gate_weight": ((e, d), dtype), "e_score_correction_bias": ((e,), jnp.float32)}
        for name, (out_dim, in_dim) in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
            if fp8:
                m[f"{name}_weight"] = ((e, out_dim, in_dim), jnp.float8_e4m3fn)
                m[f"{name}_scale"] = ((e, _blocks(out_dim), _blocks(in_dim)), jnp.float32)
            else:
                m[f"{name}_weight"] = ((e, out_dim, in_dim), dtype)
        if c.n_shared_experts:
            m["shared_experts"] = mlp(i * c.n_shared_experts)
        return m

    def block(is_moe: bool) -> dict:
        return {"input_layernorm": norm(d), "post_attention_layernorm": norm(d), "self_attn": attention(),
                "mlp": moe() if is_moe else mlp(c.intermediate_size)}

    def stacked(tree: dict, layers: int) -> dict:
        return jax.tree.map(lambda sd: ((layers, *sd[0]), sd[1]), tree, is_leaf=_is_decl)

    tree: dict[str, Any] = {"embed_tokens": {"embedding": ((c.vocab_size, d), dtype)}}
    if c.n_dense_layers:
        tree[DENSE_LAYERS] = stacked(block(False), c.n_dense_layers)
    if c.n_moe_layers:
        tree[MOE_LAYERS] = stacked(block(True), c.n_moe_layers)
    tree["norm"] = norm(d)
    tree["lm_head"] = linear(d, c.vocab_size, quantized=False)
    if include_mtp and c.num_nextn_predict_layers:
        tree[MTP] = {"embed_tokens": {"embedding": ((c.vocab_size, d), dtype)}, "enorm": norm(d),
                     "hnorm": norm(d), "eh_proj": linear(2 * d, d), "block": block(True),
                     "shared_head_norm": norm(d),
                     "shared_head_head": linear(d, c.vocab_size, quantized=False)}
    return jax.tree_util.tree_map_with_path(
        lambda p, sd: ArrayInfo(sd[0], sd[1], param_axes(path_str(p), len(sd[0]))), tree, is_leaf=_is_decl)


def _is_decl(x: Any) -> bool:
    """A (shape, dtype) declaration: the leaves `param_layout` builds before naming their axes."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


# ----------------------------------------------------------------------------------------- cache
def token_shapes(cfg: ModelConfig, form: str = "absorbed") -> dict[str, tuple[int, ...]]:
    """Per-token, per-layer shape of each cache leaf of `form`."""
    if form == "absorbed":
        return {PAGES: (cfg.latent_dim,)}
    if form == "naive":
        h = cfg.num_attention_heads
        return {K_PAGES: (h, cfg.qk_head_dim), V_PAGES: (h, cfg.v_head_dim)}
    raise ValueError(f"cache form must be one of {FORMS}, got {form!r}")


KV_CACHE_DTYPES = ("auto", "bf16", "fp8")  # EngineConfig.kv_cache_dtype / --kv-cache-dtype (vLLM's names)
# Other names vLLM users type for the same caches (vLLM's fp8 on CUDA is e4m3), and dtype spellings.
KV_CACHE_DTYPE_ALIASES = {"bfloat16": "bf16", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8"}
FP8 = "fp8"  # the FP8 latent cache: `FP8_LEAVES` (pallas_kernels.mla_common's format)


def canonical_kv_cache_dtype(name: str) -> str:
    """`name` as one of `KV_CACHE_DTYPES` (aliases mapped); ValueError naming the value otherwise."""
    if isinstance(name, str) and name in KV_CACHE_DTYPES:
        return name
    if isinstance(name, str) and name in KV_CACHE_DTYPE_ALIASES:
        return KV_CACHE_DTYPE_ALIASES[name]
    why = " (the FP8 cache stores e4m3: use fp8)" if isinstance(name, str) and "e5m2" in name else ""
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or "
                     f"{', '.join(KV_CACHE_DTYPE_ALIASES)}), got {name!r}{why}")


def kv_cache_dtype(cfg: ModelConfig, name: str | None) -> Any:
    """The cache dtype that `--kv-cache-dtype` / `EngineConfig.kv_cache_dtype` `name` means for `cfg`:
    "auto" (or None) the model's compute dtype, "bf16" bfloat16, "fp8" the FP8 latent format (`FP8`,
    which `cache_layout` takes as its dtype). ValueError naming the value otherwise."""
    name = canonical_kv_cache_dtype("auto" if name is None else name)
    if name == "auto":
        return jnp.dtype(cfg.dtype)
    return FP8 if name == FP8 else jnp.dtype(jnp.bfloat16)


def is_fp8(dtype: Any) -> bool:
    """Whether a cache dtype (as `cache_layout` takes it) is the FP8 latent format."""
    return isinstance(dtype, str) and dtype == FP8


def cache_layout(cfg: ModelConfig, num_pages: int, page_size: int, form: str = "absorbed", dtype: Any = None,
                 mtp: bool = False) -> dict[str, Any]:
    """The paged cache tree of ArrayInfo: `num_pages` pages of `page_size` tokens for every layer, in
    `dtype` (default: the config's compute dtype); the MTP layer's own pool when `mtp` and the config
    has one. `dtype` "fp8" (`FP8`): the FP8 latent cache, absorbed form only, three leaves (`FP8_LEAVES`):
    latent e4m3 `[.., page_size, kv_lora_rank]`, fp32 scales per 128 latent values block-major per page
    `[.., ceil(kv_lora_rank / 128), page_size]`, rope bf16 `[.., page_size, rope]` (656 bytes per token for
    V3 vs 1,152 in bf16; `mla_common.Fp8Pages`)."""
    if is_fp8(dtype):
        if form != "absorbed":
            raise ValueError("kv_cache_dtype 'fp8' needs attention='absorbed': the naive form caches "
                             "per-head K/V, the FP8 cache is the absorbed form's latent")
        from pallas_kernels.mla_common import fp8_blocks

        lat = cfg.kv_lora_rank
        # leaf -> (shape after the page axis, dtype)
        leaves = {FP8_LATENT: ((page_size, lat), jnp.dtype(jnp.float8_e4m3fn)),
                  FP8_SCALE: ((fp8_blocks(lat), page_size), jnp.dtype(jnp.float32)),
                  FP8_ROPE: ((page_size, cfg.qk_rope_head_dim), jnp.dtype(jnp.bfloat16))}
    else:
        dt = jnp.dtype(dtype or cfg.dtype)
        leaves = {name: ((page_size, *shape), dt) for name, shape in token_shapes(cfg, form).items()}

    def pool(layers: tuple[int, ...]) -> dict[str, ArrayInfo]:
        lead = ("layers",) if layers else ()
        return {name: ArrayInfo((*layers, num_pages, *shape), dt, lead + CACHE_AXES[name])
                for name, (shape, dt) in leaves.items()}

    cache: dict[str, Any] = {}
    if cfg.n_dense_layers:
        cache[DENSE_LAYERS] = pool((cfg.n_dense_layers,))
    if cfg.n_moe_layers:
        cache[MOE_LAYERS] = pool((cfg.n_moe_layers,))
    if mtp and cfg.num_nextn_predict_layers:
        cache[MTP] = pool(())
    return cache


def bytes_per_token(cfg: ModelConfig, form: str = "absorbed", dtype: Any = None, mtp: bool = False) -> int:
    """Cache bytes one token costs over all layers (absorbed V3, bf16: 576 x 2 x 61 = 70,272; fp8:
    656 x 61 = 40,016): the cache layout of one one-token page."""
    return tree_nbytes(cache_layout(cfg, 1, 1, form, dtype, mtp))

