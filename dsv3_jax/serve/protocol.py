"""The OpenAI wire format: request schemas (pydantic, unknown fields refused), response and stream-chunk
builders, and the error body.

Owns: which request fields exist and their ranges, the cross-field checks (a field we accept but cannot
honour is refused with a 400 naming it and saying why, never silently ignored; pure labels, `store`,
`metadata`, `user`, `service_tier`, are accepted and ignored), which structured-output spelling a request
used (`structured_format`: OpenAI's `response_format`, vLLM's `guided_json` / `guided_regex` /
`guided_choice` and `structured_outputs`), the response id (`response_id`: vLLM's `request_id`), and the
exact JSON shapes of `chat.completion`, `chat.completion.chunk`, `text_completion`, usage and
`{"error": {...}}`.
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
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk (with include_usage)


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


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise RequestError("response_format of type json_schema needs json_schema.schema",
                               "response_format")
        if self.type != "json_schema" and self.json_schema is not None:
            raise RequestError(f"response_format.json_schema is only for type json_schema (got {self.type})",
                               "response_format")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# Fields a client may send that this server refuses, and why (a 400 naming the field).
_REFUSED = {
    "reasoning_effort": "DeepSeek-V3.1's thinking is on or off, not graded: use "
                        "chat_template_kwargs.thinking",
    "modalities": "this model produces text only",
    "audio": "this model produces text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "guided_grammar": "grammars are not supported; use a JSON schema, a regex or a choice",
}


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
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM's sampling extensions
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=128)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # keep going past EOS
    return_token_ids: bool = False  # prompt_token_ids and token_ids in the response
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # the response id's tail
    priority: int = 0  # only 0: no priority scheduling
    # structured outputs (OpenAI's response_format; vLLM's spellings)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    # labels: accepted, ignored
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in _REFUSED.items():
                if data.get(name) is not None:
                    raise RequestError(f"{name} is not supported: {why}", name)
        return data

    @model_validator(mode="after")
    def _unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.priority != 0:
            raise RequestError("priority is not supported: requests are served first come, first served "
                               "(only 0)", "priority")
        for tok in self.logit_bias or {}:
            if not tok.lstrip("-").isdigit():
                raise RequestError(f"logit_bias keys are token ids, got {tok!r}", "logit_bias")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})",
                               "min_tokens")
        self.structured_format()  # one spelling at most
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def processing_kwargs(self) -> dict[str, Any]:
        """The logits processors as request_stream.resolve takes them (None: the default, off)."""
        return {"repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "min_p": self.min_p,
                "min_tokens": self.min_tokens,
                "logit_bias": {int(k): float(v) for k, v in (self.logit_bias or {}).items()}}

    def structured_format(self) -> tuple[str, Any, str] | None:
        """(kind, value, field) of the output format asked for (kind json_schema | json_object | regex |
        choice; field: the request field that asked), None for free text. Two spellings at once are a 400."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("json_object", None, "response_format"))
        elif rf is not None and rf.type == "json_schema":
            found.append(("json_schema", rf.json_schema.schema_, "response_format"))
        if self.guided_json is not None:
            found.append(("json_schema", self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            found.append(("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(("choice", self.guided_choice, "guided_choice"))
        so = self.structured_outputs
        if so is not None:
            options = (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                       ("json_object", so.json_object or None), ("grammar", so.grammar))
            given = [(k, v) for k, v in options if v is not None]
            if len(given) != 1:
                raise RequestError("structured_outputs takes exactly one of json, regex, choice, json_object",
                                   "structured_outputs")
            if given[0][0] == "grammar":
                raise RequestError("structured_outputs.grammar is not supported: "
                                   + _REFUSED["guided_grammar"], "structured_outputs")
            found.append((*given[0], "structured_outputs"))
        if len(found) > 1:
            raise RequestError(f"{found[0][2]} and {found[1][2]} both ask for an output format; pass one",
                               found[1][2])
        return found[0] if found else None


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM: end the prompt with the assistant's turn opener
    continue_final_message: bool = False  # vLLM: the last (assistant) message is continued, left open

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
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message continues the last message: it needs "
                               "add_generation_prompt false", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise RequestError("continue_final_message needs the last message to be the assistant's",
                               "continue_final_message")
        if self.max_completion_tokens is not None and self.min_tokens > self.max_completion_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) exceeds max_completion_tokens "
                               f"({self.max_completion_tokens})", "min_tokens")
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


def response_id(prefix: str, request_id: str | None) -> str:
    """The response's id: vLLM's `{prefix}-{request_id}` when the client gave one, else a random one."""
    return f"{prefix}-{request_id}" if request_id else new_id(prefix)


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
