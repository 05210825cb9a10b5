"""Serving engine: continuous batching == alone (greedy), chunked prefill, preemption, prefix caching,
MTP speculative decoding (greedy exact; sampled keeps the distribution), page accounting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3_jax.api import ModelHandle
from dsv3_jax.config import ModelConfig
from dsv3_jax.engine.core import Engine, EngineConfig
from dsv3_jax.engine.executor import DeviceExecutor
from dsv3_jax.engine.paging import OutOfPages, PagePool
from dsv3_jax.model.transformer import Transformer

CFG = ModelConfig.preset("tiny").replace(vocab_size=256, max_position_embeddings=512)


def _mtp_friendly_params(cfg: ModelConfig, seed: int, head_scale: float) -> dict:
    """Random weights whose MTP head mostly agrees with the main model (so drafts get accepted *and*
    rejected): the layers' outputs are damped, so the main model's next token depends mostly on the
    current token, and the MTP head is wired to compute that same function of token i+1."""
    model = Transformer(cfg)
    p = model.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32), method=model.init_all)["params"]
    p = jax.tree_util.tree_map(np.array, p)  # writable copies
    d = cfg.hidden_size
    for stack in ("dense_layers", "moe_layers"):
        p[stack]["self_attn"]["o_proj"]["weight"] *= 0.3
        mlp = p[stack]["mlp"]
        for leaf in ("down_proj_weight",):
            if leaf in mlp:
                mlp[leaf] *= 0.3
        if "down_proj" in mlp:
            mlp["down_proj"]["weight"] *= 0.3
        if "shared_experts" in mlp:
            mlp["shared_experts"]["down_proj"]["weight"] *= 0.3
    p["lm_head"]["weight"] = p["lm_head"]["weight"] * head_scale
    p["norm"]["weight"] = np.ones(d, np.float32)
    m = p["mtp"]
    m["embed_tokens"]["embedding"] = p["embed_tokens"]["embedding"]
    m["enorm"]["weight"] = np.ones(d, np.float32)
    m["eh_proj"]["weight"] = np.concatenate([np.eye(d), np.zeros((d, d))], 1).astype(np.float32)
    m["block"]["self_attn"]["o_proj"]["weight"] *= 0.0
    m["block"]["mlp"]["down_proj_weight"] *= 0.0
    m["block"]["mlp"]["shared_experts"]["down_proj"]["weight"] *= 0.0
    m["shared_head_norm"]["weight"] = np.ones(d, np.float32)
    m["shared_head_head"]["weight"] = p["lm_head"]["weight"]
    return jax.tree_util.tree_map(jnp.asarray, p)


@pytest.fixture(scope="module")
def handle():
    return ModelHandle(CFG, _mtp_friendly_params(CFG, 1, 4.0))


def _prompts(n, lo=3, hi=40, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _alone(handle, prompt, n):
    return handle.generate(prompt, max_new_tokens=n, temperature=0, ignore_eos=True).token_ids


def test_engine_runs_on_an_injected_executor(handle):
    """The core drives whatever executor it is given: every step goes through it, its compile counters are
    the engine's, and the tokens equal those of the default executor's engine."""
    cfg = dict(num_pages=32, page_size=16, max_batch=4, max_batched_tokens=64, chunk_size=16)
    keys = []

    class Recording(DeviceExecutor):
        def execute(self, key, ints, floats):
            keys.append(key)
            return super().execute(key, ints, floats)

    ex = Recording(handle, EngineConfig(**cfg))
    eng = Engine(handle, EngineConfig(**cfg), executor=ex)
    prompts = _prompts(3, seed=4)
    got = [r.output for r in eng.generate(prompts, max_new_tokens=6)]
    assert eng.executor is ex and eng.width == ex.width and len(keys) == eng.stats["steps"] > 3
    assert all(k.width == ex.width for k in keys)
    assert eng.stats["compiles"] == eng.engine_stats()["compiles"] == ex.stats["compiles"]
    default = Engine(handle, EngineConfig(**cfg))
    assert isinstance(default.executor, DeviceExecutor) and default.executor is not ex
    assert [r.output for r in default.generate(prompts, max_new_tokens=6)] == got


def test_continuous_batching_equals_alone_with_chunking_and_preemption(handle):
    prompts = _prompts(6, seed=1)
    want = [_alone(handle, p, 12) for p in prompts]
    # Tiny pages, a small pool (forces preemption), small chunks (prompts span several steps).
    eng = Engine(handle, EngineConfig(num_pages=24, page_size=4, max_batch=4, max_batched_tokens=24,
                                      chunk_size=8))
    rids, got = {}, {}
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]}  # requests join between steps
    step = 0
    while len(got) < len(prompts):
        for i in arrivals.get(step, []):
            rids[eng.add_request(prompts[i], max_new_tokens=12)] = i
        for ev in eng.step():
            if ev.finished:
                got[rids[ev.rid]] = eng.finished[ev.rid].output
        eng.pool.check()
        step += 1
    assert [got[i] for i in range(len(prompts))] == want
    assert eng.stats["preemptions"] > 0, "the pool was meant to be too small to avoid preemption"
    assert max(eng.stats["batch_sizes"]) > 1
    assert eng.pool.num_used == 0  # everything freed


def test_prefix_cache_hit_gives_same_tokens(handle):
    system = _prompts(1, 30, 31, seed=2)[0]
    a, b = system + [5, 6, 7], system + [9, 10]
    eng = Engine(handle, EngineConfig(num_pages=64, page_size=4))
    ra = eng.generate([a], max_new_tokens=6)[0]
    rb = eng.generate([b], max_new_tokens=6)[0]
    assert rb.cached_tokens == 28  # 7 full pages of the 30-token shared prefix
    assert ra.output == _alone(handle, a, 6) and rb.output == _alone(handle, b, 6)
    assert eng.engine_stats()["prefix_hit_rate"] > 0
    eng.pool.check()
    assert eng.pool.num_used == 0


def test_cancellation_and_oversized_requests(handle):
    eng = Engine(handle, EngineConfig(num_pages=10, page_size=4))
    with pytest.raises(ValueError, match="could never run"):
        eng.add_request(list(range(2, 40)), max_new_tokens=8)
    with pytest.raises(ValueError, match="overflows the context"):
        eng.add_request([3] * 500, max_new_tokens=20)
    with pytest.raises(ValueError, match="seed"):  # seeds are int32 on the device
        eng.add_request([3, 4, 5], max_new_tokens=4, seed=2**40)
    rid = eng.add_request([3, 4, 5], max_new_tokens=20)
    eng.step()
    assert eng.pool.num_used > 0
    assert eng.cancel(rid) and eng.finished[rid].finish_reason == "cancelled"
    assert eng.pool.num_used == 0 and not eng.has_work()


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_speculation_equals_plain_greedy(handle, k):
    prompts = _prompts(4, seed=3)
    want = [_alone(handle, p, 16) for p in prompts]
    eng = Engine(handle, EngineConfig(num_pages=64, page_size=4, spec_k=k, chunk_size=16))
    got = [r.output for r in eng.generate(prompts, max_new_tokens=16)]
    assert got == want
    stats = eng.engine_stats()
    print(f"k={k}: acceptance {stats['mtp_acceptance']:.2f}, steps {stats['steps']}")
    # Both paths exercised: some drafts accepted (fewer steps than tokens), some rejected.
    assert 0.1 < stats["mtp_acceptance"] < 1.0
    assert max(r.steps for r in eng.finished.values()) < 16


def test_sampled_speculation_keeps_the_distribution():
    """Two sampled tokens after a fixed prompt, with and without MTP drafts: same joint distribution."""
    cfg = CFG.replace(vocab_size=8)
    h = ModelHandle(cfg, _mtp_friendly_params(cfg, 5, 2.0))
    n = 256

    def joint(spec_k):
        eng = Engine(h, EngineConfig(num_pages=200, page_size=4, max_batch=128, max_batched_tokens=1024,
                                     spec_k=spec_k))
        for s in range(n):
            eng.add_request([1, 2, 3], max_new_tokens=2, temperature=1.0, seed=s)
        for _ in eng.run():
            pass
        counts = np.zeros((8, 8))
        for i in range(n):
            out = eng.finished[i].output
            counts[out[0], out[1]] += 1
        return counts, eng

    plain, _ = joint(0)
    spec, eng = joint(1)
    assert 0 < eng.engine_stats()["mtp_acceptance"] < 1  # drafts were really tested, both ways
    # Chi-square homogeneity test over the cells with enough mass.
    from scipy.stats import chi2_contingency

    mask = (plain + spec).ravel() >= 5
    table = np.stack([plain.ravel()[mask], spec.ravel()[mask]])
    p = chi2_contingency(table)[1]
    assert p > 1e-3, p


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "match", "register"]),
                          st.integers(0, 5), st.integers(0, 3)), max_size=40))
def test_page_pool_refcounts_never_negative(ops):
    pool = PagePool(12, 2)
    held: list[list[int]] = []
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [7, 7, 7, 7]]
    for op, n, which in ops:
        if op == "alloc":
            try:
                held.append(pool.allocate(n))
            except OutOfPages:
                assert n > pool.num_free
        elif op == "release" and held:
            pool.release(held.pop(which % len(held)))
        elif op == "match":
            got = pool.match_prefix(seqs[which % 3], 3)
            held.append(got)
        elif op == "register" and held:
            pool.register(seqs[which % 3], held[which % len(held)])
        pool.check()
    for h in held:
        pool.release(h)
    pool.check()
    assert pool.num_used == 0


def test_requests_compare_by_identity():
    """The scheduler asks `r in self.running` for every row of every step and removes requests from its
    lists: with field-by-field dataclass equality each test built two 31-field tuples per list entry,
    O(rows^2) Python work a step (256 decoders: 78 ms of schedule a step on the CPU dev box, 2.4 ms by
    identity; benchmarks/host_step_cost.py). Two requests with equal fields are still two requests."""
    import dataclasses

    from dsv3_jax.engine.scheduler import Request

    a = Request(7, [1, 2, 3], 4, 0.0, 1.0, 0, 0, frozenset())
    b = dataclasses.replace(a)
    assert a == a and a != b and b not in [a] and [a, b].index(b) == 1
    assert len({a, b}) == 2  # hashable by identity
