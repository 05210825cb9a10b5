"""The offline batch API (`handle.generate`) with what a server request carries: per-prompt sampling
parameters, lengths, seeds, stop strings and logprobs, on the embedded default model."""

from __future__ import annotations

import numpy as np
import pytest

from dsv3_jax import api
from dsv3_jax.request_stream import StopMatcher

PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [9, 8]]


@pytest.fixture(scope="module")
def handle():
    return api.load()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_per_prompt_lengths_and_sampling(handle):
    solo = [handle.generate(p, max_new_tokens=6, temperature=0.0, ignore_eos=True).token_ids for p in PROMPTS]
    rs = handle.generate(PROMPTS, max_new_tokens=[2, 6, 4], temperature=[0.0, 0.0, 1.0], top_k=[0, 0, 5],
                         seed=[0, 0, 42], ignore_eos=True)
    assert [len(r.token_ids) for r in rs] == [2, 6, 4]
    assert [rs[0].token_ids, rs[1].token_ids] == [solo[0][:2], solo[1]]  # greedy rows unaffected by row 2
    again = handle.generate(PROMPTS[2], max_new_tokens=4, temperature=1.0, top_k=5, seed=42, ignore_eos=True)
    assert rs[2].token_ids == again.token_ids  # an explicit per-prompt seed reproduces alone


def test_per_prompt_stop_strings(handle):
    texts = ["def main():", "import os"]
    full = handle.generate(texts, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    stop0 = full[0].text[4:7]
    assert len(stop0) == 3
    rs = handle.generate(texts, max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=[[stop0], None])
    assert rs[0].text == full[0].text[: full[0].text.find(stop0)] and rs[0].finish_reason == "stop"
    assert rs[1].text == full[1].text and rs[1].finish_reason == "length"
    pieces = list(handle.generate(texts[0], max_new_tokens=12, temperature=0.0, ignore_eos=True,
                                  stop=stop0, stream=True))
    assert "".join(pieces) == rs[0].text  # no piece of the stop string was streamed


@pytest.fixture(scope="module")
def handle32():
    return api.load(dtype="float32")  # the same weights in float32: path equivalence to fp32 rounding


def test_logprobs_per_prompt(handle32):
    """Per-prompt logprobs are the model's: the paged engine behind `generate` against a plain forward over
    prompt + output, every generated position, in float32.

    Why float32: the two paths order their sums differently (paged, chunked attention vs one pass), so
    they differ by rounding. In bf16 the logits themselves are bf16 (ulp 2^(e-7): 0.0625 for |x| in [8, 16),
    the default model's top logits are ~13), and one logit rounded across a boundary moves a logprob by
    up to an ulp: a bound that is a coin flip. In float32 the reordering costs a few ulps (measured
    ~3e-6 at |x| ~13, ulp 9.5e-7): the bound is 64 ulps of the largest logit, twice (logprob = logit -
    logsumexp, each term off by at most that), computed from the logits: ~1.2e-4 here. Any real fault
    (wrong position or page, a stale or missing cache entry, a bf16 cast on the way) is orders larger.
    """
    h = handle32
    rs = h.generate(PROMPTS[:2], max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=[2, None])
    assert rs[1].logprobs is None
    lps, out = rs[0].logprobs, rs[0].token_ids
    assert [lp.token for lp in lps] == out and all(len(lp.top) == 2 for lp in lps)
    n = len(PROMPTS[0])
    logits = h.forward([PROMPTS[0] + out[:-1]])[0, n - 1:]  # the logits each output token was drawn from
    ulp = np.spacing(np.abs(logits).max(-1).astype(np.float32)).astype(np.float64)
    tol = 2 * 64 * ulp
    for j, lp in enumerate(lps):
        ref = _log_softmax(logits[j])
        assert abs(lp.logprob - ref[out[j]]) <= tol[j], (j, lp.logprob - ref[out[j]], tol[j])
        assert lp.top[0][0] == out[j]  # greedy: the chosen token is the most likely
        top_ids, top_vals = np.array([t for t, _ in lp.top]), np.array([v for _, v in lp.top])
        assert top_vals[0] >= top_vals[1]
        assert np.abs(top_vals - ref[top_ids]).max() <= tol[j]  # each alternative's own logprob
        assert np.abs(top_vals - np.sort(ref)[::-1][:2]).max() <= tol[j]  # and they are the top two


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_new_tokens=[2, 3]), "max_new_tokens has 2 values for 3 prompts"),
    (dict(temperature=[0.0, -1.0, 0.0]), "temperature"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=[["a"], None]), "stop has 2 values for 3 prompts"),
])
def test_bad_per_prompt_arguments(handle, kwargs, match):
    with pytest.raises(ValueError, match=match):
        handle.generate(PROMPTS, **kwargs)


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["STOP", "ab"])
    out = [m.feed(x) for x in ["xa", "yS", "TO", "zz", "ST", "OP", "more"]]
    assert "".join(out) == "xayS" + "TOzz" and m.stopped  # "STOP" completes across "ST" + "OP"
    assert StopMatcher().feed("anything") == "anything"


def test_request_stream_deltas_stop_and_finish():
    """The request layer alone on scripted engine events: text pieces concatenate to the decoded text, a
    stop string mid-event ends the stream with STOP (text cut before it, all the event's ids kept), an
    engine finish carries its reason, and an end the engine does not produce (cancel / reject) is final."""
    from dsv3_jax.engine.api import FinishReason, StepEvent
    from dsv3_jax.request_stream import RequestParams, RequestStream
    from dsv3_jax.text.tokenizer import Tokenizer

    tok = Tokenizer.default()
    ids = tok.encode("alpha beta gamma delta", add_bos=False)
    s = RequestStream(RequestParams(max_new_tokens=50, stop=(" gam",)), tok)
    d1 = s.on_event(StepEvent(0, ids[:1], False))
    assert d1.finish_reason is None and d1.token_ids == ids[:1]
    d2 = s.on_event(StepEvent(0, ids[1:], False))
    assert d2.finish_reason == FinishReason.STOP and d2.by_stop_string and s.done
    assert d1.text + d2.text == s.text == "alpha beta" and s.token_ids == ids
    plain = RequestStream(RequestParams(max_new_tokens=50), tok)
    pieces = [plain.on_event(StepEvent(0, [t], False)).text for t in ids[:-1]]
    last = plain.on_event(StepEvent(0, ids[-1:], True, FinishReason.LENGTH))
    assert last.finish_reason == "length" and not last.by_stop_string
    assert "".join(pieces) + last.text == tok.decode(ids)
    with pytest.raises(RuntimeError, match="after the stream ended"):
        plain.on_event(StepEvent(0, [1], False))
    r = RequestStream(RequestParams()).reject("too many pages")
    assert r.finish_reason == FinishReason.ERROR and r.rejected and r.error == "too many pages"
    assert RequestStream(RequestParams()).cancel().finish_reason == FinishReason.CANCELLED
    with pytest.raises(ValueError, match="tokenizer"):
        RequestStream(RequestParams(stop=("x",)))


@pytest.mark.parametrize(("prompt", "kw", "field"), [
    ([], {}, "prompt"),
    ([5, 10**6], {}, "prompt"),
    ([5] * 95, {"max_new_tokens": 2}, "prompt"),  # not even one token fits: the prompt's fault
    ([5] * 10, {"max_new_tokens": 91}, "max_new_tokens"),
    ([5] * 10, {"max_new_tokens": 2, "logprobs": 21}, "logprobs"),
    ([5] * 10, {"temperature": -1.0}, None),
])
def test_check_names_the_field(prompt, kw, field):
    """One check (engine/api.check_request + sampling ranges) against Limits; the field at fault named.
    Capacity here: min(context 128, pool 96 tokens) = 96; a 10-token prompt with spec_k 1 leaves room for
    96 - 10 - 1 = 85 new tokens, so 85 fits and 91 overflows."""
    from dsv3_jax.request_stream import Limits, RequestInvalid, RequestParams, check

    limits = Limits(vocab_size=1000, context=128, spec_k=1, pool_tokens=96)
    assert limits.capacity == 96 and limits.room(10) == 85
    check([5] * 10, RequestParams(max_new_tokens=85), limits)  # exactly fits
    with pytest.raises(RequestInvalid) as e:
        check(prompt, RequestParams(**kw), limits)
    assert e.value.field == field
