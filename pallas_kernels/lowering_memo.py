"""A process-wide memo of Mosaic GPU kernel lowerings, so one kernel is lowered once per process.

Owns: `memoized_lowering()`, a context manager under which JAX's Mosaic GPU lowering of a kernel
(`lower_unpipelined_jaxpr_to_module`: the jaxpr to a Mosaic GPU MLIR module, layout inference included)
is looked up by what determines it (the kernel's jaxpr text, argument and result avals, compiler params,
the GPU mesh and the JAX mesh) before it is computed. A hit re-parses the stored module bytecode into
the current MLIR context; everything after (the serde pass, the custom call and its kernel hash) runs
unchanged, so a program lowered with the memo is the program lowered without it
(tests/test_lowering_memo.py compares the StableHLO text).

Why: an engine compiles each step shape twice (greedy and full sampling) and the two programs hold the
same kernels at the same shapes; Mosaic GPU lowering is ~90% of lowering a step (6.1 of 6.8 s for the
FP8 slice on the CPU, 12 kernel call sites a program; measured 2026-12-06) and it is serial Python, so
a cold warmup pays it per program.

Must not: change any lowering's result, hold MLIR objects across contexts (only bytes are kept), or
memoize a kernel whose jaxpr closes over array constants (their values are not in the text: such a
lowering is computed, not looked up). It patches one JAX-internal function, only inside the block; a JAX
without it turns the memo off with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

# JAX internals (checked against jax 0.11.2). If a JAX release moves them, the memo turns itself off with one
# warning and lowering is JAX's own: slower cold warmups, the same programs.
try:
    from jax._src import core as jax_core
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering

    _original = mgpu_lowering.lower_unpipelined_jaxpr_to_module
    unavailable: str | None = None
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the JAX version
    mgpu_lowering, _original, unavailable = None, None, f"{type(e).__name__}: {e}"

_lock = threading.Lock()
_memo: dict[tuple, tuple[bytes, Any]] = {}  # key -> (module bytecode, LoweringResult without its module)
_depth = 0  # nested memoized_lowering() scopes; the patch is installed while > 0
_warned = False
stats = {"hits": 0, "misses": 0, "uncacheable": 0}


def _is_array_value(c: Any) -> bool:
    # A kernel's nested jaxprs (run_scoped bodies) close over the kernel's refs: tracers, which the text
    # names with their types. A concrete array's values are not in the text.
    return not isinstance(c, jax_core.Tracer) and getattr(c, "ndim", 0) > 0


def _has_array_consts(jaxpr: jax_core.Jaxpr) -> bool:
    """True if some nested closed jaxpr carries concrete non-scalar constants."""
    for eqn in jaxpr.eqns:
        for sub in jax_core.jaxprs_in_params(eqn.params):
            if _has_array_consts(sub):
                return True
        for p in eqn.params.values():
            if isinstance(p, jax_core.ClosedJaxpr) and any(map(_is_array_value, p.consts)):
                return True
    return False


def _key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params) -> tuple | None:
    if jaxpr.constvars or _has_array_consts(jaxpr):
        return None
    return (str(jaxpr), tuple(map(str, in_shapes)), tuple(map(str, out_shapes)), repr(params), repr(gpu_mesh),
            repr(jax_mesh))


def _memoized(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, *, outer_traceback=None):
    key = _key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params)
    if key is None:
        stats["uncacheable"] += 1
        return _original(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params,
                         outer_traceback=outer_traceback)
    with _lock:
        hit = _memo.get(key)
    if hit is not None:
        stats["hits"] += 1
        bytecode, rest = hit
        return dataclasses.replace(rest, module=ir.Module.parse(bytecode))
    stats["misses"] += 1
    result = _original(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params,
                       outer_traceback=outer_traceback)
    # Stored as bytes: the module belongs to this lowering's MLIR context. Written before the serde pass
    # (which runs later, on each program's own copy).
    text = mlir.module_to_bytecode(result.module)
    with _lock:
        _memo[key] = (text, dataclasses.replace(result, module=None))
    return result


@contextlib.contextmanager
def memoized_lowering() -> Iterator[None]:
    """Lower Mosaic GPU kernels through the process-wide memo inside this block (re-entrant; lowering
    outside any such block is JAX's own). Where this JAX lacks the internals it patches, the block does
    nothing but warn once."""
    global _depth, _warned
    if _original is None:
        if not _warned:
            log.warning("Mosaic GPU kernel lowering memo off (%s): each program lowers its kernels itself",
                        unavailable)
            _warned = True
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            mgpu_lowering.lower_unpipelined_jaxpr_to_module = _memoized
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                mgpu_lowering.lower_unpipelined_jaxpr_to_module = _original


def clear() -> None:
    """Forget every memoized lowering (tests)."""
    with _lock:
        _memo.clear()
        for k in stats:
            stats[k] = 0
