"""Multi-host lockstep for the serving engine: process 0 schedules, every other process replays its steps.

With a mesh spanning several processes, every process must run the same compiled programs with the same
inputs in the same order. Process 0 alone holds requests, schedules and reads results; before each
device operation it sends that operation's host inputs through distributed.StepChannel, and the other
processes (`follow`) rebuild the same engine and replay exactly those operations. Followers therefore
need neither the prompts nor the tokenizer, and the server's request handling stays on process 0.

Owns: the process's channel (`activate`, once after distributed.initialize), the hooks the engine calls
(`announce` when an engine is built, `warmup` before it compiles its programs, `step` before each device
step, `clear` before pages are zeroed),
`finish` / `fail` (process 0 ends the followers), and `follow`, the followers' loop. Single process:
every hook is a no-op. Must not schedule (engine.py, scheduler.py) nor move bytes itself (distributed.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from dsv3_jax.parallel import distributed

log = logging.getLogger(__name__)

_channel: distributed.StepChannel | None = None


def activate() -> bool:
    """Open the engine channel when this program runs as several processes; True if it did."""
    import jax

    global _channel
    if jax.process_count() > 1 and _channel is None:
        _channel = distributed.StepChannel("engine")
    return _channel is not None


def active() -> bool:
    return _channel is not None


def is_follower() -> bool:
    return _channel is not None and not _channel.is_leader


def _send(op: str, arrays: Mapping[str, np.ndarray]) -> None:
    if _channel is not None and _channel.is_leader:
        _channel.send({"op": np.frombuffer(op.encode(), np.uint8), **arrays})


def _config_bytes(config: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(dataclasses.asdict(config)).encode(), np.uint8)


def announce(config: Any) -> None:
    """Process 0 built an engine with `config` (an EngineConfig): followers build the same one."""
    _send("engine", {"config": _config_bytes(config)})


def step(key: tuple, ints: np.ndarray, floats: np.ndarray) -> None:
    """Process 0 is about to run the compiled step `key` on these inputs."""
    _send("step", {"key": np.asarray(key, np.int64), "ints": ints, "floats": floats})


def warmup(max_rows: int | None, max_tokens: int | None, modes: tuple[str, ...]) -> None:
    """Process 0 is about to compile these step programs (Engine.warmup): followers compile the same
    ones, so neither side compiles while the other waits in a step."""
    spec = {"max_rows": max_rows, "max_tokens": max_tokens, "modes": list(modes)}
    _send("warmup", {"spec": np.frombuffer(json.dumps(spec).encode(), np.uint8)})


def clear(pages: np.ndarray) -> None:
    """Process 0 is about to zero these physical pages."""
    _send("clear", {"pages": np.asarray(pages, np.int32)})


def finish() -> None:
    """Process 0 is done: followers return from `follow`."""
    if _channel is not None and _channel.is_leader:
        _channel.close()


def fail(message: str) -> None:
    """Process 0 failed: followers raise DistributedError with its message."""
    if _channel is not None and _channel.is_leader:
        _channel.fail(message)


def follow(handle: Any) -> int:
    """A follower's whole life: replay process 0's engine operations until it finishes. Returns the
    number of steps replayed; raises distributed.DistributedError when process 0 failed."""
    from dsv3_jax.engine.core import Engine, EngineConfig
    from dsv3_jax.engine.step import StepKey

    if not is_follower():
        raise distributed.DistributedError("follow() runs on processes other than 0 of a multi-process run")
    engine, steps = None, 0
    while (msg := _channel.receive()) is not None:
        op = msg["op"].tobytes().decode()
        if op == "engine":
            fields = json.loads(msg["config"].tobytes().decode())
            for name in ("token_buckets", "row_buckets"):
                fields[name] = tuple(fields.get(name) or ())
            engine = Engine(handle, EngineConfig(**fields))
        elif op == "warmup":
            spec = json.loads(msg["spec"].tobytes().decode())
            engine.warmup(spec["max_rows"], spec["max_tokens"], tuple(spec["modes"]))
        elif op == "step":
            engine.execute(StepKey(*(int(x) if i < 4 else bool(x) for i, x in enumerate(msg["key"]))),
                           msg["ints"], msg["floats"])
            steps += 1
        elif op == "clear":
            engine.clear_pages(msg["pages"])
        else:
            raise distributed.DistributedError(f"unknown lockstep operation {op!r} from process 0")
    log.info("follower done after %d steps", steps)
    return steps
