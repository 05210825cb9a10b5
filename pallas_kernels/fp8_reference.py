"""Plain-jnp references for the FP8 GEMMs in ``fp8_gemm.py``: dequantize, then matmul in fp32.

Same signatures as the kernels. The grouped reference is ``group_tiles.segment_matmul`` over row tiles
that never straddle two experts, dequantizing one expert's weight per tile: no ``ragged_dot`` (which
XLA densifies over all experts) and no fp32 copy of every expert's weight. Rows at or past
``sum(group_sizes)`` come out zero, as in the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_quant import dequantize_act, dequantize_weight, quantize_act
from pallas_kernels.group_tiles import check_group_sizes, segment_matmul


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
    check_group_sizes(group_sizes, w_fp8.shape[0])
    x = dequantize_act(x_fp8, x_scale)
    if w_scale.shape[0] != w_fp8.shape[0]:  # checked here: the per-group dequantize sees one group only
        raise ValueError(f"w_scale {w_scale.shape} does not match w_fp8 {w_fp8.shape} in the group axis")
    out = segment_matmul(x, group_sizes.astype(jnp.int32),
                         lambda g: dequantize_weight(w_fp8[g], w_scale[g]), w_fp8.shape[1])
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
