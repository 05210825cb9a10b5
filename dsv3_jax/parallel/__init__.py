"""Many devices and many processes: meshes and shardings, DP attention, multi-host lockstep.

`sharding` (mesh specs, parameter/cache/activation shardings), `dp_attention` (the page-partitioned
attention under shard_map), `distributed` (jax.distributed start-up, the step channel), `lockstep`
(an executor wrapper: process 0 sends typed device operations, followers replay them), `flags` (the
layout and capacity flags both CLIs share). Must not schedule requests or hold model math.
"""
