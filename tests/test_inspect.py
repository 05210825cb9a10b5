"""The handle's text/HTML repr (dsv3_jax/notebook.py) and the research hooks (dsv3_jax/model/probes.py),
checked against independent computations on the tiny default model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax import plan
from dsv3_jax.api import tiny_default
from dsv3_jax.model import kv_cache, layout
from dsv3_jax.model.moe import route
from dsv3_jax.notebook import Table, memory_per_device
from dsv3_jax.parallel import sharding

PROMPT = "Routers pick experts; attention picks tokens."


@pytest.fixture(scope="module")
def h():
    return tiny_default(seed=0)


@pytest.fixture(scope="module")
def captured(h):
    """The MoE layers' post-attention-norm outputs and the layers' kv_a_layernorm outputs for PROMPT."""
    ids = h.tokenizer.encode(PROMPT)

    def keep(mdl, method):
        return method == "__call__" and mdl.name in ("post_attention_layernorm", "kv_a_layernorm")

    fn = jax.jit(lambda p, t: h.model.apply({"params": p}, t, mutable=["intermediates"],
                                            capture_intermediates=keep)[1]["intermediates"])
    return ids, fn(h.params, jnp.asarray([ids]))


# -------------------------------------------------------------------------------------------- repr
def test_html_repr_renders_config_fields(h):
    html = h._repr_html_()
    assert html.startswith("<table>") and html.endswith("</table>")
    c = h.config
    for field in ("dsv3_jax ModelHandle", f"{c.num_hidden_layers} ({c.n_dense_layers} dense + "
                  f"{c.n_moe_layers} MoE)", f"num_experts_per_tok {c.num_experts_per_tok}",
                  f"kv_lora_rank {c.kv_lora_rank}", f"{c.num_attention_heads} heads", "absorbed form",
                  "float32 weights and activations", "none (one device)", "weights per device",
                  f"{c.vocab_size:,}", "16.87M total", "kernels", "reference"):
        assert field in html, field
    text = repr(h)
    assert text.startswith("ModelHandle(") and "hidden_size" in text and "absorbed" in text
    assert len(text) < 2000  # a summary, never the parameter arrays


@pytest.fixture(scope="module")
def hm(h):
    """The same model placed on a data=2,tensor=2,expert=2 mesh of the 8 CPU devices."""
    mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
    sh = sharding.param_shardings(h.config, mesh, h.params)
    return dataclasses.replace(h, params=jax.device_put(h.params, sh), mesh=mesh, param_shardings=sh)


def test_repr_shows_mesh_and_per_device_memory(h, hm):
    mesh = hm.mesh
    per = memory_per_device(hm)
    assert len(per) == 8
    # What the planner predicts from the sharding tables is what the placed arrays really hold.
    _, expected, _ = plan.tree_bytes_per_device(h.params, sharding.param_specs(h.params),
                                                sharding.axis_sizes(mesh))
    assert set(per.values()) == {expected}
    assert expected < 0.51 * sum(x.nbytes for x in jax.tree.leaves(h.params))
    html = hm._repr_html_()
    assert "data=2,tensor=2,expert=2 (8 devices)" in html and "on each of 8 device(s)" in html


def test_table_renders_text_html_csv(tmp_path):
    t = Table([{"mesh": "expert=8", "GB": 106.29, "fits": True},
               {"mesh": "tensor=8", "GB": 87.2, "fits": True}], title="plans")
    assert len(t) == 2 and "expert=8" in repr(t) and repr(t).startswith("plans")
    assert t._repr_html_().count("<tr>") == 3 and "<th>GB</th>" in t._repr_html_()
    t.to_csv(tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text().splitlines() == ["mesh,GB,fits", "expert=8,106.29,True",
                                                             "tensor=8,87.2,True"]
    with pytest.raises(ValueError, match="rows"):
        Table([])


# ------------------------------------------------------------------------------------ router stats
def test_router_stats_match_the_router_on_captured_inputs(h, captured):
    ids, inter = captured
    stats = h.router_stats(PROMPT)
    c = h.config
    assert stats.token_ids == ids and stats.layers == [2, 3] and len(stats.tokens) == len(ids)
    assert stats.choices.shape == (c.n_moe_layers, len(ids), c.num_experts_per_tok)
    # Recompute every MoE layer's routing from its captured input and its own router weights.
    hn = inter["moe_layers"]["post_attention_layernorm"]["__call__"][0][:, 0]  # [L, T, D]
    mlp = h.params["moe_layers"]["mlp"]
    for layer in range(c.n_moe_layers):
        logits = hn[layer] @ mlp["gate_weight"][layer].T
        _, idx = route(logits, mlp["e_score_correction_bias"][layer], c)
        np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(stats.choices[layer], -1))
    # Each token: k distinct experts from at most topk_group groups; the histogram counts them all.
    per_group = c.n_routed_experts // c.n_group
    for row in stats.choices.reshape(-1, c.num_experts_per_tok):
        assert len(set(row)) == c.num_experts_per_tok and len(set(row // per_group)) <= c.topk_group
    assert stats.load.shape == (c.n_moe_layers, c.n_routed_experts)
    assert (stats.load.sum(1) == len(ids) * c.num_experts_per_tok).all()
    rows = stats.table()
    assert [r["layer"] for r in rows] == [2, 3]
    assert all(r["busiest_load"] == stats.load[i].max() for i, r in enumerate(rows))
    assert (stats.imbalance >= 1.0).all()


def test_router_stats_plot(h):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    fig = h.router_stats(PROMPT).plot()
    assert fig.axes[0].get_xlabel() == "expert"


# ------------------------------------------------------------------------------- attention entropy
def test_attention_entropy_is_consistent_with_the_model(h):
    ent = h.attention_entropy(PROMPT)
    n = len(ent.token_ids)
    c = h.config
    assert ent.entropy.shape == (c.num_hidden_layers, c.num_attention_heads, n)
    assert ent.recompute_error < 1e-5  # the recomputed attention output is the model's own
    assert np.allclose(ent.entropy[..., 0], 0.0, atol=1e-6)  # the first query sees one key
    assert (ent.entropy >= -1e-6).all() and (ent.entropy <= ent.max_entropy + 1e-5).all()
    assert ent.mean.shape == ent.normalized.shape == (c.num_hidden_layers, c.num_attention_heads)


def test_attention_entropy_of_uniform_attention_is_log_t(h):
    # Zero query projections make every score 0: attention is uniform, entropy exactly log(t + 1).
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "q_b_proj" in jax.tree_util.keystr(path) else x, h.params)
    ent = dataclasses.replace(h, params=params).attention_entropy(PROMPT)
    np.testing.assert_allclose(ent.entropy, np.broadcast_to(ent.max_entropy, ent.entropy.shape), atol=1e-5)
    np.testing.assert_allclose(ent.normalized, 1.0, atol=1e-5)


# ------------------------------------------------------------------------------------- cache pages
def test_cache_pages_hold_the_sequence_latents(h, captured):
    ids, inter = captured
    pages = h.cache_pages(PROMPT, page_size=4)
    n = len(ids)
    c = h.config
    assert pages.n_tokens == n and pages.page_fill() == [min(4, n - 4 * i) for i in range(-(-n // 4))]
    np.testing.assert_array_equal(pages.block_table, kv_cache.contiguous_table(1, n, 4)[0])
    arr = pages.pages["dense_layers"]["pages"]
    assert arr.shape == (c.n_dense_layers, pages.n_pages, 4, c.latent_dim)
    # The cached latent part is kv_a_layernorm's output (the rope part follows it), layer by layer.
    for stack, first in (("dense_layers", 0), ("moe_layers", c.n_dense_layers)):
        latents = np.asarray(inter[stack]["self_attn"]["kv_a_layernorm"]["__call__"][0][:, 0])
        for i in range(latents.shape[0]):
            np.testing.assert_allclose(pages.layer(first + i)[:, : c.kv_lora_rank], latents[i], atol=1e-5)
    flat = arr.reshape(arr.shape[0], -1, c.latent_dim)
    assert not flat[:, n:].any()  # slots past the sequence stay unwritten
    rows = pages.table()
    assert [r["tokens"] for r in rows] == pages.page_fill()
    assert rows[0]["bytes_all_layers"] == 4 * layout.bytes_per_token(c, "absorbed", jnp.float32)


def test_cache_pages_naive_form(h):
    hn = dataclasses.replace(h, attention="naive")
    pages = hn.cache_pages([4, 5, 6], page_size=8)
    c = hn.config
    assert set(pages.pages["moe_layers"]) == {"k_pages", "v_pages"}
    assert pages.layer(3).shape == (3, c.num_attention_heads, c.qk_head_dim)
    assert pages.layer(3, "v_pages").shape == (3, c.num_attention_heads, c.v_head_dim)


@pytest.mark.parametrize("prompt, match", [([], "empty"), ([-1, 2], "token ids"),
                                           ([0, 10**7], "token ids")])
def test_bad_prompts_are_refused(h, prompt, match):
    for fn in (h.router_stats, h.attention_entropy, h.cache_pages):
        with pytest.raises(ValueError, match=match):
            fn(prompt)
    with pytest.raises(ValueError, match="page_size"):
        h.cache_pages([1, 2], page_size=0)
    with pytest.raises(ValueError, match="layer"):
        h.cache_pages(PROMPT, page_size=4).layer(99)


def test_hooks_on_a_mesh_match_one_device(h, hm):
    # Expert-parallel MoE under the mesh (the prompt is padded to the mesh's batch shards).
    one, many = h.router_stats(PROMPT), hm.router_stats(PROMPT)
    np.testing.assert_array_equal(np.sort(one.choices, -1), np.sort(many.choices, -1))
    e1, e8 = h.attention_entropy(PROMPT), hm.attention_entropy(PROMPT)
    np.testing.assert_allclose(e8.entropy, e1.entropy, atol=1e-5)
    assert e8.recompute_error < 1e-5
