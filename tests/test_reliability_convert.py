"""Reliability of the converter (issue 12, classes 1-3): nothing destroyed, killed at any moment and
resumed to the same bytes, nothing read from outside the source.

The kill test SIGKILLs real converter processes at random moments (at least 20 kills) of a synthetic
conversion that the converter's test hook (`TEST_DELAY_ENV`) spreads over a few seconds, resumes each
one with `--resume`, and compares a hash of every file with an uninterrupted run. The processes are
forked from a server that has already imported the converter (multiprocessing's forkserver), so a
kill costs the conversion's time, not an interpreter start; they run the CLI's `main`, are real
processes and die by a real SIGKILL. The other cases run `python -m convert` as subprocesses.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convert.converter import JOURNAL, PLAN, TEST_DELAY_ENV
from convert.synthetic import write_checkpoint
from dsv3_jax.config import ModelConfig
from dsv3_jax.formats.checkpoint import COMPLETE_MARKER
from tests.reliability_child import run_converter

ROOT = Path(__file__).resolve().parents[1]
UNIT_DELAY = 0.006  # x 129 units / 2 workers + 6 phase pauses of 10x: ~1.2 s of conversion
MIN_KILLS = 20


def tree_hashes(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, str]:
    """sha256 of every file under `root` (relative path -> hash), symlinks by their target."""
    out = {}
    for p in sorted(root.rglob("*")):
        if any(p == s or s in p.parents for s in skip):
            continue
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def checkpoint_hashes(d: Path) -> dict[str, str]:
    """Hashes of a converted checkpoint; the manifest without its creation time."""
    h = tree_hashes(d)
    m = json.loads((d / COMPLETE_MARKER).read_text())
    m.pop("created")
    h[COMPLETE_MARKER] = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()
    return h


def run_cli(*args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "convert", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120)


def assert_one_clear_line(r: subprocess.CompletedProcess, *names: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("dsv3-convert: error:"), r.stderr
    for n in names:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A 4-layer synthetic BF16... (fp32, random data) checkpoint in 13 shards: 129 conversion units."""
    src = tmp_path_factory.mktemp("rel") / "src"
    write_checkpoint(src, ModelConfig.preset("tiny").replace(vocab_size=512), fp8=False, data="random",
                     shard_bytes=200_000)
    return src


# ------------------------------------------------------------------------------- 2. killed anywhere
def test_sigkill_at_random_moments_then_resume_is_byte_identical(source, tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.reliability_child", "convert.__main__", "convert.converter"])
    src_before = tree_hashes(source)

    def start(dst: Path, *flags: str) -> multiprocessing.Process:
        argv = [str(source), str(dst), "--quiet", "--workers", "2", *flags]
        p = ctx.Process(target=run_converter, args=(argv, TEST_DELAY_ENV, UNIT_DELAY))
        p.start()
        return p

    p = ctx.Process(target=os._exit, args=(0,))  # start the fork server (imports the converter) first
    p.start()
    p.join(60)
    ref = tmp_path / "ref"
    t = time.perf_counter()
    p = start(ref)
    p.join(60)
    assert p.exitcode == 0
    full = time.perf_counter() - t
    print(f"uninterrupted run: {full:.2f} s")
    want = checkpoint_hashes(ref)

    rng = random.Random(int(os.environ.get("DSV3_KILL_SEED", "12")))
    kills, chains, phases = 0, 0, set()
    deadline = time.monotonic() + 150
    while kills < MIN_KILLS and time.monotonic() < deadline:
        chains += 1
        dst = tmp_path / f"c{chains}" / "ckpt"
        tmp = dst.parent / f".{dst.name}.converting"
        while True:  # kill, resume, kill again ... until a run completes
            p = start(dst, "--resume")
            time.sleep(rng.uniform(0.0, full * 0.8))
            alive = p.exitcode is None
            p.kill()
            p.join(30)
            if alive and p.exitcode == -9:
                kills += 1
                phases.add(_phase(dst, tmp))
                # Never a loadable incomplete directory: dst is absent or complete and identical;
                # a manifest in the working directory means it is complete too.
                if dst.exists():
                    assert checkpoint_hashes(dst) == want
                if (tmp / COMPLETE_MARKER).exists():
                    h = checkpoint_hashes(tmp)
                    h.pop(PLAN, None), h.pop(JOURNAL, None)
                    assert h == want
                continue
            assert p.exitcode == 0, f"chain {chains}: exit {p.exitcode}"
            break
        assert checkpoint_hashes(dst) == want, f"chain {chains} differs from the uninterrupted run"
        assert sorted(x.name for x in dst.parent.iterdir()) == ["ckpt"]  # no lock, temp or leftovers
    assert kills >= MIN_KILLS, f"only {kills} kills in the time allowed"
    assert tree_hashes(source) == src_before
    print(f"{kills} kills in {chains} chains; phases hit: {sorted(phases)}")
    assert len(phases) >= 3, phases


def _phase(dst: Path, tmp: Path) -> str:
    """Where a kill landed, from what it left (for the test's report)."""
    if dst.exists():
        return "after rename"
    if (tmp / COMPLETE_MARKER).exists():
        return "manifest written, not renamed"
    if (tmp / "config.json").exists():
        return "finishing (metadata, side files, fsync)"
    if (tmp / JOURNAL).exists():
        return "converting units"
    if tmp.exists():
        return "plan written"
    return "before the plan"


# ------------------------------------------------------------------------------- 1. nothing destroyed
def test_force_never_deletes_what_it_did_not_write(source, tmp_path, capsys):
    from convert.__main__ import main

    parent = tmp_path / "parent"
    parent.mkdir()
    src = parent / "src"
    os.symlink(source, src)  # the source inside the directory --force is pointed at
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    before, src_before = tree_hashes(tmp_path), tree_hashes(source)
    # The case as a real subprocess: SRC's parent as DST with --force.
    assert_one_clear_line(run_cli(source, source.parent, "--force", "--quiet"), "contains the source")
    # The same CLI path in this process for the other refusals.
    for args, names in [((src, parent), ["contains the source"]),
                        ((source, other), ["not a checkpoint this converter wrote", str(other)]),
                        ((source, source), ["is the source directory"])]:
        assert main([*map(str, args), "--force", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert_one_clear_line(subprocess.CompletedProcess([], 2, "", err), *names)
    assert tree_hashes(tmp_path) == before and tree_hashes(source) == src_before  # nothing changed


def test_second_converter_on_the_same_destination_is_refused(source, tmp_path):
    """A second converter is refused while the first runs; once the first is SIGKILLed, its lock file
    is stale (the kernel dropped the flock) and `--resume` takes it and finishes."""
    from convert.__main__ import main
    from convert.converter import ConvertError, convert

    dst = tmp_path / "dst"
    cmd = [sys.executable, "-m", "convert", str(source), str(dst), "--quiet", "--workers", "1"]
    # 0.2 s per unit: the first run lasts ~30 s, far longer than this test needs it to.
    first = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, TEST_DELAY_ENV: "0.2"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".dst.lock"
    try:
        deadline = time.time() + 120
        while not (lock.exists() and lock.read_text()) and time.time() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert lock.exists(), f"the first converter never took its lock: {first.stderr.read()[-2000:]}"
        r = run_cli(source, dst, "--quiet", "--force")
        assert_one_clear_line(r, "another conversion into", str(first.pid))
        for resume in (False, True):
            with pytest.raises(ConvertError, match=f"another conversion into .*pid {first.pid}"):
                convert(source, dst, progress=False, resume=resume)
        assert main([str(source), str(dst), "--quiet", "--force"]) == 2
        assert first.poll() is None, "the second converter disturbed the first"
    finally:
        first.kill()
        first.wait(60)
    assert lock.exists() and not dst.exists()  # a stale lock file: no process holds it any more
    convert(source, dst, progress=False, resume=True)
    assert (dst / COMPLETE_MARKER).exists() and not lock.exists()


# ------------------------------------------------------------------------------- 3. contained paths
def _copy_source(source: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(source, dst)
    return dst


def test_index_entries_and_side_files_outside_the_source_are_refused(source, tmp_path, capsys):
    src = _copy_source(source, tmp_path / "src")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name, shard = sorted(index["weight_map"].items())[0]
    (elsewhere / shard).write_bytes((src / shard).read_bytes())
    cases = {"absolute": str(elsewhere / shard), "dotdot": f"../elsewhere/{shard}",
             "symlink": "link.safetensors"}
    os.symlink(elsewhere / shard, src / "link.safetensors")
    before = tree_hashes(tmp_path)
    from convert.__main__ import main

    for label, entry in cases.items():
        bad = json.loads(json.dumps(index))
        for n, f in bad["weight_map"].items():
            if f == shard:
                bad["weight_map"][n] = entry
        (src / "model.safetensors.index.json").write_text(json.dumps(bad))
        if label == "absolute":  # one as a real subprocess, the others through the same main()
            r = run_cli(src, tmp_path / f"out-{label}", "--quiet")
        else:
            code = main([str(src), str(tmp_path / f"out-{label}"), "--quiet"])
            r = subprocess.CompletedProcess([], code, "", capsys.readouterr().err)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert entry in r.stderr and "nothing was written" in r.stderr, (label, r.stderr)
        assert not (tmp_path / f"out-{label}").exists()
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    before["src/model.safetensors.index.json"] = tree_hashes(src)["model.safetensors.index.json"]
    assert tree_hashes(tmp_path) == before

    # side files: a tokenizer.json symlinked out of the source is not copied (and says so)
    secret = elsewhere / "secret.json"
    secret.write_text('{"secret": 1}')
    os.unlink(src / "link.safetensors")
    os.symlink(secret, src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text("{}")
    assert main([str(src), str(tmp_path / "out"), "--quiet"]) == 0
    stdout = capsys.readouterr().out
    out = tmp_path / "out"
    assert not (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").is_file()
    assert "not copied" in stdout and "tokenizer.json" in stdout and str(secret) in stdout
    assert json.loads((out / COMPLETE_MARKER).read_text())["copied_files"] == ["tokenizer_config.json"]


def test_hugging_face_hub_snapshot_symlinks_are_accepted(source, tmp_path):
    """The hub cache stores every file of a snapshot as a symlink into the repo's blobs/: that one
    layout of symlinks leaving the directory is accepted; the same links anywhere else are not."""
    from convert.converter import convert
    from convert.validate import ValidationError

    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        os.link(f, blob)
        os.symlink(f"../../blobs/blob{i}", snap / f.name)
    report = convert(snap, tmp_path / "out", progress=False)
    assert report.tensors > 0 and (tmp_path / "out" / COMPLETE_MARKER).exists()
    plain = tmp_path / "not-a-snapshot"
    plain.mkdir()
    for f in snap.iterdir():
        os.symlink(os.readlink(snap / f.name).replace("../../blobs", str(repo / "blobs")), plain / f.name)
    with pytest.raises(ValidationError, match="outside"):
        convert(plain, tmp_path / "out2", progress=False)
