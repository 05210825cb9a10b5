"""The offline batch API (`handle.generate`) with what a server request carries: per-prompt sampling
parameters, lengths, seeds, stop strings and logprobs, on the embedded default model."""

from __future__ import annotations

import numpy as np
import pytest

from dsv3_jax import api
from dsv3_jax.decode import StopMatcher

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


def test_logprobs_per_prompt(handle):
    rs = handle.generate(PROMPTS[:2], max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=[2, None])
    assert rs[1].logprobs is None
    lps = rs[0].logprobs
    assert [lp.token for lp in lps] == rs[0].token_ids and all(len(lp.top) == 2 for lp in lps)
    # Against a plain forward: exact in float32, to bf16 rounding otherwise (paged prefill vs no cache).
    ref = _log_softmax(handle.forward([PROMPTS[0]])[0, -1])
    tol = 1e-4 if handle.config.dtype == "float32" else 5e-2
    assert abs(lps[0].logprob - ref[rs[0].token_ids[0]]) < tol
    assert lps[0].top[0][0] == rs[0].token_ids[0]  # greedy: the chosen token is the most likely
    assert lps[0].top[0][1] >= lps[0].top[1][1] and abs(lps[0].top[1][1] - np.sort(ref)[-2]) < tol


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
