"""Meshes on 8 virtual CPU devices: every layout gives one device's logits and greedy tokens, parameters
are sharded as sharding.py's table says, the expert-parallel dispatch paths agree, bad meshes fail clearly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.model import kv_cache, layout, moe
from dsv3_jax.model.trace_options import TraceOptions
from dsv3_jax.parallel import sharding
from dsv3_jax.parallel.sharding import MeshError
from tests.hf_reference import make_hf_model, rel_err, save_hf
from tests.mesh_models import MESH_CONFIGS

TOL = 1e-4
PROMPT, NEW = 10, 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (checkpoint dir, tokens, one-device logits, one-device greedy continuation), built lazily."""
    built = {}

    def get(kind: str):
        if kind not in built:
            dst = save_hf(make_hf_model(kind), tmp_path_factory.mktemp(kind))
            handle = dsv3_jax.load(dst)
            tokens = _tokens(handle.config.vocab_size)
            built[kind] = dst, tokens, handle.forward(tokens), _greedy(handle, tokens)
        return built[kind]

    assert set(MESH_CONFIGS) >= {"h8e16", "h8e8"}
    return get


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(7).integers(2, vocab, size=(3, PROMPT + NEW)).astype(np.int32)


def _greedy(handle, tokens: np.ndarray) -> np.ndarray:
    """Greedy continuation of tokens[:, :PROMPT] in a fixed-size buffer (causal: padding is invisible)."""
    buf = tokens.copy()
    for t in range(PROMPT, PROMPT + NEW):
        buf[:, t] = handle.forward(buf)[:, t - 1].argmax(-1)
    return buf[:, PROMPT:]


# (checkpoint, mesh): the layouts. h8e16 has 16 experts (tensor=2,expert=4: 4 per device;
# expert=8: 2 per device), h8e8 has 8 experts (expert=8: 1 per device).
LAYOUTS = [
    ("h8e16", "data=1,tensor=8"),
    ("h8e16", "tensor=2,expert=4"),
    ("h8e16", "data=2,tensor=2,expert=2"),
    ("h8e16", "data=8"),
    ("h8e16", "expert=8"),
    ("h8e8", "expert=8"),
]


@pytest.mark.parametrize("kind,spec", LAYOUTS)
def test_layout_matches_one_device(models, kind, spec):
    dst, tokens, ref_logits, ref_greedy = models(kind)
    handle = dsv3_jax.load(dst, mesh=spec)
    logits = handle.forward(tokens)
    assert rel_err(logits, ref_logits) <= TOL, f"{spec}: rel err {rel_err(logits, ref_logits):.2e}"
    np.testing.assert_array_equal(logits.argmax(-1), ref_logits.argmax(-1))
    # Cached generation on the mesh (paged cache placed on the mesh, MoE expert-parallel) gives the
    # one-device greedy tokens.
    got = handle.generate([p.tolist() for p in tokens[:, :PROMPT]], max_new_tokens=NEW, temperature=0,
                          ignore_eos=True)
    np.testing.assert_array_equal(np.array([r.token_ids for r in got]), ref_greedy)


@pytest.mark.parametrize("kind,spec,capacity", [
    ("h8e8", "expert=8", 2.0),  # 1 expert per device, real all-to-all
    ("h8e16", "data=2,tensor=2,expert=2", 2.0),
    ("h8e16", "tensor=2,expert=4", 0.25),  # capacity too small: must fall back, dropping nothing
])
def test_all_to_all_dispatch_matches(models, kind, spec, capacity):
    dst, tokens, ref_logits, _ = models(kind)
    options = TraceOptions.resolve(moe_dispatch="all_to_all", capacity_factor=capacity)
    handle = dsv3_jax.load(dst, mesh=spec, trace_options=options)
    logits = handle.forward(tokens)
    assert rel_err(logits, ref_logits) <= TOL, f"{spec}/a2a cf={capacity}: {rel_err(logits, ref_logits):.2e}"


def test_capacity_and_dispatch_choice():
    v3 = dsv3_jax.ModelConfig.preset("deepseek-v3")
    # A token reaches at most 4 devices at EP=8 (4 groups, one group per device), 8 at EP=16 (a group
    # spans 2 devices), never more than k or ep; a group split unevenly spans one device more.
    assert [moe.max_destinations(v3, ep) for ep in (1, 2, 4, 8, 16, 32, 64)] == [1, 2, 4, 4, 8, 8, 8]
    assert moe.max_destinations(v3.replace(n_group=1, topk_group=1), 8) == 8
    assert moe.max_destinations(v3.replace(n_routed_experts=96, n_group=12, topk_group=1), 8) == 2
    # Capacity: capacity_factor x the balanced load (n x max_dest / ep), rounded up to 8, capped at n.
    assert moe.a2a_capacity(n_local=64, ep=16, max_dest=4, capacity_factor=2.0) == (32, 64)
    assert moe.a2a_capacity(n_local=4096, ep=8, max_dest=4, capacity_factor=2.0) == (4096, 4096)
    assert moe.a2a_capacity(n_local=2, ep=8, max_dest=8, capacity_factor=2.0)[0] == 2
    auto = TraceOptions()
    assert moe.choose_dispatch(64, auto) == "all_gather"
    assert moe.choose_dispatch(auto.all_gather_max_tokens + 1, auto) == "all_to_all"
    assert moe.choose_dispatch(1, auto.replace(moe_dispatch="all_to_all")) == "all_to_all"
    with pytest.raises(ValueError, match="dispatch"):
        TraceOptions(moe_dispatch="ring")


def _sharded_cache(handle, b: int, max_len: int):
    """A cache whose sequences live in their batch shard's slice (paged pool or contiguous slots)."""
    shards = sharding.batch_multiple(handle.mesh)
    if not hasattr(kv_cache, "PageMeta"):  # contiguous [L, B, S, ...] slots
        return kv_cache.allocate(handle.config, batch=b, max_len=max_len, dtype=jnp.float32), None
    ps, n = 4, -(-max_len // 4)
    per_shard = (b // shards) * n + 1  # + one page per shard so page 0 (scratch) is never a sequence's
    pool = kv_cache.allocate(handle.config, num_pages=shards * per_shard, page_size=ps, dtype=jnp.float32)
    table = np.array([[(s // (b // shards)) * per_shard + 1 + (s % (b // shards)) * n + j for j in range(n)]
                      for s in range(b)], np.int32)
    return pool, table


def test_cached_decode_on_mesh_matches_full_forward(models):
    """Prefill + step-by-step decode with the latent cache batch-sharded over data x expert."""
    dst, tokens, ref_logits, _ = models("h8e16")
    handle = dsv3_jax.load(dst, mesh="data=2,tensor=2,expert=2")
    b = 4  # a multiple of the 4 batch shards
    toks = np.concatenate([tokens, tokens[:1]])[:b]
    cache, table = _sharded_cache(handle, b, 32)
    cache_sh = sharding.cache_shardings(handle.config, handle.mesh, cache)
    cache = jax.device_put(cache, cache_sh)
    tok_sh = sharding.activation_sharding(handle.mesh, "tokens")
    if table is None:
        def apply_fn(p, t, pos, c, n):
            return handle.model.apply({"params": p}, t, pos, c)
    else:
        def apply_fn(p, t, pos, c, n):
            meta = kv_cache.PageMeta(jnp.asarray(table), jnp.full((b,), n, jnp.int32))
            return handle.model.apply({"params": p}, t, pos, c, meta)
    apply = jax.jit(apply_fn, in_shardings=(handle.param_shardings, tok_sh, tok_sh, cache_sh),
                    out_shardings=(None, None, cache_sh), static_argnums=4)
    steps = []
    with handle.mesh_context():
        pos = np.broadcast_to(np.arange(PROMPT, dtype=np.int32), (b, PROMPT))
        logits, _, cache = apply(handle.params, toks[:, :PROMPT], pos, cache, PROMPT)
        steps.append(np.asarray(logits))
        for t in range(PROMPT, toks.shape[1]):
            logits, _, cache = apply(handle.params, toks[:, t:t + 1], np.full((b, 1), t, np.int32), cache, 1)
            steps.append(np.asarray(logits))
    leaf = jax.tree.leaves(cache["moe_layers"])[0]
    assert leaf.sharding.spec == jax.tree.leaves(sharding.cache_specs(cache)["moe_layers"])[0]
    assert leaf.addressable_shards[0].data.shape[1] == leaf.shape[1] // 4  # batch / pages split 4 ways
    stepped = np.concatenate(steps, axis=1)[:3]
    assert rel_err(stepped, ref_logits) <= TOL


def test_parameter_shard_shapes(models):
    handle = dsv3_jax.load(models("h8e16")[0], mesh="data=2,tensor=2,expert=2")
    p, c = handle.params, handle.config
    nl, e, d, i = c.n_moe_layers, c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
    h = c.num_attention_heads
    expected = {
        ("moe_layers", "mlp", "gate_proj_weight"): (nl, e // 2, i // 2, d),  # experts / expert, FFN / tensor
        ("moe_layers", "mlp", "down_proj_weight"): (nl, e // 2, d, i // 2),
        ("moe_layers", "self_attn", "q_b_proj", "weight"): (nl, h // 2 * c.qk_head_dim, c.q_lora_rank),
        # kv_b as the handle holds it (model/kv_b.py): heads / tensor
        ("moe_layers", "self_attn", "w_uk"): (nl, h // 2, c.kv_lora_rank, c.qk_nope_head_dim),
        ("moe_layers", "self_attn", "w_uv"): (nl, h // 2, c.v_head_dim, c.kv_lora_rank),
        ("moe_layers", "self_attn", "o_proj", "weight"): (nl, d, h // 2 * c.v_head_dim),
        # q_a and kv_a fused as the handle holds them (model/qkv_a.py): replicated
        ("moe_layers", "self_attn", "qkv_a_proj", "weight"): (nl, c.q_lora_rank + c.latent_dim, d),
        ("dense_layers", "mlp", "gate_proj", "weight"): (c.n_dense_layers, c.intermediate_size // 2, d),
        ("moe_layers", "mlp", "shared_experts", "up_proj", "weight"): (nl, i * c.n_shared_experts // 2, d),
        ("embed_tokens", "embedding"): (c.vocab_size // 2, d),  # vocabulary-parallel
        ("lm_head", "weight"): (c.vocab_size // 2, d),
    }
    for path, shape in expected.items():
        arr = p
        for k in path:
            arr = arr[k]
        shards = {s.data.shape for s in arr.addressable_shards}
        assert shards == {shape}, f"{'/'.join(path)}: shards {shards}, expected {shape}"


@pytest.mark.parametrize("spec", ["expert=8", "tensor=2,expert=4", "data=2,tensor=2,expert=2"])
def test_nothing_expert_sized_is_replicated(spec):
    """Every [.., E, ..] expert array is split over `expert`; only the router (tiny) is replicated."""
    from dsv3_jax import plan

    cfg = dsv3_jax.ModelConfig.preset("deepseek-v3")
    shapes = plan.param_shapes(cfg, "bf16")
    specs = sharding.param_specs(shapes)
    sizes = sharding.parse_mesh_spec(spec)
    router = expert_bytes = 0
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(
            specs, is_leaf=lambda v: isinstance(v, jax.sharding.PartitionSpec)), strict=True):
        name = jax.tree_util.keystr(path)
        dims = [k for k, n in enumerate(x.shape) if n == cfg.n_routed_experts]
        if not dims:
            continue
        shard = sharding.shard_shape(x.shape, s, sizes)
        nbytes = int(np.prod(x.shape)) * x.dtype.itemsize
        if "gate_weight" in name or "e_score_correction_bias" in name:
            router += nbytes
            continue
        assert shard[dims[0]] == cfg.n_routed_experts // sizes["expert"], f"{name} not split over expert"
        expert_bytes += nbytes
    assert router < 1e-3 * expert_bytes  # the replicated router is < 0.1% of the expert weights


def test_mesh_spec_parsing_and_errors():
    assert sharding.parse_mesh_spec("data=2,tensor=2,expert=2") == {"data": 2, "expert": 2, "tensor": 2}
    assert sharding.parse_mesh_spec("tensor=8") == {"data": 1, "expert": 1, "tensor": 8}
    assert sharding.resolve_sizes("expert=-1,tensor=2", 8) == {"data": 1, "expert": 4, "tensor": 2}
    mesh = sharding.make_mesh("data=2,tensor=2,expert=2")
    assert dict(mesh.shape) == {"data": 2, "expert": 2, "tensor": 2}
    with pytest.raises(MeshError, match=r"needs 6 devices .* 8 are available"):
        sharding.make_mesh("data=3,tensor=2")
    with pytest.raises(MeshError, match=r"unknown axis 'model'.*data, expert, tensor"):
        sharding.make_mesh("model=8")
    with pytest.raises(MeshError, match="not an integer"):
        sharding.make_mesh("tensor=two")
    with pytest.raises(MeshError, match="given twice"):
        sharding.make_mesh("tensor=2,tensor=4")
    with pytest.raises(MeshError, match="at most one axis may be -1"):
        sharding.make_mesh("tensor=-1,expert=-1")
    with pytest.raises(MeshError, match="'axis=size'"):
        sharding.make_mesh("tensor")


def test_mesh_must_divide_the_model(tmp_path):
    cfg = dsv3_jax.ModelConfig.preset("tiny")  # 4 heads, 16 experts, vocab 129280
    with pytest.raises(MeshError, match="tensor=8 does not divide num_attention_heads=4"):
        sharding.validate(cfg, sharding.make_mesh("tensor=8"))
    with pytest.raises(MeshError, match="expert=3 does not divide n_routed_experts=16"):
        sharding.validate(cfg, {"data": 1, "tensor": 1, "expert": 3})
    with pytest.raises(MeshError, match="vocab_size=1001"):
        sharding.validate(cfg.replace(vocab_size=1001), {"data": 1, "tensor": 2, "expert": 1})
    # load() refuses before reading weights: the 4-head model on tensor=8.
    dst = save_hf(make_hf_model("lora_yarn"), tmp_path / "m")
    with pytest.raises(MeshError, match="num_attention_heads=4"):
        dsv3_jax.load(dst, mesh="tensor=8")
    with pytest.raises(MeshError, match="needs 4 devices"):
        dsv3_jax.load(dst, mesh="tensor=4")


def test_rules_table_covers_every_parameter():
    """Every leaf of the model (bf16 and FP8 trees, with MTP) has logical axes of the right rank."""
    from dsv3_jax import plan

    cfg = dsv3_jax.ModelConfig.preset("tiny")
    for dt in ("bf16", "fp8"):
        specs = sharding.param_specs(plan.param_shapes(cfg, dt))
        assert specs["moe_layers"]["mlp"]["gate_proj_weight"] == jax.sharding.PartitionSpec(
            None, "expert", "tensor", None)
    with pytest.raises(KeyError, match="PARAM_AXES"):
        layout.param_axes("moe_layers/mlp/new_thing", 2)
    handle_like = dataclasses.make_dataclass("X", [("shape", tuple)])
    assert sharding.param_specs({"norm": {"weight": handle_like((4,))}})["norm"]["weight"] == \
        jax.sharding.PartitionSpec(None)
