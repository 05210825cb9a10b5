"""Shared pytest setup: CPU by default, GPU tests skipped (with the reason) when no GPU is present."""

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
# tests start inherit DSV3_JAX_CACHE_DIR and share it as before. Why: three CI runs of the kv_b inference
# form (2026-12-07) died with a segmentation fault in XLA:CPU's executable serialization, inside JAX's
# cache write (`compilation_cache.put_executable_and_time`), at the same mesh-forward compile of
# test_sharding after ~740 tests; never when that test ran alone. In one process JAX's in-memory caches
# already reuse programs; the engine's own program store (test_engine_step) still serializes.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)


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
