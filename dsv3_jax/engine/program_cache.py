"""Compiled engine step programs on disk, loaded without tracing: what makes a second server start fast.

JAX's persistent compilation cache (enabled by executor.py) skips XLA's compile, but it keys on the lowered
program, so every start still traces and lowers each step program (the model, and Mosaic GPU's kernel
lowering: seconds per program on the full-width model). This store keys a serialized executable on what
determines the program instead, and loads it directly:

  the step key, the model's trace options and the XLA options (`executor.DeviceExecutor.compile_key`),
  the shapes, dtypes and shardings of the params, cache and state, the mesh (axis names, shape, device
  ids), the model config, the versions of jax and jaxlib, the devices' kind, and a hash of this
  package's and `pallas_kernels`' source files (so an edited model or kernel never loads an old program).

Files live beside JAX's cache (`<cache dir>/programs/<sha256>.bin`, written atomically); a file that
fails to load is logged, removed and recompiled. Like JAX's own cache, a file is executable code: the
directory must be as trusted as the user's home. Owns the key, the file format and the store.
Must not decide which programs an engine needs (core.py) nor compile anything (executor.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger(__name__)

_FORMAT = 1


@functools.cache
def source_digest() -> str:
    """sha256 over the source files of `dsv3_jax` and `pallas_kernels` (their paths and bytes)."""
    import pallas_kernels

    h = hashlib.sha256()
    for pkg in (Path(__file__).resolve().parents[1], Path(pallas_kernels.__file__).resolve().parent):
        for f in sorted(pkg.rglob("*.py")):
            h.update(str(f.relative_to(pkg.parent)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def jaxlib_version() -> str:
    import jaxlib

    return getattr(jaxlib, "__version__", "")


def _leaf_sig(x: Any) -> tuple:
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return (tuple(x.shape), str(x.dtype), str(spec) if spec is not None else type(sharding).__name__)


def program_id(compile_key: tuple, trees: Any, mesh: Any, model_config: Any) -> str:
    """The file name of a program: a digest of everything it depends on (see the module docstring)."""
    leaves, treedef = jax.tree.flatten(trees)
    dev = jax.devices()[0]
    mesh_sig = None if mesh is None else (tuple(mesh.axis_names), tuple(mesh.devices.shape),
                                          tuple(int(d.id) for d in mesh.devices.flat))
    parts = (_FORMAT, repr(compile_key), str(treedef), tuple(_leaf_sig(x) for x in leaves), mesh_sig,
             repr(model_config), jax.__version__, jaxlib_version(),
             dev.platform, getattr(dev, "device_kind", ""), jax.process_count(), jax.process_index(),
             source_digest())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ProgramStore:
    """Serialized compiled programs in one directory (None: a store that holds nothing)."""

    def __init__(self, directory: Path | None):
        self.dir = None if directory is None else Path(directory) / "programs"

    def load(self, pid: str, devices: list[Any]) -> Any | None:
        """The compiled program `pid` on `devices` (those it was compiled for: the mesh's, or the one
        default device), or None (absent, or unloadable: then removed and logged)."""
        if self.dir is None:
            return None
        path = self.dir / f"{pid}.bin"
        if not path.exists():
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            fmt, payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            if fmt != _FORMAT:
                raise ValueError(f"format {fmt}, expected {_FORMAT}")
            return deserialize_and_load(payload, in_tree, out_tree, backend=devices[0].client,
                                        execution_devices=devices)
        except Exception as e:  # a stale or damaged file: compile instead, never fail the start
            log.warning("program cache: %s did not load (%s: %s); compiling it", path.name,
                        type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None

    def save(self, pid: str, compiled: Any) -> bool:
        """Write `compiled` as `pid` (atomically); False (logged) when the program cannot be serialized."""
        if self.dir is None:
            return False
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(compiled)
            data = pickle.dumps((_FORMAT, payload, in_tree, out_tree))
        except Exception as e:
            log.warning("program cache: not saved (%s: %s)", type(e).__name__, e)
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{pid}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.dir / f"{pid}.bin")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True
