"""Collective bytes of the compiled program (benchmarks/comm_volume.py) on 8 virtual CPU devices: a 3-layer
DeepSeek-V3 at full width (1 dense + 2 MoE layers, bf16) partitioned for TP=8 and EP=8: every collective
that carries activations is bf16, no routing intermediate crosses a device (each device routes its own
tokens), one all-reduce per MoE block under TP, and the partitioned module's bytes equal the closed form,
at decode (all-gather dispatch) and prefill (per-destination all-to-all, at the DeepEP-style minimum)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import comm_volume as cv  # noqa: E402

from dsv3_jax.config import ModelConfig  # noqa: E402
from dsv3_jax.parallel import sharding  # noqa: E402

CFG = ModelConfig.preset("deepseek-v3").replace(num_hidden_layers=3, first_k_dense_replace=1, vocab_size=4096,
                                                num_nextn_predict_layers=0)


def _collectives(text: str) -> list[tuple[str, str]]:
    """(kind, result shape text) of every collective in an HLO module."""
    return [(m.group("kind"), m.group("shape")) for m in map(cv._OP.search, text.splitlines()) if m]


@pytest.mark.parametrize("spec,tokens", [("tensor=8", 1), ("expert=8", 2), ("expert=8", 256)])
def test_partitioned_bytes_are_bf16_and_match_the_formula(spec, tokens, monkeypatch):
    captured = {}
    real = cv.compile_partitioned

    def keep(fn, args, mesh):
        captured["text"], final = real(fn, args, mesh)
        return captured["text"], final

    monkeypatch.setattr(cv, "compile_partitioned", keep)
    hlo, cpu, _ = cv.hlo_count(CFG, spec, tokens, 8)
    hlo = {k: v for k, v in hlo.items() if v}  # a psum over a 1-device axis moves nothing
    sizes = sharding.resolve_sizes(spec, 8)
    want = cv.count(CFG, sizes, tokens)
    assert set(hlo) == set(want), (hlo, want)
    assert all(hlo[k] == pytest.approx(want[k], rel=1e-6) for k in want), (hlo, want)
    d = CFG.hidden_size
    for kind, shape in _collectives(captured["text"]):
        if re.search(rf"\b{d}\]", shape) or re.search(rf",{d}\]", shape):  # carries [.., D] activations
            assert shape.startswith("bf16") or "(bf16" in shape, f"{kind} {shape}: not bf16"
        assert str(CFG.n_routed_experts) + "]" not in shape, f"{kind} {shape}: router scores travel"
    # The CPU back end promotes them to fp32 (why the report counts the partitioned module).
    assert sum(cpu.values()) > 1.9 * sum(hlo.values())
    if sizes["expert"] > 1:  # EP=8, DeepSeek-V3 routing: the DeepEP-style minimum, ids and weights aside
        assert sum(hlo.values()) <= 1.01 * cv.deepep_min(CFG, sizes, tokens)
    else:  # TP=8: the embedding, o_proj + MLP in the dense layer, o_proj + one for the whole MoE block
        n_ar = sum(k == "all-reduce" for k, _ in _collectives(captured["text"]))
        assert n_ar == 1 + 2 * CFG.n_dense_layers + 2, n_ar  # the MoE stack is one scanned body
