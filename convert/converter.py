"""HF safetensors shards -> converted checkpoint (Orbax params + config + tokenizer + manifest).

Owns: planning the conversion (which tree leaf each HF tensor fills, in which dtype: copy, cast, FP8
quantize or dequantize), running it in resumable units (one unit = one leaf's slab for one layer, or an
unstacked leaf), streaming each tensor in row slabs so memory is bounded by a few slabs per worker, the
temporary sibling directory with its plan and journal, the lock that keeps a second converter off the
same destination, what `--force` may replace (only a checkpoint this converter wrote, never the
source or a directory holding it), the final rename, the manifest (written last: its presence is what
makes a directory loadable) and the run's report. A run killed at any instant is completed by
`resume` to the same bytes. Validation lives in
validate.py, the array store in orbax_io.py, FP8 arithmetic in fp8_blocks.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import dataclasses
import errno
import fcntl
import json
import os
import re
import resource
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import psutil

from convert.validate import Source, inspect_source
from dsv3_jax.config import ModelConfig
from dsv3_jax.formats import fp8_blocks, hf_names, orbax_io
from dsv3_jax.formats.checkpoint import COMPLETE_MARKER
from dsv3_jax.formats.orbax_io import ChunkPolicy, LeafPath
from dsv3_jax.formats.paths import PathContainmentError, regular_file_inside
from dsv3_jax.formats.safetensors_io import DTYPES, SafetensorsError, TensorInfo, read_tensor

CONVERTER_VERSION = "1.0"
MANIFEST_FORMAT = "dsv3-jax-converted/1"
PLAN = "convert_plan.json"
JOURNAL = "convert_progress.jsonl"
OUT_DTYPES = ("auto", "bf16", "fp8")
EXTRA_FILES = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "chat_template*")
# Test hook (tests only, never set in use): seconds to sleep after each unit, and ten times that at
# each step of starting and finishing (before the plan is written, after it, after the metadata,
# half-way through the closing fsync, after the manifest, before the rename), so a test that SIGKILLs
# the converter at random moments lands in every phase of a small conversion.
TEST_DELAY_ENV = "DSV3_CONVERT_TEST_UNIT_DELAY"
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
_HP = {"bfloat16": BF16, "float32": F32, "float16": np.dtype(np.float16)}


class ConvertError(ValueError):
    """The conversion cannot start or continue (destination exists, stale partial run, bad option)."""


@dataclasses.dataclass
class LeafPlan:
    """One output leaf: where its data comes from and how it is stored."""

    path: LeafPath
    kind: str  # cast | fp8_copy | dequantize | quantize | scale (the companion of an FP8 weight)
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    whole: bool  # one chunk per layer slab, assembled in memory and written once
    n_lead: int  # stacking dims in front (layers, experts)
    entries: list[tuple[str, tuple[int, ...]]]
    scale: LeafPlan | None = None


@dataclasses.dataclass
class Unit:
    """The resumable unit of work: one leaf (with its scale companion) for one layer."""

    leaf: LeafPlan
    layer: int | None
    entries: list[tuple[str, tuple[int, ...]]]
    nbytes: int

    @property
    def id(self) -> str:
        return orbax_io.leaf_name(self.leaf.path) + ("" if self.layer is None else f"@{self.layer}")


@dataclasses.dataclass
class ConvertReport:
    """What a conversion did; `table()` is the closing summary the CLI prints."""

    src: str
    dst: str
    dtype: str
    tensors: int
    leaves: int
    bytes_in: int
    bytes_out: int
    seconds: float
    peak_rss: int
    baseline_rss: int
    units: int
    units_resumed: int
    notes: list[str]

    @property
    def gb_per_s(self) -> float:
        return self.bytes_in / max(self.seconds, 1e-9) / 1e9

    def table(self) -> str:
        rows = [("source", self.src), ("destination", f"{self.dst} ({self.dtype})"),
                ("tensors", f"{self.tensors:,} -> {self.leaves} leaves"),
                ("bytes in", f"{self.bytes_in / 1e9:,.3f} GB"),
                ("bytes out", f"{self.bytes_out / 1e9:,.3f} GB"),
                ("time", f"{self.seconds:,.1f} s"), ("throughput", f"{self.gb_per_s:,.2f} GB/s (bytes in)"),
                ("peak RSS", f"{self.peak_rss / 2**20:,.0f} MiB "
                             f"(at start {self.baseline_rss / 2**20:,.0f} MiB)"),
                ("units", f"{self.units} ({self.units_resumed} already done, resumed)" if self.units_resumed
                 else f"{self.units}")]
        w = max(len(k) for k, _ in rows)
        line = "-" * (w + 3 + max(len(v) for _, v in rows))
        out = ["dsv3-convert summary", line, *(f"{k:<{w}}   {v}" for k, v in rows), line]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


# ------------------------------------------------------------------------------------------ planning
def _is_scale(path: LeafPath) -> bool:
    return path[-1] == "scale" or path[-1].endswith("_scale")


def scale_path(path: LeafPath) -> LeafPath:
    """The tree path of a weight leaf's FP8 scale: .../weight -> .../scale, <proj>_weight -> <proj>_scale."""
    last = path[-1]
    return (*path[:-1], "scale" if last == "weight" else last[: -len("weight")] + "scale")


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "weight_scale_inv"


def _target(name: str, cfg: ModelConfig) -> hf_names.Target:
    t = hf_names.hf_target(name, cfg)
    if t is None and name == f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight_scale_inv":
        return hf_names.Target(("mtp", "eh_proj", "scale"), ())  # hf_names has no entry for it (yet)
    if t is None:
        raise KeyError(f"tensor {name} has no place in the model")  # validation rules this out
    return t


def _leaf_groups(cfg: ModelConfig, names: list[str]) -> dict[LeafPath, list[tuple[str, tuple[int, ...]]]]:
    groups: dict[LeafPath, list[tuple[str, tuple[int, ...]]]] = {}
    for n in names:
        t = _target(n, cfg)
        groups.setdefault(t.path, []).append((n, t.index))
    return groups


def plan_leaves(src: Source, out_dtype: str, policy: ChunkPolicy) -> list[LeafPlan]:
    """Every output leaf of converting `src` to `out_dtype` (auto | bf16 | fp8)."""
    cfg = src.cfg
    order = sorted(src.tensors, key=lambda n: (src.tensors[n].file.name, src.tensors[n].start))
    groups = _leaf_groups(cfg, order)
    quantizable = {_target(n, cfg).path
                   for n, (_, dt) in hf_names.expected_hf_tensors(cfg, fp8=True).items() if dt == "F8_E4M3"}
    out_fp8 = out_dtype == "fp8" or (out_dtype == "auto" and src.fp8)
    hp = BF16 if out_dtype == "bf16" else _HP[cfg.dtype]
    plans = []
    for path, entries in groups.items():
        if _is_scale(path):
            continue  # planned with its weight
        first = src.tensors[entries[0][0]]
        shape = hf_names.leaf_shape(cfg, path, entries, first.shape)
        n_lead = len(shape) - len(first.shape)
        if first.dtype == "F8_E4M3":
            kind = "fp8_copy" if out_fp8 else "dequantize"
        elif out_dtype == "fp8" and path in quantizable:
            kind = "quantize"
        else:
            kind = "cast"
        if kind in ("fp8_copy", "quantize"):
            dtype = fp8_blocks.FP8
        elif path[-1] == "e_score_correction_bias":
            dtype = DTYPES[first.dtype]  # the router bias stays fp32, as in the official checkpoints
        else:
            dtype = hp
        chunks, whole = orbax_io.chunks_for(shape, n_lead, dtype.itemsize, policy)
        leaf = LeafPlan(path, kind, shape, dtype, chunks, whole, n_lead, entries)
        if kind in ("fp8_copy", "quantize"):
            sshape = (*shape[:n_lead], *(fp8_blocks.n_blocks(s) for s in first.shape))
            schunks, _ = orbax_io.chunks_for(sshape, n_lead, 4, policy, whole=True)
            leaf.scale = LeafPlan(scale_path(path), "scale", sshape, F32, schunks, True, n_lead, entries)
        plans.append(leaf)
    return plans


def make_units(src: Source, leaves: list[LeafPlan]) -> list[Unit]:
    """Split leaves into per-layer units, ordered by where their first tensor lies in the source."""
    units = []
    for leaf in leaves:
        by_layer: dict[int | None, list] = {}
        for name, ix in leaf.entries:
            by_layer.setdefault(ix[0] if leaf.n_lead else None, []).append((name, ix))
        for layer, entries in by_layer.items():
            n = sum(src.tensors[name].nbytes for name, _ in entries)
            if leaf.kind in ("fp8_copy", "dequantize"):
                n += sum(src.tensors[_scale_name(name)].nbytes for name, _ in entries)
            units.append(Unit(leaf, layer, entries, n))

    def where(u: Unit) -> tuple[str, int]:
        t = min((src.tensors[n] for n, _ in u.entries), key=lambda t: (t.file.name, t.start))
        return t.file.name, t.start

    return sorted(units, key=where)


def output_config(src: Source, out_fp8: bool, hp: str, ue8m0: bool) -> dict[str, Any]:
    """The destination's config.json: the source's, with dtype, quantization and MTP made true."""
    d = copy.deepcopy(src.config)
    if out_fp8 and not src.fp8:
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}
        if ue8m0:
            d["quantization_config"]["scale_fmt"] = "ue8m0"
    elif not out_fp8:
        d.pop("quantization_config", None)
    d["torch_dtype"] = hp
    if "dtype" in d:
        d["dtype"] = hp
    if not src.has_mtp and src.cfg.num_nextn_predict_layers:
        d["num_nextn_predict_layers"] = 0
    ModelConfig.from_hf_dict(d)  # must stay readable
    return d


# ------------------------------------------------------------------------------------------ one unit
def _read_rows(info: TensorInfo, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of a tensor (axis 0), read straight from the file into this thread's read buffer.

    The result is a view of that buffer (`orbax_io.scratch_bytes`), valid until the thread's next call:
    every caller copies, converts or writes it before reading on.
    """
    dt = DTYPES[info.dtype]
    row = int(np.prod(info.shape[1:], dtype=np.int64))
    nbytes = (r1 - r0) * row * dt.itemsize
    buf = orbax_io.scratch_bytes("read", nbytes)
    view, got = memoryview(buf), 0
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.start + r0 * row * dt.itemsize)
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise SafetensorsError(f"{info.file}: truncated while reading tensor {info.name!r}")
            got += n
    return buf.view(dt).reshape((r1 - r0, *info.shape[1:]))


def _row_slabs(shape: tuple[int, ...], rows: int) -> list[tuple[int, int]]:
    if len(shape) != 2:
        return [(0, shape[0] if shape else 1)]
    return [(r, min(r + rows, shape[0])) for r in range(0, shape[0], rows)]


class _Sink:
    """Receives one unit's row slabs for one leaf: buffers a whole slab, or writes tile rows directly."""

    def __init__(self, files: orbax_io.ChunkFiles, leaf: LeafPlan, layer: int | None):
        self.files, self.layer = files, layer
        self.lead = () if layer is None else (layer,)
        inner = leaf.shape[1:] if leaf.n_lead else leaf.shape
        self.buf = np.empty(inner, leaf.dtype) if leaf.whole else None
        self.bytes = 0

    def put(self, sub: tuple[int, ...], r0: int, r1: int, block: np.ndarray) -> None:
        self.bytes += block.nbytes
        if self.buf is not None:
            self.buf[sub][r0:r1] = block
        else:
            head = (*self.lead, *sub)
            start = (*head, r0, *(0,) * (block.ndim - 1))
            self.files.write(start, block.reshape((1,) * len(head) + block.shape))

    def copy(self, sub: tuple[int, ...], info: TensorInfo) -> bool:
        """Copy a whole tensor file to chunk files in the kernel when its chunks are contiguous byte
        ranges of it (tiled leaf, chunks spanning full rows, no dtype change); False if they are not."""
        if self.buf is not None or len(info.shape) != 2 or not self.files.holds_whole_rows:
            return False
        head = (*self.lead, *sub)
        self.files.copy_rows((*head, 0, 0), info.file, info.start, info.shape[0])
        self.bytes += info.nbytes
        return True

    def close(self) -> None:
        if self.buf is not None:
            self.files.write((*self.lead, *(0,) * self.buf.ndim), self.buf.reshape((1,) * len(self.lead)
                                                                                   + self.buf.shape))
            self.buf = None


def run_unit(unit: Unit, src: Source, stores: dict[LeafPath, orbax_io.ChunkFiles], policy: ChunkPolicy, *,
             ue8m0: bool, check_ue8m0: bool) -> tuple[int, list[str]]:
    """Convert one unit; returns (bytes written, names of scales that are not powers of two)."""
    leaf = unit.leaf
    w = _Sink(stores[leaf.path], leaf, unit.layer)
    s = _Sink(stores[leaf.scale.path], leaf.scale, unit.layer) if leaf.scale else None
    odd: list[str] = []
    for name, ix in sorted(unit.entries, key=lambda e: src.tensors[e[0]].start):
        sub = ix[1:] if leaf.n_lead else ix
        info = src.tensors[name]
        scale = None
        if leaf.kind in ("fp8_copy", "dequantize"):
            scale = read_tensor(src.tensors[_scale_name(name)])
            if check_ue8m0 and not fp8_blocks.is_power_of_two(scale).all():
                odd.append(_scale_name(name))
            if s is not None:
                s.put(sub, 0, scale.shape[0], scale)
        if leaf.kind in ("fp8_copy", "cast") and DTYPES[info.dtype] == leaf.dtype and w.copy(sub, info):
            continue
        for r0, r1 in _row_slabs(info.shape, policy.rows):
            x = _read_rows(info, r0, r1)
            b0, b1 = r0 // fp8_blocks.BLOCK, fp8_blocks.n_blocks(r1)
            if leaf.kind == "dequantize":
                x = fp8_blocks.dequantize(x, scale[b0:b1], leaf.dtype)
            elif leaf.kind == "quantize":
                x, sc = fp8_blocks.quantize(x, ue8m0=ue8m0)
                s.put(sub, b0, b1, sc)
            elif x.dtype != leaf.dtype:
                x = x.astype(leaf.dtype)
            w.put(sub, r0, r1, x)
    w.close()
    if s is not None:
        s.close()
    return w.bytes + (s.bytes if s else 0), odd


# ------------------------------------------------------------------------------------------ the run
def _large_allocations_via_mmap() -> None:
    """Make glibc serve every allocation >= 1 MiB with its own mmap, returned to the OS on free.

    By default glibc raises its mmap threshold after the first large free, after which slab-sized
    buffers come from per-thread heaps that keep their pages: RSS then grows to several hundred MB
    of freed slabs. Fixing the threshold keeps peak RSS at the slabs actually in flight.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def _temp_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.converting"


def _staging_dir(dst: Path) -> Path:
    """Where the temporary directory is prepared (plan written) before it is renamed into place, so
    `_temp_dir` never exists without its plan."""
    return dst.parent / f".{dst.name}.converting.new"


def _pause() -> None:
    """The test hook's pause at a phase boundary (see TEST_DELAY_ENV); nothing when unset."""
    delay = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
    if delay:
        time.sleep(10 * delay)


def _write_json(path: Path, obj: Any) -> None:
    """Write atomically and durably (tmp + fsync + rename + directory fsync)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _journal_done(tmp: Path) -> set[str]:
    done = set()
    if (tmp / JOURNAL).exists():
        for line in (tmp / JOURNAL).read_text().splitlines():
            try:
                done.add(json.loads(line)["unit"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut by the kill: that unit is simply redone
    return done


def _group_odd_scales(names: list[str]) -> str:
    kinds = Counter(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    return ", ".join(f"{k} ({v})" for k, v in sorted(kinds.items()))


# ------------------------------------------------------------------------ what may be touched, the lock
def _manifest(d: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint this converter wrote (complete), else None."""
    try:
        m = json.loads((d / COMPLETE_MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return m if isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT else None


def _is_ours(d: Path) -> bool:
    """Whether `d` is a (complete or interrupted) conversion this converter wrote."""
    return d.is_dir() and not d.is_symlink() and (_manifest(d) is not None or (d / PLAN).is_file())


def _inside(a: Path, b: Path) -> bool:
    """Whether `a` is `b` or lies under it (resolved paths)."""
    return a == b or b in a.parents


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    """Refuse a destination that would destroy anything but a checkpoint this converter wrote."""
    rs, rd = src.resolve(), dst.resolve()
    if rd == rs:
        raise ConvertError(f"destination {dst} is the source directory")
    tmp = _temp_dir(dst).resolve()
    if _inside(rs, tmp) or _inside(rs, _staging_dir(dst).resolve()):
        raise ConvertError(f"the source {src} lies inside the converter's working directory {tmp}")
    if not (dst.exists() or dst.is_symlink()):
        return
    if not force:
        raise ConvertError(f"destination {dst} already exists; pass --force to replace it")
    if _inside(rs, rd) or _inside(Path(os.path.abspath(src)), Path(os.path.abspath(dst))):
        raise ConvertError(f"--force refused: destination {dst} contains the source {src}; replacing it "
                           "would delete the source")
    if dst.is_symlink():
        raise ConvertError(f"--force refused: destination {dst} is a symbolic link; give the real path")
    if _manifest(dst) is None:
        raise ConvertError(f"--force refused: {dst} is not a checkpoint this converter wrote (no valid "
                           f"{COMPLETE_MARKER}); --force replaces only those. Remove it yourself if you "
                           "mean to")


def _remove_ours(d: Path) -> None:
    """Delete a directory this converter wrote, its manifest and plan last: a deletion cut short leaves
    a directory still recognisable as ours (and not loadable once the manifest is gone)."""
    keep = {COMPLETE_MARKER, PLAN}
    for root, dirs, files in os.walk(d, topdown=False):
        for name in files:
            if not (root == str(d) and name in keep):
                os.unlink(os.path.join(root, name))
        for name in dirs:
            p = os.path.join(root, name)
            os.unlink(p) if os.path.islink(p) else os.rmdir(p)
    (d / COMPLETE_MARKER).unlink(missing_ok=True)
    (d / PLAN).unlink(missing_ok=True)
    os.rmdir(d)


class _DestinationLock:
    """An exclusive lock on `DST` held for the whole run (flock on a sibling lock file).

    The kernel drops a flock when its holder dies, so a lock file left by a killed run is free and the
    next run takes it: no stale-lock guessing. The file is removed on release; a process that opened
    the old file before that notices (its inode is no longer the path's) and retries.
    """

    def __init__(self, dst: Path):
        self.dst, self.path = dst, dst.parent / f".{dst.name}.lock"
        self.fd: int | None = None

    def refuse_if_held(self) -> None:
        """Raise ConvertError if another process holds the lock now (a check before taking it)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._held() from None
            raise
        finally:
            os.close(fd)  # closing drops our probe's lock

    def _held(self) -> ConvertError:
        try:
            holder = f" (pid {int(self.path.read_text() or '0')})"
        except (OSError, ValueError):
            holder = ""
        return ConvertError(f"another conversion into {self.dst} is running{holder}; wait for it to finish "
                            "(or stop it and pass --resume)")

    def __enter__(self) -> _DestinationLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise self._held() from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
                self.fd = fd
                return self
            os.close(fd)  # released and removed by its holder meanwhile: lock the new file

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def _clear_stale_staging(dst: Path) -> None:
    """A staging directory left by a run killed while starting holds at most the plan: remove it."""
    stage = _staging_dir(dst)
    if not stage.exists():
        return
    names = {p.relative_to(stage).as_posix() for p in stage.rglob("*")}
    if stage.is_symlink() or not names <= {PLAN, PLAN + ".tmp", orbax_io.PARAMS_DIR}:
        raise ConvertError(f"{stage} exists and is not a conversion this converter started; remove it "
                           "yourself")
    shutil.rmtree(stage)


def _start_temp(tmp: Path, dst: Path, plan_doc: dict[str, Any]) -> None:
    """Create the temporary directory with its plan: prepared under another name, then renamed, so
    the directory a later `--resume` finds always has its plan."""
    stage = _staging_dir(dst)
    stage.mkdir()
    _pause()
    _write_json(stage / PLAN, plan_doc)
    (stage / orbax_io.PARAMS_DIR).mkdir()
    _pause()
    os.rename(stage, tmp)
    _fsync_dir(tmp.parent)


def _same_run(m: dict[str, Any], plan_doc: dict[str, Any]) -> bool:
    """Whether a manifest records a conversion of the same source with the same options and leaves."""
    return (m.get("source", {}).get("files") == plan_doc["source"] and m.get("options") == plan_doc["options"]
            and m.get("leaves") == plan_doc["leaves"])


def convert(src: str | Path, dst: str | Path, *, dtype: str = "auto", ue8m0: bool = False,
            include_mtp: bool = True, workers: int = 4, force: bool = False, resume: bool = False,
            progress: bool = True, policy: ChunkPolicy | None = None) -> ConvertReport:
    """Convert the HF directory `src` into the checkpoint directory `dst`.

    dtype: "auto" keeps what the source has (FP8 stays e4m3 + scales), "bf16" dequantizes/casts to
    bfloat16, "fp8" quantizes a high-precision source into 128x128 blocks (`ue8m0`: power-of-two
    scales). The whole source is validated before anything is written (`ValidationError`). Work goes to
    a hidden sibling of `dst` renamed into place at the end; `resume` continues an interrupted run
    (killed at any moment: the result is byte-identical to an uninterrupted run; a run that already
    finished is reported as such); `force` replaces an existing `dst` only if it is a checkpoint this
    converter wrote (its manifest), never the source or a directory containing it, and only once the
    new one is complete. A second conversion into the same `dst` is refused while one runs.
    """
    t0 = time.perf_counter()
    _large_allocations_via_mmap()
    baseline = psutil.Process().memory_info().rss
    policy = policy or ChunkPolicy()
    if dtype not in OUT_DTYPES:
        raise ConvertError(f"dtype must be one of {OUT_DTYPES}, got {dtype!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConvertError(f"workers must be a positive integer, got {workers!r}")
    src, dst = Path(src), Path(dst)
    _DestinationLock(dst).refuse_if_held()
    if not (resume and _manifest(dst) is not None):  # resume may find its own finished checkpoint there
        _check_destination(src, dst, force)
    tmp = _temp_dir(dst)
    if tmp.exists() and not (resume or force):
        raise ConvertError(f"{tmp} holds an interrupted conversion: pass --resume to continue it "
                           "or --force to start over")

    source = inspect_source(src, include_mtp=include_mtp)  # raises before anything is written
    notes = list(source.notes)
    out_fp8 = dtype == "fp8" or (dtype == "auto" and source.fp8)
    quantizing = dtype == "fp8" and not source.fp8
    if ue8m0 and not quantizing:
        notes.append("--ue8m0 applies only when quantizing a high-precision source; ignored")
        ue8m0 = False
    hp = "bfloat16" if dtype == "bf16" else source.cfg.dtype
    leaves = plan_leaves(source, dtype, policy)
    all_leaves = [x for leaf in leaves for x in (leaf, leaf.scale) if x is not None]
    config = output_config(source, out_fp8, hp, ue8m0)
    out_name = "float8_e4m3fn" if out_fp8 else hp
    plan_doc = {"converter_version": CONVERTER_VERSION, "source": source.fingerprint(),
                "options": {"dtype": dtype, "ue8m0": ue8m0, "include_mtp": include_mtp,
                            "policy": dataclasses.asdict(policy)},
                "leaves": {orbax_io.leaf_name(x.path): [list(x.shape), orbax_io.DTYPE_NAMES[x.dtype],
                                                        list(x.chunks)] for x in all_leaves}}

    dst.parent.mkdir(parents=True, exist_ok=True)
    with _DestinationLock(dst):
        # Decided again under the lock: another run may have finished or started meanwhile.
        finished = _manifest(dst) if resume and not tmp.exists() else None
        if finished is not None and _same_run(finished, plan_doc):
            report = _load_report(dst, t0, baseline)
            report.notes.append("the conversion had already finished; nothing to do")
            _clean_replaced(dst)
            return _finish_report(report, dst, t0)
        if resume and not force and dst.exists():
            raise ConvertError(f"destination {dst} already exists and is not this conversion's result; pass "
                               "--force as well to replace it")
        _check_destination(src, dst, force)
        _clear_stale_staging(dst)
        return _run(source, dst, tmp, plan_doc, leaves, all_leaves, config, out_name, notes,
                    workers=workers, force=force, resume=resume, progress=progress, policy=policy,
                    ue8m0=ue8m0, t0=t0, baseline=baseline)


def _run(source: Source, dst: Path, tmp: Path, plan_doc: dict[str, Any], leaves: list[LeafPlan],
         all_leaves: list[LeafPlan], config: dict[str, Any], out_name: str, notes: list[str], *, workers: int,
         force: bool, resume: bool, progress: bool, policy: ChunkPolicy, ue8m0: bool, t0: float,
         baseline: int) -> ConvertReport:
    """The conversion proper, under the destination lock."""
    done: set[str] = set()
    if tmp.exists() or tmp.is_symlink():
        if not _is_ours(tmp):
            raise ConvertError(f"{tmp} exists and is not a conversion this converter started; remove it "
                               "yourself")
        m = _manifest(tmp)
        if resume and m is not None:  # killed between the manifest and the rename
            if not _same_run(m, plan_doc):
                raise ConvertError(f"{tmp} holds a finished conversion of a different source or options; "
                                   "pass --force to start over")
            return _finish_rename(tmp, dst, force, _load_report(tmp, t0, baseline), t0)
        if resume:
            try:
                old = json.loads((tmp / PLAN).read_text())
            except (OSError, json.JSONDecodeError):
                old = None
            if old != plan_doc:
                raise ConvertError(f"{tmp} was started with a different source or options; rerun those, "
                                   "or pass --force to start over")
            done = _journal_done(tmp)
        else:
            _remove_ours(tmp)  # --force: start over
    if not tmp.exists():
        _start_temp(tmp, dst, plan_doc)
    params = tmp / orbax_io.PARAMS_DIR
    for x in all_leaves:  # tensorstore writes each array's metadata; the chunks are ours (ChunkFiles)
        orbax_io.open_leaf(params, x.path, x.shape, x.dtype, x.chunks)
    stores = {x.path: orbax_io.ChunkFiles(params, x.path, x.shape, x.dtype, x.chunks) for x in all_leaves}

    units = make_units(source, leaves)
    todo = [u for u in units if u.id not in done]
    check = source.fp8 and source.cfg.quantization.scale_fmt == "ue8m0"
    odd: list[str] = []
    n_tensors = len(source.tensors)
    tensors_done = sum(len(u.entries) * (2 if u.leaf.kind in ("fp8_copy", "dequantize") else 1)
                       for u in units if u.id in done)
    delay = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)

    def work(u: Unit) -> tuple[int, list[str]]:
        r = run_unit(u, source, stores, policy, ue8m0=ue8m0, check_ue8m0=check)
        if delay:
            time.sleep(delay)
        return r

    from tqdm.auto import tqdm  # renders as a widget in notebooks

    bar = tqdm(total=sum(u.nbytes for u in units), initial=sum(u.nbytes for u in units if u.id in done),
               unit="B", unit_scale=True, desc="converting", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    bar.set_postfix_str(f"tensors {tensors_done}/{n_tensors}")
    jpath = tmp / JOURNAL
    if jpath.exists() and jpath.stat().st_size and not jpath.read_bytes().endswith(b"\n"):
        with open(jpath, "a") as j:  # a line cut by a kill: end it, so the next entry stays whole
            j.write("\n")
    with open(jpath, "a") as journal, cf.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(work, u): u for u in todo}
        try:
            for fut in cf.as_completed(futures):
                u = futures[fut]
                _, bad = fut.result()
                odd += bad
                journal.write(json.dumps({"unit": u.id}) + "\n")
                journal.flush()  # survives a killed process (page cache); a machine crash needs --force
                tensors_done += len(u.entries) * (2 if u.leaf.kind in ("fp8_copy", "dequantize") else 1)
                bar.update(u.nbytes)
                bar.set_postfix_str(f"tensors {tensors_done}/{n_tensors}")
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()
            raise
    bar.close()

    if check and done:  # units done before an interruption were checked then; check their scales again
        odd += [_scale_name(n) for u in units if u.id in done for n, _ in u.entries
                if not fp8_blocks.is_power_of_two(read_tensor(source.tensors[_scale_name(n)])).all()]
    if odd:
        notes.append(f"{len(odd)} weight_scale_inv tensors are not powers of two although config.json "
                     f"declares scale_fmt ue8m0: {_group_odd_scales(odd)}. Kept as exact fp32 scales "
                     "(the loader applies any fp32 scale), so the model is unchanged")

    # ---- finish: Orbax metadata, config and side files, data on disk, manifest, then the rename.
    # Every step is redone by --resume until the manifest exists; after it only the rename is left.
    orbax_io.write_tree_metadata(params, {x.path: x.shape for x in all_leaves})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _pause()
    copied = _copy_side_files(source.root, tmp, notes)
    bytes_out = sum(int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize for x in all_leaves)
    report = ConvertReport(str(source.root), str(dst), out_name, n_tensors, len(all_leaves), source.nbytes,
                           bytes_out, 0.0, 0, baseline, len(units), len(units) - len(todo), notes)
    manifest = {
        "format": MANIFEST_FORMAT, "converter_version": CONVERTER_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": {"path": str(source.root.resolve()), "files": source.fingerprint(),
                   "tensors": n_tensors, "bytes": source.nbytes, "fp8": source.fp8,
                   "mtp": source.has_mtp},
        "options": plan_doc["options"], "dtype": out_name, "params_dir": orbax_io.PARAMS_DIR,
        "leaves": plan_doc["leaves"], "bytes": bytes_out, "copied_files": copied,
        "ue8m0_nonconformant_scales": sorted(odd), "notes": notes,
    }
    _fsync_tree(tmp)  # every chunk durable before the manifest declares the checkpoint complete
    _write_json(tmp / COMPLETE_MARKER, manifest)
    _pause()
    return _finish_rename(tmp, dst, force, report, t0)


def _copy_side_files(root: Path, tmp: Path, notes: list[str]) -> list[str]:
    """Copy generation config, tokenizer and template files as regular files; a name that is not a
    regular file inside the source (a symlink out of it, a directory, a fifo) is skipped with a note."""
    copied = []
    for pattern in EXTRA_FILES:
        for f in sorted(root.glob(pattern)):
            try:
                regular_file_inside(root, f, f"side file {f.name}")
            except PathContainmentError as e:
                notes.append(f"not copied: {e}")
                continue
            shutil.copyfile(f, tmp / f.name)
            copied.append(f.name)
    return copied


def _fsync_tree(root: Path) -> None:
    paths = [os.path.join(d, name) for d, _, files in os.walk(root) for name in files]
    for i, p in enumerate(paths):
        if i == len(paths) // 2:
            _pause()
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d, _, _ in os.walk(root):
        _fsync_dir(Path(d))


def _load_report(d: Path, t0: float, baseline: int) -> ConvertReport:
    m = json.loads((d / COMPLETE_MARKER).read_text())
    return ConvertReport(m["source"]["path"], "", m["dtype"], m["source"]["tensors"], len(m["leaves"]),
                         m["source"]["bytes"], m["bytes"], 0.0, 0, baseline, 0, 0, list(m["notes"]))


def _finish_rename(tmp: Path, dst: Path, force: bool, report: ConvertReport, t0: float) -> ConvertReport:
    """Move the finished temporary directory into place (replacing an old checkpoint of ours)."""
    for f in (PLAN, JOURNAL):  # bookkeeping of the run; the manifest now says it is complete
        (tmp / f).unlink(missing_ok=True)
    _fsync_dir(tmp)
    _pause()
    if dst.exists():
        if not force:
            raise ConvertError(f"destination {dst} already exists; pass --force to replace it")
        # Checked by _check_destination under the same lock: dst is a checkpoint of ours.
        old = dst.parent / f".{dst.name}.replaced-{os.getpid()}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
        _remove_ours(old)
    else:
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
    _clean_replaced(dst)
    return _finish_report(report, dst, t0)


def _clean_replaced(dst: Path) -> None:
    """Delete old checkpoints a run killed during a --force replacement left beside a complete `dst`."""
    pattern = re.sub(r"([*?\[])", r"[\1]", f".{dst.name}.replaced-") + "*"
    for old in dst.parent.glob(pattern):
        if _is_ours(old):
            _remove_ours(old)


def _finish_report(report: ConvertReport, dst: Path, t0: float) -> ConvertReport:
    report.dst = str(dst)
    report.seconds = time.perf_counter() - t0
    report.peak_rss = peak_rss()
    return report


def peak_rss() -> int:
    """Peak resident bytes of this process's own address space.

    /proc's VmHWM starts afresh at exec; getrusage's ru_maxrss does not (a child forked from a large
    parent inherits the parent's size), so it is only the fallback off Linux.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
