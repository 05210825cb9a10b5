"""Cached generation: greedy equals transformers' generate, stop handling, streaming, CLI, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import dsv3_jax
from dsv3_jax.text.tokenizer import Tokenizer
from tests.hf_reference import HF_CONFIGS, make_hf_model, save_hf

N_NEW = 32


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    model = make_hf_model("lora_yarn", seed=3)
    return model, save_hf(model, tmp_path_factory.mktemp("gen"))


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("form", ["absorbed", "naive"])
def test_greedy_batch_equals_transformers(hf_model_dir, form):
    model, d = hf_model_dir
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, n).tolist() for n in (3, 11, 7)]
    handle = dsv3_jax.load(d, attention=form)
    results = handle.generate(prompts, max_new_tokens=N_NEW, temperature=0, ignore_eos=True)
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == _hf_greedy(model, p, N_NEW)
        assert r.finish_reason == "length" and len(r.token_ids) == N_NEW
        assert r.time_to_first_token_s > 0


def test_eos_stops_and_seed_reproducible(hf_model_dir):
    _, d = hf_model_dir
    handle = dsv3_jax.load(d)
    base = handle.generate([5, 6, 7], max_new_tokens=12, temperature=0, ignore_eos=True)
    # Declare the 4th greedy token the EOS: generation must stop right before it.
    handle.generation_defaults = {"eos_token_ids": [base.token_ids[3]]}
    r = handle.generate([5, 6, 7], max_new_tokens=12, temperature=0)
    assert r.token_ids == base.token_ids[:3] and r.finish_reason == "stop"
    a = handle.generate([5, 6, 7], max_new_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    b = handle.generate([5, 6, 7], max_new_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[1] * 600), "context"),
    (dict(prompts=[1, 2], max_new_tokens=511), "overflows"),
    (dict(prompts=[1, 2], temperature=-0.5), "temperature"),
    (dict(prompts=[1, 2], top_p=0.0), "top_p"),
    (dict(prompts=[1, 2], top_p=1.5), "top_p"),
    (dict(prompts=[[1, 2], []]), "empty"),
    (dict(prompts="text"), "tokenizer"),
])
def test_bad_generation_input(hf_model_dir, kwargs, match):
    _, d = hf_model_dir
    handle = dsv3_jax.load(d)
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=match):
        handle.generate(**kwargs)


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    """A tiny HF checkpoint whose vocabulary fits the real DeepSeek-V3.1 tokenizer."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(**{**HF_CONFIGS["lora_yarn"], "vocab_size": 129280, "num_hidden_layers": 2,
                              "first_k_dense_replace": 1}, bos_token_id=0, eos_token_id=1)
    d = tmp_path_factory.mktemp("textckpt")
    DeepseekV3ForCausalLM(cfg).save_pretrained(d, max_shard_size="20MB")
    Tokenizer.default().save_to(d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95,
                                                          "eos_token_id": 1, "bos_token_id": 0}))
    return d


def test_stream_pieces_concatenate_to_text_and_stop_strings(text_ckpt):
    handle = dsv3_jax.load(text_ckpt)
    full = handle.generate("你好，世界 🌍", max_new_tokens=20, temperature=0, ignore_eos=True)
    pieces = list(handle.generate("你好，世界 🌍", max_new_tokens=20, temperature=0, ignore_eos=True,
                                  stream=True))
    assert "".join(pieces) == full.text == handle.tokenizer.decode(full.token_ids)
    stop = full.text[len(full.text) // 2:][:3]
    if stop.strip():
        cut = handle.generate("你好，世界 🌍", max_new_tokens=20, temperature=0, ignore_eos=True, stop=stop)
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert full.text.startswith(cut.text)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv3_jax.generate", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_end_to_end_json(text_ckpt, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "Hello"}\n{"messages": [{"role": "user", "content": "Hi"}]}\nplain line\n')
    r = _cli("--ckpt", str(text_ckpt), "--input-file", str(inp), "--json", "--max-new-tokens", "5",
             "--temperature", "0")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["index"] for x in rows] == [0, 1, 2]
    assert all(len(x["token_ids"]) <= 5 and x["finish_reason"] in ("stop", "length") for x in rows)
    assert rows[1]["prompt_token_ids"][:2] == [0, 128803]  # BOS, <｜User｜> from the chat template
    assert all("ttft_s" in x["metrics"] for x in rows)
    r = _cli("--ckpt", str(text_ckpt), "--prompt", "Hi", "--stats", "--max-new-tokens", "3")
    assert r.returncode == 0 and "[stats] request 0: 3 tokens" in r.stderr, r.stderr
    # transformers' save_pretrained drops the MTP layer: speculative decoding must say so.
    r = _cli("--ckpt", str(text_ckpt), "--prompt", "Hi", "--mtp", "1")
    assert r.returncode == 2 and "MTP layer" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, match", [
    (["--ckpt", "/no/such/dir", "--prompt", "x"], "not found"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
])
def test_cli_bad_input_clear_error(args, match):
    r = _cli(*args)
    assert r.returncode == 2
    assert match in r.stderr and "Traceback" not in r.stderr


def test_prefill_progress_reports_a_chunked_prompt_until_it_is_in_the_cache(hf_model_dir):
    """`prefill_progress(done, total)` after every step of a prompt prefilled in 16-token chunks: it rises
    to the total and stops being called once nothing is pending; the tokens are unchanged by it."""
    _, d = hf_model_dir
    handle = dsv3_jax.load(d)
    prompt = np.random.default_rng(1).integers(2, 512, 70).tolist()
    seen: list[tuple[int, int]] = []
    sizing = {"chunk_size": 16, "max_batched_tokens": 16}
    r = handle.generate(prompt, max_new_tokens=4, temperature=0, ignore_eos=True, sizing=sizing,
                        prefill_progress=lambda done, total: seen.append((done, total)))
    assert r.token_ids == handle.generate(prompt, max_new_tokens=4, temperature=0, ignore_eos=True,
                                          sizing=sizing).token_ids
    assert [t for _, t in seen] == [70] * len(seen)
    assert [x for x, _ in seen] == [16, 32, 48, 64, 70]  # one call per chunk, the last at the total


def test_prefill_printer_is_silent_for_short_prefills_and_prints_long_ones():
    import io

    from dsv3_jax.generate import prefill_printer

    t = [0.0]
    out = io.StringIO()
    show = prefill_printer(1.0, out, clock=lambda: t[0])
    show(100, 100)  # done within the first interval: nothing
    assert out.getvalue() == ""
    out = io.StringIO()
    show = prefill_printer(1.0, out, clock=lambda: t[0])
    for done, now in ((4096, 0.0), (8192, 0.5), (65536, 1.2), (98304, 1.7), (131072, 2.0)):
        t[0] = now
        show(done, 131072)
    assert out.getvalue().splitlines() == ["[prefill] 65,536 / 131,072 prompt tokens (50%), 1.2 s",
                                           "[prefill] 131,072 / 131,072 prompt tokens (100%), 2.0 s"]
