"""Run a sharded forward on one or many processes (hosts) with `jax.distributed` and print the logits.

One process per host (or per GPU); every process runs this same script. Process discovery:
  explicit:  --coordinator HOST:PORT --num-processes N --process-id I
  automatic: no flags under SLURM (srun) or Open MPI (mpirun): jax.distributed.initialize() reads the
             environment (SLURM_*, OMPI_*); JAX_COORDINATOR_ADDRESS etc. also work.
  single:    --single (no jax.distributed at all; one process, all local devices)

Example (2 processes on one machine, CPU):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
    python launch/run_multihost.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 \\
    --checkpoint /path/ckpt --mesh data=2,tensor=2,expert=2 --out /tmp/logits.npy &   # and id 1
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="converted or HF checkpoint directory")
    ap.add_argument("--mesh", required=True, help="e.g. 'tensor=8', 'data=2,expert=8' (all devices)")
    ap.add_argument("--coordinator", help="HOST:PORT of process 0 (omit for SLURM/Open MPI auto-detection)")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--single", action="store_true", help="one process: skip jax.distributed")
    ap.add_argument("--tokens", default="1,2,3,4,5,6,7,8", help="ids '1,2,3' (batch 1) or @file.npy")
    ap.add_argument("--out", help="process 0 writes the float32 logits here (.npy)")
    a = ap.parse_args(argv)

    import jax

    if not a.single:
        if a.coordinator:
            jax.distributed.initialize(coordinator_address=a.coordinator, num_processes=a.num_processes,
                                       process_id=a.process_id)
        else:
            jax.distributed.initialize()  # SLURM / Open MPI / JAX_* environment
    import dsv3_jax

    if a.tokens.startswith("@"):
        tokens = np.load(a.tokens[1:]).astype(np.int32)
    else:
        tokens = np.array([[int(t) for t in a.tokens.split(",")]], np.int32)
    handle = dsv3_jax.load(a.checkpoint, mesh=a.mesh)
    logits = handle.forward(tokens)
    info = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "mesh": a.mesh, "logits_shape": list(logits.shape),
            "logits_sum": float(logits.sum()), "greedy": logits.argmax(-1).tolist()}
    print(json.dumps(info), flush=True)
    if a.out and jax.process_index() == 0:
        np.save(a.out, logits)
    if not a.single:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
