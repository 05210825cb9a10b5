"""The engine's device side: the cache, the per-slot state and the compiled step programs of one engine.

The engine core (core.py) decides what runs; an executor runs it. `Executor` is the interface the core
calls: `execute(key, ints, floats)` runs the compiled step `key` on packed host inputs (step.py's layout)
and returns the packed outputs as device arrays, `clear_pages(pages)` zeroes physical pages, `warmup(keys)`
compiles step programs ahead of use, and `width`, `stats` and `compile_wall_s` say what it holds and what
compiling has cost. `DeviceExecutor` implements it in this process; multi-host wraps it
(parallel/lockstep.LockstepExecutor sends each operation to the other processes before running it).

Owns: the paged latent cache and the per-slot state arrays (allocated and placed on the handle's mesh, in
the cache dtype EngineConfig.kv_cache_dtype or the handle's names, its size logged in tokens),
the page-table width (the most pages one sequence can hold, rounded to 8 columns), the compiled step
programs (their compile key, the per-handle program dict engines over one handle share, the program
store on disk (program_cache.py), warmup's parallel compile with each kernel lowered once (lowering_memo),
compile counters and log lines), and the JAX persistent compilation cache setting.
Must not own requests, the schedule or page bookkeeping (core.py, scheduler.py, paging.py), the batch
layout (step.py) or model math (model/).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.engine import program_cache, step
from dsv3_jax.engine.api import EngineConfig
from dsv3_jax.model import kv_cache, layout
from dsv3_jax.parallel import sharding
from pallas_kernels import lowering_memo

log = logging.getLogger(__name__)

Progress = Callable[[int, int, step.StepKey, float], None]  # (done, total, key, seconds)


class Executor(Protocol):
    """What the engine core calls on the device side (DeviceExecutor; LockstepExecutor around it)."""

    @property
    def width(self) -> int:
        """Page-table columns of every step (step.StepKey.width)."""
        ...

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: compiles, compile_s (summed per program), compiles_after_warmup, programs_loaded."""
        ...

    @property
    def compile_wall_s(self) -> float:
        """Wall seconds this process spent compiling (warmup's parallel compile counted once)."""
        ...

    def execute(self, key: step.StepKey, ints: np.ndarray, floats: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """Run the step program `key` on packed host inputs; (out_ints, out_floats) on device."""
        ...

    def clear_pages(self, pages: np.ndarray) -> None:
        """Zero these physical pages (int32 [n]; 0 entries touch only scratch) in every cache leaf."""
        ...

    def warmup(self, keys: Sequence[step.StepKey], progress: Progress | None = None,
               workers: int | None = None) -> float:
        """Compile (or load) the programs `keys` and the page-clearing program; the seconds spent."""
        ...


# ------------------------------------------------------------------------------ compilation cache
CACHE_ENV = "DSV3_JAX_CACHE_DIR"  # a directory, or "off"


def compilation_cache_dir() -> Path | None:
    """Where compiled steps persist across runs: $DSV3_JAX_CACHE_DIR, else the user cache directory
    ($XDG_CACHE_HOME or ~/.cache)/dsv3_jax/xla; None when set to "off"."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dsv3_jax" / "xla"


def enable_compilation_cache() -> Path | None:
    """Turn on JAX's persistent compilation cache (once; a directory the user configured wins)."""
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    d = compilation_cache_dir()
    if d is None:
        return None
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    try:  # JAX decides once, at its first compile, whether the cache is on: let it decide again
        from jax._src import compilation_cache

        if compilation_cache._cache_checked and not compilation_cache._cache_used:
            compilation_cache.reset_cache()
    except (ImportError, AttributeError):  # another JAX version: the setting applies from the next process
        log.info("compilation cache set to %s; it applies to programs compiled from now on", d)
    return d


# Compiled steps per model handle, keyed explicitly (`DeviceExecutor.compile_key`); every executor over
# the same handle shares them. Dropped when the handle is garbage collected.
_COMPILED: dict[int, dict[tuple, Any]] = {}


def compiled_programs(handle: Any) -> dict[tuple, Any]:
    """The compiled step programs of `handle` (compile key -> executable), shared by its executors."""
    hid = id(handle)
    if hid not in _COMPILED:
        _COMPILED[hid] = {}
        weakref.finalize(handle, _COMPILED.pop, hid, None)
    return _COMPILED[hid]


# BF16 weights on a GPU: XLA's dense GEMMs as cuBLAS calls instead of Triton GEMM fusions, faster at the
# decode step's few rows. The BF16 1+2 slice's step on one H100 (step_profile.py --xla-variants,
# 2026-12-06): b=1 3.162 -> 2.648 ms wall, 2.748 -> 2.286 ms device; b=64 (with dynamic-slice fusion too)
# 16.885 -> 16.581 ms. The layer scan's copies of the dense weights (7 a layer, 0.43 GB) remain: adding
# xla_gpu_enable_dynamic_slice_fusion left the device time as it was (2.284 ms). FP8 linears are Pallas
# kernels: no change there.
BF16_GEMM_OPTIONS: dict[str, Any] = {"xla_gpu_enable_triton_gemm": False}


def default_compiler_options(handle: Any, platform: str) -> dict[str, Any]:
    """The XLA options a step of this handle compiles with before EngineConfig.compiler_options (which
    override them key by key): BF16_GEMM_OPTIONS for BF16 weights on a GPU, else none."""
    return dict(BF16_GEMM_OPTIONS) if platform == "gpu" and not handle.fp8 else {}


def batch_shards(handle: Any) -> int:
    """Batch shards of the handle's mesh (DP attention: data x expert); 1 without a mesh."""
    return 1 if handle.mesh is None else sharding.batch_multiple(handle.mesh)


class DeviceExecutor:
    """The cache, state and compiled steps for one engine configuration, in this process.

    `config.num_pages` must be a whole number of batch shards (the engine core rounds it up). Building
    one allocates the cache on the mesh, which spans processes in a multi-host run: every process builds
    its executor at the same point (parallel/lockstep.py sees to that).
    """

    def __init__(self, handle: Any, config: EngineConfig):
        self.handle, self.cfg = handle, config
        c, mc = config, handle.config
        shards = batch_shards(handle)
        if c.num_pages % shards:
            raise ValueError(f"num_pages ({c.num_pages}) must be a multiple of the {shards} batch shards")
        # One page-table width: the most pages a sequence can hold (the pool's shard or the context),
        # rounded to 8 columns. Kernels loop to each row's live length, so width costs only the table.
        longest = min(c.num_pages // shards - 1,
                      kv_cache.pages_for(mc.max_position_embeddings + c.spec_k, c.page_size))
        self.width = -(-max(longest, 1) // 8) * 8
        self._programs = program_cache.ProgramStore(enable_compilation_cache())
        self.compiler_options = {**default_compiler_options(handle, jax.default_backend()),
                                 **(c.compiler_options or {})}
        # EngineConfig.kv_cache_dtype, else the handle's (dsv3_jax.load(kv_cache_dtype=...)); "fp8": the FP8
        # latent cache (layout.cache_layout), quantized by the step's cache write.
        self.kv_cache_dtype = c.kv_cache_dtype or getattr(handle, "kv_cache_dtype", None) or "auto"
        cache_dtype = layout.kv_cache_dtype(mc, self.kv_cache_dtype)
        self.cache = sharding.place_cache(handle, kv_cache.allocate(
            mc, c.num_pages, c.page_size, handle.attention, cache_dtype, mtp=bool(c.spec_k)))
        per_token = layout.bytes_per_token(mc, handle.attention, cache_dtype, mtp=bool(c.spec_k))
        log.info("KV cache: %s (%s), %d pages of %d tokens in %d batch shard(s): %d tokens (%s B per token, "
                 "%.2f GB)", self.kv_cache_dtype, "fp8 e4m3 latent + bf16 rope" if layout.is_fp8(cache_dtype)
                 else jnp.dtype(cache_dtype).name, c.num_pages, c.page_size, shards,
                 (c.num_pages - shards) * c.page_size, f"{per_token:,}",
                 c.num_pages * c.page_size * per_token / 1e9)
        self.state = step.init_state(c.max_batch + 1, c.spec_k, mc.vocab_size)
        if handle.mesh is not None:
            self.state = jax.device_put(self.state, self._replicated())
        leaves, tree = jax.tree.flatten((self.cache, self.state))
        self._sig = (str(tree), tuple((x.shape, str(x.dtype)) for x in leaves), id(handle.mesh))
        self._warm = False  # set by warmup(): a compile after it is a bug (logged, counted)
        self._clear_program = None  # clear_pages compiled by warmup()
        self.compile_wall_s = 0.0
        self.stats: dict[str, Any] = {"compiles": 0, "compile_s": 0.0, "compiles_after_warmup": 0,
                                      "programs_loaded": 0}

    # ------------------------------------------------------------------ running
    def execute(self, key: step.StepKey, ints: np.ndarray, floats: np.ndarray) -> tuple[jax.Array, jax.Array]:
        fn = self._compiled(key)
        with self.handle.mesh_context():
            out_ints, out_floats, self.cache, self.state = fn(self.handle.params, self.cache, self.state,
                                                              self._put(ints), self._put(floats))
        return out_ints, out_floats

    def clear_pages(self, pages: np.ndarray) -> None:
        if self._clear_program is not None and pages.shape == (self.width,):
            self.cache = self._clear_program(self.cache, self._put(pages))
        else:
            self.cache = _clear_pages(self.cache, jnp.asarray(pages))

    def _replicated(self) -> jax.sharding.Sharding:
        if self.handle.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.sharding.NamedSharding(self.handle.mesh, jax.sharding.PartitionSpec())

    def _put(self, x: np.ndarray) -> jax.Array:
        if self.handle.mesh is None:
            return jnp.asarray(x)
        return jax.make_array_from_callback(x.shape, self._replicated(), lambda idx: x[idx])

    # ------------------------------------------------------------------ compiling
    def compile_key(self, key: step.StepKey) -> tuple:
        """What a compiled step depends on: the step key, the cache/state signature, the model's trace
        options whole (model/trace_options.py: kernel backend, MoE dispatch and its thresholds) and the
        XLA options."""
        opts = tuple(sorted(self.compiler_options.items()))
        return (key, self._sig, self.handle.model.trace_options, opts)

    def _program_id(self, key: step.StepKey) -> str:
        """The program store's name for `key`: the compile key without the in-process signature (the
        store hashes the arrays' shapes, dtypes and shardings itself), plus the attention form."""
        h = self.handle
        key_, _sig, trace_options, opts = self.compile_key(key)
        return program_cache.program_id((key_, trace_options, opts, h.attention),
                                        (h.params, self.cache, self.state), h.mesh, h.config)

    def _lower(self, key: step.StepKey):
        ints = jax.ShapeDtypeStruct((step.packed_size(step.int_fields(key)),), jnp.int32)
        floats = jax.ShapeDtypeStruct((step.packed_size(step.float_fields(key)),), jnp.float32)
        if self.handle.mesh is not None:
            rep = self._replicated()
            ints = jax.ShapeDtypeStruct(ints.shape, ints.dtype, sharding=rep)
            floats = jax.ShapeDtypeStruct(floats.shape, floats.dtype, sharding=rep)
        fn = jax.jit(self._step_fn(key), donate_argnums=(1, 2))
        # Programs share kernels (greedy and full twins hold the same ones): each Mosaic GPU kernel is
        # lowered once per process (pallas_kernels/lowering_memo.py), the serial part of a cold warmup.
        with self.handle.mesh_context(), lowering_memo.memoized_lowering():
            return fn.lower(self.handle.params, self.cache, self.state, ints, floats)

    def _step_fn(self, key: step.StepKey):
        """The step function of `key`, its returned per-slot state pinned to the sharding it came in with
        (replicated): left to propagation, a program may hand it back split over `tensor` (the long-prefill
        program did), and the next program, compiled for the replicated input, would refuse it."""
        inner = step.make_step(self.handle.model, key)
        if self.handle.mesh is None:
            return inner
        rep = self._replicated()

        def pinned(params, cache, state, ints, floats):
            out_ints, out_floats, cache, state = inner(params, cache, state, ints, floats)
            return out_ints, out_floats, cache, jax.lax.with_sharding_constraint(state, rep)
        return pinned

    def _compile_lowered(self, lowered):
        opts = dict(self.compiler_options)
        with self.handle.mesh_context():
            return lowered.compile(compiler_options=opts) if opts else lowered.compile()

    def _compile_timed(self, lowered, t0: float):
        compiled = self._compile_lowered(lowered)
        return compiled, time.perf_counter() - t0

    def _compiled(self, key: step.StepKey):
        store = compiled_programs(self.handle)
        ck = self.compile_key(key)
        if ck not in store:
            t0 = time.perf_counter()
            store[ck] = self._compile_lowered(self._lower(key))
            seconds = time.perf_counter() - t0
            self.compile_wall_s += seconds
            self.stats["compiles"] += 1
            self.stats["compile_s"] += seconds
            if self._warm:
                self.stats["compiles_after_warmup"] += 1
                log.warning("compiled step %s after warmup (%.1f s): outside the warmed set", key, seconds)
            else:
                log.info("compiled step %s in %.1f s", key, seconds)
        return store[ck]

    def warmup(self, keys: Sequence[step.StepKey], progress: Progress | None = None,
               workers: int | None = None) -> float:
        """Compile the step programs `keys` not compiled yet, and the page-clearing program; returns the
        seconds spent. Tracing runs here one program after another; XLA compiles them on `workers`
        threads meanwhile (default: one per program, up to the CPU count). `progress(done, total, key,
        seconds)` is called as each program finishes, in completion order. A program an earlier process
        compiled loads from the program store (program_cache: no tracing), else XLA's persistent cache
        spares the compile.
        A compile after warmup is counted (`stats["compiles_after_warmup"]`) and logged."""
        store = compiled_programs(self.handle)
        keys = [k for k in keys if self.compile_key(k) not in store]
        t_start = time.perf_counter()
        done = 0
        workers = workers or max(1, min(len(keys), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {}
            for key in keys:
                t0 = time.perf_counter()
                loaded = self._programs.load(self._program_id(key), self._devices())
                if loaded is not None:
                    store[self.compile_key(key)] = loaded
                    self.stats["programs_loaded"] += 1
                    done += 1
                    log.info("loaded step %s in %.1f s", key, time.perf_counter() - t0)
                    if progress is not None:
                        progress(done, len(keys), key, time.perf_counter() - t0)
                    continue
                lowered = self._lower(key)
                futures[pool.submit(self._compile_timed, lowered, t0)] = key
            for fut in concurrent.futures.as_completed(futures):
                key = futures[fut]
                compiled, seconds = fut.result()
                store[self.compile_key(key)] = compiled
                self._programs.save(self._program_id(key), compiled)
                self.stats["compiles"] += 1
                self.stats["compile_s"] += seconds
                done += 1
                log.info("compiled step %s in %.1f s", key, seconds)
                if progress is not None:
                    progress(done, len(keys), key, seconds)
        if self._clear_program is None:  # compiled, not run: a multi-host run must not execute it alone
            pages = jax.ShapeDtypeStruct((self.width,), jnp.int32, sharding=self._replicated())
            with self.handle.mesh_context():
                self._clear_program = _clear_pages.lower(self.cache, pages).compile()
        wall = time.perf_counter() - t_start
        self.compile_wall_s += wall
        self._warm = True
        return wall

    def _devices(self) -> list:
        mesh = self.handle.mesh
        return [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)


@jax.jit
def _clear_pages(cache: dict, pages: jax.Array) -> dict:
    return kv_cache.clear_pages(cache, pages)
