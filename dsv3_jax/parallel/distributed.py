"""Many processes (hosts) running one program: start-up, lockstep step plans, output on process 0.

Owns: starting `jax.distributed` from explicit flags (`--coordinator/--num-processes/--process-id`),
SLURM (srun) or Open MPI (mpirun); the bounded waits that turn a dead or hung peer into one clear error
and an exit (`EXIT_PEER_LOST`) instead of a hang; `StepChannel`, which carries each engine step's host
inputs (a dict of numpy arrays) from process 0, which owns the request queue, to the other processes,
which only follow; and `main_print` (output on process 0 only). Must not own models, meshes or
scheduling: the engine decides what a step is, this module only moves it.

Why the coordinator's key-value store, not a device broadcast (`multihost_utils.broadcast_one_to_all`):
a step's arrays change shape (batch and chunk sizes), and a device broadcast needs every process to know
the shapes beforehand (a second broadcast) and compiles one program per shape; it also runs on the
accelerators' collectives, which on CPU (gloo) simply hang when a peer is gone. The key-value store
takes variable-size bytes, costs no compile and no device memory, and every wait on it has a timeout,
so a follower waiting for the next plan can notice that process 0 is gone. Plans are small (block
tables and token ids: kilobytes), so the coordinator's gRPC is not a bottleneck.

Liveness: JAX's own heartbeat ends a process whose peer stopped answering, but by aborting with a C++
stack trace after `heartbeat_timeout_seconds`. `initialize` starts a watchdog thread that publishes a
counter every second and checks the others'; a peer silent for `peer_timeout_s` ends this process with
one line naming it (JAX's heartbeat, at twice that, stays as the backstop). When process 0 itself dies
its coordinator goes with it and JAX ends the others at once ("the leader task ... died").
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 75  # a peer process died or hung (EX_TEMPFAIL: rerun the job)
DEFAULT_PEER_TIMEOUT_S = 60.0  # long XLA compiles must not look like a dead peer
DEFAULT_INIT_TIMEOUT_S = 300
_PREFIX = "dsv3"
_WINDOW = 64  # step keys kept in the store; followers are at most one step behind (the step is collective)


class DistributedError(RuntimeError):
    """Bad multi-process flags, a failed start-up, or a peer that stopped answering."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    process_index: int
    process_count: int
    method: str  # "single", "explicit", "slurm", "openmpi", "env"

    @property
    def is_main(self) -> bool:
        return self.process_index == 0


# ----------------------------------------------------------------------------------------- start-up
def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """The multi-process flags shared by generate, serve and the launch scripts."""
    g = parser.add_argument_group("multi-process (one process per host; all run the same command)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (omit under srun / mpirun: detected)")
    g.add_argument("--num-processes", type=int, help="number of processes (with --coordinator)")
    g.add_argument("--process-id", type=int, help="this process's index, 0..N-1 (with --coordinator)")
    g.add_argument("--peer-timeout", type=float, default=DEFAULT_PEER_TIMEOUT_S, metavar="S",
                   help="exit with an error when a peer is silent this long "
                   f"(default {DEFAULT_PEER_TIMEOUT_S:g})")


def detect(env: Mapping[str, str] | None = None) -> str:
    """Which launcher started us: "slurm" (srun, >1 task), "openmpi" (mpirun, >1 rank), "env"
    (JAX_COORDINATOR_ADDRESS set) or "single"."""
    env = os.environ if env is None else env
    slurm_vars = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in env for v in slurm_vars) and int(env["SLURM_NTASKS"]) > 1:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "openmpi"
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "env"
    return "single"


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
               init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S) -> ProcessInfo:
    """Start `jax.distributed` (explicit arguments, else SLURM / Open MPI / JAX_* environment) and the
    liveness watchdog. One process and no launcher: nothing is started. Call before any other JAX use."""
    import jax

    explicit = (coordinator, num_processes, process_id)
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise DistributedError("--coordinator, --num-processes and --process-id go together: give all "
                                   "three (or none under srun / mpirun)")
        if ":" not in coordinator:
            raise DistributedError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise DistributedError(f"--process-id must lie in 0..{num_processes - 1} (--num-processes "
                                   f"{num_processes}), got {process_id}")
        method = "explicit" if num_processes > 1 else "single"
    else:
        method = detect()
    if peer_timeout_s <= 0:
        raise DistributedError(f"--peer-timeout must be > 0 seconds, got {peer_timeout_s}")
    if method == "single":
        return ProcessInfo(0, 1, "single")
    kwargs: dict[str, Any] = dict(initialization_timeout=int(init_timeout_s),
                                  heartbeat_timeout_seconds=max(int(2 * peer_timeout_s), 10))
    if method == "explicit":
        kwargs.update(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:  # XlaRuntimeError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"jax.distributed start-up ({method}) failed within {init_timeout_s} s: "
                               f"{first}") from None
    info = ProcessInfo(jax.process_index(), jax.process_count(), method)
    _Watchdog(info, peer_timeout_s).start()
    log.info("process %d of %d (%s), %d local / %d global devices", info.process_index,
             info.process_count, method, jax.local_device_count(), jax.device_count())
    return info


def initialize_from_args(args: argparse.Namespace) -> ProcessInfo:
    """`initialize` from the flags of `add_cli_flags`."""
    return initialize(args.coordinator, args.num_processes, args.process_id,
                      peer_timeout_s=args.peer_timeout)


def _client():
    from jax._src import distributed as jd  # the store JAX's own checkpointing (orbax) uses

    return jd.global_state.client


def process_index() -> int:
    import jax

    return jax.process_index()


def is_main() -> bool:
    return process_index() == 0


def main_print(*args: Any, **kwargs: Any) -> None:
    """print() on process 0 only (the others' output would repeat it N times)."""
    if is_main():
        print(*args, **kwargs)


def _die(msg: str) -> None:
    """One clear line and an immediate exit: a dead peer leaves collectives that can never finish."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


class _Watchdog(threading.Thread):
    """Publish our counter every `interval` s; exit (one line) when a peer's stops moving."""

    def __init__(self, info: ProcessInfo, timeout_s: float, interval_s: float = 1.0):
        super().__init__(name="dsv3-peer-watchdog", daemon=True)
        self.info, self.timeout_s, self.interval_s = info, timeout_s, min(interval_s, timeout_s / 4)

    def run(self) -> None:
        client, me, n = _client(), self.info.process_index, self.info.process_count
        seen: dict[int, tuple[str, float]] = {}
        beat = 0
        while True:
            now = time.monotonic()
            try:
                beat += 1
                client.key_value_set(f"{_PREFIX}/alive/{me}", str(beat), allow_overwrite=True)
                for p in range(n):
                    if p == me:
                        continue
                    try:
                        v = client.key_value_try_get(f"{_PREFIX}/alive/{p}")
                    except Exception:  # NOT_FOUND: the peer has not published yet (start-up)
                        v = ""
                    if p not in seen or seen[p][0] != v:
                        seen[p] = (v, now)
                    elif now - seen[p][1] > self.timeout_s:
                        _die(f"process {p} of {n} stopped responding {now - seen[p][1]:.0f} s ago "
                             f"(died, hung or unreachable); process {me} exits instead of waiting forever")
            except Exception as e:  # the coordinator (process 0) is gone
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _die(f"lost the coordinator (process 0): {first}")
            time.sleep(self.interval_s)


# ----------------------------------------------------------------------------------------- lockstep
def pack(arrays: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    return buf.getvalue()


def unpack(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


class StepChannel:
    """Process 0 `send`s each step's host inputs; every other process `receive`s them in order.

    `send(None)` (or `close()`) tells followers to stop; `fail(msg)` stops them with process 0's error.
    Followers wait without a deadline (a server may idle for hours) but in one-second slices, so the
    watchdog's verdict on a dead process 0 is never stuck behind a blocking call.
    """

    def __init__(self, name: str = "engine"):
        import jax

        self.me, self.n = jax.process_index(), jax.process_count()
        self._client = _client() if self.n > 1 else None
        self._key = f"{_PREFIX}/{name}"
        self._step = 0

    @property
    def is_leader(self) -> bool:
        return self.me == 0

    def _put(self, payload: bytes) -> None:
        if self._client is None:
            return
        self._client.key_value_set_bytes(f"{self._key}/{self._step}", payload)
        if self._step >= _WINDOW:
            self._client.key_value_delete(f"{self._key}/{self._step - _WINDOW}")
        self._step += 1

    def send(self, arrays: Mapping[str, np.ndarray] | None) -> None:
        if not self.is_leader:
            raise DistributedError("only process 0 sends step plans")
        self._put(b"S" if arrays is None else b"P" + pack(arrays))

    def close(self) -> None:
        self.send(None)

    def fail(self, message: str) -> None:
        if self.is_leader:
            self._put(b"E" + message.encode())

    def receive(self) -> dict[str, np.ndarray] | None:
        """The next step's arrays, or None when process 0 has finished."""
        if self.is_leader:
            raise DistributedError("process 0 sends step plans; it does not receive them")
        if self._client is None:
            return None
        key = f"{self._key}/{self._step}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, 1000)
                break
            except Exception as e:
                if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
                    raise DistributedError(f"process {self.me}: lost process 0 while waiting for step "
                                           f"{self._step}: {str(e).strip().splitlines()[0]}") from None
        self._step += 1
        kind, body = data[:1], data[1:]
        if kind == b"S":
            return None
        if kind == b"E":
            raise DistributedError(f"process 0 failed: {body.decode(errors='replace')}")
        return unpack(body)
