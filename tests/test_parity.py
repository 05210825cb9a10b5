"""Logit parity with transformers' DeepseekV3 (fp32, CPU) in both attention forms, with and without cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.model import kv_cache
from tests.hf_reference import hf_logits, make_hf_model, rel_err, save_hf

TOL = 1e-4


@pytest.fixture(scope="module", params=["lora_yarn", "nolora"])
def hf_pair(request, tmp_path_factory):
    model = make_hf_model(request.param)
    dst = save_hf(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, dst


@pytest.mark.parametrize("form", ["absorbed", "naive"])
def test_full_forward_matches_transformers(hf_pair, form):
    kind, model, dst = hf_pair
    rng = np.random.default_rng(1)
    # 40 tokens: longer than the YaRN config's original 16-token context.
    tokens = rng.integers(0, model.config.vocab_size, size=(2, 40))
    ref = hf_logits(model, tokens)
    handle = dsv3_jax.load(dst, attention=form)
    ours = handle.forward(tokens)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= TOL, f"{kind}/{form}: rel err {rel_err(ours, ref):.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0


@pytest.mark.parametrize("form", ["absorbed", "naive"])
def test_prefill_then_decode_matches_full_forward(hf_pair, form):
    """Decode consistency: prefill a prefix, then feed tokens one by one through the cache."""
    kind, model, dst = hf_pair
    handle = dsv3_jax.load(dst, attention=form)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, model.config.vocab_size, size=(2, 24)).astype(np.int32)
    full = handle.forward(tokens)
    # Small pages so the sequence spans several, with a shuffled (non-contiguous) page assignment.
    cache = kv_cache.allocate(handle.config, num_pages=16, page_size=4, form=form, dtype=jnp.float32)
    table = jnp.asarray(np.random.default_rng(3).permutation(np.arange(1, 16))[:14].reshape(2, 7), jnp.int32)
    apply = jax.jit(lambda p, t, pos, c, m: handle.model.apply({"params": p}, t, pos, c, m))
    n_prefill = 9
    pos = jnp.broadcast_to(jnp.arange(n_prefill, dtype=jnp.int32), (2, n_prefill))
    meta = kv_cache.PageMeta(table, jnp.full((2,), n_prefill, jnp.int32))
    logits, _, cache = apply(handle.params, jnp.asarray(tokens[:, :n_prefill]), pos, cache, meta)
    steps = [np.asarray(logits)]
    one = kv_cache.PageMeta(table, jnp.ones((2,), jnp.int32))
    for t in range(n_prefill, tokens.shape[1]):
        pos = jnp.full((2, 1), t, jnp.int32)
        logits, _, cache = apply(handle.params, jnp.asarray(tokens[:, t:t + 1]), pos, cache, one)
        steps.append(np.asarray(logits))
    stepped = np.concatenate(steps, axis=1)
    assert rel_err(stepped, full) <= TOL, f"{kind}/{form}: {rel_err(stepped, full):.2e}"
