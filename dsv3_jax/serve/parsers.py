"""The model's output text, parsed for the OpenAI API: `<think>` reasoning and V3.1 / V3-0324 tool calls.

Owns: the DeepSeek-V3.1 output markers as text (think tags, the tool-call tokens), the incremental parsers
that turn a stream of text pieces into reasoning, content and tool-call deltas (the text comes already
cut at stop strings by request_stream.py), and the tool description block that the V3.1 model card puts
into the system prompt (its chat template does not render `tools`).
Every parser holds back a tail that could still grow into a marker, so pieces split anywhere (inside a
marker, inside a multi-character stop string) give the same result as the whole text at once, and the
streamed deltas concatenate to the non-streamed answer. Must not touch token ids, the engine or HTTP.

V3.1 tool-call format (`deepseek_v31`; model card; the chat template writes past calls the same way):
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS-JSON<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
V3 / V3-0324 (`deepseek_v3`; its chat template): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n
ARGUMENTS-JSON\n```<｜tool▁call▁end｜>` in the same outer block; `detect_tool_format` picks one from a
template.
Calls to names the request did not declare come back as content (vLLM's DeepSeek parsers pass any name
through; a client cannot run a tool it never declared, so we show it the text instead).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from dsv3_jax.request_stream import held_tail

THINK_START, THINK_END = "<think>", "</think>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, CALL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class ReasoningParser:
    """Splits text into (reasoning, content) at `</think>`.

    With thinking on, the V3.1 template already ends the prompt with `<think>`, so the output starts as
    reasoning; a leading `<think>` the model writes anyway is dropped. With thinking off the prompt ends
    with `</think>` and everything is content.
    """

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self._at_start = thinking
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        if not self.in_reasoning:
            return "", buf
        if self._at_start:
            if len(buf) < len(THINK_START) and THINK_START.startswith(buf):
                self._held = buf
                return "", ""
            if buf.startswith(THINK_START):
                buf = buf[len(THINK_START):]
            self._at_start = False
        i = buf.find(THINK_END)
        if i >= 0:
            self.in_reasoning = False
            return buf[:i], buf[i + len(THINK_END):]
        keep = held_tail(buf, [THINK_END])
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], ""

    def flush(self) -> tuple[str, str]:
        out, self._held = self._held, ""
        return (out, "") if self.in_reasoning else ("", out)


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclasses.dataclass
class ToolCallDelta:
    """A streamed piece of call `index`: the first delta of a call carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            fn = {"name": self.name, **fn}
        out["function"] = fn
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


TOOL_FORMATS = ("deepseek_v31", "deepseek_v3")
V3_FENCE = "```json"
_V3_CLOSINGS = ("\n```\n" + CALL_END, "\n```" + CALL_END, "```\n" + CALL_END, "```" + CALL_END)


def detect_tool_format(chat_template: str | None) -> str:
    """The call format a chat template writes past calls in: `deepseek_v3` (V3 / V3-0324: a ```json block
    after `function<｜tool▁sep｜>NAME`), else `deepseek_v31`."""
    return "deepseek_v3" if chat_template and V3_FENCE in chat_template else "deepseek_v31"


class ToolCallParser:
    """Parses the tool-call block out of content text: content before it stays content, each call
    becomes a `ToolCall` (name when it is complete, arguments streamed as they come).

    `fmt`: `deepseek_v31` (`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`) or `deepseek_v3`
    (V3-0324: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`; the
    fence is optional). `names`: the declared tools; a call to any other name is not a call: its text, from
    `<｜tool▁call▁begin｜>` to `<｜tool▁call▁end｜>`, comes back as content (None: any name).
    Whitespace between calls is dropped; text after `<｜tool▁calls▁end｜>` is content again. A call cut off
    before its name is complete (length limit) is dropped; one cut inside its arguments keeps them as is.
    """

    def __init__(self, fmt: str = "deepseek_v31", names: Collection[str] | None = None) -> None:
        if fmt not in TOOL_FORMATS:
            raise ValueError(f"tool-call format must be one of {TOOL_FORMATS}, got {fmt!r}")
        self.fmt, self.names = fmt, None if names is None else frozenset(names)
        self.state = "text"  # text | between | name | v3name | fence | args | raw | after
        self.calls: list[ToolCall] = []
        self._held = ""
        self._name = ""
        self._raw = ""  # the call's text so far (returned as content if its name is not a declared tool)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        buf, self._held = self._held + text, ""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while buf:
            if self.state in ("text", "after"):
                i = buf.find(CALLS_BEGIN) if self.state == "text" else -1
                if i >= 0:
                    content.append(buf[:i])
                    buf, self.state = buf[i + len(CALLS_BEGIN):], "between"
                    continue
                keep = held_tail(buf, [CALLS_BEGIN]) if self.state == "text" else 0
                content.append(buf[: len(buf) - keep])
                self._held, buf = buf[len(buf) - keep:], ""
            elif self.state == "between":
                s = buf.lstrip()
                if s.startswith(CALL_BEGIN):
                    buf, self.state, self._name, self._raw = s[len(CALL_BEGIN):], "name", "", CALL_BEGIN
                elif s.startswith(CALLS_END):
                    buf, self.state = s[len(CALLS_END):], "after"
                elif not s or CALL_BEGIN.startswith(s) or CALLS_END.startswith(s):
                    self._held, buf = s, ""
                else:  # not a call: the block is malformed; what follows is content
                    self.state = "after"
                    buf = s
            elif self.state in ("name", "v3name"):
                marker = CALL_SEP if self.state == "name" else "\n"
                i = buf.find(marker)
                if i < 0:
                    keep = held_tail(buf, [marker])
                    self._name += buf[: len(buf) - keep]
                    self._raw += buf[: len(buf) - keep]
                    self._held, buf = buf[len(buf) - keep:], ""
                    continue
                self._name += buf[:i]
                self._raw += buf[: i + len(marker)]
                buf = buf[i + len(marker):]
                if self.state == "name" and self.fmt == "deepseek_v3":  # that was the type ("function")
                    self.state, self._name = "v3name", ""
                    continue
                name = self._name.strip()
                if self.names is not None and name not in self.names:
                    content.append(self._raw)
                    self.state = "raw"
                    continue
                call = ToolCall(new_call_id(), name)
                self.calls.append(call)
                deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name))
                self.state = "fence" if self.fmt == "deepseek_v3" else "args"
            elif self.state == "fence":  # V3: an optional ```json line before the arguments
                s = buf.lstrip(" ")
                if len(s) < len(V3_FENCE) + 1 and (V3_FENCE + "\n").startswith(s):
                    self._held, buf = buf, ""
                    continue
                if s.startswith(V3_FENCE):
                    s = s[len(V3_FENCE):]
                    buf = s[1:] if s.startswith("\n") else s
                self.state = "args"
            elif self.state == "raw":  # an undeclared tool's call: content up to and with its end marker
                i = buf.find(CALL_END)
                if i >= 0:
                    content.append(buf[: i + len(CALL_END)])
                    buf, self.state = buf[i + len(CALL_END):], "between"
                    continue
                keep = held_tail(buf, [CALL_END])
                content.append(buf[: len(buf) - keep])
                self._held, buf = buf[len(buf) - keep:], ""
            else:  # args
                closings = [CALL_END] if self.fmt == "deepseek_v31" else [*_V3_CLOSINGS, CALL_END]
                i = buf.find(CALL_END)
                if i >= 0:
                    piece = buf[:i]
                    for c in closings:  # the V3 closing fence is not part of the arguments
                        fence = c[: -len(CALL_END)]
                        if fence and piece.endswith(fence):
                            piece = piece[: -len(fence)]
                            break
                    self._args(piece, deltas)
                    buf, self.state = buf[i + len(CALL_END):], "between"
                    continue
                keep = held_tail(buf, closings)
                self._args(buf[: len(buf) - keep], deltas)
                self._held, buf = buf[len(buf) - keep:], ""
        return "".join(content), _merge(deltas)

    def _args(self, piece: str, deltas: list[ToolCallDelta]) -> None:
        if not piece:
            return
        self.calls[-1].arguments += piece
        deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        held, self._held = self._held, ""
        deltas: list[ToolCallDelta] = []
        if self.state in ("text", "after", "raw"):
            return held, deltas
        if self.state == "args":
            self._args(held, deltas)
        return "", deltas


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One delta per call index within one feed (name delta first, arguments concatenated)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            out[-1].arguments += d.arguments
        else:
            out.append(dataclasses.replace(d))
    return out


@dataclasses.dataclass
class OutputDelta:
    """What one piece of model text adds to a chat choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Reasoning split -> tool calls (content only), for one chat choice.

    `feed` each text piece (request_stream.Delta.text: detokenized, cut at stop strings), then `flush`
    at the end; the deltas add up to `reasoning`, `content` and `tool_calls`.
    """

    def __init__(self, *, thinking: bool, tools: bool | Collection[str], tool_format: str = "deepseek_v31"):
        """`tools`: False (no parsing), the declared tool names (calls to others stay content), or True
        (any name)."""
        self.reasoning_parser = ReasoningParser(thinking)
        names = None if tools is True else tools
        self.tool_parser = ToolCallParser(tool_format, names) if tools else None
        self.reasoning = ""
        self.content = ""

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tool_parser.calls if self.tool_parser else []

    def feed(self, piece: str) -> OutputDelta:
        return self._text(piece, final=False)

    def flush(self) -> OutputDelta:
        return self._text("", final=True)

    def _text(self, text: str, final: bool) -> OutputDelta:
        reasoning, content = self.reasoning_parser.feed(text)
        if final:
            r2, c2 = self.reasoning_parser.flush()
            reasoning, content = reasoning + r2, content + c2
        calls: list[ToolCallDelta] = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.feed(content)
            if final:
                c2, calls2 = self.tool_parser.flush()
                content, calls = content + c2, _merge(calls + calls2)
        self.reasoning += reasoning
        self.content += content
        return OutputDelta(reasoning, content, calls)


def tool_description(tools: Sequence[Mapping[str, Any]], fmt: str = "deepseek_v31") -> str:
    """The `## Tools` system-prompt block of the DeepSeek-V3.1 model card for OpenAI-style `tools`; with
    `fmt="deepseek_v3"` the same block asks for the V3-0324 call format its template writes."""
    lines = ["## Tools", "You have access to the following tools:", ""]
    for tool in tools:
        fn = tool["function"]
        params = json.dumps(fn.get("parameters") or {}, ensure_ascii=False)
        lines += [f"### {fn['name']}", f"Description: {fn.get('description') or ''}", "",
                  f"Parameters: {params}", ""]
    lines += [
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:",
        f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{CALL_SEP}tool_call_arguments{CALL_END}"
        f"{{additional_tool_calls}}{CALLS_END}" if fmt == "deepseek_v31" else
        f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}tool_call_name\n{V3_FENCE}\ntool_call_arguments\n```"
        f"{CALL_END}{{additional_tool_calls}}{CALLS_END}",
        "",
        "Where:",
        "- `tool_call_name` must be an exact match to one of the available tools",
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema",
        "- For multiple tool calls, chain them directly without separators or spaces",
    ]
    return "\n".join(lines)
