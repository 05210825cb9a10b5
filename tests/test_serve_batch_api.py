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
