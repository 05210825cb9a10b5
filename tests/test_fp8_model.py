"""A tiny FP8 model (e4m3 weights, 128x128 block scales, dynamic 1x128 activation quantization) vs its
float twin: top-1 agreement and KL over a few hundred positions.

Bound and why: e4m3 has a 3-bit mantissa, so each weight and activation carries up to ~6% relative
rounding error (2^-4); this random MoE amplifies it (a perturbed router score flips an expert choice).
Measured here (2-core x86 CPU, jax 0.11.2): top-1 agreement 0.903, mean KL 3.5e-2 nats and logit
relative error 0.093 against the float model; we assert top-1 >= 0.85, mean KL <= 5e-2 and relative
error <= 0.1, which a broken scale (e.g. a transposed block grid: KL > 1) or a skipped activation scale
could not meet. The relative-error margin is thin (7%): these are empirical bounds, not derived ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.config import ModelConfig
from dsv3_jax.formats.quantize import float_twin, quantize_params
from dsv3_jax.model.transformer import Transformer

CFG = ModelConfig.preset("tiny").replace(vocab_size=1000, hidden_size=256, intermediate_size=384,
                                         moe_intermediate_size=160, q_lora_rank=192, kv_lora_rank=160)


def _kl(p_logits, q_logits):
    lp = jax.nn.log_softmax(p_logits, -1)
    lq = jax.nn.log_softmax(q_logits, -1)
    return float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), -1)))


def test_fp8_model_close_to_float_twin():
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (2, 160)), jnp.int32)
    model = Transformer(CFG)
    params = model.init(jax.random.key(0), toks[:, :4], method=model.init_all)["params"]
    # A random deep MoE is chaotic (a 4% error flips routing, which flips more), unlike a trained model;
    # keep the init's small layer weights (a well-conditioned residual stream) and sharpen the head so
    # the logits are peaked enough for top-1 to mean something.
    params = {**params, "lm_head": {"weight": params["lm_head"]["weight"] * 10.0}}
    q = quantize_params(params)
    assert q["moe_layers"]["mlp"]["gate_proj_weight"].dtype == jnp.float8_e4m3fn
    assert q["moe_layers"]["mlp"]["gate_proj_scale"].shape == (2, 16, 2, 2)  # 160 -> 2 blocks, 256 -> 2
    assert q["lm_head"]["weight"].dtype == jnp.float32  # heads and the router stay in float
    assert q["moe_layers"]["mlp"]["gate_weight"].dtype == jnp.float32

    ref = model.apply({"params": params}, toks)[0]
    fp8_model = Transformer(CFG, fp8=True)
    got = fp8_model.apply({"params": q}, toks)[0]
    twin = model.apply({"params": float_twin(q)}, toks)[0]  # same weights, activations not quantized

    top1 = float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(ref, -1)))
    kl = _kl(ref, got)
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    print(f"fp8 vs float: top-1 agreement {top1:.3f}, mean KL {kl:.2e}, logit rel err {rel:.3f} over "
          f"{toks.size} positions; vs dequantized twin KL {_kl(twin, got):.2e}")
    assert top1 >= 0.85 and kl <= 5e-2 and rel <= 0.1
    # Activation quantization alone is a smaller error than weight + activation quantization.
    assert _kl(twin, got) <= kl
