"""Server paths that need a forced model output: V3.1 tool calls, reasoning + tools, and admission (429).

The model here is a scripted stand-in for the Engine (the contract of engine/api.py: add_request, cancel,
step, has_work, engine_stats; plus what the runner reads: finished, pool, waiting, running) used ONLY
to force what the model "says"; the app, runner thread, request streams, parsers, SSE and the official
openai client are the real ones (in-process ASGI).
Everything that a real model can exercise is tested against the real server in test_serve.py.
"""

from __future__ import annotations

import json
import time
import types

import pytest

from dsv3_jax.engine.api import EngineConfig, FinishReason, StepEvent
from dsv3_jax.engine.paging import PagePool
from dsv3_jax.model import kv_cache
from dsv3_jax.serve.parsers import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END
from dsv3_jax.serve.runner import EngineRunner
from dsv3_jax.text.tokenizer import Tokenizer

# The serving extras: the app is fastapi (its TestClient drives it through httpx), /metrics is
# prometheus_client, the client is openai. An image without them (the GPU machine's) skips this module.
_EXTRAS = "the server tests need the serving extras (pip install -e '.[test]')"
for _name in ("fastapi", "httpx", "prometheus_client"):
    pytest.importorskip(_name, reason=f"{_name} is not installed: {_EXTRAS}")
openai = pytest.importorskip("openai", reason=f"openai is not installed: {_EXTRAS}")

from fastapi.testclient import TestClient  # noqa: E402

from dsv3_jax.serve.app import Service, create_app  # noqa: E402
from dsv3_jax.serve.metrics import Metrics  # noqa: E402

MODEL = "scripted"
ARGS = '{"city": "Paris", "days": [1, 2]}'


class ScriptedEngine:
    """Emits `script` (token ids) for every request, a few tokens per step, then finishes with STOP.

    `hold=True` keeps every request running without output (to fill the admission bound).
    """

    script: list[int] = []
    hold = False
    broken_stats = False  # engine_stats raises: a bug outside the step, on the engine thread

    def __init__(self, handle, cfg: EngineConfig):
        self.cfg, self.pool = cfg, PagePool(cfg.num_pages, cfg.page_size)
        self.waiting, self.running, self.finished = [], [], {}
        self._next = 0

    def add_request(self, prompt, *, max_new_tokens, eos=(), **_):
        r = types.SimpleNamespace(rid=self._next, prompt=list(prompt), output=[], finish_reason=None,
                                  cached_tokens=0, max_new_tokens=max_new_tokens,
                                  pages=self.pool.allocate(kv_cache.pages_for(len(prompt) + max_new_tokens,
                                                                              self.cfg.page_size)))
        self._next += 1
        self.running.append(r)
        return r.rid

    def _finish(self, r, reason):
        self.running.remove(r)
        self.pool.release(r.pages)
        r.pages, r.finish_reason = [], reason
        self.finished[r.rid] = r

    def cancel(self, rid):
        r = next((r for r in self.running if r.rid == rid), None)
        if r is not None:
            self._finish(r, FinishReason.CANCELLED)
        return r is not None

    def has_work(self):
        return bool(self.running)

    def step(self):
        if self.hold:
            time.sleep(0.01)
            return []
        events = []
        for r in list(self.running):
            new = self.script[len(r.output): len(r.output) + 3][: r.max_new_tokens - len(r.output)]
            r.output += new
            done = len(r.output) >= min(len(self.script), r.max_new_tokens)
            reason = None
            if done:
                reason = FinishReason.STOP if len(r.output) == len(self.script) else FinishReason.LENGTH
                self._finish(r, reason)
            events.append(StepEvent(r.rid, new, done, reason))
        return events

    def engine_stats(self):
        if self.broken_stats:
            raise KeyError("compiles")
        return {"steps": 1, "mean_batch": 1.0, "prefix_hit_rate": 0.0, "mtp_acceptance": float("nan"),
                "compiles": 0, "compiles_after_warmup": 0}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.default()


@pytest.fixture
def served(tokenizer):
    handle = types.SimpleNamespace(
        tokenizer=tokenizer, generation_defaults={"temperature": 0.6, "top_p": 0.95},
        config=types.SimpleNamespace(max_position_embeddings=4096, vocab_size=tokenizer.vocab_size,
                                     bos_token_id=tokenizer.bos_id),
        eos_ids=lambda: [tokenizer.eos_id])
    runner = EngineRunner(handle, EngineConfig(num_pages=64, max_batch=4), max_pending=3, metrics=Metrics(),
                          engine_factory=ScriptedEngine)
    runner.start()
    with TestClient(create_app(Service(handle, runner, runner.metrics, MODEL))) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0,
                            timeout=30), http, runner
    runner.stop()
    ScriptedEngine.hold = False
    ScriptedEngine.broken_stats = False


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _script(tokenizer, text):
    ScriptedEngine.script = tokenizer.encode(text, add_bos=False)


def test_tool_call_parsed_stream_and_not(served, tokenizer):
    client, _, runner = served
    _script(tokenizer, f"Let me check.{CALLS_BEGIN}{CALL_BEGIN}get_weather{CALL_SEP}{ARGS}{CALL_END}"
                       f"{CALL_BEGIN}get_weather{CALL_SEP}{{}}{CALL_END}{CALLS_END}")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200,
                                       extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me check."
    assert [(t.function.name, t.function.arguments) for t in ch.message.tool_calls] == \
        [("get_weather", ARGS), ("get_weather", "{}")]
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": [1, 2]}
    assert len({t.id for t in ch.message.tool_calls}) == 2
    # The tools reached the prompt as the V3.1 model card's system block, after the user's system prompt.
    prompt = tokenizer.decode(r.model_extra["prompt_token_ids"])
    assert prompt.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n")
    assert "### get_weather\nDescription: Weather forecast\n\nParameters: {\"type\": \"object\"" in prompt
    assert prompt.endswith("<｜User｜>Weather in Paris?<｜Assistant｜></think>")

    calls, content, reasons = {}, "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200,
                                                stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        reasons.append(chunk.choices[0].finish_reason)
        for t in d.tool_calls or []:
            if t.id:
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments or ""
    assert content == "Let me check."
    assert list(calls.values()) == [["get_weather", ARGS], ["get_weather", "{}"]]
    assert [x for x in reasons if x] == ["tool_calls"]
    assert runner.pending == 0


def test_reasoning_then_tool_call_and_tools_off(served, tokenizer):
    client, _, _ = served
    _script(tokenizer, f"I should call it.</think>{CALLS_BEGIN}{CALL_BEGIN}get_weather{CALL_SEP}{ARGS}"
                       f"{CALL_END}{CALLS_END}")
    msgs = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "I should call it."
    assert m.content is None and m.tool_calls[0].function.arguments == ARGS
    # tool_choice "none": no tool block in the prompt and the markers stay plain content.
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none",
                                       max_tokens=200)
    assert r.choices[0].message.tool_calls is None
    assert CALLS_BEGIN in r.choices[0].message.content


def test_tool_call_cut_by_length(served, tokenizer):
    client, _, _ = served
    _script(tokenizer, f"{CALLS_BEGIN}{CALL_BEGIN}get_weather{CALL_SEP}{ARGS}{CALL_END}{CALLS_END}")
    n = len(ScriptedEngine.script) - 4
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                       max_tokens=n)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == n
    assert ch.message.tool_calls[0].function.name == "get_weather"
    assert ARGS.startswith(ch.message.tool_calls[0].function.arguments)


def test_admission_bound_gives_429(served, tokenizer):
    client, http, runner = served
    ScriptedEngine.hold = True
    streams = [http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5,
                                                             "stream": True}) for _ in range(3)]
    opened = [s.__enter__() for s in streams]
    try:
        assert all(o.status_code == 200 for o in opened)
        deadline = time.monotonic() + 10
        while runner.pending < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.pending == 3
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="one more", max_tokens=5)
        assert "server busy" in e.value.body["message"]
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        ScriptedEngine.hold = False
        for s in streams:
            s.__exit__(None, None, None)
    deadline = time.monotonic() + 10
    while runner.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.pending == 0
    assert runner.engine.pool.num_used == 0


def test_tool_history_rendered_in_v31_format(served, tokenizer):
    """A finished tool round trip (assistant tool_calls, tool result) goes back to the model in the V3.1
    template's own format; content given as text parts is joined."""
    client, _, _ = served
    _script(tokenizer, "Sunny, 22C.")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=50,
                                       extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(r.model_extra["prompt_token_ids"])
    assert prompt.endswith(f"<｜User｜>Weather?<｜Assistant｜></think>{CALLS_BEGIN}{CALL_BEGIN}get_weather"
                           f"{CALL_SEP}{ARGS}{CALL_END}{CALLS_END}<｜end▁of▁sentence｜>"
                           "<｜tool▁output▁begin｜>22C<｜tool▁output▁end｜>")
    assert r.choices[0].message.content == "Sunny, 22C." and r.choices[0].finish_reason == "stop"


def test_engine_thread_death_answers_every_client(served, tokenizer):
    """A bug on the engine thread outside the step (here its gauge update) must not leave a client waiting
    forever (the CI hang of 2026-12-04): the request in flight gets a 5xx and later ones a 503."""
    client, http, runner = served
    _script(tokenizer, "A sentence long enough to need several engine steps to come out whole.")
    ScriptedEngine.broken_stats = True
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 50})
    assert r.status_code >= 500 and "KeyError" in r.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while runner.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not runner.alive and runner.pending == 0
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5})
    assert r.status_code == 503 and "engine thread stopped" in r.json()["error"]["message"]
