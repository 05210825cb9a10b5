"""q_a and kv_a fused at load (model/qkv_a.py): the fused rows hold the checkpoint's numbers, the model
reads either form to the same logits, a handle holds the fused form (replicated on a mesh), configs the
fusion cannot take keep the two linears, and the planner counts the padding.

Bounds: the fusion is a concatenation, so rows are compared bit for bit. Forwards through one GEMM
instead of two sum the same products in the same order per output (each output column is its own dot
over K); fp32 logits agree to a few ulps of the largest (1e-5 relative is ~80 ulps), far below a wrong
row (a swapped q_a / kv_a moves logits by O(1)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax import plan
from dsv3_jax.api import ModelHandle
from dsv3_jax.config import ModelConfig
from dsv3_jax.formats.quantize import quantize_params
from dsv3_jax.model import inference_form, kv_b, layout, qkv_a
from dsv3_jax.model.transformer import Transformer
from dsv3_jax.parallel import sharding
from pallas_kernels import fp8_gemm
from tests import tiny_models

CFG = tiny_models.CFG
# q_lora_rank a whole number of 128-row scale blocks (as DeepSeek-V3's 1536), latent 256 + rope
FP8_CFG = tiny_models.FP8_BASE.replace(q_lora_rank=256)
_init, _tokens = tiny_models.init, tiny_models.tokens


def _close(got, ref) -> None:
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_rows_hold_the_checkpoint_numbers(fp8):
    cfg = FP8_CFG if fp8 else CFG
    _, params = _init(cfg, fp8)
    fused = qkv_a.fuse(params, cfg)
    q, lat = cfg.q_lora_rank, cfg.latent_dim
    rows = qkv_a.width(cfg, fp8)
    assert rows == (-(-(q + lat) // fp8_gemm.N_ALIGN) * fp8_gemm.N_ALIGN if fp8 else q + lat)
    for stack in (layout.DENSE_LAYERS, layout.MOE_LAYERS):
        attn, old = fused[stack]["self_attn"], params[stack]["self_attn"]
        assert qkv_a.Q_A not in attn and qkv_a.KV_A not in attn
        w = np.asarray(attn[qkv_a.QKV_A]["weight"].astype(jnp.float32))
        assert w.shape[-2] == rows
        q_a, kv_a = (np.asarray(old[n]["weight"].astype(jnp.float32)) for n in (qkv_a.Q_A, qkv_a.KV_A))
        np.testing.assert_array_equal(w[:, :q], q_a)
        np.testing.assert_array_equal(w[:, q:q + lat], kv_a)
        assert not w[:, q + lat:].any()  # the padding rows are zeros
        if fp8:
            s = np.asarray(attn[qkv_a.QKV_A]["scale"])
            qb = q // 128
            np.testing.assert_array_equal(s[:, :qb], np.asarray(old[qkv_a.Q_A]["scale"]))
            kb = old[qkv_a.KV_A]["scale"].shape[-2]
            np.testing.assert_array_equal(s[:, qb:qb + kb], np.asarray(old[qkv_a.KV_A]["scale"]))
            assert s.shape[-2] == rows // 128 and (s[:, qb + kb:] == 1).all()
        for name in attn:  # every other leaf is the very same array
            if name != qkv_a.QKV_A:
                assert attn[name] is old[name]
    assert qkv_a.QKV_A in fused[layout.MTP]["block"]["self_attn"]
    again = qkv_a.fuse(fused, cfg)
    assert jax.tree.leaves(again) == jax.tree.leaves(fused)  # idempotent, no new arrays


@pytest.mark.parametrize("attention", ["absorbed", "naive"])
def test_both_forms_give_the_same_logits(attention):
    _, params = _init(CFG)
    model = Transformer(CFG, form=attention)
    toks = _tokens(CFG)
    ref = model.apply({"params": params}, toks)[0]
    _close(model.apply({"params": qkv_a.fuse(params, CFG)}, toks)[0], ref)


def test_fp8_model_reads_the_fused_form_to_the_same_logits():
    model, params = _init(FP8_CFG, fp8=True)
    toks = _tokens(FP8_CFG)
    ref = model.apply({"params": params}, toks)[0]
    _close(model.apply({"params": inference_form.prepare(params, FP8_CFG, jnp.float32)}, toks)[0], ref)


def test_fp8_without_whole_scale_blocks_keeps_two_linears(caplog):
    cfg = FP8_CFG.replace(q_lora_rank=192)
    model, params = _init(cfg, fp8=True)
    with caplog.at_level("INFO", logger="dsv3_jax.model.qkv_a"):
        qkv_a._log_not_fused.cache_clear()
        same = qkv_a.fuse(params, cfg)
    assert same is params and "stay two linears" in caplog.text
    assert qkv_a.fuse_shapes(params, cfg) is params
    toks = _tokens(cfg, 8)
    _close(model.apply({"params": same}, toks)[0], model.apply({"params": params}, toks)[0])


def test_no_q_lora_has_nothing_to_fuse():
    cfg = CFG.replace(q_lora_rank=None)
    _, params = _init(cfg)
    assert qkv_a.fuse(params, cfg) is params


def test_a_handle_holds_the_fused_form_replicated():
    _, params = _init(CFG)
    mesh = sharding.make_mesh({"tensor": 2}, jax.devices()[:2])
    sh = sharding.param_shardings(CFG, mesh, params)
    h = ModelHandle(CFG, jax.device_put(params, sh), mesh=mesh, param_shardings=sh)
    fused = h.params[layout.MOE_LAYERS]["self_attn"][qkv_a.QKV_A]["weight"]
    assert fused.sharding.spec == jax.sharding.PartitionSpec(None, None, None)
    assert h.param_shardings[layout.MOE_LAYERS]["self_attn"][qkv_a.QKV_A]["weight"] == fused.sharding
    toks = np.asarray(_tokens(CFG))
    _close(h.forward(toks), Transformer(CFG).apply({"params": params}, jnp.asarray(toks))[0])


@pytest.mark.parametrize("fp8", [False, True])
def test_shapes_are_the_arrays_shapes(fp8):
    cfg = FP8_CFG if fp8 else CFG
    _, params = _init(cfg, fp8)
    got = inference_form.shapes(params, cfg, jnp.float32)
    want = inference_form.prepare(params, cfg, jnp.float32)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)


def test_default_tilings_never_pad_an_aligned_weight():
    configs = [v for v in vars(fp8_gemm).values() if isinstance(v, fp8_gemm.Fp8GemmConfig)]
    assert len(configs) >= 4
    for c in configs:
        assert fp8_gemm.N_ALIGN % (c.tile_n * c.cluster_n) == 0, c


def test_the_planner_counts_the_padding():
    cfg = ModelConfig.preset("deepseek-v3")
    sizes = dict.fromkeys(sharding.AXES, 1)
    stored = plan.param_layout(cfg, "fp8")
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    pad_rows = qkv_a.width(cfg, True) - cfg.q_lora_rank - cfg.latent_dim
    assert pad_rows > 0  # 2,112 rows padded to 2,304
    k_blocks = -(-cfg.hidden_size // 128)
    extra_blocks = qkv_a.width(cfg, True) // 128 - (cfg.q_lora_rank // 128 + -(-cfg.latent_dim // 128))
    padding = layers * (pad_rows * cfg.hidden_size + extra_blocks * k_blocks * 4)
    split = layout.tree_nbytes(kv_b.split_shapes(stored, cfg, jnp.bfloat16))
    got = plan.plan(cfg, sizes, dtype="fp8", device_memory="2000GB")
    assert got.weight_bytes_total == split + padding


def test_a_float_fused_tree_quantized_runs_as_fp8():
    """quantize_params over a handle's float tree (fused unpadded) gives an FP8 tree the model reads at its
    stored width. Bound: e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4 a weight, averaging out
    over the sums), so FP8 logits stay within 10% of the largest float logit; a row of q_a read as kv_a
    (or the reverse) moves them by O(1)."""
    model, params = _init(CFG)
    fused = qkv_a.fuse(params, CFG)
    q = quantize_params(fused)
    w = q[layout.MOE_LAYERS]["self_attn"][qkv_a.QKV_A]["weight"]
    assert w.dtype == jnp.float8_e4m3fn and w.shape[-2] == CFG.q_lora_rank + CFG.latent_dim
    toks = _tokens(CFG, 8)
    ref = model.apply({"params": params}, toks)[0]
    got = Transformer(CFG, fp8=True).apply({"params": q}, toks)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0,
                               atol=0.1 * float(jnp.max(jnp.abs(ref))))


def test_the_fused_fp8_linear_in_the_kernel_gives_both_outputs():
    """The Pallas FP8 GEMM (interpreted here) over the fused, padded weight gives q_a's and kv_a's outputs
    as the reference gives them from the two linears. Bound: both accumulate the same e4m3 products in
    fp32 per 128-wide K block and round the output to bf16 once; the kernel may split K differently at
    a different N (fp32 partial sums added in another order, ~1e-7 relative), so the outputs agree to
    one bf16 rounding step (2^-8 relative) of the largest output."""
    from pallas_kernels import fp8_reference

    _, params = _init(FP8_CFG, fp8=True)
    attn = params[layout.MOE_LAYERS]["self_attn"]
    fused = qkv_a.fuse(params, FP8_CFG)[layout.MOE_LAYERS]["self_attn"][qkv_a.QKV_A]
    x = jax.random.normal(jax.random.key(2), (3, FP8_CFG.hidden_size), jnp.bfloat16)
    got = fp8_gemm.fp8_linear(x, fused["weight"][0], fused["scale"][0], interpret=True)
    q_out, kv_out = qkv_a.split_output(got, FP8_CFG)
    for out, name in ((q_out, qkv_a.Q_A), (kv_out, qkv_a.KV_A)):
        ref = fp8_reference.fp8_linear_reference(x, attn[name]["weight"][0], attn[name]["scale"][0],
                                                 out_dtype=jnp.bfloat16)
        ref32 = np.asarray(ref.astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref32, rtol=0,
                                   atol=2.0 ** -8 * float(np.abs(ref32).max()))
    assert not np.asarray(got[:, FP8_CFG.q_lora_rank + FP8_CFG.latent_dim:].astype(jnp.float32)).any()
