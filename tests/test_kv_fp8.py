"""The FP8 latent KV cache (issue 28): its format, its arithmetic, and that every engine feature works on it.

Format (pallas_kernels/mla_common.py): per token 512 latent values in e4m3, one fp32 scale per 128, 64
rope values in bf16 = 656 bytes vs 1,152 in bf16. Bounds below come from e4m3 / bf16 arithmetic:
- a block's scale is amax / 448, so a value x maps to y = x / scale with |y| <= 448; e4m3 keeps 3 mantissa
  bits: for |y| >= 2^-6 (normal) rounding errs by at most half an ulp, 2^-4 |y|; below, the subnormal
  step is 2^-9, so the error is at most 2^-10. Dequantized: |x^ - x| <= max(2^-4 |x|, 2^-10 scale), plus
  the fp32 division and product (2 ulps of fp32, 2^-23 |x|);
- rope in bf16 (8 significant bits): |r^ - r| <= 2^-8 |r|.
The engine on an FP8 cache must equal the FP8-cache reference forward (one whole-sequence chunk over a
contiguous FP8 pool: every key and value read through the same quantize -> dequantize) up to fp32
reordering, and stay close to the bf16/fp32 cache engine (bound derived in the test).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from dsv3_jax import plan
from dsv3_jax.api import ModelHandle
from dsv3_jax.config import ModelConfig
from dsv3_jax.engine.core import Engine, EngineConfig
from dsv3_jax.model import kv_cache, layout
from pallas_kernels.mla_common import (
    FP8_KV_BYTES,
    LATENT_DIM,
    PAGE_SIZE,
    ROPE_DIM,
    Fp8Pages,
    dequantize_kv,
    fp8_row_bytes,
    quantize_kv,
)
from tests.test_engine import CFG, _alone, _mtp_friendly_params, _prompts

V3 = ModelConfig.preset("deepseek-v3")


def _latents(key, shape, spread: float = 6.0):
    """Values over ~`spread` binades of magnitude, with sign, a zero block and a lone outlier per row."""
    k1, k2, k3 = jax.random.split(key, 3)
    mag = jnp.exp2(jax.random.uniform(k1, shape, minval=-spread, maxval=2.0))
    x = mag * jnp.sign(jax.random.normal(k2, shape))
    x = x.at[..., 0].set(jax.random.normal(k3, shape[:-1]) * 300.0)  # outlier: small values go subnormal
    if shape[-1] >= 256:
        x = x.at[..., 128:256].set(0.0)  # an all-zero block (scale 1, no division by zero)
    return x


@pytest.mark.parametrize("latent,rope", [(512, 64), (32, 8), (24, 4)])
@pytest.mark.parametrize("pow2", [False, True])
def test_round_trip_bound(latent, rope, pow2):
    x = _latents(jax.random.key(latent), (5, 7, latent))
    r = jax.random.normal(jax.random.key(1), (5, 7, rope)) * 3.0
    nb = -(-latent // 128)
    pages = quantize_kv(x, r, pow2_scales=pow2)  # 5 pages of 7 tokens
    assert [(a.shape, a.dtype) for a in pages] == [
        ((5, 7, latent), jnp.float8_e4m3fn), ((5, nb, 7), jnp.float32), ((5, 7, rope), jnp.bfloat16)]
    assert sum(a[0, :1].nbytes if i != 1 else a[0, :, :1].nbytes for i, a in enumerate(pages)) == \
        fp8_row_bytes(latent, rope)
    back = dequantize_kv(pages, rope, jnp.float32)
    x_hat, r_hat = np.asarray(back[..., :latent]), np.asarray(back[..., latent:])
    x, r = np.asarray(x), np.asarray(r)
    blocks = np.pad(np.abs(x), [(0, 0), (0, 0), (0, nb * 128 - latent)]).reshape(5, 7, nb, 128)
    amax = blocks.max(-1)
    scale = np.where(amax > 0, amax / 448.0, 1.0)
    if pow2:
        scale = np.exp2(np.ceil(np.log2(scale)))
    scale_el = np.repeat(scale, 128, axis=-1)[..., :latent]
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale_el) + 2.0**-22 * np.abs(x)
    err = np.abs(x_hat - x)
    assert (err <= bound).all(), f"worst excess {np.max(err - bound):.3e}"
    # The bound is tight: some values do err by close to half an e4m3 ulp.
    assert np.max(err / np.maximum(bound, 1e-30)) > 0.5
    assert (np.abs(r_hat - r) <= 2.0**-8 * np.abs(r)).all()
    zero = dequantize_kv(jax.tree.map(jnp.zeros_like, pages), rope)
    assert not np.asarray(zero).any()  # cleared pages (all-zero bytes, scales 0 too) read as zeros
    with pytest.raises(ValueError, match="rope"):
        dequantize_kv(pages, rope + 1)


def test_format_bytes_and_planner_ratio():
    assert FP8_KV_BYTES == 656 == fp8_row_bytes(512, 64)
    bf16 = layout.bytes_per_token(V3, "absorbed", jnp.bfloat16)
    fp8 = layout.bytes_per_token(V3, "absorbed", "fp8")
    assert (bf16, fp8) == (576 * 2 * 61, 656 * 61)
    assert bf16 / fp8 >= 1.7
    # The planner's pool: tokens per GB of KV >= 1.7x, and more tokens in the same memory.
    kw = dict(dtype="fp8", max_model_len=32768, device_memory="141GB", max_batched_tokens=2048,
              max_batch=256, attention_kernel=True)
    p16 = plan.pool_plan(V3, "tensor=8", cache_dtype="bf16", **kw)
    p8 = plan.pool_plan(V3, "tensor=8", cache_dtype="fp8", **kw)
    per_gb = [p.kv_tokens_per_shard / p.kv_bytes_per_device for p in (p16, p8)]
    assert per_gb[1] / per_gb[0] >= 1.7
    assert p8.kv_tokens_per_shard >= 1.7 * p16.kv_tokens_per_shard
    assert "kv cache dtype fp8" in p8.summary()
    q = plan.plan(V3, "tensor=8", dtype="fp8", device_memory="141GB", kv_cache_dtype="fp8")
    assert q.kv_bytes_per_token == fp8 and q.tokens_per_device >= 1.7 * plan.plan(
        V3, "tensor=8", dtype="fp8", device_memory="141GB").tokens_per_device
    # The pool the engine allocates is what the layout declares.
    cache = jax.eval_shape(lambda: kv_cache.allocate(CFG, 8, 4, dtype="fp8", mtp=True))
    lat, nb, rope = CFG.kv_lora_rank, -(-CFG.kv_lora_rank // 128), CFG.qk_rope_head_dim
    want = {layout.FP8_LATENT: ((8, 4, lat), jnp.float8_e4m3fn), layout.FP8_SCALE: ((8, nb, 4), jnp.float32),
            layout.FP8_ROPE: ((8, 4, rope), jnp.bfloat16)}
    assert set(cache) == {layout.DENSE_LAYERS, layout.MOE_LAYERS, layout.MTP}
    for name, pool in cache.items():
        lead = () if name == layout.MTP else (getattr(CFG, f"n_{name.split('_')[0]}_layers"),)
        assert {k: (v.shape, v.dtype) for k, v in pool.items()} == {
            k: ((*lead, *shape), jnp.dtype(dt)) for k, (shape, dt) in want.items()}
    # Per token per layer: exactly the format's bytes (656 for V3).
    assert fp8 == fp8_row_bytes(512, 64) * V3.num_hidden_layers


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(ValueError, match="absorbed"):
        layout.cache_layout(CFG, 4, 4, "naive", "fp8")
    with pytest.raises(ValueError, match="absorbed"):
        ModelHandle(CFG, {}, "naive", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        layout.kv_cache_dtype(CFG, "int8")
    with pytest.raises(ValueError, match="stores e4m3: use fp8"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype=["fp8"])  # a wrong type: the same one line, not a TypeError


def test_vllm_names_for_the_cache_dtypes():
    """vLLM's --kv-cache-dtype names (fp8_e4m3: what its fp8 means on CUDA; bfloat16) mean our fp8 and bf16
    everywhere a cache dtype is named: the CLIs' flag, EngineConfig, the handle, the plan."""
    import argparse

    from dsv3_jax.parallel import flags as parallel_cli

    ap = argparse.ArgumentParser()
    parallel_cli.add_flags(ap)
    assert ap.parse_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8"
    assert ap.parse_args(["--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bf16"
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    assert ModelHandle(CFG, {}, "absorbed", kv_cache_dtype="bfloat16").kv_cache_dtype == "bf16"
    with pytest.raises(ValueError, match="absorbed"):
        ModelHandle(CFG, {}, "naive", kv_cache_dtype="fp8_e4m3")
    assert layout.kv_cache_dtype(CFG, "fp8_e4m3") == layout.FP8
    p8 = plan.plan(V3, "tensor=8", device_memory="141GB", kv_cache_dtype="fp8_e4m3")
    assert p8.kv_cache_dtype == "fp8"
    assert p8.kv_bytes_per_token == plan.plan(V3, "tensor=8", device_memory="141GB",
                                              kv_cache_dtype="fp8").kv_bytes_per_token


def test_reference_reads_fp8_pages_as_their_dequantized_values():
    """Every jnp reference path (decode, MTP verify, prefill chunk) on FP8 pages equals the same path on
    the dequantized pages: the FP8 read is exactly `dequantize_kv`."""
    rng = np.random.default_rng(0)
    b, h, pages, ps = 3, 4, 12, 64
    vals = jax.random.normal(jax.random.key(0), (pages, ps, 576))
    fp8 = quantize_kv(vals[..., :512], vals[..., 512:])
    deq = dequantize_kv(fp8, 64, jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[:9].reshape(3, 3), jnp.int32)
    lens = jnp.asarray([70, 130, 5], jnp.int32)
    ql = jax.random.normal(jax.random.key(1), (b, 2, h, 512))
    qr = jax.random.normal(jax.random.key(2), (b, 2, h, 64))
    for fn, args in ((pallas_kernels.mla_decode_reference, (lens,)),
                     (pallas_kernels.mla_prefill_reference, (lens - 2, jnp.asarray([2, 1, 2], jnp.int32)))):
        o8, l8 = fn(ql, qr, fp8, table, *args, softmax_scale=0.1)
        o, lse = fn(ql, qr, deq, table, *args, softmax_scale=0.1)
        np.testing.assert_array_equal(np.asarray(o8), np.asarray(o))
        np.testing.assert_array_equal(np.asarray(l8), np.asarray(lse))


# ------------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def params():
    return _mtp_friendly_params(CFG, 1, 4.0)


@pytest.fixture(scope="module")
def fp8_handle(params):
    return ModelHandle(CFG, params, kv_cache_dtype="fp8")


REF_LEN = 48  # every reference call is padded to this many tokens: one compiled shape


def _reference_logprobs(handle: ModelHandle, tokens: list[int], dtype) -> np.ndarray:
    """log-softmax [T, V] of one whole-sequence chunk over a contiguous pool of `dtype` ("fp8": every key
    and value the attention reads went through quantize -> dequantize, as in the engine)."""
    t = len(tokens)
    assert t <= REF_LEN
    cache, table = kv_cache.allocate_contiguous(handle.config, 1, REF_LEN, dtype=dtype)
    pos = jnp.arange(REF_LEN, dtype=jnp.int32)[None]
    meta = kv_cache.PageMeta(jnp.asarray(table), jnp.asarray([t], jnp.int32))  # tokens >= t: padding
    toks = jnp.asarray([tokens + [0] * (REF_LEN - t)], jnp.int32)
    logits = _apply(handle.model, handle.params, toks, pos, cache, meta)[0]
    return np.asarray(jax.nn.log_softmax(logits[0, :t].astype(jnp.float32), axis=-1))


def _apply(model, params, toks, pos, cache, meta):
    fn = _APPLY.setdefault(id(model), jax.jit(lambda p, t, q, c, m: model.apply({"params": p}, t, q, c, m)))
    return fn(params, toks, pos, cache, meta)


_APPLY: dict[int, object] = {}


def _engine_logprobs(handle, prompts, n, later=(), **cfg):
    """Greedy outputs and each output token's logprob, all `prompts` at once in one engine (chunked
    prefill, small pool: preemption), prefix caching on; then the `later` prompts (prefix hits)."""
    eng = Engine(handle, EngineConfig(num_pages=24, page_size=4, max_batch=4, max_batched_tokens=24,
                                      chunk_size=8, **cfg))
    rids, lps = [], {}
    for group in (prompts, later):
        rids += [eng.add_request(p, max_new_tokens=n, logprobs=1) for p in group]
        while eng.has_work():
            for ev in eng.step():
                lps.setdefault(ev.rid, []).extend(lp.logprob for lp in ev.logprobs or [])
    return [eng.finished[r].output for r in rids], [np.asarray(lps[r]) for r in rids], eng


def test_fp8_engine_equals_fp8_reference_forward(fp8_handle):
    """Continuous batching with chunked prefill, preemption and a prefix hit on the FP8 cache gives the
    FP8-cache reference forward's greedy tokens, and its logprobs up to fp32 reordering.

    Tolerance: engine and reference compute the same fp32 latents up to reordering (~1e-6 relative);
    a latent within that of an e4m3 rounding boundary may round the other way (one ulp, 2^-3 of its
    scaled value), which moves a logprob of this model (|logit| < ~10, damped layers) by far less than
    1e-3; without such a flip the difference is fp32 noise (~1e-5)."""
    prompts = _prompts(6, lo=13, hi=30, seed=3)
    later = [prompts[0][:12] + [7, 9, 11]]  # shares three full pages with prompt 0: a prefix hit
    outs, lps, eng = _engine_logprobs(fp8_handle, prompts, 6, later)
    prompts += later
    assert eng.engine_stats()["prefix_hit_rate"] > 0
    assert eng.engine_stats()["preemptions"] > 0
    for p, out, lp in zip(prompts, outs, lps, strict=True):
        ref = _reference_logprobs(fp8_handle, p + out, "fp8")
        steps = ref[len(p) - 1:len(p) - 1 + len(out)]
        assert [int(s.argmax()) for s in steps] == out
        np.testing.assert_allclose(lp, steps[np.arange(len(out)), out], atol=1e-3)


def test_fp8_cache_close_to_full_precision_cache(params, fp8_handle):
    """FP8 vs the compute-dtype (fp32) cache on the same tokens: logits differ by at most what the cache's
    rounding allows. Each cached latent errs by <= 2^-4 of itself (+ the subnormal floor), each rope value
    by 2^-8; attention is a convex mix of values, so each layer's attention output errs by <= ~2^-4 of
    the value scale plus the score change's effect, and the damped layers and the residual stream do not
    amplify it: we hold the logits' relative error (max |diff| / max |logit|) to 2^-4."""
    full = ModelHandle(CFG, params)
    rng = np.random.default_rng(5)
    for _ in range(3):
        toks = rng.integers(2, 256, 40).tolist()
        a = _reference_logprobs(fp8_handle, toks, "fp8")
        b = _reference_logprobs(full, toks, None)
        rel = np.max(np.abs(a - b)) / np.max(np.abs(b))
        # measured 2026-12-05 (CPU): 4e-4 .. 9e-4, argmax agreeing everywhere
        assert 0 < rel <= 2.0**-4, rel
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_fp8_engine_continuous_batching_equals_alone_and_mtp(fp8_handle):
    """Continuous batching (preemption, chunking) == each prompt alone on the FP8 cache, and MTP greedy
    speculation (the MTP layer's own FP8 pool) == plain greedy."""
    prompts = _prompts(3, lo=3, hi=30, seed=9)
    outs, _, _ = _engine_logprobs(fp8_handle, prompts, 6)
    assert outs == [_alone(fp8_handle, p, 6) for p in prompts]
    eng = Engine(fp8_handle, EngineConfig(num_pages=64, page_size=4, spec_k=1, chunk_size=16))
    cache = eng.executor.cache
    assert set(cache[layout.MTP]) == set(layout.FP8_LEAVES)
    assert cache[layout.MTP][layout.FP8_LATENT].dtype == jnp.float8_e4m3fn
    rids = [eng.add_request(p, max_new_tokens=6) for p in prompts]
    while eng.has_work():
        eng.step()
    assert [eng.finished[r].output for r in rids] == outs
    assert eng.engine_stats()["mtp_acceptance"] > 0


def test_fp8_dp_attention_engine_matches_one_device(tmp_path_factory):
    """DP attention on 8 virtual devices (data=2, tensor=2, expert=2: 4 batch shards, each its own FP8 page
    slice) gives one device's FP8-cache tokens with prefix caching and preemption (test_dp_engine's
    workload), each device holds 1/4 of each FP8 leaf (latent, scales, rope), and no compiled step moves
    FP8 pages."""
    import dsv3_jax
    from dsv3_jax.engine.executor import compiled_programs
    from tests.hf_reference import make_hf_model, save_hf
    from tests.test_dp_engine import PS, _run

    ckpt = save_hf(make_hf_model("h8e16"), tmp_path_factory.mktemp("h8e16_fp8"))
    want, _ = _run(dsv3_jax.load(ckpt, kv_cache_dtype="fp8"))
    handle = dsv3_jax.load(ckpt, mesh="data=2,tensor=2,expert=2", kv_cache_dtype="fp8")
    got, eng = _run(handle)
    assert got == want
    hlo = {jnp.dtype(jnp.float8_e4m3fn): "f8e4m3fn", jnp.dtype(jnp.float32): "f32",
           jnp.dtype(jnp.bfloat16): "bf16"}
    local = set()  # each FP8 leaf's per-device shape as HLO spells it
    for pool in eng.executor.cache.values():
        assert set(pool) == set(layout.FP8_LEAVES)
        for leaf in pool.values():
            assert PS in leaf.shape[-2:]
            assert all(s.data.nbytes * 4 == leaf.nbytes for s in leaf.addressable_shards)
            shape = leaf.addressable_shards[0].data.shape
            local.add(f"{hlo[leaf.dtype]}[{','.join(map(str, shape))}]")
    for compiled in compiled_programs(handle).values():
        ops = ("all-gather(", "all-reduce(", "all-to-all(", "collective-permute(")
        moving = [ln for ln in compiled.as_text().splitlines()
                  if any(t in ln.split("(")[0] for t in local) and any(c in ln for c in ops)]
        assert not moving, moving[:2]


def test_pallas_backend_reads_fp8_pages_with_the_fp8_kernel(caplog):
    """The dispatch routes FP8 pages to the FP8-page Mosaic kernel (`pallas_kernels.mla_decode_fp8`; here in
    the GPU interpreter), without a fallback warning, never to the bf16 kernel with misread bytes; it matches
    the reference on the same pages within the bf16 bound of tests/test_mla_fp8_kernel.py."""
    from dsv3_jax.model import kernel_dispatch
    from pallas_kernels import mla_decode_fp8

    vals = jax.random.normal(jax.random.key(3), (4, 64, 576))
    fp8 = quantize_kv(vals[..., :512], vals[..., 512:])
    table = jnp.asarray([[1, 2], [3, 0]], jnp.int32)
    ql = jax.random.normal(jax.random.key(4), (2, 1, 16, 512))
    qr = jax.random.normal(jax.random.key(5), (2, 1, 16, 64))
    start, n = jnp.asarray([90, 10], jnp.int32), jnp.ones((2,), jnp.int32)
    from pallas_kernels.mla_prefill import mla_prefill

    kernel_dispatch._log_mla_shape_fallback.cache_clear()
    mla_prefill.clear_cache()  # so that the kernel function is traced (and the spy sees it) here
    calls = []
    real = mla_decode_fp8.run_fp8_items

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    with caplog.at_level("WARNING"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_decode_fp8, "run_fp8_items", spy)
        o, lse = kernel_dispatch.mla_attention(ql, qr, fp8, table, start, n, softmax_scale=0.1,
                                               backend="pallas")
    assert calls and "MLA kernel needs" not in caplog.text
    ref, ref_lse = pallas_kernels.mla_prefill_reference(ql, qr, fp8, table, start, n, softmax_scale=0.1)
    o, ref = np.asarray(o, np.float32), np.asarray(ref, np.float32)
    assert np.max(np.abs(o - ref)) <= 2.0**-6 * np.max(np.abs(ref))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=3e-2, rtol=5e-3)


def test_gpu_benchmark_runs_tiny_on_cpu(tmp_path):
    """benchmarks/kv_fp8_gpu.py --tiny: the FP8 path the model runs (the FP8-page kernel) vs the fp32
    reference on the same FP8 pages within the script's bf16 bound, the bf16 kernel timed beside it, JSON
    written (the GPU run of the same code is the lead's)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kv_fp8_gpu

    out = tmp_path / "kv_fp8_gpu.json"
    res = kv_fp8_gpu.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text())["checks"] == res["checks"]
    assert all(0 < c["max_rel_err"] <= kv_fp8_gpu.ERR_BOUND for c in res["checks"])
    assert res["fp8_path"] == "kernel"  # the FP8-page kernel (pallas_kernels.mla_decode_fp8), no fallback
    assert res["timings"] and all(r["fp8"]["median_ms"] > 0 for r in res["timings"])


def _probe_page_kernel(pages: Fp8Pages, page: int, interpret: bool) -> jax.Array:
    """A Mosaic GPU probe: TMA-load page `page` of each FP8 leaf into shared memory (latent e4m3 [64, 512] in
    (8, 128) tiles with the 128-B swizzle, scales [4, 64] f32 untiled, rope bf16 [64, 64] in (8, 64) tiles
    with the swizzle), dequantize in registers (a WGMMA-layout load of each 128-column latent block times
    its scale row as a per-row vector) into a bf16 [64, 576] tile in wgmma operand layout, store it out."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    row = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA tile: a per-token vector
    swz = plgpu.SwizzleTransform(128)
    t8, t16 = plgpu.TilingTransform((8, 128)), plgpu.TilingTransform((8, 64))

    def kernel(lat_ref, sc_ref, rope_ref, out_ref, lat, sc, rope, tile, bar):
        plgpu.copy_gmem_to_smem(lat_ref.at[page], lat, bar)
        plgpu.copy_gmem_to_smem(sc_ref.at[page], sc, bar)
        plgpu.copy_gmem_to_smem(rope_ref.at[page], rope, bar)
        plgpu.barrier_wait(bar)
        for j in range(LATENT_DIM // 128):
            x = plgpu.load(lat.at[:, pl.ds(128 * j, 128)], layout=plgpu.Layout.WGMMA, optimized=False)
            s = plgpu.load(sc.at[j], layout=row)
            x = x.astype(jnp.float32) * jax.lax.broadcast_in_dim(s, (PAGE_SIZE, 128), [0])
            tile.at[:, pl.ds(128 * j, 128)][...] = x.astype(jnp.bfloat16)
        tile.at[:, pl.ds(LATENT_DIM, ROPE_DIM)][...] = plgpu.load(rope, layout=plgpu.Layout.WGMMA,
                                                                  optimized=False)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tile, out_ref)
        plgpu.wait_smem_to_gmem(0)

    def entry(*refs):
        pl.run_scoped(lambda *scratch: kernel(*refs, *scratch),
                      plgpu.SMEM((PAGE_SIZE, LATENT_DIM), jnp.float8_e4m3fn, transforms=(t8, swz)),
                      plgpu.SMEM((LATENT_DIM // 128, PAGE_SIZE), jnp.float32),
                      plgpu.SMEM((PAGE_SIZE, ROPE_DIM), jnp.bfloat16, transforms=(t16, swz)),
                      plgpu.SMEM((PAGE_SIZE, LATENT_DIM + ROPE_DIM), jnp.bfloat16, transforms=(t16, swz)),
                      plgpu.Barrier(num_arrivals=3))

    params = plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None
    out = jax.ShapeDtypeStruct((PAGE_SIZE, LATENT_DIM + ROPE_DIM), jnp.bfloat16)
    return plgpu.kernel(entry, out_type=out, interpret=params)(*pages)


def test_fp8_pages_are_kernel_ready_tma_load_and_dequantize():
    """The cache's FP8 leaves, at the shapes the engine allocates (64-token pages, 512 + 64), feed a Pallas
    Mosaic GPU kernel: a probe that TMA-loads one page of each leaf into swizzled shared memory and
    dequantizes it lowers for Hopper on the CPU (Mosaic GPU's TMA / tiling / swizzle / layout checks run at
    lowering), and in Pallas' GPU interpreter reproduces `dequantize_kv` of that page exactly (the same
    fp32 product, one bf16 rounding)."""
    leaves = layout.cache_layout(V3, 3, kv_cache.PAGE_SIZE, "absorbed", "fp8")[layout.MOE_LAYERS]
    shapes = [jax.ShapeDtypeStruct(leaves[n].shape[1:], leaves[n].dtype) for n in layout.FP8_LEAVES]
    assert [s.shape for s in shapes] == [(3, PAGE_SIZE, LATENT_DIM), (3, LATENT_DIM // 128, PAGE_SIZE),
                                         (3, PAGE_SIZE, ROPE_DIM)]
    text = jax.jit(lambda p: _probe_page_kernel(p, 2, False)).trace(Fp8Pages(*shapes)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    x = _latents(jax.random.key(7), (3, PAGE_SIZE, LATENT_DIM))
    pages = quantize_kv(x, jax.random.normal(jax.random.key(8), (3, PAGE_SIZE, ROPE_DIM)))
    got = _probe_page_kernel(pages, 2, True)
    want = dequantize_kv(pages, ROPE_DIM, jnp.float32)[2].astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    if jax.default_backend() == "gpu":  # the GPU run: the compiled kernel, real TMA and swizzle
        got = _probe_page_kernel(pages, 2, False)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_fp8_cache_write_lands_each_token_and_clears_to_zeros():
    """The step's cache write on an FP8 pool (a scanned stack, layer 1 of 2): each real token's latent,
    scales (block-major, token by token) and rope land at its page and slot and read back as that token
    quantized alone; padding goes to scratch page 0; other layers and pages stay zero; cleared pages read
    as zeros."""
    cfg, ps = CFG, 4
    pool = kv_cache.allocate(cfg, 6, ps, dtype="fp8")[layout.MOE_LAYERS]
    assert pool[layout.FP8_LATENT].shape[0] >= 2
    lat, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    x = _latents(jax.random.key(11), (2, 3, lat))
    r = jax.random.normal(jax.random.key(12), (2, 3, rope))
    meta = kv_cache.PageMeta(jnp.asarray([[1, 2], [3, 4]], jnp.int32), jnp.asarray([3, 1], jnp.int32))
    start = jnp.asarray([2, 0], jnp.int32)  # row 0: a chunk at positions 2..4 (crosses a page); row 1: decode
    new = kv_cache.latent_rows(x, r, pool)
    assert {k: v.shape for k, v in new.items()} == {layout.FP8_LATENT: (2, 3, lat),
                                                    layout.FP8_SCALE: (2, 3, -(-lat // 128)),
                                                    layout.FP8_ROPE: (2, 3, rope)}
    out = kv_cache.write_leaves(pool, new, meta, start, jnp.int32(1))
    vals = np.asarray(dequantize_kv(Fp8Pages(*(out[n] for n in layout.FP8_LEAVES)), rope))  # [L, P, ps, D]
    alone = np.asarray(dequantize_kv(quantize_kv(x, r), rope))  # [2, 3, D]: each token quantized alone
    want = np.zeros_like(vals)
    for (b, t), (page, slot) in {(0, 0): (1, 2), (0, 1): (1, 3), (0, 2): (2, 0), (1, 0): (3, 0)}.items():
        want[1, page, slot] = alone[b, t]
    np.testing.assert_array_equal(vals[:, 1:], want[:, 1:])
    assert np.asarray(out[layout.FP8_ROPE][1, 0]).any()  # the two padding tokens went to scratch page 0
    assert not vals[0].any()
    cleared = kv_cache.clear_pages({layout.MOE_LAYERS: out}, jnp.asarray([1, 3], jnp.int32))
    cleared = cleared[layout.MOE_LAYERS]
    back = np.asarray(dequantize_kv(Fp8Pages(*(cleared[n] for n in layout.FP8_LEAVES)), rope))
    assert not back[:, [1, 3]].any() and np.array_equal(back[1, 2], want[1, 2])


def test_quality_benchmark_ue8m0_patch_reaches_the_cache_write():
    """benchmarks/kv_fp8_quality.py's UE8M0 row measures what it names: inside `pow2_kv_scales` the cache
    write (`kv_cache.latent_rows`, traced afresh) stores power-of-two scales, outside it the product's fp32
    amax / 448 scales, and the patch is undone afterwards."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kv_fp8_quality

    from pallas_kernels import mla_common

    pool = {name: None for name in layout.FP8_LEAVES}
    latent = _latents(jax.random.key(5), (2, 3, LATENT_DIM))
    rope = jax.random.normal(jax.random.key(6), (2, 3, ROPE_DIM))

    def scales():
        rows = jax.jit(lambda x, r: kv_cache.latent_rows(x, r, pool))(latent, rope)
        return np.asarray(rows[layout.FP8_SCALE])

    real = mla_common.quantize_kv
    plain = scales()
    with kv_fp8_quality.pow2_kv_scales():
        pow2 = scales()
    assert mla_common.quantize_kv is real
    assert np.all(np.exp2(np.round(np.log2(pow2))) == pow2)  # every scale a power of two
    assert not np.all(np.exp2(np.round(np.log2(plain))) == plain)
    assert np.all(pow2 >= plain) and np.all(pow2 < 2 * plain)  # rounded up, less than a binade
