"""benchmarks/hlo_sources.py: profiled kernel names map to their HLO instruction and source module."""

import gzip
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    import hlo_sources
finally:
    sys.path.remove(str(BENCH))

_PATH = "jit(f)/Transformer/while/body/moe_layers"
HLO = "\n".join([
    "ENTRY %main {",
    f'  %loop_pad_fusion.6 = f8e4m3fn[768,7168]{{1,0}} fusion(%p.1), kind=kLoop, calls=%fc.3, '
    f'metadata={{op_name="{_PATH}/self_attn/kv_a_proj_with_mqa/jit(fp8_gemm)/pad" stack_frame_id=7}}',
    f'  %input_reduce_fusion.9 = f32[1,56]{{1,0}} fusion(%p.2), kind=kInput, calls=%fc.4, '
    f'metadata={{op_name="{_PATH}/mlp/shared_experts/up_proj/reduce_max"}}',
    f'  %sort.35 = (s32[8]{{0}}) sort(%p.3), dimensions={{0}}, metadata={{op_name="{_PATH}/mlp/argsort"}}',
    "}"])


def test_kernels_map_to_their_sources(tmp_path, capsys):
    table = hlo_sources.instructions(HLO)
    assert table["loop_pad_fusion_6"]["op"] == "fusion"
    assert hlo_sources.source(table["loop_pad_fusion_6"]["op_name"]) == ("self_attn", "pad")
    assert hlo_sources.source(table["input_reduce_fusion_9"]["op_name"]) == ("shared_experts", "reduce_max")
    assert hlo_sources.source(table["sort_35"]["op_name"]) == ("mlp", "argsort")
    kernels = [{"name": "loop_pad_fusion_6", "kind": "XLA fusion", "ms_per_call": 0.0076,
                "launches_per_call": 1},
               {"name": "sort_35", "kind": "other", "ms_per_call": 0.003, "launches_per_call": 2},
               {"name": "anonymous_mosaic_gpu_kernel", "kind": "Pallas", "ms_per_call": 0.2,
                "launches_per_call": 10}]
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"rows": [{"moe_layers": 2, "kernels": kernels}]}))
    hlo = tmp_path / "h.hlo.txt.gz"
    with gzip.open(hlo, "wt") as f:
        f.write(HLO)
    hlo_sources.main([str(prof), str(hlo)])
    out = capsys.readouterr().out
    assert "kv_a_proj_with_mqa/jit(fp8_gemm)/pad" in out
    assert "     7.6    1.0  XLA fusion" in out and "self_attn" in out.split("by kind and module")[1]
    assert "unmapped" in out  # the Pallas kernel has no instruction of its name
