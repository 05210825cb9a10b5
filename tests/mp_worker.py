"""A worker for tests/test_distributed.py: two processes step a cross-process jitted sum in lockstep,
process 0 sending each step's arrays through distributed.StepChannel. `--die-after K`: this process
exits abruptly after step K (a crashed host): its peers must end with a clear error, not hang.
`--raise-after K`: this process raises after step K without ending the channel (a leader's uncaught
error): the channel's exit hook must stop the followers before JAX's shutdown barrier waits for them."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    from dsv3_jax.parallel import distributed

    distributed.add_cli_flags(ap)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--die-after", type=int, default=-1)
    ap.add_argument("--raise-after", type=int, default=-1)
    a = ap.parse_args()
    distributed.initialize_from_args(a)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    f = jax.jit(lambda x, a: jnp.sum(x) + a.sum(), out_shardings=NamedSharding(mesh, P()))
    ch = distributed.StepChannel("test")
    for step in range(a.steps):
        arrays = {"a": np.arange(step + 1, dtype=np.float32)} if ch.is_leader else ch.receive()
        if ch.is_leader:
            ch.send(arrays)
        x = jax.make_array_from_callback((jax.device_count(),), NamedSharding(mesh, P("x")),
                                         lambda i: np.ones(jax.device_count(), np.float32)[i])
        y = float(f(x, arrays["a"]).addressable_data(0))
        distributed.main_print(f"step {step} {y}", flush=True)
        if step == a.die_after:
            os._exit(9)
        if step == a.raise_after:
            raise RuntimeError(f"process {jax.process_index()} gives up after step {step}")
        time.sleep(0.1)
    if ch.is_leader:
        ch.close()
    else:
        assert ch.receive() is None
    print(f"done {jax.process_index()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
