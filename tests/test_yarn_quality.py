"""benchmarks/yarn_quality.context_use: the far-context check on a tiny random model (CPU)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import yarn_quality  # noqa: E402

from dsv3_jax.api import ModelHandle  # noqa: E402
from dsv3_jax.config import ModelConfig  # noqa: E402
from dsv3_jax.model.transformer import Transformer  # noqa: E402


def _tiny_handle() -> ModelHandle:
    cfg = ModelConfig.preset("tiny").replace(vocab_size=256, max_position_embeddings=256, dtype="float32")
    model = Transformer(cfg, jnp.float32)
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 1), jnp.int32))["params"])(jax.random.key(0))
    return ModelHandle(cfg, params, attention="naive")


def test_context_use_scores_the_same_second_half_after_own_and_foreign_first_halves():
    h = _tiny_handle()
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, 256, 128), rng.integers(1, 256, 128)
    logs: list[str] = []
    r = yarn_quality.context_use(h, [a, b], 64, logs.append)
    assert r["boundary"] == 64 and r["windows"] == 2 and len(logs) == 2
    # Different first halves change the second half's CE; the pooled means match the per-window gains.
    assert all(abs(g) > 1e-6 for g in r["per_window_gain_nats"])
    assert np.isclose(r["foreign_ce"] - r["own_ce"], np.mean(r["per_window_gain_nats"]), atol=1e-4)
    assert list(r["by_distance"]) == ["64-127"]  # a 63-prediction half: one span, no empty ones
    # Two windows with the same first half: the foreign half is the own half, so nothing is gained.
    c = np.concatenate([a[:64], b[64:]])
    same = yarn_quality.context_use(h, [a, c], 64, logs.append)
    assert np.allclose(same["per_window_gain_nats"], 0.0, atol=1e-6)
