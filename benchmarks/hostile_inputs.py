"""A hostile-input sweep: >= 150 bad (or odd but valid) inputs against the converter, the loader, the CLIs,
the API and the planner, each classified as

  clear      refused with one short message naming the field / file / tensor / entry, no traceback
  handled    an odd but valid input that works as a user would expect (a dtype spelling, a BOM, ...)
  unclear    a traceback, an exception from deep inside, or a message that does not name the thing
  silent     accepted although it should have been refused (or a valid input that did not work)
  lost       a file outside the destination changed (the source or another checkpoint)

    python benchmarks/hostile_inputs.py [--out results.json]

CLI cases run through each CLI's real `main` in one driver subprocess (tests/reliability_driver.py);
API, loader and planner cases run in this process. Prints a table per area and the totals.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from convert.converter import convert  # noqa: E402
from convert.synthetic import write_checkpoint  # noqa: E402
from dsv3_jax.config import ModelConfig  # noqa: E402

CFG = ModelConfig.preset("tiny").replace(vocab_size=512)
INDEX = "model.safetensors.index.json"
# Every library error is a ValueError subclass, files give OSError, a request the engine stopped on
# device (non-finite logits) gives request_stream.GenerationError.
from dsv3_jax.request_stream import GenerationError  # noqa: E402

EXPECTED = (ValueError, OSError, GenerationError)


@dataclasses.dataclass
class Case:
    area: str  # converter | loader | cli | api | planner
    label: str
    expect: str  # refuse | work
    names: list[str]  # what a refusal must name
    cli: dict | None = None  # {"cli", "argv"} for driver cases
    call: Callable[[], Any] | None = None  # API cases
    protect: list[Path] = dataclasses.field(default_factory=list)  # must not change
    check: Callable[[], bool] | None = None  # for "work" cases: did it do the right thing?
    verdict: str = ""
    detail: str = ""


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
        h.update(str(p.relative_to(root) if root.is_dir() else p.name).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ fixtures
def linked_copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            os.link(f, dst / f.name)
        elif f.is_file():
            shutil.copyfile(f, dst / f.name)
    return dst


def edit_json(path: Path, **changes: Any) -> None:
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if "." in k:
            a, b = k.split(".", 1)
            d[a] = {**(d.get(a) or {}), b: v}
        elif v is _DEL:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


_DEL = object()


def write_shard(path: Path, header: dict, data: bytes, pad: bool = True) -> None:
    blob = json.dumps(header).encode()
    if pad:
        blob += b" " * (-len(blob) % 8)
    if path.exists():
        path.unlink()  # may be a hard link to the pristine source
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def shard_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def build_world(root: Path) -> dict:
    from tokenizers import Tokenizer, models

    src = root / "src"
    write_checkpoint(src, CFG, fp8=False, data="random", shard_bytes=200_000)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    (src / "tokenizer.json").write_text(Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str())
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "chat_template": template}))
    ckpt = root / "ckpt"
    convert(src, ckpt, progress=False)
    return {"root": root, "src": src, "ckpt": ckpt}


# ------------------------------------------------------------------------------------------ cases
CONFIG_MUTATIONS = [
    ({"rope_theta": math.nan}, ["`rope_theta`"]), ({"rope_theta": "10000"}, ["`rope_theta`"]),
    ({"routed_scaling_factor": "big"}, ["`routed_scaling_factor`"]),
    ({"routed_scaling_factor": math.inf}, ["`routed_scaling_factor`"]),
    ({"n_group": None}, ["`n_group`"]), ({"hidden_size": "64"}, ["`hidden_size`"]),
    ({"hidden_size": 64.0}, ["`hidden_size`"]), ({"vocab_size": 0}, ["`vocab_size`"]),
    ({"norm_topk_prob": "yes"}, ["`norm_topk_prob`"]), ({"eos_token_id": []}, ["`eos_token_id`"]),
    ({"eos_token_id": 10**9}, ["`eos_token_id`"]), ({"bos_token_id": -1}, ["`bos_token_id`"]),
    ({"num_experts_per_tok": True}, ["`num_experts_per_tok`"]), ({"rope_scaling": "yarn"}, ["`rope_scaling`"]),
    ({"rope_scaling.factor": math.inf}, ["`rope_scaling.factor`"]),
    ({"rope_scaling.beta_fast": "32"}, ["`rope_scaling.beta_fast`"]),
    ({"rope_scaling.original_max_position_embeddings": 0}, ["original_max_position_embeddings"]),
    ({"rope_scaling.type": "linear"}, ["`rope_scaling.type`"]), ({"rms_norm_eps": 0}, ["`rms_norm_eps`"]),
    ({"rms_norm_eps": -1e-6}, ["`rms_norm_eps`"]),
    ({"quantization_config.weight_block_size": []}, ["weight_block_size"]),
    ({"quantization_config.quant_method": "awq"}, ["quant_method"]),
    ({"quantization_config.scale_fmt": "ue9"}, ["scale_fmt"]),
    ({"quantization_config": "fp8"}, ["`quantization_config`"]),
    ({"torch_dtype": 16}, ["`torch_dtype`"]), ({"torch_dtype": "float8"}, ["`dtype`"]),
    ({"max_position_embeddings": -5}, ["`max_position_embeddings`"]), ({"q_lora_rank": 1.5}, ["`q_lora_rank`"]),
    ({"topk_group": 99}, ["`topk_group`"]), ({"model_type": "llama"}, ["`model_type`"]),
    ({"num_hidden_layers": 0}, ["`num_hidden_layers`"]), ({"first_k_dense_replace": -1}, ["first_k_dense_replace"]),
    ({"tie_word_embeddings": "no"}, ["`tie_word_embeddings`"]), ({"qk_rope_head_dim": 7}, ["`qk_rope_head_dim`"]),
    ({"kv_lora_rank": _DEL}, ["`kv_lora_rank`", "missing"]), ({"rope_parameters": [1]}, ["`rope_parameters`"]),
]


def converter_cases(w: dict, tmp: Path) -> list[Case]:
    src = w["src"]
    cases: list[Case] = []
    n = 0

    def new_src() -> Path:
        nonlocal n
        n += 1
        return linked_copy(src, tmp / f"s{n}")

    def conv(s: Path, label: str, names: list[str], *extra: str, expect: str = "refuse",
             dst: Path | None = None, check: Callable[[], bool] | None = None) -> None:
        d = dst or tmp / "out" / s.name
        cases.append(Case("converter", label, expect, names, {"cli": "convert",
                          "argv": [str(s), str(d), "--quiet", *extra]}, protect=[s, w["src"], w["ckpt"]],
                          check=check))

    for change, names in CONFIG_MUTATIONS:
        s = new_src()
        edit_json(s / "config.json", **change)
        conv(s, f"config.json {change}", ["config.json", *names])
    s = new_src()
    (s / "config.json").write_text("[1, 2]")
    conv(s, "config.json is a list", ["JSON object"])
    s = new_src()
    (s / "config.json").write_bytes(b'{"x": "\xe9"}')
    conv(s, "config.json not UTF-8", ["not UTF-8"])
    s = new_src()
    (s / "config.json").unlink()
    conv(s, "config.json missing", ["config.json is missing"])
    s = new_src()
    (s / "config.json").unlink()
    (s / "config.json").mkdir()
    conv(s, "config.json is a directory", ["config.json", "not a regular file"])
    s = new_src()
    (s / "config.json").write_text("")
    conv(s, "config.json empty", ["config.json", "not valid JSON"])
    s = new_src()
    (s / "config.json").unlink()
    os.symlink(w["ckpt"] / "config.json", s / "config.json")
    conv(s, "config.json symlink out of the source", ["config.json", "outside"])

    # ---- shard headers
    def shard_case(label: str, names: list[str], edit: Callable[[dict, list[str], bytes], tuple[dict, bytes]],
                   pad: bool = True) -> None:
        s = new_src()
        shard = sorted(s.glob("*.safetensors"))[0]
        header, data = shard_parts(shard)
        order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        header, data = edit(header, order, data)
        write_shard(shard, header, data, pad)
        conv(s, f"shard: {label}", [shard.name, *names])

    def span(e: dict) -> int:
        return e["data_offsets"][1] - e["data_offsets"][0]

    def overlap(h, o, d):
        h[o[1]]["data_offsets"] = [h[o[0]]["data_offsets"][0], h[o[0]]["data_offsets"][0] + span(h[o[1]])]
        return h, d

    def hole(h, o, d):
        for k in o[1:]:
            h[k]["data_offsets"] = [x + 64 for x in h[k]["data_offsets"]]
        return h, d[:span(h[o[0]])] + b"\0" * 64 + d[span(h[o[0]]):]

    def setk(key, value):
        def f(h, o, d):
            h[o[0]][key] = value
            return h, d
        return f

    shard_case("overlapping offsets", ["overlaps"], overlap)
    shard_case("hole between tensors", ["no holes"], hole)
    shard_case("string offsets", ["malformed data_offsets"], setk("data_offsets", ["0", "8"]))
    shard_case("reversed offsets", ["malformed data_offsets"], setk("data_offsets", [8, 0]))
    shard_case("negative dim", ["malformed shape"], setk("shape", [-1, 4]))
    shard_case("float dim", ["malformed shape"], setk("shape", [2.5, 4]))
    shard_case("bool dim", ["malformed shape"], setk("shape", [True, 4]))
    shard_case("unsupported dtype", ["unsupported dtype"], setk("dtype", "Q4"))
    shard_case("extra header key", ["corrupt header entry"], setk("quant", 1))
    shard_case("trailing bytes", ["after the last tensor"], lambda h, o, d: (h, d + b"\0" * 16))
    shard_case("truncated data", ["truncated"], lambda h, o, d: (h, d[:-100]))
    shard_case("__metadata__ not an object", ["__metadata__"], lambda h, o, d: ({**h, "__metadata__": [1]}, d))
    shard_case("header is a list", ["not a JSON object"], lambda h, o, d: ([1, 2], d))
    s = new_src()
    shard = sorted(s.glob("*.safetensors"))[0]
    shard.unlink()
    shard.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    conv(s, "shard: header length 1 TB", [shard.name, "corrupt or truncated header"])
    s = new_src()
    shard = sorted(s.glob("*.safetensors"))[0]
    shard.unlink()
    shard.write_bytes(b"\x01\x02")
    conv(s, "shard: 2 bytes", [shard.name, "truncated"])
    s = new_src()
    shard = sorted(s.glob("*.safetensors"))[0]
    shard.unlink()
    conv(s, "shard missing", [shard.name, "missing"])
    s = new_src()
    shard = sorted(s.glob("*.safetensors"))[0]
    shard.unlink()
    shard.mkdir()
    conv(s, "shard is a directory", [shard.name, "not a regular file"])

    # ---- tensors against the config
    def retensor(label: str, names: list[str], fn: Callable[[dict, list[str], bytes], tuple[dict, bytes]]):
        shard_case(label, names, fn)

    def wrong_shape(h, o, d):
        h[o[0]]["shape"] = [span(h[o[0]]) // 4]
        return h, d

    retensor("tensor with wrong shape", ["shape"], wrong_shape)
    s = new_src()
    idx = json.loads((s / INDEX).read_text())
    idx["weight_map"]["model.layers.0.mlp.bogus.weight"] = sorted(idx["weight_map"].values())[0]
    (s / INDEX).write_text(json.dumps(idx))
    conv(s, "index lists a tensor its shard lacks", ["model.layers.0.mlp.bogus.weight", "absent"])

    # ---- index entries
    def index_case(label: str, names: list[str], fn: Callable[[dict, Path], Any]) -> None:
        s = new_src()
        idx = json.loads((s / INDEX).read_text())
        r = fn(idx, s)
        (s / INDEX).write_text(r if isinstance(r, str) else json.dumps(idx))
        conv(s, f"index: {label}", names)

    first = sorted(json.loads((src / INDEX).read_text())["weight_map"].items())[0]
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    shutil.copyfile(src / first[1], elsewhere / first[1])

    def point(entry: str):
        def f(idx, s):
            for k, v in idx["weight_map"].items():
                if v == first[1]:
                    idx["weight_map"][k] = entry
        return f

    def point_symlink(idx, s):
        os.symlink(elsewhere / first[1], s / "evil.safetensors")
        point("evil.safetensors")(idx, s)

    index_case("absolute entry", [str(elsewhere / first[1]), "absolute"], point(str(elsewhere / first[1])))
    index_case("'..' entry", ["../elsewhere", "'..'"], point(f"../elsewhere/{first[1]}"))
    index_case("symlink entry leaving the source", ["evil.safetensors", "outside"], point_symlink)
    index_case("weight_map not an object", [INDEX, "weight_map"], lambda idx, s: idx.update(weight_map=[1]))
    index_case("weight_map empty", [INDEX, "weight_map"], lambda idx, s: idx.update(weight_map={}))
    index_case("entry is a number", [INDEX, "not a file name"], point(7))
    index_case("index not JSON", [INDEX, "unreadable"], lambda idx, s: "{not json")
    index_case("entry names a directory", ["sub", "not a regular file"],
               lambda idx, s: ((s / "sub").mkdir(), point("sub")(idx, s)))

    # ---- destination and options
    par = tmp / "parent"
    par.mkdir()
    inner = linked_copy(src, par / "src")
    cases.append(Case("converter", "--force onto the source's parent", "refuse", ["contains the source"],
                      {"cli": "convert", "argv": [str(inner), str(par), "--force", "--quiet"]}, protect=[par]))
    other = tmp / "other"
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    cases.append(Case("converter", "--force onto someone else's directory", "refuse",
                      ["not a checkpoint this converter wrote"],
                      {"cli": "convert", "argv": [str(src), str(other), "--force", "--quiet"]}, protect=[other]))
    cases.append(Case("converter", "destination is the source", "refuse", ["is the source directory"],
                      {"cli": "convert", "argv": [str(src), str(src), "--force", "--quiet"]}, protect=[src]))
    afile = tmp / "afile"
    afile.write_text("data")
    cases.append(Case("converter", "--force onto a file", "refuse", ["not a checkpoint this converter wrote"],
                      {"cli": "convert", "argv": [str(src), str(afile), "--force", "--quiet"]}, protect=[afile]))
    link = tmp / "ckpt-link"
    os.symlink(w["ckpt"], link)
    cases.append(Case("converter", "--force onto a symlink to a checkpoint", "refuse", ["symbolic link"],
                      {"cli": "convert", "argv": [str(src), str(link), "--force", "--quiet"]},
                      protect=[w["ckpt"]]))
    cases.append(Case("converter", "existing destination without --force", "refuse", ["already exists", "--force"],
                      {"cli": "convert", "argv": [str(src), str(w["ckpt"]), "--quiet"]}, protect=[w["ckpt"]]))
    cases.append(Case("converter", "--dtype int4", "refuse", ["--dtype 'int4'"],
                      {"cli": "convert", "argv": [str(src), str(tmp / "out" / "x1"), "--dtype", "int4"]}))
    cases.append(Case("converter", "--dtype fp16", "refuse", ["not available here"],
                      {"cli": "convert", "argv": [str(src), str(tmp / "out" / "x2"), "--dtype", "fp16"]}))
    cases.append(Case("converter", "--workers 0", "refuse", ["--workers"],
                      {"cli": "convert", "argv": [str(src), str(tmp / "out" / "x3"), "--workers", "0"]}))
    for spelling in ("bfloat16", "BF16", "float8_e4m3fn", "e4m3"):
        d = tmp / "good" / spelling
        cases.append(Case("converter", f"--dtype {spelling}", "work", [],
                          {"cli": "convert", "argv": [str(src), str(d), "--quiet", "--dtype", spelling]},
                          protect=[src], check=lambda d=d: (d / "dsv3_manifest.json").is_file()))
    d = tmp / "good" / "ue8m0-ignored"
    cases.append(Case("converter", "--ue8m0 without quantizing", "work", [],
                      {"cli": "convert", "argv": [str(src), str(d), "--quiet", "--ue8m0"]},
                      check=lambda d=d: "ue8m0" in json.loads((d / "dsv3_manifest.json").read_text())["notes"][-1]))
    d = tmp / "good" / "forced"
    shutil.copytree(w["ckpt"], d)
    cases.append(Case("converter", "--force onto its own checkpoint", "work", [],
                      {"cli": "convert", "argv": [str(src), str(d), "--quiet", "--force"]},
                      protect=[src], check=lambda d=d: (d / "dsv3_manifest.json").is_file()))
    cases.append(Case("converter", "--resume of a finished conversion", "work", [],
                      {"cli": "convert", "argv": [str(src), str(d), "--quiet", "--resume"]},
                      protect=[src], check=lambda d=d: (d / "dsv3_manifest.json").is_file()))
    s = new_src()
    os.symlink(elsewhere / first[1], s / "tokenizer_config.json") if not (s / "tokenizer_config.json").exists() \
        else ((s / "tokenizer_config.json").unlink(), os.symlink(elsewhere / first[1], s / "tokenizer_config.json"))
    d = tmp / "good" / "side-symlink"
    cases.append(Case("converter", "tokenizer_config.json symlinked out of the source", "work", [],
                      {"cli": "convert", "argv": [str(s), str(d), "--quiet"]}, protect=[s],
                      check=lambda d=d: not (d / "tokenizer_config.json").exists()
                      and (d / "tokenizer.json").is_file()))
    return cases


def loader_cases(w: dict, tmp: Path) -> list[Case]:
    import dsv3_jax
    from dsv3_jax.text.tokenizer import Tokenizer

    ckpt, src = w["ckpt"], w["src"]
    cases: list[Case] = []
    n = 0

    def copy() -> Path:
        nonlocal n
        n += 1
        d = tmp / f"L{n}"
        shutil.copytree(ckpt, d)
        return d

    def load_case(label: str, d: Path, names: list[str], expect: str = "refuse", check=None) -> None:
        cases.append(Case("loader", label, expect, names, call=lambda d=d: dsv3_jax.load(d), protect=[ckpt, src],
                          check=check))

    leaf = "moe_layers.mlp.down_proj_weight"

    def chunk(d: Path) -> Path:
        return d / "params" / leaf / sorted(f for f in os.listdir(d / "params" / leaf) if not f.startswith("."))[1]

    d = copy()
    with open(chunk(d), "r+b") as f:
        f.truncate(100)
    load_case("truncated chunk", d, [leaf, chunk(d).name, "truncated"])
    d = copy()
    c = chunk(d)
    c.unlink()
    load_case("missing chunk", d, [leaf, c.name, "missing"])
    d = copy()
    (d / "params" / leaf / ".zarray").unlink()
    load_case("missing .zarray", d, [leaf, ".zarray"])
    d = copy()
    (d / "params" / leaf / ".zarray").write_text("{garbage")
    load_case("corrupt .zarray", d, [leaf, ".zarray"])
    d = copy()
    z = json.loads((d / "params" / leaf / ".zarray").read_text())
    z["shape"][0] += 1
    (d / "params" / leaf / ".zarray").write_text(json.dumps(z))
    load_case(".zarray shape disagrees with the manifest", d, [leaf, "manifest"])
    d = copy()
    shutil.rmtree(d / "params" / leaf)
    load_case("leaf directory missing", d, [leaf])
    for label, where, names in [("absolute params_dir", "/etc", ["params_dir", "absolute"]),
                                ("'..' params_dir", "../ckpt/params", ["params_dir", "'..'"]),
                                ("params_dir a number", 5, ["params_dir"])]:
        d = copy()
        edit_json(d / "dsv3_manifest.json", params_dir=where)
        load_case(label, d, names)
    d = copy()
    shutil.rmtree(d / "params")
    os.symlink(ckpt / "params", d / "params")
    load_case("params is a symlink out of the checkpoint", d, ["params_dir", "outside"])
    d = copy()
    (d / "dsv3_manifest.json").write_text("{not json")
    load_case("manifest not JSON", d, ["dsv3_manifest.json", "unreadable"])
    d = copy()
    edit_json(d / "dsv3_manifest.json", leaves=[1])
    load_case("manifest leaves a list", d, ["leaves"])
    d = copy()
    m = json.loads((d / "dsv3_manifest.json").read_text())
    m["leaves"]["../../etc"] = m["leaves"].pop(leaf)
    (d / "dsv3_manifest.json").write_text(json.dumps(m))
    load_case("manifest leaf name with '..'", d, ["../../etc"])
    d = copy()
    m = json.loads((d / "dsv3_manifest.json").read_text())
    m["leaves"][leaf][1] = "int4"
    (d / "dsv3_manifest.json").write_text(json.dumps(m))
    load_case("manifest leaf dtype int4", d, [leaf, "malformed"])
    d = copy()
    edit_json(d / "dsv3_manifest.json", leaves=_DEL)
    load_case("manifest without leaves", d, ["dsv3_manifest.json", "leaves"])
    d = copy()
    (d / "dsv3_manifest.json").unlink()
    (d / "convert_plan.json").write_text("{}")
    load_case("interrupted conversion (no manifest)", d, ["incomplete", "--resume"])
    d = copy()
    edit_json(d / "config.json", rope_theta=math.nan)
    load_case("config rope_theta NaN", d, ["`rope_theta`", "nan"])
    d = copy()
    (d / "config.json").unlink()
    load_case("config.json missing", d, ["config.json"])
    d = copy()
    edit_json(d / "config.json", intermediate_size=96)
    load_case("config.json edited after conversion", d, ["do not match config.json", "down_proj"])
    for label, gen, names in [("temperature 'hot'", {"temperature": "hot"}, ["`temperature`", "'hot'"]),
                              ("top_k 2**40", {"top_k": 2**40}, ["`top_k`"]),
                              ("top_p 0", {"top_p": 0}, ["`top_p`"]),
                              ("eos_token_id []", {"eos_token_id": []}, ["`eos_token_id`"]),
                              ("eos_token_id 'x'", {"eos_token_id": "x"}, ["`eos_token_id`"]),
                              ("do_sample 'yes'", {"do_sample": "yes"}, ["`do_sample`"]),
                              ("temperature true", {"temperature": True}, ["`temperature`"])]:
        d = copy()
        (d / "generation_config.json").write_text(json.dumps(gen))
        load_case(f"generation_config {label}", d, ["generation_config.json", *names])
    d = copy()
    (d / "generation_config.json").write_text("[]")
    load_case("generation_config a list", d, ["generation_config.json", "JSON object"])
    d = copy()
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": None}))
    load_case("generation_config with top_k null", d, [], expect="work",
              check=None)
    d = copy()
    shutil.copyfile(src / "tokenizer.json", tmp / "outside-tokenizer.json")
    (d / "tokenizer.json").unlink()
    os.symlink(tmp / "outside-tokenizer.json", d / "tokenizer.json")
    load_case("tokenizer.json symlinked out", d, ["tokenizer.json", "outside"])
    d = copy()
    (d / "tokenizer.json").write_text("{not a tokenizer")
    load_case("tokenizer.json invalid", d, ["tokenizer.json"])
    d = copy()
    (d / "tokenizer_config.json").write_text("[1]")
    load_case("tokenizer_config.json a list", d, ["tokenizer_config.json", "JSON object"])
    d = copy()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"x": 1}]}))
    load_case("chat_template list without names", d, ["chat_template"])
    load_case("path is a file", ckpt / "config.json", ["not found"])
    load_case("path missing", tmp / "nope", ["not found"])
    # HF directories loaded directly
    hf = linked_copy(src, tmp / "hf-shape")
    shard = sorted(hf.glob("*.safetensors"))[0]
    h, data = shard_parts(shard)
    k = sorted(x for x in h if x != "__metadata__")[0]
    h[k]["shape"] = [(h[k]["data_offsets"][1] - h[k]["data_offsets"][0]) // 4]
    write_shard(shard, h, data)
    load_case("HF tensor with wrong shape", hf, [k, shard.name, "shape"])
    hf = linked_copy(src, tmp / "hf-abs")
    idx = json.loads((hf / INDEX).read_text())
    k0, f0 = sorted(idx["weight_map"].items())[0]
    idx["weight_map"] = {k: (str(src / f) if f == f0 else f) for k, f in idx["weight_map"].items()}
    (hf / INDEX).write_text(json.dumps(idx))
    load_case("HF index entry absolute", hf, ["absolute", f0])
    hf = linked_copy(src, tmp / "hf-dotdot")
    idx["weight_map"] = {k: (f"../src/{f0}" if f == str(src / f0) else f) for k, f in idx["weight_map"].items()}
    (hf / INDEX).write_text(json.dumps(idx))
    load_case("HF index entry with '..'", hf, ["'..'"])
    cases.append(Case("loader", "Tokenizer.from_dir on a missing dir", "refuse", ["not found"],
                      call=lambda: Tokenizer.from_dir(tmp / "nope")))
    return cases


def cli_cases(w: dict, tmp: Path) -> list[Case]:
    inp = tmp / "inputs"
    inp.mkdir()
    (inp / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (inp / "utf16.txt").write_text("hello\n", encoding="utf-16")
    (inp / "empty.txt").write_text("\n\n")
    (inp / "int_prompt.jsonl").write_text('{"prompt": 5}\n')
    (inp / "str_messages.jsonl").write_text('{"messages": "hi"}\n')
    (inp / "no_key.jsonl").write_text('{"text": "hi"}\n')
    (inp / "bad.jsonl").write_text('{"prompt": "hi"\n')
    (inp / "bom.txt").write_bytes("\ufeffhello world\n".encode())
    (inp / "role.jsonl").write_text(json.dumps({"messages": [{"role": "developer", "content": "x"}]}) + "\n")
    (inp / "content.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": [1]}]}) + "\n")
    ck = str(w["ckpt"])
    big = str(2**40)
    rows = [
        (["--prompt", "x", "--seed", big], ["seed", big]), (["--prompt", "x", "--seed", "-" + big], ["seed"]),
        (["--prompt", "x", "--top-k", big], ["top_k", big]), (["--prompt", "x", "--top-k", "-1"], ["top_k"]),
        (["--prompt", "x", "--temperature", "nan"], ["temperature"]),
        (["--prompt", "x", "--temperature", "-1"], ["temperature"]),
        (["--prompt", "x", "--temperature", "inf"], ["temperature"]), (["--prompt", "x", "--top-p", "0"], ["top_p"]),
        (["--prompt", "x", "--top-p", "1.5"], ["top_p"]), (["--prompt", "x", "--top-p", "nan"], ["top_p"]),
        (["--prompt", "x", "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--prompt", "x", "--max-new-tokens", "-5"], ["--max-new-tokens"]), (["--prompt", "x", "--mtp", "9"], ["--mtp"]),
        (["--prompt", "x", "--dtype", "fp8"], ["--dtype 'fp8'", "conversion"]),
        (["--prompt", "x", "--dtype", "int4"], ["unknown dtype"]), (["--prompt", "x", "--mesh", ""], ["empty"]),
        (["--prompt", "x", "--mesh", ",,"], ["empty"]), (["--prompt", "x", "--mesh", "tensor=2,,expert=2"], ["empty item"]),
        (["--prompt", "x", "--mesh", "bogus=2"], ["bogus"]), (["--prompt", "x", "--mesh", "tensor=x"], ["tensor"]),
        (["--prompt", "x", "--mesh", "tensor=0"], ["tensor"]),
        (["--prompt", "x", "--mesh", "tensor=2,tensor=2"], ["twice"]), (["--prompt", "x", "--stop", ""], ["--stop"]),
        (["--input-file", str(inp)], ["is a directory"]), (["--input-file", str(inp / "latin1.txt")], ["not UTF-8"]),
        (["--input-file", str(inp / "utf16.txt")], ["not UTF-8"]),
        (["--input-file", str(inp / "missing.txt")], ["not found"]), (["--input-file", str(inp / "empty.txt")], ["no prompts"]),
        (["--input-file", str(inp / "int_prompt.jsonl")], ["'prompt' must be a string"]),
        (["--input-file", str(inp / "str_messages.jsonl")], ["'messages'"]),
        (["--input-file", str(inp / "no_key.jsonl")], ["'prompt' or 'messages'"]),
        (["--input-file", str(inp / "bad.jsonl")], ["bad.jsonl:1", "invalid JSON"]),
        (["--input-file", "/dev/zero"], ["/dev/zero", "not a regular file"]),
        (["--ckpt", str(w["src"] / "config.json"), "--prompt", "x"], ["not a directory"]),
        (["--ckpt", str(tmp / "nope"), "--prompt", "x"], ["not found"]),
        (["--ckpt", ck, "--input-file", str(inp / "role.jsonl"), "--max-new-tokens", "1"], ["'developer'"]),
        (["--ckpt", ck, "--input-file", str(inp / "content.jsonl"), "--max-new-tokens", "1"], ["'content'"]),
    ]
    nan_w = tmp / "ckpt-nan-weights"  # the final norm all NaN: every logit is NaN
    shutil.copytree(w["ckpt"], nan_w)
    chunk = nan_w / "params" / "norm.weight" / "0"
    chunk.write_bytes(np.full(chunk.stat().st_size // 4, np.nan, np.float32).tobytes())
    w["nan_w"] = nan_w
    rows.append((["--ckpt", str(nan_w), "--prompt", "hello", "--max-new-tokens", "3"], ["non-finite logits"]))
    cases = [Case("cli", "generate " + " ".join(a)[-80:], "refuse", names, {"cli": "generate", "argv": a})
             for a, names in rows]
    for a in (["--ckpt", ck, "--input-file", str(inp / "bom.txt"), "--max-new-tokens", "2", "--json"],
              ["--ckpt", ck, "--prompt", "hello", "--dtype", "bf16", "--max-new-tokens", "2"],
              ["--ckpt", ck, "--prompt", "hello", "--seed", str(2**31 - 1), "--max-new-tokens", "2", "--top-k",
               "3"]):
        cases.append(Case("cli", "generate " + " ".join(a)[-80:], "work", [], {"cli": "generate", "argv": a}))
    return cases


def planner_cases(w: dict, tmp: Path) -> list[Case]:
    from dsv3_jax import plan

    cfg = ModelConfig.preset("tiny")
    cases: list[Case] = []
    base = ["--config", "tiny", "--device-memory", "1GB"]
    rows = [
        (["--mesh", ""], ["empty"]), (["--mesh", " , "], ["empty"]), (["--mesh", "expert=2", "--reserve", "-1"], ["reserve"]),
        (["--mesh", "expert=2", "--reserve", "nan"], ["reserve"]), (["--mesh", "expert=2", "--reserve", "inf"], ["reserve"]),
        (["--mesh", "expert=2", "--reserve", "5e9"], ["reserve"]), (["--mesh", "expert=2", "--dtype", "int8"], ["int8"]),
        (["--mesh", "expert=2", "--max-seq-len", "0"], ["max_seq_len"]),
        (["--mesh", "expert=2", "--device-memory", "lots"], ["device memory"]),
        (["--mesh", "expert=2", "--device-memory", "0GB"], ["device memory"]),
        (["--mesh", "expert=3"], ["expert"]), (["--mesh", "expert=-1"], ["-1"]),
    ]
    for a, names in rows:
        cases.append(Case("planner", "plan " + " ".join(a), "refuse", names, {"cli": "plan", "argv": base + a}))
    cases.append(Case("planner", "plan --config missing", "refuse", ["neither a preset"],
                      {"cli": "plan", "argv": ["--config", str(tmp / "nope"), "--mesh", "expert=2"]}))
    for m, d in (("expert=2,", "bfloat16"), ("expert=2", "float8_e4m3fn"), (" tensor=2 , ", "bf16"),
                 ("expert=2", "FP32")):
        cases.append(Case("planner", f"plan --mesh {m!r} --dtype {d}", "work", [],
                          {"cli": "plan", "argv": base + ["--mesh", m, "--dtype", d]}))
    for label, kw, names in [("reserve -1", {"reserve": -1}, ["reserve"]), ("reserve NaN", {"reserve": math.nan}, ["reserve"]),
                             ("reserve True", {"reserve": True}, ["reserve"]),
                             ("device_memory -5", {"device_memory": -5}, ["device memory"]),
                             ("max_seq_len 1.5", {"max_seq_len": 1.5}, ["max_seq_len"]),
                             ("dtype 'int8'", {"dtype": "int8"}, ["dtype"]),
                             ("mesh {'expert': 0}", {"mesh": {"expert": 0}}, ["expert"])]:
        args = {"mesh": "expert=2", "device_memory": "1GB", **kw}
        cases.append(Case("planner", f"plan() {label}", "refuse", names,
                          call=lambda args=args: plan.plan(cfg, **args)))
    cases.append(Case("planner", "plan() numpy ints", "work", [],
                      call=lambda: plan.plan(cfg, "expert=2", device_memory=np.int64(10**9),
                                             max_seq_len=np.int32(64))))
    return cases


def api_cases(w: dict, tmp: Path) -> list[Case]:
    from dsv3_jax.engine.sampling import SamplingParams, validate_sampling_params
    from dsv3_jax.text.chat import encode_chat
    from dsv3_jax.text.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cases: list[Case] = []
    for label, msgs, names in [
        ("unknown role", [{"role": "developer", "content": "x"}], ["'developer'"]),
        ("role int", [{"role": 3, "content": "x"}], ["role"]),
        ("content int", [{"role": "user", "content": 5}], ["content"]),
        ("content list of parts", [{"role": "user", "content": [{"type": "text", "text": "x"}]}], ["content"]),
        ("content dict", [{"role": "user", "content": {"a": 1}}], ["content"]),
        ("no content", [{"role": "user"}], ["content"]), ("message a string", ["hello"], ["messages[0]"]),
        ("messages a string", "hello", ["messages"]), ("no messages", [], ["empty"]),
    ]:
        cases.append(Case("api", f"chat: {label}", "refuse", names, call=lambda m=msgs: encode_chat(tok, m)))
    for label, msgs in [("system+user+assistant+tool", [{"role": "system", "content": "s"},
                                                      {"role": "user", "content": "u"},
                                                      {"role": "assistant", "content": "a"},
                                                      {"role": "tool", "content": "t"}]),
                        ("assistant tool_calls with content None", [
                            {"role": "user", "content": "u"},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}])]:
        cases.append(Case("api", f"chat: {label}", "work", [], call=lambda m=msgs: encode_chat(tok, m)))
    for label, args, names in [
        ("top_k 2**40", (1.0, 1.0, 2**40), ["top_k"]), ("top_k np.int64(2**40)", (1.0, 1.0, np.int64(2**40)), ["top_k"]),
        ("temperature True", (True, 1.0, 0), ["temperature"]), ("top_p '0.9'", (1.0, "0.9", 0), ["top_p"]),
        ("top_k 1.5", (1.0, 1.0, 1.5), ["top_k"]), ("top_k None", (1.0, 1.0, None), ["top_k"]),
        ("temperature NaN", (math.nan, 1.0, 0), ["temperature"]), ("top_k []", (1.0, 1.0, []), ["top_k"]),
    ]:
        cases.append(Case("api", f"sampling: {label}", "refuse", names,
                          call=lambda a=args: validate_sampling_params(*a)))
    cases.append(Case("api", "sampling: seed 2**40", "refuse", ["seed"],
                      call=lambda: validate_sampling_params(1.0, 1.0, 0, seed=2**40)))
    cases.append(Case("api", "SamplingParams.make(batch_size=0)", "refuse", ["batch_size"],
                      call=lambda: SamplingParams.make(0)))
    cases.append(Case("api", "sampling: numpy scalars", "work", [],
                      call=lambda: SamplingParams.make(np.int64(2), np.float32(0.5), np.float64(0.9), np.int32(3))))
    cases.append(Case("api", "ModelConfig.replace(num_experts_per_tok='8')", "refuse", ["num_experts_per_tok"],
                      call=lambda: CFG.replace(num_experts_per_tok="8")))
    cases.append(Case("api", "ModelConfig(hidden_size=True)", "refuse", ["hidden_size"],
                      call=lambda: ModelConfig(hidden_size=True)))
    cases.append(Case("api", "tokenizer.encode(5)", "refuse", ["str"], call=lambda: tok.encode(5)))
    cases.append(Case("api", "ModelConfig.replace(num_experts_per_tok=np.int64(2))", "work", [],
                      call=lambda: CFG.replace(num_experts_per_tok=np.int64(2)),
                      check=lambda: type(CFG.replace(num_experts_per_tok=np.int64(2)).num_experts_per_tok) is int))

    # Through a loaded handle: the whole stack (engine included).
    import dsv3_jax

    state: dict[str, Any] = {}

    def handle():
        if "h" not in state:
            state["h"] = dsv3_jax.load(w["ckpt"])
        return state["h"]

    for label, kw, names in [("seed 2**40", {"seed": 2**40}, ["seed"]), ("top_k 2**40", {"top_k": 2**40}, ["top_k"]),
                             ("max_new_tokens 0", {"max_new_tokens": 0}, ["max_new_tokens"]),
                             ("temperature -1", {"temperature": -1.0}, ["temperature"])]:
        cases.append(Case("api", f"handle.generate {label}", "refuse", names,
                          call=lambda kw=kw: handle().generate([3, 4], **{"max_new_tokens": 2, **kw})))
    cases.append(Case("api", "handle.generate token id beyond the vocabulary", "refuse", ["token"],
                      call=lambda: handle().generate([3, 10**6], max_new_tokens=2)))
    cases.append(Case("api", "handle.generate with NaN weights", "refuse", ["non-finite logits"],
                      call=lambda: dsv3_jax.load(w["nan_w"]).generate([3, 4], max_new_tokens=2)))
    cases.append(Case("api", "handle.generate empty prompt", "refuse", ["prompt"],
                      call=lambda: handle().generate([], max_new_tokens=2)))
    cases.append(Case("api", "handle.chat unknown role", "refuse", ["'developer'"],
                      call=lambda: handle().chat([{"role": "developer", "content": "x"}])))
    cases.append(Case("api", "dsv3_jax.load dtype='bf16'", "work", [],
                      call=lambda: dsv3_jax.load(w["ckpt"], dtype="bf16")))
    cases.append(Case("api", "dsv3_jax.load dtype=jnp.float32", "work", [],
                      call=lambda: dsv3_jax.load(w["ckpt"], dtype=np.float32)))
    cases.append(Case("api", "dsv3_jax.load dtype='fp8'", "refuse", ["fp8", "conversion"],
                      call=lambda: dsv3_jax.load(w["ckpt"], dtype="fp8")))
    cases.append(Case("api", "dsv3_jax.load mesh=''", "refuse", ["mesh"],
                      call=lambda: dsv3_jax.load(w["ckpt"], mesh="")))
    return cases


# ------------------------------------------------------------------------------------------ running
def classify_cli(c: Case, r: dict) -> None:
    err = r["stderr"]
    if r["traceback"] or "Traceback" in err:
        c.verdict, c.detail = "unclear", (r["traceback"] or err).strip().splitlines()[-1][:200]
        return
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("  - ", "[dsv3_jax]"))]
    if c.expect == "refuse":
        if r["code"] in (0, None):
            c.verdict, c.detail = "silent", f"exit {r['code']}"
        elif len(lines) == 1 and all(n in err for n in c.names):
            c.verdict, c.detail = "clear", lines[0][:200]
        else:
            c.verdict, c.detail = "unclear", f"exit {r['code']}: {err.strip()[:200]!r} (wanted {c.names})"
    else:
        ok = r["code"] in (0, 1) and (c.check is None or c.check())
        c.verdict, c.detail = ("handled" if ok else "silent"), f"exit {r['code']} {err.strip()[-200:]!r}"


def run_api(c: Case) -> None:
    try:
        c.call()
    except EXPECTED as e:
        msg = str(e)
        if c.expect == "work":
            c.verdict, c.detail = "silent", f"refused: {msg[:200]}"
        elif all(n in msg for n in c.names) and msg.count("\n") == 0:
            c.verdict, c.detail = "clear", msg[:200]
        else:
            c.verdict, c.detail = "unclear", f"{type(e).__name__}: {msg[:200]} (wanted {c.names})"
        return
    except Exception as e:  # noqa: BLE001 - the sweep records it
        c.verdict, c.detail = "unclear", f"{type(e).__name__}: {str(e)[:200]}"
        return
    ok = c.check is None or c.check()
    if c.expect == "work":
        c.verdict, c.detail = ("handled" if ok else "silent"), "ok"
    else:
        c.verdict, c.detail = "silent", "accepted"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write every case and its verdict as JSON here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hostile-") as d:
        tmp = Path(d)
        w = build_world(tmp / "world")
        (tmp / "conv").mkdir()
        cases = converter_cases(w, tmp / "conv")
        cases += loader_cases(w, tmp) + cli_cases(w, tmp) + planner_cases(w, tmp) + api_cases(w, tmp)
        protected = {p for c in cases for p in c.protect}
        before = {p: tree_hash(p) for p in protected}
        drv = [c for c in cases if c.cli is not None]
        (tmp / "cases.json").write_text(json.dumps([c.cli for c in drv]))
        r = subprocess.run([sys.executable, "-m", "tests.reliability_driver", str(tmp / "cases.json"),
                            str(tmp / "results.json")], cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        for c, res in zip(drv, json.loads((tmp / "results.json").read_text()), strict=True):
            classify_cli(c, res)
        for c in cases:
            if c.call is not None:
                run_api(c)
        changed = {p for p in protected if tree_hash(p) != before[p]}
        for c in cases:
            if any(p in changed for p in c.protect):
                c.verdict, c.detail = "lost", f"changed: {[str(p) for p in c.protect if p in changed]}"
    kinds = ("clear", "handled", "unclear", "silent", "lost")
    table = collections.defaultdict(collections.Counter)
    for c in cases:
        table[c.area][c.verdict] += 1
    print(f"{'area':<10} {'attempts':>8} " + " ".join(f"{k:>8}" for k in kinds))
    for area in ("converter", "loader", "cli", "planner", "api"):
        row = table[area]
        print(f"{area:<10} {sum(row.values()):>8} " + " ".join(f"{row[k]:>8}" for k in kinds))
    total = collections.Counter(c.verdict for c in cases)
    print(f"{'total':<10} {len(cases):>8} " + " ".join(f"{total[k]:>8}" for k in kinds))
    print(f"({time.perf_counter() - t0:.0f} s)")
    for c in cases:
        if c.verdict not in ("clear", "handled"):
            print(f"  [{c.verdict}] {c.area}: {c.label}: {c.detail}")
    if args.out:
        args.out.write_text(json.dumps([{"area": c.area, "label": c.label, "expect": c.expect,
                                         "verdict": c.verdict, "detail": c.detail} for c in cases], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
