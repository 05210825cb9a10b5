"""The HTTP side: FastAPI routes of the OpenAI-compatible API over one EngineRunner.

Owns the HTTP concerns only: reading and validating request bodies (errors reshaped to OpenAI's
`{"error": {...}}` with the offending field, never a traceback), building prompts (chat template with
per-request thinking, the V3.1 tool block), wire conventions of parameters (top_k -1, a random seed per
request, n choices), reasoning and tool-call parsing of the streamed text (parsers.py), wire logprobs and
finish reasons, usage, SSE streaming, cancelling on client disconnect, HTTP status codes (`_failure`, the
one mapping), and the HTTP-side metrics (requests, tokens, TTFT, ITL).
Resolving and checking a request's parameters, detokenizing, stop strings and finish reasons are the
request layer's (request_stream.py; its streams run on runner.py's engine thread, which says why).
Must not call the Engine directly (runner.py's thread does) nor define wire shapes (protocol.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv3_jax import request_stream
from dsv3_jax.engine.api import FinishReason, TokenLogprob
from dsv3_jax.request_stream import Delta, RequestInvalid, RequestParams, RequestStream
from dsv3_jax.serve import protocol as P
from dsv3_jax.serve.metrics import CONTENT_TYPE, Metrics
from dsv3_jax.serve.parsers import ChatOutputParser, tool_description
from dsv3_jax.serve.runner import EngineDown, EngineRunner, Overloaded, Submission
from dsv3_jax.text.chat import encode_chat

log = logging.getLogger(__name__)

_SEED_MOD = 2**31  # the engine keeps seeds as int32
_DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks that its client is still there
_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "literal")  # pydantic union branch names


class _Choice:
    """One generated sequence of an HTTP request as the wire sees it: the request layer's deltas (from the
    engine thread) parsed for chat (reasoning, tool calls), wire logprob entries, the OpenAI finish reason."""

    def __init__(self, svc: Service, sub: Submission, *, chat: bool, thinking: bool, tools: bool,
                 num_logprobs: int | None):
        self.svc, self.sub = svc, sub
        self.chat = ChatOutputParser(thinking=thinking, tools=tools) if chat else None
        self.num_logprobs = num_logprobs
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[str, float, list[tuple[str, float]]]] = []
        self.text = ""  # completions only
        self.finish_reason: str | None = None  # the wire's, set by the final delta
        self.failed = self.rejected = False
        self.cached_tokens = 0
        self.error: str | None = None
        self.last_token_at: float | None = None

    def apply(self, d: Delta, arrival: float) -> tuple[Any, list]:
        """One delta in; returns (wire delta, logprob entries): an OutputDelta for chat, text otherwise."""
        if d.token_ids:
            now = time.perf_counter()
            m = self.svc.metrics
            if self.last_token_at is None:
                m.ttft.observe(now - arrival)
            else:
                for _ in d.token_ids:
                    m.itl.observe((now - self.last_token_at) / len(d.token_ids))
            self.last_token_at = now
        self.token_ids += d.token_ids
        entries = self._logprob_entries(d.logprobs) if self.num_logprobs is not None else []
        self.logprobs += entries
        if self.chat is not None:
            delta = self.chat.feed(d.text)
            if d.finish_reason is not None:
                rest = self.chat.flush()
                delta.reasoning += rest.reasoning
                delta.content += rest.content
                delta.tool_calls += rest.tool_calls
        else:
            delta = d.text
            self.text += d.text
        if d.finish_reason is not None:
            self._finish(d)
        return delta, entries

    def _finish(self, d: Delta) -> None:
        self.cached_tokens, self.error = d.cached_tokens, d.error
        self.failed, self.rejected = d.finish_reason == FinishReason.ERROR, d.rejected
        if d.finish_reason == FinishReason.STOP and not d.by_stop_string and self.chat is not None \
                and self.chat.tool_calls:
            self.finish_reason = "tool_calls"
        else:
            self.finish_reason = d.finish_reason.value

    def _logprob_entries(self, lps: list[TokenLogprob]) -> list[tuple[str, float, list[tuple[str, float]]]]:
        dec = self.svc.token_text
        return [(dec(lp.token), float(lp.logprob), [(dec(t), float(v)) for t, v in lp.top]) for lp in lps]


class Service:
    """Everything the routes share: the handle's tokenizer and defaults, the runner, metrics."""

    def __init__(self, handle: Any, runner: EngineRunner, metrics: Metrics, model_name: str):
        if handle.tokenizer is None:
            raise ValueError("the server needs a checkpoint with tokenizer.json")
        self.handle, self.runner, self.metrics, self.model_name = handle, runner, metrics, model_name
        self.tokenizer = handle.tokenizer
        self.context = handle.config.max_position_embeddings
        self.limits = request_stream.Limits.of(handle.config, runner.config)  # the model's and the pool's
        self.created = P.now()
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return t

    # ------------------------------------------------------------------ request -> engine parameters
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.RequestError(f"the model {model!r} does not exist (this server serves "
                                 f"{self.model_name!r})", "model", status=404, code="model_not_found")

    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        messages = [m.template_dict() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        template = self.tokenizer.chat_template or ""
        if tools and "tools" in template:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        elif tools:  # V3.1's template ignores `tools`: the model card puts them into the system prompt
            messages.append({"role": "system", "content": tool_description([t.model_dump() for t in tools])})
        try:
            return encode_chat(self.tokenizer, messages, add_generation_prompt=True, **kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise P.RequestError(f"chat template: {e}", "messages") from e

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def params(self, req: P._SamplingRequest, prompt: list[int], first_index: int,
               prompt_param: str) -> list[RequestParams]:
        """The `req.n` choices' parameters for one prompt (request_stream.resolve: generation_config
        defaults; max_tokens absent: all that fits), checked once (request_stream.check); a 400 naming
        the request's field when the prompt cannot run."""
        room = self.limits.room(len(prompt))
        requested = req.token_limit
        seed = req.seed if req.seed is not None else random.randrange(_SEED_MOD)
        out = []
        for i in range(first_index, first_index + req.n):
            p = request_stream.resolve(
                self.handle.generation_defaults, temperature=req.temperature, top_p=req.top_p,
                max_new_tokens=max(room, 1) if requested is None else requested,
                top_k=None if req.top_k is None else max(req.top_k, 0),  # the wire's -1: no limit, as 0
                seed=(seed + i) % _SEED_MOD, stop=req.stop_list(), logprobs=req.num_logprobs,
                eos=() if req.ignore_eos else self.handle.eos_ids())
            try:
                request_stream.check(prompt, p, self.limits)
            except RequestInvalid as e:
                raise self._refusal(e, prompt, p, room, prompt_param) from None
            out.append(p)
        return out

    def _refusal(self, e: RequestInvalid, prompt: list[int], p: RequestParams, room: int,
                 prompt_param: str) -> P.RequestError:
        """The check's verdict in the wire's words and field names."""
        n, cap = len(prompt), self.limits.capacity
        if e.field == "max_new_tokens":
            return P.RequestError(f"prompt ({n} tokens) + max_tokens ({p.max_new_tokens}) exceeds what the "
                                  f"server fits ({room + n} tokens)", "max_tokens")
        if e.field == "prompt" and n and room < 1:
            return P.RequestError(f"the prompt has {n} tokens; the server fits at most {room + n - 1} "
                                  f"(context {self.context}, page pool {self.limits.pool_tokens} tokens, "
                                  f"at most {cap} per request)", prompt_param)
        return P.RequestError(str(e), {"prompt": prompt_param}.get(e.field, e.field))

    def submit_all(self, prompts: list[list[int]], params: list[RequestParams], *,
                   skip_special_tokens: bool = True) -> list[Submission]:
        """Submit every choice (one HTTP request may hold several); all or none, else 429."""
        loop = asyncio.get_running_loop()
        shared: asyncio.Queue = asyncio.Queue()
        subs: list[Submission] = []
        try:
            for i, (p, q) in enumerate(zip(prompts, params)):
                stream = RequestStream(q, self.tokenizer, skip_special_tokens=skip_special_tokens)
                subs.append(self.runner.submit(p, stream, loop, out_queue=shared, tag=i))
        except Overloaded as e:
            for s in subs:
                self.runner.cancel(s)
            raise P.RequestError(str(e), None, status=429, type="rate_limit_error", code="server_busy") from e
        except EngineDown as e:
            for s in subs:
                self.runner.cancel(s)
            raise P.RequestError(str(e), None, status=503, type="server_error", code="engine_down") from e
        return subs


# ---------------------------------------------------------------------------------------- body parsing


async def _body(request: Request, model: type[P._Strict]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.RequestError(f"malformed JSON body: {e}", None) from e
    if not isinstance(data, dict):
        raise P.RequestError("the request body must be a JSON object", None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from e


def _validation_error(e: ValidationError) -> P.RequestError:
    """The first pydantic error as one line naming the field (union branches folded into one message)."""
    errs = e.errors(include_url=False)
    first = errs[0]
    loc = [str(x) for x in first["loc"] if isinstance(x, int) or not _is_union_tag(x)]
    param = _join_loc(loc)
    same_field = [x for x in errs if x["loc"][:1] == first["loc"][:1]]
    if first["type"] == "extra_forbidden":
        msg = f"unknown field {param!r}"
    elif first["type"] == "missing":
        msg = f"{param} is required"
    elif len(same_field) > 1 and len({x["type"] for x in same_field}) > 1:
        msg = f"{param}: invalid value {_short(first.get('input'))} (wrong type or shape)"
    else:
        msg = f"{param}: {first['msg']} (got {_short(first.get('input'))})"
    return P.RequestError(msg, param)


def _is_union_tag(x: Any) -> bool:
    # pydantic names union branches in `loc` by their type ("str", "list[int]", "function-after[...]")
    return any(c in x for c in "[]") or x in _TYPE_TAGS


def _join_loc(loc: list[str]) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if x.isdigit() else (f".{x}" if out else x)
    return out or None


def _short(value: Any) -> str:
    s = json.dumps(value, ensure_ascii=False, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


# --------------------------------------------------------------------------------------------- the app


def create_app(svc: Service) -> FastAPI:
    app = FastAPI(title="dsv3-jax", docs_url=None, redoc_url=None)
    app.state.svc = svc

    @app.exception_handler(P.RequestError)
    async def _request_error(_: Request, e: P.RequestError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(P.error_body(e.message, e.type, e.param, e.code), e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(P.error_body(str(e.detail), "invalid_request_error"), e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = svc.runner.alive
        return JSONResponse({"status": "ok" if ok else "engine thread stopped", **svc.runner.status()},
                            200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": svc.created,
                                            "owned_by": "dsv3-jax", "max_model_len": svc.context}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req: P.ChatCompletionRequest = await _body(request, P.ChatCompletionRequest)
        svc.check_model(req.model)
        prompt = svc.chat_prompt(req)
        params = svc.params(req, prompt, 0, "messages")
        subs = svc.submit_all([prompt] * req.n, params)
        tools = bool(req.tools) and req.tool_choice != "none"
        choices = [_Choice(svc, s, chat=True, thinking=req.thinking, tools=tools,
                           num_logprobs=req.num_logprobs) for s in subs]
        ctx = _Ctx(svc, "chat", P.new_id("chatcmpl"), [len(prompt)], [prompt], arrival, req)
        if req.stream:
            return _sse(_chat_stream(ctx, choices))
        return await _complete(request, ctx, choices, _chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req: P.CompletionRequest = await _body(request, P.CompletionRequest)
        svc.check_model(req.model)
        prompts = [svc.encode_prompt(p) for p in req.prompts()]
        params = [q for j, p in enumerate(prompts) for q in svc.params(req, p, j * req.n, "prompt")]
        flat = [p for p in prompts for _ in range(req.n)]
        subs = svc.submit_all(flat, params)
        choices = [_Choice(svc, s, chat=False, thinking=False, tools=False, num_logprobs=req.num_logprobs)
                   for s in subs]
        ctx = _Ctx(svc, "completions", P.new_id("cmpl"), [len(p) for p in prompts], prompts, arrival, req)
        if req.echo:
            for c, p in zip(choices, flat):
                c.text = svc.tokenizer.decode(p, skip_special_tokens=True)
        if req.stream:
            return _sse(_completion_stream(ctx, choices))
        return await _complete(request, ctx, choices, _completion_response)

    return app


class _Ctx:
    """Per-HTTP-request facts the response builders need."""

    def __init__(self, svc: Service, endpoint: str, rid: str, prompt_lens: list[int],
                 prompts: list[list[int]], arrival: float, req: Any):
        self.svc, self.endpoint, self.id = svc, endpoint, rid
        self.prompt_lens, self.prompts = prompt_lens, prompts
        self.arrival, self.req, self.created = arrival, req, P.now()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def usage(self, choices: list[_Choice]) -> dict[str, Any]:
        # Prompt tokens count once per prompt (n samples share them); cached tokens as the engine reports.
        n = self.req.n
        cached = sum(c.cached_tokens for c in choices[::n])
        return P.usage(sum(self.prompt_lens), sum(len(c.token_ids) for c in choices), cached)

    def record(self, choices: list[_Choice], outcome: str) -> None:
        m = self.svc.metrics
        m.requests.labels(self.endpoint, outcome).inc()
        m.prompt_tokens.inc(sum(self.prompt_lens))
        m.cached_tokens.inc(sum(c.cached_tokens for c in choices[:: self.req.n]))
        m.generation_tokens.inc(sum(len(c.token_ids) for c in choices))
        m.e2e.observe(time.perf_counter() - self.arrival)


async def _events(ctx: _Ctx, choices: list[_Choice]) -> AsyncIterator[tuple[int, Any, list]]:
    """(choice index, wire delta, logprob entries) as deltas arrive; the last one of each choice ends it.

    Cancels every unfinished choice in the engine when the consumer stops early (client disconnect).
    """
    q = choices[0].sub.queue
    open_ = set(range(len(choices)))
    try:
        while open_:
            tag, delta = await q.get()
            wire, lps = choices[tag].apply(delta, ctx.arrival)
            if delta.finish_reason is not None:
                open_.discard(tag)
            yield tag, wire, lps
    finally:
        for i in open_:
            ctx.svc.runner.cancel(choices[i].sub)
        if open_:
            ctx.record(choices, "cancelled")


def _failure(choices: list[_Choice]) -> tuple[int, dict[str, Any]] | None:
    """The one mapping of a failed choice to HTTP: (status, error body), or None when none failed. A
    request the engine refused is the client's (400); a failure while generating is the server's (500)."""
    bad = next((c for c in choices if c.failed), None)
    if bad is None:
        return None
    status, kind = (400, "invalid_request_error") if bad.rejected else (500, "server_error")
    return status, P.error_body(bad.error or "generation failed", kind)


async def _complete(request: Request, ctx: _Ctx, choices: list[_Choice], build) -> Response:
    """Non-streaming: gather every choice, watching for the client to go away (then cancel)."""
    async def consume() -> None:
        async for _ in _events(ctx, choices):
            pass

    task = asyncio.ensure_future(consume())
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            break
        if await request.is_disconnected():
            task.cancel()  # _events' finally cancels the engine requests
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    task.result()
    failure = _failure(choices)
    if failure is not None:
        ctx.record(choices, "error")
        status, body = failure
        return JSONResponse(body, status)
    ctx.record(choices, "ok")
    return JSONResponse(build(ctx, choices))


def _chat_response(ctx: _Ctx, choices: list[_Choice]) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        calls = [t.to_openai() for t in c.chat.tool_calls]
        msg: dict[str, Any] = {"role": "assistant", "content": c.chat.content if (c.chat.content or not calls)
                               else None, "reasoning_content": c.chat.reasoning or None}
        if calls:
            msg["tool_calls"] = calls
        choice = {"index": i, "message": msg, "finish_reason": c.finish_reason,
                  "logprobs": {"content": P.chat_logprob_entries(c.logprobs)} if c.num_logprobs is not None
                  else None}
        if ctx.req.return_token_ids:
            choice["token_ids"] = c.token_ids
        out.append(choice)
    body = {"id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.svc.model_name,
            "choices": out, "usage": ctx.usage(choices), "system_fingerprint": None}
    if ctx.req.return_token_ids:
        body["prompt_token_ids"] = ctx.prompts[0]
    return body


def _completion_response(ctx: _Ctx, choices: list[_Choice]) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        choice = {"index": i, "text": c.text, "finish_reason": c.finish_reason,
                  "logprobs": P.completion_logprobs(c.logprobs, 0) if c.num_logprobs is not None else None}
        if ctx.req.return_token_ids:
            choice["token_ids"] = c.token_ids
            choice["prompt_token_ids"] = ctx.prompts[i // ctx.req.n]
        out.append(choice)
    return {"id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.svc.model_name,
            "choices": out, "usage": ctx.usage(choices), "system_fingerprint": None}


# ------------------------------------------------------------------------------------------- streaming


def _sse(gen: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for obj in gen:
            yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _chunk(ctx: _Ctx, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    out = {"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.svc.model_name,
           "system_fingerprint": None, "choices": choices}
    if ctx.include_usage:
        out["usage"] = None
    return out


async def _chat_stream(ctx: _Ctx, choices: list[_Choice]) -> AsyncIterator[dict[str, Any]]:
    obj = "chat.completion.chunk"
    sent = [0] * len(choices)  # token ids already sent per choice (return_token_ids)
    for i in range(len(choices)):
        yield _chunk(ctx, obj, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}])
    async for i, d, lps in _events(ctx, choices):
        c = choices[i]
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.tool_calls:
            delta["tool_calls"] = [t.to_openai() for t in d.tool_calls]
        done = c.finish_reason is not None
        if delta or lps or (ctx.req.return_token_ids and len(c.token_ids) > sent[i]):
            ch = {"index": i, "delta": delta, "finish_reason": None,
                  "logprobs": {"content": P.chat_logprob_entries(lps)} if lps else None}
            if ctx.req.return_token_ids:
                ch["token_ids"] = c.token_ids[sent[i]:]
                sent[i] = len(c.token_ids)
            yield _chunk(ctx, obj, [ch])
        if done and not c.failed:
            yield _chunk(ctx, obj, [{"index": i, "delta": {}, "logprobs": None,
                                     "finish_reason": c.finish_reason}])
    async for ev in _stream_end(ctx, choices):
        yield ev


async def _completion_stream(ctx: _Ctx, choices: list[_Choice]) -> AsyncIterator[dict[str, Any]]:
    obj = "text_completion"
    offsets = [len(c.text) for c in choices]
    sent = [0] * len(choices)
    for i, c in enumerate(choices):
        if c.text:  # echo: the prompt text first
            yield _chunk(ctx, obj, [{"index": i, "text": c.text, "logprobs": None, "finish_reason": None}])
    async for i, text, lps in _events(ctx, choices):
        c = choices[i]
        if text or lps or (ctx.req.return_token_ids and len(c.token_ids) > sent[i]):
            ch = {"index": i, "text": text, "finish_reason": None,
                  "logprobs": P.completion_logprobs(lps, offsets[i]) if lps else None}
            if ctx.req.return_token_ids:
                ch["token_ids"] = c.token_ids[sent[i]:]
                sent[i] = len(c.token_ids)
            yield _chunk(ctx, obj, [ch])
            offsets[i] += len(text)
        if c.finish_reason is not None and not c.failed:
            yield _chunk(ctx, obj, [{"index": i, "text": "", "logprobs": None,
                                     "finish_reason": c.finish_reason}])
    async for ev in _stream_end(ctx, choices):
        yield ev


async def _stream_end(ctx: _Ctx, choices: list[_Choice]) -> AsyncIterator[dict[str, Any]]:
    failure = _failure(choices)
    ctx.record(choices, "ok" if failure is None else "error")
    if failure is not None:
        yield failure[1]  # headers are sent: the status stays 200, the body says what failed
    if ctx.include_usage:
        obj = "chat.completion.chunk" if ctx.endpoint == "chat" else "text_completion"
        yield {**_chunk(ctx, obj, []), "usage": ctx.usage(choices)}

