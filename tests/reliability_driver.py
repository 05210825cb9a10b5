"""Runs many command-line cases in one interpreter: `python -m tests.reliability_driver CASES OUT`.

CASES is a JSON list of {"cli": "convert" | "generate" | "plan", "argv": [...]}; each case calls that
CLI's real `main(argv)` with stdout and stderr captured; OUT receives, per case, the exit code, both
streams and, if an exception escaped `main` (a bug: the CLIs must turn expected failures into one
line), its traceback. Used by the reliability tests and benchmarks/hostile_inputs.py so that dozens of
CLI cases cost one interpreter start instead of one each.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import traceback

MAINS = {"convert": "convert.__main__", "generate": "dsv3_jax.generate", "plan": "dsv3_jax.plan"}


def run_case(cli: str, argv: list[str]) -> dict:
    """One CLI call: {"code", "stdout", "stderr", "traceback"}."""
    main = importlib.import_module(MAINS[cli]).main
    out, err = io.StringIO(), io.StringIO()
    code, tb = None, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own usage errors
            code = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 - reported to the caller as a bug
            tb = traceback.format_exc()
    return {"code": code, "stdout": out.getvalue()[-4000:], "stderr": err.getvalue()[-4000:], "traceback": tb}


def main(argv: list[str]) -> int:
    cases = json.loads(open(argv[0]).read())
    results = [run_case(c["cli"], c["argv"]) for c in cases]
    with open(argv[1], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
