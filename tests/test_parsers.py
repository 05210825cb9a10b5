"""Output parsers of the server (dsv3_jax/serve/parsers.py) on hand-written text streams.

Every case is fed whole, character by character, and split at every single position and at random
multi-way cuts: the streamed deltas must add up to the expected reasoning / content / tool calls.
"""

from __future__ import annotations

import json
import random

import pytest

from dsv3_jax.request_stream import StopMatcher
from dsv3_jax.serve.parsers import (
    CALL_BEGIN,
    CALL_END,
    CALL_SEP,
    CALLS_BEGIN,
    CALLS_END,
    ChatOutputParser,
    tool_description,
)


def _splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, cut once at every position, and 20 random cuttings."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def _run(pieces, stop=(), **kw):
    # As the server composes them: the request layer's stop strings cut the text, then the chat parser.
    m, p = StopMatcher(stop), ChatOutputParser(**kw)
    reasoning, content, calls = "", "", {}
    for d in [p.feed(m.feed(x)) for x in pieces] + [p.feed(m.flush()), p.flush()]:
        reasoning += d.reasoning
        content += d.content
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index not in calls, "a call's name was announced twice"
                calls[c.index] = {"id": c.id, "name": c.name, "arguments": ""}
            calls[c.index]["arguments"] += c.arguments
    # The streamed deltas and the parser's own totals agree.
    assert (reasoning, content) == (p.reasoning, p.content)
    streamed = [(c["name"], c["arguments"]) for c in calls.values()]
    assert streamed == [(c.name, c.arguments) for c in p.tool_calls]
    return reasoning, content, streamed, m.stopped


def _check_all_splits(text, expected, **kw):
    for pieces in _splits(text):
        assert _run(pieces, **kw) == expected, pieces


def test_reasoning_split_thinking_on():
    text = "Let me think <b>about</b> it.</think>The answer is 4."
    _check_all_splits(text, ("Let me think <b>about</b> it.", "The answer is 4.", [], False),
                      thinking=True, tools=False)


def test_reasoning_leading_think_tag_dropped_and_unfinished_reasoning():
    _check_all_splits("<think>hmm</think>ok", ("hmm", "ok", [], False), thinking=True, tools=False)
    # Cut off before </think> (length limit): everything is reasoning, a partial tag included.
    _check_all_splits("still thinking </thi", ("still thinking </thi", "", [], False), thinking=True,
                      tools=False)


def test_thinking_off_is_all_content():
    text = "plain </think> text <think>"
    _check_all_splits(text, ("", text, [], False), thinking=False, tools=False)


def test_single_tool_call():
    args = '{"location": "Paris, FR", "unit": "°C"}'
    text = f"Checking.{CALLS_BEGIN}{CALL_BEGIN}get_weather{CALL_SEP}{args}{CALL_END}{CALLS_END}"
    _check_all_splits(text, ("", "Checking.", [("get_weather", args)], False), thinking=False, tools=True)


def test_several_tool_calls_with_reasoning_first():
    a1, a2 = '{"q": "jax <pallas>"}', '{"a": [1, 2, {"b": "}"}]}'
    text = (f"need tools</think>{CALLS_BEGIN}{CALL_BEGIN}search{CALL_SEP}{a1}{CALL_END}"
            f"{CALL_BEGIN}calc{CALL_SEP}{a2}{CALL_END}{CALLS_END}")
    _check_all_splits(text, ("need tools", "", [("search", a1), ("calc", a2)], False), thinking=True,
                      tools=True)


def test_tool_block_cut_off_keeps_complete_name_and_partial_arguments():
    text = f"{CALLS_BEGIN}{CALL_BEGIN}f{CALL_SEP}{{\"x\": 1"
    _check_all_splits(text, ("", "", [("f", '{"x": 1')], False), thinking=False, tools=True)
    text = f"hi{CALLS_BEGIN}{CALL_BEGIN}get_wea"
    _check_all_splits(text, ("", "hi", [], False), thinking=False, tools=True)


def test_tools_off_leaves_markers_in_content():
    text = f"{CALLS_BEGIN}{CALL_BEGIN}f{CALL_SEP}{{}}{CALL_END}{CALLS_END}"
    _check_all_splits(text, ("", text, [], False), thinking=False, tools=False)


def test_text_after_tool_block_and_lookalike_prefixes_are_content():
    # '<｜tool' starts like a marker but is not one: it must come out as content, unchanged.
    text = f"a <｜tool x {CALLS_BEGIN}{CALL_BEGIN}g{CALL_SEP}{{}}{CALL_END}{CALLS_END} done"
    _check_all_splits(text, ("", "a <｜tool x  done", [("g", "{}")], False), thinking=False, tools=True)


def test_stop_strings_cut_and_hold_back():
    text = "one two STOP three"
    _check_all_splits(text, ("", "one two ", [], True), thinking=False, tools=False, stop=["STOP", "xyz"])
    # A prefix of a stop string that never completes is released at the end.
    _check_all_splits("ends with ST", ("", "ends with ST", [], False), thinking=False, tools=False,
                      stop=["STOP"])
    m = StopMatcher(["ab", "b"])
    assert m.feed("xa") == "x" and m.feed("b") == "" and m.stopped  # earliest stop wins: "ab" at 1


def test_stop_string_inside_reasoning():
    _check_all_splits("think END more</think>x", ("think ", "", [], True), thinking=True, tools=False,
                      stop=["END"])


@pytest.mark.parametrize("desc", [None, "Look up the weather"])
def test_tool_description_block(desc):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": desc,
                                               "parameters": {"type": "object", "properties": {}}}}]
    block = tool_description(tools)
    assert block.startswith("## Tools\nYou have access to the following tools:\n\n### get_weather\n")
    params = json.dumps(tools[0]["function"]["parameters"])
    assert f"Description: {desc or ''}\n\nParameters: {params}" in block
    assert f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{CALL_SEP}tool_call_arguments{CALL_END}" in block
    assert block.endswith("chain them directly without separators or spaces")


# ------------------------------------------------------------------ V3-0324 format and declared names
V3 = {"tool_format": "deepseek_v3"}


def _v3_call(name: str, args: str, sep: str = "\n") -> str:
    return f"{CALL_BEGIN}function{CALL_SEP}{name}\n```json\n{args}{sep}```{CALL_END}"


def test_v3_0324_tool_calls():
    a1, a2 = '{"city": "Paris"}', '{"expr": "```not the end``` \\n x"}'
    text = f"Let me check.{CALLS_BEGIN}{_v3_call('get_weather', a1)}\n{_v3_call('calc', a2)}{CALLS_END}"
    _check_all_splits(text, ("", "Let me check.", [("get_weather", a1), ("calc", a2)], False),
                      thinking=False, tools=True, **V3)
    # The chat template's own rendering of a past call parses back to the same call.
    _check_all_splits(f"{CALLS_BEGIN}{_v3_call('f', '{}', sep=chr(10))}{CALLS_END}",
                      ("", "", [("f", "{}")], False), thinking=False, tools={"f"}, **V3)


def test_v3_without_fence_and_cut_off():
    text = f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}f\n{{\"x\": 1}}{CALL_END}{CALLS_END}"
    _check_all_splits(text, ("", "", [("f", '{"x": 1}')], False), thinking=False, tools=True, **V3)
    cut = f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}f\n```json\n{{\"x\""
    _check_all_splits(cut, ("", "", [("f", '{"x"')], False), thinking=False, tools=True, **V3)


def test_v31_text_under_the_v3_parser_is_not_a_call_named_function():
    # The bug of 2026-12-04 the other way round: a V3 call read by the V3.1 parser was named "function".
    text = f"{CALLS_BEGIN}{_v3_call('get_weather', '{}')}{CALLS_END}"
    _, _, calls, _ = _run([text], thinking=False, tools={"get_weather"})
    assert calls == []  # "function" is no declared tool: the text is content, not a call
    _, _, calls, _ = _run([text], thinking=False, tools={"get_weather"}, **V3)
    assert calls == [("get_weather", "{}")]


@pytest.mark.parametrize("fmt", ["deepseek_v31", "deepseek_v3"])
def test_undeclared_tool_name_comes_back_as_content(fmt):
    def call(name, args):
        v31 = f"{CALL_BEGIN}{name}{CALL_SEP}{args}{CALL_END}"
        return _v3_call(name, args) if fmt == "deepseek_v3" else v31

    bad = call("rm_rf", '{"path": "/"}')
    text = f"ok{CALLS_BEGIN}{call('get_weather', '{}')}{bad}{CALLS_END}"
    _check_all_splits(text, ("", "ok" + bad, [("get_weather", "{}")], False), thinking=False,
                      tools={"get_weather"}, tool_format=fmt)


def test_detect_tool_format_and_v3_description():
    from dsv3_jax.serve.parsers import detect_tool_format
    from dsv3_jax.text.tokenizer import Tokenizer

    assert detect_tool_format(Tokenizer.default().chat_template) == "deepseek_v31"
    assert detect_tool_format("{{ '<｜tool▁sep｜>' + name + '\\n' + '```json' }}") == "deepseek_v3"
    assert detect_tool_format(None) == "deepseek_v31"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    block = tool_description(tools, "deepseek_v3")
    want = f"{CALL_BEGIN}function{CALL_SEP}tool_call_name\n```json\ntool_call_arguments\n```{CALL_END}"
    assert want in block
