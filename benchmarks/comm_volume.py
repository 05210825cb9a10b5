"""Communication volume per step per device: DeepSeek-V3 (671B) on 8 and 16 devices, counted two ways.

1. `count(...)`: closed form from the layout (sharding.py's table, moe.py's collectives): which
   collective each layer issues, on how many bytes, over how many devices.
2. `hlo_count(...)`: the collectives XLA really emits. The full-width model is lowered with abstract
   parameters (no memory) on virtual CPU devices and compiled; every all-gather, reduce-scatter,
   all-reduce, all-to-all and collective-permute of the *partitioned* module is summed, scan loops
   multiplied by their trip counts. "Partitioned" is the module after SPMD partitioning and XLA's
   platform-independent passes, captured just before the CPU back end's own passes: the CPU runtime has
   no bf16 collectives, so its `all-reduce-promotion` and `float-normalization-bf16` passes rewrite every
   bf16 collective to fp32 (the 2x "fp32 on the wire" this report showed on 2026-12-03). A GPU build keeps
   them bf16 (XLA's GpuFloatSupport accepts bf16 all-reduce, reduce-scatter, all-gather and all-to-all;
   NCCL reduces bf16). The CPU's final program is counted too (`hlo_cpu`), to show that difference.
Both use one convention, bytes *sent* by one device with ring/pairwise algorithms over a group of g
devices: all-gather (g-1)/g x result, reduce-scatter (g-1)/g x operand, all-reduce 2(g-1)/g x size,
all-to-all (g-1)/g x buffer. Activations are bf16 (D = 7168: 14,336 B per token), routing weights and
ids 4 B each; the step's logits stay vocabulary-sharded (sampling's gather is listed on its own).
"DeepEP-style minimum": each token sent once per chosen expert and its output returned once, bf16 both
ways, local copies free: 2 x (g-1)/g x tokens x k x D x 2 per MoE layer (g = the expert group; for
`tensor=8`, which has no expert group, g = 8 and tokens = all the step's tokens, what an EP=8 layout
would send for them).

    python benchmarks/comm_volume.py                 # table + benchmarks/results/comm_volume.json
    python benchmarks/comm_volume.py --no-hlo        # closed form only (seconds instead of minutes)

Must not change model or sharding code: it only reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

N_DEVICES = 16  # virtual CPU devices: enough for every layout below; must be set before jax is imported
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N_DEVICES}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv3_jax.config import ModelConfig  # noqa: E402
from dsv3_jax.model import moe  # noqa: E402
from dsv3_jax.model.trace_options import TraceOptions  # noqa: E402
from dsv3_jax.parallel import sharding  # noqa: E402

ACT = 2  # bf16 activations
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
OPTIONS = TraceOptions()  # the default MoE dispatch ("auto") and capacity factor the compiled model uses

# (mesh, devices). 8: TP=8 and EP=8 with DP attention (FP8 weights fit one host either way); 16: the
# two-host BF16 layout (`tensor=2,expert=8`: 103.6 GB of weights per device, launch/README.md; `data=2`
# layouts replicate the weights and do not fit BF16), EP=8 with DP attention over two hosts (FP8), and
# EP=16. Decode: B tokens per batch shard (one per sequence); prefill: a 4K chunk per shard (above
# TraceOptions.all_gather_max_tokens per expert group, so the all-to-all path).
LAYOUTS = [
    ("tensor=8", 8), ("expert=8", 8),
    ("tensor=2,expert=8", 16), ("data=2,expert=8", 16), ("expert=16", 16),
]
DECODE_TOKENS = (1, 64)  # per batch shard
PREFILL_TOKENS = 4096


# ------------------------------------------------------------------------------------- closed form
def _ag(g: int, result: float) -> float:
    return (g - 1) / g * result


def _ar(g: int, size: float) -> float:
    return 2 * (g - 1) / g * size


def count(cfg: ModelConfig, sizes: dict[str, int], tokens: int, *, act: int = ACT,
          options: TraceOptions = OPTIONS) -> dict[str, float]:
    """Bytes one device sends per step, by collective kind, for `tokens` tokens per batch shard.

    `act`: bytes per activation value on the wire (2: bf16, what the partitioned program sends).
    """
    t, ep = sizes["tensor"], sizes["expert"]
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    row = tokens * d * act  # one device's [tokens, D] activations
    out: dict[str, float] = defaultdict(float)
    n_dense, n_moe = cfg.n_dense_layers, cfg.n_moe_layers
    if t > 1:
        # Vocabulary-parallel embedding; per layer the o_proj all-reduce (heads split) and the MLP's
        # (dense FFN width; in MoE layers one psum over tensor of the routed and shared experts' partial
        # sums together, moe.py).
        out["all-reduce"] += _ar(t, row) * (1 + 2 * n_dense + 2 * n_moe)
    if ep > 1:
        if moe.choose_dispatch(tokens * ep, options) == "all_gather":
            # Gather the group's tokens (+ routing weights and ids), reduce-scatter the partial outputs.
            out["all-gather"] += n_moe * _ag(ep, ep * (row + tokens * k * 8))
            out["reduce-scatter"] += n_moe * _ag(ep, ep * row)
        else:
            cap, worst = moe.a2a_capacity(tokens, ep, moe.max_destinations(cfg, ep), options.capacity_factor)
            buf = ep * cap  # C rows per destination, padded: sent whether filled or not
            # There: tokens + their local ids and weights (k x 4 B each); back: one partial sum per row.
            out["all-to-all"] += n_moe * _ag(ep, buf * (2 * d * act + k * 8))
            if cap < worst:  # the overflow check: a scalar pmax over the batch shards
                out["all-reduce"] += n_moe * _ar(ep * sizes["data"], 4)
    return dict(out)


def deepep_min(cfg: ModelConfig, sizes: dict[str, int], tokens: int) -> float:
    """The DeepEP-style minimum one device sends per step (module docstring): bf16 dispatch of each
    (token, expert) pair and bf16 combine, over the expert group (over `tensor` for a pure TP layout)."""
    g = sizes["expert"] if sizes["expert"] > 1 else sizes["tensor"]
    if g == 1:
        return 0.0
    step_tokens = tokens if sizes["expert"] > 1 else tokens * sizes["data"]
    return cfg.n_moe_layers * 2 * _ag(g, step_tokens * cfg.num_experts_per_tok * cfg.hidden_size * ACT)


def deepep_style(cfg: ModelConfig, sizes: dict[str, int], tokens: int) -> float:
    """What one device would send per step with DeepEP's low-latency format (FP8 tokens + a fp32 scale
    per 128 values, each (token, expert) pair once, no capacity padding) and BF16 combine; 0 without EP."""
    ep = sizes["expert"]
    if ep == 1:
        return 0.0
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    per_pair = (d + d // 128 * 4) + 2 * d
    return cfg.n_moe_layers * _ag(ep, tokens * k * per_pair)


def sampling_gather(cfg: ModelConfig, sizes: dict[str, int], rows: int) -> float:
    """All-gather of the sampled rows' fp32 logits over `tensor` (vocabulary-parallel LM head)."""
    t = sizes["tensor"]
    return _ag(t, rows * cfg.vocab_size * 4) if t > 1 else 0.0


# ------------------------------------------------------------------------------------------- HLO
_OP = re.compile(r"=\s*(?P<shape>\([^)]*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(?P<kind>all-gather|reduce-scatter|all-reduce|"
                 r"all-to-all|collective-permute)(?:-start)?\((?P<args>.*)$")
_ARR = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _nbytes(shape_text: str) -> int:
    total = 0
    for dt, dims in _ARR.findall(shape_text):
        total += _BYTES.get(dt, 4) * math.prod(int(x) for x in dims.split(",") if x)
    return total


def _group(line: str, n: int) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # mesh['a'=2,'b'=4] {'b'}
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=([0-9]+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9]+),([0-9]+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"source_target_pairs=", line)
    return 2 if m else n


def _trips_from_condition(lines: list[str]) -> int:
    """A scan's trip count from its loop condition (`i < N`, N an s32 constant): the partitioned module
    is captured before XLA annotates known trip counts. 1 when the condition is not of that form."""
    consts = [int(m.group(1)) for ln in lines for m in [re.search(r"= s32\[\] constant\(([0-9]+)\)", ln)] if m]
    lt = any("direction=LT" in ln for ln in lines)
    return consts[0] if lt and len(consts) == 1 else 1


def parse_hlo(text: str, n_devices: int) -> dict[str, float]:
    """Bytes sent per device by kind, over the whole module: computations reached through while loops
    count trip-count times; of a conditional's branches the one with the most bytes counts (the
    all-to-all path over its all-gather fallback)."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif cur is not None:
            comps[cur].append(line)

    def own(lines: list[str]) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for line in lines:
            m = _OP.search(line)
            if not m or "-done" in line.split("=")[1][:40]:
                continue
            kind, g = m.group("kind"), _group(line, n_devices)
            res = _nbytes(m.group("shape"))
            if kind == "all-gather":
                out[kind] += _ag(g, res)
            elif kind == "reduce-scatter":
                out[kind] += _ag(g, res * g)
            elif kind == "all-reduce":
                out[kind] += _ar(g, res)
            elif kind == "all-to-all":
                out[kind] += _ag(g, res)
            else:
                out[kind] += res
        return out

    memo: dict[str, dict[str, float]] = {}

    def total(name: str) -> dict[str, float]:
        if name in memo:
            return memo[name]
        memo[name] = {}
        acc = defaultdict(float, own(comps.get(name, [])))
        for line in comps.get(name, []):
            w = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
            if w:
                n = re.search(r'"known_trip_count":\{"n":"([0-9]+)"', line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                trips = int(n.group(1)) if n else _trips_from_condition(comps.get(cond.group(1), []) if cond
                                                                        else [])
                for kk, v in total(w.group(1)).items():
                    acc[kk] += trips * v
                continue
            br = re.search(r"branch_computations=\{([^}]*)\}", line) or \
                re.search(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", line)
            if br:
                names = [x.strip().lstrip("%") for x in ",".join(br.groups()).split(",") if x.strip()]
                best = max((total(b) for b in names), key=lambda x: (x.get("all-to-all", 0), sum(x.values())),
                           default={})
                for kk, v in best.items():
                    acc[kk] += v
                continue
            for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
                for kk, v in total(callee).items():
                    acc[kk] += v
        memo[name] = dict(acc)
        return memo[name]

    return total(entry) if entry else {}


PARTITIONED_PASS = "all-reduce-promotion"  # the CPU back end's first pass on the partitioned module


def compile_partitioned(fn, args, mesh) -> tuple[str, str]:
    """(partitioned module text, final CPU module text) of `fn` lowered on `args` under `mesh`: the
    module XLA dumps just before the CPU back end's `all-reduce-promotion` (see the module docstring)."""
    with tempfile.TemporaryDirectory() as dump, jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile(compiler_options={
            "xla_dump_to": dump, "xla_dump_hlo_pass_re": PARTITIONED_PASS})
        files = sorted(Path(dump).glob(f"*before_{PARTITIONED_PASS}.txt"))
        if not files:
            raise RuntimeError(f"XLA dumped no module before {PARTITIONED_PASS!r}: the CPU pipeline changed; "
                               f"pick the pass that now follows SPMD partitioning")
        return files[-1].read_text(), compiled.as_text()


def hlo_count(cfg: ModelConfig, spec: str, tokens: int, n_devices: int,
              options: TraceOptions = OPTIONS) -> tuple[dict[str, float], dict[str, float], float]:
    """Compile one step's forward (`tokens` per batch shard, one new token per sequence at decode) on
    `spec` with abstract full-width bf16 parameters; return (bytes per device by kind in the partitioned
    module, the same in the CPU's final module, compile seconds)."""
    from dsv3_jax import plan
    from dsv3_jax.model.transformer import Transformer

    mesh = sharding.make_mesh(spec, jax.devices()[:n_devices])
    shapes = plan.param_shapes(cfg, "bf16", include_mtp=False)
    p_sh = sharding.param_shardings(cfg, mesh, shapes)
    shards = sharding.batch_multiple(mesh)
    decode = tokens <= max(DECODE_TOKENS)
    b, t = (shards * tokens, 1) if decode else (shards, tokens)
    tok_sh = sharding.activation_sharding(mesh, "tokens")
    model = Transformer(cfg, jnp.bfloat16, False, trace_options=options)
    fn = jax.jit(lambda p, x: model.apply({"params": p}, x)[0], in_shardings=(p_sh, tok_sh),
                 out_shardings=sharding.activation_sharding(mesh, "logits"))
    args = (jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, p_sh),
            jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=tok_sh))
    t0 = time.perf_counter()
    partitioned, final = compile_partitioned(fn, args, mesh)
    return parse_hlo(partitioned, n_devices), parse_hlo(final, n_devices), time.perf_counter() - t0


# --------------------------------------------------------------------------------------- published
# DeepEP V1 (docs/legacy.md of deepseek-ai/DeepEP): H800, DeepSeek-V3 settings, FP8 dispatch, BF16 combine.
DEEPEP = {
    "low_latency": "128 tokens/rank, hidden 7168, top-8: EP8 dispatch 77 us (98 GB/s RDMA), combine 114 us "
                   "(127 GB/s); EP16 dispatch 118 us (63 GB/s), combine 195 us (74 GB/s)",
    "normal": "4096 tokens/batch: intranode EP8 dispatch 153 GB/s, combine 158 GB/s (NVLink); "
              "internode EP16 43 / 43 GB/s (RDMA)",
}


def deepep_low_latency_bytes(cfg: ModelConfig, tokens: int) -> dict[str, float]:
    """Bytes one rank sends in DeepEP's low-latency kernels: each token to each of its k experts (FP8
    payload + one fp32 scale per 128 values on dispatch, BF16 on combine), local copies included."""
    d, k = cfg.hidden_size, cfg.num_experts_per_tok
    return {"dispatch": tokens * k * (d + d // 128 * 4), "combine": tokens * k * d * 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-hlo", action="store_true", help="closed form only")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "comm_volume.json"))
    a = ap.parse_args(argv)
    cfg = ModelConfig.preset("deepseek-v3").replace(num_nextn_predict_layers=0)
    rows = []
    print(f"{'mesh':>18} {'dev':>3} {'phase':>7} {'tok/shard':>9} | {'HLO MB':>10} {'count MB':>10} {'ratio':>6} | "
          f"{'min MB':>10} {'HLO/min':>7} | {'CPU HLO MB':>10} | {'sampling MB':>11}")
    for spec, n in LAYOUTS:
        sizes = sharding.resolve_sizes(spec, n)
        for phase, toks in [("decode", b) for b in DECODE_TOKENS] + [("prefill", PREFILL_TOKENS)]:
            c = count(cfg, sizes, toks)
            r = {"mesh": spec, "devices": n, "phase": phase, "tokens_per_shard": toks, "count": c,
                 "deepep_min": deepep_min(cfg, sizes, toks),
                 "deepep_low_latency_fp8": deepep_style(cfg, sizes, toks),
                 "sampling_gather": sampling_gather(cfg, sizes, toks) if phase == "decode" else 0.0}
            if not a.no_hlo:
                h, cpu, secs = hlo_count(cfg, spec, toks, n)
                r.update(hlo=h, hlo_cpu=cpu, compile_s=round(secs, 1))
            rows.append(r)
            tot = sum(c.values())
            hlo = sum(r["hlo"].values()) if "hlo" in r else float("nan")
            cpu = sum(r["hlo_cpu"].values()) if "hlo_cpu" in r else float("nan")
            mn = r["deepep_min"]
            print(f"{spec:>18} {n:>3} {phase:>7} {toks:>9} | {hlo / 1e6:10.1f} {tot / 1e6:10.1f} "
                  f"{hlo / tot if tot else float('nan'):6.3f} | {mn / 1e6:10.1f} "
                  f"{(hlo if 'hlo' in r else tot) / mn:7.3f} | {cpu / 1e6:10.1f} | "
                  f"{r['sampling_gather'] / 1e6:11.2f}", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "model": "deepseek-v3 (61 layers: 3 dense + 58 MoE), bf16",
           "convention": "bytes sent per device per step (ring / pairwise)",
           "hlo": "partitioned module (before the CPU back end's bf16 promotion); hlo_cpu: final CPU module",
           "rows": rows, "deepep_published": DEEPEP,
           "deepep_low_latency_bytes_128_tokens": deepep_low_latency_bytes(cfg, 128)}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
