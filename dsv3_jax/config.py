"""Model configuration: every knob of DeepSeek-V3, read from HF `config.json` or a named preset.

Owns: the frozen `ModelConfig` dataclass, its validation (every field type- and range-checked, errors
name the field and the value), `generation_config.json`'s sampling fields (`read_generation_config`),
reading a JSON object file (`read_json_object`), presets, and the
derived sizes (parameter counts, weight bytes). The arrays' shapes and the KV-cache bytes per token
derive from model/layout.py. Must not touch arrays.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config field is missing, has the wrong type, or contradicts another field."""


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension (rope_scaling / rope_parameters with type "yarn")."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """The official FP8 format: e4m3 weights with one fp32 scale per 128x128 block."""

    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    scale_fmt: str | None = None  # "ue8m0" for V3.1's power-of-two scales


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 hyper-parameters (HF names). Defaults are the 671B model's values."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # dense MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size: int = 2048  # one routed / shared expert
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536  # None: q is one projection of x (the V2-Lite layout)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 163840
    rope_scaling: YarnScaling | None = dataclasses.field(default_factory=YarnScaling)
    rope_interleave: bool = True  # checkpoint rope dims are (re, im) pairs; HF permutes them
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    dtype: str = "bfloat16"
    quantization: QuantConfig | None = None

    # ---------------------------------------------------------------- derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def n_moe_layers(self) -> int:
        return self.num_hidden_layers - self.n_dense_layers

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer in the absorbed form: [c ; k_rope]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def yarn_mscale(self) -> float:
        """The attention-temperature factor whose square multiplies the softmax scale."""
        s = self.rope_scaling
        if s is None or s.factor <= 1.0:
            return 1.0
        return 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.yarn_mscale**2

    def attention_params(self) -> int:
        d, h = self.hidden_size, self.num_attention_heads
        if self.q_lora_rank is None:
            q = d * h * self.qk_head_dim
        else:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        kv = d * self.latent_dim + self.kv_lora_rank
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        o = h * self.v_head_dim * d
        return q + kv + o + 2 * d  # + the two per-layer RMSNorms

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def moe_layer_params(self, activated: bool = False) -> int:
        n = self.num_experts_per_tok if activated else self.n_routed_experts
        router = self.hidden_size * self.n_routed_experts + self.n_routed_experts
        return self.attention_params() + router + (n + self.n_shared_experts) * self.expert_params()

    def dense_layer_params(self) -> int:
        return self.attention_params() + 3 * self.hidden_size * self.intermediate_size

    def mtp_params(self, activated: bool = False) -> int:
        d = self.hidden_size
        # The checkpoint's MTP layer carries its own copies of the embedding and the head.
        per = 2 * self.vocab_size * d + 2 * d + 2 * d * d + self.moe_layer_params(activated) + d
        return self.num_nextn_predict_layers * per

    def param_count(self, *, activated: bool = False, include_mtp: bool = False) -> int:
        """Main-model parameters (671B for DeepSeek-V3); `activated`: those one token touches."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        n = embed + head + self.hidden_size
        n += self.n_dense_layers * self.dense_layer_params()
        n += self.n_moe_layers * self.moe_layer_params(activated)
        if include_mtp:
            n += self.mtp_params(activated)
        return n

    def weight_bytes(self, dtype: str = "bf16", *, include_mtp: bool = True) -> int:
        """Bytes of all weights; fp8 keeps norms, router and embeddings in bf16 as the official ckpt."""
        total = self.param_count(include_mtp=include_mtp)
        if dtype in ("bf16", "bfloat16"):
            return 2 * total
        if dtype in ("fp32", "float32"):
            return 4 * total
        if dtype != "fp8":
            raise ConfigError(f"weight_bytes: dtype must be bf16, fp32 or fp8, got {dtype!r}")
        # Quantized: the big linears (attention projections, MLPs, experts) at 1 byte + fp32 block scales.
        d = self.hidden_size
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        norms_router = self.num_hidden_layers * (2 * d + self.kv_lora_rank + (self.q_lora_rank or 0))
        norms_router += self.n_moe_layers * (d * self.n_routed_experts + self.n_routed_experts)
        linear = total - embed - norms_router - d
        scales = linear // (128 * 128) * 4
        return linear + scales + 2 * (total - linear)

    # ---------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        def need(cond: bool, field: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"config field `{field}`: {why}")

        # Types and ranges first (every field, so nothing below compares a string with a number).
        # Numpy numbers are accepted and stored as plain Python numbers (the dataclass stays hashable
        # and JSON-writable).
        def keep(f: str, v: Any) -> None:
            object.__setattr__(self, f, v)

        for f in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "n_group",
                  "topk_group", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            keep(f, _check_int(getattr(self, f), f, 1))
        for f in ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers", "bos_token_id",
                  "eos_token_id"):
            keep(f, _check_int(getattr(self, f), f, 0))
        if self.q_lora_rank is not None:
            keep("q_lora_rank", _check_int(self.q_lora_rank, "q_lora_rank", 1, "null or "))
        for f in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            keep(f, _check_float(getattr(self, f), f, positive=True))
        for f in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
            need(isinstance(getattr(self, f), bool), f, f"must be true or false, got {getattr(self, f)!r}")
        for f in ("topk_method", "scoring_func", "dtype"):
            need(isinstance(getattr(self, f), str), f, f"must be a string, got {getattr(self, f)!r}")

        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even (rotary pairs)")
        need(self.topk_method == "noaux_tc", "topk_method",
             f"only 'noaux_tc' (DeepSeek-V3) is supported, got {self.topk_method!r}")
        need(self.scoring_func == "sigmoid", "scoring_func",
             f"only 'sigmoid' (DeepSeek-V3) is supported, got {self.scoring_func!r}")
        need(self.n_routed_experts % self.n_group == 0, "n_routed_experts",
             f"{self.n_routed_experts} is not divisible by n_group={self.n_group}")
        need(self.topk_group <= self.n_group, "topk_group",
             f"topk_group={self.topk_group} is larger than n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        need(per_group >= 2, "n_group", f"each group needs >= 2 experts (top-2 group score), has {per_group}")
        left = self.topk_group * per_group
        need(self.num_experts_per_tok <= left, "num_experts_per_tok",
             f"{self.num_experts_per_tok} experts per token, but group selection keeps only "
             f"{left} (topk_group={self.topk_group} x {per_group} experts per group)")
        for f in ("bos_token_id", "eos_token_id"):
            need(getattr(self, f) < self.vocab_size, f,
                 f"{getattr(self, f)} is not a token id (vocab_size {self.vocab_size})")
        need(self.dtype in ("bfloat16", "float32", "float16"), "dtype",
             f"must be bfloat16, float16 or float32, got {self.dtype!r}")
        s = self.rope_scaling
        if s is not None:
            need(isinstance(s, YarnScaling), "rope_scaling", f"must be a YaRN setting, got {s!r}")
            for f in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                _check_float(getattr(s, f), f"rope_scaling.{f}", positive=False)
            _check_int(s.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings", 1)
            need(s.factor >= 1.0, "rope_scaling.factor", f"must be >= 1, got {s.factor}")
            need(s.beta_fast > s.beta_slow, "rope_scaling.beta_fast", "must be larger than beta_slow")
        q = self.quantization
        if q is not None:
            need(isinstance(q, QuantConfig), "quantization_config", f"must be an object, got {q!r}")
            need(q.fmt == "e4m3", "quantization_config.fmt", f"only e4m3 is supported, got {q.fmt!r}")
            wbs = q.weight_block_size
            need(isinstance(wbs, tuple | list) and tuple(wbs) == (128, 128)
                 and not any(isinstance(x, bool) for x in wbs), "quantization_config.weight_block_size",
                 f"only [128, 128] is supported, got {list(wbs) if isinstance(wbs, tuple) else wbs!r}")
            need(q.activation_scheme == "dynamic", "quantization_config.activation_scheme",
                 f"only 'dynamic' is supported, got {q.activation_scheme!r}")
            need(q.scale_fmt in (None, "ue8m0"), "quantization_config.scale_fmt",
                 f"must be null or 'ue8m0', got {q.scale_fmt!r}")

    # ---------------------------------------------------------------- construction
    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from an HF `config.json` dict (rope_scaling or rope_parameters spelling).

        Every field is type- and range-checked (ConfigError naming the field and the value).
        """
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        if mt is not None and mt != "deepseek_v3":
            raise ConfigError(f"config field `model_type`: expected 'deepseek_v3', got {mt!r}")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for f in required:
            if f not in d:
                raise ConfigError(f"config field `{f}`: missing from config.json")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "quantization", "dtype"}
        kw: dict[str, Any] = {k: d[k] for k in names if k in d}
        for f in ("eos_token_id", "bos_token_id"):
            if isinstance(kw.get(f), list):
                if not kw[f]:
                    raise ConfigError(f"config field `{f}`: an empty list names no token")
                kw[f] = kw[f][0]
        kw["rope_scaling"], theta = _parse_rope(d)
        if theta is not None:
            kw["rope_theta"] = theta
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        if not isinstance(dtype, str):
            raise ConfigError(f"config field `torch_dtype`: must be a string, got {dtype!r}")
        kw["dtype"] = dtype
        qc = d.get("quantization_config")
        if qc is not None and qc != {}:
            if not isinstance(qc, dict):
                raise ConfigError(f"config field `quantization_config`: must be an object, got {qc!r}")
            qm = qc.get("quant_method", "fp8")
            if qm != "fp8":
                raise ConfigError(f"config field `quantization_config.quant_method`: only 'fp8' (the "
                                  f"official block format) is supported, got {qm!r}")
            wbs = qc.get("weight_block_size", (128, 128))
            kw["quantization"] = QuantConfig(
                fmt=qc.get("fmt", "e4m3"),
                weight_block_size=tuple(wbs) if isinstance(wbs, list | tuple) else wbs,
                activation_scheme=qc.get("activation_scheme", "dynamic"),
                scale_fmt=qc.get("scale_fmt"),
            )
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf_dict(read_json_object(path, "config.json"))

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` spelling (rope_scaling form), readable by transformers."""
        d: dict[str, Any] = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
        for f in dataclasses.fields(self):
            if f.name in ("rope_scaling", "quantization", "dtype"):
                continue
            d[f.name] = getattr(self, f.name)
        d["torch_dtype"] = self.dtype
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", "rope_type": "yarn",
                                 **dataclasses.asdict(self.rope_scaling)}
        else:
            d["rope_scaling"] = None
        if self.quantization is not None:
            q = dataclasses.asdict(self.quantization)
            q["weight_block_size"] = list(q["weight_block_size"])
            if q["scale_fmt"] is None:
                del q["scale_fmt"]
            d["quantization_config"] = {"quant_method": "fp8", **q}
        return d

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return PRESETS[name]


def _parse_rope(d: dict[str, Any]) -> tuple[YarnScaling | None, float | None]:
    """Read `rope_scaling` (older) or `rope_parameters` (newer transformers)."""
    rp = d.get("rope_parameters")
    rs = d.get("rope_scaling")
    for name, v in (("rope_parameters", rp), ("rope_scaling", rs)):
        if v is not None and not isinstance(v, dict):
            raise ConfigError(f"config field `{name}`: must be an object or null, got {v!r}")
    src = rp if rp else rs
    theta = rp.get("rope_theta") if rp else None
    if not src:
        return None, theta
    kinds = {src[k] for k in ("rope_type", "type") if k in src}
    if len(kinds) > 1:
        raise ConfigError(f"config field `rope_scaling.type`: {src.get('type')!r} and rope_type "
                          f"{src.get('rope_type')!r} disagree")
    kind = kinds.pop() if kinds else "default"
    if kind == "default":
        return None, theta
    if kind != "yarn":
        raise ConfigError(f"config field `rope_scaling.type`: only 'yarn' is supported, got {kind!r}")
    fields = {f.name for f in dataclasses.fields(YarnScaling)}
    kw = {k: src[k] for k in fields if src.get(k) is not None}
    if "original_max_position_embeddings" not in kw:
        raise ConfigError("config field `rope_scaling.original_max_position_embeddings`: missing for yarn")
    return YarnScaling(**kw), theta


def _check_int(v: Any, field: str, lo: int, also: str = "") -> int:
    """`v` as a plain int (numpy integers accepted), or ConfigError naming the field and the value."""
    ok = not isinstance(v, bool | float | str) and hasattr(v, "__index__") and type(v).__name__ != "bool_"
    if not ok or operator.index(v) < lo:
        want = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ConfigError(f"config field `{field}`: must be {also}{want}, got {v!r}")
    return operator.index(v)


def _check_float(v: Any, field: str, *, positive: bool) -> float:
    """`v` as a plain float (ints and numpy numbers accepted), or ConfigError naming the field."""
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and type(v).__name__ != "bool_"
    if not ok or not math.isfinite(v) or (positive and v <= 0):
        want = "a finite number > 0" if positive else "a finite number"
        raise ConfigError(f"config field `{field}`: must be {want}, got {v!r}")
    return float(v)


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """Sampling defaults from a `generation_config.json` file, every field typed and range-checked.

    Returns the keys present among temperature, top_p, top_k, with `do_sample: false` mapped to
    temperature 0 (greedy), plus `eos_token_ids` (a list) when the file names an eos_token_id.
    ConfigError names the field and the value.
    """
    d = read_json_object(path, "generation_config.json")

    def bad(field: str, want: str) -> ConfigError:
        return ConfigError(f"generation_config.json field `{field}`: must be {want}, got {d[field]!r}")

    def number(field: str) -> float | None:
        v = d.get(field)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise bad(field, "a finite number")
        return float(v)

    out: dict[str, Any] = {}
    t, p = number("temperature"), number("top_p")
    if t is not None:
        if t < 0:
            raise bad("temperature", "a finite number >= 0")
        out["temperature"] = t
    if p is not None:
        if not 0 < p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        out["top_p"] = p
    k = d.get("top_k")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 2**31 - 1:
            raise bad("top_k", "an integer in [0, 2**31 - 1]")
        out["top_k"] = k
    ds = d.get("do_sample")
    if ds is not None and not isinstance(ds, bool):
        raise bad("do_sample", "true or false")
    if ds is False:
        out["temperature"] = 0.0
    eos = d.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
            raise bad("eos_token_id", "a token id or a non-empty list of them")
        out["eos_token_ids"] = list(ids)
    return out


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON object from a UTF-8 file (a BOM is tolerated); ConfigError naming the file otherwise."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if not path.is_file():
        raise ConfigError(f"{path}: {what} is not a regular file")
    try:
        d = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"{path}: unreadable ({e.strerror})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: {what} must hold a JSON object, got {type(d).__name__}")
    return d


PRESETS: dict[str, ModelConfig] = {
    "deepseek-v3": ModelConfig(),
    # Small enough for CPU tests and the demo, but every mechanism is on: q LoRA, 2 dense + 2 MoE layers,
    # 4 groups of 4 experts with top-2 groups, YaRN with a short original context, the MTP layer.
    "tiny": ModelConfig(
        vocab_size=129280,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=2048,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        bos_token_id=0,
        eos_token_id=1,
        dtype="float32",
    ),
}
