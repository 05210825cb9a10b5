"""Mixture of experts: the `noaux_tc` grouped sigmoid router and the routed + shared SwiGLU experts.

Owns: expert selection and weights (`route`), token permutation by expert, the grouped matmuls
(through `kernels.grouped_matmul`: the FP8 Pallas kernel on Hopper, `ragged_dot` elsewhere) and the
weighted un-permutation. Only the chosen experts' work is computed. Expert weights are stacked [E, ...]
in the HF [out, in] layout. Must not know about meshes (sharding.py wraps this in shard_map).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dsv3_jax import kernels
from dsv3_jax.config import ModelConfig
from dsv3_jax.layers import MLP


def route(logits: jax.Array, bias: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """noaux_tc routing: logits [N, E] (fp32) -> (weights [N, k] fp32, expert ids [N, k] int32).

    The correction bias steers *selection only*; weights are the unbiased sigmoid scores of the chosen
    experts, normalized to sum 1 (norm_topk_prob) and multiplied by routed_scaling_factor.
    """
    n, e = logits.shape
    g, k = cfg.n_group, cfg.num_experts_per_tok
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores + bias.astype(jnp.float32)
    group_score = jax.lax.top_k(biased.reshape(n, g, e // g), 2)[0].sum(-1)  # [N, G]
    _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
    group_keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
    expert_keep = jnp.repeat(group_keep, e // g, axis=1)
    _, idx = jax.lax.top_k(jnp.where(expert_keep, biased, -jnp.inf), k)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def routed_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, experts: dict,
                   num_experts: int) -> jax.Array:
    """sum_k w_k * expert_k(x) for x [N, D] via sort-by-expert + grouped matmuls.

    `experts` holds {gate_proj, up_proj, down_proj}: {"weight": [E, out, in], optionally "scale"}.
    `idx` may hold ids outside [0, num_experts) (experts another device owns): those rows are skipped.
    """
    n, k = idx.shape
    flat = idx.reshape(-1)
    local = (flat >= 0) & (flat < num_experts)
    # Foreign experts sort last and fall outside every group, so they cost nothing and add zero.
    order = jnp.argsort(jnp.where(local, flat, num_experts), stable=True)
    token = order // k
    group_sizes = jnp.bincount(jnp.where(local, flat, num_experts), length=num_experts + 1)[:num_experts]
    xs = x[token]

    def mm(h, name):
        p = experts[name]
        return kernels.grouped_matmul(h, p["weight"], group_sizes, p.get("scale"))

    h = jax.nn.silu(mm(xs, "gate_proj")) * mm(xs, "up_proj")
    y = mm(h, "down_proj")
    wsorted = jnp.where(local[order], weights.reshape(-1)[order], 0.0)
    y = (y.astype(jnp.float32) * wsorted[:, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(y)


class MoE(nn.Module):
    cfg: ModelConfig
    param_dtype: jnp.dtype = jnp.float32
    fp8: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        e, d, i = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        init = nn.initializers.normal(0.02)
        gate_w = self.param("gate_weight", init, (e, d), self.param_dtype)
        bias = self.param("e_score_correction_bias", nn.initializers.zeros, (e,), jnp.float32)

        def expert_param(name, out_dim, in_dim):
            if self.fp8:
                return {"weight": self.param(f"{name}_weight", nn.initializers.zeros, (e, out_dim, in_dim),
                                             jnp.float8_e4m3fn),
                        "scale": self.param(f"{name}_scale", nn.initializers.ones,
                                            (e, -(-out_dim // 128), -(-in_dim // 128)), jnp.float32)}
            return {"weight": self.param(f"{name}_weight", init, (e, out_dim, in_dim), self.param_dtype)}

        experts = {"gate_proj": expert_param("gate_proj", i, d), "up_proj": expert_param("up_proj", i, d),
                   "down_proj": expert_param("down_proj", d, i)}
        shape = x.shape
        xf = x.reshape(-1, d)
        logits = jnp.einsum("nd,ed->ne", xf.astype(jnp.float32), gate_w.astype(jnp.float32))
        w, idx = route(logits, bias, c)
        self.sow("intermediates", "router_choice", idx.reshape(*shape[:-1], -1))
        out = routed_experts(xf, w, idx, experts, e)
        if c.n_shared_experts:
            shared = MLP(d, i * c.n_shared_experts, self.param_dtype, self.fp8, name="shared_experts")
            out = out + shared(xf)
        return out.reshape(shape)
