"""The OpenAI wire format: request schemas (pydantic, unknown fields refused), response and stream-chunk
builders, and the error body.

Owns: which request fields exist and their ranges, the cross-field checks (a field we accept but cannot
honour is refused with a 400 naming it, never silently ignored), and the exact JSON shapes of
`chat.completion`, `chat.completion.chunk`, `text_completion`, usage and `{"error": {...}}`.
Must not tokenize, render templates or talk to the engine (that is app.py and runner.py); the one engine
fact it reads is the contract's logprobs bound (engine/api.MAX_LOGPROBS).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsv3_jax.engine.api import MAX_LOGPROBS  # the engine contract's bound on top alternatives

MAX_N = 16
MAX_STOP = 16


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `type`, offending `param`.

    Not a ValueError on purpose: raised inside a pydantic validator it propagates as is (keeping `param`)
    instead of being folded into a ValidationError without a field name.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,  # noqa: A002
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(_Strict):
    type: Literal["text"]


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message; extra keys (e.g. `prefix`) pass through to the template as transformers would."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined, `developer` -> `system`."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        d.setdefault("content", "")
        if d["role"] == "developer":
            d["role"] = "system"
        return d


class _SamplingRequest(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: no limit
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension: keep going past EOS
    return_token_ids: bool = False  # vLLM extension: prompt_token_ids and token_ids in the response

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tool_choice not in (None, "none", "auto"):
            raise RequestError("only 'auto' and 'none' are supported (no forced calls)", "tool_choice")
        if self.tool_choice == "auto" and not self.tools:
            raise RequestError("tool_choice 'auto' needs tools", "tool_choice")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens disagree; pass one", "max_tokens")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def thinking(self) -> bool:
        kw = self.chat_template_kwargs or {}
        return bool(kw.get("thinking", kw.get("enable_thinking", False)))

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | Annotated[list[str], Field(min_length=1)] | \
        Annotated[list[list[int]], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _checks(self):
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (only best_of == n)", "best_of")
        if self.echo and self.logprobs is not None:
            raise RequestError("echo with logprobs is not supported (no prompt logprobs)", "echo")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's completions default

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


# ----------------------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprob_entries(entries: list[tuple[str, float, list[tuple[str, float]]]]) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content`: token text, logprob, UTF-8 bytes and the top alternatives."""
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]} for t, lp, top in entries]


def completion_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]],
                        offset: int) -> dict[str, Any]:
    """Legacy completions `logprobs`: parallel lists, top alternatives as {token: logprob} dicts."""
    offsets, pos = [], offset
    for t, _, _ in entries:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}
