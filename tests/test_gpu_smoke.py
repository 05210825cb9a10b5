"""benchmarks/gpu_smoke.py (the speed part of the GPU gate) runs and judges on CPU, in its --tiny mode.

The baseline cycle: a run writes a baseline; its figures judged against it pass; against a baseline
doctored 2x better they fail; without a baseline the run exits 2 ("no baseline"); a failed test part
(`--prior`) fails the run. The fast test measures the kernel parts only (the slice's engine warmup
compiles six programs, over a minute on the 2-core box); the slow one runs everything, the engine's
no-compile-after-warmup check included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "benchmarks" / "gpu_smoke.py"


def smoke(tmp: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "DSV3_JAX_CACHE_DIR": str(tmp / "xla")}
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(SMOKE), "--tiny", *args], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    print(p.stdout[-3000:], p.stderr[-3000:])
    return p


def doctored(base: Path, out: Path) -> None:
    """The baseline made 2x better: times halved, rates doubled."""
    b = json.loads(base.read_text())
    for f in b["figures"].values():
        f["value"] *= 0.5 if f["better"] == "lower" else 2.0
    out.write_text(json.dumps(b))


def baseline_cycle(tmp: Path, *measure: str) -> dict:
    base, first = tmp / "baseline.json", tmp / "first.json"
    p = smoke(tmp, *measure, "--baseline", str(base), "--write-baseline", "--out", str(first))
    assert p.returncode == 0, "the first run writes the baseline"
    b = json.loads(base.read_text())
    assert b["mode"] == "tiny" and b["figures"], b
    assert all(f["better"] in ("lower", "higher") for f in b["figures"].values())
    assert "result" in p.stdout and "wrote baseline" in p.stdout

    p = smoke(tmp, "--from-json", str(first), "--baseline", str(base), "--out", str(tmp / "second.json"))
    assert p.returncode == 0 and "PASS" in p.stdout.splitlines()[-1], "the same figures pass against it"
    res = json.loads((tmp / "second.json").read_text())
    assert res["verdict"]["ok"]
    assert {r[0] for r in res["verdict"]["rows"] if r[4] == "PASS"} >= set(b["figures"])

    doctored(base, tmp / "better.json")
    p = smoke(tmp, "--from-json", str(first), "--baseline", str(tmp / "better.json"),
              "--out", str(tmp / "x.json"))
    assert p.returncode == 1, "a baseline 2x better fails every gated figure"
    rows = json.loads((tmp / "x.json").read_text())["verdict"]["rows"]
    assert {r[0] for r in rows if r[4] == "FAIL"} == set(b["figures"])

    p = smoke(tmp, "--from-json", str(first), "--baseline", str(tmp / "absent.json"),
              "--out", str(tmp / "y.json"))
    assert p.returncode == 2 and "no baseline" in p.stdout
    p = smoke(tmp, "--from-json", str(first), "--baseline", str(base), "--prior", "gpu_tests=1",
              "--out", str(tmp / "z.json"))
    assert p.returncode == 1 and "test part: gpu_tests" in p.stdout, "a failed test part fails the smoke"
    return json.loads(first.read_text())


def test_baseline_cycle_kernels(tmp_path):
    res = baseline_cycle(tmp_path, "--skip", "slice")
    names = set(res["figures"])
    assert any(n.startswith("mla decode") for n in names)
    assert sum(n.startswith(("fp8 grouped prefill", "bf16 grouped decode")) for n in names) == 4
    assert all(c["ok"] for c in res["checks"]), res["checks"]


@pytest.mark.slow
def test_baseline_cycle_everything(tmp_path):
    res = baseline_cycle(tmp_path)
    names = set(res["figures"])
    for want in ("bare b=1 decode step ms", "engine warmup s (cold)", "engine 1 request ITL p50 ms",
                 "engine 1 request tok/s", "engine 64 requests ITL p50 ms", "engine 64 requests tok/s"):
        assert want in names
    check = {c["name"]: c for c in res["checks"]}["engine loads compile nothing after warmup"]
    assert check["ok"], check
    assert res["warmup"]["compiles"] > 0


def test_default_baseline_is_the_cards_own():
    """Each card judged against its own committed baseline: an H100's figures never against the H200's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_smoke
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert gpu_smoke.default_baseline("NVIDIA H200").name == "baseline_h200.json"
    assert gpu_smoke.default_baseline("NVIDIA H100 80GB HBM3").name == "baseline_h100.json"
    assert gpu_smoke.default_baseline("cpu").name == "baseline_cpu.json"
    assert gpu_smoke.default_baseline("NVIDIA H200").exists()  # the committed one
