"""Checking a whole HF DeepSeek-V3 source directory against its config before anything is written.

Owns: reading `config.json` and the shard index, validating every shard header against its file size,
and comparing the tensors found with the names, shapes and dtypes the config implies (missing,
unexpected, wrong shape, wrong dtype). Every problem is collected and raised together as one
`ValidationError`. Also fingerprints the source (shard sizes and header hashes) for the manifest and
for `--resume`. Must not write anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from pathlib import Path
from typing import Any

from dsv3_jax.config import ConfigError, ModelConfig, read_json_object
from dsv3_jax.formats import hf_names
from dsv3_jax.formats.paths import PathContainmentError, contained
from dsv3_jax.formats.safetensors_io import (
    INDEX,
    SINGLE,
    SafetensorsError,
    TensorInfo,
    read_header,
    shard_files,
)


class ValidationError(ValueError):
    """The source directory does not match its config; `problems` lists every finding."""

    def __init__(self, src: Path, problems: list[str], limit: int = 40):
        self.src, self.problems = src, problems
        shown = problems[:limit]
        more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        n = len(problems)
        if n == 1:  # one line
            super().__init__(f"{src}: {problems[0]} (nothing was written)")
        else:
            super().__init__(f"{src}: {n} problems found, nothing was written:\n  - " + "\n  - ".join(shown)
                             + more)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    name: str
    size: int
    header_sha256: str
    tensors: int


@dataclasses.dataclass
class Source:
    """A validated source: its config (raw dict and parsed), tensors by name, shards, and findings."""

    root: Path
    config: dict[str, Any]
    cfg: ModelConfig
    tensors: dict[str, TensorInfo]
    shards: list[ShardInfo]
    fp8: bool
    has_mtp: bool
    notes: list[str]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def fingerprint(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(s) for s in self.shards]


def _header_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return hashlib.sha256(f.read(n)).hexdigest()


def _limited(label: str, names: list[str], limit: int = 12) -> str:
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"{label} ({len(names)}): " + ", ".join(names[:limit]) + more


def _mtp_prefix(cfg: ModelConfig) -> str:
    return f"model.layers.{cfg.num_hidden_layers}."


def inspect_source(src: str | Path, *, include_mtp: bool = True) -> Source:
    """Validate the HF directory `src` as a whole; raise `ValidationError` listing every problem."""
    root = Path(src)
    if not root.is_dir():
        raise ValidationError(root, ["source directory does not exist"])
    problems: list[str] = []
    try:
        contained(root, "config.json", "config.json")
        config = read_json_object(root / "config.json", "config.json")
        cfg = ModelConfig.from_hf_dict(config)
    except FileNotFoundError:
        raise ValidationError(root, ["config.json is missing"]) from None
    except (ConfigError, PathContainmentError) as e:
        raise ValidationError(root, [f"config.json: {e}"]) from None

    # ---- shard index and headers
    try:
        weight_map, files = shard_files(root)
    except FileNotFoundError:
        raise ValidationError(root, [f"neither {INDEX} nor {SINGLE} exists"]) from None
    except (SafetensorsError, PathContainmentError) as e:
        raise ValidationError(root, [str(e)]) from None
    tensors: dict[str, TensorInfo] = {}
    shards: list[ShardInfo] = []
    unreadable: set[str] = set()
    for f in files:
        try:
            found, _ = read_header(root / f)
        except SafetensorsError as e:
            problems.append(str(e))
            unreadable.add(f)
            continue
        shards.append(ShardInfo(f, (root / f).stat().st_size, _header_sha256(root / f), len(found)))
        for name, info in found.items():
            if name in tensors:
                problems.append(f"tensor {name} appears in both {tensors[name].file.name} and {f}")
            tensors[name] = info
    for name, f in sorted(weight_map.items()):
        if f in unreadable:
            continue
        if name not in tensors:
            problems.append(f"tensor {name}: listed in {INDEX} under {f} but absent from that shard")
        elif tensors[name].file != root / f:
            problems.append(f"tensor {name}: {INDEX} says {f}, found in {tensors[name].file.name}")
    skip = {n for n, f in weight_map.items() if f in unreadable}  # already reported through their shard

    # ---- names, shapes and dtypes against the config
    fp8 = cfg.quantization is not None
    expected = hf_names.expected_hf_tensors(cfg, fp8=fp8, include_mtp=True)
    notes: list[str] = []
    mtp = _mtp_prefix(cfg) if cfg.num_nextn_predict_layers else None
    has_mtp = bool(mtp) and any(n.startswith(mtp) for n in tensors)
    if mtp and not include_mtp:
        expected = {n: v for n, v in expected.items() if not n.startswith(mtp)}
        tensors = {n: v for n, v in tensors.items() if not n.startswith(mtp)}
        has_mtp = False
    elif mtp and not has_mtp and not any(n.startswith(mtp) for n in skip):
        expected = {n: v for n, v in expected.items() if not n.startswith(mtp)}
        notes.append(f"the source has no MTP layer ({mtp}*; transformers' save_pretrained drops it): "
                     "the output has none and its config says num_nextn_predict_layers = 0")
    missing = sorted(n for n in expected if n not in tensors and n not in skip)
    unexpected = sorted(n for n in tensors if n not in expected)
    if missing:
        problems.append(_limited("missing tensors", missing))
    if unexpected:
        problems.append(_limited("unexpected tensors (no place in the model)", unexpected))
    for name in sorted(set(expected) & set(tensors)):
        (shape, dtype), t = expected[name], tensors[name]
        if t.shape != tuple(shape):
            problems.append(f"tensor {name} in {t.file.name}: shape {list(t.shape)}, config implies "
                            f"{list(shape)}")
        elif t.dtype != dtype:
            problems.append(f"tensor {name} in {t.file.name}: dtype {t.dtype}, expected {dtype}")
    if not fp8 and any(t.dtype == "F8_E4M3" for t in tensors.values()):
        problems.append("some tensors are F8_E4M3 but config.json has no quantization_config "
                        "(the official FP8 checkpoints declare it)")
    if problems:
        raise ValidationError(root, problems)
    return Source(root, config, cfg, tensors, shards, fp8, has_mtp, notes)
