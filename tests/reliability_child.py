"""The converter process the kill test forks (kept apart from the test module so that a forked child
has nothing to import: the fork server preloads this module and the converter)."""

from __future__ import annotations

import os
import sys


def run_converter(argv: list[str], delay_env: str, delay: float) -> None:
    """Run the converter's CLI `main(argv)` in this (forked) process and exit with its code."""
    os.environ[delay_env] = str(delay)
    from convert.__main__ import main

    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process ends with this call
    os._exit(main(argv))
