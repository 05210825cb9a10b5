"""The naive-form long-prefill path (model/long_prefill.py, issue 29 item 1): one sequence's chunk laid
out one token per row with `PageMeta.long_prefill` attends over the absorbed pool in naive form, block by
block, and must give what the absorbed path gives on the same pool (bf16 and FP8 pools, a prefix over
several blocks with a partial last one, a chunk starting mid-page, padding rows), and what a full causal
forward gives; the flash attention's reference and the block merge on their own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.api import ModelHandle
from dsv3_jax.config import ModelConfig
from dsv3_jax.engine.core import Engine, EngineConfig
from dsv3_jax.engine.executor import DeviceExecutor
from dsv3_jax.model import kernel_dispatch, kv_cache, long_prefill
from dsv3_jax.model.kv_cache import PageMeta
from dsv3_jax.model.transformer import Transformer
from tests.greedy_compare import bf16_logit_bound, compare_until_near_tie

CFG = ModelConfig.preset("tiny").replace(vocab_size=256, max_position_embeddings=512,
                                         num_nextn_predict_layers=0)
PS = 4  # page size: a chunk at position 22 starts mid-page


@pytest.fixture(scope="module")
def params():
    model = Transformer(CFG)
    return jax.jit(lambda k: model.init(k, jnp.zeros((1, 4), jnp.int32))["params"])(jax.random.key(5))


def _rows(model, params, cache, toks, start, total, long, table):
    """Tokens `toks` at positions start.. as one token per row, padded to `total` rows."""
    n = len(toks)
    t = np.full(total, 7, np.int32)
    t[:n] = toks
    pos = np.concatenate([np.arange(start, start + n), np.full(total - n, start)]).astype(np.int32)
    valid = (np.arange(total) < n).astype(np.int32)
    meta = PageMeta(jnp.asarray(np.repeat(table[None], total, 0)), jnp.asarray(valid), long_prefill=long)
    logits, _, cache = model.apply({"params": params}, jnp.asarray(t)[:, None], jnp.asarray(pos)[:, None],
                                   cache, meta)
    return np.asarray(logits)[:n, 0], cache


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])
def test_long_prefill_matches_the_absorbed_path_and_the_full_forward(params, monkeypatch, kv_dtype):
    monkeypatch.setattr(long_prefill, "BLOCK_TOKENS", 2 * PS)  # a 22-token prefix: 3 blocks, the last partial
    model = Transformer(CFG)
    rng = np.random.default_rng(0)
    seq = rng.integers(2, 256, 31)
    prefix = 22  # then a 9-token chunk
    table = np.arange(1, 11, dtype=np.int32)[::-1].copy()  # non-contiguous physical pages
    dtype = jnp.float8_e4m3fn if kv_dtype == "fp8" else None
    cache0 = kv_cache.allocate(CFG, 12, PS, dtype=dtype)
    traced = []
    flash = kernel_dispatch.flash_attention
    monkeypatch.setattr(kernel_dispatch, "flash_attention",
                        lambda *a, **k: traced.append(k) or flash(*a, **k))
    _, cache = _rows(model, params, cache0, seq[:prefix], 0, 24, False, table)  # the prefix, absorbed
    want, cache_abs = _rows(model, params, cache, seq[prefix:], prefix, 16, False, table)
    assert not traced
    got, cache_long = _rows(model, params, cache, seq[prefix:], prefix, 16, True, table)
    assert {k["causal"] for k in traced} == {False, True}  # the prefix blocks and the chunk's own keys
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # The same pages written (layers past the first hold values computed from the layer below: fp32 rounding)
    for a, b in zip(jax.tree.leaves(cache_long), jax.tree.leaves(cache_abs), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)
    if kv_dtype == "float32":  # an fp32 pool holds exact values: the full causal forward is the truth
        full = np.asarray(model.apply({"params": params}, jnp.asarray(seq)[None],
                                      jnp.arange(len(seq))[None])[0])[0, prefix:]
        np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)


def test_a_chunk_that_ends_late_in_its_last_page_reads_its_own_keys(params):
    """15 rows (not a multiple of the page) starting 3 tokens into a page span 5 pages: the chunk's own
    window must hold them all (a window one page short would be clamped onto the wrong keys)."""
    model = Transformer(CFG)
    seq = np.random.default_rng(6).integers(2, 256, 7 + 15)
    table = np.arange(1, 9, dtype=np.int32)
    _, cache = _rows(model, params, kv_cache.allocate(CFG, 10, PS), seq[:7], 0, 8, False, table)
    got, _ = _rows(model, params, cache, seq[7:], 7, 15, True, table)
    full = model.apply({"params": params}, jnp.asarray(seq)[None], jnp.arange(len(seq))[None])[0]
    np.testing.assert_allclose(got, np.asarray(full)[0, 7:], rtol=1e-4, atol=1e-4)


def test_a_chunk_at_prefix_zero_attends_only_to_itself(params):
    model = Transformer(CFG)
    seq = np.arange(3, 15)
    table = np.arange(1, 5, dtype=np.int32)
    got, _ = _rows(model, params, kv_cache.allocate(CFG, 6, PS), seq, 0, 16, True, table)
    full = model.apply({"params": params}, jnp.asarray(seq)[None], jnp.arange(len(seq))[None])[0]
    full = np.asarray(full)[0]
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)


def test_flash_reference_and_the_merge_split_keys_exactly():
    rng = np.random.default_rng(1)
    n, s, h, d, dv = 6, 10, 3, 8, 5
    q, k = (jnp.asarray(rng.normal(size=(m, h, d)), jnp.float32) for m in (n, s))
    v = jnp.asarray(rng.normal(size=(s, h, dv)), jnp.float32)
    scale = 0.3
    full, lse_full = kernel_dispatch.flash_attention(q, k, v, jnp.int32(n), jnp.int32(s), causal=False,
                                                     softmax_scale=scale, backend="reference")
    sc = np.einsum("nhd,shd->nhs", np.asarray(q, np.float64), np.asarray(k, np.float64)) * scale
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("nhs,shv->nhv", p, np.asarray(v, np.float64))
    np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-6)
    a = kernel_dispatch.flash_attention(q, k[:4], v[:4], jnp.int32(n), jnp.int32(4), causal=False,
                                        softmax_scale=scale, backend="reference")
    b = kernel_dispatch.flash_attention(q, k[4:], v[4:], jnp.int32(n), jnp.int32(6), causal=False,
                                        softmax_scale=scale, backend="reference")
    o, lse = long_prefill._merge(*a, *b)
    np.testing.assert_allclose(o, full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, lse_full, rtol=1e-6, atol=1e-6)
    # padding queries (t >= q_len) come back zero with lse -inf, and merge as nothing
    o_pad, lse_pad = kernel_dispatch.flash_attention(q, k, v, jnp.int32(4), jnp.int32(s), causal=True,
                                                     softmax_scale=scale, backend="reference")
    assert np.all(np.asarray(o_pad)[4:] == 0) and np.all(np.isneginf(np.asarray(lse_pad)[4:]))
    o2, lse2 = long_prefill._merge(o_pad, lse_pad, o_pad, lse_pad)
    np.testing.assert_allclose(o2, o_pad, rtol=1e-6, atol=1e-7)
    assert np.all(np.isfinite(np.asarray(o2)))


class _Recording(DeviceExecutor):
    def execute(self, key, ints, floats):
        self.keys.append(key)
        return super().execute(key, ints, floats)


def test_engine_routes_a_lone_long_chunk_to_the_naive_path_with_the_same_tokens(params):
    """A 90-token prompt in 16-token chunks with long_prefill_from=32: the chunks at 32, 48, 64 and 80 (the
    request alone; the last one's 10 tokens pick the same 32-token shape) run the long-prefill program,
    the rest the usual ones; tokens and logprobs equal the engine without it. Beside a decoding neighbour
    no step is long."""
    handle = ModelHandle(CFG, params)
    base = dict(num_pages=40, page_size=8, max_batch=4, max_batched_tokens=32, chunk_size=16,
                row_buckets=(4,))
    rng = np.random.default_rng(2)
    prompt = rng.integers(2, 256, 90).tolist()

    def run(cfg, prompts):
        ex = _Recording(handle, cfg)
        ex.keys = []
        eng = Engine(handle, cfg, executor=ex)
        rids = [eng.add_request(p, max_new_tokens=6, logprobs=1) for p in prompts]
        for _ in eng.run():
            pass
        return [eng.finished[r] for r in rids], ex.keys, eng

    plain, keys0, _ = run(EngineConfig(**base), [prompt])
    long, keys1, eng = run(EngineConfig(**base, long_prefill_from=32), [prompt])
    assert not any(k.long_prefill for k in keys0)
    assert sum(k.long_prefill for k in keys1) == 4  # the chunks at 32, 48, 64 and 80
    assert {k for k in keys1 if k.long_prefill} <= set(eng.step_keys())  # warmup compiles what runs
    # One program for the path, the full mode, though this request is greedy.
    assert [k.full for k in eng.step_keys() if k.long_prefill] == [True]
    assert long[0].output == plain[0].output
    for a, b in zip(long[0].output_logprobs, plain[0].output_logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    # a decoding neighbour: every step holds two rows, none is long
    both, keys2, _ = run(EngineConfig(**base, long_prefill_from=32), [prompt[:20], prompt])
    assert not any(k.long_prefill for k in keys2)
    assert both[1].output == plain[0].output


@pytest.mark.gpu
def test_cudnn_chunk_attention_matches_the_reference_gpu():
    """The long-prefill path on the GPU (cuDNN flash attention per block) against the same path on the jnp
    reference, DeepSeek's widths, bf16, 16 heads: a 20,000-token prefix (two blocks, the second partial), a
    1,000-token chunk starting mid-page, 24 padding rows. Bound: both round P to bf16 before P V (one
    normalized, one not: <= 1 bf16 step of 2^-8 relative between them) and the output to bf16 (1 step),
    so 2 steps of the largest output value, doubled for accumulation order: 2^-6 x max |reference|."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    h, ps, prefix, n, rows = 16, kv_cache.PAGE_SIZE, 20_000, 1_000, 1_024
    pages = -(-(prefix + rows) // ps) + 1
    rng = np.random.default_rng(4)
    table = jnp.asarray(rng.permutation(np.arange(1, pages + 1)).astype(np.int32))
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    kv = jax.random.normal(k1, (pages + 1, ps, 576), jnp.bfloat16)
    qn = jax.random.normal(k2, (rows, h, 128), jnp.bfloat16)
    qr = jax.random.normal(k3, (rows, h, 64), jnp.bfloat16)
    w = jax.random.normal(k4, (2, h, 128, 512), jnp.bfloat16) * 0.05

    def run(backend):
        return jax.jit(lambda: long_prefill.chunk_attention(
            qn, qr, lambda ids: kv_cache.read_values(kv, ids, jnp.bfloat16), table, jnp.int32(prefix),
            jnp.int32(n), w[0].swapaxes(1, 2), w[1], page_size=ps,  # W_uk [h, R, dn], W_uv [h, dv, R]
            softmax_scale=192**-0.5, backend=backend))()

    got, want = (np.asarray(run(b), np.float32) for b in ("pallas", "reference"))
    assert np.all(np.isfinite(got))
    bound = 2.0**-6 * np.abs(want[:n]).max()
    assert np.abs(got[:n] - want[:n]).max() <= bound, (np.abs(got[:n] - want[:n]).max(), bound)
    assert np.all(got[n:] == 0)  # padding rows


def test_long_prefill_on_a_tensor_mesh_gives_one_devices_tokens(tmp_path):
    """Heads split over tensor=8 (one batch shard): the long-prefill steps run under the partitioner and
    the tokens equal one device's without the path."""
    import dsv3_jax
    from tests.hf_reference import make_hf_model, save_hf
    from tests.mesh_models import MESH_CONFIGS  # noqa: F401  (registers h8e16)

    ckpt = save_hf(make_hf_model("h8e16"), tmp_path)
    prompt = np.random.default_rng(3).integers(2, 500, 45).tolist()
    cfg = dict(num_pages=24, page_size=4, max_batch=2, max_batched_tokens=8, chunk_size=8, row_buckets=(2,))

    def run(handle, **kw):
        eng = Engine(handle, EngineConfig(**cfg, **kw))
        rid = eng.add_request(prompt, max_new_tokens=4)
        for _ in eng.run():
            pass
        return eng.finished[rid].output, eng.stats["long_prefill_steps"]

    want, none = run(dsv3_jax.load(ckpt))
    got, steps = run(dsv3_jax.load(ckpt, mesh="tensor=8"), long_prefill_from=16)
    assert none == 0 and steps == 4  # chunks at 16, 24, 32, 40
    assert got == want


@pytest.mark.gpu
def test_long_prefill_engine_gives_the_absorbed_engines_tokens_on_the_gpu():
    """The embedded default model (BF16, DeepSeek's MLA widths, 16 heads) through the engine, one 1,024-token
    prompt at a time in 128-token chunks: with the long-prefill path from 256 (cuDNN) and without it (the
    Pallas MLA kernel), the same greedy tokens while no near tie decides them, the logprobs within bf16
    rounding: 2 bf16 steps of the largest logit, the bound test_trace_options derives for another GEMM
    order (a different attention algorithm moves the hidden state by roundings the same way)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    import json
    from pathlib import Path

    from dsv3_jax import api

    d = api.DEFAULT_MODEL_DIR
    mcfg = ModelConfig.from_json(d / "config.json")
    h = ModelHandle(mcfg, jax.tree_util.tree_map(jnp.asarray, api._host_params(d, mcfg)))
    data = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "mtp_depth_prompts.json"
    ids = json.loads(data.read_text())["ids"]
    prompts = [sum(ids[16 * i:16 * i + 16], [])[:1024] for i in range(2)]
    base = dict(num_pages=64, max_batch=4, max_batched_tokens=128, chunk_size=128)
    runs, long_steps = [], []
    for start in (0, 256):
        eng = Engine(h, EngineConfig(**base, long_prefill_from=start))
        out = []
        for p in prompts:  # alone, so every chunk past 256 is a lone chunk
            rid = eng.add_request(p, max_new_tokens=16, logprobs=2)
            for _ in eng.run():
                pass
            out.append(eng.finished[rid].output_logprobs)
        runs.append(out)
        long_steps.append(eng.stats["long_prefill_steps"])
    assert long_steps == [0, 2 * 6]  # chunks at 256, 384, ..., 896
    compared = compare_until_near_tie(*runs, bf16_logit_bound(h, prompts, runs[0]))
    assert compared >= 4
