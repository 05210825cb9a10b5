"""Unit tests: noaux_tc routing, YaRN frequencies vs transformers, the MTP module vs numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import rope
from dsv3_jax.model.moe import route
from dsv3_jax.model.transformer import Transformer

CFG = ModelConfig.preset("tiny").replace(vocab_size=97)  # 16 experts, 4 groups of 4, top-2 groups, k=4


def _route(logits, bias, cfg=CFG):
    w, idx = route(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    return np.asarray(w), np.asarray(idx)


def test_group_masking_keeps_experts_inside_the_best_groups():
    logits = np.full((1, 16), -3.0, np.float32)
    # Group 0 has one huge expert but a weak runner-up; groups 2 and 3 have two good experts each.
    logits[0, 0], logits[0, 1] = 6.0, -6.0
    logits[0, 8:10] = [2.0, 2.0]
    logits[0, 12:14] = [1.5, 1.5]
    _, idx = _route(logits, np.zeros(16))
    groups = set((idx[0] // 4).tolist())
    assert groups <= {2, 3}, idx  # top-2 *sum* picks groups 2 and 3, not group 0
    assert set(idx[0].tolist()) == {8, 9, 12, 13}


def test_bias_changes_selection_not_weights():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(32, 16)).astype(np.float32)
    w0, i0 = _route(logits, np.zeros(16))
    bias = np.zeros(16, np.float32)
    bias[15] = 10.0  # forces expert 15 (and its group) in
    w1, i1 = _route(logits, bias)
    assert (i1 == 15).any(axis=1).all() and not (i0 == 15).all()
    s = 1 / (1 + np.exp(-logits))
    chosen = np.take_along_axis(s, i1, axis=1)
    # Weights are the unbiased sigmoid scores, normalized, times routed_scaling_factor.
    np.testing.assert_allclose(w1, chosen / chosen.sum(1, keepdims=True) * CFG.routed_scaling_factor,
                               rtol=1e-6)
    np.testing.assert_allclose(w0.sum(1), CFG.routed_scaling_factor, rtol=1e-6)


def test_no_normalization_when_norm_topk_prob_false():
    cfg = CFG.replace(norm_topk_prob=False, routed_scaling_factor=1.0)
    logits = np.random.default_rng(1).normal(size=(4, 16)).astype(np.float32)
    w, idx = _route(logits, np.zeros(16), cfg)
    np.testing.assert_allclose(w, np.take_along_axis(1 / (1 + np.exp(-logits)), idx, axis=1), rtol=1e-6)


def test_yarn_frequencies_match_transformers():
    pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = ModelConfig.preset("deepseek-v3")
    hf = DeepseekV3Config(**{k: v for k, v in c.to_hf_dict().items()
                             if k not in ("architectures", "model_type", "torch_dtype")})
    inv, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    np.testing.assert_allclose(rope.inv_frequencies(c), inv.numpy(), rtol=1e-6)
    assert rope.cos_sin_factor(c) == pytest.approx(attn_factor)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    attn = DeepseekV3Attention(hf.__class__(**{**hf.to_dict(), "hidden_size": 64, "num_attention_heads": 2,
                                               "q_lora_rank": 8, "kv_lora_rank": 8}), layer_idx=0)
    assert c.softmax_scale == pytest.approx(attn.scaling, rel=1e-7)


def _np_rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def test_mtp_matches_numpy_formula():
    """h' = eh_proj([enorm(embed(t+1)); hnorm(h)]) -> MoE block -> shared_head norm + head."""
    cfg = CFG.replace(num_hidden_layers=1, first_k_dense_replace=0)
    model = Transformer(cfg)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 6)), jnp.int32)
    params = model.init(jax.random.key(0), toks, method=model.init_all)["params"]
    hidden = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, 64)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    logits, _, _ = model.apply({"params": params}, hidden, toks, pos, method=model.mtp_logits)

    # The block itself is checked against transformers by the parity tests; here we check the wiring
    # around it by running the very same block as a one-layer main model on numpy-built input.
    p = jax.tree_util.tree_map(np.asarray, params["mtp"])
    eps = cfg.rms_norm_eps
    e = _np_rms(p["embed_tokens"]["embedding"][np.asarray(toks)], p["enorm"]["weight"], eps)
    h = _np_rms(np.asarray(hidden), p["hnorm"]["weight"], eps)
    x = np.concatenate([e, h], -1) @ p["eh_proj"]["weight"].T
    from dsv3_jax.model.transformer import Block

    blk = Block(cfg, True)
    (y, _, _), _ = blk.apply({"params": params["mtp"]["block"]}, (jnp.asarray(x, jnp.float32), None, None),
                             pos, None)
    y = _np_rms(np.asarray(y), p["shared_head_norm"]["weight"], eps)
    want = y @ p["shared_head_head"]["weight"].T
    np.testing.assert_allclose(np.asarray(logits), want, rtol=2e-4, atol=2e-5)
