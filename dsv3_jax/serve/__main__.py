"""`python -m dsv3_jax.serve` (console script `dsv3-serve`): the OpenAI-compatible HTTP server.

Owns: flag parsing (vLLM's spellings first, ours as aliases: `dsv3-serve MODEL_DIR --tensor-parallel-size 8
--max-num-seqs 64 ...`), loading the model (the embedded default without one), sizing the engine from
the flags (the EngineConfig fields), the server's options (`app.ServerOptions`: API keys, CORS, body
limit, model names, parsers, --max-model-len), warming the compiled steps before the port opens, and
running uvicorn with a drain on SIGINT/SIGTERM (`run_server`: the first signal stops accepting and lets
requests in flight finish for up to --drain-timeout seconds, then fails them; a second one fails them
now; either way the engine thread is joined and the process exits 0, no traceback).
Bad flags or a missing checkpoint give one line on stderr and exit code 2, no traceback.
Must not implement routes (app.py) or the engine loop (runner.py).
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

EXIT_BAD_INPUT = 2
DEFAULT_MAX_BODY_BYTES = 32 << 20  # a 128K-token conversation as JSON is a few MB; 32 MiB leaves room
log = logging.getLogger("dsv3_jax.serve")


def _parser() -> argparse.ArgumentParser:
    from dsv3_jax.engine.api import EngineConfig
    from dsv3_jax.parallel import flags as parallel_cli

    d = EngineConfig()
    p = argparse.ArgumentParser(prog="python -m dsv3_jax.serve",
                                description="Serve a DeepSeek-V3-class model over the OpenAI HTTP API.")
    parallel_cli.add_model_args(p)  # MODEL_DIR, --model, --ckpt
    p.add_argument("--mesh", help="e.g. data=1,tensor=8,expert=1")
    p.add_argument("--attention", choices=["absorbed", "naive"], default="absorbed")
    p.add_argument("--dtype", help="override the checkpoint dtype (e.g. float32, bfloat16)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model ids clients may send; the first is the one responses name (default: the "
                        "checkpoint directory's name)")
    a = p.add_argument_group("access")
    a.add_argument("--api-key", action="append", metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every /v1 route (repeatable; default: "
                        "$DSV3_API_KEY; /health and /metrics stay open)")
    a.add_argument("--allowed-origins", metavar="LIST",
                   help="CORS origins allowed to call the API: a JSON list or comma-separated, e.g. "
                        "'[\"*\"]' (default: none, no CORS headers; vLLM's default is '*')")
    a.add_argument("--allowed-methods", metavar="LIST", default="*", help="CORS methods (default *)")
    a.add_argument("--allowed-headers", metavar="LIST", default="*", help="CORS headers (default *)")
    a.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    a.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES >> 20} MiB)")
    o = p.add_argument_group("prompts and outputs")
    o.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file, or the template itself) instead of the checkpoint's")
    o.add_argument("--tool-call-parser", choices=["auto", "deepseek_v31", "deepseek_v3"], default="auto",
                   help="the tool-call format the model writes: deepseek_v31 (`NAME<｜tool▁sep｜>JSON`), "
                        "deepseek_v3 (V3-0324: `function<｜tool▁sep｜>NAME` + a ```json block); auto: from "
                        "the chat template")
    o.add_argument("--reasoning-parser", choices=["deepseek_v3", "deepseek_r1", "none"],
                   default="deepseek_v3",
                   help="deepseek_v3: the output is reasoning until </think> when the request turns thinking "
                        "on (chat_template_kwargs); deepseek_r1: always; none: no split, all content")
    o.add_argument("--seed", type=int, default=None,
                   help="seeds the per-request seeds of requests that give none (reproducible runs)")
    o.add_argument("--disable-log-requests", action="store_true",
                   help="no one-line log per finished request (logger dsv3_jax.serve.requests)")
    g = p.add_argument_group("engine sizing (EngineConfig)")
    g.add_argument("--num-pages", type=int, default=d.num_pages, help="KV-cache pages (page 0 is scratch)")
    g.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, default=d.max_batch,
                   help="sequences per engine step")
    g.add_argument("--max-num-batched-tokens", "--max-batched-tokens", dest="max_batched_tokens", type=int,
                   default=d.max_batched_tokens, help="tokens per engine step")
    g.add_argument("--chunk-size", type=int, default=d.chunk_size, help="longest prefill chunk per step")
    g.add_argument("--no-enable-prefix-caching", "--no-prefix-caching", dest="no_prefix_caching",
                   action="store_true", help="do not reuse cached prompt pages")
    g.add_argument("--num-speculative-tokens", "--spec-k", dest="spec_k", type=int, default=0,
                   help="MTP draft tokens per step (0 = off, up to 3)")
    g.add_argument("--speculative-config", dest="spec_k", type=parallel_cli.speculative_config,
                   metavar="JSON", help="vLLM's form of the same: "
                   '\'{"method": "deepseek_mtp", "num_speculative_tokens": K}\'')
    g.add_argument("--token-buckets", type=_ints,
                   help="extra mixed/prefill step capacities below --max-num-batched-tokens, e.g. 512 (each "
                        "adds two compiled programs)")
    g.add_argument("--row-buckets", type=_ints,
                   help="decode step capacities below --max-num-seqs (default 4,32; each adds two programs)")
    g.add_argument("--prefill-attention-pairs", type=int, default=d.prefill_attention_pairs, metavar="PAIRS",
                   help="while decode rows share a step, its prefill chunks attend at most this many (query, "
                        "key) pairs (0 = no cap); 1048576 kept decoders' p99 ITL within 2x beside a 128K "
                        "prompt on an H100 (benchmarks/RESULTS.md)")
    g.add_argument("--long-prefill-from", type=int, default=d.long_prefill_from, metavar="TOKENS",
                   help="a prompt's chunk past this prefix, alone in its step, attends in naive form "
                        "(expanded K/V, cuDNN flash attention): faster long prompts, one more program "
                        "(default %(default)s; 0 = off)")
    p.add_argument("--max-pending", type=int, default=None,
                   help="requests in flight before new ones get 429 (default: 4 x --max-num-seqs)")
    p.add_argument("--no-warmup", "--enforce-eager", dest="no_warmup", action="store_true",
                   help="compile step programs on first use instead of all before the port opens (vLLM's "
                        "--enforce-eager skips its start-up graph capture the same way: faster start, slower "
                        "first requests)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGINT/SIGTERM, let requests in flight finish for up to S seconds, then fail "
                        "them (a second signal fails them at once; default 30)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parallel_cli.add_flags(p, engine_sizing=False)  # -tp/-dp, --gpu-memory-utilization, multi-process
    return p


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(sorted(values))


def _list(text: str | None, flag: str) -> list[str]:
    """A JSON list (vLLM's form) or comma-separated values."""
    import json

    if text is None:
        return []
    s = text.strip()
    if s.startswith("["):
        try:
            value = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not a JSON list ({e.msg})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{flag}: expected a list of strings, got {s!r}")
        return value
    return [v.strip() for v in s.split(",") if v.strip()]


def engine_config(args: argparse.Namespace) -> Any:
    from dsv3_jax.engine.api import EngineConfig

    extra = {k: getattr(args, k) for k in ("token_buckets", "row_buckets", "kv_cache_dtype")
             if getattr(args, k, None) is not None}
    return EngineConfig(num_pages=args.num_pages, max_batch=args.max_batch, chunk_size=args.chunk_size,
                        prefix_caching=not args.no_prefix_caching, spec_k=args.spec_k,
                        max_batched_tokens=args.max_batched_tokens, long_prefill_from=args.long_prefill_from,
                        prefill_attention_pairs=args.prefill_attention_pairs, **extra)


def check_args(args: argparse.Namespace) -> None:
    """The serve-only flags, checked before anything loads (ValueError naming the flag)."""
    from dsv3_jax.parallel import flags as parallel_cli

    parallel_cli.resolve_model(args)
    if args.max_pending is not None and args.max_pending < 1:
        raise ValueError(f"--max-pending must be >= 1, got {args.max_pending}")
    if args.max_request_body_bytes < 1024:
        raise ValueError(f"--max-request-body-bytes must be >= 1024, got {args.max_request_body_bytes}")
    if args.prefill_attention_pairs < 0:
        raise ValueError(f"--prefill-attention-pairs must be >= 0 (0: no cap), "
                         f"got {args.prefill_attention_pairs}")
    if args.long_prefill_from < 0:
        raise ValueError(f"--long-prefill-from must be >= 0 tokens (0: off), got {args.long_prefill_from}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be a non-negative integer, got {args.seed}")
    if any(not k for k in args.api_key or []):
        raise ValueError("--api-key: an empty key would let anyone in")
    if args.chat_template is not None:  # read and parsed now: a bad template is refused before loading
        args.chat_template = parallel_cli.load_chat_template(args.chat_template)
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        _list(getattr(args, flag), "--" + flag.replace("_", "-"))


def load_handle(args: argparse.Namespace) -> Any:
    from dsv3_jax import api

    if args.ckpt is None:
        print("[dsv3_jax.serve] no MODEL_DIR: serving the embedded default model", file=sys.stderr)
    elif not args.ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {args.ckpt}")
    return api.load(args.ckpt, mesh=args.mesh, attention=args.attention, dtype=args.dtype,
                    n_activated_experts=args.n_activated_experts)


def server_options(args: argparse.Namespace, handle: Any) -> Any:
    """app.ServerOptions from the flags (and $DSV3_API_KEY)."""
    from dsv3_jax.serve.app import ServerOptions
    from dsv3_jax.serve.parsers import detect_tool_format

    keys = list(args.api_key or [])
    if not keys and os.environ.get("DSV3_API_KEY"):
        keys = [os.environ["DSV3_API_KEY"]]
    names = list(args.served_model_name or [args.ckpt.name if args.ckpt else "dsv3-default"])
    tool_format = args.tool_call_parser
    if tool_format == "auto":
        tool_format = detect_tool_format(handle.tokenizer.chat_template if handle.tokenizer else None)
    return ServerOptions(
        model_names=tuple(names), api_keys=tuple(keys),
        allowed_origins=tuple(_list(args.allowed_origins, "")),
        allowed_methods=tuple(_list(args.allowed_methods, "")),
        allowed_headers=tuple(_list(args.allowed_headers, "")), allow_credentials=args.allow_credentials,
        max_body_bytes=args.max_request_body_bytes, max_model_len=args.max_model_len, seed=args.seed,
        log_requests=not args.disable_log_requests, tool_format=tool_format,
        reasoning_parser=args.reasoning_parser)


def build(args: argparse.Namespace, handle: Any = None):
    """(FastAPI app, runner) for parsed flags; the runner's thread is started and the steps warmed."""
    from dsv3_jax.serve.app import Service, create_app
    from dsv3_jax.serve.metrics import Metrics
    from dsv3_jax.serve.runner import EngineRunner

    handle = handle if handle is not None else load_handle(args)
    if args.chat_template is not None and handle.tokenizer is not None:
        handle.tokenizer.chat_template = args.chat_template
    cfg = engine_config(args)
    opts = server_options(args, handle)
    metrics = Metrics(opts.model_names[0], spec_decode=cfg.spec_k > 0)
    runner = EngineRunner(handle, cfg, max_pending=args.max_pending or 4 * cfg.max_batch, metrics=metrics)
    if not args.no_warmup:
        t0 = time.perf_counter()
        warm(runner)
        print(f"[dsv3_jax.serve] engine warmed in {time.perf_counter() - t0:.1f} s: every step program "
              "compiled, none compiles while serving", file=sys.stderr)
    svc = Service(handle, runner, metrics, opts.model_names[0], options=opts)
    svc.warm_host()
    runner.start()
    return create_app(svc), runner


def warm(runner: Any) -> None:
    """Compile every step program the engine can use (`Engine.warmup()`: every reachable (tokens, rows)
    shape, greedy and full, so the default request (temperature from generation_config), logprobs, n
    and multi-row prefills all run compiled) before the port opens, with a progress line per program."""
    from dsv3_jax.parallel.flags import warmup_printer

    runner.engine.warmup(progress=warmup_printer("dsv3_jax.serve"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: may resolve anywhere


class _DrainingServer:
    """uvicorn.Server with our signal policy (see the module docstring); built lazily (uvicorn import)."""

    @staticmethod
    def make(config: Any, runner: Any, drain_timeout: float) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            def __init__(self) -> None:
                super().__init__(config)
                self.signals = 0
                self._timer: threading.Timer | None = None

            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown (a
                # KeyboardInterrupt traceback and a non-zero exit for what is a requested stop).
                self.signals += 1
                if self.signals == 1:
                    log.warning("%s: draining %d request(s) in flight for up to %.0f s (again: stop now)",
                                signal.Signals(sig).name, runner.pending, drain_timeout)
                    self.should_exit = True
                    self._timer = threading.Timer(drain_timeout, self._stop_engine, ("drain timeout",))
                    self._timer.daemon = True
                    self._timer.start()
                elif self.signals == 2:
                    log.warning("%s again: failing %d request(s) in flight now", signal.Signals(sig).name,
                                runner.pending)
                    self._stop_engine("second signal")
                else:
                    self.force_exit = True

            def _stop_engine(self, why: str) -> None:
                if runner.pending:
                    log.warning("%s: failing %d request(s) still in flight", why, runner.pending)
                runner.abort()  # every request gets its final (error) delta; handlers finish; sockets close

        return Server()


def run_server(app: Any, runner: Any, *, host: str, port: int, drain_timeout: float,
               log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM, drain (see the module docstring), stop the engine thread; 0 when the
    engine thread ended, 1 when it did not within 30 s (then the process exits hard: a thread inside a
    device call cannot be interrupted)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=drain_timeout + 10)  # uvicorn's own last resort
    server = _DrainingServer.make(config, runner, drain_timeout)
    try:
        server.run()
    finally:
        runner.abort()
        runner.join(30.0)
    if runner.alive:
        log.error("the engine thread did not stop within 30 s; exiting without waiting for it")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


def main(argv: list[str] | None = None) -> int:
    # The server tokenizes one request per call on its own threads: the tokenizer's internal thread pool
    # would only compete with them (and makes it warn about forks).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dsv3_jax.config import ConfigError
    from dsv3_jax.engine.api import EngineConfig
    from dsv3_jax.parallel import flags as parallel_cli
    from dsv3_jax.parallel.distributed import DistributedError

    ls = None  # the engine's lockstep.Lockstep when several processes (hosts) run this command
    try:
        check_args(args)
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
    # The startup heap (the model's pytrees, jax's caches, the tokenizer: ~340K objects for the embedded
    # model) leaves the garbage collector: a full collection of it holds the GIL ~0.2 s on a CPU box, a
    # stall of every stream whenever one triggers while serving. vLLM freezes its startup heap the same way.
    gc.collect()
    gc.freeze()
    opts = app.state.svc.options
    if not opts.api_keys and not is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who can reach this port can use the model "
                    "(give --api-key or $DSV3_API_KEY)", args.host)
    try:
        return run_server(app, runner, host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                          log_level=args.log_level)
    finally:
        if ls is not None:
            ls.finish()


if __name__ == "__main__":
    sys.exit(main())
