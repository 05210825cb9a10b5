"""Structured outputs: a request's output held to a grammar (JSON schema, any JSON object, a regex, one of
a few strings) through llguidance (the `serve` extra; imported on first use).

Owns: turning a request's format into a validated llguidance grammar (`compile_format`: `Grammar`, an
immutable, shareable value; a bad schema is a `FormatInvalid` naming the request field), the llguidance
tokenizer built once per `Tokenizer` (`ll_tokenizer`, ~2 s for DeepSeek-V3.1's 129K tokens), and the
per-request matcher the engine drives (`Constraint`: `fill_bitmask(out)` writes the allowed next tokens as
ceil(V/32) int32 words, bit b of word w = token 32 w + b, the layout the step's bitmask input takes;
`advance(token)` consumes a sampled token; `done` once the grammar can take nothing more; `error`).
The engine applies the bitmask on the device and decides when to fill it (engine/core.py, step.py);
this module never touches device arrays, the engine or the wire format (serve/protocol.py).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsv3_jax.text.tokenizer import Tokenizer

_LOCK = threading.Lock()
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class FormatInvalid(ValueError):
    """A format no grammar can be built from; `field` names the request field (e.g. response_format)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - the serve extra installs it
        raise FormatInvalid("structured outputs need the llguidance package (pip install llguidance)",
                            "response_format") from e
    return llguidance


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos: Sequence[int]) -> Any:
    """The llguidance tokenizer for `tokenizer` at the model's `vocab_size` (ids past the tokenizer's own
    are never allowed) with these end-of-sequence ids; built once per (tokenizer, vocab, eos)."""
    llg = _llguidance()
    key = (vocab_size, tuple(sorted(set(eos))))
    with _LOCK:
        per = _LL_TOKENIZERS.setdefault(tokenizer, {})
        if key not in per:
            per[key] = llg.LLTokenizer(tokenizer._json, n_vocab=vocab_size,
                                       eos_token=list(key[1]) or None)
        return per[key]


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar and the tokenizer it runs over; `constraint()` starts a matcher."""

    kind: str  # json_schema | json_object | regex | choice
    grammar: str  # llguidance's grammar JSON
    tokenizer: Any = dataclasses.field(compare=False, repr=False)  # llguidance.LLTokenizer

    def constraint(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """One request's matcher over a `Grammar` (single-threaded: the engine thread)."""

    def __init__(self, grammar: Grammar):
        llg = _llguidance()
        self.grammar = grammar
        self.matcher = llg.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
        if self.matcher.is_error():
            raise FormatInvalid(f"grammar: {self.matcher.get_error()}", "response_format")

    @property
    def error(self) -> str | None:
        return self.matcher.get_error().splitlines()[0] if self.matcher.is_error() else None

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow (the engine stops it there)."""
        return self.matcher.is_stopped()

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the tokens allowed next into `out` (int32 [ceil(V/32)], C-contiguous)."""
        if out.dtype != np.int32 or out.ndim != 1 or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"bitmask row must be a contiguous int32 vector, got {out.dtype} {out.shape}")
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False (and `error` set) if the grammar refuses it."""
        return bool(self.matcher.consume_token(int(token)))


def _json_schema(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise FormatInvalid(f"{field}: the schema is not valid JSON ({e})", field) from None
    if not isinstance(schema, dict | bool):
        raise FormatInvalid(f"{field}: the schema must be a JSON object, got {type(schema).__name__}", field)
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError) as e:
        raise FormatInvalid(f"{field}: {e}", field) from None


def compile_format(kind: str, value: Any, tokenizer: Tokenizer, *, vocab_size: int, eos: Sequence[int],
                   field: str) -> Grammar:
    """A validated grammar for one format: `kind` json_schema (value: the schema, a dict or its JSON
    text), json_object (value ignored: any JSON object), regex (a pattern) or choice (a list of strings,
    the output is exactly one of them). FormatInvalid naming `field` if it cannot be built."""
    llg = _llguidance()
    if kind == "json_schema":
        grammar = _json_schema(value, field)
    elif kind == "json_object":
        grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"})
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise FormatInvalid(f"{field}: a regex must be a non-empty string", field)
        grammar = llg.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise FormatInvalid(f"{field}: choice must be a non-empty list of non-empty strings", field)
        grammar = llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    else:
        raise FormatInvalid(f"{field}: unknown format {kind!r}", field)
    tok = ll_tokenizer(tokenizer, vocab_size, eos)
    err = llg.LLMatcher.validate_grammar(grammar, tok)
    if err:
        raise FormatInvalid(f"{field}: {err.splitlines()[0]}", field)
    return Grammar(kind, grammar, tok)
