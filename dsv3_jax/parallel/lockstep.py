"""Multi-host lockstep for the serving engine: process 0 schedules, every other process replays its device
operations.

With a mesh spanning several processes, every process must run the same compiled programs with the same
inputs in the same order. Process 0 alone holds requests, schedules and reads results: its engines run
on a `LockstepExecutor`, which sends each device operation as one typed message (`Build`, `Warmup`,
`Step`, `Clear`) through a distributed.StepChannel before running it. The other processes (`follow`)
build only an engine/executor.DeviceExecutor (no page pool, no scheduler, no requests) and replay those
messages in order. Followers therefore need neither the prompts nor the tokenizer, and the server's
request handling stays on process 0.

The seam (no module state): `start()`, called by parallel/flags.start once jax.distributed is up,
returns a `Lockstep` over the process's channel (None in a one-process run). The CLI that started it
then, after loading the model, either sets `handle.executor_factory = lockstep.executor` (process 0:
every Engine built over that handle, including a server's fresh one after a failure, sends `Build`
before it allocates, so all processes allocate together, as a cross-process mesh requires) or calls
`lockstep.follow(handle)` (the others). Process 0 ends the followers with `finish()` or `fail(message)`;
one that exits without either fails them on its way out (the channel's exit hook), so no process is left
waiting for a message that never comes while the other sits in JAX's shutdown barrier.

Messages travel as dicts of numpy arrays (distributed.pack), encoded by field name: a StepKey as one
array per field, an EngineConfig as JSON of `dataclasses.asdict`, restored with each field's declared
type (tuples come back as tuples), so a field added to either travels without edits here.

Owns: the messages and their encoding, `LockstepExecutor`, `Lockstep` (the process's channel and its
leader/follower operations) and `follow`, the followers' loop. Must not schedule or hold requests
(engine/core.py, scheduler.py), own device arrays or compiled programs (engine/executor.py), nor move
bytes itself (distributed.py). Imports the engine's executor and contract only, never its core.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dsv3_jax.engine.api import EngineConfig
from dsv3_jax.engine.executor import DeviceExecutor, Progress
from dsv3_jax.engine.step import StepKey
from dsv3_jax.parallel import distributed

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- messages
@dataclasses.dataclass(frozen=True)
class Build:
    """Process 0 builds an engine with `config`: build its device side (collective allocation)."""

    config: EngineConfig


@dataclasses.dataclass(frozen=True)
class Warmup:
    """Process 0 compiles these step programs (and the page-clearing one): compile the same ones, so
    neither side compiles while the other waits in a step."""

    keys: tuple[StepKey, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """Process 0 runs the compiled step `key` on these packed host inputs."""

    key: StepKey
    ints: np.ndarray
    floats: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Clear:
    """Process 0 zeroes these physical pages."""

    pages: np.ndarray


Message = Build | Warmup | Step | Clear
_KEY_TYPES = typing.get_type_hints(StepKey)  # field name -> int / bool


def _text(s: str) -> np.ndarray:
    return np.frombuffer(s.encode(), np.uint8)


def _read_text(a: np.ndarray) -> str:
    return a.tobytes().decode()


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    """An EngineConfig from `config_to_json`, each field converted back to its declared type's container
    (JSON has lists only: tuple fields come back as tuples). Unknown fields are an error: process 0 runs
    other code than this process."""
    data = json.loads(text)
    types = typing.get_type_hints(EngineConfig)
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise distributed.DistributedError(f"process 0 sent EngineConfig fields unknown here: {unknown}")
    fields = {k: tuple(v) if typing.get_origin(types[k]) is tuple and v is not None else v
              for k, v in data.items()}
    return EngineConfig(**fields)


def _keys_to_arrays(prefix: str, keys: Sequence[StepKey]) -> dict[str, np.ndarray]:
    return {f"{prefix}.{name}": np.asarray([getattr(k, name) for k in keys],
                                           np.bool_ if t is bool else np.int64)
            for name, t in _KEY_TYPES.items()}


def _keys_from_arrays(prefix: str, arrays: Mapping[str, np.ndarray]) -> list[StepKey]:
    cols = {name: arrays[f"{prefix}.{name}"].tolist() for name in _KEY_TYPES}
    n = len(next(iter(cols.values())))
    return [StepKey(**{name: t(cols[name][i]) for name, t in _KEY_TYPES.items()}) for i in range(n)]


def encode(msg: Message) -> dict[str, np.ndarray]:
    """A message as named arrays (what distributed.StepChannel carries)."""
    out = {"op": _text(type(msg).__name__)}
    if isinstance(msg, Build):
        out["config"] = _text(config_to_json(msg.config))
    elif isinstance(msg, Warmup):
        out.update(_keys_to_arrays("keys", msg.keys))
    elif isinstance(msg, Step):
        out.update(_keys_to_arrays("key", [msg.key]))
        out["ints"], out["floats"] = np.asarray(msg.ints), np.asarray(msg.floats)
    elif isinstance(msg, Clear):
        out["pages"] = np.asarray(msg.pages, np.int32)
    else:
        raise TypeError(f"not a lockstep message: {msg!r}")
    return out


def decode(arrays: Mapping[str, np.ndarray]) -> Message:
    """The message `encode` made (DistributedError for an operation this process does not know)."""
    op = _read_text(arrays["op"])
    if op == "Build":
        return Build(config_from_json(_read_text(arrays["config"])))
    if op == "Warmup":
        return Warmup(tuple(_keys_from_arrays("keys", arrays)))
    if op == "Step":
        return Step(_keys_from_arrays("key", arrays)[0], arrays["ints"], arrays["floats"])
    if op == "Clear":
        return Clear(arrays["pages"])
    raise distributed.DistributedError(f"unknown lockstep operation {op!r} from process 0")


# ----------------------------------------------------------------------------------------- process 0
class LockstepExecutor:
    """Process 0's executor: announces each device operation to the followers, then runs it on `inner`.
    Implements engine/executor.Executor."""

    def __init__(self, inner: DeviceExecutor, channel: distributed.StepChannel):
        self.inner, self.channel = inner, channel

    @property
    def width(self) -> int:
        return self.inner.width

    @property
    def stats(self) -> dict[str, Any]:
        return self.inner.stats

    @property
    def compile_wall_s(self) -> float:
        return self.inner.compile_wall_s

    def execute(self, key: StepKey, ints: np.ndarray, floats: np.ndarray):
        self.channel.send(encode(Step(key, ints, floats)))
        return self.inner.execute(key, ints, floats)

    def clear_pages(self, pages: np.ndarray) -> None:
        self.channel.send(encode(Clear(pages)))
        self.inner.clear_pages(pages)

    def warmup(self, keys: Sequence[StepKey], progress: Progress | None = None,
               workers: int | None = None) -> float:
        keys = tuple(keys)
        self.channel.send(encode(Warmup(keys)))
        return self.inner.warmup(keys, progress, workers)


class Lockstep:
    """This process's part in a multi-process run (from `start`): on process 0 the executor factory and
    the end of the run (`finish`, `fail`), on the others `follow`."""

    def __init__(self, channel: distributed.StepChannel):
        self.channel = channel

    @property
    def is_follower(self) -> bool:
        return not self.channel.is_leader

    def executor(self, handle: Any, config: EngineConfig) -> LockstepExecutor:
        """`handle.executor_factory` on process 0: tell the followers to build (Build), then build."""
        if self.is_follower:
            raise distributed.DistributedError("only process 0 builds engines; the others follow()")
        self.channel.send(encode(Build(config)))
        return LockstepExecutor(DeviceExecutor(handle, config), self.channel)

    def follow(self, handle: Any) -> int:
        return follow(handle, self.channel)

    def finish(self) -> None:
        """Process 0 is done: followers return from `follow` (a no-op on a follower)."""
        if not self.is_follower:
            self.channel.close()

    def fail(self, message: str) -> None:
        """Process 0 failed: followers raise DistributedError with its message (a no-op on a follower)."""
        if not self.is_follower:
            self.channel.fail(message)


def start() -> Lockstep | None:
    """The engine's lockstep when this program runs as several processes (after distributed.initialize);
    None in one process."""
    import jax

    return Lockstep(distributed.StepChannel("engine")) if jax.process_count() > 1 else None


# ----------------------------------------------------------------------------------------- followers
def follow(handle: Any, channel: distributed.StepChannel) -> int:
    """A follower's whole life: replay process 0's device operations on DeviceExecutors of its own (one
    per Build; no pool, no scheduler) until process 0 finishes. Returns the number of steps replayed;
    raises distributed.DistributedError when process 0 failed."""
    if channel.is_leader:
        raise distributed.DistributedError("follow() runs on processes other than 0 of a multi-process run")
    executor: DeviceExecutor | None = None
    steps = 0
    while (arrays := channel.receive()) is not None:
        msg = decode(arrays)
        if isinstance(msg, Build):
            executor = DeviceExecutor(handle, msg.config)
            continue
        if executor is None:
            raise distributed.DistributedError(f"process 0 sent {type(msg).__name__} before any Build")
        if isinstance(msg, Warmup):
            executor.warmup(msg.keys)
        elif isinstance(msg, Step):
            executor.execute(msg.key, msg.ints, msg.floats)
            steps += 1
        else:
            executor.clear_pages(msg.pages)
    log.info("follower done after %d steps", steps)
    return steps
