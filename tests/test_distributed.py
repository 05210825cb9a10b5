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


def test_an_uncaught_error_on_the_leader_stops_the_followers():
    """Process 0 raises mid-run without finish()/fail(): the channel's exit hook sends the failure, the
    follower ends with one line naming it, and both exit long before JAX's shutdown barrier (minutes)."""
    port = free_port()
    leader_only = ["--raise-after", "1", "--steps", "100"]
    procs = spawn(lambda i: _worker(port, [])(i) + (leader_only if i == 0 else []))
    t0 = time.monotonic()
    outs = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 1 and "gives up after step 1" in outs[0][1]
    assert procs[1].returncode != 0
    assert "process 0 failed: process 0 exited without ending the lockstep" in outs[1][1], outs[1][1][-2000:]
    assert time.monotonic() - t0 < 60


def test_pack_and_the_stream_handshake():
    arrays = {"i": np.arange(6, dtype=np.int32).reshape(2, 3), "f": np.float32(0.25), "b": np.array([True]),
              "u8": np.frombuffer(b"Step", np.uint8), "empty": np.zeros((0, 4), np.int64),
              "strided": np.arange(10, dtype=np.float64)[::3]}
    back = distributed.unpack(distributed.pack(arrays))
    assert list(back) == list(arrays)
    for k, v in arrays.items():
        assert back[k].dtype == np.asarray(v).dtype and back[k].shape == np.shape(v)
        np.testing.assert_array_equal(back[k], v)
        assert back[k].flags.writeable
    with pytest.raises(distributed.DistributedError, match="'o'.*not a plain number"):
        distributed.pack({"o": np.array([object()])})

    # Process 0's accept loop takes only connections presenting the published token and a follower index;
    # a stray connection is dropped, not counted.
    import socket

    ch = distributed.StepChannel.__new__(distributed.StepChannel)
    ch.me, ch.n, ch.name = 0, 3, "t"
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        for c, hello in zip(clients, [b"wrong 1\n", b"tok 2\n", b"tok 0\n", b"tok 1\n"], strict=True):
            c.sendall(hello)
        peers = ch._accept(server, "tok", time.monotonic() + 20)
        assert len(peers) == 2
        peers[0].sendall(b"to 1")
        assert clients[3].recv(4) == b"to 1"
        assert clients[0].recv(4) == b""  # the stray one was closed
        ch2 = distributed.StepChannel.__new__(distributed.StepChannel)
        ch2.me, ch2.n, ch2.name = 0, 2, "t"
        with pytest.raises(distributed.DistributedError, match=r"processes \[1\] did not open"):
            ch2._accept(server, "tok", time.monotonic() + 0.2)
        for s in clients + peers:
            s.close()

