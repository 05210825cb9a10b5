"""The memory planner: DeepSeek-V3 numbers against a hand calculation, tiny models against the bytes really
placed on the 8 virtual devices, load() refusing a plan that cannot fit, the CLI."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax import plan
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kv_cache
from dsv3_jax.model.transformer import Transformer
from dsv3_jax.parallel import sharding
from tests.hf_reference import make_hf_model, save_hf
from tests.mesh_models import MESH_CONFIGS

V3 = ModelConfig.preset("deepseek-v3")


def test_v3_kv_cache_matches_hand_calculation():
    p = plan.plan(V3, "expert=8", dtype="fp8", max_seq_len=128 * 1024, device_memory="141GB")
    assert p.kv_bytes_per_token == 576 * 2 * 61 == 70_272  # [c ; k_rope] x bf16 x layers
    assert round(p.kv_bytes_per_token / 1024, 1) == 68.6  # "~68.6 KB/token"
    assert p.kv_bytes_per_request == 70_272 * 131_072 == 9_210_691_584
    assert round(p.kv_bytes_per_request / 2**30, 1) == 8.6  # "~8.6 GB per 128K request"
    free = 141 * 10**9 - int(0.10 * 141 * 10**9) - p.weight_bytes_per_device
    assert p.free_bytes_per_device == free
    assert p.tokens_per_device == free // 70_272
    assert p.requests_per_device == free // 9_210_691_584
    assert p.batch_shards == 8 and p.requests_total == 8 * p.requests_per_device


def _v3_bf16_bytes() -> dict[str, int]:
    """DeepSeek-V3 (with its MTP layer) by hand: what `tensor` splits, what `expert` splits, the total."""
    d, v, h = 7168, 129280, 128
    layers = 61 + 1  # + MTP
    moe_layers = 58 + 1
    routed = moe_layers * 256 * 3 * d * 2048
    by_tensor = (4 * v * d  # embed + head, MTP embed + head (vocabulary-parallel)
                 + layers * (1536 * h * 192 + 512 * h * 256 + h * 128 * d)  # q_b, kv_b, o
                 + 3 * 3 * d * 18432  # dense MLPs
                 + moe_layers * 3 * d * 2048  # shared experts
                 + routed)  # routed experts' FFN width
    total = 2 * V3.param_count(include_mtp=True) + 2 * moe_layers * 256  # router bias kept fp32
    return {"total": total, "routed": 2 * routed, "by_tensor": 2 * by_tensor}


@pytest.mark.parametrize("spec", ["expert=8", "tensor=8", "data=2,tensor=4,expert=2"])
def test_v3_weights_per_device_match_hand_calculation(spec):
    hand = _v3_bf16_bytes()
    s = sharding.parse_mesh_spec(spec)
    t, e = s["tensor"], s["expert"]
    # Routed experts are split by expert x tensor; the rest of `by_tensor` by tensor; the rest replicated.
    per_dev = (hand["total"] - hand["by_tensor"] + (hand["by_tensor"] - hand["routed"]) // t
               + hand["routed"] // (t * e))
    p = plan.plan(V3, spec, dtype="bf16", max_seq_len=4096, device_memory="141GB")
    assert p.weight_bytes_total == hand["total"]
    assert p.weight_bytes_per_device == per_dev


def test_v3_fits_only_where_it_should():
    bf16 = plan.plan(V3, "expert=8", dtype="bf16", max_seq_len=131072, device_memory="141GB")
    assert not bf16.fits and bf16.weight_bytes_per_device > 141e9  # 1.37 TB does not fit on 8 H200s
    with pytest.raises(plan.PlanError, match=r"does not fit: per device 204\.9\d GB"):
        bf16.check()
    fp8 = plan.plan(V3, "tensor=8", dtype="fp8", max_seq_len=131072, device_memory="141GB")
    assert fp8.fits and fp8.requests_per_device >= 1
    fp8.check()
    assert plan.plan(V3, "data=2,expert=8", dtype="bf16", max_seq_len=131072, device_memory="141GB").fits \
        is False  # data parallelism does not split weights
    assert plan.plan(V3, "tensor=2,expert=8", dtype="bf16", max_seq_len=131072, device_memory="141GB").fits


def test_tiny_plan_matches_bytes_on_devices(tmp_path):
    """Loaded HF checkpoint (no MTP) and a directly initialized tiny preset (with MTP), on 8 devices."""
    dst = save_hf(make_hf_model("h8e16"), tmp_path / "m")
    handle = dsv3_jax.load(dst, mesh="data=2,tensor=2,expert=2")
    p = plan.plan(handle.config, handle.mesh, dtype="fp32", device_memory="1GB",
                  params_or_shapes=handle.params)
    for dev in jax.devices():
        assert _bytes_on(handle.params, dev) == p.weight_bytes_per_device

    cfg = ModelConfig.preset("tiny")
    mesh = sharding.make_mesh("tensor=2,expert=4")
    model = Transformer(cfg, jnp.float32)
    init = lambda k: model.init(k, jnp.zeros((1, 1), jnp.int32), method=model.init_all)["params"]  # noqa: E731
    sh = sharding.param_shardings(cfg, mesh, jax.eval_shape(init, jax.random.key(0)))
    params = jax.jit(init, out_shardings=sh)(jax.random.key(0))
    p = plan.plan(cfg, "tensor=2,expert=4", dtype="fp32", device_memory="1GB")
    assert _bytes_on(params, jax.devices()[0]) == p.weight_bytes_per_device
    assert p.weight_bytes_total == sum(x.nbytes for x in jax.tree.leaves(params))

    # The KV cache: batch / pages split over data x expert, replicated over tensor.
    if hasattr(kv_cache, "PageMeta"):
        cache = kv_cache.allocate(cfg, num_pages=16, page_size=8, dtype=jnp.bfloat16)
    else:
        cache = kv_cache.allocate(cfg, batch=8, max_len=16, dtype=jnp.bfloat16)
    placed = jax.device_put(cache, sharding.cache_shardings(cfg, mesh, cache))
    per_dev = plan.cache_bytes_per_device(cache, sharding.axis_sizes(mesh))
    assert _bytes_on(placed, jax.devices()[3]) == per_dev
    assert per_dev * 4 == sum(x.nbytes for x in jax.tree.leaves(cache))


def _bytes_on(tree, device) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == device)


def test_load_refuses_a_plan_that_cannot_fit(tmp_path):
    dst = save_hf(make_hf_model("h8e8"), tmp_path / "m")
    with pytest.raises(plan.PlanError, match=r"does not fit: per device .* weights"):
        dsv3_jax.load(dst, mesh="expert=8", device_memory="200KB", max_seq_len=256)
    # Weights fit, but not one 256-token request: memory = weights + reserve + half a request.
    cfg = ModelConfig.from_json(dst / "config.json")
    p = plan.plan(cfg, "expert=8", dtype="fp32", max_seq_len=256, device_memory="1GB")
    tight = int((p.weight_bytes_per_device + p.kv_bytes_per_request // 2) / 0.9)
    with pytest.raises(plan.PlanError, match=r"one 256-token request needs .* short"):
        dsv3_jax.load(dst, mesh="expert=8", device_memory=tight, max_seq_len=256)
    h = dsv3_jax.load(dst, mesh="expert=8", device_memory="1GB", max_seq_len=256)
    assert h.param_shardings is not None and MESH_CONFIGS["h8e8"]["n_routed_experts"] == 8


def test_parse_bytes_and_cli(capsys):
    assert plan.parse_bytes("141GB") == 141 * 10**9
    assert plan.parse_bytes("139GiB") == 139 * 2**30
    assert plan.parse_bytes("1.5 kb") == 1500
    with pytest.raises(ValueError, match="141GB"):
        plan.parse_bytes("lots")
    rc = plan.main(["--config", "deepseek-v3", "--mesh", "expert=8", "--dtype", "fp8", "--max-seq-len",
                    "131072", "--device-memory", "141GB"])
    out = capsys.readouterr().out
    assert rc == 0 and "70,272 B" in out and "fits" in out and "yes" in out
    assert plan.main(["--mesh", "expert=8", "--dtype", "bf16", "--device-memory", "141GB"]) == 1
    assert "NO" in capsys.readouterr().out
    assert plan.main(["--mesh", "expert=7", "--device-memory", "141GB"]) == 2
    assert "does not divide n_routed_experts=256" in capsys.readouterr().err
    assert np.isfinite(plan.plan(V3, {"expert": 8}, device_memory=10**12).tokens_total)
