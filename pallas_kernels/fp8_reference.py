"""Plain-jnp references for the FP8 GEMMs in ``fp8_gemm.py``: dequantize, then matmul in fp32.

Same signatures as the kernels. The grouped reference uses ``jax.lax.ragged_dot`` on the dequantized
operands, so it never builds an ``[E, M, N]`` intermediate over all experts. Rows at or past
``sum(group_sizes)`` come out zero, as in the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_quant import dequantize_act, dequantize_weight, quantize_act


def fp8_gemm_reference(
    x_fp8: jax.Array,
    x_scale: jax.Array,
    w_fp8: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """``x [M, K] @ w[N, K].T`` with both operands dequantized to fp32 first."""
    x = dequantize_act(x_fp8, x_scale)
    w = dequantize_weight(w_fp8, w_scale)
    out = jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def fp8_grouped_gemm_reference(
    x_fp8: jax.Array,
    x_scale: jax.Array,
    w_fp8: jax.Array,
    w_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """Rows of ``x [M, K]`` sorted by group; group ``e``'s rows times ``w[e] [N, K]`` transposed."""
    x = dequantize_act(x_fp8, x_scale)
    w = dequantize_weight(w_fp8, w_scale)
    out = jax.lax.ragged_dot(
        x,
        jnp.swapaxes(w, 1, 2),
        group_sizes.astype(jnp.int32),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)


def fp8_linear_reference(
    x: jax.Array, w_fp8: jax.Array, w_scale: jax.Array, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """Quantize ``x [..., K]`` per token per 128 channels, then :func:`fp8_gemm_reference`."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_act(x.reshape(-1, k))
    out = fp8_gemm_reference(xq, xs, w_fp8, w_scale, out_dtype=out_dtype or x.dtype)
    return out.reshape(*lead, w_fp8.shape[0])


def fp8_grouped_linear_reference(
    x: jax.Array,
    w_fp8: jax.Array,
    w_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Quantize ``x [M, K]`` (rows sorted by group), then :func:`fp8_grouped_gemm_reference`."""
    xq, xs = quantize_act(x)
    return fp8_grouped_gemm_reference(
        xq, xs, w_fp8, w_scale, group_sizes, out_dtype=out_dtype or x.dtype
    )
