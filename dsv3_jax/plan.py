"""The memory planner: will this model fit on this mesh, and how much KV cache is left?

Owns: per-device byte counts derived from the *same* declarations the loader uses (parameter and cache
shapes, dtypes and logical axes from model/layout.py, never loaded or allocated; shard shapes through
sharding.LOGICAL_RULES), the KV budget (absorbed MLA cache: 576 values x 2 bytes x 61 layers = 70,272 B per
token for DeepSeek-V3, each device holding whole sequences because the cache is batch-sharded), the
`plan(...)` function `load()` calls to refuse a plan that cannot fit (its inputs checked: dtype,
lengths, memory, a reserve that is negative, NaN or larger than the device), and the CLI:

    python -m dsv3_jax.plan --config deepseek-v3 --mesh expert=8 --dtype fp8 \\
        --max-seq-len 131072 --device-memory 141GB

Must not allocate device memory or read checkpoint data.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import inference_form, layout
from dsv3_jax.parallel import sharding

DTYPES = ("bf16", "fp8", "fp32")
DEFAULT_RESERVE_FRACTION = 0.10  # activations, logits, XLA workspace and fragmentation


class PlanError(ValueError):
    """The model does not fit on the mesh (the message carries the numbers)."""


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 10**3, "m": 10**6,
          "g": 10**9, "t": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """"141GB" -> 141e9, "139GiB" -> 139 * 2**30, 1000 -> 1000 (GB/G are decimal, GiB binary)."""
    if isinstance(text, int | np.integer) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"device memory must look like '141GB', '139GiB' or a byte count, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    return f"{n / 1e9:,.2f} GB ({n / 2**30:,.2f} GiB)"


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A preset name ("deepseek-v3", "tiny") or a config.json path / checkpoint directory."""
    from dsv3_jax.config import PRESETS

    if str(name_or_path) in PRESETS:
        return ModelConfig.preset(str(name_or_path))
    if not Path(name_or_path).exists():
        raise FileNotFoundError(f"config {str(name_or_path)!r}: neither a preset "
                                f"({', '.join(sorted(PRESETS))}) nor an existing config.json or checkpoint "
                                "directory")
    return ModelConfig.from_json(name_or_path)


def param_layout(cfg: ModelConfig, dtype: str = "bf16", include_mtp: bool = True) -> Any:
    """The parameter layout (tree of layout.ArrayInfo) of weights stored as `dtype` (DTYPES): fp8 is the
    official format (FP8 linears + fp32 block scales, the rest bf16)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return layout.param_layout(cfg, jnp.float32 if dtype == "fp32" else jnp.bfloat16, include_mtp,
                               fp8=dtype == "fp8")


def device_form(tree: Any, cfg: ModelConfig, dtype: str = "bf16") -> Any:
    """A parameter tree (arrays, ShapeDtypeStructs or the layout) as the devices hold it: the inference
    form every ModelHandle prepares (model/inference_form.py), kv_b's halves in the compute dtype of
    weights stored as `dtype`. What the planner and the scale table count."""
    return inference_form.shapes(tree, cfg, jnp.float32 if dtype == "fp32" else jnp.bfloat16)


@functools.lru_cache(maxsize=8)
def param_shapes(cfg: ModelConfig, dtype: str = "bf16", include_mtp: bool = True) -> Any:
    """The parameter tree as ShapeDtypeStructs (from the layout: no memory, no tracing)."""
    return layout.structs(param_layout(cfg, dtype, include_mtp))


def tree_bytes_per_device(tree: Any, specs: Any, sizes: Mapping[str, int]) -> tuple[int, int, int]:
    """(total bytes, bytes per device, replicated bytes per device) of `tree` (arrays, ShapeDtypeStructs
    or layout.ArrayInfo) sharded by `specs`."""
    total = per_dev = replicated = 0
    leaves = jax.tree.leaves(tree, is_leaf=layout.is_info)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    for x, spec in zip(leaves, spec_leaves, strict=True):
        item = jnp.dtype(x.dtype).itemsize
        shard = sharding.shard_shape(x.shape, spec, sizes)
        total += math.prod(x.shape) * item
        per_dev += math.prod(shard) * item
        if tuple(shard) == tuple(x.shape) and math.prod(sizes.values()) > 1:
            replicated += math.prod(shard) * item
    return total, per_dev, replicated


def cache_bytes_per_device(cache_or_shapes: Any, sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of a cache tree (layout.cache_layout, or arrays of it) sharded by its
    logical axes."""
    return tree_bytes_per_device(cache_or_shapes, sharding.cache_specs(cache_or_shapes), sizes)[1]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device memory for one (model, mesh, dtype, context) choice. Bytes unless noted."""

    mesh: dict[str, int]
    dtype: str
    max_seq_len: int
    device_memory: int
    reserve: int
    weight_bytes_total: int
    weight_bytes_per_device: int
    replicated_bytes_per_device: int
    kv_bytes_per_token: int  # one token of one sequence, all layers (absorbed cache; bf16, fp32 for fp32)
    batch_shards: int  # sequences are spread over data x expert; each device holds whole sequences
    kv_cache_dtype: str = "auto"  # layout.KV_CACHE_DTYPES

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def kv_bytes_per_request(self) -> int:
        return self.kv_bytes_per_token * self.max_seq_len

    @property
    def free_bytes_per_device(self) -> int:
        return self.device_memory - self.reserve - self.weight_bytes_per_device

    @property
    def tokens_per_device(self) -> int:
        return max(self.free_bytes_per_device, 0) // self.kv_bytes_per_token

    @property
    def requests_per_device(self) -> int:
        return max(self.free_bytes_per_device, 0) // self.kv_bytes_per_request

    @property
    def tokens_total(self) -> int:
        return self.tokens_per_device * self.batch_shards

    @property
    def requests_total(self) -> int:
        return self.requests_per_device * self.batch_shards

    @property
    def fits(self) -> bool:
        """Weights, the reserve and at least one full-length request fit on every device."""
        return self.requests_per_device >= 1

    def summary(self) -> str:
        m = ",".join(f"{a}={self.mesh[a]}" for a in ("data", "tensor", "expert"))
        rows = [
            ("mesh", f"{m} ({self.n_devices} devices, {self.batch_shards} batch shards)"),
            ("weights dtype", self.dtype),
            ("weights, unsharded total", fmt_bytes(self.weight_bytes_total)),
            ("weights per device", fmt_bytes(self.weight_bytes_per_device)),
            ("  of which replicated", fmt_bytes(self.replicated_bytes_per_device)),
            ("device memory", fmt_bytes(self.device_memory)),
            ("reserve (activations, workspace)", fmt_bytes(self.reserve)),
            ("free for KV per device", fmt_bytes(self.free_bytes_per_device)),
            ("KV per token", f"{self.kv_bytes_per_token:,} B ({self.kv_bytes_per_token / 1e3:.1f} KB, "
                             f"kv cache dtype {self.kv_cache_dtype})"),
            (f"KV per {self.max_seq_len:,}-token request", fmt_bytes(self.kv_bytes_per_request)),
            ("tokens per device / total", f"{self.tokens_per_device:,} / {self.tokens_total:,}"),
            (f"{self.max_seq_len:,}-token requests per device / total",
             f"{self.requests_per_device:,} / {self.requests_total:,}"),
            ("fits", "yes" if self.fits else "NO"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)

    def check(self) -> None:
        """Raise PlanError (with the numbers) unless the plan fits."""
        if self.fits:
            return
        short = self.kv_bytes_per_request - max(self.free_bytes_per_device, 0)
        hint = ("more devices (a larger tensor or expert axis), --dtype fp8, or a shorter max_seq_len"
                if self.free_bytes_per_device < 0 else "a shorter max_seq_len or more devices")
        raise PlanError(
            f"the model does not fit: per device {fmt_bytes(self.weight_bytes_per_device)} of weights "
            f"+ {fmt_bytes(self.reserve)} reserve leave {fmt_bytes(self.free_bytes_per_device)} of "
            f"{fmt_bytes(self.device_memory)}, but one {self.max_seq_len:,}-token request needs "
            f"{fmt_bytes(self.kv_bytes_per_request)} of KV cache ({fmt_bytes(short)} short). Try {hint}.\n"
            + self.summary())


def plan(cfg: ModelConfig, mesh: str | Mapping[str, int] | Any, *, dtype: str = "bf16",
         max_seq_len: int | None = None, device_memory: int | str,
         reserve: int | float = DEFAULT_RESERVE_FRACTION, params_or_shapes: Any = None,
         include_mtp: bool = True, kv_cache_dtype: str = "auto") -> Plan:
    """Plan `cfg` on `mesh` (a spec string, axis-size dict or Mesh) without allocating anything.

    `reserve` < 1 is a fraction of device memory, otherwise bytes. `params_or_shapes` overrides the
    parameter tree (e.g. the shapes of a checkpoint without the MTP layer). `kv_cache_dtype`
    (layout.KV_CACHE_DTYPES): "auto" bf16 (fp32 for fp32 weights), "bf16", or "fp8" (656 B per token per
    layer instead of 1,152), or one of their aliases (layout.KV_CACHE_DTYPE_ALIASES).
    """
    kv_cache_dtype = layout.canonical_kv_cache_dtype(kv_cache_dtype)
    if isinstance(mesh, str | Mapping):
        if isinstance(mesh, str):
            from dsv3_jax.cli import check_mesh

            mesh = check_mesh(mesh, "mesh")  # an empty string would silently mean one device
        sizes = sharding.parse_mesh_spec(mesh)
        if -1 in sizes.values():
            raise sharding.MeshError(f"plan: mesh {mesh!r} has a -1 axis; give every size explicitly")
    else:
        sizes = sharding.axis_sizes(mesh)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    fp8 = dtype == "fp8"
    sharding.validate(cfg, sizes, fp8=fp8)
    if max_seq_len is not None and (isinstance(max_seq_len, bool)
                                    or not isinstance(max_seq_len, int | np.integer)):
        raise ValueError(f"max_seq_len must be an integer >= 1, got {max_seq_len!r}")
    max_seq_len = cfg.max_position_embeddings if max_seq_len is None else int(max_seq_len)
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    mem = parse_bytes(device_memory)
    if mem <= 0:
        raise ValueError(f"device memory must be > 0 bytes, got {device_memory!r}")
    if isinstance(reserve, bool) or not isinstance(reserve, int | float | np.integer | np.floating) \
            or not math.isfinite(reserve) or reserve < 0:
        raise ValueError(f"reserve must be a fraction in [0, 1) of device memory or a byte count >= 1, "
                         f"got {reserve!r}")
    reserve_b = int(reserve * mem) if reserve < 1 else int(reserve)
    if reserve_b >= mem:
        raise ValueError(f"reserve ({fmt_bytes(reserve_b)}) leaves nothing of the device memory "
                         f"({fmt_bytes(mem)})")
    stored = params_or_shapes if params_or_shapes is not None else param_layout(cfg, dtype, include_mtp)
    tree = device_form(stored, cfg, dtype)
    total, per_dev, rep = tree_bytes_per_device(tree, sharding.param_specs(tree), sizes)
    return Plan(mesh=sizes, dtype=dtype, max_seq_len=max_seq_len, device_memory=mem, reserve=reserve_b,
                weight_bytes_total=total, weight_bytes_per_device=per_dev, replicated_bytes_per_device=rep,
                kv_bytes_per_token=layout.bytes_per_token(cfg, "absorbed",
                                                          _cache_dtype(dtype, kv_cache_dtype)),
                kv_cache_dtype=kv_cache_dtype,
                batch_shards=sharding.mesh_size(sharding.LOGICAL_RULES["batch"], sizes))


def _cache_dtype(weights: str, kv_cache_dtype: str) -> Any:
    """The cache dtype (as layout.cache_layout takes it) of the canonical name `kv_cache_dtype` for weights
    stored as `weights`: "auto" is bf16, fp32 for fp32 weights."""
    if kv_cache_dtype == "auto":
        return jnp.float32 if weights == "fp32" else jnp.bfloat16
    return layout.FP8 if kv_cache_dtype == layout.FP8 else jnp.bfloat16


DEFAULT_MEMORY_FRACTION = 0.90  # like vLLM's --gpu-memory-utilization: weights + activations + KV pages


def activation_estimate(cfg: ModelConfig, sizes: Mapping[str, int], *, max_batched_tokens: int,
                        max_batch: int, max_model_len: int, attention_kernel: bool = False,
                        long_prefill: bool = False) -> int:
    """Peak transient bytes of one engine step on one device (fp32 intermediates), an upper estimate.

    Terms, per device (tokens and sequences are split over the batch shards, heads / vocab / FFN over
    `tensor`): the residual stream and its per-layer intermediates (16 x D per token), the absorbed
    attention's queries and scores (heads x (576 + max_model_len) per token: XLA materializes the
    scores; with `attention_kernel`, the Pallas MLA kernel, which never does, heads x (576 + 512): the
    queries and the latent output), the MoE's gathered group tokens (expert x D per token) and expert
    intermediates (k x 3 x FFN width), and the sampled rows' logits (3 copies of V: logits,
    probabilities, sort).
    With `long_prefill` (EngineConfig.long_prefill_from > 0) the naive-form path's K/V block and its
    chunk's state are added (model/long_prefill.transient_bytes).
    An engine that measured its compiled step passes the measured bytes to `pool_plan` instead.
    """
    shards = sharding.mesh_size(sharding.LOGICAL_RULES["batch"], sizes)
    t, ep = sizes["tensor"], sizes["expert"]
    tok = -(-max_batched_tokens // shards)
    rows = -(-max_batch // shards)
    heads = cfg.num_attention_heads // t
    scores = cfg.kv_lora_rank if attention_kernel else max_model_len
    per_token = (16 * cfg.hidden_size + heads * (cfg.latent_dim + scores)
                 + ep * cfg.hidden_size + cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size // t)
    total = 4 * (tok * per_token + rows * 3 * cfg.vocab_size // t)
    if long_prefill:
        from dsv3_jax.model import long_prefill as lp

        total += lp.transient_bytes(heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim,
                                    max_batched_tokens, max_model_len)
    return total


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The engine's page pool sized from device memory: bytes per device, pages per batch shard."""

    mesh: dict[str, int]
    page_size: int
    max_model_len: int
    device_memory: int
    memory_fraction: float
    weight_bytes_per_device: int
    activation_bytes_per_device: int
    activations_measured: bool
    page_bytes_per_device: int  # one page (all layers) on the device holding it
    batch_shards: int
    pages_per_shard: int  # including the shard's scratch page
    kv_cache_dtype: str = "auto"  # what the pages hold (layout.KV_CACHE_DTYPES)

    @property
    def num_pages(self) -> int:
        """Pages of the whole pool (EngineConfig.num_pages); each batch shard's devices hold 1/d."""
        return self.pages_per_shard * self.batch_shards

    @property
    def kv_bytes_per_device(self) -> int:
        return self.pages_per_shard * self.page_bytes_per_device

    @property
    def kv_tokens_per_shard(self) -> int:
        return (self.pages_per_shard - 1) * self.page_size

    @property
    def pages_per_request(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def max_requests_per_shard(self) -> int:
        return (self.pages_per_shard - 1) // self.pages_per_request

    @property
    def max_requests(self) -> int:
        """Requests of max_model_len tokens that fit at once, all shards (each request lives on one)."""
        return self.max_requests_per_shard * self.batch_shards

    def summary(self) -> str:
        m = ",".join(f"{a}={self.mesh[a]}" for a in ("data", "tensor", "expert"))
        act = "measured" if self.activations_measured else "estimated"
        rows = [
            ("mesh", f"{m} ({self.batch_shards} batch shards, each its own page slice)"),
            ("device memory x fraction", f"{fmt_bytes(self.device_memory)} x {self.memory_fraction:g}"),
            ("weights per device", fmt_bytes(self.weight_bytes_per_device)),
            (f"activations per device ({act})", fmt_bytes(self.activation_bytes_per_device)),
            ("KV pages per device", f"{fmt_bytes(self.kv_bytes_per_device)} = {self.pages_per_shard:,} x "
                                    f"{self.page_bytes_per_device:,} B ({self.page_size}-token pages, "
                                    f"kv cache dtype {self.kv_cache_dtype})"),
            ("KV tokens per shard / total", f"{self.kv_tokens_per_shard:,} / "
                                            f"{self.kv_tokens_per_shard * self.batch_shards:,}"),
            (f"{self.max_model_len:,}-token requests per shard / total",
             f"{self.max_requests_per_shard:,} / {self.max_requests:,}"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def pool_plan(cfg: ModelConfig, mesh: str | Mapping[str, int] | Any, *, dtype: str = "bf16",
              max_model_len: int, device_memory: int | str,
              memory_fraction: float = DEFAULT_MEMORY_FRACTION, page_size: int | None = None,
              form: str = "absorbed", cache_dtype: Any = None, mtp: bool = False,
              max_batched_tokens: int = 512, max_batch: int = 32, activation_bytes: int | None = None,
              params_or_shapes: Any = None, include_mtp: bool = True,
              attention_kernel: bool = False, long_prefill: bool = False) -> PoolPlan:
    """Size the engine's page pool: what `memory_fraction` of each device leaves after the weights and
    one step's activations, in whole pages (layout.cache_layout, sharded by its logical axes: each batch
    shard's devices hold only that shard's slice). Raises PlanError, with the numbers, when
    not even one `max_model_len`-token request fits a shard's slice. `attention_kernel`: the step runs
    the Pallas MLA kernel (no score matrix; see activation_estimate); `long_prefill`: the engine runs the
    naive-form long-prefill path (its transient K/V block is reserved too).
    """
    from dsv3_jax.model import kv_cache

    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction must lie in (0, 1], got {memory_fraction!r}")
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int | np.integer) \
            or max_model_len < 1:
        raise ValueError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len:,} exceeds the model's context "
                         f"({cfg.max_position_embeddings:,} tokens)")
    page_size = kv_cache.PAGE_SIZE if page_size is None else int(page_size)
    weights = plan(cfg, mesh, dtype=dtype, max_seq_len=max_model_len, device_memory=device_memory,
                   reserve=0, params_or_shapes=params_or_shapes, include_mtp=include_mtp)
    sizes, d = weights.mesh, weights.batch_shards
    named = isinstance(cache_dtype, str) and (cache_dtype in layout.KV_CACHE_DTYPES
                                              or cache_dtype in layout.KV_CACHE_DTYPE_ALIASES)
    kv_name = layout.canonical_kv_cache_dtype(cache_dtype) if named else None
    if kv_name is not None:  # "auto": the compute dtype, as the engine allocates it
        cache_dtype = None if kv_name == "auto" else _cache_dtype(dtype, kv_name)
    two_pages_each = layout.cache_layout(cfg, 2 * d, page_size, form, cache_dtype, mtp)
    page_bytes = cache_bytes_per_device(two_pages_each, sizes) // 2
    measured = activation_bytes is not None
    act = int(activation_bytes) if measured else activation_estimate(
        cfg, sizes, max_batched_tokens=max_batched_tokens, max_batch=max_batch, max_model_len=max_model_len,
        attention_kernel=attention_kernel, long_prefill=long_prefill)
    budget = int(memory_fraction * weights.device_memory) - weights.weight_bytes_per_device - act
    pages = max(budget, 0) // page_bytes
    p = PoolPlan(mesh=sizes, page_size=page_size, max_model_len=max_model_len,
                 device_memory=weights.device_memory, memory_fraction=float(memory_fraction),
                 weight_bytes_per_device=weights.weight_bytes_per_device, activation_bytes_per_device=act,
                 activations_measured=measured, page_bytes_per_device=page_bytes, batch_shards=d,
                 pages_per_shard=int(pages),
                 kv_cache_dtype=kv_name or ("fp8" if layout.is_fp8(cache_dtype) else
                                            str(jnp.dtype(cache_dtype or cfg.dtype))))
    if p.pages_per_shard < 1 + p.pages_per_request:
        have = max(p.pages_per_shard - 1, 0)
        raise PlanError(
            f"no room for one {max_model_len:,}-token request: {memory_fraction:g} x "
            f"{fmt_bytes(p.device_memory)} minus {fmt_bytes(p.weight_bytes_per_device)} of weights and "
            f"{fmt_bytes(act)} of activations leaves {fmt_bytes(max(budget, 0))} per device = {have} "
            f"usable pages, but one request needs {p.pages_per_request} pages "
            f"({fmt_bytes(p.pages_per_request * page_bytes)}). Try a shorter --max-model-len, a larger "
            f"--memory-fraction, fewer --max-batched-tokens, or more devices.\n" + p.summary())
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from dsv3_jax.cli import check_mesh, parse_dtype, report_error

    ap = argparse.ArgumentParser(prog="python -m dsv3_jax.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="deepseek-v3", help="preset name or config.json / checkpoint dir")
    ap.add_argument("--mesh", required=True, help="e.g. 'expert=8' or 'data=2,tensor=2,expert=2'")
    ap.add_argument("--dtype", default="bf16", help="weights: bf16 (bfloat16), fp8 (float8_e4m3fn) or fp32")
    ap.add_argument("--max-seq-len", "--max-model-len", type=int, default=131072, dest="max_seq_len",
                    help="longest request (prompt + output)")
    ap.add_argument("--device-memory", default="141GB", help="per device, e.g. 141GB or 80GiB")
    ap.add_argument("--reserve", type=float, default=DEFAULT_RESERVE_FRACTION,
                    help="kept free for activations/workspace: a fraction (<1) or bytes")
    ap.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer's weights")
    from dsv3_jax.parallel.flags import kv_cache_dtype_arg

    ap.add_argument("--kv-cache-dtype", default="auto", type=kv_cache_dtype_arg, metavar="{auto,bf16,fp8}",
                    help="KV cache: auto (bf16; fp32 for fp32 weights), bf16, or fp8 (e4m3 latent with "
                         "per-128 scales + bf16 rope: 656 instead of 1,152 B per token per layer)")
    a = ap.parse_args(argv)
    try:
        dtype = parse_dtype(a.dtype, DTYPES)
        mesh = check_mesh(a.mesh)
        cfg = load_config(a.config)
        p = plan(cfg, mesh, dtype=dtype, max_seq_len=a.max_seq_len, device_memory=a.device_memory,
                 reserve=a.reserve, include_mtp=not a.no_mtp, kv_cache_dtype=a.kv_cache_dtype)
    except (ValueError, OSError) as e:  # ConfigError, MeshError, UsageError, a missing config file
        return report_error("plan", e)
    print(p.summary())
    # What the serving engine would hold (flags.engine_plan's sizing, the Pallas attention of a Hopper GPU):
    # the concurrent full-length requests it runs before preempting.
    try:
        longest = min(a.max_seq_len, cfg.max_position_embeddings)
        pool = pool_plan(cfg, mesh, dtype=dtype, max_model_len=longest, device_memory=a.device_memory,
                         max_batched_tokens=2048, max_batch=256, cache_dtype=a.kv_cache_dtype,
                         include_mtp=not a.no_mtp, attention_kernel=True)
        print(f"\nengine pool (memory fraction {DEFAULT_MEMORY_FRACTION:g}, Pallas attention):\n"
              + pool.summary())
    except PlanError as e:
        print(f"\nengine pool: {str(e).splitlines()[0]}")
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
