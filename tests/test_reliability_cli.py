"""Reliability of the command lines and the API (issue 12, classes 3-6): every bad input refused in
one clear line naming the field, file, tensor or entry; no traceback; nothing outside changed.

The CLI cases run through each CLI's real `main` inside ONE subprocess (tests/reliability_driver.py),
and each CLI also once as its own `python -m ...` process for the true exit code and stderr. The API
cases call the library directly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convert.converter import convert
from convert.synthetic import write_checkpoint
from dsv3_jax.config import ConfigError, ModelConfig
from dsv3_jax.formats.safetensors_io import SafetensorsError, read_header
from tests.test_reliability_convert import tree_hashes

ROOT = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
CFG = ModelConfig.preset("tiny").replace(vocab_size=512)
BIG = str(2**40)


# ------------------------------------------------------------------------------------------ fixtures
def _linked_copy(src: Path, dst: Path) -> Path:
    """A copy of an HF directory whose shards are hard links (cheap; still regular files inside)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            os.link(f, dst / f.name)
        else:
            shutil.copyfile(f, dst / f.name)
    return dst


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if "." in k:
            a, b = k.split(".")
            d[a] = {**(d.get(a) or {}), b: v}
        else:
            d[k] = v
    path.write_text(json.dumps(d))


def _write_shard(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A synthetic HF source, its conversion (with a tiny word-level tokenizer), and damaged variants."""
    from tokenizers import Tokenizer, models

    root = tmp_path_factory.mktemp("cli")
    src = root / "src"
    write_checkpoint(src, CFG, fp8=False, data="random", shard_bytes=200_000)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3}
    (src / "tokenizer.json").write_text(Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str())
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ckpt = root / "ckpt"
    convert(src, ckpt, progress=False)

    damaged = {}
    for kind in ("truncated", "missing"):
        d = root / f"ckpt-{kind}"
        shutil.copytree(ckpt, d)
        leaf = d / "params" / "moe_layers.mlp.down_proj_weight"
        chunk = leaf / sorted(f for f in os.listdir(leaf) if not f.startswith("."))[1]
        if kind == "truncated":
            with open(chunk, "r+b") as f:
                f.truncate(100)
        else:
            chunk.unlink()
        damaged[kind] = (d, chunk)
    nan_cfg = root / "ckpt-nan-config"
    shutil.copytree(ckpt, nan_cfg)
    _edit_json(nan_cfg / "config.json", rope_theta=float("nan"))
    nan_w = root / "ckpt-nan-weights"  # the final norm all NaN: every logit is NaN (issue 12, class 7)
    shutil.copytree(ckpt, nan_w)
    chunk = nan_w / "params" / "norm.weight" / "0"
    chunk.write_bytes(np.full(chunk.stat().st_size // 4, np.nan, np.float32).tobytes())
    gen_cfg = root / "ckpt-genconfig"
    shutil.copytree(ckpt, gen_cfg)
    (gen_cfg / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))

    # An HF directory with one wrong-shaped tensor (shard rewritten with a [7, 5] tensor).
    hf_bad = _linked_copy(src, root / "hf-bad-shape")
    wm = json.loads((src / INDEX).read_text())["weight_map"]
    bad_name = "model.layers.2.mlp.experts.3.down_proj.weight"
    shard = hf_bad / wm[bad_name]
    infos, _ = read_header(shard)
    shard.unlink()
    header, data, off = {}, b"", 0
    for n, t in sorted(infos.items(), key=lambda x: x[1].start):
        shape = [7, 5] if n == bad_name else list(t.shape)
        nb = int(np.prod(shape)) * 4
        header[n] = {"dtype": t.dtype, "shape": shape, "data_offsets": [off, off + nb]}
        data += b"\0" * nb
        off += nb
    _write_shard(shard, header, data)
    return {"root": root, "src": src, "ckpt": ckpt, "damaged": damaged, "nan_cfg": nan_cfg, "nan_w": nan_w,
            "gen_cfg": gen_cfg, "hf_bad": (hf_bad, bad_name, shard.name)}


def _run_driver(cases: list[dict], tmp: Path) -> list[dict]:
    (tmp / "cases.json").write_text(json.dumps(cases))
    r = subprocess.run([sys.executable, "-m", "tests.reliability_driver", str(tmp / "cases.json"),
                        str(tmp / "out.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


def _one_line(stderr: str, prog: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{prog}: error:"), stderr
    return lines[0]


# ------------------------------------------------------------------------------ CLI cases, batched
CONFIG_CASES = [  # (config.json change, what the message must name)
    ({"rope_theta": float("nan")}, ["`rope_theta`", "nan"]),
    ({"routed_scaling_factor": "big"}, ["`routed_scaling_factor`", "'big'"]),
    ({"n_group": None}, ["`n_group`", "None"]),
    ({"hidden_size": "64"}, ["`hidden_size`", "'64'"]),
    ({"norm_topk_prob": "yes"}, ["`norm_topk_prob`", "'yes'"]),
    ({"eos_token_id": []}, ["`eos_token_id`", "empty list"]),
    ({"num_experts_per_tok": True}, ["`num_experts_per_tok`", "True"]),
    ({"rope_scaling": "yarn"}, ["`rope_scaling`", "'yarn'"]),
    ({"rope_scaling.factor": float("inf")}, ["`rope_scaling.factor`", "inf"]),
    ({"rms_norm_eps": 0}, ["`rms_norm_eps`", "0"]),
    ({"quantization_config.weight_block_size": []}, ["weight_block_size", "[]"]),
    ({"torch_dtype": 16}, ["`torch_dtype`", "16"]),
    ({"max_position_embeddings": -5}, ["`max_position_embeddings`", "-5"]),
    ({"q_lora_rank": 1.5}, ["`q_lora_rank`", "1.5"]),
]

def _span(entry: dict) -> int:
    return entry["data_offsets"][1] - entry["data_offsets"][0]


SHARD_CASES = {  # header entry of the first tensor -> what the message must name
    "overlap": (lambda h, names: h[names[1]].update(data_offsets=[
        h[names[0]]["data_offsets"][0], h[names[0]]["data_offsets"][0] + _span(h[names[1]])]), "overlaps"),
    "string offsets": (lambda h, names: h[names[0]].update(data_offsets=["0", "4"]),
                       "malformed data_offsets"),
    "negative dim": (lambda h, names: h[names[0]].update(shape=[-1, 4]), "malformed shape"),
    "float dim": (lambda h, names: h[names[0]].update(shape=[2.5, 4]), "malformed shape"),
}


def _cli_cases(world, tmp: Path) -> list[tuple[dict, int, list[str]]]:
    """(case, wanted exit code, substrings of the one-line message)."""
    src = world["src"]
    cases: list[tuple[dict, int, list[str]]] = []

    def conv(s: Path, *extra: str) -> dict:
        return {"cli": "convert", "argv": [str(s), str(tmp / "out" / s.name), "--quiet", *extra]}

    for i, (change, names) in enumerate(CONFIG_CASES):
        s = _linked_copy(src, tmp / f"cfg{i}")
        _edit_json(s / "config.json", **change)
        cases.append((conv(s), 2, ["config.json", *names, "nothing was written"]))
    s = _linked_copy(src, tmp / "cfg-list")
    (s / "config.json").write_text("[1, 2]")
    cases.append((conv(s), 2, ["config.json must hold a JSON object"]))
    s = _linked_copy(src, tmp / "cfg-latin1")
    (s / "config.json").write_bytes(b'{"model_type": "deepseek_v3", "x": "\xe9"}')
    cases.append((conv(s), 2, ["not UTF-8"]))
    for label, (edit, want) in SHARD_CASES.items():
        s = _linked_copy(src, tmp / f"shard-{label.replace(' ', '-')}")
        shard = sorted(s.glob("*.safetensors"))[0]
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        edit(header, names)
        shard.unlink()
        _write_shard(shard, header, raw[8 + n:])
        cases.append((conv(s), 2, [shard.name, want]))
    s = _linked_copy(src, tmp / "shard-trailing")
    shard = sorted(s.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data + b"\0" * 16)
    cases.append((conv(s), 2, [shard.name, "after the last tensor"]))
    cases.append((conv(src, "--dtype", "int4"), 2, ["--dtype 'int4'", "unknown dtype"]))
    cases.append((conv(src, "--dtype", "fp16"), 2, ["--dtype 'fp16'", "auto, bf16, fp8"]))

    def gen(*argv: str) -> dict:
        return {"cli": "generate", "argv": list(argv)}

    inp = tmp / "inputs"
    inp.mkdir()
    (inp / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (inp / "int_prompt.jsonl").write_text('{"prompt": 5}\n')
    (inp / "str_messages.jsonl").write_text('{"messages": "hi"}\n')
    trunc_dir, trunc_chunk = world["damaged"]["truncated"]
    miss_dir, miss_chunk = world["damaged"]["missing"]
    hf_bad, bad_name, bad_shard = world["hf_bad"]
    cases += [
        (gen("--prompt", "x", "--seed", BIG), 2, ["seed", BIG]),
        (gen("--prompt", "x", "--top-k", BIG), 2, ["top_k", BIG]),
        (gen("--prompt", "x", "--temperature", "nan"), 2, ["temperature", "nan"]),
        (gen("--prompt", "x", "--dtype", "fp8"), 2, ["--dtype 'fp8'", "conversion"]),
        (gen("--prompt", "x", "--dtype", "int4"), 2, ["--dtype 'int4'", "unknown dtype"]),
        (gen("--prompt", "x", "--mesh", ""), 2, ["--mesh ''", "empty"]),
        (gen("--prompt", "x", "--mesh", "tensor=2,,expert=2"), 2, ["empty item"]),
        (gen("--prompt", "x", "--mesh", "bogus=2"), 2, ["unknown axis 'bogus'"]),
        (gen("--prompt", "x", "--stop", ""), 2, ["--stop"]),
        (gen("--input-file", str(inp)), 2, [str(inp), "is a directory"]),
        (gen("--input-file", str(inp / "latin1.txt")), 2, ["latin1.txt", "not UTF-8"]),
        (gen("--input-file", str(inp / "none.txt")), 2, ["none.txt", "not found"]),
        (gen("--input-file", str(inp / "int_prompt.jsonl")), 2,
         ["int_prompt.jsonl:1", "'prompt' must be a string"]),
        (gen("--input-file", str(inp / "str_messages.jsonl")), 2, ["str_messages.jsonl:1", "'messages'"]),
        (gen("--ckpt", str(src / "config.json"), "--prompt", "x"), 2, ["not a directory"]),
        (gen("--ckpt", str(trunc_dir), "--prompt", "x"), 2,
         ["moe_layers.mlp.down_proj_weight", str(trunc_chunk), "truncated"]),
        (gen("--ckpt", str(miss_dir), "--prompt", "x"), 2,
         ["moe_layers.mlp.down_proj_weight", str(miss_chunk), "missing"]),
        (gen("--ckpt", str(world["nan_cfg"]), "--prompt", "x"), 2, ["`rope_theta`", "nan"]),
        (gen("--ckpt", str(world["gen_cfg"]), "--prompt", "x"), 2,
         ["generation_config.json field `temperature`", "'hot'"]),
        (gen("--ckpt", str(hf_bad), "--prompt", "x"), 2, [bad_name, bad_shard, "shape [7, 5]"]),
        # The engine's non-finite guard, seen from the CLI: one line, exit 1 (a failed run, not bad input).
        (gen("--ckpt", str(world["nan_w"]), "--prompt", "hello", "--max-new-tokens", "3"), 1,
         ["prompt 0", "non-finite logits"]),
    ]

    def plan(*argv: str) -> dict:
        return {"cli": "plan", "argv": ["--config", "tiny", "--device-memory", "1GB", *argv]}

    cases += [
        (plan("--mesh", ""), 2, ["--mesh ''", "empty"]),
        (plan("--mesh", " , "), 2, ["empty"]),
        (plan("--mesh", "expert=2", "--reserve", "-1"), 2, ["reserve", "-1"]),
        (plan("--mesh", "expert=2", "--reserve", "nan"), 2, ["reserve", "nan"]),
        (plan("--mesh", "expert=2", "--reserve", "2e9"), 2, ["reserve", "leaves nothing"]),
        (plan("--mesh", "expert=2", "--dtype", "int8"), 2, ["--dtype 'int8'"]),
        (plan("--mesh", "expert=2", "--max-seq-len", "0"), 2, ["max_seq_len"]),
        (plan("--mesh", "expert=2", "--device-memory", "lots"), 2, ["device memory", "'lots'"]),
        ({"cli": "plan", "argv": ["--config", str(tmp / "nope"), "--mesh", "expert=2"]}, 2,
         ["neither a preset", "nope"]),
        ({"cli": "plan", "argv": ["--config", str(tmp / "cfg0"), "--mesh", "expert=2"]}, 2, ["`rope_theta`"]),
    ]
    return cases


def test_every_cli_refuses_bad_input_in_one_clear_line(world, tmp_path):
    cases = _cli_cases(world, tmp_path)
    # Spellings that must work alike (handled, exit 0 or the planner's "does not fit" 1).
    good = [{"cli": "plan", "argv": ["--config", "tiny", "--mesh", m, "--dtype", d, "--device-memory", "1GB"]}
            for m, d in (("expert=2,", "bfloat16"), ("expert=2", "float8_e4m3fn"), (" tensor=2 , ", "bf16"),
                         ("expert=2", "fp8"), ("expert=2", "float32"))]
    good.append({"cli": "convert", "argv": [str(world["src"]), str(tmp_path / "good-bf16"), "--quiet",
                                            "--dtype", "bfloat16"]})
    before = tree_hashes(world["root"])
    results = _run_driver([c for c, _, _ in cases] + good, tmp_path)
    bad = []
    for (case, code, names), r in zip(cases, results, strict=False):
        label = f"{case['cli']} {' '.join(case['argv'])[-120:]}"
        if r["traceback"] or "Traceback" in r["stderr"]:
            bad.append(f"{label}: traceback\n{r['traceback'] or r['stderr']}")
            continue
        lines = [x for x in r["stderr"].splitlines() if x.strip() and not x.startswith("[dsv3_jax]")]  # info
        if r["code"] != code or len(lines) != 1 or not all(n in lines[0] for n in names):
            bad.append(f"{label}: exit {r['code']}, stderr {r['stderr']!r}, wanted {names}")
    for case, r in zip(good, results[len(cases):], strict=True):
        if r["code"] not in (0, 1) or r["traceback"] or "error" in r["stderr"]:
            bad.append(f"{case['argv']}: should work, got exit {r['code']} {r['stderr'][-500:]!r} "
                       f"{(r['traceback'] or '')[-1500:]}")
    assert not bad, "\n".join(bad)
    assert "nothing was written" not in results[-1]["stderr"] and (tmp_path / "good-bf16" / "params").is_dir()
    assert not (tmp_path / "out").exists()  # no refused conversion wrote anything
    assert tree_hashes(world["root"]) == before  # sources and checkpoints untouched
    assert len(cases) >= 50


@pytest.mark.parametrize("cli, argv, names", [
    ("dsv3_jax.generate", ["--ckpt", "{trunc}", "--prompt", "x"],
     ["moe_layers.mlp.down_proj_weight", "truncated"]),
    ("dsv3_jax.plan", ["--config", "tiny", "--mesh", "expert=2", "--reserve", "nan"], ["reserve", "nan"]),
])
def test_real_subprocess_exit_code_and_single_line(world, cli, argv, names):
    argv = [a.format(trunc=world["damaged"]["truncated"][0]) for a in argv]
    r = subprocess.run([sys.executable, "-m", cli, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr
    line = _one_line(r.stderr, cli.rsplit(".", 1)[-1])
    assert all(n in line for n in names), line


# ------------------------------------------------------------------------------------------ API cases
def test_api_damaged_checkpoints_name_the_leaf_file_or_tensor(world):
    import dsv3_jax
    from dsv3_jax.formats.checkpoint import CheckpointError

    for kind, (d, chunk) in world["damaged"].items():
        with pytest.raises(CheckpointError) as e:
            dsv3_jax.load(d)
        assert "moe_layers.mlp.down_proj_weight" in str(e.value) and str(chunk) in str(e.value), kind
        assert "\n" not in str(e.value)
    hf_bad, name, shard = world["hf_bad"]
    with pytest.raises(CheckpointError, match=f"{name} in {shard}: shape \\[7, 5\\]"):
        dsv3_jax.load(hf_bad)
    # A manifest that points outside its checkpoint is refused, naming the entry.
    d = world["root"] / "ckpt-escape"
    shutil.copytree(world["ckpt"], d)
    for where in ("/etc", "../ckpt/params"):
        _edit_json(d / "dsv3_manifest.json", params_dir=where)
        with pytest.raises(CheckpointError, match="params_dir"):
            dsv3_jax.load(d)
    # A config.json edited after conversion: named leaves, not a Flax error at the first forward.
    e2 = world["root"] / "ckpt-edited-config"
    shutil.copytree(world["ckpt"], e2)
    _edit_json(e2 / "config.json", intermediate_size=96)
    with pytest.raises(CheckpointError, match="dense_layers.mlp.down_proj.weight: stored .* implies"):
        dsv3_jax.load(e2)
    # A tokenizer.json that is a symlink out of the checkpoint is not read.
    _edit_json(d / "dsv3_manifest.json", params_dir="params")
    (d / "tokenizer.json").unlink()
    os.symlink(world["src"] / "tokenizer.json", d / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer.json.*outside"):
        dsv3_jax.load(d)


def test_api_config_fields_are_typed():
    base = CFG.to_hf_dict()
    for change, names in CONFIG_CASES:
        d = json.loads(json.dumps(base))
        for k, v in change.items():
            if "." in k:
                a, b = k.split(".")
                d[a] = {**(d.get(a) or {}), b: v}
            else:
                d[k] = v
        with pytest.raises(ConfigError) as e:
            ModelConfig.from_hf_dict(d)
        assert all(n in str(e.value) for n in names), (change, str(e.value))
    with pytest.raises(ConfigError, match="`num_experts_per_tok`.*'8'"):
        CFG.replace(num_experts_per_tok="8")


def test_api_safetensors_offsets_follow_the_format(tmp_path):
    def shard(header: dict, data: bytes) -> Path:
        p = tmp_path / "x.safetensors"
        _write_shard(p, header, data)
        return p

    t = {"dtype": "F32", "shape": [2]}
    with pytest.raises(SafetensorsError, match="'b'.*overlaps"):
        read_header(shard({"a": {**t, "data_offsets": [0, 8]}, "b": {**t, "data_offsets": [0, 8]}},
                          b"\0" * 8))
    with pytest.raises(SafetensorsError, match="before tensor 'b'.*no holes"):
        read_header(shard({"a": {**t, "data_offsets": [0, 8]}, "b": {**t, "data_offsets": [16, 24]}},
                          b"\0" * 24))
    with pytest.raises(SafetensorsError, match="'a' has malformed data_offsets"):
        read_header(shard({"a": {**t, "data_offsets": [8, 0]}}, b"\0" * 8))
    with pytest.raises(SafetensorsError, match="'a' has a malformed shape"):
        read_header(shard({"a": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, b"\0" * 8))
    assert read_header(shard({"a": {**t, "data_offsets": [0, 8]}}, b"\0" * 8))[0]["a"].shape == (2,)


def test_api_chat_refuses_what_the_template_would_drop():
    from dsv3_jax.text.chat import encode_chat
    from dsv3_jax.text.tokenizer import Tokenizer

    tok = Tokenizer.default()
    ok = encode_chat(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert len(ok) > 3
    for msgs, names in [([{"role": "developer", "content": "x"}], ["messages[0]", "'developer'"]),
                        ([{"role": "user", "content": 5}], ["messages[0]", "int"]),
                        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], ["list"]),
                        ([{"role": "user", "content": "a"}, {"role": "user"}],
                         ["messages[1]", "no 'content'"]),
                        ([{"role": 3, "content": "x"}], ["messages[0]", "role"]),
                        ([], ["empty"])]:
        with pytest.raises(ValueError) as e:
            encode_chat(tok, msgs)
        assert all(n in str(e.value) for n in names), (msgs, str(e.value))


def test_api_sampling_values_at_the_edges():
    from dsv3_jax.engine.sampling import SamplingParams, validate_sampling_params

    p = SamplingParams.make(np.int64(2), np.float32(0.5), np.float64(0.9), np.int32(3))  # numpy ints work
    assert p.batch_size == 2 and int(p.top_k[0]) == 3
    for kw, name in [({"top_k": 2**40}, "top_k"), ({"top_k": np.int64(2**40)}, "top_k"),
                     ({"temperature": True}, "temperature"), ({"top_p": "0.9"}, "top_p"),
                     ({"top_k": 1.5}, "top_k"), ({"temperature": math.inf}, "temperature")]:
        args = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **kw}
        with pytest.raises(ValueError, match=name):
            validate_sampling_params(**args)
    with pytest.raises(ValueError, match="seed"):
        validate_sampling_params(1.0, 1.0, 0, seed=2**40)
    validate_sampling_params(1.0, 1.0, 0, seed=np.int64(7))


def test_api_planner_and_cli_helpers(tmp_path):
    from dsv3_jax import generate, plan
    from dsv3_jax.cli import UsageError, check_mesh, parse_dtype

    cfg = ModelConfig.preset("tiny")
    for reserve in (-1, math.nan, math.inf, True):
        with pytest.raises(ValueError, match="reserve"):
            plan.plan(cfg, "expert=2", device_memory="1GB", reserve=reserve)
    assert {parse_dtype(s, ("bf16", "fp8")) for s in ("bf16", "bfloat16", "BF16")} == {"bf16"}
    assert {parse_dtype(s, ("bf16", "fp8")) for s in ("fp8", "float8_e4m3fn", "e4m3")} == {"fp8"}
    with pytest.raises(UsageError, match="not available here"):
        parse_dtype("fp32", ("bf16", "fp8"))
    assert check_mesh("tensor=2,") == "tensor=2"
    with pytest.raises(UsageError, match="empty"):
        check_mesh(" ")
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffhello\nworld\n".encode())
    assert generate.read_input_file(bom) == ["hello", "world"]  # the BOM is not part of the prompt
