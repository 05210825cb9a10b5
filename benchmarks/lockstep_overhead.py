"""What multi-host lockstep costs per engine step: two CPU processes on a loopback coordinator.

Process 0 runs the engine (the embedded default model, greedy; `--mtp K` for MTP drafts) on a
LockstepExecutor; process 1 follows (lockstep.follow). Both wrap their step channel to stamp each message
with CLOCK_MONOTONIC (one clock for the processes of one host): the leader around its `send`, the follower
around its `receive`. Per engine step (Step messages only):

- `send`: the leader's send call (on its critical path, before it dispatches the step);
- `transit`: the follower's receive return minus the later of (leader's send start, follower's receive
  call): how long the message took to reach a follower that was already waiting for it;
- `overhead` = send + transit: what the channel adds to a step whose collectives wait for the follower
  (counted in full, although a pipelined step hides it behind the step before);
- `wait`: the follower's whole time in `receive` (idle until process 0 has scheduled the step; not cost);
- `step`: the leader's period, one Step send start to the next.

The goal (issue 30) is overhead p99 <= 5% of the step p50. Both processes end through the lockstep's
stop message, every wait is bounded (`--timeout`), and a failed leader tells its follower (`fail`), so a
broken run ends with both processes' errors instead of JAX's shutdown barrier timing out.

    python benchmarks/lockstep_overhead.py [--mesh data=2,expert=2] [--mtp 1] [--new-tokens 48] [--out F]

Owns nothing the engine uses: it only wraps the channel it hands to lockstep.Lockstep.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:\n    def push(self, x):",
           "for i in range(10):"]


class StampedChannel:
    """A step channel that records (op, start ns, end ns) per message; delegates everything else."""

    def __init__(self, inner):
        self.inner, self.stamps = inner, []

    @property
    def is_leader(self) -> bool:
        return self.inner.is_leader

    def send(self, arrays):
        t = time.monotonic_ns()
        self.inner.send(arrays)
        op = "stop" if arrays is None else bytes(arrays["op"]).decode()
        self.stamps.append((op, t, time.monotonic_ns()))

    def close(self):
        self.send(None)

    def fail(self, message):
        self.inner.fail(message)

    def receive(self):
        t = time.monotonic_ns()
        arrays = self.inner.receive()
        op = "stop" if arrays is None else bytes(arrays["op"]).decode()
        self.stamps.append((op, t, time.monotonic_ns()))
        return arrays


def worker(a: argparse.Namespace) -> int:
    from dsv3_jax.parallel import distributed

    distributed.initialize(a.coordinator, 2, a.process_id, peer_timeout_s=a.timeout / 4)
    import dsv3_jax
    from dsv3_jax.engine.api import EngineConfig
    from dsv3_jax.engine.core import Engine
    from dsv3_jax.parallel import lockstep

    channel = StampedChannel(distributed.StepChannel("engine"))
    ls = lockstep.Lockstep(channel)
    out: dict = {"process": a.process_id}
    try:
        handle = dsv3_jax.load(None, mesh=a.mesh, dtype="float32")
        if ls.is_follower:
            out["steps"] = ls.follow(handle)
        else:
            handle.executor_factory = ls.executor
            eng = Engine(handle, EngineConfig(num_pages=64, page_size=16, max_batch=4, max_batched_tokens=64,
                                              chunk_size=32, spec_k=a.mtp))
            eng.warmup(max_rows=4, modes=("greedy",))
            prompts = [handle.tokenizer.encode(p) for p in PROMPTS]
            res = eng.generate(prompts, max_new_tokens=a.new_tokens, temperature=0)
            out["tokens"] = [r.output for r in res]
            out["compiles_after_warmup"] = eng.stats["compiles_after_warmup"]
            ls.finish()
    except Exception as e:
        ls.fail(f"{type(e).__name__}: {e}")  # the follower stops with this line (a no-op on the follower)
        raise
    out["stamps"] = channel.stamps
    Path(a.out_dir, f"p{a.process_id}.json").write_text(json.dumps(out))
    return 0


def summarize(p0: dict, p1: dict) -> dict:
    sends, recvs = p0["stamps"], p1["stamps"]
    assert [s[0] for s in sends] == [r[0] for r in recvs], "the follower saw other messages than were sent"
    steps = [i for i, s in enumerate(sends) if s[0] == "Step"]
    ms = lambda ns: np.asarray(ns, np.float64) / 1e6  # noqa: E731
    send = ms([sends[i][2] - sends[i][1] for i in steps])
    transit = ms([recvs[i][2] - max(sends[i][1], recvs[i][1]) for i in steps])
    wait = ms([recvs[i][2] - recvs[i][1] for i in steps])
    period = np.diff(ms([sends[i][1] for i in steps]))
    overhead = send + transit
    pct = lambda x, q: round(float(np.percentile(x, q)), 4)  # noqa: E731
    r = {"steps": len(steps)}
    for name, x in (("send", send), ("transit", transit), ("overhead", overhead), ("wait", wait),
                    ("step", period)):
        r[f"{name}_ms_p50"], r[f"{name}_ms_p99"] = pct(x, 50), pct(x, 99)
    r["overhead_p99_over_step_p50"] = round(r["overhead_ms_p99"] / r["step_ms_p50"], 5)
    return r


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)


def run(mesh: str, mtp: int, new_tokens: int, timeout: float) -> dict:
    """Both processes, bounded by `timeout` seconds; the summary (RuntimeError with their stderr if not)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    devices = max(1, int(np.prod([int(x.split("=")[1]) for x in mesh.split(",")])) // 2)  # per process
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        procs = [subprocess.Popen([sys.executable, __file__, "--process-id", str(i), "--coordinator",
                                   f"127.0.0.1:{port}", "--out-dir", tmp, "--mesh", mesh, "--mtp", str(mtp),
                                   "--new-tokens", str(new_tokens), "--timeout", str(timeout)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        t0 = time.monotonic()
        errs = []
        try:
            for p in procs:
                errs.append(p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))[1])
        except subprocess.TimeoutExpired:
            _stop(procs)
            raise RuntimeError(f"no result within {timeout:.0f} s; both processes killed") from None
        finally:
            _stop(procs)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"exit codes {[p.returncode for p in procs]}\n--- process 0\n{errs[0][-3000:]}\n"
                               f"--- process 1\n{errs[1][-3000:]}")
        p0, p1 = (json.loads(Path(tmp, f"p{i}.json").read_text()) for i in range(2))
    return {"mesh": mesh, "mtp": mtp, "new_tokens": new_tokens, "compiles_after_warmup":
            p0["compiles_after_warmup"], "tokens": p0["tokens"], **summarize(p0, p1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="data=2,expert=2", help="over both processes' devices")
    ap.add_argument("--mtp", type=int, nargs="+", default=[0, 1], help="MTP draft tokens per step (spec_k); "
                    "one run per value")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds for each run (both processes)")
    ap.add_argument("--out", help="JSON: every run's summary")
    ap.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.process_id is not None:
        a.mtp = a.mtp[0]
        return worker(a)
    runs = []
    for k in a.mtp:
        try:
            runs.append(run(a.mesh, k, a.new_tokens, a.timeout))
        except RuntimeError as e:
            print(f"error: mtp={k}: {e}", file=sys.stderr)
            return 1
    load = os.getloadavg()[0]
    result = {"date": time.strftime("%Y-%m-%d"), "device": "CPU", "load_avg_1m": load, "runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    cols = ["mtp", "steps", "send_ms_p50", "send_ms_p99", "transit_ms_p50", "transit_ms_p99", "overhead_ms_p99",
            "wait_ms_p50", "wait_ms_p99", "step_ms_p50", "overhead_p99_over_step_p50"]
    print(f"lockstep overhead, mesh {a.mesh}, 2 CPU processes, load average {load:.1f}")
    print(" | ".join(cols))
    for r in runs:
        print(" | ".join(str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
