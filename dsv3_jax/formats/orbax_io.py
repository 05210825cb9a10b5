"""The converted checkpoint's array store: one Orbax-readable zarr array per parameter leaf.

Owns: the on-disk layout of `DST/params/` (the layout Orbax's PyTreeCheckpointer writes without OCDBT:
a zarr v2 array per leaf named by its dotted tree path, plus the `_METADATA` tree description), the
chunking rule, creating each array through tensorstore and writing its chunk files slab by slab
(`ChunkFiles`; a stacked [L, E, out, in] leaf is never held whole), checking a leaf's files before
reading them (`check_leaf_files`), and restoring leaves onto given
shardings with Orbax so that each process reads only the chunks its devices hold. Must not know HF
names or the model's math.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

LeafPath = tuple[str, ...]
log = logging.getLogger(__name__)
PARAMS_DIR = "params"
METADATA = "_METADATA"
_TS_DTYPES = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn",
              np.dtype(np.float32): "<f4", np.dtype(np.float16): "<f2"}
DTYPE_NAMES = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn",
               np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
# No chunk cache: every write goes straight to the file, so memory stays at the slab being written.
# No fsync per chunk (tensorstore's default): it cut throughput ~5x; the converter syncs once at the end.
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": False,
                       "file_io_concurrency": {"limit": 16}, "data_copy_concurrency": {"limit": 4}})


@dataclasses.dataclass(frozen=True)
class ChunkPolicy:
    """How leaves are chunked: per-layer slabs up to `small_bytes` are one chunk; larger 2-D tensors are
    split into (`rows`, `cols`) tiles (multiples of 128, so chunks line up with FP8 blocks).

    `cols` 8192 covers DeepSeek-V3's 7168-wide inputs whole: such a chunk is a contiguous byte range of
    the source tensor (copied file to file by the kernel), and no sharding rule splits that input
    dimension, so restoring never reads more than it needs there. Wider inputs (o_proj's 16384, the
    dense MLP's 18432) are split at 8192, which tensor-parallel restores read up to 4x of.
    """

    small_bytes: int = 16 << 20
    rows: int = 2048
    cols: int = 8192

    def __post_init__(self) -> None:
        if self.rows % 128 or self.cols % 128 or self.rows <= 0 or self.cols <= 0:
            raise ValueError(f"ChunkPolicy rows/cols must be positive multiples of 128, got "
                             f"{self.rows}/{self.cols}")


def leaf_name(path: LeafPath) -> str:
    return ".".join(path)


def chunks_for(shape: tuple[int, ...], n_lead: int, itemsize: int, policy: ChunkPolicy,
               whole: bool = False) -> tuple[tuple[int, ...], bool]:
    """(chunk shape, whether one chunk holds a whole per-layer slab) for a leaf with `n_lead` stacking
    dims. A whole-slab leaf is written once per layer; otherwise each stacked tensor is written in row
    slabs of `policy.rows` that cover whole chunks (no read-modify-write). `whole` forces one chunk per
    slab (FP8 scale leaves: 1/16384 of their weight's size)."""
    inner = shape[1:] if n_lead else shape
    small = int(np.prod(inner, dtype=np.int64)) * itemsize <= policy.small_bytes
    if whole or small or len(shape) - n_lead != 2:
        return ((1, *inner) if n_lead else tuple(shape)), True
    r, c = shape[-2:]
    return (*(1,) * n_lead, min(r, policy.rows), min(c, policy.cols)), False


def open_leaf(root: Path, path: LeafPath, shape: tuple[int, ...], dtype: np.dtype,
              chunks: tuple[int, ...]) -> ts.TensorStore:
    """Create (or reopen, for --resume) the zarr array of one leaf under `root`."""
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(root / leaf_name(path))},
            "metadata": {"shape": list(shape), "chunks": list(chunks), "dtype": _TS_DTYPES[np.dtype(dtype)],
                         "compressor": None, "dimension_separator": ".", "fill_value": None},
            # Write every chunk, zeros included: the chunk set is the same whatever the data.
            "store_data_equal_to_fill_value": True}
    return ts.open(spec, create=True, open=True, context=_CONTEXT).result()


_SCRATCH = threading.local()


def scratch_bytes(slot: str, nbytes: int) -> np.ndarray:
    """This thread's reusable byte buffer `slot`, at least `nbytes` long (a view of exactly `nbytes`).

    Reused rather than allocated per slab: fresh large buffers are new pages the kernel must fault in
    and zero, which cost the converter more CPU than its reads and writes. Valid until the thread asks
    for the same slot again."""
    buf = getattr(_SCRATCH, slot, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, np.uint8)
        setattr(_SCRATCH, slot, buf)
    return buf[:nbytes]


class ChunkFiles:
    """Writes a leaf's chunks as zarr v2 chunk files directly, bypassing tensorstore's write path.

    Why: with no compressor a zarr v2 chunk is just its C-order bytes in a file named by the chunk's
    grid index ("0.3.1"), edge chunks padded to the full chunk shape. tensorstore's write path copies
    each block into a freshly allocated, zero-filled chunk buffer and writes a temporary file that it
    renames; on the benchmark box that tripled the CPU time of a plain `cp`. Here a chunk is at most
    one copy into a per-thread scratch buffer (none when the block already is the chunk) and one
    write(). tensorstore still creates the array (`open_leaf`, the `.zarray` metadata) and reads it back,
    so the format stays whatever tensorstore and Orbax read; the tests read every leaf back through them.
    Atomicity is the converter's (temporary directory, per-unit journal, rename at the end), not per file.
    """

    def __init__(self, root: Path, path: LeafPath, shape: tuple[int, ...], dtype: np.dtype,
                 chunks: tuple[int, ...]):
        self.dir = Path(root) / leaf_name(path)
        self.shape, self.dtype, self.chunks = tuple(shape), np.dtype(dtype), tuple(chunks)

    @property
    def holds_whole_rows(self) -> bool:
        """Whether each chunk is whole rows of one 2-D slab, i.e. a contiguous byte range of it."""
        return self.chunks[-1] == self.shape[-1] and all(c == 1 for c in self.chunks[:-2])

    def _chunk_path(self, idx: tuple[int, ...]) -> Path:
        return self.dir / (".".join(map(str, idx)) if idx else "0")

    def _chunk_range(self, ax: int, st: int, end: int) -> range:
        """Chunk indices covering [st, end) of axis `ax`, which must be whole chunks (the last one may
        end at the array's edge): anything else would need a read-modify-write, so it is refused."""
        ch, size = self.chunks[ax], self.shape[ax]
        if st % ch or end > size or (end % ch and end != size):
            raise ValueError(f"{self.dir.name}: rows [{st}, {end}) of axis {ax} are not whole chunks "
                             f"of {ch} (size {size})")
        return range(st // ch, -(-end // ch))

    def write(self, start: tuple[int, ...], block: np.ndarray) -> None:
        """Write `block` at `start`; the region must consist of whole chunks (the last chunk along an axis
        may end at the array's edge). Anything else would need a read-modify-write: refused."""
        if block.ndim != len(self.shape) or len(start) != len(self.shape) or block.dtype != self.dtype:
            raise ValueError(f"{self.dir.name}: block {block.shape} {block.dtype} at {start} does not fit "
                             f"the leaf {self.shape} {self.dtype}")
        grid = [self._chunk_range(ax, st, st + n) for ax, (st, n) in enumerate(zip(start, block.shape))]
        for idx in itertools.product(*grid):
            piece = block[tuple(slice(i * ch - st, i * ch - st + ch)
                                for i, ch, st in zip(idx, self.chunks, start, strict=True))]
            self._write_chunk(idx, piece)

    def copy_rows(self, start: tuple[int, ...], src: Path, offset: int, nrows: int) -> None:
        """Fill rows [start[-2], start[-2] + nrows) of the leaf's last two axes at `start` from `nrows`
        full-width rows stored contiguously in the file `src` at byte `offset`, without passing the data
        through Python: each chunk file is made by the kernel (`os.sendfile`, file to file, any
        filesystem). Needs chunks that span the full width and one index along every leading axis."""
        if len(start) != len(self.shape) or not self.holds_whole_rows:
            raise ValueError(f"{self.dir.name}: chunks {self.chunks} do not hold whole rows; use write()")
        ch, end = self.chunks[-2], start[-2] + nrows
        row_bytes = self.shape[-1] * self.dtype.itemsize
        with open(src, "rb", buffering=0) as fin:
            for i in self._chunk_range(len(self.shape) - 2, start[-2], end):
                n = min(ch, end - i * ch)
                with open(self._chunk_path((*start[:-2], i, 0)), "wb", buffering=0) as fout:
                    _copy_bytes(fin, fout, offset + (i * ch - start[-2]) * row_bytes, n * row_bytes)
                    if n < ch:  # zarr v2 stores edge chunks whole: extend with zeros (sparse)
                        os.ftruncate(fout.fileno(), ch * row_bytes)
                    _start_writeback(fout)

    def _write_chunk(self, idx: tuple[int, ...], piece: np.ndarray) -> None:
        if piece.shape == self.chunks and piece.flags.c_contiguous:
            data = piece
        else:  # a tile of wider rows, or an edge chunk: assemble it in the thread's scratch buffer
            nbytes = int(np.prod(self.chunks, dtype=np.int64)) * self.dtype.itemsize
            data = scratch_bytes("chunk", nbytes).view(self.dtype).reshape(self.chunks)
            if piece.shape != self.chunks:
                data[...] = 0  # zarr v2 stores edge chunks whole; the padding is never read
            data[tuple(slice(0, n) for n in piece.shape)] = piece
        with open(self._chunk_path(idx), "wb", buffering=0) as f:
            view = memoryview(data.reshape(-1).view(np.uint8))
            while view:  # write() may be partial for large buffers
                view = view[f.write(view):]
            _start_writeback(f)


def _start_writeback(f: Any) -> None:
    """Start writing the file's dirty pages to disk now, without waiting (Linux: fadvise DONTNEED starts
    asynchronous writeback, then drops the pages that are clean). Left alone, the kernel writes back
    only under memory pressure or after ~30 s, so the converter's closing fsync found nearly all of the
    output still in memory and waited for it serially; started early, writeback overlaps the reads."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


_SENDFILE_WORKS = True


def _copy_bytes(fin: Any, fout: Any, offset: int, count: int) -> None:
    """Copy `count` bytes at `offset` of `fin` to the current position of `fout`, in the kernel when
    the platform can (Linux sendfile between regular files); else, logged once, through a buffer."""
    global _SENDFILE_WORKS
    if _SENDFILE_WORKS:
        try:
            done = 0
            while done < count:
                n = os.sendfile(fout.fileno(), fin.fileno(), offset + done, count - done)
                if n == 0:
                    raise EOFError(f"{fin.name}: ended {count - done} bytes early")
                done += n
            return
        except (OSError, AttributeError) as e:
            if done:
                raise
            _SENDFILE_WORKS = False
            log.warning("in-kernel file copy (os.sendfile) unavailable here (%r): copying chunk data "
                        "through user memory instead, which costs more CPU", e)
    fin.seek(offset)
    left = count
    while left:
        block = fin.read(min(left, 64 << 20))
        if not block:
            raise EOFError(f"{fin.name}: ended {left} bytes early")
        fout.write(block)
        left -= len(block)


def write_tree_metadata(root: Path, shapes: Mapping[LeafPath, tuple[int, ...]]) -> None:
    """Orbax's `_METADATA` (PyTree structure + per-leaf write shape); written once all leaves exist."""
    tree = {str(p): {"key_metadata": [{"key": k, "key_type": 2} for k in p],  # 2: dict key
                     "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                        "write_shape": list(s)}}
            for p, s in shapes.items()}
    meta = {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    tmp = root / (METADATA + ".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, root / METADATA)


class ChunkError(ValueError):
    """A leaf's array files are missing, truncated or do not match the manifest (names leaf and file)."""


def check_leaf_files(root: Path, name: str, shape: tuple[int, ...], dtype: str,
                     chunks: tuple[int, ...]) -> None:
    """Check that leaf `name`'s zarr metadata matches (shape, dtype, chunks) and that every chunk file
    exists with the full chunk size (uncompressed zarr v2 stores edge chunks whole).

    Costs one directory listing and one stat per chunk, no data: run before a restore, so a damaged
    checkpoint is one error naming the leaf and the file instead of an error from deep inside the
    asynchronous restore.
    """
    d = Path(root) / name
    meta_file = d / ".zarray"
    try:
        meta = json.loads(meta_file.read_text())
        ok = (meta["shape"] == list(shape) and meta["chunks"] == list(chunks)
              and meta["dtype"] == _TS_DTYPES[DTYPES_BY_NAME[dtype]] and meta.get("compressor") is None)
    except FileNotFoundError:
        raise ChunkError(f"leaf {name}: its array metadata {meta_file} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ChunkError(f"leaf {name}: its array metadata {meta_file} is unreadable ({e!r})") from None
    if not ok:
        raise ChunkError(f"leaf {name}: {meta_file} says shape {meta.get('shape')} chunks "
                         f"{meta.get('chunks')} dtype {meta.get('dtype')}, the manifest {list(shape)} "
                         f"{list(chunks)} {dtype}")
    want = int(np.prod(chunks, dtype=np.int64)) * DTYPES_BY_NAME[dtype].itemsize
    grid = [range(-(-n // c)) if n else range(0) for n, c in zip(shape, chunks, strict=True)]
    sizes: dict[str, int] = {}
    with os.scandir(d) as it:
        for e in it:
            if not e.name.startswith("."):
                sizes[e.name] = e.stat().st_size
    for idx in itertools.product(*grid):
        f = ".".join(map(str, idx)) if idx else "0"
        if f not in sizes:
            raise ChunkError(f"leaf {name}: chunk file {d / f} is missing")
        if sizes[f] != want:
            raise ChunkError(f"leaf {name}: chunk file {d / f} has {sizes[f]} bytes, a chunk has {want} "
                             "(truncated or damaged)")


def read_leaf(root: Path, path: LeafPath) -> np.ndarray:
    """One whole leaf as numpy (tests and tools; the loader uses `restore`)."""
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(Path(root) / leaf_name(path))}}
    return ts.open(spec, open=True, context=_CONTEXT).result().read().result()


def restore(root: Path, leaves: Mapping[LeafPath, tuple[tuple[int, ...], np.dtype]],
            shardings: Mapping[LeafPath, Any]) -> dict[str, Any]:
    """Restore `leaves` ({path: (shape, dtype to restore as)}) as jax.Arrays placed on `shardings`.

    Orbax reads, for every leaf, only the chunks that intersect the shards of this process's devices.
    """
    import orbax.checkpoint as ocp

    args: dict[str, Any] = {}
    item: dict[str, Any] = {}
    for p, (shape, dtype) in leaves.items():
        a, t = args, item
        for k in p[:-1]:
            a, t = a.setdefault(k, {}), t.setdefault(k, {})
        a[p[-1]] = ocp.ArrayRestoreArgs(sharding=shardings[p], global_shape=tuple(shape), dtype=dtype)
        t[p[-1]] = 0
    ckpt = ocp.PyTreeCheckpointer()
    return ckpt.restore(Path(root).absolute(),
                        args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))
