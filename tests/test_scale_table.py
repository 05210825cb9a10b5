"""benchmarks/scale_table.py (DeepSeek-V3 on 8/16/32 H200s on paper): the script runs and writes its table
between the README markers, and its terms are consistent: each time is its bytes (or FLOPs) over its rate
(a term doubles when its bytes double or its bandwidth halves), the comm bytes are comm_volume's closed
form, the HBM bytes are the planner's weights less what a step does not read, and tok/s follows from the
step."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import comm_volume  # noqa: E402
import scale_table as st  # noqa: E402

from dsv3_jax import plan as planner  # noqa: E402
from dsv3_jax.parallel import sharding  # noqa: E402

CFG = planner.load_config("deepseek-v3")
HW, CAL = st.Hardware(), st.Calibration()


def _est(mesh="expert=8", dtype="fp8", batch=256, mtp=False, context=1024, hw=HW, cal=CAL):
    return st.estimate(CFG, mesh, dtype, batch, context=context, mtp=mtp, hw=hw, cal=cal)


def test_script_writes_the_table_between_markers(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# launch\n\nbefore\n{st.BEGIN}\nold table\n{st.END}\nafter\n")
    assert st.main(["--write-readme", str(readme), "--json", str(tmp_path / "rows.json")]) == 0
    doc = readme.read_text()
    assert "old table" not in doc and doc.startswith("# launch\n\nbefore\n") and doc.endswith("after\n")
    body = doc[doc.index(st.BEGIN):doc.index(st.END)]
    assert body.count("\n| 8 |") >= 8 and "\n| 16 |" in body and "\n| 32 |" in body
    assert "| 8 | BF16 | `expert=8` |" in body and "does not fit" in body  # 1.34 TB of BF16 on 8 GPUs
    assert "| 16 | BF16 | `tensor=2,expert=8` |" in body and "per user" in body and "per GPU" in body
    assert capsys.readouterr().out.strip().startswith("| GPUs |")
    fresh = tmp_path / "fresh.md"
    fresh.write_text("# x\n")
    st.write_readme("T", fresh)
    assert fresh.read_text() == f"# x\n\n{st.BEGIN}\nT\n{st.END}\n"


def test_terms_scale_with_their_bytes_and_rates():
    base = _est()
    slow_hbm = _est(hw=dataclasses.replace(HW, hbm_copy=HW.hbm_copy / 2))
    assert slow_hbm["hbm_ms"] == pytest.approx(2 * base["hbm_ms"], rel=1e-3)
    slow_nv = _est(mesh="tensor=8", hw=dataclasses.replace(HW, nvlink=HW.nvlink / 2))
    assert slow_nv["nvlink_ms"] == pytest.approx(2 * _est(mesh="tensor=8")["nvlink_ms"], rel=1e-3)
    # Twice the context: the latent cache bytes double, and the HBM term grows by exactly their time.
    long = _est(context=2048)
    assert long["kv_bytes"] == 2 * base["kv_bytes"]
    assert long["hbm_ms"] - base["hbm_ms"] == pytest.approx(base["kv_bytes"] / HW.hbm_copy * 1e3, rel=1e-3)
    # Twice the decode tokens per shard (MTP's verify): the all-to-all/all-gather bytes double.
    b1, b2 = comm_volume.count(CFG, sharding.parse_mesh_spec("expert=8"), 32), comm_volume.count(
        CFG, sharding.parse_mesh_spec("expert=8"), 64)
    assert sum(b2.values()) == pytest.approx(2 * sum(b1.values()), rel=1e-9)
    # The link split: the two-host BF16 layout sends its expert traffic 4/7 over IB (4 of 7 peers on the other
    # host), its tensor pairs stay on NVLink; one-host layouts use no IB.
    s = sharding.parse_mesh_spec("tensor=2,expert=8")
    assert st.off_host_share(s, "expert", 8) == pytest.approx(4 / 7)
    assert st.off_host_share(s, "tensor", 8) == 0
    r = _est(mesh="tensor=2,expert=8", dtype="bf16")
    expert_bytes = sum(v for k, v in comm_volume.count(CFG, s, 32).items() if k != "all-reduce")
    assert r["ib_bytes"] == pytest.approx(expert_bytes * 4 / 7, rel=1e-9)
    assert r["ib_ms"] == pytest.approx(r["ib_bytes"] / HW.ib * 1e3, abs=1e-3)
    assert _est()["ib_bytes"] == 0 and _est(mesh="data=4,expert=8")["ib_bytes"] == 0


def test_bytes_match_the_planner_and_the_comm_formula():
    # Batch 256 on EP=8 touches every local expert: the step reads all weights but the embedding table
    # (a gather), plus the cache of its 32 sequences.
    r = _est()
    sizes = sharding.parse_mesh_spec("expert=8")
    p = planner.plan(CFG, sizes, dtype="fp8", max_seq_len=1024, device_memory=int(HW.memory),
                     include_mtp=False)
    w = st.weight_bytes(CFG, "fp8", sizes, mtp=False)
    assert w["dense"] + w["experts"] + w["embed"] == p.weight_bytes_per_device
    assert r["expert_share_read"] == 1.0
    assert r["hbm_bytes"] == pytest.approx(p.weight_bytes_per_device - w["embed"] + r["kv_bytes"], rel=1e-9)
    assert r["kv_bytes"] == 32 * 1024 * 576 * 2 * 61
    # Batch 1: a token's 8 experts over <= 4 of 8 GPUs (group limit): the busiest holds 2 to 8 of them.
    one = _est(batch=1)
    assert 2 / 32 <= one["expert_share_read"] <= 8 / 32
    assert one["comm_bytes"] == pytest.approx(sum(comm_volume.count(CFG, sizes, 1).values()), rel=1e-9)
    tp = _est(mesh="tensor=8")
    tsz = sharding.parse_mesh_spec("tensor=8")
    want = sum(comm_volume.count(CFG, tsz, 256).values()) + comm_volume.sampling_gather(CFG, tsz, 256)
    assert tp["comm_bytes"] == pytest.approx(want, rel=1e-9) and tp["ib_bytes"] == 0


def test_step_is_the_sum_and_rates_follow():
    for r in (_est(), _est(batch=1, mtp=True), _est(mesh="tensor=2,expert=8", dtype="bf16")):
        parts = max(r["hbm_ms"], r["compute_ms"]) + r["excess_ms"] + r["nvlink_ms"] + r["ib_ms"]
        assert r["step_ms"] == pytest.approx(parts + r["latency_ms"], abs=1e-3)
        per_gpu = r["batch"] * r["tokens_per_step"] / r["step_ms"] * 1e3 / r["gpus"]
        # tok_s_gpu is rounded to 0.1 (half a step of error) and step_ms to 1e-3 ms (< 1e-4 relative here)
        assert r["tok_s_gpu"] == pytest.approx(per_gpu, abs=0.05 + 1e-4 * per_gpu)
    # Batch 1: the measured excess is the fixed part plus one per layer (one more with the MTP layer).
    assert _est(batch=1)["excess_ms"] == pytest.approx((CAL.fixed_s + 61 * 165e-6) * 1e3, abs=1e-3)
    assert _est(batch=1, mtp=True)["excess_ms"] == pytest.approx((CAL.fixed_s + 62 * 165e-6) * 1e3, abs=1e-3)
    assert _est(batch=1, mtp=True)["tokens_per_step"] == 1 + CAL.acceptance
    assert math.isclose(CAL.ratio_large, 18.31 / 11.93)
