"""Training module: corpus split, loss going down, router-bias balancing, and the save -> load round trip
(tree -> HF names -> safetensors -> dsv3_jax.load) giving identical main and MTP logits."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv3_jax
from dsv3_jax import train as T
from dsv3_jax.formats import compact, hf_names
from dsv3_jax.formats.tree_to_hf import tree_to_hf
from dsv3_jax.model import inference_form
from dsv3_jax.model.transformer import Transformer

# 1 dense + 1 MoE layer + MTP: every mechanism, small compile.
CFG = T.preset("tiny").replace(vocab_size=128, num_hidden_layers=2, first_k_dense_replace=1)


def _random_params(cfg, seed=0):
    """Training-form params with every leaf non-trivial (norms, router bias, head off their init)."""
    p = T.init_params(cfg, jax.random.key(seed))
    leaves, tdef = jax.tree_util.tree_flatten(p)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree_util.tree_unflatten(tdef, leaves)


def _logits(cfg, params, toks):
    model = Transformer(cfg, jnp.dtype(cfg.dtype), False, "absorbed")
    full = {"params": compact.tie_mtp(params)}
    logits, hidden, _ = model.apply(full, toks)
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1] - 1), (toks.shape[0], toks.shape[1] - 1))
    mtp, _, _ = model.apply(full, hidden[:, :-1], toks[:, 1:], pos, method=model.mtp_logits)
    return np.asarray(logits), np.asarray(mtp)


def test_corpus_from_stdlib_with_real_tokenizer():
    from dsv3_jax.text.tokenizer import Tokenizer

    tok = Tokenizer.default()
    files = [f for f in T.stdlib_files() if f.stat().st_size < 6000][:40]
    corpus = T.build_corpus(tok, files, heldout_every=3)
    assert corpus.n_train_files + corpus.n_heldout_files == len(files)
    assert corpus.n_heldout_files > 0 and corpus.n_train_files > 0
    assert corpus.train[0] == tok.bos_id and corpus.train[-1] == tok.eos_id
    assert (corpus.train == tok.bos_id).sum() == corpus.n_train_files
    # The split is by file and deterministic.
    again = T.build_corpus(tok, files, heldout_every=3)
    np.testing.assert_array_equal(again.heldout, corpus.heldout)
    w = T.windows(corpus.heldout, 16)
    assert w.shape == (len(corpus.heldout) // 16, 16) and w.dtype == np.int32
    b = T.sample_batch(np.random.default_rng(0), corpus.train, 4, 16)
    assert b.shape == (4, 16) and b.max() < 129280
    with pytest.raises(ValueError, match="seq_len"):
        T.windows(corpus.heldout[:5], 16)


def _pattern_corpus(n, seed):
    """A learnable stream over 128 ids: mostly x_{t+1} = (5 x_t + 3) mod 128, a few random restarts."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, np.uint32)
    x = 0
    for i in range(n):
        x = int(rng.integers(2, 128)) if rng.random() < 0.05 else (5 * x + 3) % 128
        out[i] = x
    return out


def test_training_reduces_loss_and_balances_router():
    corpus = T.Corpus(_pattern_corpus(20000, 0), _pattern_corpus(600, 1), 1, 1)
    tc = T.TrainConfig(steps=30, batch=8, seq_len=24, peak_lr=1e-2, warmup=5, eval_every=0, log_every=5)
    params, hist = T.train(CFG, tc, corpus, log=lambda s: None)
    first, last = hist["train"][0], hist["train"][-1]
    assert last["main_ce"] < first["main_ce"] - 1.0
    assert last["mtp_ce"] < first["mtp_ce"] - 0.5
    final = hist["final_eval"]
    assert final["main_ce"] < np.log(128) - 1.0
    assert 0.0 <= final["acceptance_proxy"] <= 1.0
    # The router bias moved (aux-loss-free balancing); it is no gradient-trained parameter.
    assert np.abs(np.asarray(params["moe_layers"]["mlp"]["e_score_correction_bias"])).max() > 0
    g = T.greedy_acceptance(CFG, params, corpus.heldout, prompts=2, prompt_len=8, n_new=6)
    assert g["drafts"] == 2 * 5 and 0.0 <= g["greedy_acceptance"] <= 1.0


def test_tree_to_hf_is_the_inverse_of_hf_names():
    full = compact.tie_mtp(_random_params(CFG))
    tensors = tree_to_hf(full, CFG)
    expected = hf_names.expected_hf_tensors(CFG)
    assert set(tensors) == set(expected)
    assert f"model.layers.{CFG.num_hidden_layers}.shared_head.head.weight" in tensors
    back = hf_names.assemble(CFG, list(tensors), tensors.__getitem__)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, jax.tree_util.tree_map(np.asarray, full))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_gives_identical_logits(tmp_path, dtype):
    from dsv3_jax.text.tokenizer import Tokenizer

    cfg = CFG.replace(dtype=dtype)
    params = T.cast_for_compute(_random_params(cfg), jnp.dtype(dtype))
    dst = T.save_checkpoint(params, cfg, Tokenizer.default(), tmp_path / "ckpt", max_shard_bytes=100_000)
    assert (dst / "model.safetensors.index.json").exists()  # small shards force the sharded layout
    assert (dst / "tokenizer.json").exists() and json.loads((dst / "generation_config.json").read_text())
    h = dsv3_jax.load(dst)
    assert h.config == cfg
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    # The handle holds the inference form (model/inference_form.py: other op shapes, other rounding):
    # the saved weights are compared in that form, like with like.
    a, am = _logits(cfg, inference_form.prepare(params, cfg, jnp.dtype(dtype)), toks)
    b, bm = _logits(cfg, compact.untie_mtp(h.params), toks)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(am, bm)
    # The handle's jitted forward against the same jitted forward over the saved params: like with like
    # (a jitted program may keep a bf16 intermediate that op-by-op `_logits` rounds, or the reverse).
    ref = dataclasses.replace(h, params=compact.tie_mtp(params))
    np.testing.assert_array_equal(h.forward(np.asarray(toks)), ref.forward(np.asarray(toks)))


def test_compact_export_round_trip(tmp_path):
    params = _random_params(CFG)
    used = np.zeros(CFG.vocab_size, bool)
    used[[0, 1, 5, 9, 77]] = True
    r = T.restrict_vocab(params, used)
    head = np.asarray(r["lm_head"]["weight"])
    assert np.all(head[~used] == head[~used][0])
    assert np.all(np.asarray(r["embed_tokens"]["embedding"])[~used] == 0)
    files = T.export_compact(r, used, tmp_path, part_bytes=20_000)
    assert len(files) > 1 and all(f.stat().st_size <= 20_000 for f in files)
    back = compact.import_compact(tmp_path)
    want = jax.tree_util.tree_map(np.asarray, T.cast_for_compute(r, jnp.bfloat16))
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, want)
    with pytest.raises(ValueError, match="used"):
        T.restrict_vocab(params, used[:10])
