"""The mapping between HF DeepSeek-V3 tensor names and dsv3_jax's parameter tree.

Owns: which HF tensor lands where in the tree (and at which stacking index: layer within its scanned
stack, expert within the layer), the expected name/shape/dtype of every HF tensor for a config, and
assembling the tree from any name -> array source. Used by the converter, `dsv3_jax.load` on HF
directories, and the tests. Must not read files itself.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dsv3_jax.config import ModelConfig
from dsv3_jax.model.layout import DENSE_LAYERS, MOE_LAYERS, MTP

Path = tuple[str, ...]

# Within one decoder layer: HF suffix -> tree path (relative to the layer).
_LINEARS_ATTN = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_NORMS_ATTN = ("q_a_layernorm", "kv_a_layernorm")
_MLP = ("gate_proj", "up_proj", "down_proj")
# Tensors an FP8 checkpoint stores as e4m3 with a weight_scale_inv: every linear of attention, dense
# MLPs and experts. Embeddings, norms, the router and the heads stay in bf16 (the official layout).
_MTP_OWN = {"embed_tokens.weight": ("embed_tokens", "embedding"), "enorm.weight": ("enorm", "weight"),
            "hnorm.weight": ("hnorm", "weight"), "eh_proj.weight": ("eh_proj", "weight"),
            "eh_proj.weight_scale_inv": ("eh_proj", "scale"),
            "shared_head.norm.weight": ("shared_head_norm", "weight"),
            "shared_head.head.weight": ("shared_head_head", "weight")}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: `path` in the tree, at `index` (layer, [expert]) of the stacked leaf."""

    path: Path
    index: tuple[int, ...]


def _layer_suffix(suffix: str, is_moe: bool) -> tuple[Path, tuple[int, ...]] | None:
    """Map a per-layer suffix (after `model.layers.{i}.`) to (path within layer, extra index)."""
    if suffix in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return (suffix.split(".")[0], "weight"), ()
    m = re.fullmatch(r"self_attn\.(\w+)\.(weight|weight_scale_inv)", suffix)
    if m and (m[1] in _LINEARS_ATTN or (m[1] in _NORMS_ATTN and m[2] == "weight")):
        return ("self_attn", m[1], "scale" if m[2] == "weight_scale_inv" else "weight"), ()
    if not is_moe:
        m = re.fullmatch(r"mlp\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)", suffix)
        if m:
            return ("mlp", m[1], "scale" if m[2] == "weight_scale_inv" else "weight"), ()
        return None
    if suffix == "mlp.gate.weight":
        return ("mlp", "gate_weight"), ()
    if suffix == "mlp.gate.e_score_correction_bias":
        return ("mlp", "e_score_correction_bias"), ()
    m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)", suffix)
    if m:
        kind = "scale" if m[3] == "weight_scale_inv" else "weight"
        return ("mlp", f"{m[2]}_{kind}"), (int(m[1]),)
    m = re.fullmatch(r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)", suffix)
    if m:
        return ("mlp", "shared_experts", m[1], "scale" if m[2] == "weight_scale_inv" else "weight"), ()
    return None


def hf_target(name: str, cfg: ModelConfig) -> Target | None:
    """The tree target of HF tensor `name`, or None if dsv3_jax has no place for it."""
    if name == "model.embed_tokens.weight":
        return Target(("embed_tokens", "embedding"), ())
    if name == "model.norm.weight":
        return Target(("norm", "weight"), ())
    if name == "lm_head.weight":
        return Target(("lm_head", "weight"), ())
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m:
        return None
    i, suffix = int(m[1]), m[2]
    nd, nl = cfg.n_dense_layers, cfg.num_hidden_layers
    if i >= nl:  # the MTP module
        if i != nl or cfg.num_nextn_predict_layers < 1:
            return None
        if suffix in _MTP_OWN:
            return Target((MTP, *_MTP_OWN[suffix]), ())
        r = _layer_suffix(suffix, True)
        return None if r is None else Target((MTP, "block", *r[0]), r[1])
    is_moe = i >= nd
    r = _layer_suffix(suffix, is_moe)
    if r is None:
        return None
    stack = MOE_LAYERS if is_moe else DENSE_LAYERS
    return Target((stack, *r[0]), (i - nd if is_moe else i, *r[1]))


def _quantized(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-s // 128) for s in shape)


def expected_hf_tensors(cfg: ModelConfig, *, fp8: bool = False, include_mtp: bool = True
                        ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every HF tensor name a checkpoint of `cfg` holds -> (shape, dtype string as safetensors says).

    `fp8`: the official layout (linears F8_E4M3 + F32 `weight_scale_inv` per 128x128 block).
    """
    c = cfg
    d, h = c.hidden_size, c.num_attention_heads
    fdt = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}[c.dtype]
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def lin(name: str, shape: tuple[int, int]) -> None:
        if fp8:
            out[f"{name}.weight"] = (shape, "F8_E4M3")
            out[f"{name}.weight_scale_inv"] = (_quantized(shape), "F32")
        else:
            out[f"{name}.weight"] = (shape, fdt)

    def layer(p: str, is_moe: bool) -> None:
        out[f"{p}.input_layernorm.weight"] = ((d,), fdt)
        out[f"{p}.post_attention_layernorm.weight"] = ((d,), fdt)
        a = f"{p}.self_attn"
        if c.q_lora_rank is None:
            lin(f"{a}.q_proj", (h * c.qk_head_dim, d))
        else:
            lin(f"{a}.q_a_proj", (c.q_lora_rank, d))
            out[f"{a}.q_a_layernorm.weight"] = ((c.q_lora_rank,), fdt)
            lin(f"{a}.q_b_proj", (h * c.qk_head_dim, c.q_lora_rank))
        lin(f"{a}.kv_a_proj_with_mqa", (c.latent_dim, d))
        out[f"{a}.kv_a_layernorm.weight"] = ((c.kv_lora_rank,), fdt)
        lin(f"{a}.kv_b_proj", (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
        lin(f"{a}.o_proj", (d, h * c.v_head_dim))
        if not is_moe:
            i = c.intermediate_size
            lin(f"{p}.mlp.gate_proj", (i, d))
            lin(f"{p}.mlp.up_proj", (i, d))
            lin(f"{p}.mlp.down_proj", (d, i))
            return
        i = c.moe_intermediate_size
        out[f"{p}.mlp.gate.weight"] = ((c.n_routed_experts, d), fdt)
        out[f"{p}.mlp.gate.e_score_correction_bias"] = ((c.n_routed_experts,), "F32")
        for e in range(c.n_routed_experts):
            lin(f"{p}.mlp.experts.{e}.gate_proj", (i, d))
            lin(f"{p}.mlp.experts.{e}.up_proj", (i, d))
            lin(f"{p}.mlp.experts.{e}.down_proj", (d, i))
        if c.n_shared_experts:
            si = i * c.n_shared_experts
            lin(f"{p}.mlp.shared_experts.gate_proj", (si, d))
            lin(f"{p}.mlp.shared_experts.up_proj", (si, d))
            lin(f"{p}.mlp.shared_experts.down_proj", (d, si))

    out["model.embed_tokens.weight"] = ((c.vocab_size, d), fdt)
    for i in range(c.num_hidden_layers):
        layer(f"model.layers.{i}", i >= c.n_dense_layers)
    out["model.norm.weight"] = ((d,), fdt)
    out["lm_head.weight"] = ((c.vocab_size, d), fdt)
    if include_mtp and c.num_nextn_predict_layers:
        p = f"model.layers.{c.num_hidden_layers}"
        layer(p, True)
        out[f"{p}.embed_tokens.weight"] = ((c.vocab_size, d), fdt)
        out[f"{p}.enorm.weight"] = ((d,), fdt)
        out[f"{p}.hnorm.weight"] = ((d,), fdt)
        if fp8:
            out[f"{p}.eh_proj.weight"] = ((d, 2 * d), "F8_E4M3")
            out[f"{p}.eh_proj.weight_scale_inv"] = (_quantized((d, 2 * d)), "F32")
        else:
            out[f"{p}.eh_proj.weight"] = ((d, 2 * d), fdt)
        out[f"{p}.shared_head.norm.weight"] = ((d,), fdt)
        out[f"{p}.shared_head.head.weight"] = ((c.vocab_size, d), fdt)
    return out


def leaf_groups(cfg: ModelConfig, names: list[str]) -> dict[Path, list[tuple[str, tuple[int, ...]]]]:
    """Group HF names by the tree leaf they fill: path -> [(hf name, index within the leaf)]."""
    groups: dict[Path, list[tuple[str, tuple[int, ...]]]] = {}
    unknown = []
    for n in names:
        t = hf_target(n, cfg)
        if t is None:
            unknown.append(n)
            continue
        groups.setdefault(t.path, []).append((n, t.index))
    if unknown:
        raise KeyError(f"{len(unknown)} tensors have no place in the model: {', '.join(sorted(unknown)[:8])}")
    return groups


def leaf_shape(cfg: ModelConfig, path: Path, entries: list[tuple[str, tuple[int, ...]]],
               tensor_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stacked leaf's shape: stacking dims (layers, experts) in front of one tensor's shape."""
    if path[0] == DENSE_LAYERS:
        lead: tuple[int, ...] = (cfg.n_dense_layers,)
    elif path[0] == MOE_LAYERS:
        lead = (cfg.n_moe_layers,)
    else:
        lead = ()
    if any(len(ix) > len(lead) for _, ix in entries):
        lead = (*lead, cfg.n_routed_experts)
    return (*lead, *tensor_shape)


def iter_leaves(cfg: ModelConfig, names: list[str], get: Callable[[str], np.ndarray]
                ) -> Iterator[tuple[Path, np.ndarray]]:
    """Yield (path, stacked numpy leaf) one leaf at a time (bounded memory: one leaf)."""
    for path, entries in leaf_groups(cfg, names).items():
        first = get(entries[0][0])
        leaf = np.empty(leaf_shape(cfg, path, entries, first.shape), first.dtype)
        for name, ix in entries:
            leaf[ix] = first if name == entries[0][0] else get(name)
        yield path, leaf


def set_path(tree: dict[str, Any], path: Path, value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def assemble(cfg: ModelConfig, names: list[str], get: Callable[[str], np.ndarray]) -> dict[str, Any]:
    """The whole parameter tree (numpy) from HF tensors `names`, read through `get(name)`."""
    tree: dict[str, Any] = {}
    for path, leaf in iter_leaves(cfg, names, get):
        set_path(tree, path, leaf)
    return tree
