"""Converter throughput and memory on a synthetic checkpoint of real DeepSeek-V3 tensor shapes.

Writes an official-layout FP8 checkpoint with random data (7168 hidden, 128 heads, 18432-wide dense
MLP, 256 routed experts per MoE layer with a narrower expert width so it stays a few GB), then, with
the files evicted from the page cache before each run, times `cat` of the shards (the read ceiling),
`cp` of the shards plus `sync` (the ceiling of anything that writes what it reads: the durable copy
rate) and `python -m convert` (subprocess, its own peak RSS). Prints a table and writes JSON.

  python benchmarks/convert_bench.py [--moe-layers 2] [--expert-width 256] [--dtype auto] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from convert.synthetic import write_checkpoint  # noqa: E402
from dsv3_jax.config import ModelConfig  # noqa: E402


def evict(paths: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (no root needed), so reads hit the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dsv3_convert_bench"))
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=256, help="moe_intermediate_size (real: 2048)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp8"))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    cfg = ModelConfig(vocab_size=16384, num_hidden_layers=1 + a.moe_layers, first_k_dense_replace=1,
                      moe_intermediate_size=a.expert_width, num_nextn_predict_layers=0)
    src, dst = a.dir / "src", a.dir / "dst"
    if not (src / "config.json").exists():
        shutil.rmtree(a.dir, ignore_errors=True)
        write_checkpoint(src, cfg, fp8=True, data="random", shard_bytes=1 << 30)
    shards = sorted(src.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    rows = []
    for rep in range(a.repeats):
        evict(shards)
        t = time.perf_counter()
        subprocess.run(["cat", *map(str, shards)], stdout=subprocess.DEVNULL, check=True)
        cat_s = time.perf_counter() - t
        # The ceiling of any converter that writes what it reads: copy the shards and make them durable.
        evict(shards)
        copy_dir = a.dir / "copy"
        shutil.rmtree(copy_dir, ignore_errors=True)
        copy_dir.mkdir()
        subprocess.run(["sync"], check=True)
        t = time.perf_counter()
        subprocess.run(["cp", *map(str, shards), str(copy_dir)], check=True)
        subprocess.run(["sync", "-f", str(copy_dir)], check=True)
        cp_s = time.perf_counter() - t
        shutil.rmtree(copy_dir)
        evict(shards)
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        report_path = a.dir / "report.json"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "convert", str(src), str(dst), "--quiet", "--dtype", a.dtype,
                        "--workers", str(a.workers), "--report-json", str(report_path)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        conv_s = time.perf_counter() - t
        r = json.loads(report_path.read_text())
        cat_rate, cp_rate = size / cat_s / 1e9, size / cp_s / 1e9
        rows.append({"rep": rep, "cat_GBps": cat_rate, "cp_sync_GBps": cp_rate, "convert_GBps": r["gb_per_s"],
                     "convert_wall_s": conv_s, "convert_s": r["seconds"], "ratio": r["gb_per_s"] / cat_rate,
                     "ratio_cp": r["gb_per_s"] / cp_rate,
                     "peak_rss_MiB": r["peak_rss"] / 2**20,
                     "rss_growth_MiB": (r["peak_rss"] - r["baseline_rss"]) / 2**20,
                     "bytes_out_GB": r["bytes_out"] / 1e9})
    print(f"source: {len(shards)} shards, {size / 1e9:.2f} GB, FP8 layout, 7168 hidden, 256 experts x "
          f"{a.moe_layers} MoE layers (expert width {a.expert_width}); --dtype {a.dtype}, "
          f"{a.workers} workers")
    hdr = ["rep", "cat_GBps", "cp_sync_GBps", "convert_GBps", "ratio", "ratio_cp", "convert_s", "convert_wall_s", "peak_rss_MiB",
           "rss_growth_MiB", "bytes_out_GB"]
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join(f"{r[h]:.2f}" if isinstance(r[h], float) else str(r[h]) for h in hdr))
    out = a.json or a.dir / "convert_bench.json"
    out.write_text(json.dumps({"size_bytes": size, "args": {k: str(v) for k, v in vars(a).items()},
                               "runs": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
