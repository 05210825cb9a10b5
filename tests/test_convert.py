"""The converter end to end: HF shards -> converted checkpoint -> dsv3_jax.load, against transformers.

Round trips (Python API and CLI), the official FP8 layout (auto keeps e4m3, bf16 dequantizes), BF16 ->
FP8 quantization, MTP tensors, streaming with tiny chunk tiles, SIGKILL + --resume, peak RSS on a
synthetic multi-hundred-MB checkpoint and validation/planning of a sparse full-size 671B checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv3_jax
from convert.converter import JOURNAL, TEST_DELAY_ENV, convert, make_units, plan_leaves
from convert.synthetic import write_checkpoint
from convert.validate import ValidationError, inspect_source
from dsv3_jax.config import ModelConfig
from dsv3_jax.formats import checkpoint, fp8_blocks, orbax_io
from dsv3_jax.formats.checkpoint import COMPLETE_MARKER, CheckpointError
from dsv3_jax.formats.hf_names import expected_hf_tensors, hf_target
from dsv3_jax.formats.orbax_io import ChunkPolicy
from dsv3_jax.formats.safetensors_io import read_header, read_tensor, write_safetensors
from tests.hf_reference import HF_CONFIGS, hf_logits, make_hf_model, rel_err, save_hf

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
TOKENS = np.random.default_rng(1).integers(0, 384, size=(2, 24))


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "convert", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)


def leaves_of(dst: Path) -> dict[str, np.ndarray]:
    m = json.loads((dst / COMPLETE_MARKER).read_text())
    return {n: orbax_io.read_leaf(dst / "params", tuple(n.split("."))) for n in m["leaves"]}


def hf_shards(src: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update({n: read_tensor(t) for n, t in read_header(f)[0].items()})
    return out


def write_hf_dir(dst: Path, tensors: dict[str, np.ndarray], config: dict, n_shards: int = 3) -> Path:
    """An HF directory with `tensors` spread over `n_shards` shards and an index."""
    dst.mkdir(parents=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = names[i::n_shards]
        write_safetensors(dst / fname, {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The lora_yarn tiny model saved in 6 shards, plus tokenizer files to be copied."""
    model = make_hf_model("lora_yarn")
    src = save_hf(model, tmp_path_factory.mktemp("hf") / "src")
    from tokenizers import Tokenizer, models

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3}
    (src / "tokenizer.json").write_text(Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str())
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    (src / "tokenizer_config.json").write_text(json.dumps(specials))
    (src / "special_tokens_map.json").write_text(json.dumps(specials))
    return model, src, hf_logits(model, TOKENS)


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    _, src, _ = tiny
    dst = tmp_path_factory.mktemp("out") / "ckpt"
    report = convert(src, dst, progress=False)
    return dst, report


# ------------------------------------------------------------------------------------- round trips
def test_round_trip_python_api(tiny, converted):
    model, src, ref = tiny
    dst, report = converted
    ours = dsv3_jax.load(dst).forward(TOKENS)
    assert rel_err(ours, ref) <= TOL, rel_err(ours, ref)
    manifest = json.loads((dst / COMPLETE_MARKER).read_text())
    shards = sorted(src.glob("*.safetensors"))
    assert [f["name"] for f in manifest["source"]["files"]] == [f.name for f in shards]
    assert all(len(f["header_sha256"]) == 64 and f["size"] == (src / f["name"]).stat().st_size
               for f in manifest["source"]["files"])
    assert manifest["source"]["tensors"] == report.tensors == len(hf_shards(src))
    assert manifest["dtype"] == "float32" and manifest["converter_version"]
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()
    # transformers dropped the MTP layer: the output config says so instead of promising one.
    assert json.loads((dst / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert report.units_resumed == 0 and "dsv3-convert summary" in report.table()
    assert not list(dst.parent.glob(".*converting*"))


def test_round_trip_cli(tiny, converted, tmp_path):
    model, src, ref = tiny
    dst = tmp_path / "cli"
    r = run_cli(src, dst, "--workers", "3", "--report-json", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    assert "dsv3-convert summary" in r.stdout and "peak RSS" in r.stdout
    assert json.loads((tmp_path / "r.json").read_text())["tensors"] == len(hf_shards(src))
    ours = dsv3_jax.load(dst).forward(TOKENS)
    assert rel_err(ours, ref) <= TOL, rel_err(ours, ref)
    a, b = leaves_of(dst), leaves_of(converted[0])
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_loaded_onto_shardings_and_refused_when_incomplete(converted, tmp_path):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    dst, _ = converted
    cfg = ModelConfig.from_json(dst)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))
    shardings = {"moe_layers": {"mlp": {k: NamedSharding(mesh, PartitionSpec(None, "expert"))
                                        for k in ("gate_proj_weight", "up_proj_weight", "down_proj_weight")}}}
    replicated = NamedSharding(mesh, PartitionSpec())
    full = jax.tree_util.tree_map(lambda _: replicated, checkpoint.load_params(dst, cfg, dtype=jnp.float32))
    full["moe_layers"]["mlp"].update(shardings["moe_layers"]["mlp"])
    tree = checkpoint.load_params(dst, cfg, dtype=jnp.bfloat16, shardings=full)
    w = tree["moe_layers"]["mlp"]["gate_proj_weight"]
    assert w.dtype == jnp.bfloat16 and w.sharding.spec == PartitionSpec(None, "expert")
    assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape[1] == w.shape[1] // 4
    assert tree["moe_layers"]["mlp"]["e_score_correction_bias"].dtype == jnp.float32  # router bias stays
    partial = tmp_path / "partial"
    shutil.copytree(dst, partial)
    (partial / COMPLETE_MARKER).unlink()
    with pytest.raises(CheckpointError, match="incomplete converted checkpoint"):
        checkpoint.load_params(partial, cfg, dtype=jnp.float32)
    with pytest.raises(CheckpointError, match="no dsv3_manifest.json"):
        checkpoint.load_converted(partial, cfg, dtype=jnp.float32)


# ------------------------------------------------------------------------------------- FP8
def _fp8_model():
    """A tiny model whose dense MLP (320 wide) spans several 128-blocks with partial edge blocks."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(3)
    cfg = DeepseekV3Config(**{**HF_CONFIGS["lora_yarn"], "intermediate_size": 320, "q_lora_rank": 160},
                           bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model = DeepseekV3ForCausalLM(cfg).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.05 * torch.randn_like(mod.e_score_correction_bias))
    return model


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory):
    """The official FP8 layout (o_proj scales deliberately not UE8M0, like V3.1-Terminus) and the
    transformers model holding the dequantized weights (the reference)."""
    from transformers import DeepseekV3ForCausalLM

    base = tmp_path_factory.mktemp("fp8")
    hp = save_hf(_fp8_model(), base / "hp", shard_size="200KB")
    config = json.loads((hp / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(config)
    f8_names = {n for n, (_, dt) in expected_hf_tensors(cfg, fp8=True).items() if dt == "F8_E4M3"}
    tensors, deq = {}, {}
    for name, w in hf_shards(hp).items():
        deq[name] = w
        if name in f8_names:
            q, s = fp8_blocks.quantize(w, ue8m0="o_proj" not in name)
            tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = q, s
            deq[name] = fp8_blocks.dequantize(q, s, np.float32)
        else:
            tensors[name] = w
    qconfig = {**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}}
    src = write_hf_dir(base / "src", tensors, qconfig)
    ref_dir = write_hf_dir(base / "deq", deq, config, n_shards=1)
    reference = DeepseekV3ForCausalLM.from_pretrained(ref_dir).eval()
    return src, deq, hf_logits(reference, TOKENS)


def dequantized_forward(handle, tokens) -> np.ndarray:
    """Logits of `handle`'s model with every FP8 (weight, scale) pair dequantized to fp32 first: the
    exact function the e4m3 + scales encode, without the FP8 path's per-token activation quantization."""
    import jax

    from dsv3_jax.api import ModelHandle
    from dsv3_jax.model import kernel_dispatch as kernels

    def walk(node):
        out = {}
        for k, v in node.items():
            if isinstance(v, dict):
                out[k] = walk(v)
            elif v.dtype == jnp.float8_e4m3fn:
                sk = "scale" if k == "weight" else k[: -len("weight")] + "scale"
                out[k] = kernels.dequantize_weight(v, node[sk], jnp.float32)
            elif not (k == "scale" or (k.endswith("_scale") and k[: -len("scale")] + "weight" in node)):
                out[k] = v
        return out

    params = jax.tree_util.tree_map(jnp.asarray, walk(handle.params))
    return ModelHandle(handle.config.replace(dtype="float32"), params).forward(tokens)


def test_fp8_auto_stays_e4m3_and_matches_dequantized_reference(fp8_source, tmp_path):
    src, _, ref = fp8_source
    report = convert(src, tmp_path / "auto", progress=False)
    handle = dsv3_jax.load(tmp_path / "auto")
    mlp = handle.params["moe_layers"]["mlp"]
    assert handle.fp8 and mlp["gate_proj_weight"].dtype == jnp.float8_e4m3fn
    assert handle.params["dense_layers"]["mlp"]["up_proj"]["scale"].shape == (2, 3, 1)  # 320 rows: 3 blocks
    hf = hf_shards(src)  # e4m3 bytes and scales are carried over bit for bit
    assert np.array_equal(np.asarray(mlp["up_proj_weight"][1, 7]).view(np.uint8),
                          hf["model.layers.3.mlp.experts.7.up_proj.weight"].view(np.uint8))
    assert np.array_equal(np.asarray(handle.params["dense_layers"]["mlp"]["down_proj"]["scale"][0]),
                          hf["model.layers.0.mlp.down_proj.weight_scale_inv"])
    assert rel_err(dequantized_forward(handle, TOKENS), ref) <= TOL
    # The o_proj scales are not powers of two although config declares ue8m0: reported, by name.
    odd = json.loads((tmp_path / "auto" / COMPLETE_MARKER).read_text())["ue8m0_nonconformant_scales"]
    assert odd and all("self_attn.o_proj" in n for n in odd) and len(odd) == 4  # one per layer
    assert any("self_attn.o_proj" in n and "not powers of two" in n for n in report.notes)


def test_fp8_to_bf16_dequantizes(fp8_source, tmp_path):
    src, deq, _ = fp8_source
    r = run_cli(src, tmp_path / "bf16", "--dtype", "bf16", "--quiet")
    assert r.returncode == 0, r.stderr
    cfg_out = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in cfg_out and cfg_out["torch_dtype"] == "bfloat16"
    leaves = leaves_of(tmp_path / "bf16")
    w = leaves["dense_layers.mlp.up_proj.weight"]
    assert w.dtype == ml_dtypes.bfloat16
    want = np.stack([deq[f"model.layers.{i}.mlp.up_proj.weight"] for i in range(2)])
    want = want.astype(ml_dtypes.bfloat16)
    assert np.array_equal(w, want)  # exactly the dequantized weight, rounded once to bf16
    # Reference: transformers holding the dequantized weights as stored (rounded once to bf16; the
    # router bias stays fp32). Our fp32 forward over the bf16 checkpoint must match it to 1e-4.
    from transformers import DeepseekV3ForCausalLM

    rounded = {n: w if n.endswith("e_score_correction_bias") else
               w.astype(ml_dtypes.bfloat16).astype(np.float32) for n, w in deq.items()}
    config = json.loads((src.parent / "hp" / "config.json").read_text())
    ref_dir = write_hf_dir(tmp_path / "ref", rounded, config, n_shards=1)
    ref = hf_logits(DeepseekV3ForCausalLM.from_pretrained(ref_dir).eval(), TOKENS)
    ours = dsv3_jax.load(tmp_path / "bf16", dtype="float32").forward(TOKENS)
    assert rel_err(ours, ref) <= TOL, rel_err(ours, ref)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_bf16_source_to_fp8(tiny, tmp_path, ue8m0):
    model, src, ref = tiny
    convert(src, tmp_path / "q", dtype="fp8", ue8m0=ue8m0, progress=False)
    cfg_out = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg_out["quantization_config"]["weight_block_size"] == [128, 128]
    assert (cfg_out["quantization_config"].get("scale_fmt") == "ue8m0") == ue8m0
    leaves, hf = leaves_of(tmp_path / "q"), hf_shards(src)
    q, s = leaves["moe_layers.mlp.down_proj_weight"], leaves["moe_layers.mlp.down_proj_scale"]
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (2, 16, 1, 1)
    if ue8m0:
        assert fp8_blocks.is_power_of_two(s).all()
    # Every weight within e4m3's rounding: 3 mantissa bits (rel. 2^-4) or half a subnormal step.
    w = hf["model.layers.3.mlp.experts.5.down_proj.weight"]
    err = np.abs(fp8_blocks.dequantize(q[1, 5], s[1, 5], np.float32) - w)
    assert (err <= np.maximum(np.abs(w) * 2.0**-4, s[1, 5, 0, 0] * 2.0**-10) + 1e-12).all()
    # Logits of the FP8 model (e4m3 weights and per-token e4m3 activations) against the fp32 model.
    # Tolerance 0.35 (measured 0.22 plain, 0.23 UE8M0): e4m3 keeps 3 mantissa bits (<= 6% per value)
    # and this tiny random model is chaotic: its near-uniform router flips top-k experts under such
    # noise (bf16 rounding alone moves its logits by 5%). The per-weight bound above is the exact check.
    handle = dsv3_jax.load(tmp_path / "q")
    assert handle.fp8
    ours = handle.forward(TOKENS)
    assert rel_err(ours, ref) <= 0.35, rel_err(ours, ref)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.5


# ------------------------------------------------------------------------------------- MTP
def test_mtp_weights_survive(tiny, tmp_path):
    _, src, _ = tiny
    cfg = ModelConfig.from_json(src)
    mtp_src = tmp_path / "src"
    shutil.copytree(src, mtp_src)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    rng = np.random.default_rng(7)
    mtp = {n: (0.05 * rng.standard_normal(shape)).astype(np.float32)
           for n, (shape, _) in expected_hf_tensors(cfg).items() if n.startswith(prefix)}
    write_safetensors(mtp_src / "model-mtp.safetensors", mtp)
    index = json.loads((mtp_src / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "model-mtp.safetensors" for n in mtp})
    (mtp_src / "model.safetensors.index.json").write_text(json.dumps(index))

    convert(mtp_src, tmp_path / "dst", progress=False)
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tree = checkpoint.load_params(tmp_path / "dst", cfg, dtype=jnp.float32)
    for name, w in mtp.items():
        t = hf_target(name, cfg)
        leaf = tree
        for k in t.path:
            leaf = leaf[k]
        assert np.array_equal(np.asarray(leaf)[t.index], w), name
    convert(mtp_src, tmp_path / "nomtp", include_mtp=False, progress=False)
    assert not any(k.startswith("mtp.") for k in leaves_of(tmp_path / "nomtp"))
    assert json.loads((tmp_path / "nomtp" / "config.json").read_text())["num_nextn_predict_layers"] == 0


# ------------------------------------------------------------------------------------- streaming
def test_tiled_streaming_equals_whole_slab(fp8_source, tiny, converted, tmp_path):
    """Tiny tiles (128x128, 2 KB slabs) force the row-slab path; the content must not change."""
    policy = ChunkPolicy(small_bytes=2048, rows=128, cols=128)
    src, _, _ = fp8_source
    convert(src, tmp_path / "a", dtype="bf16", progress=False)
    convert(src, tmp_path / "b", dtype="bf16", policy=policy, workers=3, progress=False)
    convert(tiny[1], tmp_path / "c", dtype="fp8", policy=policy, progress=False)
    convert(tiny[1], tmp_path / "d", dtype="fp8", progress=False)
    convert(src, tmp_path / "e", dtype="auto", policy=policy, progress=False)  # e4m3 rows copied as is
    convert(src, tmp_path / "f", dtype="auto", progress=False)
    m = json.loads((tmp_path / "b" / COMPLETE_MARKER).read_text())["leaves"]
    assert m["dense_layers.mlp.up_proj.weight"][2] == [1, 128, 64]  # tiled, not one slab
    for x, y in (("a", "b"), ("c", "d"), ("e", "f")):
        a, b = leaves_of(tmp_path / x), leaves_of(tmp_path / y)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float32])
def test_chunk_files_read_back_through_tensorstore(tmp_path, dtype):
    """Chunks written by ChunkFiles (row slabs, tiles, padded edge chunks) are what tensorstore reads."""
    rng = np.random.default_rng(0)
    shape, chunks = (2, 3, 300, 200), (1, 1, 128, 128)  # 300 and 200 leave padded edge chunks
    full = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    orbax_io.open_leaf(tmp_path, ("w",), shape, np.dtype(dtype), chunks)
    files = orbax_io.ChunkFiles(tmp_path, ("w",), shape, np.dtype(dtype), chunks)
    for layer in range(2):
        for e in range(3):
            for r0 in range(0, 300, 128):
                files.write((layer, e, r0, 0), full[layer:layer + 1, e:e + 1, r0:r0 + 128])
    back = orbax_io.read_leaf(tmp_path, ("w",))
    assert back.dtype == np.dtype(dtype) and np.array_equal(back.view(np.uint8), full.view(np.uint8))
    # A region that is not made of whole chunks would need a read-modify-write: refused, naming the leaf.
    with pytest.raises(ValueError, match="w: rows \\[64, 192\\) of axis 2"):
        files.write((0, 0, 64, 0), full[:1, :1, 64:192])
    with pytest.raises(ValueError, match="does not fit"):
        files.write((0, 0, 0, 0), full[:1, :1, :128].astype(np.float16))


@pytest.mark.parametrize("sendfile_works", [True, False])
def test_chunk_files_copy_rows_from_a_file(tmp_path, monkeypatch, caplog, sendfile_works):
    """Full-width row chunks are copied file to file (edge chunk zero-extended); without os.sendfile
    the copy falls back to a buffered one and says so in the log."""
    rng = np.random.default_rng(1)
    shape, chunks = (2, 300, 96), (1, 128, 96)
    full = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    src = tmp_path / "src.bin"
    src.write_bytes(b"header!" + full.tobytes())
    monkeypatch.setattr(orbax_io, "_SENDFILE_WORKS", True)
    if not sendfile_works:
        def broken(*a):
            raise OSError(22, "Invalid argument")
        monkeypatch.setattr(os, "sendfile", broken)
    orbax_io.open_leaf(tmp_path, ("w",), shape, full.dtype, chunks)
    files = orbax_io.ChunkFiles(tmp_path, ("w",), shape, full.dtype, chunks)
    with caplog.at_level("WARNING", logger="dsv3_jax.formats.orbax_io"):
        for layer in range(2):
            files.copy_rows((layer, 0, 0), src, 7 + layer * full[0].nbytes, 300)
    assert np.array_equal(orbax_io.read_leaf(tmp_path, ("w",)).view(np.uint8), full.view(np.uint8))
    assert ("os.sendfile" in caplog.text) == (not sendfile_works)
    assert (tmp_path / "w" / "0.2.0").stat().st_size == 128 * 96 * 2  # edge chunk stored whole
    with pytest.raises(ValueError, match="not whole chunks"):
        files.copy_rows((0, 64, 0), src, 7, 128)
    tiles = orbax_io.ChunkFiles(tmp_path, ("w",), shape, full.dtype, (1, 128, 64))
    with pytest.raises(ValueError, match="do not hold whole rows"):
        tiles.copy_rows((0, 0, 0), src, 7, 300)


# ------------------------------------------------------------------------------------- resume
def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_sigkill_then_resume_gives_identical_checkpoint(tiny, converted, tmp_path):
    _, src, _ = tiny
    dst = tmp_path / "dst"
    tmp = tmp_path / ".dst.converting"
    cmd = [sys.executable, "-m", "convert", str(src), str(dst), "--workers", "1", "--quiet"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, TEST_DELAY_ENV: "0.05"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if (tmp / JOURNAL).exists() and len((tmp / JOURNAL).read_text().splitlines()) >= 10:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"conversion ended (rc {proc.returncode}): {proc.stderr.read()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dst.exists() and tmp.is_dir()
    cfg = ModelConfig.from_json(src)
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.load_params(tmp, cfg, dtype=jnp.float32)
    with pytest.raises(FileNotFoundError):
        dsv3_jax.load(dst)
    r = run_cli(src, dst, "--quiet")  # refuses to silently restart
    assert r.returncode == 2 and "--resume" in r.stderr and not dst.exists()
    r = run_cli(src, dst, "--resume", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "already done, resumed" in r.stdout and not tmp.exists()
    a, b = _files(dst), _files(converted[0])
    ma, mb = (json.loads(x.pop(COMPLETE_MARKER)) for x in (a, b))
    assert a == b  # every chunk, the Orbax metadata, config and tokenizer files, byte for byte
    for m in (ma, mb):
        m.pop("created")
        m["source"].pop("path")
    assert ma == mb


def test_force_replaces_only_when_complete(tiny, converted, tmp_path):
    _, src, _ = tiny
    dst = tmp_path / "dst"
    shutil.copytree(converted[0], dst)
    (dst / "marker").write_text("old")
    convert(src, dst, force=True, progress=False)
    assert not (dst / "marker").exists() and (dst / COMPLETE_MARKER).exists()


# ------------------------------------------------------------------------------------- memory / scale
def _synthetic_cfg(n_experts: int, n_moe: int) -> ModelConfig:
    """DeepSeek-V3 widths (7168 hidden, 128 heads, 18432 dense MLP) with fewer experts/layers/vocab."""
    return ModelConfig(vocab_size=8192, num_hidden_layers=1 + n_moe, first_k_dense_replace=1,
                       n_routed_experts=n_experts, moe_intermediate_size=256, n_group=8, topk_group=4,
                       num_nextn_predict_layers=0)


def _rss_run(tmp_path: Path, n_experts: int, n_moe: int) -> tuple[dict, int]:
    cfg = _synthetic_cfg(n_experts, n_moe)
    size = write_checkpoint(tmp_path / "src", cfg, fp8=True, data="sparse", shard_bytes=1 << 30)
    r = run_cli(tmp_path / "src", tmp_path / "dst", "--quiet", "--report-json", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    largest = max(t.nbytes for t in inspect_source(tmp_path / "src").tensors.values())
    shutil.rmtree(tmp_path / "dst")
    return json.loads((tmp_path / "r.json").read_text()) | {"size": size}, largest


def test_peak_rss_bounded_by_tensors_not_checkpoint(tmp_path):
    report, largest = _rss_run(tmp_path, n_experts=64, n_moe=1)  # ~0.75 GB, 7168-wide tensors
    grew = report["peak_rss"] - report["baseline_rss"]
    # Four workers, each with one read buffer (a row slab, <= 2048 rows) and one chunk scratch buffer:
    # well under 3x the largest tensor.
    assert grew <= 3 * largest, (grew, largest)
    assert report["size"] > 5 * largest


@pytest.mark.slow
def test_peak_rss_independent_of_size(tmp_path):
    small, largest = _rss_run(tmp_path / "s", n_experts=64, n_moe=1)
    big, _ = _rss_run(tmp_path / "b", n_experts=256, n_moe=2)  # ~3.5 GB: 256 experts per layer
    assert big["size"] > 2.5 * small["size"]
    grew_small, grew_big = (r["peak_rss"] - r["baseline_rss"] for r in (small, big))
    assert grew_big <= 3 * largest and grew_big <= grew_small + 64 * 2**20, (grew_small, grew_big)


def test_full_size_sparse_checkpoint_validates_and_plans(tmp_path):
    """The real 671B FP8 layout (157 shards, 91,992 tensors, 688 GB apparent, ~20 MB on disk)."""
    src = tmp_path / "full"
    write_checkpoint(src, ModelConfig(), fp8=True, data="sparse", shard_bytes=4_400_000_000)
    source = inspect_source(src)
    assert len(source.tensors) == 91_992 and source.has_mtp
    units = make_units(source, plan_leaves(source, "auto", ChunkPolicy()))
    assert len({u.leaf.path for u in units}) == 55
    experts = [u for u in units if u.leaf.path == ("moe_layers", "mlp", "gate_proj_weight")]
    assert len(experts) == 58 and experts[0].leaf.shape == (58, 256, 2048, 7168)
    assert experts[0].leaf.chunks == (1, 1, 2048, 7168) and not experts[0].leaf.whole  # whole rows
    shard = sorted(src.glob("*.safetensors"))[77]
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(ValidationError, match=f"{shard.name}: truncated"):
        convert(src, tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists() and not (tmp_path / ".dst.converting").exists()
