"""The layout, capacity and multi-host flags that `generate` and `serve` share, and what they start.

Owns: the layout flags under vLLM's names with ours as aliases (`--tensor-parallel-size/-tp/--tp`,
`--data-parallel-size/-dp/--dp`, `--ep`, `--enable-expert-parallel`: shorthands for `--mesh
tensor=..,data=..,expert=..`), `--max-model-len`, `--gpu-memory-utilization/--memory-fraction`,
`--device-memory`, `--max-num-seqs/--max-batch`, `--max-num-batched-tokens/--max-batched-tokens`, the
`--speculative-config` JSON (vLLM's form of the MTP draft count), `--kv-cache-dtype` (auto/bf16/fp8:
EngineConfig.kv_cache_dtype and the plan's page bytes),
`--n-activated-experts`, the checkpoint argument both CLIs take (`add_model_args`: positional MODEL_DIR,
`--model`, `--ckpt`) and the multi-process flags (distributed.add_cli_flags); checking them before
anything loads; the
warm-up progress lines both CLIs print (`warmup_printer`); starting
the processes (`start`: jax.distributed, and with several processes the engine's `lockstep.Lockstep`,
which the caller hands to the loaded model or follows with); and sizing the engine from the planner
(`engine_plan`: plan.pool_plan on the loaded model, the pool that `--memory-fraction` of each device
leaves, printed once at start by process 0). Must not parse prompts, build engines or load weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dsv3_jax.parallel import distributed

SHORTHANDS = (("tp", "tensor"), ("dp", "data"), ("ep", "expert"))
LONG_NAMES = {"tp": "--tensor-parallel-size", "dp": "--data-parallel-size"}


def add_flags(parser: argparse.ArgumentParser, *, engine_sizing: bool = True) -> None:
    """The shared flags (`--mesh` itself stays the command's own). `engine_sizing=False` leaves out
    --max-batch / --max-batched-tokens for a command that defines them already."""
    g = parser.add_argument_group("layout and capacity")
    g.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tp", type=int, metavar="N",
                   help="tensor parallel size (shorthand for --mesh tensor=N)")
    g.add_argument("--data-parallel-size", "-dp", "--dp", dest="dp", type=int, metavar="N",
                   help="data parallel size: batch shards with their own KV pages (DP attention)")
    g.add_argument("--ep", type=int, metavar="N", help="expert parallel size (also a batch axis outside "
                                                      "the MoE)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM's DP + EP deployment: the --data-parallel-size ranks split the routed experts "
                        "(mesh expert=N instead of data=N; attention stays data-parallel over them, "
                        "--tensor-parallel-size still splits each expert's width)")
    g.add_argument("--max-model-len", type=int, metavar="T",
                   help="longest request (prompt + output) the KV pool must hold; default: the model's "
                        "context")
    g.add_argument("--gpu-memory-utilization", "--memory-fraction", dest="memory_fraction", type=float,
                   default=0.9, metavar="F",
                   help="share of each device's memory for weights + activations + KV pages (default 0.9)")
    g.add_argument("--device-memory", metavar="BYTES",
                   help="per-device memory to plan with, e.g. 141GB (default: what the accelerator reports; "
                        "none on CPU, where the pool is sized for the work instead)")
    if engine_sizing:
        g.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, metavar="S",
                       help="sequences per engine step")
        g.add_argument("--max-num-batched-tokens", "--max-batched-tokens", dest="max_batched_tokens",
                       type=int, metavar="N", help="tokens per engine step")
    g.add_argument("--kv-cache-dtype", default="auto", type=kv_cache_dtype_arg, metavar="{auto,bf16,fp8}",
                   help="KV cache: auto (the model's dtype), bf16, or fp8 (latent e4m3 with per-128 scales + "
                        "rope bf16: 656 instead of 1,152 B per token per layer, ~1.75x the tokens); vLLM's "
                        "fp8_e4m3 and bfloat16 are taken as fp8 and bf16")
    g.add_argument("--n-activated-experts", type=int, metavar="K",
                   help="routed experts per token (default: the checkpoint's num_experts_per_tok)")
    distributed.add_cli_flags(parser)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The checkpoint directory, as vLLM takes it (positional MODEL_DIR or --model) or as before (--ckpt);
    `resolve_model` folds them into `args.ckpt` (None: the embedded default model)."""
    parser.add_argument("model_dir", nargs="?", type=Path, metavar="MODEL_DIR",
                        help="converted (or HF) checkpoint dir; default: the embedded model")
    parser.add_argument("--model", "--ckpt", dest="ckpt", type=Path, metavar="DIR",
                        help="the same as MODEL_DIR")


def resolve_model(args: argparse.Namespace) -> None:
    """args.ckpt from MODEL_DIR / --model / --ckpt; two different directories are refused."""
    pos = getattr(args, "model_dir", None)
    if pos is not None and args.ckpt is not None and pos != args.ckpt:
        raise ValueError(f"two checkpoints given: MODEL_DIR {pos} and --model {args.ckpt}; give one")
    args.ckpt = args.ckpt if args.ckpt is not None else pos


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the value itself when it is a template (vLLM takes both);
    ValueError naming the flag when it is neither a file nor valid Jinja."""
    import jinja2

    path = Path(value)
    looks_like_path = "{" not in value and "\n" not in value
    if looks_like_path:
        if not path.is_file():
            raise ValueError(f"--chat-template: no such file {value!r} (give a file or the template text)")
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {path}: cannot read it ({e})") from None
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})"
                         ) from None
    return value


# The speculative methods `--speculative-config` accepts: DeepSeek's own MTP head (vLLM's names for it).
MTP_METHODS = ("deepseek_mtp", "mtp")
MAX_SPEC_TOKENS = 3


def speculative_config(value: str) -> int:
    """`--speculative-config` as vLLM takes it (JSON, e.g. '{"method": "deepseek_mtp",
    "num_speculative_tokens": 1}'): the MTP draft tokens per step. argparse turns the error into one
    `PROG: error: argument --speculative-config: ...` line."""
    import json

    bad = argparse.ArgumentTypeError
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as e:
        raise bad(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(spec, dict):
        raise bad('must be a JSON object, e.g. \'{"method": "deepseek_mtp", "num_speculative_tokens": 1}\'')
    unknown = sorted(set(spec) - {"method", "num_speculative_tokens"})
    if unknown:
        raise bad(f"unsupported key(s) {unknown}: only method and num_speculative_tokens (drafts come from "
                  "the checkpoint's own MTP layer)")
    method = spec.get("method", MTP_METHODS[0])
    if method not in MTP_METHODS:
        raise bad(f"method {method!r} is not supported: only {' / '.join(MTP_METHODS)} (the checkpoint's MTP "
                  "layer drafts)")
    k = spec.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPEC_TOKENS:
        raise bad(f"num_speculative_tokens must be an integer in 0..{MAX_SPEC_TOKENS}, got {k!r}")
    return k


def check(args: argparse.Namespace) -> None:
    """Refuse bad values before loading; fold --tp/--dp/--ep (and --enable-expert-parallel) into
    args.mesh."""
    from dsv3_jax import plan
    from dsv3_jax.parallel import sharding

    for flag, _ in SHORTHANDS:
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"{LONG_NAMES.get(flag, '--' + flag)} must be >= 1, got {v}")
    if getattr(args, "enable_expert_parallel", False):
        if (args.dp or 1) < 2:
            raise ValueError("--enable-expert-parallel splits the experts over the --data-parallel-size "
                             "ranks (DP attention + EP); give --data-parallel-size N > 1, or --ep N directly")
        if args.ep is not None:
            raise ValueError("give either --ep or --enable-expert-parallel (which makes the data-parallel "
                             "ranks expert-parallel), not both")
        args.ep, args.dp = args.dp, None
    given = {axis: getattr(args, flag) for flag, axis in SHORTHANDS if getattr(args, flag) is not None}
    if given:
        if getattr(args, "mesh", None):
            raise ValueError("give either --mesh or --tp/--dp/--ep, not both")
        args.mesh = ",".join(f"{a}={n}" for a, n in given.items())
        sharding.parse_mesh_spec(args.mesh)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if not 0 < args.memory_fraction <= 1:
        raise ValueError(f"--memory-fraction must lie in (0, 1], got {args.memory_fraction}")
    if args.device_memory is not None:
        plan.parse_bytes(args.device_memory)
    for flag, name in (("max_batch", "--max-num-seqs"), ("max_batched_tokens", "--max-num-batched-tokens"),
                       ("n_activated_experts", "--n-activated-experts")):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if args.peer_timeout <= 0:
        raise ValueError(f"--peer-timeout must be > 0 seconds, got {args.peer_timeout}")


def start(args: argparse.Namespace) -> Any:
    """jax.distributed (flags, srun or mpirun); with several processes, the engine's lockstep.Lockstep
    over a new channel (None in one process). Process 0 sets `handle.executor_factory = ls.executor`
    once the model is loaded; the others call `ls.follow(handle)` instead of building engines."""
    from dsv3_jax.parallel import lockstep

    distributed.initialize_from_args(args)
    return lockstep.start()


def kv_cache_dtype_arg(name: str) -> str:
    """argparse `type` of --kv-cache-dtype: the canonical name (layout.canonical_kv_cache_dtype), its
    error as argparse's one line."""
    from dsv3_jax.model import layout

    try:
        return layout.canonical_kv_cache_dtype(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device_memory(args: argparse.Namespace) -> int | None:
    """--device-memory, else what the first local accelerator reports (None on CPU)."""
    from dsv3_jax import plan

    if args.device_memory is not None:
        return plan.parse_bytes(args.device_memory)
    import jax

    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def engine_plan(handle: Any, args: argparse.Namespace, *, spec_k: int = 0) -> Any:
    """The plan-sized pool for this model and mesh (plan.PoolPlan), or None without a device memory
    (CPU): PlanError when not even one --max-model-len request fits."""
    from dsv3_jax import api, plan
    from dsv3_jax.engine.api import EngineConfig
    from dsv3_jax.model import kv_cache as cache
    from dsv3_jax.parallel import sharding

    mem = device_memory(args)
    if mem is None:
        return None
    cfg = handle.config
    sizes = dict.fromkeys(sharding.AXES, 1) if handle.mesh is None else sharding.axis_sizes(handle.mesh)
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    # The engine's default when the CLI has no flag for it (generate); the path's programs and transient
    # block exist only where a sequence can reach its prefix (engine/core.py).
    long_from = getattr(args, "long_prefill_from", EngineConfig.long_prefill_from) or 0
    return plan.pool_plan(
        cfg, sizes, dtype=api._weights_dtype(cfg),
        max_model_len=max_model_len,
        device_memory=mem, memory_fraction=args.memory_fraction, page_size=cache.PAGE_SIZE,
        form=handle.attention, cache_dtype=getattr(args, "kv_cache_dtype", "auto"), mtp=bool(spec_k),
        max_batched_tokens=getattr(args, "max_batched_tokens", None) or 2048,
        max_batch=getattr(args, "max_batch", None) or 256, params_or_shapes=handle.params,
        attention_kernel=attention_kernel_serves(handle, getattr(args, "kv_cache_dtype", "auto")),
        long_prefill=0 < long_from < max_model_len)


def attention_kernel_serves(handle: Any, kv_cache_dtype: str | None) -> bool:
    """Whether the engine's attention over this handle's cache runs the Pallas MLA kernel, which never
    materializes scores over the context (plan.activation_estimate counts them otherwise): the absorbed
    form, kernels "pallas", DeepSeek's widths, and a bf16 cache or FP8 pages (the FP8-page kernel, issue
    28; counting an FP8 cache as the reference reserved 22.6 GB a device for scores at 163,840 tokens on
    tensor=8, against 1.2 GB)."""
    import jax.numpy as jnp

    from dsv3_jax.model import kernel_dispatch, layout
    from dsv3_jax.model import kv_cache as cache

    cfg = handle.config
    dtype = layout.kv_cache_dtype(cfg, kv_cache_dtype)
    return (handle.attention == "absorbed" and (layout.is_fp8(dtype) or dtype == jnp.bfloat16)
            and kernel_dispatch.mla_kernel_serves(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cache.PAGE_SIZE,
                                                  handle.trace_options.kernels))


def engine_defaults(handle: Any, args: argparse.Namespace, *, spec_k: int = 0) -> dict[str, int]:
    """EngineConfig sizing fields from the flags and the plan (printed by process 0): what the CLIs
    pass explicitly to every engine they build."""
    out = {k: v for k in ("max_batch", "max_batched_tokens", "kv_cache_dtype")
           if (v := getattr(args, k, None)) is not None}
    p = engine_plan(handle, args, spec_k=spec_k)
    if p is None:
        distributed.main_print("[dsv3_jax] plan: no device memory limit known (CPU; pass --device-memory to "
                               "plan): the KV pool is sized for the requests", file=sys.stderr)
    else:
        distributed.main_print("[dsv3_jax] plan:\n" + p.summary(), file=sys.stderr)
        out["num_pages"] = p.num_pages
    return out


def size_server_pool(handle: Any, args: argparse.Namespace, default_num_pages: int, *,
                     spec_k: int = 0) -> None:
    """The server's hook: with a plan (a device memory known), print it and, unless --num-pages was
    given, size the pool from it (args.num_pages)."""
    p = engine_plan(handle, args, spec_k=spec_k)
    if p is None:
        return
    distributed.main_print("[dsv3_jax.serve] plan:\n" + p.summary(), file=sys.stderr)
    if args.num_pages == default_num_pages:
        args.num_pages = p.num_pages


def warmup_printer(prog: str) -> Any:
    """A `progress` callback for `Engine.warmup`: one stderr line per compiled step program, e.g.
    `[dsv3_jax.serve] warmup [###.....] 3/8: step tokens=256 rows=256 full compiled in 12.3 s`, and the
    total wall time (from this call) after the last one."""
    import time

    t0 = time.perf_counter()

    def report(done: int, total: int, key: Any, seconds: float) -> None:
        mode = "full" if key.full else "greedy"
        bar = "#" * done + "." * (total - done)
        print(f"[{prog}] warmup [{bar}] {done}/{total}: step tokens={key.tokens} rows={key.rows} {mode} "
              f"compiled in {seconds:.1f} s", file=sys.stderr, flush=True)
        if done == total:
            print(f"[{prog}] warmup done: {total} step programs, {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    return report
