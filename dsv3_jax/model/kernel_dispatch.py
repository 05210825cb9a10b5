"""The one dispatch point between the model and `pallas_kernels`.

Owns: routing the FP8 linears, the expert grouped matmul (FP8 or bf16/fp16 weights) and MLA attention to
a Pallas Mosaic GPU kernel or its plain-`jnp` reference, and the naive-form flash attention of a long
prefill chunk (long_prefill.py) to cuDNN or its reference, given the backend the caller passes ("pallas" or
"reference": `TraceOptions.kernels`, see trace_options.py, which resolves "auto" and DSV3_KERNELS), and
the fallbacks to the reference for shapes or dtypes a kernel cannot take (logged once).
Reads no setting from module state or the environment: the backend is an argument, so a trace is
determined by its inputs (and, for cuDNN, which exists only there, by whether JAX traces for a GPU).
Must not know about layers, configs or meshes: arrays in, arrays out.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp

from dsv3_jax.model.trace_options import KERNEL_BACKENDS

log = logging.getLogger(__name__)


def _pallas(backend: str) -> bool:
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    return backend == "pallas"


# ------------------------------------------------------------------------------------------- FP8
# FP8 checkpoints run as DeepSeek's reference does: activations are quantized per token per 128
# channels (activation_scheme "dynamic") and multiplied with the e4m3 weights, block scales applied in
# fp32. The CPU reference does exactly that math, so CPU and GPU give the same numbers up to rounding.
def dequantize_weight(w: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """W [..., N, K] e4m3 times its [..., ceil(N/128), ceil(K/128)] block scales."""
    from pallas_kernels import fp8_quant

    return fp8_quant.dequantize_weight(w, scale).astype(dtype)


def fp8_linear(x: jax.Array, w: jax.Array, scale: jax.Array, *, backend: str) -> jax.Array:
    """x [..., K] @ W^T for an FP8 block-scaled W [N, K]; output in x's dtype."""
    if _pallas(backend):
        from pallas_kernels import fp8_gemm

        return fp8_gemm.fp8_linear(x, w, scale, out_dtype=x.dtype)
    from pallas_kernels import fp8_reference

    return fp8_reference.fp8_linear_reference(x, w, scale, out_dtype=x.dtype)


# ------------------------------------------------------------------------------ grouped matmul
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   w_scale: jax.Array | None = None, *, backend: str) -> jax.Array:
    """Rows of x [M, K] sorted by group times W_g^T, W [G, N, K]; group_sizes [G] sums to <= M.

    Only the rows' own groups are computed (a grouped GEMM, never a dense all-experts product).
    Rows past sum(group_sizes) come back as zeros. With `w_scale`, W is FP8 and x is quantized.
    Otherwise W is cast to x's dtype (the compute dtype): bf16/fp16 run the Pallas grouped GEMM with
    backend "pallas" (accumulating in fp32), anything else the jnp segment-matmul reference (logged once).
    """
    gs = group_sizes.astype(jnp.int32)
    pallas = _pallas(backend)
    if w_scale is not None:
        if pallas:
            from pallas_kernels import fp8_gemm

            return fp8_gemm.fp8_grouped_linear(x, w, w_scale, gs, out_dtype=x.dtype)
        from pallas_kernels import fp8_reference

        return fp8_reference.fp8_grouped_linear_reference(x, w, w_scale, gs, out_dtype=x.dtype)
    from pallas_kernels.grouped_gemm import DTYPES, grouped_gemm, grouped_gemm_reference

    w = w.astype(x.dtype)
    if pallas:
        if x.dtype in DTYPES:
            # Off the GPU (forced "pallas" in tests) the kernel runs in Pallas' GPU interpreter.
            return grouped_gemm(x, w, gs, out_dtype=x.dtype)
        _log_grouped_dtype_fallback(str(x.dtype))
    return grouped_gemm_reference(x, w, gs, out_dtype=x.dtype)


@functools.cache
def _log_grouped_dtype_fallback(dtype: str) -> None:
    log.warning("kernel dispatch: the grouped GEMM kernel takes bf16/fp16; %s experts use the jnp reference",
                dtype)


# ------------------------------------------------------------------------------- MLA attention
def mla_attention(q_latent: jax.Array, q_rope: jax.Array, kv_pages: Any, block_table: jax.Array,
                  start_pos: jax.Array, chunk_lens: jax.Array, *, softmax_scale: float, backend: str
                  ) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA for a chunk of new tokens over a paged latent cache (decode is a chunk of 1).

    q_latent [B, T, H, R], q_rope [B, T, H, r], kv_pages [P, page, R + r] or `mla_common.Fp8Pages`; token
    t of row b sits at start_pos[b] + t (its latent already in the pages); padding rows: t >= chunk_lens[b].
    Returns (out [B, T, H, R] before W_uv, lse [B, T, H]). The Pallas kernel needs DeepSeek's widths
    (512 + 64), its page size (`mla_common.PAGE_SIZE`, = cache.PAGE_SIZE) and a bf16 cache or FP8 pages
    (`pallas_kernels.mla_decode_fp8`, issue 28); other shapes use the reference
    (logged once). A ragged token batch calls this with one token per row (T = 1).
    `mla_prefill.mla_chunk_attention` owns the routing and the casts around kernel and reference.
    """
    from pallas_kernels.mla_common import cache_widths, is_fp8_cache, kernel_shape_error
    from pallas_kernels.mla_prefill import mla_chunk_attention

    fp8 = is_fp8_cache(kv_pages)  # FP8 pages: the FP8-page kernel (pallas_kernels.mla_decode_fp8), in bf16
    fits = (kernel_shape_error(q_latent.shape[-1], q_rope.shape[-1], cache_widths(kv_pages)) is None
            and (kv_pages.latent.shape[-1] == q_latent.shape[-1] if fp8 else kv_pages.dtype == jnp.bfloat16))
    pallas = _pallas(backend)
    if pallas and not fits:
        _log_mla_shape_fallback(tuple(q_latent.shape[-1:]), "fp8 pages" if fp8 else str(kv_pages.dtype))
    # Off the GPU (forced "pallas" in tests) the kernel runs in Pallas' GPU interpreter (interpret=None).
    return mla_chunk_attention(q_latent, q_rope, kv_pages, block_table, start_pos, chunk_lens,
                               softmax_scale=softmax_scale, use_kernel=pallas and fits)


def mla_kernel_serves(latent: int, rope: int, page_size: int, backend: str) -> bool:
    """Whether `mla_attention` runs the Pallas kernel for a bf16 cache or FP8 pages of these widths and page
    size under `backend` (what a memory plan needs: the reference materializes scores over the context,
    the kernel never does). The same width rule `mla_attention` applies to the arrays."""
    from pallas_kernels.mla_common import kernel_shape_error

    return _pallas(backend) and kernel_shape_error(latent, rope, (0, page_size, latent + rope)) is None


@functools.cache
def _log_mla_shape_fallback(latent: tuple[int, ...], dtype: str) -> None:
    log.warning("kernel dispatch: MLA kernel needs latent 512 + rope 64, 64-token pages, bf16; got "
                "latent %s, %s: using the jnp reference", latent, dtype)


# ------------------------------------------------------------------- flash attention (naive form)
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_len: jax.Array, kv_len: jax.Array, *,
                    causal: bool, softmax_scale: float, backend: str) -> tuple[jax.Array, jax.Array]:
    """One sequence's multi-head attention: q [N, H, D], k [S, H, D], v [S, H, dv] (dv <= D); query t < q_len
    sees keys j < kv_len (and j <= t when `causal`: the chunk attending to its own keys, top-left aligned).

    Returns (out [N, H, dv] fp32, lse [N, H] fp32: natural-log log-sum-exp of the scaled scores, -inf where
    a query sees no key). Rows t >= q_len come back as zeros with lse -inf, so padding never carries a
    non-finite value into the pool. Backend "pallas" on a GPU runs cuDNN's flash attention (MLA widths, dv
    < D, need cuDNN >= 9.10: older ones get V padded to D, logged once); otherwise the jnp reference, which
    materializes the [H, N, S] scores (tests and small shapes).
    """
    if _pallas(backend) and jax.default_backend() == "gpu":
        out, lse = _cudnn_flash(q, k, v, q_len, kv_len, causal, softmax_scale)
    else:
        if _pallas(backend):
            _log_flash_fallback(jax.default_backend())
        out, lse = flash_attention_reference(q, k, v, q_len, kv_len, causal=causal,
                                             softmax_scale=softmax_scale)
    live = jnp.arange(q.shape[0]) < q_len
    return jnp.where(live[:, None, None], out, 0.0), jnp.where(live[:, None], lse, -jnp.inf)


def flash_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, q_len: jax.Array,
                              kv_len: jax.Array, *, causal: bool, softmax_scale: float
                              ) -> tuple[jax.Array, jax.Array]:
    """`flash_attention`'s semantics in plain jnp (matmuls in the inputs' dtype, fp32 accumulation)."""
    s = jnp.einsum("nhd,shd->hns", q, k, preferred_element_type=jnp.float32) * softmax_scale
    j = jnp.arange(k.shape[0])
    seen = j[None, :] < kv_len
    if causal:
        seen = seen & (j[None, :] <= jnp.arange(q.shape[0])[:, None])
    s = jnp.where(seen[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [H, N]
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum("hns,shv->nhv", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out, lse.T


def _cudnn_flash(q, k, v, q_len, kv_len, causal: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    # The internal entry point: the public jax.nn.dot_product_attention needs V as wide as K and returns
    # the lse cast to the output dtype (bf16 would put ~6% errors into the block merge).
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    dv = v.shape[-1]
    if dv != q.shape[-1] and cudnn.check_cudnn_version() < 91000:
        _log_cudnn_pad(cudnn.check_cudnn_version())
        v = jnp.pad(v, ((0, 0), (0, 0), (0, q.shape[-1] - dv)))
    mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    out, lse = cudnn.dot_product_attention(
        q[None], k[None], v[None], None, None, jnp.reshape(q_len, (1,)).astype(jnp.int32),
        jnp.reshape(kv_len, (1,)).astype(jnp.int32), scale=scale, mask_type=mask, qkv_layout="BTNH",
        return_residual=True)
    return out[0, ..., :dv].astype(jnp.float32), lse[0].T.astype(jnp.float32)  # lse [1, H, N] -> [N, H]


@functools.cache
def _log_flash_fallback(platform: str) -> None:
    log.warning("kernel dispatch: cuDNN flash attention needs a GPU (platform %s): the long-prefill chunk "
                "attention uses the jnp reference", platform)


@functools.cache
def _log_cudnn_pad(version: int) -> None:
    log.warning("kernel dispatch: cuDNN %d predates MLA head widths (9.10): V is padded to K's width",
                version)
