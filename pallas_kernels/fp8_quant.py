"""FP8 (e4m3) block quantization in DeepSeek-V3's format: 1x128 activation groups, 128x128 weight blocks.

Owns quantize/dequantize of activations and weights, with optional UE8M0 (power-of-two) scale rounding.
Scales are "scale_inv" in Hugging Face's sense: the real value is ``fp8 * scale`` (block-broadcast).
Shapes whose last dims are not multiples of 128 are handled: the last block is partial, its scale
covers only the elements that exist. Plain jnp: XLA fuses it into one pass, so no Pallas kernel here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
# Smallest amax used for a scale: keeps all-zero blocks finite (their fp8 values stay exactly 0).
_AMAX_FLOOR = 1e-10


def num_blocks(n: int, block: int = BLOCK) -> int:
    """Number of ``block``-wide blocks covering ``n`` elements (the last may be partial)."""
    return -(-n // block)


def _round_scale_ue8m0(scale: jax.Array) -> jax.Array:
    """Round a positive scale up to a power of two (UE8M0), so ``x / scale`` never exceeds FP8_MAX."""
    return jnp.exp2(jnp.ceil(jnp.log2(scale)))


def _pad_last(x: jax.Array, axis: int, block: int) -> jax.Array:
    n = x.shape[axis]
    pad = num_blocks(n, block) * block - n
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _scale_from_amax(amax: jax.Array, ue8m0: bool) -> jax.Array:
    scale = jnp.maximum(amax, _AMAX_FLOOR) / FP8_MAX
    return _round_scale_ue8m0(scale) if ue8m0 else scale


def quantize_act(
    x: jax.Array, *, block: int = BLOCK, ue8m0: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Quantize activations per token per ``block`` channels.

    Args:
      x: ``[..., K]`` float array.
      block: channel group size (128 in DeepSeek-V3).
      ue8m0: round scales up to powers of two (DeepSeek-V3.1's UE8M0 format).

    Returns:
      ``(x_fp8 [..., K] float8_e4m3fn, scale [..., ceil(K/block)] float32)`` with
      ``x ~= x_fp8 * scale`` broadcast over each group.
    """
    if x.ndim < 1:
        raise ValueError(f"quantize_act: x must have at least one dim, got shape {x.shape}")
    k = x.shape[-1]
    kb = num_blocks(k, block)
    xf = _pad_last(x.astype(jnp.float32), -1, block).reshape(*x.shape[:-1], kb, block)
    scale = _scale_from_amax(jnp.max(jnp.abs(xf), axis=-1), ue8m0)
    q = jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    q = q.reshape(*x.shape[:-1], kb * block)[..., :k]
    return q, scale


def quantize_weight(
    w: jax.Array, *, block: int = BLOCK, ue8m0: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Quantize weights in ``block x block`` tiles over the last two dims (HF ``[out, in]`` layout).

    Args:
      w: ``[..., N, K]`` float array (leading dims, e.g. experts, are batched).
      block: tile edge (128 in DeepSeek-V3).
      ue8m0: round scales up to powers of two.

    Returns:
      ``(w_fp8 [..., N, K], scale_inv [..., ceil(N/block), ceil(K/block)] float32)``.
    """
    if w.ndim < 2:
        raise ValueError(f"quantize_weight: w must be [..., N, K], got shape {w.shape}")
    *lead, n, k = w.shape
    nb, kb = num_blocks(n, block), num_blocks(k, block)
    wf = _pad_last(_pad_last(w.astype(jnp.float32), -1, block), -2, block)
    wf = wf.reshape(*lead, nb, block, kb, block)
    scale = _scale_from_amax(jnp.max(jnp.abs(wf), axis=(-3, -1)), ue8m0)
    q = jnp.clip(wf / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k]
    return q, scale


def dequantize_act(
    x_fp8: jax.Array, scale: jax.Array, *, block: int = BLOCK, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Inverse of :func:`quantize_act`: ``x_fp8 [..., K] * scale [..., ceil(K/block)]``."""
    k = x_fp8.shape[-1]
    kb = num_blocks(k, block)
    if scale.shape != (*x_fp8.shape[:-1], kb):
        raise ValueError(
            f"dequantize_act: scale shape {scale.shape} does not match x_fp8 {x_fp8.shape} "
            f"(expected {(*x_fp8.shape[:-1], kb)})"
        )
    s = jnp.repeat(scale.astype(jnp.float32), block, axis=-1)[..., :k]
    return (x_fp8.astype(jnp.float32) * s).astype(dtype)


def dequantize_weight(
    w_fp8: jax.Array, scale: jax.Array, *, block: int = BLOCK, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Inverse of :func:`quantize_weight`: ``w_fp8 [..., N, K] * scale [..., ceil(N/b), ceil(K/b)]``."""
    if w_fp8.ndim < 2:
        raise ValueError(f"dequantize_weight: w_fp8 must be [..., N, K], got shape {w_fp8.shape}")
    *lead, n, k = w_fp8.shape
    want = (*lead, num_blocks(n, block), num_blocks(k, block))
    if scale.shape != tuple(want):
        raise ValueError(
            f"dequantize_weight: scale shape {scale.shape} does not match w_fp8 {w_fp8.shape} "
            f"(expected {tuple(want)})"
        )
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block, axis=-2), block, axis=-1)
    return (w_fp8.astype(jnp.float32) * s[..., :n, :k]).astype(dtype)
