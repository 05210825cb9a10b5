"""Tiny random transformers DeepseekV3 models (fp32, torch CPU): the reference the tests compare to."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dsv3_jax.config import ModelConfig

# Two shapes of tiny model: groups + YaRN + q LoRA; and no q LoRA, more layers, different groups.
HF_CONFIGS = {
    "lora_yarn": dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=16, n_shared_experts=1,
                      num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=4, q_lora_rank=32,
                      kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      max_position_embeddings=512, routed_scaling_factor=2.5,
                      rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 16, "beta_fast": 32,
                                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "nolora": dict(vocab_size=384, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                   num_hidden_layers=5, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2,
                   num_experts_per_tok=3, n_group=2, topk_group=1, num_attention_heads=3, q_lora_rank=None,
                   kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                   max_position_embeddings=256, routed_scaling_factor=1.5, rope_scaling=None),
}


def make_hf_model(kind: str = "lora_yarn", seed: int = 0):
    """A random transformers DeepseekV3ForCausalLM in fp32 with a non-trivial router bias."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**HF_CONFIGS[kind], bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = DeepseekV3ForCausalLM(cfg).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # HF inits some weights to zero/one; random everywhere makes every path matter.
            if "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.05 * torch.randn_like(mod.e_score_correction_bias))
    return model


def save_hf(model, dst: Path, shard_size: str = "300KB") -> Path:
    model.save_pretrained(dst, max_shard_size=shard_size, safe_serialization=True)
    return dst


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()


def our_config(dst: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((dst / "config.json").read_text()))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
