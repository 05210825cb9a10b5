"""Tiny reference models whose heads / experts divide the 8-device test meshes (see tests/test_sharding.py).

Adds two configs to tests.hf_reference.HF_CONFIGS so `make_hf_model(kind)` builds them:
- "h8e16": 8 heads (tensor=8), 16 experts in 4 groups (expert=8 -> 2 per device, expert=4 -> 4), q LoRA, YaRN;
- "h8e8": 8 heads, 8 experts in 2 groups (expert=8 -> 1 per device), no q LoRA, 2 shared experts.
Every width that `tensor` splits (vocab, MLP, expert and shared-expert FFN) is divisible by 8.
"""

from __future__ import annotations

from tests.hf_reference import HF_CONFIGS

MESH_CONFIGS = {
    "h8e16": dict(HF_CONFIGS["lora_yarn"], num_attention_heads=8, num_hidden_layers=3,
                  first_k_dense_replace=1, intermediate_size=96),
    "h8e8": dict(vocab_size=384, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                 num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2,
                 num_experts_per_tok=3, n_group=2, topk_group=1, num_attention_heads=8, q_lora_rank=None,
                 kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 max_position_embeddings=256, routed_scaling_factor=1.5, rope_scaling=None),
}
HF_CONFIGS.update(MESH_CONFIGS)
