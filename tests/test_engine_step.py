"""The ragged engine step: each step computes its scheduled tokens in the smallest of the engine's fixed
step shapes that holds them (never batch x chunk), warmup compiles every shape a load can use, padding
reaches no expert and writes no real page, the batch layout groups tokens by shard, pipelined dispatch
equals one-step-at-a-time, logprobs equal the forward's log_softmax, a request whose logits go
non-finite stops with an error without harming its neighbours, metrics are JSON."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.api import ModelHandle
from dsv3_jax.config import ModelConfig
from dsv3_jax.engine import step
from dsv3_jax.engine.core import Engine, EngineConfig
from dsv3_jax.model import kv_cache, layout
from dsv3_jax.model.attention import MLA
from dsv3_jax.model.kv_cache import PageMeta
from dsv3_jax.model.transformer import Transformer
from dsv3_jax.request_stream import GenerationError

CFG = ModelConfig.preset("tiny").replace(vocab_size=256, max_position_embeddings=512,
                                         num_nextn_predict_layers=0)
FAST = dict(token_buckets=(32, 128), row_buckets=(4,))  # decode (4, 4), (16, 16); mixed (32, 16), (128, 16)


def _params(cfg: ModelConfig, seed: int = 0) -> dict:
    model = Transformer(cfg)
    return jax.jit(lambda k: model.init(k, jnp.zeros((1, 4), jnp.int32))["params"])(jax.random.key(seed))


@pytest.fixture(scope="module")
def params():
    return _params(CFG)


def _prompts(n, lo=3, hi=40, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


def test_each_step_computes_its_tokens_in_the_smallest_shape(params, monkeypatch):
    """Instrument the batch builder and the traced attention: a step runs in the smallest of the
    engine's shapes holding its tokens and rows, and a prefill chunk never pads the decode rows beside it."""
    handle = ModelHandle(CFG, params)  # a fresh handle: nothing compiled yet, so every program traces
    built, traced = [], []
    real_build = step.build

    def build(rows, **kw):
        b = real_build(rows, **kw)
        built.append(([r.n for r in rows], b.key))
        return b

    real_mla = MLA.__call__

    def mla(self, x, *a, **kw):
        traced.append(x.shape)
        return real_mla(self, x, *a, **kw)

    monkeypatch.setattr(step, "build", build)
    monkeypatch.setattr(MLA, "__call__", mla)
    chunk, max_batch = 32, 16
    eng = Engine(handle, EngineConfig(num_pages=64, page_size=4, max_batch=max_batch, max_batched_tokens=128,
                                      chunk_size=chunk, **FAST))
    for p in _prompts(6, 3, 8, seed=1):  # short prompts: decode rows soon
        eng.add_request(p, max_new_tokens=10)
    for _ in range(3):
        eng.step()
    eng.add_request(_prompts(1, 90, 91, seed=2)[0], max_new_tokens=3)  # a long prompt joins: chunks
    for _ in eng.run():
        pass
    mixed = 0
    assert eng.shapes.pairs == ((4, 4), (16, 16), (32, 16), (128, 16))
    for ns, key in built:
        fits = [(n, s) for n, s in eng.shapes.pairs if n >= sum(ns) and s >= len(ns)]
        assert (key.tokens, key.rows) == min(fits), (ns, key)
        assert key.width == eng.width == 64  # the pool's 63 usable pages (< 128 for the context), 8-rounded
        if max(ns) > 1 and ns.count(1) >= 2:
            mixed += 1
            assert key.tokens < len(ns) * chunk  # the old engine computed rows x chunk here
    assert mixed >= 1, "the load was meant to mix a prefill chunk with decode rows"
    # The model itself saw [N, 1] token batches (one token per attention row), N a shape's capacity.
    assert traced and all(t == 1 and b in {n for n, _ in eng.shapes.pairs} for b, t, _ in traced)
    assert {k.tokens for _, k in built} == {b for b, _, _ in traced}


def test_padding_changes_no_expert_load_and_writes_no_real_page(params):
    model = Transformer(CFG)
    rng = np.random.default_rng(3)
    n = 5
    toks = rng.integers(2, 256, n)
    cache0 = kv_cache.allocate(CFG, 8, 4)
    table = np.tile(np.arange(1, 5, dtype=np.int32), (1, 1))

    def run(total):
        t = np.zeros(total, np.int32)
        t[:n] = toks
        t[n:] = rng.integers(2, 256, total - n)  # padding with real-looking ids
        pos = np.concatenate([np.arange(n), np.full(total - n, 3)]).astype(np.int32)
        valid = (np.arange(total) < n).astype(np.int32)
        meta = PageMeta(jnp.asarray(np.repeat(table, total, 0)), jnp.asarray(valid))
        (logits, _, cache), state = model.apply({"params": params}, jnp.asarray(t)[:, None],
                                                jnp.asarray(pos)[:, None], cache0, meta,
                                                mutable=["intermediates"])
        load = state["intermediates"]["moe_layers"]["mlp"]["expert_load"][0]
        return np.asarray(logits)[:n], np.asarray(load), cache

    lg_a, load_a, cache_a = run(n)
    lg_b, load_b, cache_b = run(16)
    np.testing.assert_array_equal(load_a, load_b)  # [layers, experts]: padding routed nowhere
    assert load_a.sum() == CFG.n_moe_layers * n * CFG.num_experts_per_tok
    np.testing.assert_allclose(lg_a, lg_b, rtol=1e-5, atol=1e-5)
    # Page 0 is scratch. The real tokens own slots 0..n-1 of the table's pages (1, 2, ...): every other slot
    # of every real page must be exactly as allocated in both runs (padding wrote nothing there). The real
    # slots hold layer l's latents, computed from the layers below through matmuls whose row count differs
    # between the runs (5 vs 16), so they agree to float32 rounding, the logits' bound, not bit for bit.
    leaves0 = jax.tree.leaves(cache0)
    _, pages, ps, _ = leaves0[0].shape  # [layers, pages, page size, width]
    page = np.arange(1, pages)[:, None]
    real = ((page - 1) * ps + np.arange(ps)[None, :] < n) & (page <= table.shape[1])  # [page 1.., slot]
    for a, b, z in zip(jax.tree.leaves(cache_a), jax.tree.leaves(cache_b), leaves0, strict=True):
        a, b, z = (np.asarray(x)[:, 1:] for x in (a, b, z))
        np.testing.assert_array_equal(a[:, ~real], z[:, ~real])
        np.testing.assert_array_equal(b[:, ~real], z[:, ~real])
        assert np.abs(a[:, real]).max() > 0  # the real slots were written
        np.testing.assert_allclose(b[:, real], a[:, real], rtol=1e-5, atol=1e-5)


def test_batch_layout_groups_tokens_by_shard():
    def row(rid, n, shard):
        return step.RowPlan(rid, rid, 0, list(range(1, n + 1)), n, False, True, 0, 0, [rid + 1], 0.0, 1.0, 0,
                            0, 0, shard)

    shapes = step.StepShapes.make(max_rows=2, max_tokens=8, spec_k=0, decode_rows=(1,))
    assert shapes.pairs == ((1, 1), (2, 2), (8, 2))
    b = step.build([row(0, 5, 0), row(1, 1, 1), row(2, 2, 1), row(3, 1, 0)], spec_k=0, shapes=shapes,
                   width=2, logprobs=False, num_shards=2)
    assert b.key.tokens == 16 and b.key.rows == 4  # two shards x the (8, 2) shape holding 6 tokens, 2 rows
    row_of, valid = b.view("row_of"), b.view("valid")
    assert valid[:8].sum() == 6 and valid[8:].sum() == 3  # shard 0: rows 0, 3; shard 1: rows 1, 2
    assert b.row_index == [0, 2, 3, 1]
    assert set(row_of[:6]) == {0, 1} and set(row_of[8:11]) == {2, 3}
    np.testing.assert_array_equal(b.view("row_start")[b.row_index], [0, 8, 9, 5])


def test_pipelined_equals_one_step_at_a_time_and_metrics_are_json(params):
    handle = ModelHandle(CFG, params)
    prompts = _prompts(5, seed=4)
    outs, compile_s = [], []
    for pipeline in (True, False):
        eng = Engine(handle, EngineConfig(num_pages=40, page_size=4, max_batch=4, max_batched_tokens=32,
                                          chunk_size=16, pipeline=pipeline, **FAST))
        got = eng.generate(prompts, max_new_tokens=9, temperature=1.0, top_k=20, eos=(7, 9))
        outs.append([(r.output, r.finish_reason) for r in got])
        eng.pool.check()
        assert eng.pool.num_used == 0 and not eng.has_work()
        json.dumps(eng.engine_stats(), allow_nan=False)
        compile_s.append(eng.engine_stats()["compile_s"])
        for r in got:
            json.dumps(r.metrics(), allow_nan=False)
    assert outs[0] == outs[1]
    assert compile_s[0] > 0 and compile_s[1] == 0  # the second engine reuses the compiled steps


def test_logprobs_equal_log_softmax_of_the_forward(params):
    handle = ModelHandle(CFG, params)
    prompts = _prompts(2, seed=5)
    eng = Engine(handle, EngineConfig(num_pages=40, page_size=4, **FAST))
    r0 = eng.add_request(prompts[0], max_new_tokens=4, logprobs=3)
    r1 = eng.add_request(prompts[1], max_new_tokens=4)  # no logprobs for this one
    seen = {r0: [], r1: []}
    for ev in eng.run():
        seen[ev.rid].append(ev.logprobs)
    assert all(x is None for x in seen[r1])
    req = eng.finished[r0]
    assert len(req.output_logprobs) == 4
    full = prompts[0] + req.output
    lsm = np.asarray(jax.nn.log_softmax(handle.forward([full])[0], -1))
    for j, lp in enumerate(req.output_logprobs):
        pos = len(prompts[0]) - 1 + j
        assert lp.token == req.output[j]
        np.testing.assert_allclose(lp.logprob, lsm[pos, lp.token], atol=2e-4)
        assert [t for t, _ in lp.top] == np.argsort(-lsm[pos], kind="stable")[:3].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(lsm[pos])[::-1][:3], atol=2e-4)
    with pytest.raises(ValueError, match="logprobs"):
        eng.add_request([1, 2], logprobs=21)


def test_non_finite_logits_stop_only_that_request(params):
    poison = 11
    bad = jax.tree.map(lambda x: x, params)
    bad["embed_tokens"]["embedding"] = bad["embed_tokens"]["embedding"].at[poison].set(jnp.nan)
    clean, handle = ModelHandle(CFG, params), ModelHandle(CFG, bad)
    prompts = [p for p in _prompts(6, seed=6) if poison not in p][:3]
    poisoned = prompts[0][:2] + [poison] + prompts[0][2:]
    cfg = EngineConfig(num_pages=30, page_size=4, max_batch=4, max_batched_tokens=64, **FAST)
    want = [r.output for r in Engine(clean, cfg).generate(prompts, max_new_tokens=6)]
    eng = Engine(handle, cfg)
    rids = [eng.add_request(p, max_new_tokens=6) for p in [poisoned, *prompts]]
    events = [ev for ev in eng.run()]
    err = eng.finished[rids[0]]
    assert err.finish_reason == "error" and "non-finite" in err.error and "\n" not in err.error
    assert any(ev.rid == rids[0] and ev.finish_reason == "error" and ev.error for ev in events)
    assert [eng.finished[r].output for r in rids[1:]] == want
    # Its pages were zeroed: later requests that reuse them are unharmed.
    again = eng.generate(prompts, max_new_tokens=6)
    assert [r.output for r in again] == want
    with pytest.raises(GenerationError, match="non-finite"):
        handle.generate(poisoned, max_new_tokens=3, temperature=0)


def test_cache_layout_has_one_owner():
    from pallas_kernels.mla_common import PAGE_SIZE

    assert kv_cache.PAGE_SIZE == PAGE_SIZE  # the kernel keeps its own copy (no dsv3_jax import)
    v3 = ModelConfig.preset("deepseek-v3")
    assert layout.bytes_per_token(v3, "absorbed", jnp.bfloat16) == 70_272 == 576 * 2 * 61
    h = CFG.num_attention_heads
    assert layout.bytes_per_token(CFG, "naive", jnp.bfloat16) == \
        h * (CFG.qk_head_dim + CFG.v_head_dim) * 2 * CFG.num_hidden_layers
    shapes = jax.eval_shape(lambda: kv_cache.allocate(CFG, 4, form="naive"))
    assert set(shapes["moe_layers"]) == set(layout.CACHE_LEAVES["naive"])


def test_step_shapes_cover_every_load_and_warmup_compiles_them_all(params):
    shapes = step.StepShapes.make(max_rows=256, max_tokens=2048, spec_k=0)
    assert shapes.pairs == ((4, 4), (32, 32), (256, 256), (2048, 256))  # the default: 8 programs
    assert step.StepShapes.make(max_rows=64, max_tokens=256, spec_k=1).pairs == ((8, 4), (64, 32), (128, 64),
                                                                                   (256, 64))
    rng = np.random.default_rng(0)
    for _ in range(2000):  # any step the scheduler can build fits, in a shape reachable() lists
        t = int(rng.integers(1, 2049))
        r = int(rng.integers(1, min(t, 256) + 1))
        assert shapes.pick(t, r) in shapes.reachable(2048, 256)
        assert shapes.pick(t, r) in shapes.reachable(t, r)
    assert shapes.reachable(1, 1) == [(4, 4)]
    with pytest.raises(ValueError, match="no step shape holds 2049 tokens"):
        shapes.pick(2049, 1)

    handle = ModelHandle(CFG, params)
    eng = Engine(handle, EngineConfig(num_pages=40, page_size=4, max_batch=4, max_batched_tokens=16,
                                      chunk_size=8, row_buckets=(2,)))
    assert len(eng.step_keys()) == 6  # (2, 2), (4, 4), (16, 4) x greedy, full
    seen = []
    assert eng.warmup(progress=lambda done, total, key, s: seen.append((done, total, key))) > 0
    # Compiled here, or loaded from the program store when an earlier test compiled the same programs.
    assert eng.stats["compiles"] + eng.stats["programs_loaded"] == 6
    assert [d for d, _, _ in seen] == list(range(1, 7))
    assert {k for _, _, k in seen} == set(eng.step_keys())
    # A mixed load: greedy and sampled rows, logprobs, prompts of 1-30 tokens, arriving over time.
    prompts = _prompts(7, 1, 30, seed=7)
    for i, p in enumerate(prompts):
        eng.add_request(p, max_new_tokens=4, temperature=0.7 if i % 3 == 1 else 0.0,
                        logprobs=2 if i % 3 == 2 else None)
        eng.step()
    for _ in eng.run():
        pass
    assert eng.stats["compiles"] + eng.stats["programs_loaded"] == 6
    assert eng.stats["compiles_after_warmup"] == 0
    assert eng.stats["steps"] > 5 and len(eng.finished) == 7
    # A second engine of the same sizing on the same handle reuses every program.
    eng2 = Engine(handle, EngineConfig(num_pages=40, page_size=4, max_batch=4, max_batched_tokens=16,
                                       chunk_size=8, row_buckets=(2,)))
    eng2.warmup()
    assert eng2.stats["compiles"] == 0 and eng2.stats["programs_loaded"] == 0


@pytest.mark.parametrize("key", [step.StepKey(1, 1, 4, 0, False),
                                 step.StepKey(37, 5, 3, 2, True)])
def test_packed_input_fields_start_on_256_byte_boundaries(key):
    """Mosaic GPU kernels refuse operands that are not 256-byte aligned, and XLA may pass a field of the
    packed step input (e.g. the page table) to a kernel in place: every field must start aligned."""
    for fields in (step.int_fields(key), step.float_fields(key)):
        starts, total = step._offsets(fields, step.INPUT_ALIGN)
        assert all(off * 4 % 256 == 0 for off in starts)
        assert total == step.packed_size(fields) >= sum(int(np.prod(s)) for _, s in fields)
    rows = [step.RowPlan(rid=0, slot=1, start=0, tokens=[5, 6, 7], n=3, pending_last=False, final=True,
                         ndraft=0, hint=0, pages=[2], temperature=0.0, top_p=1.0, top_k=0, seed=0, counter=0)]
    shapes = step.StepShapes.make(max_rows=1, max_tokens=4, spec_k=0)
    batch = step.build(rows, spec_k=0, shapes=shapes, width=1, logprobs=False)
    assert batch.ints.size == step.packed_size(step.int_fields(batch.key))
    assert batch.view("tokens")[:3].tolist() == [5, 6, 7] and batch.view("table")[0, 0] == 2


def test_a_new_process_loads_warmed_programs_from_the_store(params, tmp_path, request, caplog):
    """What a second server start does: a fresh handle (no programs in memory) over a cache directory an
    earlier engine filled loads every program without tracing, and runs the same tokens; a damaged file
    is logged, removed and recompiled."""
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))  # the engine's store lives beside it
    request.addfinalizer(lambda: jax.config.update("jax_compilation_cache_dir", old))
    sizing = dict(num_pages=24, page_size=4, max_batch=2, max_batched_tokens=8, chunk_size=8,
                  row_buckets=(1,))
    prompts = _prompts(2, 3, 12, seed=11)

    def engine():
        eng = Engine(ModelHandle(CFG, params), EngineConfig(**sizing))  # a new handle: an empty memory cache
        eng.warmup(modes=("greedy",))
        return eng, [r.output for r in eng.generate(prompts, max_new_tokens=4)]

    first, out1 = engine()
    assert first.stats["compiles"] == 3 and first.stats["programs_loaded"] == 0
    assert len(list((tmp_path / "programs").glob("*.bin"))) == 3
    second, out2 = engine()
    assert second.stats["compiles"] == 0 and second.stats["programs_loaded"] == 3 and out2 == out1
    victim = sorted((tmp_path / "programs").glob("*.bin"))[0]
    victim.write_bytes(b"not a program")
    with caplog.at_level("WARNING", logger="dsv3_jax.engine.program_cache"):
        third, out3 = engine()
    assert third.stats["compiles"] == 1 and third.stats["programs_loaded"] == 2 and out3 == out1
    assert "did not load" in caplog.text and victim.read_bytes() != b"not a program"  # rewritten
