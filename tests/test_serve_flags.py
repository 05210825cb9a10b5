"""The CLIs' flags under vLLM's names (issue 31 item 2): each vLLM spelling and its older alias parse to
the same setting, in `serve` and `generate` alike; MODEL_DIR / --model / --ckpt; --enable-expert-parallel;
--chat-template; bad values refused in one line before anything loads. No model is loaded here."""

from __future__ import annotations

import argparse
import types

import pytest

from dsv3_jax import generate
from dsv3_jax.parallel import flags as parallel_cli
from dsv3_jax.serve import __main__ as serve_cli

VLLM = ["/ckpt/DeepSeek-V3.1", "--tensor-parallel-size", "8", "--gpu-memory-utilization", "0.85",
        "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--num-speculative-tokens", "1",
        "--max-model-len", "32768", "--enforce-eager", "--seed", "7"]
OURS = ["--ckpt", "/ckpt/DeepSeek-V3.1", "--tp", "8", "--memory-fraction", "0.85", "--max-batch", "64",
        "--max-batched-tokens", "4096", "--spec-k", "1", "--max-model-len", "32768", "--no-warmup",
        "--seed", "7"]
SAME = ("ckpt", "tp", "memory_fraction", "max_batch", "max_batched_tokens", "spec_k", "max_model_len",
        "no_warmup", "seed")


def _serve(argv: list[str]) -> argparse.Namespace:
    args = serve_cli._parser().parse_args(argv)
    serve_cli.check_args(args)
    parallel_cli.check(args)
    return args


def test_serve_vllm_names_equal_the_aliases():
    a, b = _serve(VLLM), _serve(OURS)
    assert {k: getattr(a, k) for k in SAME} == {k: getattr(b, k) for k in SAME}
    assert str(a.ckpt) == "/ckpt/DeepSeek-V3.1" and a.mesh == "tensor=8" and a.spec_k == 1
    assert serve_cli.engine_config(a) == serve_cli.engine_config(b)
    assert _serve(["-tp", "2", "--model", "/m"]).mesh == "tensor=2"
    assert serve_cli.engine_config(_serve(["--long-prefill-from", "16384"])).long_prefill_from == 16384
    with pytest.raises(ValueError, match="--long-prefill-from must be >= 0"):
        _serve(["--long-prefill-from", "-1"])
    capped = serve_cli.engine_config(_serve(["--prefill-attention-pairs", "1048576"]))
    assert capped.prefill_attention_pairs == 2**20
    with pytest.raises(ValueError, match="--prefill-attention-pairs must be >= 0"):
        _serve(["--prefill-attention-pairs", "-5"])


def test_generate_takes_the_same_words():
    p = generate._parser()
    argv = [w for w in VLLM if w not in ("--num-speculative-tokens", "1")] + ["--num-speculative-tokens", "2"]
    a = p.parse_args([*argv, "--prompt", "x"])
    b = p.parse_args(["--ckpt", "/ckpt/DeepSeek-V3.1", "--tp", "8", "--memory-fraction", "0.85",
                      "--max-batch", "64", "--max-batched-tokens", "4096", "--mtp", "2", "--max-model-len",
                      "32768", "--no-warmup", "--seed", "7", "--prompt", "x"])
    parallel_cli.resolve_model(a)
    keys = ("ckpt", "tp", "memory_fraction", "max_batch", "max_batched_tokens", "mtp", "max_model_len",
            "no_warmup", "seed")
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}


def test_served_model_names_and_parsers():
    a = _serve(["--served-model-name", "deepseek-ai/DeepSeek-V3.1", "dsv3", "--tool-call-parser",
                "deepseek_v3", "--reasoning-parser", "deepseek_r1", "--disable-log-requests", "--api-key",
                "k1", "--api-key", "k2", "--allowed-origins", '["https://a.example", "https://b.example"]'])
    tok = types.SimpleNamespace(chat_template="{{ x }}")
    opts = serve_cli.server_options(a, types.SimpleNamespace(tokenizer=tok))
    assert opts.model_names == ("deepseek-ai/DeepSeek-V3.1", "dsv3") and opts.api_keys == ("k1", "k2")
    assert opts.tool_format == "deepseek_v3" and opts.reasoning_parser == "deepseek_r1"
    assert not opts.log_requests and opts.allowed_origins == ("https://a.example", "https://b.example")
    auto = serve_cli.server_options(_serve([]), types.SimpleNamespace(tokenizer=tok))
    assert auto.tool_format == "deepseek_v31" and auto.model_names == ("dsv3-default",) and auto.log_requests


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("DSV3_API_KEY", "from-env")
    tok = types.SimpleNamespace(chat_template=None)
    handle = types.SimpleNamespace(tokenizer=tok)
    assert serve_cli.server_options(_serve([]), handle).api_keys == ("from-env",)
    opts = serve_cli.server_options(_serve(["--api-key", "flag"]), types.SimpleNamespace(tokenizer=tok))
    assert opts.api_keys == ("flag",)


def test_expert_parallel_maps_the_data_parallel_ranks():
    assert _serve(["--data-parallel-size", "4", "--enable-expert-parallel", "-tp", "2"]).mesh == \
        "tensor=2,expert=4"
    assert _serve(["-dp", "2"]).mesh == "data=2"


def test_chat_template_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    assert _serve(["--chat-template", str(f)]).chat_template == f.read_text()
    text = "{{ messages[0].content }}"
    assert _serve(["--chat-template", text]).chat_template == text


@pytest.mark.parametrize(("argv", "words"), [
    (["/a", "--model", "/b"], "two checkpoints given"),
    (["--enable-expert-parallel", "-tp", "8"], "--data-parallel-size N > 1"),
    (["-dp", "2", "--ep", "2", "--enable-expert-parallel"], "not both"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-pending", "0"], "--max-pending must be >= 1"),
    (["--drain-timeout", "-1"], "--drain-timeout"),
    (["--api-key", ""], "empty key"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template: no such file"),
    (["--chat-template", "{% for %}"], "not a valid Jinja template"),
    (["--allowed-origins", "[1, 2]"], "--allowed-origins: expected a list of strings"),
    (["--max-request-body-bytes", "10"], "--max-request-body-bytes"),
])
def test_bad_flags_one_line_exit_2(argv, words, capsys):
    assert serve_cli.main(argv) == serve_cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                                ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
                                                ("example.com", False)])
def test_loopback_hosts(host, loopback):
    assert serve_cli.is_loopback(host) == loopback


def test_speculative_config_is_vllms_form_of_the_draft_count(capsys):
    """--speculative-config '{"method": "deepseek_mtp", "num_speculative_tokens": K}' = K MTP drafts, in
    serve and generate; another method, an unknown key, a K outside 0..3 or non-JSON: argparse's error
    line naming the flag, exit 2."""
    spec = '{"method": "deepseek_mtp", "num_speculative_tokens": 2}'
    assert _serve(["--speculative-config", spec]).spec_k == 2
    assert _serve(["--speculative-config", '{"num_speculative_tokens": 1}']).spec_k == 1
    assert generate._parser().parse_args(["--speculative-config", spec, "--prompt", "x"]).mtp == 2
    cases = (('{"method": "eagle", "num_speculative_tokens": 1}', "method 'eagle' is not supported"),
             ('{"method": "mtp", "num_speculative_tokens": 4}', "must be an integer in 0..3"),
             ('{"num_speculative_tokens": 1, "draft_tensor_parallel_size": 1}', "unsupported key"),
             ("[1]", "must be a JSON object"), ("k=1", "not JSON"))
    for bad, words in cases:
        with pytest.raises(SystemExit) as e:
            serve_cli._parser().parse_args(["--speculative-config", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "argument --speculative-config" in err and words in err, err
