"""benchmarks/split_bench.py --tiny: the GPU benchmark of the MLA split layout and merge, its code run on
CPU at toy sizes (Pallas interpreter): old and new layouts agree, a long row's CTAs walk fewer pages."""

import json
import sys
from pathlib import Path


def test_split_bench_runs_at_toy_sizes(tmp_path):
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import split_bench
    finally:
        sys.path.remove(str(bench))
    out = tmp_path / "sb.json"
    assert split_bench.main(["--tiny", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["stall"]
    assert row["plan"]["long_rows"] > 0 and row["new_vs_old_rel_err"] < 1e-2
    assert row["new"]["most_pages_per_cta"] < row["old"]["most_pages_per_cta"]
    (steady,) = res["steady"]
    assert steady["new_vs_old_rel_err"] < 1e-6  # no long row: the same work in the same order
    assert steady["new"]["most_pages_per_cta"] == steady["old"]["most_pages_per_cta"]
    (m,) = res["merge"]
    assert m["out_rel_err"] < 1e-5 and m["lse_max_abs_err"] < 1e-5
    assert res["decode"]["hbm_floor_ms"] > 0 and res["decode"]["median_ms"] > 0
