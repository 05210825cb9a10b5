"""pallas_kernels/lowering_memo.py: a kernel met again is not lowered again, and what the memo gives back is
the module JAX's own lowering makes (CPU: lowered for Hopper, `lowering_platforms=("cuda",)`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering

from pallas_kernels import grouped_gemm, lowering_memo

sds = jax.ShapeDtypeStruct


def _operands(rows: int):
    return sds((rows, 256), jnp.bfloat16), sds((2, 256, 256), jnp.bfloat16), sds((2,), jnp.int32)


def _lower(f, rows: int) -> str:
    # A fresh function each time: jit would otherwise reuse its own cached lowering of `f`.
    return jax.jit(lambda *a: f(*a)).trace(*_operands(rows)).lower(lowering_platforms=("cuda",)).as_text()


def _gemm(x, w, gs):
    return grouped_gemm(x, w, gs, interpret=False)


def _gemm_then_scale(x, w, gs):  # another program around the same kernel
    return 2 * grouped_gemm(x, w, gs, interpret=False) + 1


def _asm(module) -> str:
    # Mosaic GPU names each lowering's dump file by a process-wide counter: the one field that differs.
    text = module.operation.get_asm(enable_debug_info=False)
    return re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "", text)


@pytest.fixture(autouse=True)
def _fresh_memo():
    lowering_memo.clear()
    yield
    lowering_memo.clear()


def test_a_kernel_lowers_once_and_the_memo_returns_what_jax_makes(monkeypatch):
    seen = {}

    def record(name, fn):
        def wrapper(*a, **k):
            r = fn(*a, **k)
            seen.setdefault(name, []).append(_asm(r.module))
            return r
        return wrapper

    with lowering_memo.memoized_lowering():
        _lower(_gemm, 64)
    assert lowering_memo.stats == {"hits": 0, "misses": 1, "uncacheable": 0}

    monkeypatch.setattr(lowering_memo, "_memoized", record("memo", lowering_memo._memoized))
    with lowering_memo.memoized_lowering():
        with_memo = _lower(_gemm_then_scale, 64)
    assert lowering_memo.stats == {"hits": 1, "misses": 1, "uncacheable": 0}

    # Outside the block the lowering is JAX's own again; lower the second program fresh and compare.
    assert mgpu_lowering.lower_unpipelined_jaxpr_to_module is lowering_memo._original
    monkeypatch.setattr(mgpu_lowering, "lower_unpipelined_jaxpr_to_module",
                        record("jax", lowering_memo._original))
    fresh = _lower(_gemm_then_scale, 64)
    assert seen["memo"] == seen["jax"] and len(seen["jax"]) == 1
    assert "mosaic_gpu" in with_memo and with_memo.count("custom_call") == fresh.count("custom_call")


def test_other_shapes_are_other_kernels():
    with lowering_memo.memoized_lowering():
        _lower(_gemm, 64)
        _lower(_gemm, 128)
        with lowering_memo.memoized_lowering():  # re-entrant
            _lower(_gemm, 64)
    assert lowering_memo.stats == {"hits": 1, "misses": 2, "uncacheable": 0}
    assert mgpu_lowering.lower_unpipelined_jaxpr_to_module is lowering_memo._original


def test_a_jax_without_the_internals_turns_the_memo_off_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(lowering_memo, "_original", None)
    monkeypatch.setattr(lowering_memo, "unavailable", "AttributeError: moved")
    monkeypatch.setattr(lowering_memo, "_warned", False)
    with caplog.at_level("WARNING", logger="pallas_kernels.lowering_memo"):
        for _ in range(2):
            with lowering_memo.memoized_lowering():
                _lower(_gemm, 64)
    assert lowering_memo.stats == {"hits": 0, "misses": 0, "uncacheable": 0}  # JAX lowered both itself
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "memo off (AttributeError: moved)" in warnings[0]
