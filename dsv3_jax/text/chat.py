"""Chat prompts: render a tokenizer's Jinja `chat_template` exactly as transformers' `apply_chat_template`.

Owns: the sandboxed Jinja environment (same options, filters and globals as transformers), message
normalization and checking (a role the template does not render, or non-string content, is refused
rather than silently dropped), the thinking switch (`thinking`, alias `enable_thinking`), continuing the
final message (`continue_final_message`: the rendered chat cut right after its text, as transformers
does), and encoding a rendered chat.
Does not own tokenization itself (`tokenizer.py`) or generation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dsv3_jax.text.tokenizer import Tokenizer

# Names under which a message's reasoning may arrive; transformers copies it to all of the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by some templates to mark assistant text).

    transformers uses these blocks to build an assistant-token mask; for plain rendering the body is
    emitted unchanged, which is all we need.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '); chat templates want plain JSON, non-ASCII kept as is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeDict:
    """`dict(...)` inside templates, without exposing the dict type itself to the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja's Namespace signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template may not set namespace attribute {name!r}")


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template in the same environment transformers uses (cached per template text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Rebuild template inputs out of plain JSON-like types (dicts, lists, str, numbers, None)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str | int | float):
        return _scalar(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy / jax scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _scalar(value: str | int | float) -> str | int | float:
    # Subclasses (str enums, IntEnum) become their base type, as transformers does.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    return float.__float__(value)


_ROLE_TEST = re.compile(r"""(?:\[\s*['"]role['"]\s*\]|\.role)\s*==\s*['"]([^'"]+)['"]""")
_ROLE_PRINTED = re.compile(r"""\{\{[^}]*(?:\[\s*['"]role['"]\s*\]|\.role)""")


@functools.lru_cache(maxsize=16)
def template_roles(template: str) -> frozenset[str] | None:
    """The roles a chat template renders: those it compares `message['role']` with, or None (any role)
    when it prints the role itself or names none. A message whose role the template never tests is
    dropped from the prompt without a word, so `render_chat` refuses it instead."""
    if _ROLE_PRINTED.search(template):
        return None
    roles = frozenset(_ROLE_TEST.findall(template))
    return roles or None


def _check_message(i: int, message: dict, roles: frozenset[str] | None) -> None:
    role = message["role"]
    if roles is not None and role not in roles:
        raise ValueError(f"messages[{i}]: role {role!r} is not one this chat template renders "
                         f"({', '.join(sorted(roles))}); it would be silently left out of the prompt")
    content = message.get("content")
    if content is None and not message.get("tool_calls"):
        raise ValueError(f"messages[{i}] ({role}) has no 'content'")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{i}] ({role}): 'content' must be a string, got {type(content).__name__} "
                         f"{content!r:.60}")


def _normalize_messages(messages: Sequence[Any], roles: frozenset[str] | None = None) -> list[dict]:
    """transformers' normalization: plain dicts, None-valued keys dropped, reasoning aliases filled.

    One deliberate difference: an assistant message with `tool_calls` and `content=None` (the OpenAI
    shape) keeps `content` as "" instead of losing the key, which transformers 5 then fails on. For
    DeepSeek templates "" renders exactly what `content=None` rendered in transformers 4.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty: a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        message = _plain(message)
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] has no string 'role': {message!r}")
        if message.get("tool_calls") and message.get("content", "") is None:
            message["content"] = ""
        _check_message(i, message, roles)
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(
    template: str,
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = False,
    thinking: bool | None = None,
    enable_thinking: bool | None = None,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """Render `messages` with a chat template, byte-identical to transformers' apply_chat_template.

    `continue_final_message`: the prompt ends inside the last message (no end-of-turn after its text), so
    the model continues it; incompatible with `add_generation_prompt`, and refused when the template
    does not write the message's text verbatim.

    `thinking` and `enable_thinking` are the same switch (DeepSeek-V3.1 reads `thinking`, other families
    read `enable_thinking`); whichever is given is passed under both names, and left out when neither is
    given so the template's own default applies. `special_tokens` (bos_token, eos_token, ...) are template
    variables; explicit `kwargs` override them, as in transformers.
    """
    if not isinstance(template, str) or not template:
        raise ValueError("render_chat: no chat template (tokenizer_config.json has no 'chat_template')")
    if thinking is not None and enable_thinking is not None and bool(thinking) != bool(enable_thinking):
        raise ValueError(f"thinking={thinking} and enable_thinking={enable_thinking} disagree; pass one")
    switch = thinking if thinking is not None else enable_thinking
    if switch is not None:
        kwargs["thinking"] = kwargs["enable_thinking"] = bool(switch)
    for name, items in (("tools", tools), ("documents", documents)):
        if items is not None and not all(isinstance(x, Mapping) for x in items):
            raise ValueError(f"render_chat: {name} must be a list of dicts (JSON schemas)")
    variables = {**(special_tokens or {}), **_plain(kwargs)}
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set: the first "
                         "continues the last message, the second opens a new assistant turn")
    normalized = _normalize_messages(messages, template_roles(template))
    rendered = compile_template(template).render(
        messages=normalized,
        tools=_plain(list(tools)) if tools is not None else None,
        documents=_plain(list(documents)) if documents is not None else None,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    return _cut_after_final(rendered, normalized[-1]) if continue_final_message else rendered


def _cut_after_final(rendered: str, message: dict) -> str:
    """The rendered chat up to the end of the final message's text (transformers' rule: its last
    occurrence; where the template trimmed the text's trailing spaces, up to the trimmed end)."""
    text = message.get("content") or ""
    if not text.strip() or text.strip() not in rendered:
        raise ValueError("continue_final_message: the final message's text does not appear in the rendered "
                         "chat (the template changes it), so there is nothing to continue")
    at = rendered.rindex(text.strip())
    if rendered[at:at + len(text.lstrip())] == text.lstrip():
        return rendered[:at + len(text.lstrip())]
    return rendered[:at + len(text.strip())]


def apply_chat_template(
    tokenizer: Tokenizer, messages: Sequence[Any], *, add_generation_prompt: bool = False, **kwargs: Any
) -> str:
    """Render with the tokenizer's own template and special tokens (see `render_chat` for the kwargs)."""
    if tokenizer.chat_template is None:
        raise ValueError("tokenizer has no chat_template (none in tokenizer_config.json)")
    return render_chat(
        tokenizer.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=tokenizer.special_tokens,
        **kwargs,
    )


def encode_chat(
    tokenizer: Tokenizer, messages: Sequence[Any], *, add_generation_prompt: bool = True, **kwargs: Any
) -> list[int]:
    """Token ids of the rendered chat; the template writes BOS itself, so none is added here."""
    text = apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    return tokenizer.encode(text, add_bos=False)
