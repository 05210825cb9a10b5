"""The public entry point: `dsv3_jax.load(path, ...)` -> `ModelHandle`.

Owns: turning a checkpoint directory (converted Orbax, or HF safetensors directly) into a ready model
on a mesh, and the handle's small surface (`config`, `forward`, `generate` / `chat` through the request
layer, request_stream.py). Must not implement model math, sampling, sharding rules, request checks or
streaming itself, nor read training code (the compact form is formats/compact.py's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv3_jax import request_stream
from dsv3_jax.cli import check_mesh, compute_dtype_name
from dsv3_jax.config import ModelConfig
from dsv3_jax.engine.executor import enable_compilation_cache
from dsv3_jax.engine.sampling import load_generation_defaults
from dsv3_jax.formats import checkpoint, compact
from dsv3_jax.model import inference_form, layout
from dsv3_jax.model.attention import ATTENTION_FORMS
from dsv3_jax.model.trace_options import TraceOptions
from dsv3_jax.model.transformer import Transformer
from dsv3_jax.parallel import sharding
from dsv3_jax.request_stream import GenerationResult
from dsv3_jax.text.tokenizer import Tokenizer


@dataclasses.dataclass
class ModelHandle:
    """A loaded model: config, parameters (placed on `mesh`), the Flax module and jitted calls."""

    config: ModelConfig
    params: dict[str, Any]
    attention: str = "absorbed"
    mesh: Any = None
    path: Path | None = None
    tokenizer: Tokenizer | None = None
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    param_shardings: Any = None  # NamedShardings of `params` on `mesh` (None without a mesh)
    # How engines over this handle build their device side: (handle, EngineConfig) -> executor.Executor.
    # None (one process): engine/executor.DeviceExecutor. A multi-host leader's parallel/lockstep.Lockstep
    # sets its `executor` here (parallel.flags.start's caller, after loading) so followers replay each step.
    executor_factory: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
    # Every trace-time setting (kernel backend, MoE dispatch): the model's, and the engine's compile key's
    trace_options: TraceOptions = dataclasses.field(default_factory=TraceOptions.from_environment)
    # The KV cache dtype of the engines built over this handle when their EngineConfig names none
    # (layout.KV_CACHE_DTYPES: "auto" the compute dtype, "bf16", "fp8" the FP8 latent cache)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_FORMS:
            raise ValueError(f"attention must be one of {ATTENTION_FORMS}, got {self.attention!r}")
        self.kv_cache_dtype = layout.canonical_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype == "fp8" and self.attention != "absorbed":
            raise ValueError("kv_cache_dtype 'fp8' needs attention='absorbed': the naive form caches "
                             "per-head K/V, the FP8 cache is the absorbed form's latent")
        self.fp8 = checkpoint.tree_is_fp8(self.params)
        # MLA's weights prepared once here, not in every step (model/inference_form.py: kv_b split and
        # dequantized, q_a and kv_a fused); the handle holds the inference form, and its shardings are
        # those of the arrays it holds.
        sharding_of = None
        if self.mesh is not None:
            sharding_of = lambda path, ndim: sharding.param_sharding(self.mesh, path, ndim)  # noqa: E731
        self.params = inference_form.prepare(self.params, self.config, jnp.dtype(self.config.dtype),
                                             sharding_of)
        if self.mesh is not None:
            self.param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
        self.model = Transformer(self.config, jnp.dtype(self.config.dtype), self.fp8, self.attention,
                                 trace_options=self.trace_options)

    def mesh_context(self):
        """`jax.set_mesh(self.mesh)` (a no-op without a mesh): trace/call jitted model code inside it so the
        MoE runs expert-parallel (moe.py reads the mesh at trace time)."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    @functools.cached_property
    def _forward(self):
        fn = lambda p, toks: self.model.apply({"params": p}, toks)[0]  # noqa: E731
        if self.mesh is None:
            return jax.jit(fn)
        # Tokens batch-sharded over data x expert; logits come back replicated so every process
        # (multi-host) can read them.
        tokens = sharding.activation_sharding(self.mesh, "tokens")
        return jax.jit(fn, in_shardings=(self.param_shardings, tokens),
                       out_shardings=jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def forward(self, tokens) -> np.ndarray:
        """float32 logits [B, T, vocab] for full sequences `tokens` [B, T] (no cache)."""
        toks = np.asarray(tokens, dtype=np.int32)
        if toks.ndim == 1:
            toks = toks[None]
        if toks.ndim != 2 or toks.shape[1] == 0:
            raise ValueError(f"tokens must be [B, T] with T >= 1, got shape {toks.shape}")
        if toks.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {toks.shape[1]} tokens exceeds the context "
                             f"({self.config.max_position_embeddings})")
        if toks.min() < 0 or toks.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        if self.mesh is None:
            return np.asarray(self._forward(self.params, jnp.asarray(toks)), dtype=np.float32)
        b = toks.shape[0]
        pad = -b % sharding.batch_multiple(self.mesh)  # every batch shard needs whole sequences
        toks = np.concatenate([toks, np.zeros((pad, toks.shape[1]), np.int32)]) if pad else toks
        glob = jax.make_array_from_callback(toks.shape, sharding.activation_sharding(self.mesh, "tokens"),
                                            lambda idx: toks[idx])
        with self.mesh_context():
            out = self._forward(self.params, glob)
        return np.asarray(out.addressable_data(0), dtype=np.float32)[:b]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass prompts as token-id lists")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], *,
                 max_new_tokens: int | Sequence[int] = 64, temperature: float | Sequence[float] | None = None,
                 top_p: float | Sequence[float] | None = None, top_k: int | Sequence[int] | None = None,
                 seed: int | Sequence[int] = 0,
                 stop: str | Sequence[str] | Sequence[Sequence[str] | None] | None = None,
                 logprobs: int | Sequence[int | None] | None = None, stream: bool = False,
                 ignore_eos: bool = False, spec_k: int = 0, sizing: Mapping[str, int] | None = None,
                 warmup_progress: Callable[..., None] | None = None,
                 prefill_progress: Callable[[int, int], None] | None = None):
        """Generate for one prompt or a batch (strings or token-id lists) through the serving engine.

        Returns a list of `GenerationResult` (one per prompt; a single result for a single prompt).
        With `stream=True` returns an iterator of text pieces (str) for a single prompt, or of
        (prompt index, piece) pairs for a batch. Sampling defaults come from generation_config.json;
        temperature 0 is greedy. `spec_k` > 0 drafts that many tokens per step with the MTP head
        (speculative decoding; greedy output is unchanged, sampled output keeps its distribution).
        `warmup_progress(done, total, step_key, seconds)`: compile every step program first, reporting each.
        `prefill_progress(done, total)`: prompt tokens prefilled so far, after every step until none are
        pending (a 128K prompt takes many steps before its first token).
        `sizing`: EngineConfig fields to use instead of sizing the engine for these prompts (the CLI's
        --max-batch, --max-batched-tokens and the plan-sized pool; request_stream.engine_config).

        Per prompt, as the server does per request: `max_new_tokens`, `temperature`, `top_p`, `top_k`,
        `seed` and `logprobs` each take one value for all prompts or a list with one per prompt; `stop`
        takes a string or list of strings for all, or a list of lists (or None) per prompt. A single
        seed gives prompt i the seed `seed + i`. `logprobs=n` (0..20) fills `result.logprobs` with each
        token's logprob (log-softmax of the raw logits) and its n most likely alternatives.
        """
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        batch = [prompts] if single else list(prompts)
        ids = [self._encode(p) for p in batch]
        params = request_stream.batch_params(
            len(ids), self.generation_defaults, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop=stop, logprobs=logprobs,
            eos=[] if ignore_eos else self.eos_ids())
        it = request_stream.stream(self, ids, params, tokenizer=self.tokenizer, spec_k=spec_k, sizing=sizing,
                                   warmup_progress=warmup_progress, prefill_progress=prefill_progress)
        if stream:
            return (piece if single else (i, piece) for i, piece, res in it if res is None and piece)
        results: list[GenerationResult | None] = [None] * len(ids)
        for i, _, res in it:
            if res is not None:
                results[i] = res
        return results[0] if single else results

    def chat(self, messages: Sequence[dict], *, thinking: bool = False, **kwargs):
        """Render the chat template (with the thinking switch) and generate the assistant's reply."""
        from dsv3_jax.text.chat import encode_chat

        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise ValueError("this checkpoint has no tokenizer chat template")
        ids = encode_chat(self.tokenizer, messages, add_generation_prompt=True, thinking=thinking)
        return self.generate(ids, **kwargs)

    def eos_ids(self) -> list[int]:
        """Token ids that end a generation: generation_config's, else the tokenizer's or config's EOS."""
        ids = list(self.generation_defaults.get("eos_token_ids", []))
        if not ids:
            ids = [self.tokenizer.eos_id] if self.tokenizer and self.tokenizer.eos_id is not None \
                else [self.config.eos_token_id]
        return ids

    # ------------------------------------- notebook display and research hooks (notebook.py, inspect.py)
    def __repr__(self) -> str:
        from dsv3_jax import notebook

        return notebook.handle_repr(self)

    def _repr_html_(self) -> str:
        from dsv3_jax import notebook

        return notebook.handle_html(self)

    def router_stats(self, prompt: str | Sequence[int]):
        """Per-MoE-layer router choices and expert-load histogram for one prompt (inspect.RouterStats)."""
        from dsv3_jax.model import probes as inspect

        return inspect.router_stats(self, prompt)

    def attention_entropy(self, prompt: str | Sequence[int]):
        """Attention entropy per layer, head and query for one prompt (inspect.AttentionEntropy)."""
        from dsv3_jax.model import probes as inspect

        return inspect.attention_entropy(self, prompt)

    def cache_pages(self, prompt: str | Sequence[int], *, page_size: int | None = None):
        """The paged KV cache of one prompt after prefill, its own pages only (inspect.CachePages)."""
        from dsv3_jax.model import probes as inspect

        return inspect.cache_pages(self, prompt, **({} if page_size is None else {"page_size": page_size}))


# The embedded default: a small DeepSeek-V3 (real MLA widths, MoE, MTP) trained on the standard library's
# source, stored in the compact form (formats/compact.py: used vocabulary rows only; default_model/README.md).
DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"


def load(path: str | Path | None = None, *, mesh: Any = None, attention: str = "absorbed",
         dtype: str | None = None, n_activated_experts: int | None = None, max_seq_len: int | None = None,
         device_memory: int | str | None = None, kernels: str | None = None,
         trace_options: TraceOptions | None = None, kv_cache_dtype: str = "auto") -> ModelHandle:
    """Load a converted checkpoint (or an HF safetensors directory) onto `mesh` (None: one device);
    `path` None loads the embedded default model (`DEFAULT_MODEL_DIR`).

    `mesh`: a spec string ("data=2,tensor=2,expert=2", see sharding.py), an axis-size dict or a Mesh
    from `sharding.make_mesh`. `dtype` overrides the compute/weight dtype (FP8 weights stay FP8);
    `n_activated_experts` overrides `num_experts_per_tok` (the speed/quality knob; validated against
    group selection). Before reading any weights, the memory plan (plan.py) must fit one request of
    `max_seq_len` tokens (default: the model's context) in `device_memory` (default: what the
    accelerator reports; no check on CPU), else PlanError with the numbers.
    `kernels`: "auto" (Pallas on a Hopper GPU, the `jnp` reference elsewhere), "pallas" or "reference";
    None reads DSV3_KERNELS. `trace_options` (a `TraceOptions`, instead of `kernels`) sets every trace
    setting at once (MoE dispatch mode, capacity factor too). `kv_cache_dtype` ("auto", "bf16", "fp8":
    vLLM's `kv_cache_dtype`) is the KV cache of the engines built over the handle (`generate`, `chat`;
    an `EngineConfig.kv_cache_dtype` overrides it) and of the plan checked here; "fp8" stores the latent
    in e4m3 with per-128 scales and the rope in bf16 (656 instead of 1,152 B per token per layer).
    """
    kv_cache_dtype = layout.canonical_kv_cache_dtype(kv_cache_dtype)
    if trace_options is not None and kernels is not None:
        raise ValueError("pass kernels or trace_options, not both (TraceOptions.kernels is the backend)")
    options = trace_options if trace_options is not None else TraceOptions.resolve(kernels)
    # JAX decides at its first compile whether the persistent cache is on, and loading compiles.
    enable_compilation_cache()
    path = DEFAULT_MODEL_DIR if path is None else Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cfg = ModelConfig.from_json(path / "config.json")
    if dtype is not None:
        cfg = cfg.replace(dtype=compute_dtype_name(dtype))  # bf16, bfloat16, jnp.bfloat16 alike
    if n_activated_experts is not None:
        cfg = cfg.replace(num_experts_per_tok=n_activated_experts)
    if mesh is not None:
        mesh = sharding.make_mesh(check_mesh(mesh, "mesh") if isinstance(mesh, str) else mesh)
        sharding.validate(cfg, mesh, fp8=cfg.quantization is not None)
    _check_plan(cfg, mesh, max_seq_len, device_memory, kv_cache_dtype)
    shardings = None
    if mesh is None:
        params = jax.tree_util.tree_map(jnp.asarray, _host_params(path, cfg))
    elif (path / checkpoint.COMPLETE_MARKER).exists():
        # Converted (Orbax): each process restores only the chunks its devices hold.
        shardings = sharding.param_shardings(cfg, mesh, _planned_shapes(cfg))
        params = checkpoint.load_params(path, cfg, dtype=jnp.dtype(cfg.dtype), shardings=shardings)
        shardings = _prune(shardings, params)
    else:
        # HF safetensors: read on the host, then each process places only its devices' slices.
        host = _host_params(path, cfg)
        shardings = sharding.param_shardings(cfg, mesh, host)
        params = jax.tree.map(lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda i: x[i]),
                              host, shardings)
    if (path / "tokenizer.json").exists():
        tok = Tokenizer.from_dir(path)
    else:
        tok = Tokenizer.default() if path == DEFAULT_MODEL_DIR else None
    return ModelHandle(cfg, params, attention, mesh, path, tok, load_generation_defaults(path), shardings,
                       trace_options=options, kv_cache_dtype=kv_cache_dtype)


def _host_params(path: Path, cfg: ModelConfig) -> dict[str, Any]:
    """The parameter tree on the host: compact part files (formats/compact.py, the default model's
    storage) expanded to the full vocabulary, or an HF / converted checkpoint read by checkpoint.py."""
    if not compact.has_compact(path):
        return checkpoint.load_params(path, cfg, dtype=jnp.dtype(cfg.dtype))
    return checkpoint.cast_tree(compact.tie_mtp(compact.import_compact(path)), jnp.dtype(cfg.dtype))


def _weights_dtype(cfg: ModelConfig) -> str:
    if cfg.quantization is not None:
        return "fp8"
    return "fp32" if cfg.dtype == "float32" else "bf16"


def _planned_shapes(cfg: ModelConfig) -> Any:
    from dsv3_jax import plan

    return plan.param_shapes(cfg, _weights_dtype(cfg), bool(cfg.num_nextn_predict_layers))


def _prune(tree: Any, like: Any) -> Any:
    """`tree` restricted to the keys of `like` (a checkpoint may lack the MTP layer)."""
    if not isinstance(like, dict):
        return tree
    return {k: _prune(tree[k], v) for k, v in like.items()}


def _check_plan(cfg: ModelConfig, mesh: Any, max_seq_len: int | None,
                device_memory: int | str | None, kv_cache_dtype: str = "auto") -> None:
    """Refuse (PlanError with the numbers) a model that cannot fit, before reading any weights."""
    from dsv3_jax import plan

    if device_memory is None:
        stats = jax.local_devices()[0].memory_stats() or {}
        device_memory = stats.get("bytes_limit")  # what XLA may use (see XLA_PYTHON_CLIENT_MEM_FRACTION)
        if device_memory is None:
            return  # CPU: no meaningful per-device limit
    sizes = sharding.axis_sizes(mesh) if mesh is not None else dict.fromkeys(sharding.AXES, 1)
    plan.plan(cfg, sizes, dtype=_weights_dtype(cfg), max_seq_len=max_seq_len, device_memory=device_memory,
              params_or_shapes=_planned_shapes(cfg), kv_cache_dtype=kv_cache_dtype).check()


def tiny_default(*, attention: str = "absorbed", seed: int = 0) -> ModelHandle:
    """The `tiny` preset with seeded random weights and DeepSeek-V3.1's tokenizer (parity tests and
    experiments; the embedded default is the trained model `load()` returns).

    Its text is gibberish (the weights are random) but every mechanism runs: MLA, groups, YaRN, MTP.
    """
    from dsv3_jax.config import ModelConfig

    cfg = ModelConfig.preset("tiny")
    model = Transformer(cfg, jnp.dtype(cfg.dtype), False, attention)
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 1), jnp.int32), method=model.init_all))(
        jax.random.key(seed))["params"]
    return ModelHandle(cfg, params, attention, None, None, Tokenizer.default(),
                       {"temperature": 0.6, "top_p": 0.95})
