"""benchmarks/engine_bench.py on the tiny config (CPU): a run of bare tasks only builds no engine, and still
writes its figures and prints its report (the first such run on the GPU failed in the report)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_largest_fit_alone_builds_no_engine(tmp_path):
    out = tmp_path / "eb.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engine_bench.py"), "--tiny", "--prompt", "32",
           "--new", "4", "--batches", "4", "--reps", "2", "--no-xla-variants", "--kv-cache-dtype", "fp8",
           "--tasks", "largest batch at --fit-context", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    fit = res["largest_fit"]
    assert "error" not in fit, fit
    assert fit["context"] == 256 and 1 <= fit["requests"] <= fit["planned_requests"]
    assert fit["median_ms"] > 0 and fit["floor_ms"] > 0
    assert "engine_stats" not in res and "warmup" not in res and res["loads"] == []
    assert "no engine built" in r.stdout and "largest batch at 256 tokens, fp8 cache" in r.stdout
