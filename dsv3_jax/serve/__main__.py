"""`python -m dsv3_jax.serve` (console script `dsv3-serve`): the OpenAI-compatible HTTP server.

Owns: flag parsing, loading the model (the embedded default without --ckpt), sizing the engine from the
flags (the EngineConfig fields), warming the compiled steps before the port opens, and running uvicorn.
Bad flags or a missing checkpoint give one line on stderr and exit code 2, no traceback.
Must not implement routes (app.py) or the engine loop (runner.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    from dsv3_jax.engine.api import EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(prog="python -m dsv3_jax.serve",
                                description="Serve a DeepSeek-V3-class model over the OpenAI HTTP API.")
    p.add_argument("--ckpt", type=Path, help="converted (or HF) checkpoint dir; default: the embedded model")
    p.add_argument("--mesh", help="e.g. data=1,tensor=8,expert=1")
    p.add_argument("--attention", choices=["absorbed", "naive"], default="absorbed")
    p.add_argument("--dtype", help="override the checkpoint dtype (e.g. float32, bfloat16)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint's name)")
    g = p.add_argument_group("engine sizing (EngineConfig)")
    g.add_argument("--num-pages", type=int, default=d.num_pages, help="KV-cache pages (page 0 is scratch)")
    g.add_argument("--max-batch", type=int, default=d.max_batch, help="sequences per engine step")
    g.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens,
                   help="tokens per engine step")
    g.add_argument("--chunk-size", type=int, default=d.chunk_size, help="longest prefill chunk per step")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt pages")
    g.add_argument("--spec-k", type=int, default=0, help="MTP draft tokens per step (0 = off, up to 3)")
    g.add_argument("--token-buckets", type=_ints,
                   help="extra mixed/prefill step capacities below --max-batched-tokens, e.g. 512 (each adds "
                        "two compiled programs)")
    g.add_argument("--row-buckets", type=_ints,
                   help="decode step capacities below --max-batch (default 4,32; each adds two programs)")
    p.add_argument("--max-pending", type=int, default=None,
                   help="requests in flight before new ones get 429 (default: 4 x --max-batch)")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile step programs on first use instead of all before the port opens")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from dsv3_jax.parallel import flags as parallel_cli

    parallel_cli.add_flags(p, engine_sizing=False)  # --tp/--dp/--ep, --memory-fraction, multi-process
    return p


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(sorted(values))




def engine_config(args: argparse.Namespace) -> Any:
    from dsv3_jax.engine.api import EngineConfig

    extra = {k: getattr(args, k) for k in ("token_buckets", "row_buckets") if getattr(args, k) is not None}
    return EngineConfig(num_pages=args.num_pages, max_batch=args.max_batch, chunk_size=args.chunk_size,
                        prefix_caching=not args.no_prefix_caching, spec_k=args.spec_k,
                        max_batched_tokens=args.max_batched_tokens, **extra)


def load_handle(args: argparse.Namespace) -> Any:
    from dsv3_jax import api

    if args.ckpt is None:
        print("[dsv3_jax.serve] no --ckpt: serving the embedded default model", file=sys.stderr)
    elif not args.ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {args.ckpt}")
    return api.load(args.ckpt, mesh=args.mesh, attention=args.attention, dtype=args.dtype,
                    n_activated_experts=args.n_activated_experts)


def build(args: argparse.Namespace, handle: Any = None):
    """(FastAPI app, runner) for parsed flags; the runner's thread is started and the steps warmed."""
    from dsv3_jax.serve.app import Service, create_app
    from dsv3_jax.serve.metrics import Metrics
    from dsv3_jax.serve.runner import EngineRunner

    if args.max_pending is not None and args.max_pending < 1:
        raise ValueError(f"--max-pending must be >= 1, got {args.max_pending}")
    handle = handle if handle is not None else load_handle(args)
    cfg = engine_config(args)
    metrics = Metrics()
    runner = EngineRunner(handle, cfg, max_pending=args.max_pending or 4 * cfg.max_batch, metrics=metrics)
    if not args.no_warmup:
        t0 = time.perf_counter()
        warm(runner)
        print(f"[dsv3_jax.serve] engine warmed in {time.perf_counter() - t0:.1f} s: every step program "
              "compiled, none compiles while serving", file=sys.stderr)
    name = args.served_model_name or (args.ckpt.name if args.ckpt else "dsv3-default")
    svc = Service(handle, runner, metrics, name)
    runner.start()
    return create_app(svc), runner


def warm(runner: Any) -> None:
    """Compile every step program the engine can use (`Engine.warmup()`, both modes: requests may be
    greedy or sampled) before the port opens, with a progress line per program."""
    from dsv3_jax.parallel.flags import warmup_printer

    runner.engine.warmup(progress=warmup_printer("dsv3_jax.serve"))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dsv3_jax.config import ConfigError
    from dsv3_jax.engine.api import EngineConfig
    from dsv3_jax.parallel import flags as parallel_cli
    from dsv3_jax.parallel.distributed import DistributedError

    ls = None  # the engine's lockstep.Lockstep when several processes (hosts) run this command
    try:
        parallel_cli.check(args)
        ls = parallel_cli.start(args)  # jax.distributed (and the lockstep) when several processes run this
        handle = load_handle(args)
        if ls is not None and ls.is_follower:  # process 0 serves HTTP; this process replays its engine steps
            ls.follow(handle)
            return 0
        if ls is not None:
            handle.executor_factory = ls.executor  # its engines announce each device operation
        parallel_cli.size_server_pool(handle, args, EngineConfig().num_pages, spec_k=args.spec_k)
        app, runner = build(args, handle)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        if ls is not None:
            ls.fail(str(e))
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import uvicorn

    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        runner.stop()
        if ls is not None:
            ls.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
