"""Reading and writing safetensors files with every dtype DeepSeek uses (BF16, F8_E4M3, F32, ...).

Owns: header parsing with validation against the file size (a truncated or corrupt shard is named in
the error), lazy per-tensor reads (one tensor in memory at a time, via a memory map), and a writer.
The `safetensors` package's numpy backend has no bfloat16/float8, hence this small module.
Must not know about model names.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool),
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A shard is missing, truncated or has a corrupt header."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a shard's header: (tensors by name, __metadata__)."""
    path = Path(path)
    if not path.exists():
        raise SafetensorsError(f"{path}: shard file is missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: truncated ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: corrupt or truncated header (claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: corrupt header ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt header (not a JSON object)")
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{path}: corrupt header entry for tensor {name!r}") from e
        if dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if b - a != want or a < 0:
            raise SafetensorsError(f"{path}: tensor {name!r} spans {b - a} bytes, its shape needs {want}")
        if base + b > size:
            raise SafetensorsError(f"{path}: truncated: tensor {name!r} ends at byte {base + b}, "
                                   f"file has {size}")
        out[name] = TensorInfo(path, name, dtype, shape, base + a, base + b)
    return out, meta


def read_tensor(info: TensorInfo) -> np.ndarray:
    """Read one tensor (a private copy; the file is not held open)."""
    dt = DTYPES[info.dtype]
    count = info.nbytes // dt.itemsize
    with open(info.file, "rb") as f:
        f.seek(info.start)
        arr = np.fromfile(f, dtype=dt, count=count)
    if arr.size != count:
        raise SafetensorsError(f"{info.file}: truncated while reading tensor {info.name!r}")
    return arr.reshape(info.shape)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (numpy, any dtype in DTYPES) as one safetensors file."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    off = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
