"""DeepSeek-V3 on 8, 16 and 32 H200s, on paper: per decode step the compute, HBM and NVLink/IB time of the
busiest GPU, and the tok/s they imply, from the one-GPU measurements and the byte counts.

Per layout (mesh axes `data, expert, tensor` as in parallel/sharding.py, FP8 or BF16 weights) and global
batch (1 and 256 sequences at `--context` tokens), for the busiest GPU of one decode step:
- **HBM floor**: the bytes it reads (plan.param_layout's weights sharded by sharding.param_specs; the
  non-expert weights whole, the routed experts it holds that the batch activates, the expected maximum over
  the expert group's GPUs under V3's group-limited routing (Monte Carlo, uniform scores); its batch
  shard's latent cache) / the measured copy bandwidth.
- **compute**: 2 x weights x its tokens (+ the absorbed attention over the context) at the FP8 / BF16
  dense GEMM ceilings.
- **kernel excess**: what the measured one-GPU step spends beyond its floor, carried over per layer (batch
  1: a fixed start/end plus a per-layer excess, additive: latency-bound kernels do not get faster on a
  smaller shard) or as a ratio (batch 256: wall / floor of the bare step; BF16 adds its expert-weight copy,
  one more pass over the activated experts at copy bandwidth).
- **NVLink / IB**: the bytes it sends (comm_volume.count, the closed form that equals the compiled HLO, and
  comm_volume.sampling_gather) split by link: a collective over a mesh axis whose group spans hosts sends
  the share of its peers on other hosts over InfiniBand; plus an assumed latency per collective.
The step is the sum (no overlap of communication with compute: an upper bound a DeepEP/two-batch-overlap
schedule would lower). Per-user tok/s = tokens per step / step at batch 1; tok/s per GPU = batch x tokens
per step / step / GPUs at batch 256 (global). With MTP (one draft, the engine's spec_k=1) a step verifies
2 tokens per sequence, reads the MTP layer and its head too, and yields 1 + acceptance tokens.

    python benchmarks/scale_table.py                      # table to stdout
    python benchmarks/scale_table.py --write-readme       # and into launch/README.md (between markers)

Must not change model, sharding or engine code: it only reads them (and comm_volume's formulas).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import comm_volume  # noqa: E402
import jax  # noqa: E402

from dsv3_jax import plan as planner  # noqa: E402
from dsv3_jax.model import kv_b, layout  # noqa: E402
from dsv3_jax.parallel import sharding  # noqa: E402

README = ROOT / "launch" / "README.md"
BEGIN, END = "<!-- scale_table:begin -->", "<!-- scale_table:end -->"
EXPERT_LEAVES = {f"{p}_{s}" for p in ("gate_proj", "up_proj", "down_proj") for s in ("weight", "scale")}

# Reference points (issue 30): TensorRT-LLM, DeepSeek-V3/R1 on 8 H200s.
TRT_LLM_USER = 158.0  # tok/s per user, min-latency, with MTP
TRT_LLM_GPU = 1436.0  # tok/s per GPU, max-throughput


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Link and memory speeds per GPU (H200 SXM, HGX 8-GPU hosts)."""

    gpus_per_host: int = 8
    memory: float = 141e9
    hbm_peak: float = 4.8e12  # spec sheet; not used for times (the measured copy bandwidth is)
    hbm_copy: float = 4.189e12  # device copy measured on one H200, 2026-12-02 (RESULTS.md, e2e section)
    nvlink: float = 450e9  # NVLink 4: 900 GB/s bidirectional per GPU, 450 GB/s each way
    ib: float = 50e9  # one 400 Gb/s NIC per GPU
    nvlink_latency: float = 8e-6  # per collective, assumed (NCCL small-message latency inside a host)
    ib_latency: float = 20e-6  # per collective crossing hosts, assumed
    fp8_flops: float = 1.285e15  # DESIGN.md ceilings (dense GEMM, measured on an H200)
    bf16_flops: float = 0.743e15


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the measured one-GPU step spends beyond its HBM floor (benchmarks/RESULTS.md)."""

    # Batch 1 (issue 32, 2026-12-05, full-width slices 1+1/1+2/1+4 MoE, least squares): wall - floor =
    # fixed + per layer. FP8 165 us per MoE layer, intercept 0.68 ms (one dense layer + the step's start
    # and end: 0.52 ms fixed). BF16 696 us per MoE layer (its expert-weight copy is most of it).
    fixed_s: float = 0.52e-3
    excess_per_layer_s: tuple[tuple[str, float], ...] = (("fp8", 165e-6), ("bf16", 696e-6))
    # Batch 256 (2026-12-02, one H200, 1K context, 5-layer FP8 slice): bare step 18.31 ms / floor 11.93 ms.
    ratio_large: float = 18.31 / 11.93
    acceptance: float = 0.85  # MTP second-token acceptance (DeepSeek-V3 report: 85-90%)

    def per_layer(self, dtype: str) -> float:
        return dict(self.excess_per_layer_s)[dtype]


# (GPUs, weights, mesh): the layouts the comm report and the planner consider. 8 GPUs hold FP8 only.
LAYOUTS = [
    (8, "fp8", "tensor=8"), (8, "fp8", "expert=8"), (8, "bf16", "expert=8"),
    (16, "fp8", "data=2,expert=8"), (16, "bf16", "tensor=2,expert=8"),
    (32, "fp8", "data=4,expert=8"), (32, "bf16", "data=2,tensor=2,expert=8"),
]
BATCHES = (1, 256)


# --------------------------------------------------------------------------------------- routing
def max_local_experts(cfg, ep: int, tokens: int, trials: int = 64, seed: int = 0) -> float:
    """Expected number of distinct routed experts the busiest of `ep` GPUs (each holding E/ep experts)
    runs for `tokens` tokens, under V3's group-limited routing with uniform scores (topk_group of n_group
    groups, then k experts among them). With ep = 1: distinct experts overall."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    groups, per_group, topg = cfg.n_group, e // cfg.n_group, cfg.topk_group
    if tokens <= 0:
        return 0.0
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        g = np.argsort(rng.random((tokens, groups)), axis=1)[:, :topg]  # chosen groups
        pick = np.argsort(rng.random((tokens, topg * per_group)), axis=1)[:, :k]  # k of their experts
        experts = np.take_along_axis(g, pick // per_group, axis=1) * per_group + pick % per_group
        hit = np.zeros(e, bool)
        hit[experts.ravel()] = True
        out.append(hit.reshape(ep, e // ep).sum(1).max())
    return float(np.mean(out))


# ----------------------------------------------------------------------------------------- bytes
def _leaves(cfg, dtype: str, mtp: bool):
    tree = planner.device_form(planner.param_layout(cfg, dtype, include_mtp=mtp), cfg, dtype)
    specs = sharding.param_specs(tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=layout.is_info)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    for (path, info), spec in zip(leaves, spec_leaves, strict=True):
        names = [str(getattr(p, "key", "")) for p in path]
        yield names, info, spec


def weight_bytes(cfg, dtype: str, sizes: dict[str, int], *, mtp: bool) -> dict[str, float]:
    """Per-GPU bytes and matmul parameters by kind: 'dense' (read whole every step), 'experts' (all routed
    experts this GPU holds), 'embed' (a gather: not read whole), with FP8 and BF16 parameter counts."""
    out = {"dense": 0.0, "experts": 0.0, "embed": 0.0, "dense_params_fp8": 0.0, "dense_params_bf16": 0.0,
           "expert_params": 0.0}
    for names, info, spec in _leaves(cfg, dtype, mtp):
        shard = sharding.shard_shape(info.shape, spec, sizes)
        item = np.dtype(info.dtype).itemsize
        nbytes = math.prod(shard) * item
        if "embed_tokens" in names:
            out["embed"] += nbytes
        elif names[-1] in EXPERT_LEAVES:
            out["experts"] += nbytes
            if names[-1].endswith("weight"):
                out["expert_params"] += math.prod(shard)
        else:
            out["dense"] += nbytes
            matrix = names[-1] in ("weight", kv_b.W_UK, kv_b.W_UV)  # kv_b's halves: model/kv_b.py
            if len(info.shape) >= 2 and matrix and "norm" not in names[-2]:
                out["dense_params_fp8" if item == 1 else "dense_params_bf16"] += math.prod(shard)
    return out


def kv_bytes_per_token(cfg) -> int:
    return layout.bytes_per_token(cfg, "absorbed", layout.kv_cache_dtype(cfg, "auto"))


# ------------------------------------------------------------------------------------------ links
def off_host_share(sizes: dict[str, int], axis: str, gpus_per_host: int) -> float:
    """The share of an `axis` group's peers on other hosts (devices numbered host by host, mesh axes
    sharding.AXES with the last fastest)."""
    g = sizes[axis]
    if g == 1:
        return 0.0
    order = list(sharding.AXES)
    stride = math.prod(sizes[a] for a in order[order.index(axis) + 1:])
    same_host = min(g, max(1, gpus_per_host // stride)) if stride < gpus_per_host else 1
    return (g - same_host) / (g - 1)


def comm(cfg, sizes: dict[str, int], tokens: int, rows: int, hw: Hardware) -> dict[str, float]:
    """Bytes one GPU sends per decode step (comm_volume's closed form + the sampling gather) by link,
    the collectives it issues, and the times: bandwidth + latency per collective."""
    kinds = comm_volume.count(cfg, sizes, tokens)
    by_axis = {"tensor": kinds.get("all-reduce", 0.0) + comm_volume.sampling_gather(cfg, sizes, rows),
               "expert": sum(v for k, v in kinds.items() if k != "all-reduce")}
    n_coll = {"tensor": (1 + 2 * cfg.num_hidden_layers + 1) if sizes["tensor"] > 1 else 0,
              "expert": 2 * cfg.n_moe_layers if sizes["expert"] > 1 else 0}
    nv = ib = 0.0
    lat = 0.0
    for axis, b in by_axis.items():
        share = off_host_share(sizes, axis, hw.gpus_per_host)
        ib += b * share
        nv += b * (1 - share)
        lat += n_coll[axis] * (hw.ib_latency if share > 0 else hw.nvlink_latency)
    return {"bytes": sum(by_axis.values()), "nvlink_bytes": nv, "ib_bytes": ib, "collectives":
            sum(n_coll.values()), "nvlink_s": nv / hw.nvlink, "ib_s": ib / hw.ib, "latency_s": lat}


# --------------------------------------------------------------------------------------- estimate
def estimate(cfg, mesh: str, dtype: str, batch: int, *, context: int, mtp: bool, hw: Hardware,
             cal: Calibration) -> dict:
    """The busiest GPU's decode step for `batch` sequences (global) at `context` tokens (module
    docstring). Times in ms."""
    sizes = sharding.parse_mesh_spec(mesh)
    n_gpu = math.prod(sizes.values())
    shards = sizes["data"] * sizes["expert"]
    per_token = 2 if mtp else 1  # tokens per sequence per step (verify: last token + one draft)
    seqs = -(-batch // shards)  # sequences in the busiest batch shard
    tokens = seqs * per_token
    group_tokens = -(-batch // sizes["data"]) * per_token  # real tokens reaching one expert group
    w = weight_bytes(cfg, dtype, sizes, mtp=mtp)
    e_local = cfg.n_routed_experts // sizes["expert"]
    active = max_local_experts(cfg, sizes["expert"], group_tokens) / e_local  # share of its experts run
    expert_read = w["experts"] * active
    kv = seqs * context * kv_bytes_per_token(cfg)
    hbm_bytes = w["dense"] + expert_read + kv
    # FLOPs: dense weights on the shard's tokens, experts on their share of the group's (token, expert)
    # pairs, absorbed attention (q.k over 576 and p.v over 512 latent values per head) at the bf16 rate.
    pairs = group_tokens * cfg.num_experts_per_tok / sizes["expert"]
    expert_flops = 2 * pairs * w["expert_params"] / e_local  # expert_params: all its experts, all layers
    attn_flops = (2 * tokens * cfg.num_hidden_layers * cfg.num_attention_heads / sizes["tensor"]
                  * (cfg.kv_lora_rank * 2 + cfg.qk_rope_head_dim) * context)
    fp8 = dtype == "fp8"
    compute_s = (2 * tokens * w["dense_params_fp8"] / hw.fp8_flops
                 + 2 * tokens * w["dense_params_bf16"] / hw.bf16_flops
                 + expert_flops / (hw.fp8_flops if fp8 else hw.bf16_flops)
                 + attn_flops / hw.bf16_flops)
    hbm_s = hbm_bytes / hw.hbm_copy
    body = max(hbm_s, compute_s)
    layers = cfg.num_hidden_layers + (1 if mtp else 0)
    if batch <= 1:
        excess_s = cal.fixed_s + layers * cal.per_layer(dtype)
    else:
        excess_s = body * (cal.ratio_large - 1) + (0.0 if fp8 else expert_read / hw.hbm_copy)
    c = comm(cfg, sizes, tokens, seqs, hw)
    step_s = body + excess_s + c["nvlink_s"] + c["ib_s"] + c["latency_s"]
    out_tokens = (1 + cal.acceptance) if mtp else 1.0
    terms = {"compute": compute_s, "HBM": hbm_s, "kernel excess": excess_s, "NVLink": c["nvlink_s"],
             "IB": c["ib_s"], "link latency": c["latency_s"]}
    ms = lambda s: round(s * 1e3, 4)  # noqa: E731
    p = planner.plan(cfg, sizes, dtype=dtype, max_seq_len=context, device_memory=int(hw.memory))
    return {"gpus": n_gpu, "mesh": mesh, "dtype": dtype, "batch": batch, "mtp": mtp, "fits": p.fits,
            "weights_gb_per_gpu": round(p.weight_bytes_per_device / 1e9, 1),
            "hbm_bytes": hbm_bytes, "expert_share_read": round(active, 4), "kv_bytes": kv,
            "comm_bytes": c["bytes"], "nvlink_bytes": c["nvlink_bytes"], "ib_bytes": c["ib_bytes"],
            "collectives": c["collectives"],
            "compute_ms": ms(compute_s), "hbm_ms": ms(hbm_s), "excess_ms": ms(excess_s),
            "nvlink_ms": ms(c["nvlink_s"]), "ib_ms": ms(c["ib_s"]), "latency_ms": ms(c["latency_s"]),
            "step_ms": ms(step_s), "tokens_per_step": out_tokens,
            "tok_s_user": round(out_tokens / step_s, 1),
            "tok_s_gpu": round(batch * out_tokens / step_s / n_gpu, 1),
            "dominant": max(terms, key=terms.get)}


def table(rows: list[dict], hw: Hardware, cal: Calibration, context: int) -> str:
    head = ("| GPUs | weights | mesh | GB/GPU | batch | MTP | compute ms | HBM ms | kernel excess ms | "
            "NVLink ms | IB ms | link latency ms | step ms | tok/s | vs TRT-LLM | dominant |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['gpus']} | {r['dtype'].upper()} | `{r['mesh']}` | {r['weights_gb_per_gpu']} "
                         f"| - | - | does not fit in {hw.memory / 1e9:.0f} GB | | | | | | | | | |")
            continue
        if r["batch"] == 1:
            rate, ref = f"{r['tok_s_user']:,.0f} per user", r["tok_s_user"] / TRT_LLM_USER
        else:
            rate, ref = f"{r['tok_s_gpu']:,.0f} per GPU", r["tok_s_gpu"] / TRT_LLM_GPU
        lines.append(
            f"| {r['gpus']} | {r['dtype'].upper()} | `{r['mesh']}` | {r['weights_gb_per_gpu']} | {r['batch']} | "
            f"{'k=1' if r['mtp'] else '-'} | {r['compute_ms']:.2f} | {r['hbm_ms']:.2f} | {r['excess_ms']:.2f} | "
            f"{r['nvlink_ms']:.2f} | {r['ib_ms']:.2f} | {r['latency_ms']:.2f} | {r['step_ms']:.2f} | {rate} | "
            f"{ref:.2f}x | {r['dominant']} |")
    note = (f"Context {context:,} tokens, bf16 latent cache; TensorRT-LLM on 8 H200s: {TRT_LLM_USER:.0f} tok/s "
            f"per user (batch 1, MTP), {TRT_LLM_GPU:,.0f} tok/s per GPU (throughput); 'vs TRT-LLM' divides "
            f"by the one for the row's batch. Batch 256 is global (all GPUs together).")
    return "\n".join(lines) + "\n\n" + note


def rows_for(cfg, context: int, hw: Hardware, cal: Calibration) -> list[dict]:
    out = []
    for gpus, dtype, mesh in LAYOUTS:
        first = estimate(cfg, mesh, dtype, 1, context=context, mtp=False, hw=hw, cal=cal)
        assert first["gpus"] == gpus, (mesh, gpus)
        if not first["fits"]:
            out.append(first)
            continue
        for batch in BATCHES:
            for mtp in (False, True):
                out.append(first if (batch, mtp) == (1, False) else
                           estimate(cfg, mesh, dtype, batch, context=context, mtp=mtp, hw=hw, cal=cal))
    return out


def write_readme(text: str, path: Path = README) -> None:
    """Put `text` between the markers in `path` (appended with them when absent)."""
    doc = path.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc and END in doc:
        doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence in the cache")
    ap.add_argument("--write-readme", nargs="?", const=str(README), metavar="FILE",
                    help=f"write the table between the markers of FILE (default {README.relative_to(ROOT)})")
    ap.add_argument("--json", help="every row as JSON")
    a = ap.parse_args(argv)
    cfg = planner.load_config("deepseek-v3")
    hw, cal = Hardware(), Calibration()
    rows = rows_for(cfg, a.context, hw, cal)
    text = table(rows, hw, cal, a.context)
    print(text)
    if a.write_readme:
        write_readme(text, Path(a.write_readme))
    if a.json:
        Path(a.json).write_text(json.dumps({"hardware": dataclasses.asdict(hw),
                                            "calibration": dataclasses.asdict(cal), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
