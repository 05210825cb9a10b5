"""Every setting the model's trace depends on, in one frozen, hashable value: `TraceOptions`.

Owns: the kernel backend ("pallas" or "reference", resolved: "auto" picks Pallas on a Hopper GPU and the
`jnp` reference elsewhere, logged once), the MoE expert-parallel dispatch mode and its thresholds (the
all-gather limit, the all-to-all capacity factor), and `resolve` / `from_environment`, which build it
from the user-facing knobs (explicit arguments, the env var DSV3_KERNELS).
The model takes it as a module attribute (`Transformer(cfg, ..., trace_options=...)`, so it is part of
the module's identity) and hands it down; the engine uses it whole in its compile key. Nothing in the
model reads a setting from module state, a context variable or the environment at trace time.
Must not know about layers, meshes or the engine: settings in, settings out.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax

log = logging.getLogger(__name__)

KERNEL_BACKENDS = ("pallas", "reference")
KERNEL_CHOICES = ("auto", *KERNEL_BACKENDS)
MOE_DISPATCH_MODES = ("auto", "all_gather", "all_to_all")
KERNELS_ENV = "DSV3_KERNELS"
# Defaults of the MoE dispatch thresholds (see moe.py's table): "auto" gathers an expert group of at
# most this many tokens (decode) and runs the all-to-all above it (prefill), whose per-pair buffer holds
# CAPACITY_FACTOR x the balanced load.
ALL_GATHER_MAX_TOKENS = 1024
CAPACITY_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """What a traced model step depends on besides shapes, config and parameters.

    kernels: "pallas" (the Mosaic GPU kernels; off the GPU they run in Pallas' interpreter) or
        "reference" (plain `jnp`); shapes or dtypes a kernel cannot take still use the reference.
    moe_dispatch: "auto" (all-gather up to `all_gather_max_tokens` tokens per expert group, all-to-all
        above), "all_gather" or "all_to_all"; only matters under an expert-parallel mesh.
    capacity_factor: the all-to-all buffer per (source, destination) pair, in units of the balanced load.
    all_gather_max_tokens: the "auto" threshold.
    """

    kernels: str = "reference"
    moe_dispatch: str = "auto"
    capacity_factor: float = CAPACITY_FACTOR
    all_gather_max_tokens: int = ALL_GATHER_MAX_TOKENS

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels must be one of {KERNEL_BACKENDS} (resolve 'auto' with "
                             f"TraceOptions.resolve), got {self.kernels!r}")
        if self.moe_dispatch not in MOE_DISPATCH_MODES:
            raise ValueError(f"MoE dispatch must be one of {MOE_DISPATCH_MODES}, got {self.moe_dispatch!r}")
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")
        if self.all_gather_max_tokens < 0:
            raise ValueError(f"all_gather_max_tokens must be >= 0, got {self.all_gather_max_tokens}")
        # 2 and 2.0 are one setting: store floats so the repr (the program store's key) agrees too.
        object.__setattr__(self, "capacity_factor", float(self.capacity_factor))

    @classmethod
    def resolve(cls, kernels: str | None = None, *, moe_dispatch: str = "auto",
                capacity_factor: float = CAPACITY_FACTOR,
                all_gather_max_tokens: int = ALL_GATHER_MAX_TOKENS) -> TraceOptions:
        """Options from the user's knobs. `kernels` in {"auto", "pallas", "reference"}; None reads the env
        var DSV3_KERNELS (unset: "auto"). "auto" picks "pallas" on a Hopper GPU, else "reference"."""
        source = "argument"
        if kernels is None:
            kernels, source = os.environ.get(KERNELS_ENV, "auto"), KERNELS_ENV
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"{'DSV3_KERNELS' if source == KERNELS_ENV else 'kernels'} must be one of "
                             f"{KERNEL_CHOICES}, got {kernels!r}")
        if kernels == "auto":
            kernels = "pallas" if _gpu_is_hopper() else "reference"
            _log_auto_once(kernels)
        return cls(kernels, moe_dispatch, capacity_factor, all_gather_max_tokens)

    @classmethod
    def from_environment(cls) -> TraceOptions:
        """The defaults, kernels as DSV3_KERNELS (or "auto") picks them on this machine."""
        return cls.resolve()

    def replace(self, **changes) -> TraceOptions:
        return dataclasses.replace(self, **changes)


@functools.cache
def _gpu_is_hopper() -> bool:
    try:
        devs = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return False
    # Mosaic GPU's wgmma/TMA kernels need sm_90 (Hopper).
    return bool(devs) and all(str(getattr(d, "compute_capability", "")).startswith("9") for d in devs)


@functools.cache
def _log_auto_once(backend: str) -> None:
    if backend == "pallas":
        log.info("dsv3_jax trace options: Hopper GPU found; kernels auto -> pallas")
    else:
        log.info("dsv3_jax trace options: no Hopper GPU found; kernels auto -> the plain-jnp reference")
