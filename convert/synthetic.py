"""Synthetic HF checkpoints with real headers: full-scale checks without the weights.

Owns: writing a DeepSeek-V3 safetensors directory (config.json, shards, index) for any `ModelConfig`,
BF16 or the official FP8 layout, whose data regions are either sparse (the file is truncated to the size
its header promises: reads return zeros, the disk holds almost nothing) or random (for benchmarks that
must really read bytes). Used by the converter's tests and benchmark. Must not be imported by the
library at run time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from dsv3_jax.config import ModelConfig, QuantConfig
from dsv3_jax.formats.hf_names import expected_hf_tensors
from dsv3_jax.formats.safetensors_io import DTYPES


def _random_bytes(rng: np.random.Generator, dtype: str, n: int) -> bytes:
    """`n` elements of plausible data (no NaN/inf) for a safetensors dtype."""
    if dtype == "F8_E4M3":
        b = rng.integers(0, 256, n, dtype=np.uint8)
        return np.where((b & 0x7F) == 0x7F, b & 0xFE, b).astype(np.uint8).tobytes()  # 0x7F/0xFF are NaN
    if dtype == "F32":
        return rng.uniform(1e-4, 1e-3, n).astype(np.float32).tobytes()
    return (0.02 * rng.standard_normal(n, dtype=np.float32)).astype(DTYPES[dtype]).tobytes()


def write_checkpoint(dst: str | Path, cfg: ModelConfig, *, fp8: bool, data: str = "sparse",
                     shard_bytes: int = 5 << 30, include_mtp: bool = True, seed: int = 0) -> int:
    """Write a checkpoint of `cfg` into `dst`; returns the total tensor bytes. `data`: sparse | random."""
    if data not in ("sparse", "random"):
        raise ValueError(f"data must be 'sparse' or 'random', got {data!r}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if fp8 and cfg.quantization is None:
        cfg = cfg.replace(quantization=QuantConfig())
    elif not fp8:
        cfg = cfg.replace(quantization=None)
    tensors = expected_hf_tensors(cfg, fp8=fp8, include_mtp=include_mtp)
    shards: list[list[tuple[str, tuple[int, ...], str, int]]] = [[]]
    size = 0
    for name, (shape, dtype) in tensors.items():
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if size and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dtype, n))
        size += n
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape, dtype, n in shard:
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(dst / fname, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            if data == "sparse":
                f.truncate(8 + len(blob) + off)
            else:
                for _, _shape, dtype, n in shard:
                    f.write(_random_bytes(rng, dtype, n // DTYPES[dtype].itemsize))
        total += off
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (dst / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    return total
