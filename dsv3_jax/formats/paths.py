"""Path containment: every file a checkpoint names must lie inside that checkpoint's directory.

Owns: the one rule for resolving a name found *inside* a directory's files (a safetensors index entry,
a manifest's `params_dir`, tokenizer and template files) to a path: relative, no `..`, and resolving
(symlinks followed) inside the directory. One exception, because it is how Hugging Face stores every
downloaded model: in a hub cache snapshot (`.../snapshots/<rev>/`), files are symlinks into the repo's
`blobs/` folder, and those are accepted. Anything else is refused with `PathContainmentError` naming
the entry. Must not read file contents (no jax, no numpy: the converter's CLI imports it).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath


class PathContainmentError(ValueError):
    """A name a checkpoint file gives leaves the checkpoint directory (absolute, `..`, or a symlink)."""


def _hub_blobs(root: Path) -> Path | None:
    """The `blobs/` folder of a Hugging Face hub cache snapshot directory, else None."""
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        return (root.parent.parent / "blobs").resolve()
    return None


def _inside(path: Path, base: Path) -> bool:
    return path == base or base in path.parents


def contained(root: str | os.PathLike, entry: object, what: str) -> Path:
    """`root / entry` after checking that `entry` (a string some file in `root` named) stays inside root.

    `what` says where the name came from (e.g. "model.safetensors.index.json entry for tensor X"); it
    starts the error message. The file need not exist (callers report missing files themselves).
    """
    if not isinstance(entry, str) or not entry or "\x00" in entry:
        raise PathContainmentError(f"{what}: {entry!r} is not a file name")
    if PurePosixPath(entry).is_absolute() or PureWindowsPath(entry).is_absolute() or entry.startswith("~"):
        raise PathContainmentError(f"{what}: {entry!r} is an absolute path; files must lie inside {root}")
    parts = PurePosixPath(entry.replace("\\", "/")).parts
    if ".." in parts:
        raise PathContainmentError(f"{what}: {entry!r} climbs out of the directory with '..'")
    root = Path(root)
    path = root / entry
    real_root = root.resolve()
    real = path.resolve()
    if _inside(real, real_root):
        return path
    blobs = _hub_blobs(real_root)
    if blobs is not None and _inside(real, blobs):
        return path
    raise PathContainmentError(f"{what}: {entry!r} is a symbolic link to {real}, outside {root}")


def regular_file_inside(root: str | os.PathLike, path: str | os.PathLike, what: str) -> Path:
    """`path` (already inside `root` by name) if it is a regular file resolving inside root; else refuse."""
    path = Path(path)
    contained(root, os.path.relpath(path, root), what)
    if not path.is_file():
        raise PathContainmentError(f"{what}: {path.name!r} is not a regular file")
    return path
