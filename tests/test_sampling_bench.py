"""benchmarks/sampling_bench.py's sort-free filter keeps exactly the product's top-k / top-p sets (CPU)."""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sampling_bench  # noqa: E402

from dsv3_jax.engine import sampling  # noqa: E402
from dsv3_jax.engine.sampling import SamplingParams  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bisection_keeps_the_sorts_sets(seed):
    """Every timed setting at bf16-valued logits (ties); per-row mixes with -inf tokens and greedy rows."""
    for name, logits, params in sampling_bench.cases(6, 3000, seed):
        got = sampling_bench.check(logits, params)
        assert got["rows_differing"] == 0, (name, got)
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(8, 500)) * 2.0, jnp.bfloat16).astype(jnp.float32)
    logits = logits.at[:, :100].set(-jnp.inf).at[3, 200:260].set(1.5)  # masked tokens; one row of many ties
    params = SamplingParams.make(8, temperature=[0.6, 1.0, 0.0, 2.0, 0.3, 1.0, 0.6, 1.0],
                                 top_p=[1.0, 0.5, 0.9, 0.99, 0.2, 1.0, 0.95, 0.01],
                                 top_k=[0, 0, 5, 0, 3, 400, 1, 0])
    got = sampling_bench.check(logits, params)
    assert got["rows_differing"] == 0, got
    assert 1.0 < got["kept_mean"] < 400  # the cuts did cut, and not to one token everywhere
    # top_p keeping the whole top-k set: the lowest kept key is the lowest of the set (nothing below it).
    params = SamplingParams.make(8, temperature=[2.0, 1.0, 0.6, 2.0, 5.0, 1.0, 3.0, 2.0],
                                 top_p=[0.999, 0.9999, 0.999, 0.5, 0.99, 0.9, 0.999, 0.95],
                                 top_k=[5, 50, 2, 7, 3, 1, 60, 9])
    got = sampling_bench.check(logits, params)
    assert got["rows_differing"] == 0, got


def test_order_keys_sort_as_the_floats():
    x = jnp.asarray([-jnp.inf, -3.5, -1e-30, 0.0, 1e-30, 2.0, 7.25, jnp.inf], jnp.float32)
    keys = np.asarray(sampling_bench._order_keys(x)).astype(np.int64)
    assert (np.diff(keys) > 0).all()
    zeros = np.asarray(sampling_bench._order_keys(jnp.asarray([-0.0, 0.0], jnp.float32)))
    assert zeros[0] == zeros[1]  # equal floats, one key (ties then go by token id, as in the sort)


def test_the_candidate_keeps_the_sorts_values():
    """Where the sets agree the kept values are the same scaled logits, value for value."""
    for name, logits, params in sampling_bench.cases(4, 3000, 7):
        np.testing.assert_array_equal(np.asarray(sampling_bench.filter_by_radix(logits, params)),
                                      np.asarray(sampling._filtered_logits(logits, params)), err_msg=name)
