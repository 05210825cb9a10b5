"""Reading and writing safetensors files with every dtype DeepSeek uses (BF16, F8_E4M3, F32, ...).

Owns: header parsing with validation against the file size and the format's rules (a truncated or
corrupt shard, overlapping or malformed offsets are named in the error), which shard files an HF
directory's index lists (each checked to lie inside the directory), lazy per-tensor reads (one tensor
in memory at a time), and a writer.
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
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a shard's header: (tensors by name, __metadata__).

    As the safetensors format requires: offsets are non-negative integers, each tensor's span matches
    its dtype and shape, spans do not overlap and together cover the data region without holes, and
    the data region ends where the file ends.
    """
    path = Path(path)
    if not path.exists():
        raise SafetensorsError(f"{path}: shard file is missing")
    if not path.is_file():
        raise SafetensorsError(f"{path}: not a regular file")
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
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{path}: corrupt header (__metadata__ is not an object)")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{path}: corrupt header entry for tensor {name!r}")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_int(s) and s >= 0 for s in shape):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(_int(o) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise SafetensorsError(f"{path}: tensor {name!r} has malformed data_offsets {offs!r}")
        a, b = offs
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if b - a != want:
            raise SafetensorsError(f"{path}: tensor {name!r} spans {b - a} bytes, its shape needs {want}")
        if base + b > size:
            raise SafetensorsError(f"{path}: truncated: tensor {name!r} ends at byte {base + b}, "
                                   f"file has {size}")
        out[name] = TensorInfo(path, name, dtype, tuple(shape), base + a, base + b)
    end = base
    for t in sorted(out.values(), key=lambda t: (t.start, t.end)):
        if t.start < end:
            raise SafetensorsError(f"{path}: tensor {t.name!r} (bytes {t.start - base}..{t.end - base}) "
                                   "overlaps another tensor's data")
        if t.start > end:
            raise SafetensorsError(f"{path}: {t.start - end} bytes before tensor {t.name!r} belong to no "
                                   "tensor (the format allows no holes)")
        end = t.end
    if end != size:
        raise SafetensorsError(f"{path}: {size - end} bytes after the last tensor belong to no tensor "
                               "(the format allows no trailing data)")
    return out, meta


def shard_files(root: str | os.PathLike) -> tuple[dict[str, str], list[str]]:
    """(weight_map, shard file names) of an HF directory: its index, or a single model.safetensors.

    Every index entry must be a string naming a file inside `root` (`dsv3_jax.formats.paths.contained`).
    Raises SafetensorsError (unreadable index), PathContainmentError, or FileNotFoundError (neither).
    """
    from dsv3_jax.formats.paths import contained

    root = Path(root)
    index = root / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SafetensorsError(f"{index}: unreadable ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SafetensorsError(f"{index}: 'weight_map' must be a non-empty object")
        for name, f in weight_map.items():
            contained(root, f, f"{INDEX} entry for tensor {name}")
        return weight_map, sorted(set(weight_map.values()))
    if (root / SINGLE).exists():
        contained(root, SINGLE, SINGLE)
        return {}, [SINGLE]
    raise FileNotFoundError(f"{root}: neither {INDEX} nor {SINGLE} exists")


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
