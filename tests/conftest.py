"""Shared pytest setup: CPU by default, GPU tests skipped (with the reason) when no GPU is present."""

import gc
import os
import tempfile

# Eight virtual CPU devices so mesh tests can run anywhere; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_ENABLE_X64", "0")
# The engine's persistent compilation cache: a throwaway directory, never the user's ~/.cache.
os.environ.setdefault("DSV3_JAX_CACHE_DIR", tempfile.mkdtemp(prefix="dsv3_jax_xla_"))

import jax  # noqa: E402
import pytest  # noqa: E402

# This pytest process never writes JAX's persistent cache (no compile is that slow); the subprocesses the
# tests start inherit DSV3_JAX_CACHE_DIR and share it as before. In one process JAX's in-memory caches
# already reuse programs; the engine's own program store (test_engine_step) still serializes.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)

# Every XLA:CPU executable JAX keeps maps ~3 memory regions for its code (measured), and JAX keeps every
# program it compiled. One process running the whole suite compiles thousands of distinct programs; the
# kernel's limit is vm.max_map_count (65,530 by default), and XLA:CPU segfaults instead of failing cleanly
# when a map is refused. Four CI runs of the kv_b inference form (2026-12-07), which compiles a few more
# programs per model handle, died so in test_sharding after ~700 tests, in a compile or in a cache write;
# never when that file ran alone. So each test module's compiled programs are dropped when it ends, and
# the summary reports the most maps seen.
_MAPS = {"peak": 0, "released": 0}


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    before = _memory_maps()
    _MAPS["peak"] = max(_MAPS["peak"], before)
    jax.clear_caches()
    gc.collect()
    _MAPS["released"] += max(0, before - _memory_maps())


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"memory maps: at most {_MAPS['peak']} at a module's end; {_MAPS['released']} released by dropping "
        "the modules' compiled programs, which one process would otherwise hold together (the kernel allows "
        "vm.max_map_count, 65,530 by default)")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DSV3_RUN_SLOW") != "1":
        skip_slow = pytest.mark.skip(reason="slow (multi-GB data); set DSV3_RUN_SLOW=1 to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if _has_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
