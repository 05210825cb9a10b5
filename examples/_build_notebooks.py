"""Writes the example notebooks (examples/0*.ipynb) from the cell sources below, without outputs.

Run `python examples/_build_notebooks.py` after editing a cell here; never edit the .ipynb files by hand.
Every notebook runs on the CPU with the tiny model (tests/test_notebooks.py executes them) and uses a GPU
when one is present. Plots and tables are also written to $DSV3_NOTEBOOK_OUT (default: a temp folder).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import json, os, tempfile, time
from pathlib import Path

# Plots and tables are shown inline and also written here (the tests point this at a temp folder).
OUT = Path(os.environ.get("DSV3_NOTEBOOK_OUT") or Path(tempfile.gettempdir()) / "dsv3_notebooks")
OUT.mkdir(parents=True, exist_ok=True)
print("outputs ->", OUT)
"""


def _cells(*items: tuple[str, str]) -> list:
    out = []
    for kind, src in items:
        src = textwrap.dedent(src).strip("\n")
        out.append(new_markdown_cell(src) if kind == "md" else new_code_cell(src))
    return out


def md(s: str) -> tuple[str, str]:
    return ("md", s)


def code(s: str) -> tuple[str, str]:
    return ("code", s)


# ------------------------------------------------------------------------------------ 01 quickstart
QUICKSTART = _cells(
    md("""
    # 01 · Quickstart: the default model, then convert, load, chat, stream

    First the **embedded default model**: `dsv3_jax.load()` with no path returns a small DeepSeek-V3
    (MLA at the real widths, MoE with grouped sigmoid routing, a shared expert, the MTP layer, YaRN)
    trained for 5 minutes on the Python standard library, so it writes Python-looking code.
    Then the notebook builds a **tiny DeepSeek-V3-shaped checkpoint** (random weights, the real
    DeepSeek-V3.1 tokenizer), converts it with the project's converter exactly as you would convert the
    real Hugging Face checkpoint, loads it, chats with thinking off and on, and streams tokens into the
    cell. That model's text is gibberish (its weights are random); every mechanism is the real one.

    With the real model the only change is the path (and a mesh, see `03_meshes_and_memory.ipynb`):
    `python -m convert /hf/DeepSeek-V3.1 /ckpt/v3.1` once, then
    `dsv3_jax.load("/ckpt/v3.1", mesh="tensor=8")`.
    """),
    code(SETUP + """
import jax
import dsv3_jax

print("jax", jax.__version__, "devices:", jax.devices())
"""),
    md("""
    ## 0. The embedded default model

    `dsv3_jax.load()` (no path) expands the compact weights shipped in `dsv3_jax/default_model/` (see its
    README) into an ordinary DeepSeek-V3 parameter tree. `temperature=0` is greedy.
    """),
    code("""
default = dsv3_jax.load()
r = default.generate("import os", max_new_tokens=32, temperature=0)
print("import os" + r.text)
default_text = r.text
"""),
    md("""
    ## 1. A tiny Hugging Face checkpoint, then the converter

    `convert.synthetic.write_checkpoint` writes safetensors shards with the exact tensor names and
    shapes of a DeepSeek-V3 checkpoint for any config (here the `tiny` preset: 4 layers, 16 experts).
    `Tokenizer.default()` is DeepSeek-V3.1's tokenizer and chat template. The converter
    (`python -m convert SRC DST` on the command line) validates the source and writes an Orbax checkpoint.
    """),
    code("""
from convert.converter import convert
from convert.synthetic import write_checkpoint
from dsv3_jax.config import ModelConfig
from dsv3_jax.text.tokenizer import Tokenizer

work = Path(tempfile.mkdtemp(prefix="dsv3_quickstart_"))
hf_dir, ckpt_dir = work / "hf", work / "converted"
nbytes = write_checkpoint(hf_dir, ModelConfig.preset("tiny"), fp8=False, data="random", seed=0)
Tokenizer.default().save_to(hf_dir)
print(f"HF checkpoint: {nbytes / 1e6:.1f} MB in", sorted(p.name for p in hf_dir.iterdir()))

report = convert(hf_dir, ckpt_dir)  # with a progress bar; CLI: python -m convert <hf_dir> <ckpt_dir>
print(report.table())
"""),
    md("""
    ## 2. Load

    `dsv3_jax.load` reads the config, checks the memory plan, then loads the weights. The handle renders
    as a summary: config, parameter counts, dtype, attention form, kernels, mesh and weights per device.
    """),
    code("""
h = dsv3_jax.load(ckpt_dir)
h
"""),
    md("""
    ## 3. Chat, thinking off and on

    `h.chat` renders DeepSeek-V3.1's chat template; `thinking=True` opens the assistant turn with
    `<think>`. `temperature=0` is greedy; `ignore_eos=True` makes the random model write all
    `max_new_tokens` tokens.
    """),
    code("""
messages = [{"role": "user", "content": "What is a mixture of experts?"}]
replies = {}
for thinking in (False, True):
    r = h.chat(messages, thinking=thinking, max_new_tokens=12, temperature=0, ignore_eos=True)
    replies[thinking] = r
    prompt_tail = h.tokenizer.decode(r.prompt_token_ids[-3:])
    print(f"thinking={thinking}: prompt ends with {prompt_tail!r}")
    print(f"  reply ({len(r.token_ids)} tokens, {r.finish_reason}): {r.text!r}")
    print(f"  time to first token {r.time_to_first_token_s:.2f} s")
"""),
    md("""
    ## 4. Streaming into a cell

    `stream=True` returns an iterator of text pieces (the incremental detokenizer never splits a
    multi-byte character); print them as they come.
    """),
    code("""
pieces = []
for piece in h.generate("The capital of France is", max_new_tokens=12, temperature=0.7, seed=1,
                        stream=True, ignore_eos=True):
    pieces.append(piece)
    print(piece, end="", flush=True)
print()
streamed = "".join(pieces)
"""),
    md("""
    ## 5. Raw logits

    `h.forward(tokens)` returns float32 logits `[B, T, vocab]` for whole sequences (no cache).
    """),
    code("""
ids = h.tokenizer.encode("Hello world")
logits = h.forward([ids])
top1 = h.tokenizer.decode([int(logits[0, -1].argmax())])
print("tokens", ids, "-> logits", logits.shape, "top-1 next token:", repr(top1))

results = {"default_model_text": default_text,
           "chat_thinking_off": replies[False].text, "chat_thinking_on": replies[True].text,
           "stream": streamed, "n_pieces": len(pieces), "logits_shape": list(logits.shape),
           "repr_html": h._repr_html_()}
(OUT / "01_quickstart.json").write_text(json.dumps(results, indent=1))
"""),
)

# ----------------------------------------------------------------------------- 02 routing and experts
ROUTING = _cells(
    md("""
    # 02 · Routing and experts

    Which experts does each MoE layer pick, how balanced is the load, and what happens to the logits and
    the speed when a token uses fewer or more experts (`n_activated_experts`)? Also: attention entropy per
    head and the paged KV cache of a sequence. All from a handle, without editing the library:
    `h.router_stats(prompt)`, `h.attention_entropy(prompt)`, `h.cache_pages(prompt)`
    (implemented in `dsv3_jax/model/probes.py`).

    This runs on `tiny_default()`: the tiny preset (4 layers, 2 of them MoE with 16 experts in 4 groups,
    4 experts per token) with random weights, so routing is close to uniform and attention is nearly
    flat. Load a real checkpoint with `dsv3_jax.load(...)` and the same cells show the real picture.
    """),
    code(SETUP + """
import dataclasses

import matplotlib.pyplot as plt
import numpy as np

from dsv3_jax.api import tiny_default
from dsv3_jax.notebook import Table

h = tiny_default(seed=0)
h
"""),
    md("""
    ## 1. Router choices and the expert-load histogram

    `router_stats` runs one full forward pass and collects the expert ids every MoE layer chose for every
    token (moe.py sows them as `intermediates/router_choice`). `imbalance` is the busiest expert's load
    over the mean load (1.0 = perfectly balanced).
    """),
    code("""
PROMPT = ("Mixture-of-experts models send every token to a few experts chosen by a router, "
          "so only a small part of the network runs for each token.")
stats = h.router_stats(PROMPT)
print(f"{len(stats.token_ids)} tokens; choices {stats.choices.shape}: MoE layers x tokens x experts")
load_table = Table(stats.table(), title="expert load per MoE layer")
load_table.to_csv(OUT / "02_expert_load.csv")
load_table
"""),
    code("""
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
stats.plot(ax=axes[0])
width = 0.8 / len(stats.layers)
for i, layer in enumerate(stats.layers):
    axes[1].bar(np.arange(stats.n_experts) + i * width, stats.load[i], width=width, label=f"layer {layer}")
axes[1].axhline(stats.load.mean(), color="k", lw=0.8, ls="--", label="mean")
axes[1].set_xlabel("expert"); axes[1].set_ylabel("tokens routed"); axes[1].legend(fontsize=8)
axes[1].set_title("expert load per layer")
fig.tight_layout()
fig.savefig(OUT / "02_expert_load.png", dpi=100)
"""),
    code("""
# The experts of the first few tokens, per layer.
Table([{"token": repr(tok), **{f"layer {l}": " ".join(map(str, stats.choices[i, t]))
                                 for i, l in enumerate(stats.layers)}}
       for t, tok in enumerate(stats.tokens[:8])], title="router choices (first 8 tokens)")
"""),
    md("""
    ## 2. Attention entropy per head

    The block inputs are captured during a forward pass and the MLA scores recomputed from each layer's
    own weights. `recompute_error` compares the recomputed attention output with the model's own (it
    should be at rounding level). The maximum entropy for query *t* is log(t+1) (uniform attention).
    """),
    code("""
ent = h.attention_entropy(PROMPT)
print(f"entropy {ent.entropy.shape} = (layers, heads, queries); recompute error {ent.recompute_error:.1e}")
fig = ent.plot()
fig.savefig(OUT / "02_attention_entropy.png", dpi=100)
Table([{"layer": l, **{f"head {j}": round(float(ent.normalized[i, j]), 4) for j in range(ent.mean.shape[1])}}
       for i, l in enumerate(ent.layers)], title="mean entropy / maximum entropy")
"""),
    md("""
    ## 3. The cache pages of a sequence

    `cache_pages` prefills the prompt into a fresh paged cache (cache.py's layout: page 0 is scratch, a
    block table maps the sequence's logical pages to physical ones) and returns the sequence's own pages.
    In the absorbed form each token keeps `kv_lora_rank + rope` values per layer.
    """),
    code("""
pages = h.cache_pages(PROMPT, page_size=16)
print("block table", pages.block_table, "tokens per page", pages.page_fill())
print("layer 0 latents", pages.layer(0).shape)
Table(pages.table(), title=f"{pages.n_tokens} tokens in {pages.n_pages} pages ({pages.form} form)")
"""),
    md("""
    ## 4. `n_activated_experts`: logits and speed

    The number of routed experts per token is a load-time knob: `dsv3_jax.load(path, n_activated_experts=k)`.
    Here the same weights are re-wrapped with a different `num_experts_per_tok` (exactly what the knob
    sets). Compared with the trained value (4 for the tiny preset, 8 for DeepSeek-V3): the KL divergence of
    the next-token distributions, top-1 agreement, and the forward time (after compilation).
    """),
    code("""
def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

toks = np.asarray([h.tokenizer.encode(PROMPT)])
base_k = h.config.num_experts_per_tok
base = h.forward(toks)
rows = []
for k in (1, 2, 4, 8):
    hk = h if k == base_k else dataclasses.replace(h, config=h.config.replace(num_experts_per_tok=k))
    logits = hk.forward(toks)  # the first call compiles
    t0 = time.perf_counter()
    for _ in range(5):
        hk.forward(toks)
    ms = (time.perf_counter() - t0) / 5 * 1e3
    p, q = softmax(base), softmax(logits)
    rows.append({"k": k, "activated_params_M": round(hk.config.param_count(activated=True) / 1e6, 3),
                 "kl_vs_default": float((p * (np.log(p) - np.log(q))).sum(-1).mean()),
                 "top1_agreement": float((base.argmax(-1) == logits.argmax(-1)).mean()),
                 "max_abs_logit_diff": float(np.abs(base - logits).max()), "forward_ms": round(ms, 2)})
k_table = Table(rows, title=f"n_activated_experts vs the default k={base_k} ({toks.shape[1]} tokens)")
k_table.to_csv(OUT / "02_n_activated_experts.csv")
k_table
"""),
    code("""
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
ks = [r["k"] for r in rows]
a1.plot(ks, [r["kl_vs_default"] for r in rows], "o-"); a1.set_xscale("log", base=2)
a1.set_xlabel("experts per token"); a1.set_ylabel("KL(default || k)"); a1.set_title("effect on the logits")
a2.plot(ks, [r["forward_ms"] for r in rows], "o-"); a2.set_xscale("log", base=2)
a2.set_xlabel("experts per token"); a2.set_ylabel("ms per forward"); a2.set_title("forward time")
fig.tight_layout()
fig.savefig(OUT / "02_n_activated_experts.png", dpi=100)
(OUT / "02_routing.json").write_text(json.dumps({
    "load": stats.load.tolist(), "layers": stats.layers, "k_rows": rows,
    "entropy_shape": list(ent.entropy.shape), "recompute_error": ent.recompute_error,
    "page_fill": pages.page_fill()}, indent=1))
"""),
)

# ------------------------------------------------------------------------------ 03 meshes and memory
MESHES = _cells(
    md("""
    # 03 · Meshes and memory

    How the model is laid out on a device mesh (axes `data`, `tensor`, `expert`; the one table in
    `dsv3_jax/parallel/sharding.py`), shown on 8 virtual CPU devices, and the memory planner
    (`dsv3_jax/plan.py`, CLI `python -m dsv3_jax.plan`) for the full 671B DeepSeek-V3 on H200s:
    which meshes fit, how much KV cache is left, and how many requests fit at each context length.
    """),
    code("""
import os
# Eight virtual CPU devices for the layout demo (must be set before jax is imported; a GPU host keeps
# its GPUs as the default devices, the CPU ones are used only for this demo).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
""" + SETUP + """
import dataclasses

import jax
import matplotlib.pyplot as plt
import numpy as np

from dsv3_jax import plan
from dsv3_jax.parallel import sharding
from dsv3_jax.config import ModelConfig
from dsv3_jax.notebook import Table

cpus = jax.devices("cpu")
if len(cpus) < 8:
    raise RuntimeError("this notebook needs 8 virtual CPU devices: restart the kernel so XLA_FLAGS above "
                       "is set before jax is imported")
print(len(cpus), "CPU devices; default devices:", jax.devices())
"""),
    md("""
    ## 1. Where every parameter goes

    Each parameter has logical axes (`layout.PARAM_AXES`), mapped to mesh axes by `LOGICAL_RULES`: `tensor`
    splits heads, vocabulary and FFN widths; `expert` splits the routed experts (and is a batch axis
    outside the MoE); `data` splits only the batch. Below: the shard each device holds of a few tiny-model
    parameters under four meshes of 8 devices.
    """),
    code("""
print("LOGICAL_RULES:", {k: v for k, v in sharding.LOGICAL_RULES.items() if v is not None})
tiny = ModelConfig.preset("tiny")
shapes = plan.param_shapes(tiny, "fp32")
specs = sharding.param_specs(shapes)
MESHES = ["data=8", "data=2,tensor=4", "expert=8", "data=2,tensor=2,expert=2"]
NAMES = [("embed_tokens", "embedding"), ("moe_layers", "self_attn", "q_b_proj", "weight"),
         ("moe_layers", "self_attn", "kv_a_proj_with_mqa", "weight"), ("moe_layers", "mlp", "gate_weight"),
         ("moe_layers", "mlp", "gate_proj_weight"), ("dense_layers", "mlp", "down_proj", "weight")]

def leaf(tree, path):
    for k in path:
        tree = tree[k]
    return tree

rows = []
for path in NAMES:
    shape, spec = leaf(shapes, path).shape, leaf(specs, path)
    row = {"parameter": "/".join(path), "shape": str(tuple(shape)), "spec": str(tuple(spec))}
    for m in MESHES:
        row[m] = str(sharding.shard_shape(shape, spec, sharding.parse_mesh_spec(m)))
    rows.append(row)
layout = Table(rows, title="per-device shard shapes (tiny model)")
layout
"""),
    code("""
# Weight bytes per device for the whole tiny model, and a mesh the model refuses (4 heads, tensor=8).
mem_rows = []
for m in MESHES:
    total, per_dev, replicated = plan.tree_bytes_per_device(shapes, specs, sharding.parse_mesh_spec(m))
    mem_rows.append({"mesh": m, "total_MB": round(total / 1e6, 2), "per_device_MB": round(per_dev / 1e6, 2),
                     "replicated_MB": round(replicated / 1e6, 2)})
try:
    sharding.validate(tiny, sharding.parse_mesh_spec("tensor=8"))
except sharding.MeshError as e:
    print("refused:", e)
Table(mem_rows, title="tiny model weights per device")
"""),
    md("""
    ## 2. A model on a mesh

    Place the tiny model's parameters on a `data=2,tensor=2,expert=2` mesh of the CPU devices and run a
    forward pass: the MoE runs expert-parallel (tokens travel to their experts' devices) and the logits
    match the single-device run. `dsv3_jax.load(path, mesh="data=2,tensor=2,expert=2")` does the same for a
    checkpoint, reading only each device's slices.
    """),
    code("""
from dsv3_jax.api import tiny_default

h = tiny_default(seed=0)
mesh = sharding.make_mesh("data=2,tensor=2,expert=2", devices=cpus[:8])
shardings = sharding.param_shardings(h.config, mesh, h.params)
hm = dataclasses.replace(h, params=jax.device_put(h.params, shardings), mesh=mesh, param_shardings=shardings)
jax.debug.visualize_array_sharding(hm.params["embed_tokens"]["embedding"])  # vocab rows split over tensor
hm
"""),
    code("""
toks = np.asarray([h.tokenizer.encode("Meshes split the model over devices.")] * 2)
single, sharded = h.forward(toks), hm.forward(toks)
mesh_diff = float(np.abs(single - sharded).max())
print(f"logits {sharded.shape}; max |single-device - mesh| = {mesh_diff:.2e}")
"""),
    md("""
    ## 3. The 671B model on H200s (141 GB each)

    The planner counts every parameter's shard from the same tables the loader uses (abstract init:
    nothing is allocated), keeps 10% of device memory in reserve, and gives the rest to the absorbed MLA
    cache: 576 values x 2 bytes x 61 layers = 70,272 B per token. Sequences are batch-sharded over
    `data x expert`, so each batch shard holds whole sequences.
    """),
    code("""
v3 = ModelConfig.preset("deepseek-v3")
CASES = [("tensor=8", "fp8"), ("expert=8", "fp8"), ("tensor=8", "bf16"), ("tensor=2,expert=8", "bf16"),
         ("data=2,tensor=8", "fp8"), ("tensor=2,expert=8", "fp8")]
plans = {}
rows = []
for m, dt in CASES:
    p = plan.plan(v3, m, dtype=dt, max_seq_len=131072, device_memory="141GB")
    plans[(m, dt)] = p
    rows.append({"mesh": m, "devices": p.n_devices, "weights": dt,
                 "weights_per_device_GB": round(p.weight_bytes_per_device / 1e9, 1),
                 "replicated_GB": round(p.replicated_bytes_per_device / 1e9, 1),
                 "free_for_kv_GB": round(p.free_bytes_per_device / 1e9, 1),
                 "kv_tokens_per_device": p.tokens_per_device,
                 "128K_requests_total": p.requests_total, "fits": p.fits})
plan_table = Table(rows, title="DeepSeek-V3 (671B) on H200, 128K-token requests")
plan_table.to_csv(OUT / "03_plan.csv")
plan_table
"""),
    code("""
print(plans[("expert=8", "fp8")].summary())
print()
try:
    plans[("tensor=8", "bf16")].check()   # what load() raises before reading any weight
except plan.PlanError as e:
    print("PlanError:", str(e).splitlines()[0])
"""),
    md("""
    ## 4. KV capacity vs context length

    Concurrent requests the cache can hold (over the whole mesh) as the context grows, for the plans
    that fit. Longer contexts trade concurrency one-for-one; meshes with more batch shards (`expert`,
    `data`) hold more sequences because each device holds only its own sequences' cache.
    """),
    code("""
contexts = [2**i for i in range(12, 18)] + [v3.max_position_embeddings]
fig, ax = plt.subplots(figsize=(7, 4))
capacity = {}
for (m, dt), p in plans.items():
    if not p.fits:
        continue
    reqs = [dataclasses.replace(p, max_seq_len=c).requests_total for c in contexts]
    capacity[f"{m} {dt}"] = reqs
    ax.plot(contexts, reqs, "o-", label=f"{m} ({p.n_devices} GPUs, {dt})")
ax.set_xscale("log", base=2); ax.set_yscale("log")
ax.set_xlabel("context length (tokens)"); ax.set_ylabel("concurrent requests (whole mesh)")
ax.set_title("DeepSeek-V3 KV capacity on H200 (141 GB)"); ax.legend(fontsize=8); ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(OUT / "03_kv_capacity.png", dpi=100)
(OUT / "03_meshes.json").write_text(json.dumps({
    "layout_rows": len(layout), "mesh_logit_diff": mesh_diff, "plan_rows": rows,
    "contexts": contexts, "capacity": capacity}, indent=1))
"""),
)

# ------------------------------------------------------------------------------------------ 04 kernels
KERNELS = _cells(
    md("""
    # 04 · Kernels: reference vs Pallas

    `dsv3_jax/model/kernel_dispatch.py` is the one switch between the Pallas Mosaic GPU kernels
    (`pallas_kernels/`: paged MLA decode/prefill, FP8 block-scaled GEMMs) and their plain-`jnp`
    references; each call takes its `backend`. The model's comes from its `TraceOptions`
    (`dsv3_jax/model/trace_options.py`): `auto` picks Pallas on a Hopper GPU, and
    `dsv3_jax.load(kernels="reference" | "pallas")` or the env var DSV3_KERNELS chooses.

    On a GPU this notebook times both backends at DeepSeek-V3 shapes. Without one it times the references
    at small shapes and plots the H200 results recorded in `benchmarks/results/*.json`.
    """),
    code(SETUP + """
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from dsv3_jax.model import kernel_dispatch as kernels
from dsv3_jax.model.trace_options import TraceOptions
from dsv3_jax.notebook import Table
from pallas_kernels import fp8_quant

GPU = any(d.platform == "gpu" for d in jax.devices())
AUTO = TraceOptions.resolve("auto").kernels
print("devices:", jax.devices(), "| auto backend:", AUTO)
BACKENDS = ["reference", "pallas"] if AUTO == "pallas" else ["reference"]
"""),
    md("""
    ## 1. Timing both backends

    MLA decode (one new token per sequence attending over a paged latent cache of S tokens) and an FP8
    linear (activations quantized per token per 128 channels, e4m3 weights with 128x128 block scales).
    The median of a few calls after a compile; each backend is its own jitted function.
    """),
    code("""
def bench(fn, *args, reps=5):
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3

def mla_inputs(B, H, S, page=64):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    n = S // page
    pages = jax.random.normal(k1, (1 + B * n, page, 576), jnp.bfloat16)
    table = (1 + jnp.arange(B * n, dtype=jnp.int32)).reshape(B, n)
    q_lat = jax.random.normal(k2, (B, 1, H, 512), jnp.bfloat16)
    q_rope = jax.random.normal(k3, (B, 1, H, 64), jnp.bfloat16)
    start = jnp.full((B,), S - 1, jnp.int32)  # the new token is the S-th, its latent already cached
    return q_lat, q_rope, pages, table, start, jnp.ones((B,), jnp.int32)

def time_mla(backend, B, H, S):
    fn = jax.jit(lambda *a: kernels.mla_attention(*a, softmax_scale=0.1, backend=backend)[0])
    return bench(fn, *mla_inputs(B, H, S))

def time_fp8(backend, M, N, K):
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.random.normal(k1, (M, K), jnp.bfloat16)
    w, scale = fp8_quant.quantize_weight(0.02 * jax.random.normal(k2, (N, K), jnp.float32))
    return bench(jax.jit(lambda *a: kernels.fp8_linear(*a, backend=backend)), x, w, scale)

# DeepSeek-V3 shapes on a GPU; small ones on the CPU (the references only).
MLA_SHAPES = [(8, 128, 4096), (64, 128, 4096)] if GPU else [(2, 16, 256)]
FP8_SHAPES = [(64, 4096, 7168), (4096, 4096, 7168)] if GPU else [(64, 256, 512)]
timing = []
for B, H, S in MLA_SHAPES:
    for b in BACKENDS:
        timing.append({"kernel": "MLA decode", "shape": f"B={B} H={H} S={S}", "backend": b,
                       "ms": round(time_mla(b, B, H, S), 4)})
for M, N, K in FP8_SHAPES:
    for b in BACKENDS:
        timing.append({"kernel": "FP8 linear", "shape": f"M={M} N={N} K={K}", "backend": b,
                       "ms": round(time_fp8(b, M, N, K), 4)})
timing_table = Table(timing, title=f"measured here ({jax.devices()[0].device_kind})")
timing_table.to_csv(OUT / "04_timing.csv")
timing_table
"""),
    code("""
fig, ax = plt.subplots(figsize=(8, 3.2))
labels = [f"{r['kernel']}\\n{r['shape']}" for r in timing if r["backend"] == "reference"]
for i, b in enumerate(BACKENDS):
    ms = [r["ms"] for r in timing if r["backend"] == b]
    ax.bar(np.arange(len(ms)) + 0.4 * i, ms, width=0.4, label=b)
ax.set_xticks(np.arange(len(labels)) + 0.2 * (len(BACKENDS) - 1), labels, fontsize=8)
ax.set_ylabel("ms (median)"); ax.set_yscale("log"); ax.legend()
ax.set_title("reference vs Pallas, measured here")
fig.tight_layout()
fig.savefig(OUT / "04_timing.png", dpi=100)
"""),
    md("""
    ## 2. Recorded H200 results (`benchmarks/results/*.json`)

    Written by `benchmarks/mla_bench.py` and `benchmarks/moe_gemm_bench.py` on one H200 (see
    `benchmarks/RESULTS.md` for the commands and the discussion). MLA decode: the Pallas kernel vs the
    XLA reference over the same paged cache; MoE expert GEMMs at decode batch sizes: the Pallas FP8
    grouped GEMM vs `jax.lax.ragged_dot` (bf16) and torch's grouped GEMMs.
    """),
    code("""
ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "benchmarks" / "results").is_dir())
# Only the kernel benchmarks' files carry a "results" list; e2e_bench writes its own layout.
files = sorted(f for f in (ROOT / "benchmarks" / "results").glob("*.json")
               if f.name.startswith(("mla_bench", "moe_gemm_bench")))
print([f.name for f in files])
mla, moe = {}, []
for f in files:
    data = json.loads(f.read_text())
    for r in data["results"]:
        if f.name.startswith("mla_bench") and r.get("kind") == "decode":
            mla[(r["H"], r["B"], r["S"])] = r  # later files win for repeated shapes
        elif f.name.startswith("moe_gemm_bench"):
            moe.append(r)
mla_rows = [{"H": H, "B": B, "S": S, "pallas_ms": round(r["kernel"]["median_ms"], 4),
             "xla_ms": round(r["xla"]["median_ms"], 4), "pallas_TFLOPs": round(r["kernel"]["tflops"], 1),
             "speedup": round(r["xla"]["median_ms"] / r["kernel"]["median_ms"], 2)}
            for (H, B, S), r in sorted(mla.items())]
mla_table = Table(mla_rows, title="MLA decode on H200 (recorded)")
mla_table.to_csv(OUT / "04_mla_bench.csv")
mla_table
"""),
    code("""
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
for H, B in sorted({(r["H"], r["B"]) for r in mla_rows}):
    sel = [r for r in mla_rows if r["H"] == H and r["B"] == B]
    line, = a1.plot([r["S"] for r in sel], [r["pallas_ms"] for r in sel], "o-", label=f"Pallas H={H} B={B}")
    a1.plot([r["S"] for r in sel], [r["xla_ms"] for r in sel], "x--", color=line.get_color(), alpha=0.6)
a1.set_xscale("log", base=2); a1.set_yscale("log"); a1.set_xlabel("cached tokens S")
a1.set_ylabel("ms (solid: Pallas, dashed: XLA)"); a1.set_title("MLA decode"); a1.legend(fontsize=7)

decode = [r for r in moe if r["case"].startswith("decode gate_up")]
for v in sorted({r["variant"] for r in decode}):
    sel = sorted((int(r["case"].split("M=")[1]), r["ms"]) for r in decode if r["variant"] == v)
    a2.plot([m for m, _ in sel], [ms for _, ms in sel], "o-", label=v)
a2.set_xscale("log", base=2); a2.set_yscale("log"); a2.set_xlabel("routed rows M (token-expert pairs)")
a2.set_ylabel("ms"); a2.set_title("MoE gate_up grouped GEMM (decode)"); a2.legend(fontsize=7)
fig.tight_layout()
fig.savefig(OUT / "04_recorded.png", dpi=100)
(OUT / "04_kernels.json").write_text(json.dumps({"gpu": GPU, "backends": BACKENDS, "timing": timing,
                                                 "mla_rows": mla_rows, "moe_rows": len(moe)}, indent=1))
"""),
)

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_routing_and_experts.ipynb": ROUTING,
    "03_meshes_and_memory.ipynb": MESHES,
    "04_kernels.ipynb": KERNELS,
}


def build(out_dir: Path = HERE) -> list[Path]:
    """Write every notebook (no outputs) into out_dir; returns their paths."""
    paths = []
    for name, cells in NOTEBOOKS.items():
        for i, cell in enumerate(cells):
            cell["id"] = f"{name[:2]}-{i:02d}"  # stable ids: rebuilding an unchanged notebook is a no-op
        nb = new_notebook(cells=cells, metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"}})
        nbformat.validate(nb)
        path = out_dir / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print("wrote", p)
