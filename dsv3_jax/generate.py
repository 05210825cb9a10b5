"""`python -m dsv3_jax.generate`: generation and chat from the command line.

Owns: flag parsing (vLLM's spellings first: MODEL_DIR, --num-speculative-tokens, --enforce-eager, the
shared ones in parallel/flags.py) and checking every flag before loading (--dtype spellings and --mesh
via cli.py,
sampling values and the seed range), reading prompts (--prompt, --input-file: UTF-8 with or without
BOM, lines or JSONL, --interactive REPL), streaming to the terminal, --json output, and turning bad
input into one line on stderr with a non-zero exit (no traceback), and the engine sizing the flags and
the memory plan fix (passed to `handle.generate` as `sizing`, never stored on the handle).
Must not implement requests or decoding (request_stream.py, engine/) or loading (api.py).
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsv3_jax.cli import EXIT_BAD_INPUT  # noqa: F401 - re-exported for callers


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsv3_jax.generate",
                                description="Generate text with a DeepSeek-V3-class model.")
    from dsv3_jax.parallel import flags as parallel_cli

    parallel_cli.add_model_args(p)  # MODEL_DIR, --model, --ckpt
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--input-file", type=Path, help="one prompt per line, or JSONL with prompt/messages")
    src.add_argument("--interactive", action="store_true", help="multi-turn chat REPL")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--thinking", action="store_true", help="chat template's thinking mode")
    p.add_argument("--system", help="system prompt for --chat / --interactive")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, help="0 = greedy (default: generation_config.json)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--mesh", help="e.g. data=1,tensor=8,expert=1")
    p.add_argument("--attention", choices=["absorbed", "naive"], default="absorbed")
    p.add_argument("--dtype", help="compute dtype: bf16 (bfloat16), fp16 or fp32 (float32); default: the "
                                   "checkpoint's. FP8 weights stay FP8")
    p.add_argument("--num-speculative-tokens", "--mtp", dest="mtp", type=int, default=0, metavar="K",
                   help="speculative decoding with K MTP draft tokens per step (0 = off, up to 3)")
    p.add_argument("--speculative-config", dest="mtp", type=parallel_cli.speculative_config, metavar="JSON",
                   help="vLLM's form of the same: "
                        '\'{"method": "deepseek_mtp", "num_speculative_tokens": K}\'')
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file, or the template itself) instead of the checkpoint's")
    p.add_argument("--stats", action="store_true", help="print per-request and engine metrics")
    p.add_argument("--no-warmup", "--enforce-eager", dest="no_warmup", action="store_true",
                   help="compile step programs on first use instead of all before the first token (vLLM's "
                        "--enforce-eager skips its start-up graph capture the same way)")
    p.add_argument("--json", action="store_true", help="print machine-readable results (JSON lines)")
    parallel_cli.add_flags(p)  # --tensor-parallel-size/-tp, --data-parallel-size, capacity, multi-process
    return p


def _load(args: argparse.Namespace):
    from dsv3_jax import api

    if args.ckpt is None:
        from dsv3_jax.parallel.distributed import main_print

        main_print("[dsv3_jax] no --ckpt: the embedded default model, a small DeepSeek-V3 (MLA at the real "
                   "widths, MoE, MTP, YaRN; 19M parameters) trained for 5 minutes on the Python standard "
                   "library: it writes Python-looking code, nothing more", file=sys.stderr)
        return api.load(None, mesh=args.mesh, attention=args.attention, dtype=args.dtype,
                        n_activated_experts=args.n_activated_experts)
    if not args.ckpt.exists():
        raise FileNotFoundError(f"checkpoint not found: {args.ckpt}")
    if not args.ckpt.is_dir():
        raise ValueError(f"--ckpt {args.ckpt} is not a directory")
    return api.load(args.ckpt, mesh=args.mesh, attention=args.attention, dtype=args.dtype,
                    n_activated_experts=args.n_activated_experts)


def _check_flags(args: argparse.Namespace) -> None:
    """Every flag checked before anything is loaded; normalizes --dtype and --mesh in place."""
    from dsv3_jax.cli import check_mesh, compute_dtype_name
    from dsv3_jax.engine.sampling import validate_sampling_params
    from dsv3_jax.parallel import sharding

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    validate_sampling_params(1.0 if args.temperature is None else args.temperature,
                             1.0 if args.top_p is None else args.top_p,
                             0 if args.top_k is None else args.top_k, seed=args.seed)
    if not 0 <= args.mtp <= 3:
        raise ValueError(f"--mtp must be in 0..3, got {args.mtp}")
    if args.dtype is not None:
        args.dtype = compute_dtype_name(args.dtype, "--dtype")
    if args.mesh is not None:
        args.mesh = check_mesh(args.mesh)
        sharding.parse_mesh_spec(args.mesh)  # names the bad axis or size now, not after loading
    from dsv3_jax.parallel import flags as parallel_cli

    parallel_cli.resolve_model(args)
    parallel_cli.check(args)
    if args.chat_template is not None:  # read and parsed now: a bad template is refused before loading
        args.chat_template = parallel_cli.load_chat_template(args.chat_template)
    if any(not s for s in args.stop):
        raise ValueError("--stop: an empty stop string would stop before the first token")


def _read_inputs(args: argparse.Namespace) -> list[Any]:
    if args.prompt is not None:
        return [args.prompt]
    if args.input_file is None:
        raise ValueError("give --prompt, --input-file or --interactive")
    return read_input_file(args.input_file)


def read_input_file(path: Path) -> list[Any]:
    """Prompts from a UTF-8 file (a BOM is skipped): one per line, or JSON lines with a string 'prompt'
    or a list of 'messages'. Every problem names the file and line."""
    if not path.exists():
        raise FileNotFoundError(f"input file not found: {path}")
    if path.is_dir():
        raise ValueError(f"--input-file {path} is a directory, not a file")
    if not (stat.S_ISREG(path.stat().st_mode) or stat.S_ISFIFO(path.stat().st_mode)):  # pipes: `<(cmd)`
        raise ValueError(f"--input-file {path} is not a regular file (a device or a socket)")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    items: list[Any] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from e
            if "messages" in obj:
                if not isinstance(obj["messages"], list) or not obj["messages"]:
                    raise ValueError(f"{path}:{n}: 'messages' must be a non-empty list of messages")
                items.append(obj["messages"])
            elif "prompt" in obj:
                if not isinstance(obj["prompt"], str):
                    raise ValueError(f"{path}:{n}: 'prompt' must be a string, got {obj['prompt']!r:.60}")
                items.append(obj["prompt"])
            else:
                raise ValueError(f"{path}:{n}: a JSON line needs 'prompt' or 'messages'")
        else:
            items.append(line)
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def _to_ids(handle, item: Any, args: argparse.Namespace) -> list[int]:
    from dsv3_jax.text.chat import encode_chat

    if isinstance(item, list) or args.chat:
        msgs = item if isinstance(item, list) else [{"role": "user", "content": item}]
        if args.system and not isinstance(item, list):
            msgs = [{"role": "system", "content": args.system}, *msgs]
        return encode_chat(handle.tokenizer, msgs, add_generation_prompt=True, thinking=args.thinking)
    return handle.tokenizer.encode(item)


def prefill_printer(interval_s: float = 1.0, out: Any = None, clock: Callable[[], float] = time.perf_counter
                    ) -> Callable[[int, int], None]:
    """The CLI's progress line for a long prompt (`handle.generate`'s `prefill_progress`): silent for a
    prefill that ends within `interval_s`, then one line per `interval_s` ("[prefill] 65,536 / 131,072
    prompt tokens (50%), 12.0 s") and a last one when it ends."""
    start, last, shown = None, 0.0, False

    def show(done: int, total: int) -> None:
        nonlocal start, last, shown
        now = clock()
        if start is None:
            start = last = now
        final = done >= total
        if now - last >= interval_s or (final and shown):
            print(f"[prefill] {done:,} / {total:,} prompt tokens ({100 * done // max(total, 1)}%), "
                  f"{now - start:.1f} s", file=out or sys.stderr, flush=True)
            last, shown = now, True

    return show


def _gen_kwargs(args: argparse.Namespace, sizing: dict[str, int]) -> dict[str, Any]:
    from dsv3_jax.parallel.flags import warmup_printer

    # Progress lines on a terminal only: piped stderr keeps the one-line error contract (the warmup runs).
    progress = None if args.no_warmup else (warmup_printer("dsv3_jax.generate") if sys.stderr.isatty()
                                            else lambda *_: None)
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop or None, spec_k=args.mtp, sizing=sizing,
                warmup_progress=progress, prefill_progress=prefill_printer() if sys.stderr.isatty() else None)


def _print_stats(results) -> None:
    def num(x):  # metrics are None where undefined (JSON-safe); print those as nan
        return float("nan") if x is None else x

    for i, r in enumerate(results):
        m = r.metrics
        ttft = num(r.time_to_first_token_s)
        print(f"[stats] request {i}: {len(r.token_ids)} tokens, ttft {ttft * 1e3:.0f} ms, "
              f"inter-token {num(m.get('inter_token_s')) * 1e3:.1f} ms, "
              f"{r.decode_tokens_per_s:.1f} tok/s, prefix-cached {m.get('cached_prompt_tokens', 0)}, "
              f"MTP acceptance {num(m.get('spec_acceptance')):.2f}, "
              f"tokens/step {num(m.get('tokens_per_step')):.2f}", file=sys.stderr)


def _run_batch(handle, args: argparse.Namespace, sizing: dict[str, int]) -> None:
    ids = [_to_ids(handle, it, args) for it in _read_inputs(args)]
    if args.json or len(ids) > 1 or args.stats:
        results = handle.generate(ids, **_gen_kwargs(args, sizing))
        for i, r in enumerate(results):
            if args.json:
                print(json.dumps({"index": i, **r.to_dict()}, ensure_ascii=False))
            else:
                print(f"--- [{i}] ({r.finish_reason})\n{r.text}")
        if args.stats:
            _print_stats(results)
        return
    t0 = time.perf_counter()
    n = 0
    for piece in handle.generate(ids[0], stream=True, **_gen_kwargs(args, sizing)):
        print(piece, end="", flush=True)
        n += 1
    print(f"\n[{n} pieces in {time.perf_counter() - t0:.2f} s]", file=sys.stderr)


def _run_interactive(handle, args: argparse.Namespace, sizing: dict[str, int]) -> None:
    from dsv3_jax.text.chat import encode_chat

    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("interactive chat: empty line or Ctrl-D quits, /reset clears the history", file=sys.stderr)
    while True:
        try:
            user = input("you> ")
        except EOFError:
            break
        if not user.strip():
            break
        if user.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": user})
        ids = encode_chat(handle.tokenizer, history, add_generation_prompt=True, thinking=args.thinking)
        print("assistant> ", end="", flush=True)
        reply = "".join(print(p, end="", flush=True) or p
                        for p in handle.generate(ids, stream=True, **_gen_kwargs(args, sizing)))
        print()
        history.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    import jinja2

    from dsv3_jax.cli import report_error
    from dsv3_jax.parallel.distributed import DistributedError
    from dsv3_jax.request_stream import GenerationError

    args = _parser().parse_args(argv)
    ls = None  # the engine's lockstep.Lockstep when several processes run this command
    try:
        _check_flags(args)
        if args.input_file is not None:
            n = len(_read_inputs(args))  # read (and refused) before the model is loaded
            from dsv3_jax.engine.sampling import validate_sampling_params

            validate_sampling_params(1.0, 1.0, 0, seed=args.seed + n - 1)  # prompt i samples with seed + i
        from dsv3_jax.parallel import flags as parallel_cli

        ls = parallel_cli.start(args)  # jax.distributed (and the lockstep) when several processes run this
        handle = _load(args)
        if ls is not None and ls.is_follower:  # process 0 owns the prompts and the output; this one replays
            ls.follow(handle)
            return 0
        if ls is not None:
            handle.executor_factory = ls.executor  # its engines announce each device operation
        sizing = parallel_cli.engine_defaults(handle, args, spec_k=args.mtp)  # flags + the plan-sized pool
        from dsv3_jax.engine.executor import enable_compilation_cache

        where = enable_compilation_cache()
        print(f"[dsv3_jax] compilation cache: {where or 'off'} (set DSV3_JAX_CACHE_DIR to move it, 'off' "
              f"to disable)", file=sys.stderr)
        if handle.tokenizer is None:
            raise ValueError(f"{args.ckpt}: no tokenizer.json in the checkpoint; the CLI needs one")
        if args.chat_template is not None:
            handle.tokenizer.chat_template = args.chat_template
        if args.interactive:
            _run_interactive(handle, args, sizing)
        else:
            _run_batch(handle, args, sizing)
    except (ValueError, OSError, jinja2.TemplateError) as e:  # ConfigError, CheckpointError, PlanError...
        _stop_followers(ls, e)
        return report_error("generate", e)
    except DistributedError as e:  # a multi-process start-up failed, or process 0 failed (followers)
        report_error("generate", e)
        return 1
    except GenerationError as e:  # the engine stopped a request (e.g. non-finite logits): one line, exit 1
        _stop_followers(ls, e)
        report_error("generate", e)
        return 1
    except KeyboardInterrupt:
        _stop_followers(ls, "interrupted")
        return 130
    if ls is not None:
        ls.finish()
    return 0


def _stop_followers(ls, error: object) -> None:
    """Multi-process: end the other processes with process 0's error (a no-op otherwise)."""
    if ls is not None:
        ls.fail(str(error))


if __name__ == "__main__":
    sys.exit(main())
