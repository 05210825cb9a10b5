"""The server's access rules, limits, names, metrics and edges (issue 31), in process: API keys (401 in
OpenAI's shape, /health and /metrics open), CORS preflights, the body limit (413), --max-model-len (400
naming it; what /v1/models reports), model aliases and GET /v1/models/{id}, `prompt: []` and `n` beyond
the admission bound (400s), the request log, vLLM's metric names, declared tool names and the V3-0324
call format end to end, --seed.

The app, runner thread, request streams, parsers and the official openai client are the real ones; the
engine is test_serve_tools' scripted stand-in (what it "says" is forced). The real process and model are
test_serve.py's.
"""

from __future__ import annotations

import logging
import time
import types

import pytest

from dsv3_jax.engine.api import EngineConfig
from dsv3_jax.serve.parsers import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END
from dsv3_jax.serve.runner import EngineRunner
from dsv3_jax.text.tokenizer import Tokenizer

_EXTRAS = "the server tests need the serving extras (pip install -e '.[test]')"
for _name in ("fastapi", "httpx", "prometheus_client"):
    pytest.importorskip(_name, reason=f"{_name} is not installed: {_EXTRAS}")
openai = pytest.importorskip("openai", reason=f"openai is not installed: {_EXTRAS}")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dsv3_jax.serve.app import ServerOptions, Service, create_app  # noqa: E402
from dsv3_jax.serve.metrics import Metrics  # noqa: E402
from tests.test_serve_tools import TOOLS, ScriptedEngine  # noqa: E402

KEY = "sk-test-0123456789"
NAMES = ("deepseek-ai/DeepSeek-V3.1", "dsv3")
MAX_MODEL_LEN = 64
MAX_PENDING = 3
BODY_LIMIT = 4096


class RecordingEngine(ScriptedEngine):
    """The scripted engine, remembering each request's add_request arguments."""

    calls: list[dict] = []

    def add_request(self, prompt, **kw):
        RecordingEngine.calls.append({"prompt": list(prompt), **kw})
        return super().add_request(prompt, **kw)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.default()


def _serve(tokenizer, **opts):
    handle = types.SimpleNamespace(
        tokenizer=tokenizer, generation_defaults={"temperature": 0.6, "top_p": 0.95},
        config=types.SimpleNamespace(max_position_embeddings=4096, vocab_size=tokenizer.vocab_size,
                                     bos_token_id=tokenizer.bos_id),
        eos_ids=lambda: [tokenizer.eos_id])
    options = ServerOptions(**{"model_names": NAMES, **opts})
    metrics = Metrics(options.model_names[0])
    runner = EngineRunner(handle, EngineConfig(num_pages=64, max_batch=4), max_pending=MAX_PENDING,
                          metrics=metrics, engine_factory=RecordingEngine)
    runner.start()
    return runner, create_app(Service(handle, runner, metrics, options.model_names[0], options=options))


@pytest.fixture(scope="module")
def locked(tokenizer):
    """A server with an API key, CORS for one origin, a small body limit and --max-model-len 64."""
    runner, app = _serve(tokenizer, api_keys=(KEY,), allowed_origins=("https://app.example",),
                         max_body_bytes=BODY_LIMIT, max_model_len=MAX_MODEL_LEN)
    with TestClient(app) as http:
        yield http, runner
    runner.stop()


def _client(http, key=KEY):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0,
                         timeout=30)


def _script(tokenizer, text):
    ScriptedEngine.script = tokenizer.encode(text, add_bos=False)


def _metrics(http) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("GET", "/v1/models/dsv3"),
                                              ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                              ("GET", "/v1/nothing")])
def test_every_v1_route_needs_the_key(locked, method, path):
    http, _ = locked
    for headers, words in (({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "incorrect API key"),
                           ({"Authorization": KEY}, "Bearer KEY")):
        r = http.request(method, path, headers=headers, json={"prompt": "x"})
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert r.json() == {"error": {"message": err["message"], "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}}
        assert words in r.json()["error"]["message"] and r.headers["www-authenticate"] == "Bearer"
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200


def test_official_client_with_and_without_the_key(locked, tokenizer):
    http, _ = locked
    _script(tokenizer, "Hello there.")
    r = _client(http).chat.completions.create(model="dsv3", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5)
    assert r.choices[0].message.content == "Hello" or r.choices[0].message.content.startswith("Hello")
    assert r.model == NAMES[0]  # an alias answers under the first name
    with pytest.raises(openai.AuthenticationError) as e:
        _client(http, "sk-other").models.list()
    assert e.value.body["code"] == "invalid_api_key"


def test_cors_preflight_and_headers(locked):
    http, _ = locked
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = http.options("/v1/chat/completions", headers=pre)  # no key: browsers send none on a preflight
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = http.options("/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_body_limit_is_a_clear_413(locked):
    http, _ = locked
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = '{"prompt": "' + "x" * BODY_LIMIT + '"}'
    r = http.post("/v1/completions", content=big, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert f"limit of {BODY_LIMIT} bytes (--max-request-body-bytes)" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the route counts while reading
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000].encode()

    r = http.post("/v1/completions", content=chunked(), headers=auth)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    m = _metrics(http)
    assert m[("http_requests_total", (("handler", "/v1/completions"), ("method", "POST"),
                                      ("status", "413")))] == 2


def test_models_aliases_and_max_model_len(locked):
    http, _ = locked
    client = _client(http)
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert {m.model_extra["max_model_len"] for m in client.models.list().data} == {MAX_MODEL_LEN}
    for name in NAMES:
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_max_model_len_caps_requests(locked, tokenizer):
    http, _ = locked
    client = _client(http)
    _script(tokenizer, "ok " * 200)
    long_prompt = list(range(1000, 1000 + 70))  # 70 tokens > 64
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="dsv3", prompt=long_prompt, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    assert "maximum context length is 64 tokens" in e.value.body["message"]
    assert "--max-model-len 64" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="dsv3", prompt=long_prompt[:10], max_tokens=60)
    assert e.value.body["param"] == "max_tokens" and "--max-model-len 64" in e.value.body["message"]
    # Without max_tokens, a chat is served up to the cap, not to the model's context.
    RecordingEngine.calls.clear()
    r = client.chat.completions.create(model="dsv3", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    (call,) = RecordingEngine.calls
    assert len(call["prompt"]) + call["max_new_tokens"] == MAX_MODEL_LEN
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= MAX_MODEL_LEN


def test_empty_prompt_and_n_beyond_the_bound_are_400(locked):
    http, runner = locked
    client = _client(http)
    for prompt in ([], [[]]):  # "" is a BOS-only prompt: served
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="dsv3", prompt=prompt, max_tokens=2)
        assert e.value.body["param"] == "prompt", (prompt, e.value.body)
    assert runner.pending == 0
    with pytest.raises(openai.BadRequestError) as e:  # idle server: a 429 could never succeed
        client.completions.create(model="dsv3", prompt="x", max_tokens=2, n=MAX_PENDING + 1)
    assert e.value.body["param"] == "n" and "--max-pending" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="dsv3", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, n=MAX_PENDING + 1)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="dsv3", prompt=["a", "b"], max_tokens=2, n=2)
    assert e.value.body["param"] == "prompt"


def test_vllm_metric_names_idle_gauges_and_errors(locked, tokenizer):
    http, runner = locked
    _script(tokenizer, "Counting tokens for the metrics.")
    r = _client(http).completions.create(model="dsv3", prompt="x", max_tokens=4)
    deadline = time.monotonic() + 10
    while runner.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    m = _metrics(http)
    me = (("model_name", NAMES[0]),)
    assert m[("vllm:num_requests_running", me)] == 0 and m[("vllm:num_requests_waiting", me)] == 0
    assert m[("vllm:kv_cache_usage_perc", me)] == 0
    assert m[("vllm:request_success_total", (("finished_reason", "length"), *me))] >= 1
    assert m[("vllm:generation_tokens_total", me)] >= r.usage.completion_tokens
    assert m[("vllm:prompt_tokens_total", me)] >= r.usage.prompt_tokens
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert m[(hist + "_count", me)] >= 1, hist
        assert (hist + "_bucket", (("le", "1800.0"), *me)) in m, hist  # buckets to 30 minutes
    assert m[("vllm:num_preemptions_total", me)] == 0
    assert not any(name.startswith(("vllm:spec_decode", "dsv3_mtp")) for name, _ in m)  # MTP is off
    assert m[("http_requests_total", (("handler", "/v1/models"), ("method", "GET"), ("status", "401")))] >= 1
    assert m[("http_requests_total", (("handler", "/v1/completions"), ("method", "POST"),
                                      ("status", "200")))] >= 1


def test_request_log_line_and_off_switch(tokenizer, caplog):
    _script(tokenizer, "Logged.")
    for log_requests in (True, False):
        runner, app = _serve(tokenizer, log_requests=log_requests)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dsv3_jax.serve.requests"), TestClient(app) as http:
            _client(http).completions.create(model="dsv3", prompt="x", max_tokens=3)
        runner.stop()
        lines = [r.getMessage() for r in caplog.records if r.name == "dsv3_jax.serve.requests"]
        if log_requests:
            assert len(lines) == 1 and " completions ok: 1 choice(s), prompt " in lines[0], lines
        else:
            assert lines == []


def test_seed_flag_makes_unseeded_requests_reproducible(tokenizer):
    _script(tokenizer, "Seeds.")
    seeds = []
    for _ in range(2):
        runner, app = _serve(tokenizer, seed=1234)
        RecordingEngine.calls.clear()
        with TestClient(app) as http:
            _client(http, key="x").completions.create(model="dsv3", prompt="x", max_tokens=2, n=2)
        runner.stop()
        seeds.append([c["seed"] for c in RecordingEngine.calls])
    assert seeds[0] == seeds[1] and len(set(seeds[0])) == 2


@pytest.mark.parametrize("fmt", ["deepseek_v31", "deepseek_v3"])
def test_tool_calls_in_both_formats_and_undeclared_names(tokenizer, fmt):
    args = '{"city": "Paris"}'

    def call(name):
        if fmt == "deepseek_v3":
            return f"{CALL_BEGIN}function{CALL_SEP}{name}\n```json\n{args}\n```{CALL_END}"
        return f"{CALL_BEGIN}{name}{CALL_SEP}{args}{CALL_END}"

    runner, app = _serve(tokenizer, tool_format=fmt)
    try:
        with TestClient(app) as http:
            client = _client(http, key="x")
            msgs = [{"role": "user", "content": "Weather in Paris?"}]
            _script(tokenizer, f"{CALLS_BEGIN}{call('get_weather')}{call('delete_files')}{CALLS_END}")
            r = client.chat.completions.create(model="dsv3", messages=msgs, tools=TOOLS, max_tokens=200,
                                               extra_body={"return_token_ids": True})
            msg = r.choices[0].message
            calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls]
            assert calls == [("get_weather", args)]
            assert msg.content == call("delete_files")  # not a declared tool: shown as text, not run
            assert r.choices[0].finish_reason == "tool_calls"
            prompt = tokenizer.decode(r.model_extra["prompt_token_ids"])
            fence = "```json" in prompt
            assert fence == (fmt == "deepseek_v3")  # the system block asks for the parser's format
            streamed = {}
            for ch in client.chat.completions.create(model="dsv3", messages=msgs, tools=TOOLS, max_tokens=200,
                                                     stream=True):
                for tc in ch.choices[0].delta.tool_calls or []:
                    d = streamed.setdefault(tc.index, {"name": None, "arguments": ""})
                    d["name"] = tc.function.name or d["name"]
                    d["arguments"] += tc.function.arguments or ""
            assert streamed == {0: {"name": "get_weather", "arguments": args}}
    finally:
        runner.stop()


def test_encode_batch_equals_encode_and_frees_the_gil(tokenizer):
    """The server tokenizes through `encode_batch` (the backend's batch call releases the GIL; `encode`
    holds it): the same ids, and another thread keeps running while a long text is tokenized."""
    import threading

    texts = ["", "hello world", "def f(x):\n    return x  # ünïcödé 中文", "<｜User｜>hi"]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]
    assert tokenizer.encode_batch(texts, add_bos=False) == [tokenizer.encode(t, add_bos=False) for t in texts]
    long = "All work and no play makes Jack a dull boy. " * 20000  # ~0.9 MB, ~0.2M tokens
    done, ticks = threading.Event(), []

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    t = threading.Thread(target=ticker)
    t.start()
    t0 = time.perf_counter()
    tokenizer.encode_batch([long])
    elapsed = time.perf_counter() - t0
    done.set()
    t.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    # Holding the GIL, the ticker would stop for the whole call; released, it only waits for the list
    # of ids to be built at the end (a small share of the call).
    assert max(gaps) < 0.5 * elapsed, (max(gaps), elapsed)


def test_a_huge_prompt_is_refused_before_its_ids_are_built(locked, tokenizer):
    """A text prompt past the cap is refused from the tokenizer's count (no 1.2M-entry id list built with
    the GIL held), in the same words as a token-id prompt past the cap; both paths (completions, chat)."""
    from dsv3_jax.text.tokenizer import TooManyTokens

    http, _ = locked
    client = _client(http)
    text = "word " * 600  # > 64 tokens, inside the test server's 4 KB body limit
    with pytest.raises(TooManyTokens) as e:
        tokenizer.encode_batch(["short", text], max_tokens=MAX_MODEL_LEN)
    assert e.value.index == 1 and e.value.tokens == len(tokenizer.encode(text)) > MAX_MODEL_LEN
    assert tokenizer.encode_batch(["short"], max_tokens=MAX_MODEL_LEN) == [tokenizer.encode("short")]
    calls = {"prompt": lambda: client.completions.create(model="dsv3", prompt=text, max_tokens=1),
             "messages": lambda: client.chat.completions.create(
                 model="dsv3", messages=[{"role": "user", "content": text}], max_tokens=1)}
    for param, call in calls.items():
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param
        assert "maximum context length is 64 tokens" in e.value.body["message"], e.value.body
        assert "--max-model-len 64" in e.value.body["message"]
