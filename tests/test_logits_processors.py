"""Logits processors (issue 31 item 3): repetition / presence / frequency penalties, logit_bias, min_p and
min_tokens run on the device inside the engine's step; each against a numpy reference of its vLLM/OpenAI
semantics on the tiny model's own logits (handle.forward), plus the device function alone on random
inputs, and the fast path of default requests (no new programs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.api import ModelHandle
from dsv3_jax.config import ModelConfig
from dsv3_jax.engine import sampling, step
from dsv3_jax.engine.core import Engine, EngineConfig
from dsv3_jax.engine.executor import DeviceExecutor
from dsv3_jax.engine.sampling import LogitsProcessing
from dsv3_jax.model.transformer import Transformer

V = 256
CFG = ModelConfig.preset("tiny").replace(vocab_size=V, max_position_embeddings=512)
ECFG = dict(num_pages=48, page_size=8, max_batch=4, max_batched_tokens=32, chunk_size=16, row_buckets=(4,))


@pytest.fixture(scope="module")
def handle():
    model = Transformer(CFG)
    p = model.init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32), method=model.init_all)["params"]
    p = jax.tree_util.tree_map(np.array, p)
    p["lm_head"]["weight"] = p["lm_head"]["weight"] * 4.0  # peaky logits: greedy repeats itself
    return ModelHandle(CFG, jax.tree_util.tree_map(jnp.asarray, p))


class Recording(DeviceExecutor):
    keys: list

    def execute(self, key, ints, floats):
        self.keys.append(key)
        return super().execute(key, ints, floats)


@pytest.fixture(scope="module")
def engine(handle):
    ex = Recording(handle, EngineConfig(**ECFG))
    ex.keys = []
    return Engine(handle, EngineConfig(**ECFG), executor=ex)


def reference(raw: np.ndarray, prompt: list[int], out: list[int], p: LogitsProcessing,
              eos: tuple[int, ...] = ()) -> np.ndarray:
    """vLLM's semantics in float64: bias and min_tokens, then repetition (prompt + output), frequency and
    presence (output); what greedy takes the argmax of."""
    x = raw.astype(np.float64).copy()
    for tok, b in p.logit_bias:
        x[tok] += b
    if len(out) < p.min_tokens:
        x[list(eos)] = -np.inf
    counts = np.bincount(np.asarray(out, np.int64), minlength=x.size)[: x.size]
    seen = counts > 0
    seen[np.asarray(prompt)] = True
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def _run(engine, prompts, **kw):
    rids = [engine.add_request(p, **kw) for p in prompts]
    for _ in engine.run():
        pass
    return [engine.finished[r] for r in rids]


def _logits_along(handle, prompt, out) -> np.ndarray:
    """The model's logits before each output token: row t is what output token t was chosen from. One
    causal forward of the whole sequence (not one per prefix: each prefix length is a new compile)."""
    return handle.forward([prompt + out])[0, len(prompt) - 1: len(prompt) - 1 + len(out)]


def _check_greedy(handle, prompt, out, p, eos=()):
    """Every greedy token is the argmax of the reference on the model's logits at that point (up to a
    float32 tie: the chosen token's value within 1e-3 of the maximum)."""
    along = _logits_along(handle, prompt, out)
    for t, tok in enumerate(out):
        raw = along[t]
        x = reference(raw, prompt, out[:t], p, eos)
        assert x[tok] >= x.max() - 1e-3 * (1 + abs(x.max())), (t, tok, int(x.argmax()))


PROMPTS = [[5, 17, 17, 30, 99, 5], list(range(40, 60)) + [41, 42]]


@pytest.mark.parametrize("p", [LogitsProcessing(repetition_penalty=1.8),
                               LogitsProcessing(repetition_penalty=0.6),
                               LogitsProcessing(frequency_penalty=1.5),
                               LogitsProcessing(presence_penalty=2.0),
                               LogitsProcessing(logit_bias=((7, 6.0), (9, -100.0))),
                               LogitsProcessing(presence_penalty=0.7, frequency_penalty=-0.3,
                                                repetition_penalty=1.3, logit_bias=((11, 3.0),))],
                         ids=["rep>1", "rep<1", "frequency", "presence", "logit_bias", "all"])
def test_greedy_processors_match_the_reference(handle, engine, p):
    plain = [r.output for r in _run(engine, PROMPTS, max_new_tokens=12)]
    got = _run(engine, PROMPTS, max_new_tokens=12, processing=p, logprobs=1)
    for prompt, r in zip(PROMPTS, got):
        _check_greedy(handle, prompt, r.output, p)
        # log-probabilities stay the raw logits' (vLLM's default)
        raw = _logits_along(handle, prompt, r.output)[2]
        lsm = raw - np.log(np.exp(raw - raw.max()).sum()) - raw.max()
        assert r.output_logprobs[2].logprob == pytest.approx(lsm[r.output[2]], abs=1e-4)
    assert any(r.output != b for r, b in zip(got, plain)), "the processors changed nothing: test is vacuous"


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached(handle, engine):
    prompt = PROMPTS[0]
    first = _run(engine, [prompt], max_new_tokens=8)[0].output
    eos = (first[0], first[1])  # the tokens greedy emits first: without min_tokens it stops at once
    stopped = _run(engine, [prompt], max_new_tokens=8, eos=eos)[0]
    assert stopped.output == [] and stopped.finish_reason == "stop"
    p = LogitsProcessing(min_tokens=5)
    r = _run(engine, [prompt], max_new_tokens=8, eos=eos, processing=p)[0]
    assert len(r.output) >= 5 and not set(r.output[:5]) & set(eos)
    _check_greedy(handle, prompt, r.output, p, eos)


def test_penalties_survive_preemption_and_skip_the_prefix_cache(handle):
    """A pool too small for four requests preempts (recompute counts prompt and output again); the
    same requests alone give the same tokens. A penalised request takes nothing from the prefix cache."""
    p = LogitsProcessing(repetition_penalty=1.5, frequency_penalty=0.5)
    prompts = [[3 + i, 8, 8, 9, 10 + i] * 3 for i in range(4)]
    small = Engine(handle, EngineConfig(num_pages=9, page_size=4, max_batch=4, max_batched_tokens=32,
                                        chunk_size=16, row_buckets=(4,)))
    got = [r.output for r in _run(small, prompts, max_new_tokens=10, processing=p)]
    assert small.stats["preemptions"] > 0
    for prompt, out in zip(prompts, got):
        _check_greedy(handle, prompt, out, p)
    again = _run(small, [prompts[0]], max_new_tokens=10, processing=p)[0]
    assert again.cached_tokens == 0 and again.output == got[0]
    plain = _run(small, [prompts[0]], max_new_tokens=4)[0]
    assert plain.cached_tokens > 0  # the cache was there to take


def test_min_p_keeps_only_tokens_near_the_most_likely(handle, engine):
    prompt = PROMPTS[1]
    temperature, min_p = 1.0, 0.5

    def outside(outs):
        bad = 0
        for out in outs:
            along = _logits_along(handle, prompt, out)
            for t, tok in enumerate(out):
                z = along[t].astype(np.float64) / temperature
                prob = np.exp(z - z.max())
                bad += prob[tok] < min_p * (1 - 1e-4)  # relative to the most likely one (prob 1 here)
        return bad

    def run(**kw):
        rids = [engine.add_request(prompt, max_new_tokens=10, temperature=temperature, seed=i, **kw)
                for i in range(6)]
        for _ in engine.run():
            pass
        return [engine.finished[r].output for r in rids]

    assert outside(run(processing=LogitsProcessing(min_p=min_p))) == 0
    without = run()
    assert outside(without) > 0, "every draw was near the top anyway: the test cannot tell"


def test_default_requests_keep_their_programs(handle, engine):
    """Greedy requests without processors run the greedy programs (no new compile keys, no mask); the
    warm-up set is the same two modes per shape as before."""
    engine.executor.keys.clear()
    _run(engine, PROMPTS, max_new_tokens=4)
    assert engine.executor.keys and all(not k.full and k.mask_words == 0 for k in engine.executor.keys)
    keys = engine.step_keys()
    assert len(keys) == 2 * len(engine.shapes.reachable(ECFG["max_batched_tokens"], ECFG["max_batch"]))
    assert {k.full for k in keys} == {False, True} and all(k.mask_words == 0 for k in keys)
    engine.executor.keys.clear()
    _run(engine, PROMPTS, max_new_tokens=4, processing=LogitsProcessing(presence_penalty=1.0))
    assert all(k.full and k.mask_words == 0 for k in engine.executor.keys)


def test_bad_values_are_refused_naming_the_field(engine):
    for p, field in [(LogitsProcessing(repetition_penalty=0.0), "repetition_penalty"),
                     (LogitsProcessing(presence_penalty=2.5), "presence_penalty"),
                     (LogitsProcessing(min_p=1.5), "min_p"),
                     (LogitsProcessing(logit_bias=((V, 1.0),)), "logit_bias"),
                     (LogitsProcessing(logit_bias=((3, 101.0),)), "logit_bias"),
                     (LogitsProcessing(min_tokens=9), "min_tokens")]:
        with pytest.raises(ValueError, match=field):
            engine.add_request([1, 2, 3], max_new_tokens=8, processing=p)


def test_device_function_matches_the_reference_on_random_inputs():
    """process_logits on random logits, counts, prompt sets, tables and a bitmask vs numpy (incl. min_p)."""
    rng = np.random.default_rng(0)
    s, v = 5, 300
    logits = rng.normal(0, 3, (s, 1, v)).astype(np.float32)
    counts = rng.integers(0, 3, (s, v)) * (rng.random((s, v)) < 0.05)
    seen = rng.random((s, v)) < 0.05
    rep = rng.uniform(0.5, 2, s)
    pres, freq = rng.uniform(-2, 2, s), rng.uniform(-2, 2, s)
    min_p = np.array([0, 0.1, 0.5, 0.0, 0.9])
    temp = np.array([1.0, 0.7, 2.0, 0.0, 1.0])
    suppress = np.array([True, False, True, True, False])
    ids = np.zeros((s, sampling.TABLE_WIDTH), np.int32)
    vals = np.zeros((s, sampling.TABLE_WIDTH), np.float32)
    ids[:, :3] = rng.integers(0, v, (s, 3))
    ids[:, 3] = 7
    vals[:, :3] = rng.uniform(-100, 100, (s, 3))
    vals[:, 3] = -np.inf
    allowed = rng.random((s, v)) < 0.7
    bitmask = np.packbits(np.pad(allowed, ((0, 0), (0, 320 - v))), axis=1, bitorder="little").view(np.int32)
    proc = sampling.ProcessorInputs(*map(jnp.asarray, (rep, pres, freq, min_p, suppress, ids, vals, counts,
                                                         seen)))
    got = np.asarray(sampling.process_logits(jnp.asarray(logits), jnp.asarray(temp), proc,
                                             jnp.asarray(bitmask)))
    for i in range(s):
        x = np.where(allowed[i], logits[i, 0].astype(np.float64), -np.inf)
        for tok, val in zip(ids[i], vals[i]):
            x[tok] += val if np.isfinite(val) else (-np.inf if suppress[i] else 0.0)
        occ = counts[i] > 0
        x = np.where(occ | seen[i], np.where(x > 0, x / rep[i], x * rep[i]), x)
        x = x - freq[i] * counts[i] - pres[i] * occ
        if min_p[i] > 0 and temp[i] > 0:
            z = x / temp[i]
            x = np.where(np.exp(z - z.max()) < min_p[i], -np.inf, x)
        fin = np.isfinite(x)
        assert (np.isfinite(got[i, 0]) == fin).all(), i
        np.testing.assert_allclose(got[i, 0][fin], x[fin], rtol=1e-5, atol=1e-3)


def test_the_step_lays_out_processor_fields_only_in_full_mode():
    rows = [step.RowPlan(rid=0, slot=1, start=0, tokens=[5, 6, 7], n=3, pending_last=False, final=True,
                         ndraft=0, hint=0, pages=[1], temperature=0.0, top_p=1.0, top_k=0, seed=0, counter=0,
                         processing=LogitsProcessing(min_tokens=2, repetition_penalty=1.2), fresh=True,
                         prompt_len=3, upload=((4, 1.5), (2, -np.inf)))]
    shapes = step.StepShapes.make(max_rows=4, max_tokens=8, spec_k=0)
    b = step.build(rows, spec_k=0, shapes=shapes, width=4, logprobs=False, scratch_slot=4)
    assert b.key.full and b.key.mask_words == 0
    assert b.view("fresh")[0] == 1 and b.view("suppress")[0] == 1 and b.view("prompt_len")[0] == 3
    assert b.view("repetition")[0] == pytest.approx(1.2) and b.view("repetition")[1] == 1.0
    assert b.view("upload_tok")[:2].tolist() == [4, 2] and b.view("upload_slot")[:3].tolist() == [1, 1, 4]
    plain = step.build([step.RowPlan(0, 1, 0, [5], 1, False, True, 0, 0, [1], 0.0, 1.0, 0, 0, 0)],
                       spec_k=0, shapes=shapes, width=4, logprobs=False)
    assert not plain.key.full and "fresh" not in dict(step.int_fields(plain.key))


def test_speculative_engine_gives_processed_requests_no_drafts():
    """With MTP drafts on, a processed request decodes one token per step (its counts must see each token
    before the next draw) and equals the engine without drafts; a plain request beside it keeps drafting."""
    from tests.test_engine import CFG as MTP_CFG
    from tests.test_engine import _mtp_friendly_params

    h = ModelHandle(MTP_CFG, _mtp_friendly_params(MTP_CFG, 1, 4.0))
    p = LogitsProcessing(repetition_penalty=1.4, presence_penalty=0.5)
    prompts = [[7, 8, 9, 10, 7, 8], [20, 21, 22]]
    want = [r.output for r in _run(Engine(h, EngineConfig(**ECFG)), prompts, max_new_tokens=10,
                                   processing=p)]
    spec = Engine(h, EngineConfig(**{**ECFG, "spec_k": 2}))
    rids = [spec.add_request(q, max_new_tokens=10, processing=p) for q in prompts]
    plain = spec.add_request(prompts[1], max_new_tokens=10)
    for _ in spec.run():
        pass
    assert [spec.finished[r].output for r in rids] == want
    assert all(spec.finished[r].spec_proposed == 0 for r in rids) and spec.finished[plain].spec_proposed > 0
    for q, out in zip(prompts, want):
        _check_greedy(h, q, out, p)


def test_request_stream_min_tokens_delays_stop_strings_and_keeps_them_when_asked():
    """vLLM: stop strings are looked for only after min_tokens tokens; include_stop_str_in_output keeps
    the stop string that ended the text."""
    from dsv3_jax.engine.api import StepEvent
    from dsv3_jax.request_stream import RequestStream, resolve
    from dsv3_jax.text.tokenizer import Tokenizer

    tok = Tokenizer.default()
    ids = tok.encode("a b a b c", add_bos=False)

    def text(**kw):
        s = RequestStream(resolve({}, max_new_tokens=20, stop=[" b"], **kw), tok)
        out = ""
        for i, t in enumerate(ids):
            d = s.on_event(StepEvent(0, [t], i == len(ids) - 1, "length" if i == len(ids) - 1 else None))
            out += d.text
            if s.done:
                break
        return out, s.finish_reason

    assert text() == ("a", "stop")
    assert text(include_stop_str_in_output=True) == ("a b", "stop")
    n = len(tok.encode("a b", add_bos=False))  # the first " b" lies inside the first min_tokens tokens
    assert text(processing={"min_tokens": n}) == ("a b a", "stop")
