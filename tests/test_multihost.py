"""Two local processes (loopback coordinator, JAX's default gloo CPU collectives, 4 CPU devices each) run a
sharded forward through launch/run_multihost.py and agree with one process on 8 devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import dsv3_jax
from tests.hf_reference import make_hf_model, rel_err, save_hf

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "run_multihost.py"
MESH = "data=2,tensor=2,expert=2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_agree_with_one(tmp_path):
    import tests.mesh_models  # noqa: F401  (registers h8e16)

    dst = save_hf(make_hf_model("h8e16"), tmp_path / "m")
    tokens = np.random.default_rng(3).integers(2, 512, size=(4, 12)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(SCRIPT), "--checkpoint", str(dst), "--mesh", MESH, "--tokens",
         f"@{tmp_path / 'tokens.npy'}", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i), "--out", str(tmp_path / "logits.npy")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, f"process failed:\n{err[-3000:]}"
        # The script's result is its last JSON line: Gloo's C++ side writes its "[Gloo] Rank ..." lines to
        # the same stdout from its own threads, at times after the result.
        outs.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    assert sorted(o["process"] for o in outs) == [0, 1]
    assert all(o["processes"] == 2 and o["devices"] == 8 and o["local_devices"] == 4 for o in outs)
    assert outs[0]["greedy"] == outs[1]["greedy"]  # both processes see the same (replicated) logits

    multi = np.load(tmp_path / "logits.npy")
    one_device = dsv3_jax.load(dst).forward(tokens)  # one process (tests/test_sharding.py: same mesh too)
    assert rel_err(multi, one_device) <= 1e-4
    assert (multi.argmax(-1) == one_device.argmax(-1)).all()
