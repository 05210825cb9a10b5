"""Where one batch-1 decode step's time goes, and what each extra layer costs (issue 32, item 1; GPU).

For the full-width DeepSeek-V3 slice with FP8 weights (e2e_bench's builders) at 1 dense + n MoE layers,
n in --moe-layers (default 1,2,4), one decode step of batch --batch at context --ctx through the Pallas
kernels, measured three ways in one run:
  * wall: the host clock around back-to-back jitted calls (what a serving step costs);
  * device: the GPU time of every kernel of the step, from a jax.profiler trace (benchmarks/device_time);
    wall - device is the time the GPU sits idle between kernels (launch gaps, host work);
  * floor: bytes the step must read / the copy bandwidth measured here (e2e_bench.step_bytes).
Then the per-layer slope of each (least squares over n): the slope beyond the floor is what 61 layers
multiply. The largest slice's kernels are listed by time per step (name, launches, ms) and grouped into
kinds (MLA, grouped GEMM, dense FP8 GEMM, quantize, XLA fusions, copies, other).
Memory: the FP8 slice holds 4.3 GB + 11.5 GB per MoE layer (256 experts), so 1+8 (96 GB) fits no 80 GB
H100. `--experts E` keeps E routed experts per MoE layer (5.9 GB a layer at 128): a batch-1 step reads the
same bytes (its 8 chosen experts and the shared one) whatever E is, so the slope is comparable; the run
refuses a slice whose weights exceed the device's memory before building any, naming the E that fits.
`--xla-variants`: the first slice with >= 2 MoE layers (a real layer scan; else the first slice) again
under each of engine_bench's XLA variants (command buffers default, off, all types with min graph size 1,
+ unrolled loops; dynamic-slice fusion), compiled per variant in this process
(the options are per compile), each with wall, device time and the gap between them: whether command
buffers remove the launch gaps.
Prints a table last and writes JSON (--out). --tiny runs the same code on CPU at toy size (no profile:
the trace has no GPU plane there, so device time is reported as absent).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import re
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_bench  # noqa: E402
from device_time import jax_device_time  # noqa: E402

from dsv3_jax.model import kv_b, kv_cache, qkv_a  # noqa: E402
from dsv3_jax.model.kv_cache import PageMeta  # noqa: E402
from dsv3_jax.model.trace_options import TraceOptions  # noqa: E402
from dsv3_jax.model.transformer import Transformer  # noqa: E402

# Kernel kinds by name fragment, first match wins. Mosaic GPU names every Pallas kernel
# "anonymous_mosaic_gpu_kernel" (MLA, FP8 GEMMs, grouped GEMMs alike): the trace cannot tell them apart.
KINDS = (("Pallas (Mosaic GPU)", ("mosaic_gpu",)), ("XLA dot (cuBLAS/Triton)", ("gemm_fusion", "dot")),
         ("cuBLAS/cutlass", ("cutlass", "sm90", "xmma", "gemm", "cublas")),
         ("copy/memset", ("memcpy", "memset", "copy")), ("XLA fusion", ("fusion", "loop_", "input_", "reduce")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, frags in KINDS:
        if any(f in low for f in frags):
            return kind
    return "other"


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (per extra MoE layer)."""
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def slice_config(n_moe: int, args):
    cfg = e2e_bench.slice_config(n_moe, args.tiny)
    return cfg.replace(n_routed_experts=args.experts) if args.experts else cfg


# An instruction of the optimized HLO that moves bytes without computing: `%name = bf16[2,3]{1,0} copy(...`.
_MOVE_RE = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (\w+)\[([\d,]*)\][^ ]* "
                      r"(copy|copy-start|transpose|pad|slice|dynamic-slice|concatenate)\(")


def hlo_moves(hlo_text: str, min_bytes: int = 1 << 20) -> list[dict]:
    """Data-moving instructions (copy, transpose, pad, slices, concatenate) of at least `min_bytes` in an
    optimized HLO module, largest first, each with the computation it sits in: how a `memcpy` kernel of the
    profile is traced back to the array it copies. A move inside a fusion's computation beside other work
    costs no launch of its own; one in ENTRY, a loop body or a `wrapped_*` computation does."""
    itemsize = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f8e4m3fn": 1, "s8": 1, "u8": 1, "pred": 1}
    out, computation = [], ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):  # a computation's header
            computation = line.split("(")[0].replace("ENTRY", "").strip(" %")
        m = _MOVE_RE.match(line)
        if not m:
            continue
        name, dtype, dims, op = m.groups()
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        size = n * itemsize.get(dtype, 4)
        if size >= min_bytes:
            out.append({"name": name, "op": op, "shape": f"{dtype}[{dims}]", "bytes": size,
                        "computation": computation, "line": line.strip()[:240]})
    return sorted(out, key=lambda r: -r["bytes"])


def weight_bytes(cfg, fp8: bool) -> int:
    """Bytes of the slice's weights (from shapes only: nothing is allocated)."""
    model = Transformer(cfg, jax.numpy.bfloat16, fp8=fp8)
    shapes = jax.eval_shape(lambda k: model.init(k, jax.numpy.zeros((1, 1), "int32"))["params"],
                            jax.random.key(0))
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))


def check_memory(ns: list[int], args) -> dict[int, float]:
    """GB of weights per slice; on a GPU, refuse (SystemExit) a slice that cannot fit beside its cache and
    workspace (90% of the allocator's limit), naming the expert count that would."""
    gb = {n: weight_bytes(slice_config(n, args), not args.bf16) / 1e9 for n in ns}
    stats = jax.devices()[0].memory_stats() if jax.default_backend() == "gpu" else None
    limit = (stats or {}).get("bytes_limit")
    if limit:
        room = 0.9 * limit / 1e9
        too_big = [n for n in ns if gb[n] > room]
        if too_big:
            n = max(too_big)
            cfg = slice_config(n, args)
            e = cfg.n_routed_experts
            fits = next((x for x in (128, 64, 32) if x < e and
                         weight_bytes(cfg.replace(n_routed_experts=x), not args.bf16) / 1e9 <= room), None)
            raise SystemExit(f"1+{n} MoE layers need {gb[n]:.1f} GB of weights at {e} experts; this device "
                             f"allows {room:.1f} GB (90% of its limit). Pass --experts {fits} (a batch-1 step "
                             "reads the same bytes), fewer layers, or run on a larger device.")
    return gb


def variants_slice(args) -> int:
    """The slice --xla-variants compiles again: the first with >= 2 MoE layers (a real layer scan, whose
    dynamic-slices of the stacked weights are what the dynamic-slice fusion variant is about; a stack of
    one layer has none), else the first."""
    ns = [int(n) for n in args.moe_layers.split(",")]
    return next((n for n in ns if n >= 2), ns[0])


def one_slice(n_moe: int, args, bandwidth: float) -> dict:
    cfg = slice_config(n_moe, args)
    model, params = e2e_bench.random_params(cfg, fp8=not args.bf16)
    if args.kv_b == "split":  # what every ModelHandle holds (model/kv_b.py)
        params = kv_b.split(params, cfg, jax.numpy.bfloat16)
    if args.qkv_a == "fused":  # what every ModelHandle holds (model/qkv_a.py)
        params = qkv_a.fuse(params, cfg)
    ps = kv_cache.PAGE_SIZE
    table = kv_cache.contiguous_table(args.batch, args.ctx + 1, ps)
    cache = kv_cache.allocate(cfg, 1 + table.size, ps, "absorbed", "bfloat16")
    cache = jax.tree_util.tree_map(lambda c: (jax.random.normal(jax.random.key(1), c.shape, "float32") * 0.5)
                                   .astype(c.dtype), cache)
    meta = PageMeta(jax.numpy.asarray(table), jax.numpy.ones((args.batch,), "int32"))
    toks = jax.numpy.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, 1)), "int32")
    pos = jax.numpy.full((args.batch, 1), args.ctx, "int32")
    m = model.clone(trace_options=TraceOptions(kernels=args.kernels))
    step = jax.jit(lambda p, c: m.apply({"params": p}, toks, pos, c, meta)[0][:, -1].argmax(-1))

    wall = e2e_bench.timeit(lambda: step(params, cache), args.reps)
    hlo = step.lower(params, cache).compile().as_text()  # from the persistent cache, if on
    moves = hlo_moves(hlo)
    if args.hlo_dir:  # the optimized HLO: a profile's fusion names map to their source ops (metadata op_name)
        args.hlo_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.hlo_dir / f"step_1+{n_moe}_{args.kv_b}_{args.qkv_a}.hlo.txt.gz", "wt") as f:
            f.write(hlo)
    floor_ms = 1e3 * e2e_bench.step_bytes(cfg, params, args.batch, args.ctx) / bandwidth
    row = {"moe_layers": n_moe, "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts, "wall": wall,
           "floor_ms": floor_ms, "hlo_moves": moves[:12],
           "hlo_moves_bytes": sum(r["bytes"] for r in moves)}
    if args.xla_variants and n_moe == variants_slice(args):
        row["xla_variants"] = xla_variants(step, (params, cache), args)
    if jax.default_backend() == "gpu":
        dev = jax_device_time(step, (params, cache), calls=args.calls)
        row["device"] = {k: dev[k] for k in ("median_ms", "min_ms", "max_ms")}
        row["gap_ms"] = wall["median_ms"] - dev["median_ms"]
        kernels = sorted(dev["kernel_totals"].items(), key=lambda kv: -kv[1]["ms_per_call"])
        row["kernels"] = [{"name": k, "kind": kind_of(k), **v} for k, v in kernels]
        kinds: dict[str, float] = {}
        for k in row["kernels"]:
            kinds[k["kind"]] = kinds.get(k["kind"], 0.0) + k["ms_per_call"]
        row["kinds"] = kinds
    return row  # the slice's weights die with this frame (main collects before the next slice)


def xla_variants(step, step_args: tuple, args) -> list[dict]:
    """The step compiled under each of engine_bench.XLA_VARIANTS (options per compile): wall, and on the
    GPU device time and the gap (wall - device). XLA:CPU accepts the GPU options and ignores them."""
    import concurrent.futures

    from engine_bench import pick_variants

    variants = pick_variants(args.xla_variants)
    lowered = step.lower(*step_args)

    def compile_one(opts):  # the variants compile on parallel threads
        t0 = time.perf_counter()
        try:
            comp = lowered.compile(compiler_options=opts) if opts else lowered.compile()
            return comp, time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - record, keep measuring
            return e, time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(variants)) as pool:
        compiled = list(pool.map(compile_one, variants.values()))
    out = []
    for (name, opts), (comp, seconds) in zip(variants.items(), compiled, strict=True):
        row = {"variant": name, "options": opts, "compile_s": seconds}
        if isinstance(comp, Exception):
            out.append({**row, "error": repr(comp)[:300]})
            continue
        row["wall"] = e2e_bench.timeit(lambda comp=comp: comp(*step_args), args.reps)
        row["hlo_moves_mb"] = sum(m["bytes"] for m in hlo_moves(comp.as_text())) / 1e6
        if jax.default_backend() == "gpu":
            try:
                dev = jax_device_time(comp, step_args, calls=args.calls)
                row["device_ms"] = dev["median_ms"]
                row["gap_ms"] = row["wall"]["median_ms"] - dev["median_ms"]
                row["launches"] = sum(k["launches_per_call"] for k in dev["kernel_totals"].values())
            except Exception as e:  # noqa: BLE001 - a graph's kernels may not split into calls
                row["device_error"] = repr(e)[:300]
        out.append(row)
        print(f"  xla variant {name}: {row['wall']['median_ms']:.3f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe-layers", default="1,2,4", help="slices of 1 dense + n MoE layers, comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--calls", type=int, default=20, help="profiled back-to-back calls")
    ap.add_argument("--kernels", default="pallas", choices=("pallas", "reference"))
    ap.add_argument("--bf16", action="store_true", help="BF16 weights (experts through the BF16 grouped GEMM)")
    ap.add_argument("--experts", type=int, default=0,
                    help="routed experts per MoE layer (0: the model's 256); 128 fits 1+8 on an 80 GB H100")
    ap.add_argument("--xla-variants", nargs="?", const="all", default=None,
                    help="the variants slice's step under XLA option variants too (engine_bench.XLA_VARIANTS): "
                         "all, or a comma list of their names (the default is always measured)")
    ap.add_argument("--kv-b", default="split", choices=("split", "checkpoint"),
                    help="kv_b as the product holds it (split: dequantized once, model/kv_b.py) or in the "
                         "checkpoint form (dequantized and transposed in every step)")
    ap.add_argument("--qkv-a", default="fused", choices=("fused", "separate"),
                    help="q_a and kv_a as the product holds them (fused: one linear, model/qkv_a.py) or as "
                         "the checkpoint's two linears")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at toy size")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--hlo-dir", type=Path, default=None, help="write each slice's optimized HLO (gzip) here")
    args = ap.parse_args(argv)
    if args.tiny:
        args.kernels, args.reps = "reference", min(args.reps, 3)

    ns = [int(n) for n in args.moe_layers.split(",")]
    weights_gb = check_memory(ns, args)
    bandwidth = e2e_bench.copy_bandwidth() if jax.default_backend() == "gpu" else 1e11
    rows = []
    for n in ns:
        rows.append({**one_slice(n, args, bandwidth), "weights_gb": weights_gb[n]})
        gc.collect()
        if args.out:  # each slice kept as it lands (a run cut short by a time limit still reports them)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"partial": True, "rows": rows}, indent=1))
    ns = [r["moe_layers"] for r in rows]
    fit = {"wall_ms_per_layer": slope(ns, [r["wall"]["median_ms"] for r in rows]),
           "floor_ms_per_layer": slope(ns, [r["floor_ms"] for r in rows])}
    if "device" in rows[0]:
        fit["device_ms_per_layer"] = slope(ns, [r["device"]["median_ms"] for r in rows])
        fit["gap_ms_per_layer"] = slope(ns, [r["gap_ms"] for r in rows])
    fit["beyond_floor_us_per_layer"] = 1e3 * (fit["wall_ms_per_layer"] - fit["floor_ms_per_layer"])
    fit["floor_ms_at_0_layers"] = float(np.polyfit(ns, [r["floor_ms"] for r in rows], 1)[1]) if len(ns) > 1 \
        else float("nan")
    result = {"device": str(jax.devices()[0]), "batch": args.batch, "ctx": args.ctx, "weights":
              "bf16" if args.bf16 else "fp8", "kv_b": args.kv_b, "qkv_a": args.qkv_a, "experts": rows[0]["experts"],
              "bandwidth_TBps": bandwidth / 1e12,
              "rows": rows, "fit": fit}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    last = rows[-1]
    if "kernels" in last:
        print(f"\nkernels of one step, 1+{last['moe_layers']} layers (ms per step, launches per step):")
        for k in last["kernels"][:20]:
            print(f"  {k['ms_per_call']:8.4f} ms  x{k['launches_per_call']:5.1f}  {k['kind']:15s} {k['name'][:70]}")
        print("  by kind: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(last["kinds"].items(),
                                                                           key=lambda kv: -kv[1])))
    print(f"\nb={args.batch} ctx={args.ctx} {result['weights']}, {result['experts']} routed experts per MoE layer, "
          f"on {result['device']}, "
          f"copy bandwidth {result['bandwidth_TBps']:.2f} TB/s")
    print("| slice | wall ms (min-max) | device ms | gap ms | floor ms | wall/floor |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        w = r["wall"]
        dev = f"{r['device']['median_ms']:.3f}" if "device" in r else "-"
        gap = f"{r['gap_ms']:.3f}" if "gap_ms" in r else "-"
        print(f"| 1+{r['moe_layers']} | {w['median_ms']:.3f} ({w['min_ms']:.3f}-{w['max_ms']:.3f}) | {dev} | "
              f"{gap} | {r['floor_ms']:.3f} | {w['median_ms'] / r['floor_ms']:.2f}x |")
    for r in rows:
        print(f"1+{r['moe_layers']}: {len(r['hlo_moves'])} data moves >= 1 MB, "
              f"{r['hlo_moves_bytes'] / 1e6:.1f} MB in all" + "".join(
                  f"\n    {m['op']} {m['shape']} {m['bytes'] / 1e6:.1f} MB in {m['computation'][:40]}: "
                  f"{m['line'][:120]}"
                  for m in r["hlo_moves"][:4]))
    print("per extra MoE layer: " + ", ".join(f"{k} {v:.4f}" for k, v in fit.items()))
    vrow = next((r for r in rows if "xla_variants" in r), {"xla_variants": [], "moe_layers": None})
    for v in vrow["xla_variants"]:
        w = v.get("wall", {}).get("median_ms")
        print(f"1+{vrow['moe_layers']} b={args.batch}, XLA {v['variant']}: "
              + (f"wall {w:.3f} ms, moves {v['hlo_moves_mb']:.0f} MB" if w is not None else str(v.get("error")))
              + (f", device {v['device_ms']:.3f} ms, gap {v['gap_ms']:.3f} ms, {v['launches']:.0f} launches"
                 if "device_ms" in v else "") + (f" ({v['device_error'][:80]})" if "device_error" in v else ""))
    return result


if __name__ == "__main__":
    main()
