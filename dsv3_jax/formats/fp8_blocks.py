"""FP8 128x128 block (de)quantization of one weight row block, in numpy, for the streaming converter.

Owns: the official DeepSeek-V3 weight format's arithmetic on host memory: e4m3 values with one fp32
"scale_inv" per 128x128 block (W ~= W_fp8 * scale, block-broadcast; partial edge blocks cover only the
elements that exist), optional UE8M0 (power-of-two) scales, and the power-of-two check. Numerics follow
`pallas_kernels.fp8_quant.quantize_weight` (amax / 448, amax floored at 1e-10, UE8M0 rounds the scale
up). Works on any row block whose first row is a multiple of 128, so a tensor can be converted a slab
at a time. Must not know about files or model names.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0
BLOCK = 128
_AMAX_FLOOR = 1e-10  # keeps all-zero blocks finite (their fp8 values stay exactly 0)


def n_blocks(n: int) -> int:
    return -(-n // BLOCK)


def _pad_to_blocks(x: np.ndarray) -> np.ndarray:
    r, c = x.shape
    pr, pc = n_blocks(r) * BLOCK - r, n_blocks(c) * BLOCK - c
    return np.pad(x, ((0, pr), (0, pc))) if pr or pc else x


# Every e4m3 bit pattern's value: indexing this table converts e4m3 -> fp32 ~3x faster than astype.
_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)


def quantize(w: np.ndarray, *, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """[R, C] float -> (e4m3 [R, C], fp32 scale [ceil(R/128), ceil(C/128)]) with w ~= q * scale.

    Works one 128-row block at a time, so the fp32 temporaries are 128 rows, not the whole slab."""
    if w.ndim != 2:
        raise ValueError(f"quantize: w must be 2-D [out, in], got shape {w.shape}")
    r, c = w.shape
    cb = n_blocks(c)
    q = np.empty((r, c), FP8)
    scale = np.empty((n_blocks(r), cb), np.float32)
    for b, r0 in enumerate(range(0, r, BLOCK)):
        x = _pad_to_blocks(w[r0:r0 + BLOCK].astype(np.float32))
        blocks = x.reshape(x.shape[0], cb, BLOCK)
        amax = np.abs(blocks).max(axis=(0, 2))
        s = np.maximum(amax, _AMAX_FLOOR) / FP8_MAX
        if ue8m0:
            s = np.exp2(np.ceil(np.log2(s)))
        scale[b] = s
        blocks /= scale[b][None, :, None]
        q[r0:r0 + BLOCK] = np.clip(blocks, -FP8_MAX, FP8_MAX).astype(FP8).reshape(x.shape)[:r - r0, :c]
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """e4m3 [R, C] times its block scales [ceil(R/128), ceil(C/128)] -> `dtype` [R, C].

    One 128-row block at a time (fp32 temporaries of 128 rows), e4m3 decoded through a lookup table."""
    r, c = q.shape
    if scale.shape != (n_blocks(r), n_blocks(c)):
        raise ValueError(f"dequantize: scale shape {scale.shape} does not cover weight {q.shape} "
                         f"in 128x128 blocks (want {(n_blocks(r), n_blocks(c))})")
    out = np.empty((r, c), dtype)
    bits = q.view(np.uint8)
    for b, r0 in enumerate(range(0, r, BLOCK)):
        x = np.take(_E4M3_TO_F32, bits[r0:r0 + BLOCK])
        x *= np.repeat(scale[b].astype(np.float32), BLOCK)[:c]
        out[r0:r0 + BLOCK] = x
    return out


def is_power_of_two(scale: np.ndarray) -> np.ndarray:
    """Elementwise: is this (positive, finite) scale exactly 2^k, i.e. representable in UE8M0?"""
    mant, _ = np.frexp(scale.astype(np.float32))
    return (mant == 0.5) & np.isfinite(scale)
