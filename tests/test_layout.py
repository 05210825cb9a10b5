"""The declared layouts: `param_layout` is leaf for leaf the tree the Flax model initializes (names, shapes,
dtypes, FP8 scales, the fp32 router bias), `cache_layout` is what `kv_cache.allocate` builds and what the
model writes, bytes per token derive from it, and every declared logical axis has a sharding rule."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from dsv3_jax import plan
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kv_cache, layout
from dsv3_jax.model.kv_cache import PageMeta
from dsv3_jax.model.transformer import Transformer
from dsv3_jax.parallel import sharding
from tests.hf_reference import HF_CONFIGS
from tests.mesh_models import MESH_CONFIGS

TINY = ModelConfig.preset("tiny")
V3 = ModelConfig.preset("deepseek-v3")


def _init_shapes(cfg: ModelConfig, param_dtype, fp8: bool):
    model = Transformer(cfg, param_dtype, fp8)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, method=model.init_all))["params"]


def _flat(tree) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=layout.is_info)
    return {layout.path_str(p): (tuple(x.shape), jnp.dtype(x.dtype)) for p, x in leaves}


def _configs() -> dict[str, ModelConfig]:
    hf = {k: ModelConfig.from_hf_dict({**v, "model_type": "deepseek_v3"})
          for k, v in {**HF_CONFIGS, **MESH_CONFIGS}.items()}
    return {"tiny": TINY, **hf,
            "no_dense_no_shared_no_mtp": TINY.replace(first_k_dense_replace=0, n_shared_experts=0,
                                                      num_nextn_predict_layers=0),
            "all_dense_no_q_lora": TINY.replace(first_k_dense_replace=4, q_lora_rank=None)}


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("param_dtype,fp8", [(jnp.float32, False), (jnp.bfloat16, False),
                                             (jnp.float32, True)])
def test_param_layout_is_the_models_tree(name, param_dtype, fp8):
    cfg = _configs()[name].replace(dtype=jnp.dtype(param_dtype).name)
    declared = layout.param_layout(cfg, param_dtype, fp8=fp8)
    assert _flat(declared) == _flat(_init_shapes(cfg, param_dtype, fp8))
    no_mtp = layout.param_layout(cfg, param_dtype, include_mtp=False, fp8=fp8)
    assert set(no_mtp) == set(declared) - {layout.MTP}


@pytest.mark.parametrize("dtype", plan.DTYPES)
def test_v3_param_layout_is_the_models_tree(dtype):
    """The full-size model (abstract init only): FP8 linears with fp32 block scales, bf16 embeddings,
    norms, router and heads, the fp32 router bias."""
    param_dtype = jnp.float32 if dtype == "fp32" else jnp.bfloat16
    cfg = V3.replace(dtype=jnp.dtype(param_dtype).name)
    declared = plan.param_layout(V3, dtype)
    got = _flat(declared)
    assert got == _flat(_init_shapes(cfg, param_dtype, dtype == "fp8"))
    assert _flat(plan.param_shapes(V3, dtype)) == got
    moe = declared[layout.MOE_LAYERS]["mlp"]
    assert moe["e_score_correction_bias"].dtype == jnp.float32
    if dtype == "fp8":
        assert moe["gate_proj_weight"].dtype == jnp.float8_e4m3fn
        assert moe["gate_proj_scale"].shape == (58, 256, 2048 // 128, 7168 // 128)
        assert moe["gate_proj_scale"].logical_axes == moe["gate_proj_weight"].logical_axes
        assert declared["lm_head"]["weight"].dtype == jnp.bfloat16
    assert sum(i.nbytes for i in jax.tree.leaves(declared, is_leaf=layout.is_info)) == \
        layout.tree_nbytes(declared)


def test_declared_axes_give_the_sharding_tables_specs():
    """The layout's own axes and the by-name lookup (any tree of that layout) give the same specs; the
    rules table covers exactly the one vocabulary of logical axes."""
    assert set(sharding.LOGICAL_RULES) == set(layout.LOGICAL_AXES)
    for fp8 in (False, True):
        declared = layout.param_layout(V3, jnp.bfloat16, fp8=fp8)
        assert sharding.param_specs(declared) == sharding.param_specs(layout.structs(declared))
    specs = sharding.param_specs(layout.param_layout(V3, jnp.bfloat16))
    assert specs[layout.MOE_LAYERS]["mlp"]["down_proj_weight"] == P(None, "expert", None, "tensor")
    assert specs[layout.MOE_LAYERS]["self_attn"]["kv_b_proj"]["weight"] == P(None, "tensor", None)
    assert specs[layout.MTP]["eh_proj"]["weight"] == P(None, None)
    assert specs["embed_tokens"]["embedding"] == P("tensor", None)
    cache = layout.cache_layout(V3, 16, 64, "naive", mtp=True)
    assert sharding.cache_specs(cache) == sharding.cache_specs(layout.structs(cache))
    assert sharding.cache_specs(cache)[layout.MOE_LAYERS][layout.K_PAGES] == \
        P(None, ("data", "expert"), None, "tensor", None)
    assert sharding.cache_specs(cache)[layout.MTP][layout.V_PAGES] == \
        P(("data", "expert"), None, "tensor", None)
    # The FP8 cache's three leaves split by pages exactly like PAGES (DP attention's per-shard pools);
    # the scale leaf's page axis is first too, its token axis last.
    fp8 = sharding.cache_specs(layout.cache_layout(V3, 16, 64, "absorbed", "fp8", mtp=True))
    bf16 = sharding.cache_specs(layout.cache_layout(V3, 16, 64, "absorbed", jnp.bfloat16, mtp=True))
    for stack in (layout.MOE_LAYERS, layout.MTP):
        assert set(fp8[stack]) == set(layout.FP8_LEAVES)
        for name in layout.FP8_LEAVES:
            assert fp8[stack][name] == bf16[stack][layout.PAGES], (stack, name)


@pytest.mark.parametrize("form", layout.FORMS)
@pytest.mark.parametrize("mtp", [False, True])
def test_cache_layout_is_what_allocate_builds_and_the_model_writes(form, mtp):
    cfg = TINY.replace(vocab_size=256)
    declared = layout.cache_layout(cfg, 6, 4, form, jnp.float32, mtp)
    assert set(declared[layout.DENSE_LAYERS]) == set(layout.CACHE_LEAVES[form])
    assert (layout.MTP in declared) == mtp
    cache = kv_cache.allocate(cfg, 6, 4, form, jnp.float32, mtp)
    assert _flat(cache) == _flat(declared)
    # The model's forward returns a cache of the declared tree (names, shapes, dtypes).
    model = Transformer(cfg, jnp.float32, False, form)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                                               method=model.init_all))["params"]
    meta = PageMeta(jnp.array([[1, 2]], jnp.int32), jnp.array([3], jnp.int32))
    _, _, out = jax.eval_shape(lambda p, c: model.apply({"params": p}, jnp.zeros((1, 3), jnp.int32),
                                                        jnp.arange(3)[None], c, meta), params, cache)
    assert _flat(out) == _flat(declared)


@pytest.mark.parametrize("mtp", [False, True])
def test_fp8_cache_layout_is_what_allocate_builds_and_the_model_writes(mtp):
    """kv_cache_dtype "fp8": three typed leaves per pool (latent e4m3, block-major fp32 scales, bf16 rope);
    allocate builds them and the model's forward returns the same tree."""
    cfg = TINY.replace(vocab_size=256)
    declared = layout.cache_layout(cfg, 6, 4, "absorbed", "fp8", mtp)
    nb = -(-cfg.kv_lora_rank // 128)
    assert {k: (v.shape[1:], v.dtype) for k, v in declared[layout.DENSE_LAYERS].items()} == {
        layout.FP8_LATENT: ((6, 4, cfg.kv_lora_rank), jnp.dtype(jnp.float8_e4m3fn)),
        layout.FP8_SCALE: ((6, nb, 4), jnp.dtype(jnp.float32)),
        layout.FP8_ROPE: ((6, 4, cfg.qk_rope_head_dim), jnp.dtype(jnp.bfloat16))}
    assert declared[layout.DENSE_LAYERS][layout.FP8_SCALE].logical_axes == \
        ("layers", "cache_pages", "kv_latent", "page_slot")
    assert (layout.MTP in declared) == mtp
    cache = kv_cache.allocate(cfg, 6, 4, "absorbed", "fp8", mtp)
    assert _flat(cache) == _flat(declared)
    model = Transformer(cfg, jnp.float32, False, "absorbed")
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                                               method=model.init_all))["params"]
    meta = PageMeta(jnp.array([[1, 2]], jnp.int32), jnp.array([3], jnp.int32))
    _, _, out = jax.eval_shape(lambda p, c: model.apply({"params": p}, jnp.zeros((1, 3), jnp.int32),
                                                        jnp.arange(3)[None], c, meta), params, cache)
    assert _flat(out) == _flat(declared)


def test_bytes_per_token_from_the_layout():
    assert layout.bytes_per_token(V3, "absorbed", jnp.bfloat16) == 576 * 2 * 61 == 70_272
    assert layout.bytes_per_token(V3, "naive", jnp.bfloat16) == 128 * (192 + 128) * 2 * 61
    assert layout.bytes_per_token(V3, "absorbed", jnp.bfloat16, mtp=True) == 576 * 2 * 62
    assert layout.bytes_per_token(V3, "absorbed", "fp8") == (512 + 4 * 4 + 64 * 2) * 61 == 40_016
    assert layout.bytes_per_token(V3, "absorbed", "fp8", mtp=True) == 656 * 62
    assert layout.bytes_per_token(TINY) == TINY.latent_dim * 4 * TINY.num_hidden_layers  # float32 config
    pool = layout.cache_layout(TINY, 10, 8, "naive", jnp.bfloat16)
    assert layout.tree_nbytes(pool) == 10 * 8 * layout.bytes_per_token(TINY, "naive", jnp.bfloat16)
    with pytest.raises(ValueError, match="cache form"):
        layout.cache_layout(TINY, 2, 4, "paged")


def test_array_info_checks_its_axes():
    info = layout.ArrayInfo([2, 3], "bfloat16", ("experts", "embed"))
    assert info.shape == (2, 3) and info.dtype == jnp.bfloat16 and info.nbytes == 12
    assert info.struct() == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.shape = (1,)  # type: ignore[misc]
    with pytest.raises(ValueError, match="2 dims but 1 logical axes"):
        layout.ArrayInfo((2, 3), jnp.float32, ("embed",))
    with pytest.raises(ValueError, match="not in layout.LOGICAL_AXES"):
        layout.ArrayInfo((2,), jnp.float32, ("hidden",))
    with pytest.raises(KeyError, match="CACHE_AXES"):
        layout.cache_axes("moe_layers/latent", 4)
