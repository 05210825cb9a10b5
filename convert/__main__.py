"""`python -m convert SRC DST` / `dsv3-convert`: the converter's command line.

Owns: argument parsing (`--dtype` spellings through dsv3_jax.cli), turning every expected failure
(invalid source, refused destination, a conversion already running, stale partial run, I/O errors)
into one line on stderr (a list when validation finds several problems) with a non-zero exit code,
and printing the closing summary. The work itself is `convert.converter.convert`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_INVALID = 2  # the source failed validation or the destination/options were refused
EXIT_FAILED = 1  # an I/O error or interruption during the run (rerun with --resume)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv3-convert",
        description="Convert a Hugging Face DeepSeek-V3 safetensors directory into a dsv3-jax checkpoint "
                    "(Orbax params + config + tokenizer files + manifest).")
    p.add_argument("src", type=Path, help="HF directory (model.safetensors.index.json + shards, config.json)")
    p.add_argument("dst", type=Path, help="destination directory (must not exist unless --force)")
    p.add_argument("--dtype", default="auto",
                   help="auto: keep the source's format (FP8 stays e4m3 + scales); bf16 (bfloat16): "
                        "dequantize/cast; fp8 (float8_e4m3fn): quantize a BF16 source into 128x128 blocks")
    p.add_argument("--ue8m0", action="store_true",
                   help="with --dtype fp8 on a BF16 source: power-of-two (UE8M0) block scales")
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP (next-token draft) layer")
    p.add_argument("--workers", type=int, default=4,
                   help="conversion threads (default 4: the work is I/O, threads overlap reads and writes)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing DST (only once the new one is complete)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion into DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--report-json", type=Path, help="also write the summary as JSON to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.workers < 1:
        print(f"dsv3-convert: error: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return EXIT_INVALID
    # Imported here so `--help` is instant (this pulls in jax through dsv3_jax).
    from convert.converter import ConvertError, convert
    from convert.validate import ValidationError
    from dsv3_jax.cli import UsageError, parse_dtype, report_error
    from dsv3_jax.config import ConfigError
    from dsv3_jax.formats.paths import PathContainmentError
    from dsv3_jax.formats.safetensors_io import SafetensorsError

    try:
        dtype = parse_dtype(args.dtype, ("auto", "bf16", "fp8"))
        report = convert(args.src, args.dst, dtype=dtype, ue8m0=args.ue8m0, include_mtp=not args.no_mtp,
                         workers=args.workers, force=args.force, resume=args.resume, progress=not args.quiet)
    except (ValidationError, ConvertError, ConfigError, UsageError, PathContainmentError) as e:
        report_error("dsv3-convert", e)
        return EXIT_INVALID
    except (SafetensorsError, OSError) as e:
        os_error = isinstance(e, OSError) and e.filename and e.strerror
        msg = f"{e.filename}: {e.strerror}" if os_error else str(e)
        print(f"dsv3-convert: error during conversion: {msg}; the partial work is kept: rerun with --resume "
              "to continue", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("dsv3-convert: interrupted; rerun with --resume to continue.", file=sys.stderr)
        return EXIT_FAILED
    print(report.table())
    if args.report_json:
        try:
            args.report_json.write_text(json.dumps(report.__dict__ | {"gb_per_s": report.gb_per_s}, indent=1))
        except OSError as e:
            print(f"dsv3-convert: the checkpoint is complete, but --report-json could not be written: "
                  f"{e.filename}: {e.strerror}", file=sys.stderr)
            return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
