"""Where a profiled step's kernels come from: each kernel of a `step_profile.py` JSON row mapped to the
optimized-HLO instruction that launched it (`step_profile.py --hlo-dir`) and that instruction's source op
(its metadata op_name: the Flax module path and the jnp/lax primitive).

    python3 benchmarks/hlo_sources.py PROFILE.json HLO.txt.gz [--row 1] [--top 40]

Prints the kernels by time with their source, then the time and launches summed by module (the last
named module on the op_name path: self_attn, mlp, shared_experts, ...) and primitive. What it reads:
XLA names a GPU kernel after its instruction, with '.' and '-' written '_' (`loop_pad_fusion.6` ->
`loop_pad_fusion_6`). Owns nothing the product uses; reads files only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MODULES = ("self_attn", "shared_experts", "mlp", "lm_head", "embed_tokens", "norm", "mtp")


def kernel_name(instruction: str) -> str:
    return instruction.replace(".", "_").replace("-", "_")


def instructions(hlo_text: str) -> dict[str, dict]:
    """Sanitized instruction name -> {op, shape, op_name} for every instruction with metadata."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        src = _OP_NAME.search(line)
        out[kernel_name(name)] = {"op": op, "shape": shape, "op_name": src.group(1) if src else ""}
    return out


def source(op_name: str) -> tuple[str, str]:
    """(module, primitive) of an op_name path: the last known module on it, and its last element."""
    parts = [p for p in op_name.split("/") if p]
    module = next((p for p in reversed(parts) if p in _MODULES), "other")
    if module == "mlp" and "shared_experts" in parts:
        module = "shared_experts"
    return module, (parts[-1] if parts else "?")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("hlo", type=Path)
    ap.add_argument("--row", type=int, default=-1, help="which row (slice) of the profile: default the last")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    row = json.loads(args.profile.read_text())["rows"][args.row]
    opener = gzip.open if args.hlo.suffix == ".gz" else open
    with opener(args.hlo, "rt") as f:
        table = instructions(f.read())
    by_source: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    print(f"1+{row['moe_layers']}: kernels by time (us per step, launches per step, kind, source)")
    for k in sorted(row["kernels"], key=lambda k: -k["ms_per_call"]):
        ins = table.get(k["name"])
        module, prim = source(ins["op_name"]) if ins else ("unmapped", k["name"])
        by_source[(k["kind"], module)][0] += 1e3 * k["ms_per_call"]
        by_source[(k["kind"], module)][1] += k["launches_per_call"]
        if args.top:
            args.top -= 1
            where = ins["op_name"][-90:] if ins else "(no such instruction)"
            print(f"  {1e3 * k['ms_per_call']:8.1f} {k['launches_per_call']:5.1f}  {k['kind'][:14]:14s} "
                  f"{k['name'][:34]:34s} {where}")
    print("by kind and module (us per step, launches per step):")
    for (kind, module), (us, n) in sorted(by_source.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:8.1f} {n:6.1f}  {kind[:24]:24s} {module}")


if __name__ == "__main__":
    main()
