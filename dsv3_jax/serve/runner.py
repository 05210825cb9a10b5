"""The engine thread: one long-lived Engine stepping while there is work, fed by a thread-safe queue.

Owns: the only thread that calls the Engine (ENGINE_API.md: it is single-threaded), the command queue
from the HTTP handlers (add / cancel / stop), the per-request asyncio queues back to them (filled with
`loop.call_soon_threadsafe`), the admission bound (429 instead of an unbounded backlog), engine
failures turned into per-request errors, and the engine-side gauges (batch, pages, prefix hits, MTP).
Must not know HTTP, JSON or text: it moves token ids and finish reasons.

Items a submission's queue receives, each prefixed by its `tag`, in order: zero or more
`("tokens", ids, logprobs)`, then exactly one `("done", finish_reason, cached_tokens, error)`. A request
the engine refuses (e.g. too long for the page pool) gets `("done", "rejected", 0, message)` only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dsv3_jax.engine.core import Engine, EngineConfig

log = logging.getLogger(__name__)

_STATS_EVERY_S = 0.25  # engine_stats() walks finished requests: refresh gauges at most this often
_KEEP_FINISHED = 256  # finished requests kept in the engine (its MTP-acceptance statistic reads them)


class Overloaded(RuntimeError):
    """The admission bound is reached: the caller answers 429."""


@dataclasses.dataclass(eq=False)
class Submission:
    """One engine request as seen by its HTTP handler."""

    prompt: list[int]
    params: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    tag: int = 0  # lets several submissions share one queue (the n choices of one HTTP request)
    rid: int | None = None
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)

    def _put(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.tag, *item))
        except RuntimeError:  # the handler's loop is closed (server shutting down): nobody listens
            pass


class EngineRunner:
    """Owns the Engine and its thread. `submit` / `cancel` are safe from any thread."""

    def __init__(self, handle: Any, config: EngineConfig, *, max_pending: int, metrics: Any = None,
                 engine_factory: Callable[[Any, EngineConfig], Any] = Engine):
        self.handle, self.config, self.max_pending, self.metrics = handle, config, max_pending, metrics
        self._new_engine = engine_factory  # tests pass a scripted stand-in with the same contract
        self.engine = engine_factory(handle, config)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[int, Submission] = {}
        self._pending = 0  # submitted and not yet done (waiting, running, or still in the command queue)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="dsv3-engine", daemon=True)
        self._last_stats = 0.0
        self._prev_steps = self._prev_batch_total = 0.0
        self.steps = 0
        self.error: str | None = None

    # ---------------------------------------------------------------- any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._cmds.put(("stop", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, prompt: list[int], params: dict[str, Any], loop: asyncio.AbstractEventLoop, *,
               out_queue: asyncio.Queue | None = None, tag: int = 0) -> Submission:
        """Queue one engine request (keyword `params` of Engine.add_request); Overloaded at the bound."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise Overloaded(f"server busy: {self._pending} requests in flight "
                                 f"(bound {self.max_pending})")
            self._pending += 1
        sub = Submission(prompt, params, loop, out_queue if out_queue is not None else asyncio.Queue(), tag)
        self._cmds.put(("add", sub))
        return sub

    def cancel(self, sub: Submission) -> None:
        self._cmds.put(("cancel", sub))

    def status(self) -> dict[str, Any]:
        """A cheap snapshot for /health (plain reads of ints and lengths; no engine call)."""
        pool = self.engine.pool
        return {"pending": self._pending, "waiting": len(self.engine.waiting),
                "running": len(self.engine.running), "pages_used": pool.num_used,
                "pages_free": pool.num_free, "pages_total": pool.num_pages - 1, "steps": self.steps}

    # ---------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        while True:
            idle = not self.engine.has_work()
            try:
                cmds = [self._cmds.get(block=idle, timeout=None if idle else 0)]
            except queue.Empty:
                cmds = []
            while True:  # drain everything queued, so one step sees all new arrivals
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            for kind, sub in cmds:
                if kind == "stop":
                    self._fail_all("server shutting down")
                    return
                if kind == "add":
                    self._add(sub)
                elif kind == "cancel":
                    self._cancel(sub)
            if self.engine.has_work():
                self._step()

    def _add(self, sub: Submission) -> None:
        try:
            sub.rid = self.engine.add_request(sub.prompt, **sub.params)
        except (ValueError, TypeError) as e:  # the engine's own validation (pages, context, sampling)
            self._done(sub, "rejected", 0, str(e))
            return
        self._subs[sub.rid] = sub

    def _cancel(self, sub: Submission) -> None:
        if sub.rid is None or sub.rid not in self._subs:
            return  # already finished (or refused): nothing to free
        self.engine.cancel(sub.rid)
        self._subs.pop(sub.rid)
        self._done(sub, "cancelled", self._cached(sub.rid), None)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - any engine failure must reach the clients, not kill the thread
            log.exception("engine step failed; failing %d requests, starting a fresh engine", len(self._subs))
            self.error = f"{type(e).__name__}: {e}"
            self._fail_all(f"engine error: {self.error}")
            self.engine = self._new_engine(self.handle, self.config)
            return
        self.steps += 1
        for ev in events:
            sub = self._subs.get(ev.rid)
            if sub is None:
                continue
            lps = getattr(ev, "logprobs", None)
            if ev.new_tokens:
                sub._put(("tokens", list(ev.new_tokens), lps))
            if ev.finished:
                self._subs.pop(ev.rid)
                req = self.engine.finished.get(ev.rid)
                reason = getattr(ev, "finish_reason", None) or (req.finish_reason if req else "stop")
                error = getattr(ev, "error", None) or (getattr(req, "error", None) if req else None)
                self._done(sub, reason, self._cached(ev.rid), error)
        self._trim_finished()
        self._update_gauges()

    def _cached(self, rid: int) -> int:
        req = self.engine.finished.get(rid)
        return int(getattr(req, "cached_tokens", 0) or 0) if req is not None else 0

    def _done(self, sub: Submission, reason: str, cached: int, error: str | None) -> None:
        with self._lock:
            self._pending -= 1
        sub._put(("done", reason, cached, error))

    def _fail_all(self, message: str) -> None:
        for rid, sub in list(self._subs.items()):
            self._subs.pop(rid)
            self._done(sub, "error", 0, message)

    def _trim_finished(self) -> None:
        fin = self.engine.finished
        while len(fin) > _KEEP_FINISHED:
            del fin[next(iter(fin))]

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        now = time.perf_counter()
        m.running.set(len(self.engine.running))
        m.waiting.set(len(self.engine.waiting))
        pool = self.engine.pool
        m.page_usage.set(pool.num_used / max(pool.num_pages - 1, 1))
        if now - self._last_stats < _STATS_EVERY_S:
            return
        self._last_stats = now
        st = self.engine.engine_stats()
        steps, total = float(st["steps"]), float(st["mean_batch"]) * float(st["steps"])
        if steps > self._prev_steps:  # mean sequences per step since the last refresh
            m.batch_size.set((total - self._prev_batch_total) / (steps - self._prev_steps))
        self._prev_steps, self._prev_batch_total = steps, total
        m.prefix_hit_rate.set(float(st["prefix_hit_rate"]))
        m.compiles.set(float(st["compiles"]))
        m.compiles_after_warmup.set(float(st["compiles_after_warmup"]))
        acc = st.get("mtp_acceptance")
        if acc is not None and acc == acc:  # None / NaN: nothing proposed yet
            m.mtp_acceptance.set(float(acc))
