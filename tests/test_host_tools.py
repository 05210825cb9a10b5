"""benchmarks/host_step_cost.py (the engine's host work per step, no device) and benchmarks/host_profile.py
(any script under cProfile, written even when stopped)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import host_profile  # noqa: E402
import host_step_cost  # noqa: E402


def test_host_step_cost_walks_the_long_prompt_in_bands():
    res = host_step_cost.main(["--decoders", "3", "--decode-ctx", "256", "--long-prompt", "4096",
                               "--prefill-attention-pairs", str(2**18), "--bands", "4"])
    bands = res["bands"]
    assert [b["prefix_from"] for b in bands] == [0, 1024, 2048, 3072]
    assert sum(b["steps"] for b in bands) == res["steps"] > 4
    # The cap (2^18 pairs) shrinks the chunks as the prefix grows: later bands take more steps.
    assert bands[-1]["steps"] > bands[0]["steps"]
    for b in bands:
        assert b["ms"]["p50"] > 0 and b["schedule"]["p50"] > 0 and b["build"]["p50"] > 0
        assert b["ms"]["p50"] >= b["schedule"]["p50"]
    # The host-only executor's tokens reached the decoders: each emitted one per step of the long prompt.
    assert res["decoder_output_at_end"] >= res["steps"]


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "work.py"
    p.write_text(textwrap.dedent(body))
    return p


def test_host_profile_writes_the_profile_and_its_tables(tmp_path, capsys):
    script = _script(tmp_path, """
        import sys
        def busy_function_here(n):
            return sum(i * i for i in range(n))
        busy_function_here(int(sys.argv[1]))
        sys.exit(3)
    """)
    out = tmp_path / "p.prof"
    argv = ["--out", str(out), "--top", "5", "--only", "work.py", "--", str(script), "20000"]
    assert host_profile.main(argv) == 3
    assert out.stat().st_size > 0
    text = capsys.readouterr().out
    assert "busy_function_here" in text and "=== by tottime (only work.py)" in text


def test_host_profile_survives_a_timeout(tmp_path):
    """SIGTERM (what `timeout` sends) mid-run: the profile is still written, with the function that ran."""
    script = _script(tmp_path, """
        import time
        def sleeping_loop():
            while True:
                time.sleep(0.01)
        print("started", flush=True)
        sleeping_loop()
    """)
    out = tmp_path / "t.prof"
    tool = str(ROOT / "benchmarks" / "host_profile.py")
    proc = subprocess.Popen([sys.executable, tool, "--out", str(out), "--", str(script)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 124 and out.stat().st_size > 0
    assert "sleeping_loop" in rest
