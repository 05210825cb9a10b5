"""jax.distributed start-up and lockstep (dsv3_jax/parallel/distributed.py): flags and launcher detection,
the step channel between two local CPU processes, and a dead process ending its peer with a clear error in
bounded time (never a hang)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dsv3_jax.parallel import distributed

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv_of, n: int = 2, devices: int = 2) -> list[subprocess.Popen]:
    """n processes on a loopback coordinator; argv_of(i) is process i's command line."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return [subprocess.Popen(argv_of(i), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(n)]


def test_flags_and_detection():
    ap = argparse.ArgumentParser()
    distributed.add_cli_flags(ap)
    a = ap.parse_args(["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"])
    assert (a.coordinator, a.num_processes, a.process_id, a.peer_timeout) == ("h:1", 2, 1, 60.0)
    with pytest.raises(distributed.DistributedError, match="go together"):
        distributed.initialize("h:1", 2, None)
    with pytest.raises(distributed.DistributedError, match="HOST:PORT"):
        distributed.initialize("h", 2, 0)
    with pytest.raises(distributed.DistributedError, match=r"--process-id must lie in 0\.\.1"):
        distributed.initialize("h:1", 2, 2)
    assert distributed.initialize() == distributed.ProcessInfo(0, 1, "single")  # no launcher: nothing started
    assert distributed.initialize("h:1", 1, 0).process_count == 1
    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n[1-2]", SLURM_NTASKS="2", SLURM_PROCID="0",
                 SLURM_LOCALID="0")
    assert distributed.detect(slurm) == "slurm"
    assert distributed.detect({**slurm, "SLURM_NTASKS": "1"}) == "single"  # sbatch without srun
    assert distributed.detect({"OMPI_COMM_WORLD_SIZE": "4"}) == "openmpi"
    assert distributed.detect({"JAX_COORDINATOR_ADDRESS": "h:1"}) == "env"
    arrays = {"table": np.arange(12, dtype=np.int32).reshape(3, 4), "temp": np.float32(0.5)}
    back = distributed.unpack(distributed.pack(arrays))
    assert back.keys() == arrays.keys() and all(np.array_equal(back[k], arrays[k]) for k in arrays)


def _worker(port: int, extra: list[str]):
    return lambda i: [sys.executable, str(ROOT / "tests" / "mp_worker.py"), "--coordinator",
                      f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                      "--peer-timeout", "3", *(extra if i == 1 else [])]


def test_a_dead_follower_ends_the_leader():
    """(Lockstep itself: tests/test_lockstep.py runs generate on two processes.)"""
    # Process 1 crashes after step 1: process 0, stuck in the next step's collective, exits with one line.
    port = free_port()
    procs = spawn(_worker(port, ["--die-after", "1", "--steps", "100"]))
    t0 = time.monotonic()
    out0, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    assert procs[1].returncode == 9 and "step 1 5.0" in out0  # it stepped in lockstep, then died
    assert procs[0].returncode == distributed.EXIT_PEER_LOST, err0[-3000:]
    assert "error: process 1 of 2 stopped responding" in err0 and "Traceback" not in err0
    assert time.monotonic() - t0 < 60


def test_a_dead_leader_ends_the_followers():
    port = free_port()
    procs = spawn(lambda i: _worker(port, [])(i) + (["--die-after", "1", "--steps", "100"] if i == 0 else []))
    t0 = time.monotonic()
    for p in procs:
        p.communicate(timeout=120)
    assert procs[0].returncode == 9 and procs[1].returncode != 0
    assert time.monotonic() - t0 < 60
