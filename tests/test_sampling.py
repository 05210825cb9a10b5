"""Sampling: greedy at temperature 0, top-k/top-p support, reproducibility, distribution, validation."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dsv3_jax.engine.sampling import (
    SamplingParams,
    load_generation_defaults,
    probs_after_filtering,
    sample,
    validate_sampling_params,
)

sample_jit = jax.jit(sample)
probs_jit = jax.jit(probs_after_filtering)


def _logits(batch, vocab, seed=0, scale=3.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, vocab)) * scale, dtype=jnp.float32)


def _allowed_sets(logits, temperature, top_p, top_k):
    """Reference (numpy, float64) of the tokens top-k then top-p may return, per row."""
    out = []
    for row, t, p, k in zip(np.asarray(logits, np.float64), temperature, top_p, top_k):
        order = np.argsort(-row, kind="stable")
        kept = order if k == 0 else order[:k]
        z = row[kept] / t
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        out.append(set(kept[(before < p) | (np.arange(len(kept)) == 0)].tolist()))
    return out


def test_temperature_zero_is_greedy():
    logits = _logits(16, 1000)
    # top_p / top_k must not matter for greedy rows
    params = SamplingParams.make(16, temperature=0.0, top_p=0.3, top_k=5)
    for seed in range(5):
        tokens = sample_jit(logits, params, jax.random.key(seed))
        np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
        assert tokens.dtype == jnp.int32 and tokens.shape == (16,)
    probs = probs_jit(logits, params)
    np.testing.assert_array_equal(probs, jax.nn.one_hot(jnp.argmax(logits, -1), 1000))


def test_mixed_batch_greedy_rows_exact():
    logits = _logits(16, 1000, seed=1, scale=0.1)  # flat logits: sampled rows almost never hit the argmax
    greedy_rows = np.arange(16) % 3 == 0
    temperature = np.where(greedy_rows, 0.0, np.linspace(0.5, 2.0, 16))
    params = SamplingParams.make(16, temperature=temperature, top_p=np.where(np.arange(16) % 2, 0.5, 1.0))
    tokens = np.asarray(sample_jit(logits, params, jax.random.key(3)))
    argmax = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(tokens[greedy_rows], argmax[greedy_rows])
    assert np.any(tokens[~greedy_rows] != argmax[~greedy_rows])


def _many_draws(logits, temperature, top_p, top_k, reps, seed=0):
    """Tile each row `reps` times so one jitted call draws `reps` samples per row with different keys."""
    batch = logits.shape[0]
    tiled = jnp.repeat(logits, reps, axis=0)
    params = SamplingParams.make(
        batch * reps,
        temperature=np.repeat(temperature, reps),
        top_p=np.repeat(top_p, reps),
        top_k=np.repeat(top_k, reps),
    )
    return np.asarray(sample_jit(tiled, params, jax.random.key(seed))).reshape(batch, reps)


@pytest.mark.parametrize(
    "top_p,top_k",
    [
        ([1.0, 1.0, 1.0, 1.0], [1, 2, 5, 17]),  # top-k only
        ([0.1, 0.5, 0.8, 0.95], [0, 0, 0, 0]),  # top-p only
        ([0.5, 0.9, 0.99, 0.3], [3, 10, 4, 50]),  # both
    ],
)
def test_never_samples_outside_allowed_set(top_p, top_k):
    logits = _logits(4, 64, seed=2, scale=2.0)
    temperature = np.array([1.0, 0.7, 1.5, 1.0])
    allowed = _allowed_sets(logits, temperature, top_p, top_k)
    draws = _many_draws(logits, temperature, np.array(top_p), np.array(top_k), reps=512)
    for row, ok in zip(draws, allowed):
        seen = set(row.tolist())
        assert seen <= ok, f"sampled {seen - ok} outside the allowed set {ok}"
        assert len(seen) > 1 or len(ok) == 1
    probs = np.asarray(
        probs_jit(logits, SamplingParams.make(4, temperature=temperature, top_p=top_p, top_k=top_k))
    )
    for row, ok in zip(probs, allowed):
        assert set(np.flatnonzero(row).tolist()) == ok
        np.testing.assert_allclose(row.sum(), 1.0, rtol=1e-5)


def test_top_k_one_equals_greedy_and_ties_pick_lowest_id():
    logits = jnp.asarray([[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    params = SamplingParams.make(2, temperature=1.0, top_k=1)
    for seed in range(10):
        np.testing.assert_array_equal(sample_jit(logits, params, jax.random.key(seed)), [1, 0])


def test_same_seed_same_tokens_and_per_row_keys():
    logits = _logits(16, 1000, seed=4, scale=1.0)
    params = SamplingParams.make(16, temperature=1.0, top_p=0.9, top_k=40)
    a = sample_jit(logits, params, jax.random.key(7))
    b = sample_jit(logits, params, jax.random.key(7))
    c = sample_jit(logits, params, jax.random.key(8))
    np.testing.assert_array_equal(a, b)
    assert np.any(np.asarray(a) != np.asarray(c))
    # Raw uint32 keys work too and are reproducible.
    np.testing.assert_array_equal(
        sample_jit(logits, params, jax.random.PRNGKey(7)), sample_jit(logits, params, jax.random.PRNGKey(7))
    )
    # With per-row keys a row's token does not depend on the rest of the batch.
    keys = jax.random.split(jax.random.key(9), 16)
    full = np.asarray(sample_jit(logits, params, keys))
    shuffled = np.asarray(sample_jit(logits[::-1], params, keys[::-1]))[::-1]
    np.testing.assert_array_equal(full, shuffled)


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(1.0, 1.0, 0), (0.6, 0.95, 0), (1.3, 0.8, 6)],
)
def test_chi_square_matches_distribution(temperature, top_p, top_k):
    # 10 real tokens padded to the 64-token vocabulary used above (padding has probability exp(-1e4) = 0),
    # drawn as 10 batches of 2048 so the compiled sampler is shared with the test above.
    vocab, rows, calls = 64, 2048, 10
    real = np.array([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.4, -1.0, -1.5, -2.5], np.float32)
    logits = jnp.asarray(np.concatenate([real, np.full(vocab - len(real), -1e4, np.float32)]))[None]
    params = SamplingParams.make(rows, temperature, top_p, top_k)
    batch = jnp.repeat(logits, rows, axis=0)
    draws = np.concatenate([np.asarray(sample_jit(batch, params, jax.random.key(i))) for i in range(calls)])
    n = rows * calls
    counts = np.bincount(draws, minlength=vocab)
    expected = np.asarray(probs_after_filtering(logits, SamplingParams.make(1, temperature, top_p, top_k)))[0]
    if temperature == 1.0 and top_p == 1.0 and top_k == 0:  # plain softmax
        np.testing.assert_allclose(expected, jax.nn.softmax(logits[0]), rtol=1e-5, atol=1e-7)
    support = expected > 0
    assert counts[~support].sum() == 0
    expected = expected.astype(np.float64)
    expected_counts = expected[support] / expected[support].sum() * n
    _, p_value = stats.chisquare(counts[support], expected_counts)
    assert p_value > 1e-3, (counts, expected_counts)


def test_validation_errors():
    validate_sampling_params(0.0, 1.0, 0)
    validate_sampling_params([0.0, 0.6], [0.95, 1.0], [0, 40])
    with pytest.raises(ValueError, match="temperature"):
        validate_sampling_params(-0.1, 1.0, 0)
    with pytest.raises(ValueError, match="temperature"):
        validate_sampling_params(float("nan"), 1.0, 0)
    for bad in (0.0, -0.5, 1.01, float("nan")):
        with pytest.raises(ValueError, match="top_p"):
            validate_sampling_params(1.0, bad, 0)
    with pytest.raises(ValueError, match="top_k"):
        validate_sampling_params(1.0, 1.0, -1)
    with pytest.raises(ValueError, match="top_k"):
        validate_sampling_params(1.0, 1.0, 2.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.make(3, top_p=[0.5, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        SamplingParams.make(3, temperature=[0.5, 1.0])
    with pytest.raises(ValueError, match="batch_size"):
        SamplingParams.make(0)
    with pytest.raises(ValueError, match="logits"):
        sample(jnp.zeros((4,)), SamplingParams.make(4), jax.random.key(0))
    with pytest.raises(ValueError, match="params.temperature"):
        sample(jnp.zeros((3, 8)), SamplingParams.make(4), jax.random.key(0))


def test_load_generation_defaults(tmp_path):
    assert load_generation_defaults(tmp_path) == {}
    deepseek = {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
                "temperature": 0.6, "top_p": 0.95, "transformers_version": "4.46.3"}
    (tmp_path / "generation_config.json").write_text(json.dumps(deepseek))
    assert load_generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "eos_token_ids": [1]}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6,
                                                                 "top_k": 20, "eos_token_id": [1, 2]}))
    assert load_generation_defaults(tmp_path) == {"temperature": 0.0, "top_k": 20, "eos_token_ids": [1, 2]}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="top_p"):
        load_generation_defaults(tmp_path)
