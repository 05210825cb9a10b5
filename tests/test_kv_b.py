"""kv_b's inference form (model/kv_b.py): the split halves hold the checkpoint's numbers, the model reads
either form to the same logits, every handle holds the split form, and the planner counts it.

Bounds: the split is a reshape and a transpose (float weights) or the step's own dequantization (FP8),
so the halves are compared bit for bit. The two forms' logits differ only in the order XLA sums the
same products (einsums over differently laid-out operands), so fp32 forwards agree to a few ulps of
their largest logit: 1e-5 relative is ~80 fp32 ulps, far below any wrong half (a swapped or transposed
W_uk moves logits by O(1)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax import plan
from dsv3_jax.api import ModelHandle
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kv_b, layout, qkv_a
from dsv3_jax.model.transformer import Transformer
from dsv3_jax.parallel import sharding
from tests import tiny_models

CFG = tiny_models.CFG
FP8_CFG = tiny_models.FP8_BASE.replace(q_lora_rank=192)
_init, _tokens = tiny_models.init, tiny_models.tokens


@pytest.mark.parametrize("fp8", [False, True])
def test_halves_hold_the_checkpoint_numbers(fp8):
    cfg = FP8_CFG if fp8 else CFG
    _, params = _init(cfg, fp8)
    split = kv_b.split(params, cfg, jnp.float32)
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    for stack in (layout.DENSE_LAYERS, layout.MOE_LAYERS):
        attn, lin = split[stack]["self_attn"], params[stack]["self_attn"][kv_b.KV_B]
        assert kv_b.KV_B not in attn
        w = np.asarray(lin["weight"].astype(jnp.float32))
        if fp8:  # each 128x128 block times its scale
            s = np.repeat(np.repeat(np.asarray(lin["scale"]), 128, -2), 128, -1)
            w = w * s[..., :w.shape[-2], :w.shape[-1]]
        w = w.reshape(-1, h, dn + dv, r)
        np.testing.assert_array_equal(np.asarray(attn[kv_b.W_UK]), w[:, :, :dn].transpose(0, 1, 3, 2))
        np.testing.assert_array_equal(np.asarray(attn[kv_b.W_UV]), w[:, :, dn:])
        # every other leaf is the very same array
        for name in attn:
            if name not in (kv_b.W_UK, kv_b.W_UV):
                assert attn[name] is params[stack]["self_attn"][name]
    assert kv_b.W_UK in split[layout.MTP]["block"]["self_attn"]
    assert kv_b.KV_B not in split[layout.MTP]["block"]["self_attn"]
    again = kv_b.split(split, cfg, jnp.float32)
    assert jax.tree.leaves(again) == jax.tree.leaves(split)  # idempotent, no new arrays


@pytest.mark.parametrize("attention", ["absorbed", "naive"])
def test_both_forms_give_the_same_logits(attention):
    model, params = _init(CFG)
    model = Transformer(CFG, form=attention)
    toks = _tokens(CFG)
    ref = model.apply({"params": params}, toks)[0]
    got = model.apply({"params": kv_b.split(params, CFG, jnp.float32)}, toks)[0]
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-5 * scale)


def test_fp8_model_reads_the_split_form_to_the_same_logits():
    model, params = _init(FP8_CFG, fp8=True)
    toks = _tokens(FP8_CFG)
    ref = model.apply({"params": params}, toks)[0]
    got = model.apply({"params": kv_b.split(params, FP8_CFG, jnp.float32)}, toks)[0]
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-5 * scale)


def test_a_handle_holds_the_split_form_sharded_by_heads():
    _, params = _init(CFG)
    mesh = sharding.make_mesh({"tensor": 2}, jax.devices()[:2])
    sh = sharding.param_shardings(CFG, mesh, params)
    placed = jax.device_put(params, sh)
    h = ModelHandle(CFG, placed, mesh=mesh, param_shardings=sh)
    attn = h.params[layout.MOE_LAYERS]["self_attn"]
    assert kv_b.KV_B not in attn
    assert attn[kv_b.W_UK].sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None, None)
    assert h.param_shardings[layout.MOE_LAYERS]["self_attn"][kv_b.W_UV] == attn[kv_b.W_UV].sharding
    toks = np.asarray(_tokens(CFG))
    ref = Transformer(CFG).apply({"params": params}, jnp.asarray(toks))[0]
    np.testing.assert_allclose(h.forward(toks), np.asarray(ref), rtol=0,
                               atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_the_planner_counts_the_split_form():
    cfg = ModelConfig.preset("deepseek-v3")
    sizes = dict.fromkeys(sharding.AXES, 1)
    checkpoint_tree = plan.param_layout(cfg, "fp8")
    got = plan.plan(cfg, sizes, dtype="fp8", device_memory="2000GB")
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    fp8_kv_b = layers * (h * (dn + dv) * r + (h * (dn + dv) // 128) * (r // 128) * 4)
    split_kv_b = layers * h * r * (dn + dv) * 2  # bf16
    # the inference form's other transform, q_a and kv_a fused, is counted by test_qkv_a.py
    fused_bytes = layout.tree_nbytes(qkv_a.fuse_shapes(checkpoint_tree, cfg))
    assert got.weight_bytes_total == fused_bytes - fp8_kv_b + split_kv_b
