"""Multi-host generation: `python -m dsv3_jax.generate` started as two local CPU processes (jax.distributed on
a loopback coordinator, 4 devices each, one mesh over all 8) gives the tokens of one process; process 0
alone prints results and the plan; the other replays process 0's engine steps (lockstep.follow)."""

from __future__ import annotations

import json
import re
import sys

import numpy as np

import dsv3_jax
from tests.test_distributed import free_port, spawn

MESH = "data=2,tensor=2,expert=2"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:\n    def push(self, x):"]
_GLOO_TEXT = re.compile(r"\[Gloo\]|Rank|is connected to|peer ranks|Expected number of connected|is :"
                        r"|[\d\s.:]")


def _without_gloo(text: str) -> str:
    return _GLOO_TEXT.sub("", text)


def test_generate_on_two_processes_matches_one(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    port = free_port()
    argv = [sys.executable, "-m", "dsv3_jax.generate", "--input-file", str(prompts), "--json",
            "--temperature", "0", "--max-new-tokens", "6", "--dtype", "fp32", "--mesh", MESH,
            "--device-memory", "420MB",
            "--max-model-len", "512", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
            "--peer-timeout", "30"]
    procs = spawn(lambda i: [*argv, "--process-id", str(i)], devices=4)
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    rows = [json.loads(ln) for ln in outs[0][0].splitlines() if ln.startswith("{")]
    assert [r["index"] for r in rows] == [0, 1, 2]
    # Output only on process 0. gloo's connection lines ("[Gloo] Rank 1 is connected to 3 peer ranks. Expected
    # number of connected peer ranks is : 3") come from several threads, unbuffered, and interleave mid-line
    # (CI once saw a lone "3"), so strip gloo's words and the digits/punctuation between them from the whole
    # text: anything left (a JSON row, the plan, a warning) is process 1 printing what it must not.
    assert _without_gloo(outs[1][0]) == "", outs[1][0][-2000:]
    assert "KV tokens per shard" in outs[0][1] and "KV tokens per shard" not in outs[1][1]  # the plan, once

    handle = dsv3_jax.load(None, mesh=MESH, dtype="float32")  # one process, the same 8-device mesh
    want = handle.generate([handle.tokenizer.encode(p) for p in PROMPTS], max_new_tokens=6, temperature=0)
    assert [r["token_ids"] for r in rows] == [w.token_ids for w in want]
    assert np.mean([len(w.token_ids) for w in want]) > 1
