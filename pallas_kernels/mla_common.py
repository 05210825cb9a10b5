"""What the MLA kernels (`mla_decode.py`, `mla_prefill.py`) and their reference (`mla_reference.py`) share.

Owns: the cache widths (`LATENT_DIM` 512 + `ROPE_DIM` 64 = `KV_DIM` 576 values per token), the kernel's
`PAGE_SIZE` (64 tokens; `dsv3_jax.model.kv_cache.PAGE_SIZE` must equal it, a test ties the two since kernels
import nothing from dsv3_jax), the argument checks (`as_4d`, `check_cache_args`, `kernel_shape_error`,
`check_kernel_args`), `clamp_page_ids` (the rule for ids outside the pool) and `mask_padding_rows`, the
rule for a chunk's padding rows; and the FP8 latent cache format (`quantize_kv`, `dequantize_kv`,
`fp8_row_bytes`, `Fp8Pages`), which the model's cache writes, the reference and the kernels all read.

FP8 cache format: three typed arrays per pool (`Fp8Pages`), the same 656 bytes per token (for L 512,
R 64) as FlashMLA's V3.2 one-row layout but laid out so that a Mosaic GPU kernel can TMA-load each page:
    latent [P, page_size, L]        float8_e4m3fn, each 128-value block divided by its scale
    scale  [P, ceil(L/128), page_size] float32, block-major per page: latent = e4m3 * scale
    rope   [P, page_size, R]        bfloat16 (the rotary key loses too much in e4m3)
Why not one uint8 row per token (656 B): tiled TMA needs the gmem minor dim a multiple of 128 B, and a
per-token fp32 scale read out of a [64, 4] tile is no per-row vector a kernel can load; here each page of
each leaf is one TMA copy (latent [64, 512] B: (8, 128) tiles with the 128-B swizzle; rope [64, 64] bf16;
scales [4, 64] f32, scale block j is one row: the per-token vector that multiplies latent columns
128 j .. 128 j + 127). For DeepSeek-V3: 512 + 16 + 128 = 656 bytes per token per layer vs 1,152 in bf16
(1.76x the tokens per byte). `quantize_kv` takes [..., n, L] values and takes axis -2 as the page's
token axis (the scale goes block-major over it); new tokens [B, T, L] quantize the same way (their scale
[B, nb, T] is written token by token, `kv_cache.write_pages`). A block's scale is amax / 448
(e4m3's largest finite value), so the largest value maps to 448 exactly and every value rounds to
e4m3's 3-bit mantissa: relative error <= 2^-4 for scaled magnitudes >= 2^-6 (normals), absolute error
<= 2^-10 * scale below (subnormals). `pow2_scales=True` rounds each scale up to a power of two (UE8M0,
DeepSeek V3.1's activation scales): then dequantizing is exact in any float dtype, at up to one binade
less range. All-zero pages (a fresh or cleared pool: scale 0) read as zeros. The reference keeps the
semantics, the kernel modules the kernels; this module imports neither, so nothing imports a private
helper across modules.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

LATENT_DIM = 512  # the compressed latent c (DeepSeek-V3 kv_lora_rank)
ROPE_DIM = 64  # the shared rotary key k_rope (qk_rope_head_dim)
KV_DIM = LATENT_DIM + ROPE_DIM  # values per cached token: c ++ k_rope
PAGE_SIZE = 64  # tokens per cache page the kernels take: one TMA load of 64 x 576 per pipeline step
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma operands
FP8_BLOCK = 128  # latent values per scale of the FP8 cache
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_BYTES = 4  # one float32 scale
FP8_KV_BYTES = LATENT_DIM + SCALE_BYTES * (LATENT_DIM // FP8_BLOCK) + 2 * ROPE_DIM  # 656: DeepSeek's row


class Fp8Pages(NamedTuple):
    """The FP8 latent cache (module docstring): latent [..., n, L] float8_e4m3fn, scale [..., nb, n]
    float32 (nb = ceil(L / 128), block-major over the n tokens of a page), rope [..., n, R] bfloat16. A
    pytree, so it passes through jit and tree maps as three arrays."""

    latent: jax.Array
    scale: jax.Array
    rope: jax.Array

    @property
    def num_pages(self) -> int:
        return self.latent.shape[0]

    @property
    def page_size(self) -> int:
        return self.latent.shape[-2]


def fp8_row_bytes(latent: int, rope: int) -> int:
    """Bytes one token costs in the FP8 cache: e4m3 latent + an fp32 scale per 128 of it + bf16 rope."""
    return latent + SCALE_BYTES * fp8_blocks(latent) + 2 * rope


def fp8_blocks(latent: int) -> int:
    """Scales per token: one per 128 latent values (the last block may be short)."""
    return -(-latent // FP8_BLOCK)


def quantize_kv(latent: jax.Array, rope: jax.Array, *, pow2_scales: bool = False) -> Fp8Pages:
    """latent [..., n, L] and rope [..., n, R] (any float dtype) -> `Fp8Pages` (latent [..., n, L] e4m3,
    scale [..., nb, n] fp32, rope [..., n, R] bf16); axis -2 is the page's token axis. Scales are computed in
    fp32; an all-zero block gets scale 1."""
    if latent.ndim < 2 or latent.shape[:-1] != rope.shape[:-1]:
        raise ValueError(f"quantize_kv needs latent [..., n, L] and rope [..., n, R], got {latent.shape} "
                         f"and {rope.shape}")
    lead, lat = latent.shape[:-1], latent.shape[-1]
    nb = fp8_blocks(lat)
    x = latent.astype(jnp.float32)
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, nb * FP8_BLOCK - lat)]).reshape(*lead, nb, FP8_BLOCK)
    amax = jnp.max(jnp.abs(x), axis=-1)  # [..., n, nb]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    if pow2_scales:
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    # Clipped: a pow2 scale never needs it, and amax / scale may round to just above 448 (e4m3fn has no inf:
    # an overflow would be NaN).
    q = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    q = q.reshape(*lead, nb * FP8_BLOCK)[..., :lat]
    return Fp8Pages(q, jnp.swapaxes(scale.astype(jnp.float32), -1, -2), rope.astype(jnp.bfloat16))


def dequantize_kv(pages: Fp8Pages, rope: int | None = None, dtype=jnp.float32) -> jax.Array:
    """`Fp8Pages` -> values [..., n, L + R] in `dtype`: latent e4m3 x its block scale (in fp32, then cast),
    rope bf16 (cast). The inverse of `quantize_kv` up to e4m3 rounding. `rope`, when given, must be the
    rope width the pages hold (a check for callers that know it)."""
    if not isinstance(pages, Fp8Pages):
        raise TypeError(f"dequantize_kv takes Fp8Pages (latent, scale, rope), got {type(pages).__name__}")
    if rope is not None and pages.rope.shape[-1] != rope:
        raise ValueError(f"FP8 pages hold {pages.rope.shape[-1]} rope values, expected {rope}")
    lead, lat = pages.latent.shape[:-1], pages.latent.shape[-1]
    nb = fp8_blocks(lat)
    if pages.scale.shape != (*lead[:-1], nb, lead[-1]):
        raise ValueError(f"FP8 scales {pages.scale.shape} do not match latent {pages.latent.shape} "
                         f"(want [..., {nb}, {lead[-1]}])")
    q = pages.latent.astype(jnp.float32)
    x = jnp.pad(q, [(0, 0)] * len(lead) + [(0, nb * FP8_BLOCK - lat)]).reshape(*lead, nb, FP8_BLOCK)
    x = (x * jnp.swapaxes(pages.scale, -1, -2)[..., None]).reshape(*lead, nb * FP8_BLOCK)[..., :lat]
    return jnp.concatenate([x.astype(dtype), pages.rope.astype(dtype)], axis=-1)


def is_fp8_cache(kv_pages: Any) -> bool:
    """Whether `kv_pages` is the FP8 cache (`Fp8Pages`) rather than one array of values."""
    return isinstance(kv_pages, Fp8Pages)


def cache_widths(kv_pages: Any) -> tuple[int, int, int]:
    """(num_pages, page_size, values per token) of a value pool [P, ps, L + R] or `Fp8Pages`."""
    if is_fp8_cache(kv_pages):
        return kv_pages.num_pages, kv_pages.page_size, kv_pages.latent.shape[-1] + kv_pages.rope.shape[-1]
    return kv_pages.shape[0], kv_pages.shape[1], kv_pages.shape[-1]


def as_4d(q_latent: jax.Array, q_rope: jax.Array) -> tuple[jax.Array, jax.Array, bool]:
    """[B, H, D] -> [B, 1, H, D] (4-D passes); returns whether the input was 3-D. Checks the pair agrees."""
    if q_latent.ndim != q_rope.ndim or q_latent.ndim not in (3, 4):
        raise ValueError(
            f"q_latent/q_rope must both be [B, H, D] or [B, Q, H, D], got {q_latent.shape} and {q_rope.shape}"
        )
    squeeze = q_latent.ndim == 3
    if squeeze:
        q_latent, q_rope = q_latent[:, None], q_rope[:, None]
    if q_rope.shape[-1] >= q_latent.shape[-1]:
        raise ValueError(f"q_rope ({q_rope.shape[-1]}) must be narrower than q_latent ({q_latent.shape[-1]})")
    if q_latent.shape[:-1] != q_rope.shape[:-1]:
        raise ValueError(f"q_latent {q_latent.shape} and q_rope {q_rope.shape} disagree before the last dim")
    return q_latent, q_rope, squeeze


def check_chunk_query(q_latent: jax.Array) -> None:
    """A chunk (prefill) query must be [B, T, H, D]; a 3-D one is a decode query."""
    if q_latent.ndim != 4:
        raise ValueError(f"q_latent must be [B, T, H, {LATENT_DIM}], got {q_latent.shape}")


def check_cache_args(kv_pages: Any, block_table: jax.Array, batch: int, **lengths: jax.Array) -> None:
    """Shape and dtype checks shared by references and kernels: the pool (values or `Fp8Pages`), the page
    table, and each per-sequence length or position in `lengths` (by its argument name) as [B] integers."""
    if is_fp8_cache(kv_pages):
        p, ps, lat = kv_pages.latent.shape if kv_pages.latent.ndim == 3 else (None, None, None)
        want = ((p, ps, lat), (p, fp8_blocks(lat or 0), ps), (p, ps, kv_pages.rope.shape[-1]))
        got = tuple(x.shape for x in kv_pages)
        if p is None or got != want or kv_pages.latent.dtype != jnp.float8_e4m3fn:
            raise ValueError("FP8 kv_pages must be latent [P, page_size, L] float8_e4m3fn, scale "
                             f"[P, ceil(L/128), page_size], rope [P, page_size, R], got "
                             f"{[(x.shape, str(x.dtype)) for x in kv_pages]}")
    elif kv_pages.ndim != 3:
        raise ValueError(f"kv_pages must be [num_pages, page_size, latent + rope], got {kv_pages.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B={batch}, max_pages], got {block_table.shape}")
    for name, x in (("block_table", block_table), *lengths.items()):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {x.dtype}")
        if name != "block_table" and x.shape != (batch,):
            raise ValueError(f"{name} must be [B={batch}], got {x.shape}")


def clamp_page_ids(block_table: jax.Array, num_pages: int) -> jax.Array:
    """The rule for page ids outside [0, num_pages): the nearest end page. Kernels and references both
    apply it, so a bad table reads only the pool and both give the same result (a kernel has no way to
    raise on a traced id, and an unclamped id is a read outside the pool on the GPU)."""
    return jnp.clip(block_table, 0, num_pages - 1)


def kernel_shape_error(latent: int, rope: int, kv_shape: tuple[int, ...]) -> str | None:
    """Why the kernels cannot take these widths / this page size (None when they can). The reference
    takes any latent width and page size; the kernels need DeepSeek's 512 + 64 and `PAGE_SIZE`."""
    if latent != LATENT_DIM or rope != ROPE_DIM or kv_shape[-1] != KV_DIM:
        return (f"the Pallas kernel needs q_latent/q_rope/kv_pages widths {LATENT_DIM}/{ROPE_DIM}/{KV_DIM}, "
                f"got {latent}/{rope}/{kv_shape[-1]}")
    if kv_shape[1] != PAGE_SIZE:
        return f"the Pallas kernel needs page_size {PAGE_SIZE}, got kv_pages {tuple(kv_shape)}"
    return None


def check_kernel_args(q_latent: jax.Array, q_rope: jax.Array, kv_pages: Any, block_table: jax.Array,
                      *, fp8_pages: bool = False, **lengths: jax.Array) -> None:
    """All checks the kernels make on [B, Q, H, D] queries before launching (`lengths` as in
    `check_cache_args`). A value-cache kernel (`fp8_pages=False`) takes a cache of q's 16-bit dtype; the
    FP8-page kernel (`mla_decode_fp8`, `fp8_pages=True`) takes `Fp8Pages` and bf16 queries."""
    check_cache_args(kv_pages, block_table, q_latent.shape[0], **lengths)
    if is_fp8_cache(kv_pages) != fp8_pages:
        raise ValueError("FP8 pages go to the FP8-page kernel (mla_decode_fp8; mla_prefill routes them), a "
                         f"value cache to mla_decode's; got {type(kv_pages).__name__}, fp8_pages={fp8_pages}")
    err = kernel_shape_error(q_latent.shape[-1], q_rope.shape[-1], cache_widths(kv_pages))
    if err:
        raise ValueError(err)
    if is_fp8_cache(kv_pages):  # the FP8-page kernel (mla_decode_fp8) computes in bf16
        if kv_pages.latent.shape[-1] != LATENT_DIM:
            raise ValueError(f"the FP8-page kernel needs latent width {LATENT_DIM}, got "
                             f"{kv_pages.latent.shape}")
        if q_latent.dtype != jnp.bfloat16 or q_rope.dtype != jnp.bfloat16:
            raise ValueError(f"the FP8-page kernel takes bf16 queries, got {q_latent.dtype}, {q_rope.dtype}")
        return
    if q_latent.dtype not in KERNEL_DTYPES or kv_pages.dtype != q_latent.dtype:
        raise ValueError(
            f"q_latent, q_rope and kv_pages must share a 16-bit float dtype, got {q_latent.dtype}, "
            f"{q_rope.dtype}, {kv_pages.dtype}"
        )


def mask_padding_rows(out: jax.Array, lse: jax.Array, chunk_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Zero out / -inf the rows t >= chunk_lens[b] of [B, T, H, ...] results."""
    valid = jnp.arange(out.shape[1])[None, :] < chunk_lens[:, None]  # [B, T]
    out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(valid[:, :, None], lse, -jnp.inf)
    return out, lse
