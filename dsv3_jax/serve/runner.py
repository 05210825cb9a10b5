"""The engine thread: one long-lived Engine stepping while there is work, fed by a thread-safe queue.

Owns: the only thread that calls the Engine (engine/api.py: an engine is single-threaded), the command
queue from the HTTP handlers (add / cancel / stop), each request's stream state (a
request_stream.RequestStream, fed that request's engine events here), the per-request asyncio queues
back to the handlers (filled with `loop.call_soon_threadsafe`), the admission bound (429 instead of an
unbounded backlog), stopping (`abort`: every request in flight gets its final error delta at once),
engine failures turned into per-request errors, and the engine-side metrics (running / waiting / KV
usage read at scrape time, batch, compiles, preemptions, queue time, MTP drafts). Must not know HTTP or
JSON, nor parse the model's text (app.py, parsers.py).

Why the stream state lives on this thread and not on the event loop: a stop string must cancel the
request in the engine, and only this thread may call the engine. Fed here, a hit cancels before the
next step is scheduled (no tokens computed past it, no late events to filter) and the handler receives
a finished stream; detokenizing is microseconds per token, and with pipelining it runs while the device
computes the next step.

Items a submission's queue receives, in order, each as `(tag, request_stream.Delta)`: zero or more
deltas with new tokens, then exactly one whose `finish_reason` is set (with `cached_tokens`). A request
the engine refuses gets only the final delta: ERROR with `rejected` and the engine's message.
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

from dsv3_jax.engine.api import EngineConfig
from dsv3_jax.engine.core import Engine
from dsv3_jax.request_stream import Delta, RequestStream

log = logging.getLogger(__name__)

_STATS_EVERY_S = 0.25  # engine_stats() walks finished requests: refresh gauges at most this often
_KEEP_FINISHED = 256  # finished requests kept in the engine (its MTP-acceptance statistic reads them)


class Overloaded(RuntimeError):
    """The admission bound is reached: the caller answers 429."""


class EngineDown(RuntimeError):
    """The engine thread has stopped (shut down, or died on a bug): the caller answers 503."""


@dataclasses.dataclass(eq=False)
class Submission:
    """One engine request as seen by its HTTP handler; `stream` is touched by the engine thread only."""

    prompt: list[int]
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    tag: int = 0  # lets several submissions share one queue (the n choices of one HTTP request)
    rid: int | None = None
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    admitted: bool = False  # the engine has scheduled it (its queue time is recorded)

    def _put(self, delta: Delta) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.tag, delta))
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
        self._prev_counts = {"preemptions": 0, "spec_proposed": 0, "spec_accepted": 0}
        self.steps = 0
        self.error: str | None = None
        self.stopping = False  # abort() was called: requests failing now are the server's shutdown
        if metrics is not None:
            metrics.bind_engine(lambda: len(self.engine.running), lambda: len(self.engine.waiting),
                                lambda: self.engine.pool.num_used / max(self.engine.pool.num_pages - 1, 1))

    # ---------------------------------------------------------------- any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.abort()
        self.join(timeout)

    def abort(self) -> None:
        """Stop without waiting: every request in flight (and every one submitted later) gets its final
        delta, ERROR "server shutting down", once the current step returns."""
        self.stopping = True
        self._cmds.put(("stop", None))

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, prompt: list[int], stream: RequestStream, loop: asyncio.AbstractEventLoop, *,
               out_queue: asyncio.Queue | None = None, tag: int = 0) -> Submission:
        """Queue one engine request (checked already: request_stream.check; its parameters are
        `stream.params`); Overloaded at the bound."""
        with self._lock:
            if not self._thread.is_alive():  # nothing would ever answer: refuse instead of hanging
                raise EngineDown(f"engine thread stopped ({self.error or 'shut down'})")
            if self._pending >= self.max_pending:
                raise Overloaded(f"server busy: {self._pending} requests in flight "
                                 f"(bound {self.max_pending})")
            self._pending += 1
        sub = Submission(prompt, stream, loop, out_queue if out_queue is not None else asyncio.Queue(), tag)
        self._cmds.put(("add", sub))
        if not self._thread.is_alive():  # it stopped between the check and the put: answer here
            self._fail_queued(f"engine thread stopped ({self.error or 'shut down'})")
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
        try:
            self._serve()
        except Exception as e:  # a bug outside the step (a stream, the gauges): no client may wait forever
            log.exception("engine thread died; failing %d requests", len(self._subs))
            self.error = f"{type(e).__name__}: {e}"
            self._fail_all(f"engine error: {self.error}")
            self._fail_queued(f"engine error: {self.error}")

    def _serve(self) -> None:
        while True:
            idle = not self.engine.has_work()
            if idle:
                self._update_gauges(idle=True)
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
                    self._fail_queued("server shutting down")
                    return
                if kind == "add":
                    self._add(sub)
                elif kind == "cancel":
                    self._cancel(sub)
            if self.engine.has_work():
                self._step()

    def _add(self, sub: Submission) -> None:
        try:
            sub.rid = self.engine.add_request(sub.prompt, **sub.stream.params.engine_kwargs())
        except ValueError as e:  # the engine's own guard (e.g. more pages than one batch shard holds)
            self._done(sub, sub.stream.reject(str(e)))
            return
        self._subs[sub.rid] = sub

    def _cancel(self, sub: Submission) -> None:
        if sub.rid is None or sub.rid not in self._subs:
            return  # already finished (or refused): nothing to free
        self.engine.cancel(sub.rid)
        self._subs.pop(sub.rid)
        self._done(sub, sub.stream.cancel(), self._cached(sub.rid))

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
        if self.metrics is not None:
            self._admissions()
        for ev in events:
            sub = self._subs.get(ev.rid)
            if sub is None:
                continue
            delta = sub.stream.on_event(ev)
            if sub.stream.done:
                if not ev.finished:  # a stop string ended it: free its pages before the next step
                    self.engine.cancel(ev.rid)
                self._subs.pop(ev.rid)
                self._done(sub, delta, self._cached(ev.rid))
            elif delta.token_ids:
                sub._put(delta)
        self._trim_finished()
        self._update_gauges()

    def _cached(self, rid: int) -> int:
        req = self.engine.finished.get(rid)
        return req.cached_tokens if req is not None else 0

    def _done(self, sub: Submission, final: Delta, cached: int = 0) -> None:
        final.cached_tokens = cached
        with self._lock:
            self._pending -= 1
        sub._put(final)

    def _fail_all(self, message: str) -> None:
        for rid, sub in list(self._subs.items()):
            self._subs.pop(rid)
            self._done(sub, sub.stream.fail(message))

    def _fail_queued(self, message: str) -> None:
        """Answer the submissions still in the command queue (added after the thread's last look)."""
        while True:
            try:
                kind, sub = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._done(sub, sub.stream.fail(message))

    def _trim_finished(self) -> None:
        fin = self.engine.finished
        while len(fin) > _KEEP_FINISHED:
            del fin[next(iter(fin))]

    def _admissions(self) -> None:
        """Queue time of the requests this step admitted (submission to the step that first ran them)."""
        now = time.perf_counter()
        for r in self.engine.running:
            sub = self._subs.get(r.rid)
            if sub is not None and not sub.admitted:
                sub.admitted = True
                self.metrics.queue_time.observe(now - sub.submitted_at)

    def _update_gauges(self, idle: bool = False) -> None:
        """The engine's counters into the metrics, at most every _STATS_EVERY_S while busy and once when
        the engine goes idle (running / waiting / KV usage are read at scrape time: metrics.bind_engine)."""
        m = self.metrics
        if m is None:
            return
        now = time.perf_counter()
        if not idle:
            if now - self._last_stats < _STATS_EVERY_S:
                return
            self._last_stats = now
        st = self.engine.engine_stats()
        steps, total = float(st["steps"]), float(st["mean_batch"]) * float(st["steps"])
        if idle:
            m.batch_size.set(0.0)
        elif steps > self._prev_steps:  # mean sequences per step since the last refresh
            m.batch_size.set((total - self._prev_batch_total) / (steps - self._prev_steps))
        self._prev_steps, self._prev_batch_total = steps, total
        m.compiles.set(float(st["compiles"]))
        m.prefill_pending.set(float(st.get("prefill_tokens_pending") or 0))
        m.compiles_after_warmup.set(float(st["compiles_after_warmup"]))
        raw = getattr(self.engine, "stats", {})
        counts = {"preemptions": int(st.get("preemptions") or 0),
                  "spec_proposed": int(raw.get("spec_proposed", 0)),
                  "spec_accepted": int(raw.get("spec_accepted", 0))}
        grew = {k: v - self._prev_counts[k] for k, v in counts.items()}
        if any(v < 0 for v in grew.values()):  # a fresh engine after a failure: its counters start at 0
            grew = counts
        self._prev_counts = counts
        m.preemptions.inc(grew["preemptions"])
        if m.spec_decode:
            m.draft_tokens.inc(grew["spec_proposed"])
            m.accepted_tokens.inc(grew["spec_accepted"])
            acc = st.get("mtp_acceptance")
            if acc is not None and acc == acc:  # None / NaN: nothing proposed yet
                m.mtp_acceptance.set(float(acc))
