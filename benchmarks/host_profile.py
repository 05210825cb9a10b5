"""Run a benchmark script under Python's cProfile and print where the host's time went.

    python3 benchmarks/host_profile.py --out $OUT/stall.prof [--top 30] [--only dsv3_jax/engine] \\
        -- benchmarks/long_context.py --tasks stall ...

The script runs as `__main__` with its own arguments (after `--`). The profile is written (and the
tables printed) also when the script raises or the run is stopped by SIGTERM (`timeout`), so a run cut
short still says where its time went. Tables: the functions with the most own time, and the most
cumulative time, each limited to --top rows; paths are shortened to the package.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import runpy
import signal
import sys
from pathlib import Path


def tables(prof_path: Path, top: int, only: str | None = None) -> str:
    """The profile's own-time and cumulative-time tables, `top` rows each; `only`: a regular expression
    the rows' file paths must match (e.g. "dsv3_jax/engine": the engine's own functions)."""
    out = io.StringIO()
    st = pstats.Stats(str(prof_path), stream=out)
    for key in ("tottime", "cumulative"):
        out.write(f"\n=== by {key}{f' (only {only})' if only else ''}\n")
        st.sort_stats(key).print_stats(*([only] if only else []), top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: host_profile.py --out FILE [--top N] -- SCRIPT [ARGS...]")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where the cProfile data goes (pstats format)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--only", help="a regular expression on file paths: only those rows in the tables")
    args = ap.parse_args(argv[:cut])
    script, script_args = argv[cut + 1], argv[cut + 2:]
    # SIGTERM (timeout's signal) becomes SystemExit, so the profile below is still written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    prof = cProfile.Profile()
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python3 SCRIPT` would
    rc = 0
    try:
        prof.enable()
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        prof.disable()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(args.out))
        print(tables(args.out, args.top, args.only), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
