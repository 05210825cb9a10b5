"""The engine's page pool sized by the planner: tiny models on the 8 virtual devices with a declared device
memory get the page counts the plan says, each device holds exactly its shard's slice, and a request that
cannot fit is refused with the numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dsv3_jax import plan
from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kv_cache, layout
from dsv3_jax.parallel import sharding
from tests.mesh_models import MESH_CONFIGS  # noqa: F401  (the mesh-sized test configs)

TINY = ModelConfig.preset("tiny")


@pytest.mark.parametrize("spec", ["tensor=2,expert=4", "data=2,tensor=2,expert=2", "data=8"])
def test_pool_pages_match_the_plan_and_the_devices(spec):
    frac, act = 0.5, 3 * 2**20
    w = plan.plan(TINY, spec, dtype="fp32", device_memory="1GB", reserve=0)
    # One page of every layer, the tiny model's absorbed latent, fp32, on one device.
    page_b = layout.bytes_per_token(TINY, "absorbed", jnp.float32) * 16
    mem = int((w.weight_bytes_per_device + act + 70.5 * page_b) / frac)  # room for 70 whole pages
    p = plan.pool_plan(TINY, spec, dtype="fp32", max_model_len=512, device_memory=mem, memory_fraction=frac,
                       page_size=16, activation_bytes=act, cache_dtype=jnp.float32)
    assert p.pages_per_shard == 70
    assert p.page_bytes_per_device == page_b  # split by pages, replicated over tensor: whole pages
    assert p.pages_per_shard == (int(frac * mem) - w.weight_bytes_per_device - act) // page_b
    assert p.batch_shards == sharding.batch_multiple(sharding.make_mesh(spec)) and p.activations_measured
    assert p.max_requests_per_shard == (p.pages_per_shard - 1) // 32
    # The pool the engine allocates from this plan: each device holds one slice, within the budget.
    mesh = sharding.make_mesh(spec)
    cache = kv_cache.allocate(TINY, p.num_pages, 16, dtype=jnp.float32)
    placed = jax.device_put(cache, sharding.cache_shardings(TINY, mesh, cache))
    for dev in jax.devices():
        on_dev = sum(s.data.nbytes for x in jax.tree.leaves(placed) for s in x.addressable_shards
                     if s.device == dev)
        assert on_dev == p.kv_bytes_per_device <= frac * mem - w.weight_bytes_per_device - act
    assert "requests per shard / total" in p.summary()


def test_estimated_activations_grow_with_the_step():
    small = plan.pool_plan(TINY, "expert=8", dtype="fp32", max_model_len=512, device_memory="1GB",
                           max_batched_tokens=64)
    big = plan.pool_plan(TINY, "expert=8", dtype="fp32", max_model_len=512, device_memory="1GB",
                         max_batched_tokens=4096)
    assert not small.activations_measured
    assert big.activation_bytes_per_device > small.activation_bytes_per_device
    assert big.pages_per_shard < small.pages_per_shard


def test_the_long_prefill_path_reserves_its_block():
    """An engine running the naive-form long-prefill path reserves its transient K/V block: exactly
    long_prefill.transient_bytes at the device's heads, fewer pages for it."""
    from dsv3_jax.model import long_prefill

    kw = dict(dtype="fp32", max_model_len=512, device_memory="1GB", max_batched_tokens=64)
    plain = plan.pool_plan(TINY, "tensor=2,expert=4", **kw)
    long = plan.pool_plan(TINY, "tensor=2,expert=4", long_prefill=True, **kw)
    extra = long_prefill.transient_bytes(TINY.num_attention_heads // 2, TINY.qk_head_dim, TINY.v_head_dim,
                                         64, 512)
    assert long.activation_bytes_per_device - plain.activation_bytes_per_device == extra > 0
    assert long.pages_per_shard < plain.pages_per_shard


def test_refuses_when_one_request_cannot_fit():
    w = plan.plan(TINY, "expert=8", dtype="fp32", device_memory="1GB", reserve=0)
    page_b = layout.bytes_per_token(TINY, "absorbed", jnp.float32) * 64
    # Room for scratch + 7 pages, but a 512-token request needs 8.
    mem = w.weight_bytes_per_device + 8 * page_b
    with pytest.raises(plan.PlanError, match=r"no room for one 512-token request: .* 7 usable pages, but one "
                                             r"request needs 8 pages"):
        plan.pool_plan(TINY, "expert=8", dtype="fp32", max_model_len=512, device_memory=mem,
                       memory_fraction=1.0, activation_bytes=0, cache_dtype=jnp.float32)
    ok = plan.pool_plan(TINY, "expert=8", dtype="fp32", max_model_len=448, device_memory=mem,
                        memory_fraction=1.0, activation_bytes=0, cache_dtype=jnp.float32)
    assert ok.pages_per_shard == 8 and ok.max_requests == 8  # one 7-page request on each of 8 shards
    with pytest.raises(ValueError, match="memory fraction"):
        plan.pool_plan(TINY, "expert=8", max_model_len=64, device_memory="1GB", memory_fraction=1.5)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        plan.pool_plan(TINY, "expert=8", max_model_len=10**7, device_memory="1GB")


def test_v3_on_one_host():
    """DeepSeek-V3 FP8 on 8 H200s, 32K requests: DP attention holds ~3.5x the requests of tensor=8
    although each device keeps fewer KV bytes (the replicated attention weights), since the pool splits."""
    v3 = ModelConfig.preset("deepseek-v3")
    kw = dict(dtype="fp8", max_model_len=32768, device_memory="141GB", max_batched_tokens=2048, max_batch=64)
    tp, ep = plan.pool_plan(v3, "tensor=8", **kw), plan.pool_plan(v3, "expert=8", **kw)
    assert tp.page_bytes_per_device == ep.page_bytes_per_device == 70_272 * 64
    assert tp.kv_bytes_per_device > ep.kv_bytes_per_device and ep.max_requests > 3 * tp.max_requests


def test_engine_pool_sized_by_the_plan(tmp_path):
    """The CLI's sizing (parallel_cli.engine_defaults) on a loaded tiny model with a declared device memory:
    the engine gets exactly the plan's pages, each device holds the plan's KV bytes."""
    import argparse

    import dsv3_jax
    from dsv3_jax.engine.core import Engine, EngineConfig
    from dsv3_jax.parallel import flags as parallel_cli
    from tests.hf_reference import make_hf_model, save_hf

    handle = dsv3_jax.load(save_hf(make_hf_model("h8e16"), tmp_path / "m"), mesh="data=2,tensor=2,expert=2")
    args = argparse.Namespace(device_memory=None, max_model_len=128, memory_fraction=0.9, max_batch=8,
                              max_batched_tokens=64)
    assert parallel_cli.engine_defaults(handle, args) == {"max_batch": 8, "max_batched_tokens": 64}  # CPU
    w = plan.plan(handle.config, handle.mesh, dtype="fp32", device_memory="1GB", reserve=0,
                  params_or_shapes=handle.params)
    args.device_memory = str(int((w.weight_bytes_per_device + 50 * 2**20) / 0.9))  # ~50 MB left per device
    p = parallel_cli.engine_plan(handle, args)
    got = parallel_cli.engine_defaults(handle, args)
    assert got["num_pages"] == p.num_pages and p.pages_per_shard > 1 + p.pages_per_request
    assert p.batch_shards == 4 and p.num_pages == 4 * p.pages_per_shard
    eng = Engine(handle, EngineConfig(page_size=kv_cache.PAGE_SIZE, **got))
    assert eng.pool.num_pages == p.num_pages and eng.pool.shards == 4
    per_dev = sum(s.data.nbytes for x in jax.tree.leaves(eng.executor.cache) for s in x.addressable_shards
                  if s.device == jax.devices()[0])
    assert per_dev == p.kv_bytes_per_device


def test_cli_plan_counts_the_fp8_cache_as_read_by_the_kernel():
    """The CLIs' pool (parallel_cli.engine_plan) reserves attention scores over the context only where the
    jnp reference reads the cache: an FP8 cache goes to the FP8-page kernel as a bf16 one goes to the bf16
    kernel, so both plans reserve the same activations and the FP8 pool holds >= 1.7x the tokens. Before,
    the FP8 plan reserved scores at 163,840 tokens (the 5-layer slice, one 141 GB device: ~170 GB), and the
    CLIs refused to start."""
    import argparse
    from types import SimpleNamespace

    from dsv3_jax import api
    from dsv3_jax.parallel import flags as parallel_cli

    cfg = ModelConfig.preset("deepseek-v3").replace(num_hidden_layers=5, first_k_dense_replace=1,
                                                   num_nextn_predict_layers=0)

    def handle(kernels="pallas", attention="absorbed", config=cfg):
        options = SimpleNamespace(kernels=kernels)
        return SimpleNamespace(config=config, attention=attention, mesh=None,
                               params=api._planned_shapes(config), trace_options=options)

    assert parallel_cli.attention_kernel_serves(handle(), "fp8")
    assert parallel_cli.attention_kernel_serves(handle(), "bf16")
    assert not parallel_cli.attention_kernel_serves(handle(kernels="reference"), "fp8")
    assert not parallel_cli.attention_kernel_serves(handle(attention="naive"), "bf16")
    assert not parallel_cli.attention_kernel_serves(handle(config=TINY), "fp8")  # widths the kernel refuses
    assert not parallel_cli.attention_kernel_serves(handle(config=cfg.replace(dtype="float32")), "auto")

    plans = {}
    for dt in ("bf16", "fp8"):
        args = argparse.Namespace(device_memory="141GB", max_model_len=163840, memory_fraction=0.9,
                                  max_batch=None, max_batched_tokens=None, kv_cache_dtype=dt,
                                  long_prefill_from=0)
        plans[dt] = parallel_cli.engine_plan(handle(), args)
    bf16, fp8 = plans["bf16"], plans["fp8"]
    assert fp8.activation_bytes_per_device == bf16.activation_bytes_per_device < 4e9
    assert fp8.kv_tokens_per_shard >= 1.7 * bf16.kv_tokens_per_shard
    assert fp8.max_requests >= 1.7 * bf16.max_requests >= 1.7


def test_cli_plan_follows_the_engine_default_for_long_prefill():
    """A CLI without --long-prefill-from (generate) plans the engine's default: the naive-form block is
    reserved when --max-model-len passes EngineConfig.long_prefill_from, and not below it (no sequence reaches
    the path there, so the engine compiles nothing for it)."""
    import argparse
    from types import SimpleNamespace

    from dsv3_jax import api
    from dsv3_jax.engine.api import EngineConfig
    from dsv3_jax.parallel import flags as parallel_cli

    cfg = ModelConfig.preset("deepseek-v3").replace(num_hidden_layers=5, first_k_dense_replace=1,
                                                   num_nextn_predict_layers=0)
    h = SimpleNamespace(config=cfg, attention="absorbed", mesh=None, params=api._planned_shapes(cfg),
                        trace_options=SimpleNamespace(kernels="pallas"))
    assert EngineConfig.long_prefill_from > 0

    def activations(max_model_len: int, **flag: int) -> int:
        args = argparse.Namespace(device_memory="141GB", max_model_len=max_model_len, memory_fraction=0.9,
                                  max_batch=None, max_batched_tokens=None, kv_cache_dtype="bf16", **flag)
        return parallel_cli.engine_plan(h, args).activation_bytes_per_device

    long_len = 4 * EngineConfig.long_prefill_from
    assert activations(long_len) > activations(long_len, long_prefill_from=0)
    assert activations(long_len) == activations(long_len, long_prefill_from=EngineConfig.long_prefill_from)
    short = EngineConfig.long_prefill_from
    assert activations(short) == activations(short, long_prefill_from=0)
