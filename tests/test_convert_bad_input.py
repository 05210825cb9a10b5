"""Bad input to the converter: each case gives one clear error naming the file/tensor, exit code 2,
no traceback, and no destination (nor temporary) directory."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from convert.__main__ import main
from dsv3_jax.formats.safetensors_io import read_header, read_tensor, write_safetensors
from tests.hf_reference import make_hf_model, save_hf

ROOT = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return save_hf(make_hf_model("nolora"), tmp_path_factory.mktemp("good") / "src", shard_size="150KB")


def _shard_of(src: Path, tensor: str) -> Path:
    return src / json.loads((src / INDEX).read_text())["weight_map"][tensor]


def _rewrite(src: Path, tensor: str, new: np.ndarray | None, extra: dict | None = None) -> None:
    """Rewrite the shard holding `tensor` with it replaced (or dropped when `new` is None)."""
    shard = _shard_of(src, tensor)
    tensors = {n: read_tensor(t) for n, t in read_header(shard)[0].items()}
    if new is None:
        del tensors[tensor]
    else:
        tensors[tensor] = new
    tensors.update(extra or {})
    write_safetensors(shard, tensors)
    index = json.loads((src / INDEX).read_text())
    if new is None:
        del index["weight_map"][tensor]
    index["weight_map"].update({n: shard.name for n in extra or {}})
    (src / INDEX).write_text(json.dumps(index))


NORM = "model.layers.0.input_layernorm.weight"
EXPERT = "model.layers.2.mlp.experts.3.down_proj.weight"


def _truncated(src):
    shard = _shard_of(src, EXPERT)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    return [shard.name, "truncated"]


def _missing_shard(src):
    shard = _shard_of(src, EXPERT)
    shard.unlink()
    return [shard.name, "missing"]


def _missing_tensor(src):
    _rewrite(src, EXPERT, None)
    return ["missing tensors", EXPERT]


def _extra_tensor(src):
    _rewrite(src, NORM, read_tensor(read_header(_shard_of(src, NORM))[0][NORM]),
             extra={"model.layers.0.mlp.bogus.weight": np.zeros(4, np.float32)})
    return ["unexpected tensors", "model.layers.0.mlp.bogus.weight"]


def _wrong_shape(src):
    _rewrite(src, EXPERT, np.zeros((7, 5), np.float32))
    return [EXPERT, "shape [7, 5]"]


def _wrong_dtype(src):
    w = read_tensor(read_header(_shard_of(src, NORM))[0][NORM])
    _rewrite(src, NORM, w.astype(ml_dtypes.bfloat16))
    return [NORM, "dtype BF16, expected F32"]


def _corrupt_header(src):
    shard = _shard_of(src, NORM)
    with open(shard, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n // 2)
        f.write(b"\x00garbage{{")
    return [shard.name, "corrupt header"]


def _two_problems(src):  # everything is reported at once, not the first finding only
    _rewrite(src, NORM, np.zeros(3, np.float32))
    return _missing_shard(src) + [NORM, "shape [3]"]


CASES = {"truncated shard": _truncated, "missing shard": _missing_shard, "missing tensor": _missing_tensor,
         "extra tensor": _extra_tensor, "wrong shape": _wrong_shape, "wrong dtype": _wrong_dtype,
         "corrupt header": _corrupt_header, "two problems": _two_problems}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_source_is_refused_before_writing(good, tmp_path, capsys, case):
    src = tmp_path / "src"
    shutil.copytree(good, src)
    want = CASES[case](src)
    dst = tmp_path / "out" / "dst"
    assert main([str(src), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv3-convert: error:") and "nothing was written" in err
    for w in want:
        assert w in err, (w, err)
    assert "Traceback" not in err
    assert not dst.exists() and not (tmp_path / "out").exists()


def test_cli_subprocess_exit_code_and_no_traceback(good, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(good, src)
    want = _truncated(src)
    r = subprocess.run([sys.executable, "-m", "convert", str(src), str(tmp_path / "dst")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and all(w in r.stderr for w in want)
    assert "Traceback" not in r.stderr and not (tmp_path / "dst").exists()


def test_existing_destination_needs_force(good, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep").write_text("x")
    assert main([str(good), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and (dst / "keep").exists()


def test_missing_config_and_missing_source(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "dst")]) == 2
    assert "source directory does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(tmp_path / "dst")]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()
