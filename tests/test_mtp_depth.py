"""benchmarks/mtp_depth.py (issue 32 item 3) and step_profile's new options, run on CPU in --tiny mode.

mtp_depth: plain and spec_k = 2 through the engine (greedy tokens equal, acceptance counted) and the slice's
verify step beside the plain one; its margin check at a doctored difference; the speedup formula.
step_profile: --experts shrinks the slice, the memory check names the expert count that fits, and
--xla-variants compiles the first scanned slice's step under every XLA variant in one run; hlo_moves
(the census that traces a profile's memcpy kernels to their arrays) finds a compiled module's copies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import mtp_depth  # noqa: E402
import step_profile  # noqa: E402


def test_mtp_depth_tiny_runs_both_parts(tmp_path):
    res = mtp_depth.main(["--tiny", "--ks", "2", "--batches", "2", "--temperature", "0",
                          "--out", str(tmp_path / "m.json")])
    assert "engine_error" not in res and "slice_error" not in res
    runs = {r["spec_k"]: r for r in res["engine"]["runs"]}
    assert set(runs) == {0, 2} and runs[0]["accepted_per_step"] == 0.0
    assert all(r["compiles_during"] == 0 for r in runs.values())  # warmed before timing
    (check,) = res["engine"]["greedy_checks"]
    assert check["identical_prompts"] == check["prompts"] == 2 and check["differences"] == []
    steps = {r["spec_k"]: r for r in res["slice"]["steps"]}
    assert steps[2]["tokens"] == 3 * steps[0]["tokens"] == 6  # 2 rows of 1 + 2 tokens vs 2 rows of 1
    (row,) = res["table"]
    assert row["speedup_at_depth"] == pytest.approx((1 + row["accepted_per_step"]) / row["step_ratio"])
    assert (tmp_path / "m.json").exists()


def test_margins_at_a_difference():
    h, _ = mtp_depth.embedded_handle(tiny=True)
    prompts = [[5, 6, 7], [8, 9, 10]]
    plain = [[11, 12, 13], [14, 15, 16]]
    other = [[11, 12, 13], [14, 99, 16]]
    (d,) = mtp_depth.margins(h, prompts, plain, other)
    assert (d["prompt"], d["position"], d["plain_token"], d["other_token"]) == (1, 1, 15, 99)
    logits = h.forward([prompts[1] + plain[1]])[0, len(prompts[1])]  # predicts plain token 1
    assert d["plain_minus_other"] == pytest.approx(float(logits[15] - logits[99]), rel=1e-4, abs=1e-5)
    assert d["top2_margin"] >= 0


def test_step_profile_experts_and_variants(tmp_path):
    res = step_profile.main(["--tiny", "--moe-layers", "1,2", "--experts", "8", "--xla-variants",
                             "--out", str(tmp_path / "s.json")])
    assert res["experts"] == 8 and [r["moe_layers"] for r in res["rows"]] == [1, 2]
    # The variants run on the first slice with a real layer scan (2 MoE layers), not the 1-layer stack.
    variants = res["rows"][1]["xla_variants"]
    assert [v["variant"] for v in variants][:2] == ["default", "command buffers off"]
    assert "dynamic-slice fusion" in [v["variant"] for v in variants]
    assert all("wall" in v for v in variants), variants
    assert "xla_variants" not in res["rows"][0]


def test_xla_variants_by_name():
    """--xla-variants NAME,...: those variants after the default, in the order given; a typo is one line."""
    from engine_bench import XLA_VARIANTS, pick_variants

    assert list(pick_variants(None)) == list(XLA_VARIANTS) == list(pick_variants("all"))
    picked = pick_variants("cuBLAS GEMMs + dynamic-slice fusion, cuBLAS GEMMs")
    assert list(picked) == ["default", "cuBLAS GEMMs + dynamic-slice fusion", "cuBLAS GEMMs"]
    assert picked["cuBLAS GEMMs"] == {"xla_gpu_enable_triton_gemm": False}
    with pytest.raises(SystemExit, match="unknown XLA variant.*'cublas'"):
        pick_variants("cublas")


def test_step_profile_refuses_a_slice_too_big(monkeypatch):
    """1+8 at 256 experts (96 GB) on an 80 GB H100 (60 GB allocator limit): refused, naming --experts."""
    class Dev:
        def memory_stats(self):
            return {"bytes_limit": int(0.75 * 79.6 * 2**30)}

    monkeypatch.setattr(step_profile.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(step_profile.jax, "devices", lambda: [Dev()])
    args = argparse.Namespace(tiny=False, experts=0, bf16=False)
    with pytest.raises(SystemExit, match=r"1\+8 MoE layers need 96\.\d GB .*--experts 128"):
        step_profile.check_memory([2, 8], args)
    args.experts = 128
    gb = step_profile.check_memory([2, 4, 8], args)
    assert 50 < gb[8] < 53


def test_hlo_moves_finds_the_copies_of_a_compiled_module_with_their_sizes():
    f = jax.jit(lambda x: (jnp.transpose(x) * 1.0, x[:, :512]))
    text = f.lower(jnp.ones((1024, 1024), jnp.float32)).compile().as_text()
    moves = step_profile.hlo_moves(text, min_bytes=1 << 20)
    by_op = {m["op"]: m for m in moves}
    assert by_op["slice"]["shape"] == "f32[1024,512]" and by_op["slice"]["bytes"] == 1024 * 512 * 4
    assert any(m["op"] in ("transpose", "copy") and m["bytes"] == 1024 * 1024 * 4 for m in moves)
    assert [m["bytes"] for m in moves] == sorted((m["bytes"] for m in moves), reverse=True)
    assert all(m["computation"] for m in moves)
    # Below the size floor nothing is listed.
    assert step_profile.hlo_moves(text, min_bytes=1 << 30) == []
