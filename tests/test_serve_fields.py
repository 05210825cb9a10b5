"""The request fields vLLM and OpenAI clients send (issue 31 items 3 and 4), through the real app, runner and
engine over the embedded default model, driven by the official openai client in process: structured
outputs (json_schema greedy and sampled, json_object, vLLM's guided_json / structured_outputs spellings:
the output parses and validates), logit_bias, min_tokens with stop_token_ids, include_stop_str_in_output,
skip_special_tokens, continue_final_message, request_id, stream_options.continuous_usage_stats, the
labels accepted and ignored, and the 400s naming the field (a malformed schema names response_format).
"""

from __future__ import annotations

import json

import pytest

from dsv3_jax import api
from dsv3_jax.engine.api import EngineConfig
from dsv3_jax.serve.runner import EngineRunner

_EXTRAS = "the server tests need the serving extras (pip install -e '.[test]')"
for _name in ("fastapi", "httpx", "prometheus_client", "llguidance"):
    pytest.importorskip(_name, reason=f"{_name} is not installed: {_EXTRAS}")
openai = pytest.importorskip("openai", reason=f"openai is not installed: {_EXTRAS}")
jsonschema = pytest.importorskip("jsonschema", reason=f"jsonschema is not installed: {_EXTRAS}")
from fastapi.testclient import TestClient  # noqa: E402

from dsv3_jax.serve.app import ServerOptions, Service, create_app  # noqa: E402
from dsv3_jax.serve.metrics import Metrics  # noqa: E402

MODEL = "dsv3-default"
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "count": {"type": "integer"}, "tags": TAGS},
          "required": ["name", "count", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    handle = api.load()
    cfg = EngineConfig(num_pages=64, max_batch=4, max_batched_tokens=64, chunk_size=64, row_buckets=(4,))
    metrics = Metrics(MODEL)
    runner = EngineRunner(handle, cfg, max_pending=16, metrics=metrics)
    runner.start()
    app = create_app(Service(handle, runner, metrics, MODEL, options=ServerOptions(model_names=(MODEL,))))
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0,
                               timeout=600)
        yield handle, http, client, runner
    runner.stop()


def _chat(client, content="Write a record as JSON.", **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_json_schema_output_validates(served, temperature):
    _, _, client, runner = served
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    r = _chat(client, response_format=fmt, temperature=temperature, max_tokens=120, seed=3, n=2)
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch  # the grammar completed: the engine stopped it there
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    assert runner.engine.engine_stats()["mask_s"] > 0


def test_json_object_and_vllm_spellings(served):
    _, _, client, _ = served
    r = _chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    obj = json.loads(r.choices[0].message.content) if r.choices[0].finish_reason == "stop" else None
    assert r.choices[0].finish_reason == "length" or isinstance(obj, dict)
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    for extra in ({"guided_json": small}, {"structured_outputs": {"json": small}}):
        out = _chat(client, temperature=0, max_tokens=20, extra_body=extra).choices[0].message.content
        jsonschema.validate(json.loads(out), small)
    c = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=5, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert c.choices[0].text in ("yes", "no") and c.choices[0].finish_reason == "stop"


def test_a_malformed_schema_is_a_400_naming_response_format(served):
    _, _, client, _ = served
    for schema in ({"type": "objekt"}, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, response_format={"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": schema}})
        assert e.value.body["param"] == "response_format", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, response_format={"type": "json_schema"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert e.value.body["param"] == "guided_regex" and "pass one" in e.value.body["message"]


def test_logit_bias_min_tokens_and_stop_token_ids(served):
    handle, _, client, _ = served
    tok = handle.tokenizer.encode(" x", add_bos=False)[0]
    r = client.completions.create(model=MODEL, prompt="def f():", max_tokens=4, temperature=0,
                                  logit_bias={str(tok): 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [tok] * 4
    plain = client.completions.create(model=MODEL, prompt="import os", max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0].token_ids
    # The first greedy token as a stop token: the request stops at once, unless min_tokens holds it off.
    stop_first = {"stop_token_ids": [plain[0]], "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt="import os", max_tokens=6, temperature=0,
                                  extra_body=stop_first)
    assert r.choices[0].token_ids == [] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="import os", max_tokens=6, temperature=0,
                                  extra_body={**stop_first, "min_tokens": 3})
    assert len(r.choices[0].token_ids) >= 3 and plain[0] not in r.choices[0].token_ids[:3]


def test_stop_strings_special_tokens_and_continuation(served):
    handle, _, client, _ = served
    base = client.completions.create(model=MODEL, prompt="import os\nimport", max_tokens=12, temperature=0)
    text = base.choices[0].text
    cut = text.strip()[:3]
    assert cut
    kept = client.completions.create(model=MODEL, prompt="import os\nimport", max_tokens=12, temperature=0,
                                     stop=[cut], extra_body={"include_stop_str_in_output": True}).choices[0]
    dropped = client.completions.create(model=MODEL, prompt="import os\nimport", max_tokens=12, temperature=0,
                                        stop=[cut]).choices[0]
    assert kept.text == dropped.text + cut and kept.finish_reason == "stop"
    # special tokens in the text: forced by logit_bias on the end-of-sentence id, with EOS ignored
    eos = handle.tokenizer.eos_id
    kw = dict(model=MODEL, prompt="x = 1", max_tokens=2, temperature=0, logit_bias={str(eos): 100})
    shown = client.completions.create(**kw, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    hidden = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert shown.choices[0].text == handle.tokenizer.eos_token * 2 and hidden.choices[0].text == ""
    # continue_final_message: the prompt ends inside the assistant's message
    msgs = [{"role": "user", "content": "Write Python."}, {"role": "assistant", "content": "import"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                       extra_body={"add_generation_prompt": False, "return_token_ids": True,
                                                   "continue_final_message": True})
    from dsv3_jax.text.chat import apply_chat_template
    prompt = apply_chat_template(handle.tokenizer, msgs, continue_final_message=True)
    assert prompt.endswith("import") and r.choices[0].finish_reason in ("length", "stop")
    want = handle.generate(handle.tokenizer.encode(prompt, add_bos=False), max_new_tokens=3, temperature=0)
    assert r.choices[0].token_ids == want.token_ids


def test_request_id_usage_stats_and_labels(served):
    _, _, client, _ = served
    r = _chat(client, max_tokens=2, temperature=0, store=False, metadata={"k": "v"}, user="u",
              service_tier="auto", extra_body={"request_id": "abc-123"})
    assert r.id == "chatcmpl-abc-123"
    # vLLM's header form: X-Request-Id names the response (the body's field wins) and comes back as a header.
    _, http, _, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "temperature": 0}
    h = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "hdr-7"})
    assert h.status_code == 200 and h.json()["id"] == "chatcmpl-hdr-7"
    assert h.headers["x-request-id"] == "hdr-7"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "request_id": "b-1"}
    h = http.post("/v1/completions", json=body, headers={"X-Request-Id": "hdr-8"})
    assert h.json()["id"] == "cmpl-b-1" and h.headers["x-request-id"] == "hdr-8"
    chunks = list(_chat(client, max_tokens=3, temperature=0, stream=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usage = [c.usage for c in chunks if c.choices]
    assert usage and all(u is not None for u in usage)
    assert [u.completion_tokens for u in usage] == sorted(u.completion_tokens for u in usage)
    assert chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"reasoning_effort": "high"}, "reasoning_effort", "thinking"),
    ({"modalities": ["audio"]}, "modalities", "text only"),
    ({"priority": 5}, "priority", "first come"),
    ({"frobnicate": 1}, "frobnicate", "unknown field"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_p": 2}, "min_p", "less than or equal to 1"),
    ({"logit_bias": {"5": 300}}, "logit_bias[5]", "less than or equal to 100"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "exceeds"),
    ({"stop_token_ids": [999999]}, "stop_token_ids", "vocabulary"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs", "not supported"),
])
def test_refused_fields_name_the_field_and_why(served, extra, param, words):
    _, http, _, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
