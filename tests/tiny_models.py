"""Tiny models for the inference-form tests (test_kv_b.py, test_qkv_a.py): parameters in the checkpoint
form, float or quantized, and token batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.config import ModelConfig
from dsv3_jax.formats.quantize import quantize_params
from dsv3_jax.model.transformer import Transformer

CFG = ModelConfig.preset("tiny")
# FP8 scale blocks are 128 wide: dimensions of whole (or half) blocks, q_lora_rank set per test file
FP8_BASE = CFG.replace(vocab_size=1000, hidden_size=256, intermediate_size=384, moe_intermediate_size=160,
                       kv_lora_rank=256)


def init(cfg: ModelConfig, fp8: bool = False) -> tuple[Transformer, dict]:
    """(the model, its parameters in the checkpoint form; FP8-quantized with `fp8`)."""
    model = Transformer(cfg)
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 1), jnp.int32), method=model.init_all))(
        jax.random.key(0))["params"]
    if fp8:
        return Transformer(cfg, fp8=True), quantize_params(params)
    return model, params


def tokens(cfg: ModelConfig, t: int = 24) -> jax.Array:
    return jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
