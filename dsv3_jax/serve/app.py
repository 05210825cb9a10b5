"""The HTTP side: FastAPI routes of the OpenAI-compatible API over one EngineRunner.

Owns the HTTP concerns only: access (`--api-key` on every /v1 route, 401 in OpenAI's shape; CORS; the
body limit, 413), reading and validating request bodies (errors reshaped to OpenAI's `{"error": {...}}`
with the offending field, never a traceback), building prompts (chat template with per-request thinking,
the V3.1 / V3 tool block), the served names and `--max-model-len` (what /v1/models reports and what a
request may span), wire conventions of parameters (top_k -1, a seed per request, n choices), reasoning
and tool-call parsing of the streamed text (parsers.py), wire logprobs and finish reasons, usage, SSE
streaming, cancelling on client disconnect, HTTP status codes (`_failure`, the one mapping), the
HTTP-side metrics (requests by status, tokens, TTFT, ITL) and the one-line request log.
No stalls: tokenizing, chat rendering and echo detokenizing run in a small thread pool (`Service.run`,
below the engine thread's priority), body parsing on its own thread (`Service.parse`, at the engine's
priority: it holds the GIL), never on the event loop, so a 5 MB body does not hold up other streams.
Resolving and checking a request's parameters, detokenizing, stop strings and finish reasons are the
request layer's (request_stream.py; its streams run on runner.py's engine thread, which says why).
Must not call the Engine directly (runner.py's thread does) nor define wire shapes (protocol.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv3_jax import request_stream
from dsv3_jax.engine.api import FinishReason, TokenLogprob
from dsv3_jax.request_stream import Delta, RequestInvalid, RequestParams, RequestStream
from dsv3_jax.serve import protocol as P
from dsv3_jax.serve.metrics import CONTENT_TYPE, Metrics
from dsv3_jax.serve.parsers import ChatOutputParser, detect_tool_format, tool_description
from dsv3_jax.serve.runner import EngineDown, EngineRunner, Overloaded, Submission
from dsv3_jax.text.chat import apply_chat_template, encode_chat
from dsv3_jax.text.tokenizer import TooManyTokens

log = logging.getLogger(__name__)
request_log = logging.getLogger("dsv3_jax.serve.requests")  # one line per finished request

_SEED_MOD = 2**31  # the engine keeps seeds as int32
_DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks that its client is still there
_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "literal")  # pydantic union branch names
_HOST_THREADS = 2  # tokenizing / rendering off the event loop (the tokenizer releases the GIL)
# The host threads run below the engine thread's priority: a 5 MB prompt is seconds of tokenizer CPU, and
# on a box with few cores it would otherwise take a core from the engine's step and stall every stream.
_HOST_NICE = 10


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What the server flags decide beyond the engine (see __main__.py for each flag)."""

    model_names: tuple[str, ...] = ("dsv3-default",)  # the first names the model in responses
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_body_bytes: int = 32 << 20
    max_model_len: int | None = None  # caps prompt + output of every request
    seed: int | None = None  # seeds the per-request seeds of requests that give none
    log_requests: bool = True
    tool_format: str | None = None  # deepseek_v31 | deepseek_v3; None: from the chat template
    reasoning_parser: str = "deepseek_v3"  # deepseek_v3 (per request) | deepseek_r1 (always) | none


class _Choice:
    """One generated sequence of an HTTP request as the wire sees it: the request layer's deltas (from the
    engine thread) parsed for chat (reasoning, tool calls), wire logprob entries, the OpenAI finish reason."""

    def __init__(self, svc: Service, sub: Submission, *, chat: bool, thinking: bool, tools: Any,
                 num_logprobs: int | None):
        self.svc, self.sub = svc, sub
        self.chat = ChatOutputParser(thinking=svc.reasoning(thinking), tools=tools,
                                     tool_format=svc.tool_format) if chat else None
        self.num_logprobs = num_logprobs
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[str, float, list[tuple[str, float]]]] = []
        self.text = ""  # completions only
        self.finish_reason: str | None = None  # the wire's, set by the final delta
        self.failed = self.rejected = False
        self.cached_tokens = 0
        self.error: str | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def apply(self, d: Delta, arrival: float) -> tuple[Any, list]:
        """One delta in; returns (wire delta, logprob entries): an OutputDelta for chat, text otherwise."""
        if d.token_ids:
            now = time.perf_counter()
            m = self.svc.metrics
            if self.last_token_at is None:
                m.ttft.observe(now - arrival)
                self.first_token_at = now
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

    def __init__(self, handle: Any, runner: EngineRunner, metrics: Metrics, model_name: str, *,
                 options: ServerOptions | None = None):
        if handle.tokenizer is None:
            raise ValueError("the server needs a checkpoint with tokenizer.json")
        opts = options if options is not None else ServerOptions(model_names=(model_name,))
        if model_name != opts.model_names[0]:
            opts = dataclasses.replace(opts, model_names=(model_name, *opts.model_names))
        self.handle, self.runner, self.metrics, self.options = handle, runner, metrics, opts
        self.model_name, self.model_names = model_name, opts.model_names
        self.tokenizer = handle.tokenizer
        limits = request_stream.Limits.of(handle.config, runner.config)  # the model's and the pool's
        if opts.max_model_len is not None:  # --max-model-len caps every request like a shorter context
            limits = dataclasses.replace(limits, context=min(limits.context, opts.max_model_len))
        self.limits = limits
        self.context = limits.context
        self.max_model_len = limits.capacity  # what one request may span: what /v1/models reports
        self.tool_format = opts.tool_format or detect_tool_format(self.tokenizer.chat_template)
        self.created = P.now()
        self._token_text: dict[int, str] = {}
        self._seeds = random.Random(opts.seed)
        self._pool = ThreadPoolExecutor(_HOST_THREADS, thread_name_prefix="dsv3-host",
                                        initializer=_lower_thread_priority)
        # Parsing a body holds the GIL (json, pydantic): ~8 ms for 5 MB. A niced thread holding the GIL on a
        # busy box waits behind every other runnable task, and the engine thread waits for the GIL behind it
        # (priority inversion): parsing runs at the engine's priority.
        self._parse_pool = ThreadPoolExecutor(1, thread_name_prefix="dsv3-parse")

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the host thread pool (tokenizing, rendering): the event loop keeps
        serving other streams meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def parse(self, raw: bytes, model: type[P._Strict]) -> Any:
        """A request body validated into `model`, off the event loop at normal priority (above)."""
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, _parse, raw, model)

    def warm_host(self) -> None:
        """Render and encode one chat before the port opens (the template compiles on first use; the
        tokenizer's length bound is computed once)."""
        try:
            self.tokenizer.encode("warm up")
            self.tokenizer.max_token_chars  # noqa: B018  (cached: a long prompt is refused from its length)
            if self.tokenizer.chat_template:
                encode_chat(self.tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            log.warning("chat template failed on a plain message (%s); chat requests will get a 400", e)

    def reasoning(self, thinking: bool) -> bool:
        """Whether the output starts as reasoning under --reasoning-parser."""
        return {"deepseek_v3": thinking, "deepseek_r1": True, "none": False}[self.options.reasoning_parser]

    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return t

    # ------------------------------------------------------------------ request -> engine parameters
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise P.RequestError(f"the model {model!r} does not exist (this server serves "
                                 f"{', '.join(map(repr, self.model_names))})", "model", status=404,
                                 code="model_not_found")

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "dsv3-jax",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}

    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        messages = [m.template_dict() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        template = self.tokenizer.chat_template or ""
        if tools and "tools" in template:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        elif tools:  # V3.1's template ignores `tools`: the model card puts them into the system prompt
            block = tool_description([t.model_dump() for t in tools], self.tool_format)
            messages.append({"role": "system", "content": block})
        try:
            text = apply_chat_template(self.tokenizer, messages,
                                       add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message, **kwargs)
            # as encode_chat, GIL released; a prompt with no room for one new token is refused unbuilt
            return self.tokenizer.encode_batch([text], add_bos=False, max_tokens=self.limits.capacity - 1)[0]
        except TooManyTokens as e:
            raise self._too_long(e, "messages") from None
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise P.RequestError(f"chat template: {e}", "messages") from e

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt (`encode_batch`: the tokenizer releases the GIL meanwhile)."""
        texts = [p for p in prompts if isinstance(p, str)]
        room = self.limits.capacity - 1  # a prompt must leave room for one new token
        try:
            encoded = iter(self.tokenizer.encode_batch(texts, max_tokens=room) if texts else [])
        except TooManyTokens as e:
            raise self._too_long(e, "prompt") from None
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

    def _too_long(self, e: TooManyTokens, param: str) -> P.RequestError:
        """A prompt refused while encoding (its id list never built): `_refusal`'s words."""
        has = f"{e.tokens} tokens" if e.exact else f"at least {e.tokens} tokens (by its length)"
        return P.RequestError(f"the prompt has {has}; the server fits at most {e.bound}: this "
                              f"model's maximum context length is {self.limits.capacity} tokens "
                              f"({self._cap_reason()})", param)

    def grammar(self, req: P._SamplingRequest) -> Any:
        """The request's structured-output grammar (structured.compile_format; None: free text), built on
        the host pool; a bad schema is a 400 naming the field that gave it."""
        fmt = req.structured_format()
        if fmt is None:
            return None
        from dsv3_jax import structured

        kind, value, field = fmt
        vocab = self.handle.config.vocab_size
        try:
            return structured.compile_format(kind, value, self.tokenizer, field=field, vocab_size=vocab,
                                             eos=self.handle.eos_ids())
        except structured.FormatInvalid as e:
            raise P.RequestError(str(e), e.field) from None

    def params(self, req: P._SamplingRequest, prompt: list[int], first_index: int,
               prompt_param: str, grammar: Any = None) -> list[RequestParams]:
        """The `req.n` choices' parameters for one prompt (request_stream.resolve: generation_config
        defaults; max_tokens absent: all that fits; logits processors, stop_token_ids, `grammar` from
        `grammar()`), checked once (request_stream.check); a 400 naming the request's field when the
        prompt cannot run."""
        room = self.limits.room(len(prompt))
        requested = req.token_limit
        seed = req.seed if req.seed is not None else self._seeds.randrange(_SEED_MOD)
        out = []
        for i in range(first_index, first_index + req.n):
            p = request_stream.resolve(
                self.handle.generation_defaults, temperature=req.temperature, top_p=req.top_p,
                max_new_tokens=max(room, 1) if requested is None else requested,
                top_k=None if req.top_k is None else max(req.top_k, 0),  # the wire's -1: no limit, as 0
                seed=(seed + i) % _SEED_MOD, stop=req.stop_list(), logprobs=req.num_logprobs,
                eos=() if req.ignore_eos else self.handle.eos_ids(), stop_token_ids=req.stop_token_ids or (),
                processing=req.processing_kwargs(), structured=grammar,
                include_stop_str_in_output=req.include_stop_str_in_output)
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
        why = (f"this model's maximum context length is {cap} tokens ({self._cap_reason()})")
        if e.field == "max_new_tokens":
            return P.RequestError(f"prompt ({n} tokens) + max_tokens ({p.max_new_tokens}) exceeds what the "
                                  f"server fits ({room + n} tokens): {why}", "max_tokens")
        if e.field == "prompt" and n and room < 1:
            return P.RequestError(f"the prompt has {n} tokens; the server fits at most {room + n - 1}: "
                                  f"{why}", prompt_param)
        return P.RequestError(str(e), {"prompt": prompt_param}.get(e.field, e.field))

    def _cap_reason(self) -> str:
        lim, mml = self.limits, self.options.max_model_len
        parts = [f"context {self.handle.config.max_position_embeddings}"]
        if mml is not None:
            parts.append(f"--max-model-len {mml}")
        if lim.pool_tokens is not None:
            parts.append(f"page pool {lim.pool_tokens}")
        if lim.spec_k:
            parts.append(f"{lim.spec_k} draft tokens reserved")
        return ", ".join(parts)

    def check_choices(self, count: int, param: str) -> None:
        """A request of more choices than the admission bound could never be admitted: 400, not 429."""
        bound = self.runner.max_pending
        if count > bound:
            raise P.RequestError(f"this request asks for {count} sequences; the server admits at most "
                                 f"{bound} at once (--max-pending)", param)

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
    """The body, read up to the limit (a chunked body has no Content-Length for the middleware to check),
    parsed and validated on the host pool."""
    svc: Service = request.app.state.svc
    limit, chunks, size = svc.options.max_body_bytes, [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.RequestError(_too_large(size, limit, more=True), None, status=413,
                                 code="request_too_large")
        chunks.append(chunk)
    return await svc.parse(b"".join(chunks), model)


def _too_large(size: int, limit: int, more: bool = False) -> str:
    return (f"request body of {size}{'+' if more else ''} bytes exceeds the server's limit of {limit} bytes "
            f"(--max-request-body-bytes)")


def _parse(raw: bytes, model: type[P._Strict]) -> Any:
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


_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


def _lower_thread_priority() -> None:
    """Nice the calling thread (Linux: a thread is a schedulable task with its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _HOST_NICE)
    except (AttributeError, OSError) as e:  # not Linux, or not permitted: host work keeps normal priority
        log.info("host threads keep normal priority (%s)", e)


def _request_id(request: Request, req: P._SamplingRequest) -> str | None:
    """The client's id for this request: the body's `request_id`, else the `X-Request-Id` header."""
    return req.request_id or request.headers.get("x-request-id") or None


class _Gate:
    """ASGI middleware in front of the routes: counts every HTTP answer by route and status (4xx/5xx
    included), refuses a body whose Content-Length exceeds the limit (413) and, with API keys, every /v1
    route without `Authorization: Bearer KEY` (401). /health and /metrics stay open (as in vLLM); CORS
    preflights are answered by the CORS middleware outside this one. A request's `X-Request-Id` header
    comes back on its answer (as vLLM's --enable-request-id-headers does; here always)."""

    def __init__(self, app: Any, svc: Service):
        self.app, self.svc = app, svc
        self.keys = [k.encode() for k in svc.options.api_keys]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        handler = path if path in _ROUTES else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                else "other")
        status = [500]
        request_id = dict(scope["headers"]).get(b"x-request-id")

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if request_id is not None:
                    headers = [*message.get("headers", []), (b"x-request-id", request_id)]
                    message = {**message, "headers": headers}
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await refusal(scope, receive, counted_send)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            self.svc.metrics.http.labels(handler, scope["method"], str(status[0])).inc()

    def _refusal(self, scope: dict, path: str) -> Response | None:
        headers = dict(scope["headers"])
        if self.keys and (path == "/v1" or path.startswith("/v1/")) and scope["method"] != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not any(hmac.compare_digest(token, k) for k in self.keys):  # constant time
                msg = ("missing API key: send it as 'Authorization: Bearer KEY'" if not auth else
                       "incorrect API key provided" if token else
                       "malformed Authorization header: send 'Authorization: Bearer KEY'")
                return JSONResponse(P.error_body(msg, "invalid_request_error", None, "invalid_api_key"), 401,
                                    headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        limit = self.svc.options.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return JSONResponse(P.error_body(_too_large(int(length), limit), "invalid_request_error", None,
                                             "request_too_large"), 413, headers={"Connection": "close"})
        return None


def create_app(svc: Service) -> FastAPI:
    app = FastAPI(title="dsv3-jax", docs_url=None, redoc_url=None)
    app.state.svc = svc
    opts = svc.options
    app.add_middleware(_Gate, svc=svc)
    if opts.allowed_origins:  # outermost: a preflight is answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(opts.allowed_origins),
                           allow_methods=list(opts.allowed_methods), allow_headers=list(opts.allowed_headers),
                           allow_credentials=opts.allow_credentials)

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
        return {"object": "list", "data": [svc.model_card(name) for name in svc.model_names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        svc.check_model(model)
        return svc.model_card(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req: P.ChatCompletionRequest = await _body(request, P.ChatCompletionRequest)
        svc.check_model(req.model)
        svc.check_choices(req.n, "n")
        prompt = await svc.run(svc.chat_prompt, req)
        grammar = await svc.run(svc.grammar, req)
        params = svc.params(req, prompt, 0, "messages", grammar)
        subs = svc.submit_all([prompt] * req.n, params, skip_special_tokens=req.skip_special_tokens)
        tools = ({t.function.name for t in req.tools} if req.tools and req.tool_choice != "none" else False)
        choices = [_Choice(svc, s, chat=True, thinking=req.thinking, tools=tools,
                           num_logprobs=req.num_logprobs) for s in subs]
        rid = P.response_id("chatcmpl", _request_id(request, req))
        ctx = _Ctx(svc, "chat", rid, [len(prompt)], [prompt], arrival, req, choices)
        if req.stream:
            return _sse(_chat_stream(ctx, choices))
        return await _complete(request, ctx, choices, _chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req: P.CompletionRequest = await _body(request, P.CompletionRequest)
        svc.check_model(req.model)
        texts = req.prompts()
        if not texts:
            raise P.RequestError("prompt is empty: give a string, a list of token ids, or a non-empty list "
                                 "of either", "prompt")
        svc.check_choices(len(texts) * req.n, "n" if len(texts) == 1 else "prompt")
        prompts = await svc.run(svc.encode_prompts, texts)
        grammar = await svc.run(svc.grammar, req)
        params = [q for j, p in enumerate(prompts) for q in svc.params(req, p, j * req.n, "prompt", grammar)]
        flat = [p for p in prompts for _ in range(req.n)]
        subs = svc.submit_all(flat, params, skip_special_tokens=req.skip_special_tokens)
        choices = [_Choice(svc, s, chat=False, thinking=False, tools=False, num_logprobs=req.num_logprobs)
                   for s in subs]
        rid = P.response_id("cmpl", _request_id(request, req))
        ctx = _Ctx(svc, "completions", rid, [len(p) for p in prompts], prompts, arrival, req, choices)
        if req.echo:
            echoed = await svc.run(lambda: [svc.tokenizer.decode(p, skip_special_tokens=True) for p in flat])
            for c, text in zip(choices, echoed):
                c.text = text
        if req.stream:
            return _sse(_completion_stream(ctx, choices))
        return await _complete(request, ctx, choices, _completion_response)

    return app


class _Ctx:
    """Per-HTTP-request facts the response builders need."""

    def __init__(self, svc: Service, endpoint: str, rid: str, prompt_lens: list[int],
                 prompts: list[list[int]], arrival: float, req: Any, choices: list[_Choice] | None = None):
        self.svc, self.endpoint, self.id = svc, endpoint, rid
        self.prompt_lens, self.prompts = prompt_lens, prompts
        self.arrival, self.req, self.created = arrival, req, P.now()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's stream_options.continuous_usage_stats: the usage so far in every chunk
        self.choices = choices if self.include_usage and req.stream_options.continuous_usage_stats else None

    def usage(self, choices: list[_Choice]) -> dict[str, Any]:
        # Prompt tokens count once per prompt (n samples share them); cached tokens as the engine reports.
        n = self.req.n
        cached = sum(c.cached_tokens for c in choices[::n])
        return P.usage(sum(self.prompt_lens), sum(len(c.token_ids) for c in choices), cached)

    def record(self, choices: list[_Choice], outcome: str) -> None:
        """Metrics and the request log line for a finished HTTP request (`outcome` ok | error |
        cancelled); each choice counts as one vLLM request."""
        m = self.svc.metrics
        now = time.perf_counter()
        prompt, cached = sum(self.prompt_lens), sum(c.cached_tokens for c in choices[:: self.req.n])
        generated = sum(len(c.token_ids) for c in choices)
        m.prompt_tokens.inc(prompt)
        m.prefix_queries.inc(prompt)
        m.prefix_hits.inc(cached)
        m.generation_tokens.inc(generated)
        for i, c in enumerate(choices):
            reason = {"stop": "stop", "tool_calls": "stop", "length": "length"}.get(c.finish_reason, "abort")
            reason = "error" if c.failed else reason  # vLLM's reasons are stop | length | abort
            m.request_finished(reason)
            m.e2e.observe(now - self.arrival)
            m.request_prompt_tokens.observe(self.prompt_lens[i // self.req.n])
            m.request_generation_tokens.observe(len(c.token_ids))
            if c.first_token_at is not None and c.last_token_at is not None and len(c.token_ids) > 1:
                m.tpot.observe((c.last_token_at - c.first_token_at) / (len(c.token_ids) - 1))
        if self.svc.options.log_requests:
            ttft = min((c.first_token_at for c in choices if c.first_token_at is not None), default=None)
            request_log.info("%s %s %s: %d choice(s), prompt %d tokens (%d cached), %d generated, ttft %s, "
                             "total %.3f s, finish %s", self.id, self.endpoint, outcome, len(choices), prompt,
                             cached, generated, "-" if ttft is None else f"{ttft - self.arrival:.3f} s",
                             now - self.arrival, ",".join(sorted({str(c.finish_reason) for c in choices})))


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
    if bad.rejected:
        return 400, P.error_body(bad.error or "request refused", "invalid_request_error")
    if bad.svc.runner.stopping:  # the server is shutting down (drain timeout, or a second signal)
        return 503, P.error_body(bad.error or "server shutting down", "server_error", None,
                                 "server_shutting_down")
    return 500, P.error_body(bad.error or "generation failed", "server_error")


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
        out["usage"] = ctx.usage(ctx.choices) if ctx.choices else None
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

