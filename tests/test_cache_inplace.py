"""The paged cache is updated in place: a step's cost must not grow with the page pool.

The scanned layer stacks used to take their cache as scan inputs and return it as scan outputs, so XLA
sliced each layer's pool out and stacked the written slices back: a full copy of the pool per step
(a 1-token step of the tiny slice on CPU: 6 ms over 64 pages, 124 ms over 4,096). Now the stack rides
in the scan carry and each layer reads and writes it through `cache.layer_view`. Checked on the compiled
program (timing is for benchmarks): no copy, broadcast or concatenation of a whole stack or of its flat
view.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kv_cache
from dsv3_jax.model.kv_cache import PageMeta, layer_view
from dsv3_jax.model.transformer import Transformer


@pytest.mark.parametrize("form", ["absorbed", "naive"])
@pytest.mark.parametrize("layers,dense", [(4, 2), (3, 1)], ids=["two-layer-stacks", "one-layer-stack"])
def test_decode_step_touches_no_whole_pool(layers, dense, form):
    # XLA turns a one-iteration scan (the embedded default's single dense layer) into straight-line code,
    # a different case: a write through the flat view there compiled to a copy of the stack (which the CPU
    # runtime happened to elide, measured: 1 ms steps over a 1 GB pool either way).
    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=layers, first_k_dense_replace=dense,
                                             num_nextn_predict_layers=0)
    model = Transformer(cfg, form=form)
    params = model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    cache = kv_cache.allocate(cfg, 512, form=form)
    meta = PageMeta(jnp.asarray([[1, 2]], jnp.int32), jnp.ones((1,), jnp.int32))
    tok, pos = jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), 70)
    step = jax.jit(lambda p, c: model.apply({"params": p}, tok, pos, c, meta)[2], donate_argnums=(1,))
    hlo = step.lower(params, cache).compile().as_text()
    for name, leaves in cache.items():
        for key, leaf in leaves.items():  # "pages" (absorbed) or "k_pages" and "v_pages" (naive)
            stacked = leaf.shape
            for shape in (stacked, (stacked[0] * stacked[1], *stacked[2:])):
                ops = set(re.findall(r"\[" + ",".join(map(str, shape)) + r"\]\{[0-9,]*\} ([a-z-]+)\(", hlo))
                # (a dynamic-update-slice of the stack is the in-place write itself)
                assert not ops & {"copy", "broadcast", "concatenate"}, (name, key, shape, ops)


def test_layer_view_addresses_one_layer_of_the_stack():
    pages = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2)  # [L=3, P=4, 2]
    meta = PageMeta(jnp.asarray([[2, 0]], jnp.int32), jnp.ones((1,), jnp.int32))
    flat, m1 = layer_view(pages, meta, jnp.int32(1))
    np.testing.assert_array_equal(flat[m1.block_table[0]], pages[1][jnp.asarray([2, 0])])
    one = pages[0]
    same, m0 = layer_view(one, meta, None)  # an unstacked leaf (the MTP layer's) is left as is
    assert same is one and m0 is meta
