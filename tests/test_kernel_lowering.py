"""Every kernel call we know of, lowered for Hopper ahead of time (no GPU needed).

Pallas' GPU interpreter never builds TMA descriptors, so a shape Mosaic GPU cannot lower (a TMA operand
whose row count is not a multiple of the 8-row tiling, a tile past the shared-memory limit) passes every
CPU test and fails only when compiled: `tests/test_kernel_fuzz.py` compiled on an H200 failed 2 of 8 GEMM
configurations that way (rows = 65) before the kernels padded rows to whole tiles. This file lowers
(`lowering_platforms=("cuda",)`, which runs Mosaic GPU's own checks and lowering on the CPU):

- every configuration `tests/test_kernel_fuzz.py` draws, at its shapes (its case generators are reused);
- every distinct kernel call the model makes, for the embedded default model (bf16 experts:
  `grouped_gemm`) and for the full-width FP8 slice of the benchmarks (hidden 7168, 1 dense + 4 MoE layers:
  `fp8_linear`, `fp8_grouped_linear`), plus the MLA kernel, for a prompt of T tokens ([1, T], prefill) and
  for a ragged batch of T one-token rows ([T, 1], the engine's decode step). The calls are collected by
  tracing the model abstractly (`jax.ShapeDtypeStruct` weights, no full-width array is ever allocated)
  with the kernel entry points replaced by recorders, then each distinct call is lowered.

Each distinct kernel is lowered once (calls whose operands pad to the same kernel share it). Lowering
costs ~0.5-1 s per kernel on the 2-core CI box and the MLA kernel differs for every (B, T), so the default
run lowers the prefill calls at T = 1, 17, 65, 300 (~60 s with the fuzz configurations); marked slow
(DSV3_RUN_SLOW=1): the edges of every power-of-two tile (T = 1..9, 15..17, 31..33, 63..66, 127..130,
255..257, 300, powers of two to 2048; ~4 min per model) and the full sweep T = 1..300, both also with
the [T, 1] decode batch.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8_gemm, grouped_gemm, mla_decode, mla_prefill
from pallas_kernels.experimental.fp8_small_m import fp8_gemm_swap_ab
from pallas_kernels.fp8_quant import FP8_DTYPE, num_blocks
from tests.test_kernel_fuzz import GEMM_SEEDS, MLA_SEEDS, gemm_case, mla_inputs
from tests.test_mla_kernels import SCALE

sds = jax.ShapeDtypeStruct
# The default run: prefill [1, T] only (a [T, 1] decode batch makes the same GEMM calls; only its MLA
# calls differ), at T = 1, 17 (the default model's experts get 68 rows), 65 (the dense GEMMs 65 rows)
# and 300 (several row tiles); every lowering costs ~0.5-1 s on the 2-core CI box.
SMOKE_TOKENS = [1, 17, 65, 300]
EDGE_TOKENS = sorted({*range(1, 10), *range(15, 18), *range(31, 34), *range(63, 67), *range(127, 131),
                    *range(255, 258), 300, *(1 << i for i in range(12))})
FULL_TOKENS = sorted({*range(1, 301), *(1 << i for i in range(12))})


def _lower(f, *args) -> str:
    """Lower `f(*args)` for CUDA; the Mosaic GPU kernel must be in the module."""
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, "no Mosaic GPU kernel in the lowered module"
    return text


# ------------------------------------------------------------------ (a) the fuzz test's configurations
def _fp8_operands(rows: int, k: int, n: int, groups: int | None):
    w_shape = (n, k) if groups is None else (groups, n, k)
    ws_shape = (num_blocks(n), num_blocks(k)) if groups is None else (groups, num_blocks(n), num_blocks(k))
    return (sds((rows, k), FP8_DTYPE), sds((rows, num_blocks(k)), jnp.float32), sds(w_shape, FP8_DTYPE),
            sds(ws_shape, jnp.float32))


@pytest.mark.parametrize("seed", GEMM_SEEDS)
def test_fuzz_gemm_configuration_lowers(seed):
    c = gemm_case(seed)
    kind, rows, k, n = c["kind"], c["rows"], c["k"], c["n"]
    try:
        if kind in ("dense", "swap_ab"):
            kernel = fp8_gemm.fp8_gemm if kind == "dense" else fp8_gemm_swap_ab
            _lower(functools.partial(kernel, interpret=False), *_fp8_operands(rows, k, n, None))
        else:
            groups = len(c["group_sizes"])
            gs = sds((groups,), jnp.int32)
            if kind == "fp8_grouped":
                _lower(functools.partial(fp8_gemm.fp8_grouped_gemm, interpret=False),
                       *_fp8_operands(rows, k, n, groups), gs)
            else:
                _lower(functools.partial(grouped_gemm, interpret=False), sds((rows, k), jnp.bfloat16),
                       sds((groups, n, k), jnp.bfloat16), gs)
    except Exception as e:  # the message names the case, so a failure says which shape cannot lower
        raise AssertionError(f"seed {seed} {kind} rows={rows} k={k} n={n}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("seed", MLA_SEEDS)
def test_fuzz_mla_configuration_lowers(seed):
    c, _, kv, table, ql, qr = mla_inputs(seed)
    b = len(c["lens"])
    args = [sds(a.shape, a.dtype) for a in (ql, qr, kv, table)]
    lens = sds((b,), jnp.int32)
    try:
        if c["prefill"]:
            f = functools.partial(mla_prefill, softmax_scale=SCALE, num_splits=c["splits"], interpret=False)
            _lower(f, *args, lens, lens)
        else:
            f = functools.partial(mla_decode, softmax_scale=SCALE, num_splits=c["splits"], interpret=False)
            _lower(f, *args, lens)
    except Exception as e:
        raise AssertionError(f"seed {seed} {c}: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------- (b) the model's kernel calls
DEFAULT_CONFIG = pathlib.Path(__file__).parent.parent / "dsv3_jax" / "default_model" / "config.json"
_TABLE_PAGES = 32  # page-table width of the traced calls (2048 tokens); the pool has one page more
_TIMES: dict[str, float] = {}


def _model_config(name: str):
    from dsv3_jax.config import ModelConfig

    if name == "default":  # the embedded default model: bf16 experts -> grouped_gemm
        return ModelConfig.from_json(DEFAULT_CONFIG), False
    # benchmarks/e2e_bench.py's slice_config(4, tiny=False): full width, 1 dense + 4 MoE layers, FP8.
    cfg = ModelConfig.preset("deepseek-v3").replace(num_hidden_layers=5, first_k_dense_replace=1,
                                                   num_nextn_predict_layers=0)
    return cfg, True


def _abstract(x):
    return sds(x.shape, x.dtype)


@contextlib.contextmanager
def _recording(calls: set):
    """Replace the kernel entry points `dsv3_jax.model.kernel_dispatch` calls with recorders that note
    (entry, abstract operands, static arguments) and return zeros of the kernel's result shape (tracing the
    interpreter's kernels would only cost time)."""
    import importlib
    from unittest import mock

    gg_mod = importlib.import_module("pallas_kernels.grouped_gemm")
    prefill_mod = importlib.import_module("pallas_kernels.mla_prefill")

    def fp8_linear(x, w, s, *, out_dtype=None, interpret=None):
        out_dtype = jnp.dtype(out_dtype or x.dtype)
        rows = int(np.prod(x.shape[:-1]))  # fp8_linear flattens the leading dims: [1, T] and [T, 1] agree
        calls.add(("fp8_linear", sds((rows, x.shape[-1]), x.dtype), _abstract(w), _abstract(s), out_dtype))
        return jnp.zeros((*x.shape[:-1], w.shape[0]), out_dtype)

    def fp8_grouped_linear(x, w, s, gs, *, out_dtype=None, config=None, interpret=None):
        assert config is None, "the model passes no tiling"
        out_dtype = jnp.dtype(out_dtype or x.dtype)
        calls.add(("fp8_grouped_linear", _abstract(x), _abstract(w), _abstract(s), _abstract(gs), out_dtype))
        return jnp.zeros((x.shape[0], w.shape[1]), out_dtype)

    def grouped(x, w, gs, *, out_dtype=None, config=None, interpret=None):
        assert config is None, "the model passes no tiling"
        out_dtype = jnp.dtype(out_dtype or x.dtype)
        calls.add(("grouped_gemm", _abstract(x), _abstract(w), _abstract(gs), out_dtype))
        return jnp.zeros((x.shape[0], w.shape[1]), out_dtype)

    real_chunk = prefill_mod.mla_chunk_attention

    def chunk(q_latent, q_rope, kv_pages, block_table, start_pos, chunk_lens, *, softmax_scale, use_kernel,
              interpret=None):
        if not use_kernel:  # the reference: no kernel to lower
            return real_chunk(q_latent, q_rope, kv_pages, block_table, start_pos, chunk_lens,
                              softmax_scale=softmax_scale, use_kernel=False)
        dt = kv_pages.dtype  # mla_chunk_attention casts q to the cache's dtype for the kernel
        calls.add(("mla_prefill", sds(q_latent.shape, dt), sds(q_rope.shape, dt), _abstract(kv_pages),
                   _abstract(block_table), _abstract(start_pos), _abstract(chunk_lens), float(softmax_scale)))
        return jnp.zeros(q_latent.shape, dt), jnp.zeros(q_latent.shape[:-1], jnp.float32)

    with (mock.patch.object(fp8_gemm, "fp8_linear", fp8_linear),
          mock.patch.object(fp8_gemm, "fp8_grouped_linear", fp8_grouped_linear),
          mock.patch.object(gg_mod, "grouped_gemm", grouped),
          mock.patch.object(prefill_mod, "mla_chunk_attention", chunk)):
        yield


@functools.cache
def _model(name: str):
    from dsv3_jax.model import inference_form
    from dsv3_jax.model.trace_options import TraceOptions
    from dsv3_jax.model.transformer import Transformer

    cfg, fp8 = _model_config(name)
    model = Transformer(cfg, jnp.bfloat16, fp8=fp8, trace_options=TraceOptions(kernels="pallas"))
    # The parameters do not depend on the trace options: shapes from the reference model's init.
    ref = model.clone(trace_options=TraceOptions(kernels="reference"))
    params = jax.eval_shape(lambda k: ref.init(k, jnp.zeros((1, 1), jnp.int32))["params"],
                            jax.random.key(0))
    # as a ModelHandle holds them (the fused q_a / kv_a is a GEMM shape of its own)
    return cfg, model, inference_form.shapes(params, cfg, jnp.bfloat16)


def model_kernel_calls(name: str, tokens: list[int], decode: bool = True) -> set:
    """The distinct kernel calls of model `name` ("default" or "fp8_slice") over a [1, T] prompt (prefill)
    and, with `decode`, a [T, 1] ragged batch (one decode token per row), for each T in `tokens`, with a
    paged cache."""
    from dsv3_jax.model import kv_cache as cache_lib

    cfg, model, params = _model(name)  # built with TraceOptions(kernels="pallas")
    pool = jax.eval_shape(lambda: cache_lib.allocate(cfg, _TABLE_PAGES + 1))
    calls: set = set()
    with _recording(calls):
        for t in tokens:
            for b, q in ((1, t), (t, 1)) if decode else ((1, t),):
                meta = cache_lib.PageMeta(sds((b, _TABLE_PAGES), jnp.int32), sds((b,), jnp.int32))

                def fwd(p, tok, pos, pool, meta):
                    return model.apply({"params": p}, tok, pos, pool, meta)

                jax.eval_shape(fwd, params, sds((b, q), jnp.int32), sds((b, q), jnp.int32), pool, meta)
    return calls


def _entry(call):
    """(the entry point with its static arguments, the abstract operands) of a recorded call."""
    kind, *ops = call
    *args, static = ops
    if kind == "mla_prefill":
        return functools.partial(mla_prefill, softmax_scale=static, interpret=False), args
    entry = {"fp8_linear": fp8_gemm.fp8_linear, "fp8_grouped_linear": fp8_gemm.fp8_grouped_linear,
             "grouped_gemm": grouped_gemm}[kind]
    return functools.partial(entry, out_dtype=static, interpret=False), args


def _kernel_eqns(jaxpr, out: list) -> list:
    """The Mosaic GPU kernel launches (``mpmd_map``) anywhere in ``jaxpr``."""
    for e in jaxpr.eqns:
        if e.primitive.name == "mpmd_map":
            out.append(e)
        for p in e.params.values():
            if isinstance(p, jax.extend.core.ClosedJaxpr):
                _kernel_eqns(p.jaxpr, out)
            elif isinstance(p, jax.extend.core.Jaxpr):
                _kernel_eqns(p, out)
    return out


def _kernel_key(call) -> str:
    """What lowering a call depends on beyond generic XLA: its kernel launches, with their operand types
    and the traced kernel bodies. Calls whose rows pad to the same kernel (T = 1..64 of a dense GEMM all
    run one 64-row tile) share a key, so each distinct kernel is lowered once."""
    f, args = _entry(call)
    eqns = _kernel_eqns(jax.jit(f).trace(*args).jaxpr.jaxpr, [])
    assert eqns, f"{_describe(call)} launches no Mosaic GPU kernel"
    return "\n".join(map(str, eqns))


def _lower_call(call) -> None:
    f, args = _entry(call)
    _lower(f, *args)


def _describe(call) -> str:
    kind, *ops = call
    shown = [f"{o.dtype}{list(o.shape)}" if isinstance(o, jax.ShapeDtypeStruct) else str(o) for o in ops]
    return f"{kind}({', '.join(shown)})"


def check_model_lowers(name: str, tokens: list[int], expect: set[str], decode: bool = True) -> None:
    t0 = time.perf_counter()
    calls = model_kernel_calls(name, tokens, decode)
    t1 = time.perf_counter()
    assert {c[0] for c in calls} == expect, f"{name}: the model called {sorted({c[0] for c in calls})}"
    failures, lowered = [], {}
    for call in sorted(calls, key=_describe):
        try:
            key = _kernel_key(call)
            if key not in lowered:
                lowered[key] = call
                _lower_call(call)
        except Exception as e:  # collect all: one run names every shape that cannot lower
            failures.append(f"{_describe(call)}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    _TIMES[name] = time.perf_counter() - t0
    print(f"{name}: {len(tokens)} token counts, {len(calls)} distinct kernel calls, {len(lowered)} distinct "
          f"kernels; model traces {t1 - t0:.1f} s, lowering {time.perf_counter() - t1:.1f} s")
    assert not failures, f"{len(failures)} of {len(calls)} {name} kernel calls do not lower:\n" + "\n".join(
        failures)


MODELS = {"default": {"grouped_gemm", "mla_prefill"},
          "fp8_slice": {"fp8_linear", "fp8_grouped_linear", "mla_prefill"}}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_kernel_calls_lower(name):
    check_model_lowers(name, SMOKE_TOKENS, MODELS[name], decode=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_kernel_calls_lower_at_tile_edges(name):
    """~4 min per model on the 2-core box: the edges of every power-of-two tile, prefill and decode."""
    check_model_lowers(name, EDGE_TOKENS, MODELS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_kernel_calls_lower_every_token_count(name):
    """T = 1..300 and the powers of two to 2048, prefill and decode: most of an hour on the 2-core box."""
    check_model_lowers(name, FULL_TOKENS, MODELS[name])


def test_recorders_see_the_padded_row_counts():
    """The recorders are no-ops if the model stops calling through them; this pins what they record: the
    default model at T = 17 sends 17 x 4 = 68 rows (not a multiple of the 8-row TMA tile) to the experts."""
    calls = model_kernel_calls("default", [17])
    rows = {c[1].shape[0] for c in calls if c[0] == "grouped_gemm"}
    assert 68 in rows, rows
    assert np.all([r % 4 == 0 for r in rows]), rows
