"""Rotary position embedding with YaRN context extension, matching transformers' DeepseekV3 numerics.

Owns: inverse frequencies (plain and YaRN-blended), the cos/sin attention factor, and applying the
rotation to the 64 rope dims of q and k. Must not touch weights or caches.

Layout: DeepSeek checkpoints keep rotary dims as interleaved pairs (x0, x1), (x2, x3), ...
(`rope_interleave=True`). We rotate the pairs in place, as the official reference does with complex
numbers; transformers writes the rotated pairs de-interleaved instead. q and k share the layout either
way, so every q.k dot product, hence every logit, is the same.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dsv3_jax.config import ModelConfig


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    # The rope dim whose wavelength completes `num_rotations` turns over the original context.
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [rope_dim/2], float32; YaRN blend when rope_scaling is set."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    s = cfg.rope_scaling
    if s is None:
        return extrapolated.astype(np.float32)
    interpolated = 1.0 / (s.factor * pos_freqs)
    low = math.floor(_correction_dim(s.beta_fast, dim, base, s.original_max_position_embeddings))
    high = math.ceil(_correction_dim(s.beta_slow, dim, base, s.original_max_position_embeddings))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0)
    keep_extrapolated = 1.0 - ramp  # high-frequency dims keep their original speed
    inv = interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated
    return inv.astype(np.float32)


def cos_sin_factor(cfg: ModelConfig) -> float:
    """YaRN's factor on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for V3)."""
    s = cfg.rope_scaling
    if s is None or s.factor <= 1.0:
        return 1.0

    def m(scale: float, ms: float) -> float:
        return 0.1 * ms * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return m(s.factor, s.mscale) / m(s.factor, s.mscale_all_dim)
    return m(s.factor, 1.0)


def rope_angles(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin of shape positions.shape + [rope_dim/2], float32, with the YaRN cos/sin factor."""
    inv = jnp.asarray(inv_frequencies(cfg))
    ang = positions.astype(jnp.float32)[..., None] * inv
    f = cos_sin_factor(cfg)
    return jnp.cos(ang) * f, jnp.sin(ang) * f


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, interleave: bool) -> jnp.ndarray:
    """Rotate x [..., T, (H,) rope_dim]; cos/sin [..., T, rope_dim/2] broadcast over the head axis."""
    if x.ndim == cos.ndim + 1:  # a head axis sits between T and the feature axis
        cos, sin = cos[..., None, :], sin[..., None, :]
    dtype = x.dtype
    x = x.astype(jnp.float32)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(dtype)
