"""Config: presets, derived sizes, HF parsing (both rope spellings), validation errors naming the field."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from dsv3_jax.config import ConfigError, ModelConfig
from dsv3_jax.model import layout


def test_deepseek_v3_sizes():
    c = ModelConfig.preset("deepseek-v3")
    total = c.param_count()
    active = c.param_count(activated=True)
    assert 670e9 < total < 672e9, total  # "671B"
    assert 36.5e9 < active < 38e9, active  # "37B activated"
    assert layout.bytes_per_token(c, "absorbed", jnp.bfloat16) == 576 * 2 * 61 == 70_272
    assert layout.bytes_per_token(c, "naive", jnp.bfloat16) == 128 * (192 + 128) * 2 * 61
    assert 13e9 < c.mtp_params() < 15e9  # the MTP module (~14B beside the 671B)
    # 128K-token request in the absorbed cache: the seeds' ~8.6 GB.
    assert abs(layout.bytes_per_token(c) * 131072 / 1e9 - 9.2) < 0.1  # 9.21 GB = 8.58 GiB
    assert 1.3e12 < c.weight_bytes("bf16") < 1.4e12  # "1.34 TB" BF16
    assert 0.65e12 < c.weight_bytes("fp8") < 0.72e12  # "~0.7 TB" FP8


def test_softmax_scale_has_mscale_squared():
    c = ModelConfig.preset("deepseek-v3")
    m = 0.1 * 1.0 * __import__("math").log(40) + 1.0
    assert c.softmax_scale == pytest.approx(192**-0.5 * m * m)


def _hf_dict():
    return ModelConfig.preset("deepseek-v3").to_hf_dict()


def test_hf_round_trip_and_rope_parameters_spelling():
    d = _hf_dict()
    assert ModelConfig.from_hf_dict(d) == ModelConfig.preset("deepseek-v3")
    newer = dict(d)
    rs = newer.pop("rope_scaling")
    newer["rope_parameters"] = {**rs, "rope_theta": 50000.0}
    newer["rope_interleave"] = False
    c = ModelConfig.from_hf_dict(newer)
    assert c.rope_theta == 50000.0 and not c.rope_interleave
    assert c.rope_scaling.factor == 40 and c.rope_scaling.beta_fast == 32


def test_quantization_config_is_read():
    d = _hf_dict()
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
    c = ModelConfig.from_hf_dict(d)
    assert c.quantization.scale_fmt == "ue8m0" and c.quantization.weight_block_size == (128, 128)
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict()))) == c


@pytest.mark.parametrize("change, field", [
    ({"n_routed_experts": 250}, "n_routed_experts"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok"),  # 4 groups x 32 experts = 128 left
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"quantization_config": {"fmt": "e5m2"}}, "quantization_config.fmt"),
])
def test_bad_fields_are_named(change, field):
    d = {**_hf_dict(), **change}
    with pytest.raises(ConfigError, match=f"`{field}`"):
        ModelConfig.from_hf_dict(d)


def test_missing_required_field_is_named():
    d = _hf_dict()
    del d["kv_lora_rank"]
    with pytest.raises(ConfigError, match="`kv_lora_rank`: missing"):
        ModelConfig.from_hf_dict(d)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        ModelConfig.preset("deepseek-v9")


def test_n_activated_experts_override_is_validated():
    c = ModelConfig.preset("tiny")
    assert c.replace(num_experts_per_tok=2).num_experts_per_tok == 2
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        c.replace(num_experts_per_tok=9)  # tiny keeps 2 groups x 4 experts = 8


def test_checkpoint_tensor_count_matches_the_seeds():
    from dsv3_jax.formats.hf_names import expected_hf_tensors

    names = expected_hf_tensors(ModelConfig.preset("deepseek-v3"))
    assert len(names) == 46_183
    assert sum(n.startswith("model.layers.") for n in names) == 46_180
