"""Prints the few Nsight Compute figures that decide a kernel's next step, from `ncu --page details --csv`
exports: duration, throughputs (SM, tensor pipe, L1/shared, L2, DRAM), registers and shared memory, and the
warp stall reasons, one column per report.

Owns only the reading of those CSV files.

    python benchmarks/ncu_summary.py mla_v1.csv mla_v8.csv
"""

import csv
import sys
from pathlib import Path

WANTED = (
    "Duration", "Elapsed Cycles", "SM Frequency", "Compute (SM) Throughput", "Memory Throughput",
    "L1/TEX Cache Throughput", "L2 Cache Throughput", "DRAM Throughput", "Registers Per Thread",
    "Dynamic Shared Memory Per Block", "Achieved Occupancy", "Issue Slots Busy", "Executed Ipc Active",
    "Warp Cycles Per Issued Instruction", "No Eligible", "Active Warps Per Scheduler",
    "Eligible Warps Per Scheduler",
)


def read(path: Path, kernel: str = "mosaic") -> dict[str, str]:
    """The wanted metrics of the first profiled kernel whose name contains `kernel` (XLA's own fusions
    around a Pallas call are profiled too)."""
    vals: dict[str, str] = {}
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if kernel not in r.get("Kernel Name", ""):
                continue
            name, unit, val = r.get("Metric Name", ""), r.get("Metric Unit", ""), r.get("Metric Value", "")
            if name in WANTED or name.startswith(("smsp__average_warps_issue_stalled", "sm__pipe_tensor",
                                                  "l1tex__data_pipe_lsu_wavefronts_mem_shared", "lts__t")):
                name = name.replace("smsp__average_warps_issue_stalled_", "stall ").replace(
                    "_per_issue_active.ratio", "")
                vals.setdefault(name, f"{val} {unit}".strip())
    return vals


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    tables = [read(p) for p in paths]
    names = list(dict.fromkeys(n for t in tables for n in t))
    print(f"{'metric':<44}" + "".join(f"{p.stem[:18]:>19}" for p in paths))
    for n in names:
        cells = [t.get(n, "-") for t in tables]
        if n.startswith("stall ") and all(c.split()[0] in ("0", "0.00", "-") for c in cells):
            continue  # a stall reason no kernel has
        print(f"{n[:44]:<44}" + "".join(f"{c[:18]:>19}" for c in cells))


if __name__ == "__main__":
    main()
