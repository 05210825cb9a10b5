"""Many processes (hosts) running one program: start-up, lockstep step plans, output on process 0.

Owns: starting `jax.distributed` from explicit flags (`--coordinator/--num-processes/--process-id`),
SLURM (srun) or Open MPI (mpirun); the bounded waits that turn a dead or hung peer into one clear error
and an exit (`EXIT_PEER_LOST`) instead of a hang; `StepChannel`, which carries each engine step's host
inputs (a dict of numpy arrays) from process 0, which owns the request queue, to the other processes,
which only follow, over one TCP stream per follower (rendezvous through the coordinator's key-value
store; the class docstring says why not the store itself or a device broadcast); and `main_print` (output
on process 0 only). Must not own models, meshes or scheduling: the engine decides what a step is, this
module only moves it.

Liveness: JAX's own heartbeat ends a process whose peer stopped answering, but by aborting with a C++
stack trace after `heartbeat_timeout_seconds`. `initialize` starts a watchdog thread that publishes a
counter every second and checks the others'; a peer silent for `peer_timeout_s` ends this process with
one line naming it (JAX's heartbeat, at twice that, stays as the backstop). When process 0 itself dies
its coordinator goes with it and JAX ends the others at once ("the leader task ... died").
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
import os
import secrets
import socket
import struct
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
_HEADER = struct.Struct("!cQ")  # kind (P payload, S stop, E error), body length
_ARRAY = struct.Struct("!HBB")  # name length, dtype length, ndim


def pack(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Named arrays as bytes: per array its name, dtype, shape and raw (C-order) data. Plain numeric and
    bool dtypes only (what a step carries); nothing is pickled."""
    parts = [struct.pack("!I", len(arrays))]
    for name, value in arrays.items():
        a = np.asarray(value)  # tobytes() writes C order whatever the strides
        if a.dtype.kind not in "biufc":
            raise DistributedError(f"step channel: array {name!r} has dtype {a.dtype}, not a plain number")
        n, d = name.encode(), a.dtype.str.encode()
        parts += [_ARRAY.pack(len(n), len(d), a.ndim), n, d, struct.pack(f"!{a.ndim}Q", *a.shape),
                  a.tobytes()]
    return b"".join(parts)


def unpack(data: bytes) -> dict[str, np.ndarray]:
    """The arrays `pack` wrote (copies: writable, aligned)."""
    view = memoryview(data)
    (count,), at = struct.unpack_from("!I", view), 4
    out = {}
    for _ in range(count):
        nlen, dlen, ndim = _ARRAY.unpack_from(view, at)
        at += _ARRAY.size
        name = bytes(view[at:at + nlen]).decode()
        dtype = np.dtype(bytes(view[at + nlen:at + nlen + dlen]).decode())
        at += nlen + dlen
        if dtype.kind not in "biufc":
            raise DistributedError(f"step channel: array {name!r} arrived with dtype {dtype}")
        shape = struct.unpack_from(f"!{ndim}Q", view, at)
        at += 8 * ndim
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        out[name] = np.frombuffer(view[at:at + size], dtype).reshape(shape).copy()
        at += size
    return out


def _coordinator_host() -> str:
    from jax._src import distributed as jd

    address = jd.global_state.coordinator_address or ""
    return address.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"


class StepChannel:
    """Process 0 `send`s each step's host inputs; every other process `receive`s them in order.

    Transport: one TCP stream from process 0 to each other process, opened when the channel is built (all
    processes build theirs at the same point, right after start-up): process 0 listens on an ephemeral port
    of every interface and publishes the port and a random token in the coordinator's key-value store under
    the channel's name; each follower reads them, connects to the coordinator's host (process 0 runs the
    coordinator) and presents the token and its index; process 0 accepts exactly the N-1 followers and
    closes the listener. From then on a message is one `sendall` of a 9-byte header (kind, length) and the
    packed arrays per follower: no round trip, no coordinator hop, nothing on the follower's critical path
    but the bytes in flight. Why not the key-value store (the previous transport): every message was a gRPC
    set on process 0 (and a delete to bound the store) plus a blocking get on each follower, a few ms per
    step under load (benchmarks/RESULTS.md, "Lockstep at no cost"). Why not a device broadcast
    (`multihost_utils.broadcast_one_to_all`): a follower must read the message on the host before it can
    pick the next program, and a device broadcast queues behind the step the device is running, so the
    follower could not dispatch step k+1 while step k runs (the engine's pipelining).

    `send(None)` (or `close()`) tells followers to stop; `fail(msg)` stops them with process 0's error.
    Process 0 that exits without either (an exception it did not catch) sends the failure on its way out
    (atexit, before JAX's own shutdown barrier), and a process 0 that dies closes the streams: either way a
    follower ends with one DistributedError line instead of waiting in JAX's shutdown barrier. Followers
    wait without a deadline (a server may idle for hours) but in one-second slices, so the watchdog's
    verdict on a hung process 0 is never stuck behind a blocking call. Start-up waits (the rendezvous) are
    bounded by `timeout_s`.
    """

    def __init__(self, name: str = "engine", timeout_s: float = DEFAULT_INIT_TIMEOUT_S):
        import jax

        self.me, self.n = jax.process_index(), jax.process_count()
        self.name = name
        self._peers: list[socket.socket] = []  # process 0: one stream per follower, by process index
        self._stream: socket.socket | None = None  # a follower: the stream from process 0
        self._buffer = bytearray()
        self._ended = False
        if self.n == 1:
            return
        client = _client()
        key = f"{_PREFIX}/{name}/stream"
        deadline = time.monotonic() + timeout_s
        if self.is_leader:
            token = secrets.token_hex(16)
            dual = socket.has_dualstack_ipv6()  # every interface, IPv4 and IPv6 where the host has both
            with socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                      backlog=self.n, dualstack_ipv6=dual) as server:
                client.key_value_set(key, f"{server.getsockname()[1]} {token}")
                self._peers = self._accept(server, token, deadline)
            atexit.register(self._exit_unended)
        else:
            try:
                port, token = client.blocking_key_value_get(key, int(timeout_s * 1000)).split()
                host = _coordinator_host()
                self._stream = socket.create_connection((host, int(port)), timeout=max(1.0, timeout_s))
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise DistributedError(f"process {self.me}: could not open the step stream {name!r} from "
                                       f"process 0 within {timeout_s:.0f} s: {first}") from None
            self._stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._stream.sendall(f"{token} {self.me}\n".encode())
            self._stream.settimeout(1.0)

    def _accept(self, server: socket.socket, token: str, deadline: float) -> list[socket.socket]:
        peers: dict[int, socket.socket] = {}
        while len(peers) < self.n - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                for s in peers.values():
                    s.close()
                missing = sorted(set(range(1, self.n)) - set(peers))
                raise DistributedError(f"process 0: processes {missing} did not open the step stream "
                                       f"{self.name!r} in time")
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(10.0)
            try:
                hello = conn.makefile("rb").readline(200).decode(errors="replace").split()
            except OSError:
                hello = []
            ok = (len(hello) == 2 and secrets.compare_digest(hello[0], token) and hello[1].isdigit()
                  and 0 < int(hello[1]) < self.n and int(hello[1]) not in peers)
            if not ok:  # not one of ours (a stray connection): drop it, keep listening
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peers[int(hello[1])] = conn
        return [peers[p] for p in sorted(peers)]

    @property
    def is_leader(self) -> bool:
        return self.me == 0

    def _put(self, kind: bytes, body: bytes = b"") -> None:
        frame = _HEADER.pack(kind, len(body)) + body
        for i, peer in enumerate(self._peers):
            try:
                peer.sendall(frame)
            except OSError as e:
                raise DistributedError(f"process 0: lost process {i + 1} (step stream {self.name!r}): "
                                       f"{e}") from None

    def send(self, arrays: Mapping[str, np.ndarray] | None) -> None:
        if not self.is_leader:
            raise DistributedError("only process 0 sends step plans")
        if self._ended:
            raise DistributedError(f"step stream {self.name!r} already ended")
        if arrays is None:
            self._end(b"S")
        else:
            self._put(b"P", pack(arrays))

    def close(self) -> None:
        self.send(None)

    def fail(self, message: str) -> None:
        if self.is_leader and not self._ended:
            self._end(b"E", message.encode())

    def _end(self, kind: bytes, body: bytes = b"") -> None:
        self._ended = True
        try:
            self._put(kind, body)
        finally:
            for peer in self._peers:
                peer.close()
            atexit.unregister(self._exit_unended)

    def _exit_unended(self) -> None:
        if not self._ended:
            try:
                self.fail("process 0 exited without ending the lockstep (see its error output)")
            except DistributedError:
                pass  # the followers are gone already

    def _read(self, size: int) -> bytes:
        while len(self._buffer) < size:
            try:
                chunk = self._stream.recv(max(1 << 16, size - len(self._buffer)))
            except TimeoutError:
                continue  # one-second slices (see the class docstring)
            except OSError as e:
                raise DistributedError(f"process {self.me}: lost process 0 (step stream {self.name!r}): "
                                       f"{e}") from None
            if not chunk:
                raise DistributedError(f"process {self.me}: process 0 closed the step stream {self.name!r} "
                                       f"without a stop message (it exited or died)")
            self._buffer += chunk
        out = bytes(self._buffer[:size])
        del self._buffer[:size]
        return out

    def receive(self) -> dict[str, np.ndarray] | None:
        """The next step's arrays, or None when process 0 has finished."""
        if self.is_leader:
            raise DistributedError("process 0 sends step plans; it does not receive them")
        if self._stream is None or self._ended:
            return None
        kind, size = _HEADER.unpack(self._read(_HEADER.size))
        body = self._read(size)
        if kind == b"P":
            return unpack(body)
        self._ended = True
        self._stream.close()
        if kind == b"E":
            raise DistributedError(f"process 0 failed: {body.decode(errors='replace')}")
        return None
