"""What every command line of the project shares: dtype spellings, mesh strings, the one-line error exit.

Owns: the one table of `--dtype` spellings (`bf16`, `bfloat16`, `fp8`, `float8_e4m3fn`, ... mean the
same thing in `python -m convert`, `python -m dsv3_jax.generate` and `python -m dsv3_jax.plan`; each
CLI says which of them it takes), checking a `--mesh` string before anything is loaded, and
`report_error`: an expected failure becomes one line on stderr naming the thing, and a non-zero exit
code. A traceback from a CLI therefore means a bug. Must not import jax (the converter's CLI uses it
before deciding what to load).
"""

from __future__ import annotations

import sys

# spelling -> canonical name. Canonical names: auto, bf16, fp16, fp32, fp8.
_SPELLINGS = {
    "auto": "auto",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "f16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "f32": "fp32", "float": "fp32",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e4m3": "fp8", "e4m3": "fp8",
    "f8_e4m3": "fp8",
}
# canonical -> the numpy / jax dtype name (for compute dtypes)
NUMPY_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
EXIT_BAD_INPUT = 2


class UsageError(ValueError):
    """A command-line value is malformed or not available in this command."""


def parse_dtype(text: object, allowed: tuple[str, ...], flag: str = "--dtype", why: str = "") -> str:
    """The canonical name (auto | bf16 | fp16 | fp32 | fp8) of a `--dtype` spelling, if `allowed`.

    `why` explains, in the refusal, what the flag means in this command (e.g. that FP8 is a weight
    format chosen at conversion)."""
    if not isinstance(text, str):
        raise UsageError(f"{flag} must be a string, got {text!r}")
    canon = _SPELLINGS.get(text.strip().lower().replace("-", "_"))
    if canon is None:
        raise UsageError(f"{flag} {text!r}: unknown dtype; use one of {', '.join(allowed)} "
                         f"(spellings such as bfloat16 or float8_e4m3fn work too)")
    if canon not in allowed:
        raise UsageError(f"{flag} {text!r} ({canon}) is not available here: this command takes "
                         f"{', '.join(allowed)}{'; ' + why if why else ''}")
    return canon


def compute_dtype_name(dtype: object, flag: str = "dtype") -> str:
    """The numpy name (bfloat16 | float16 | float32) of a compute dtype given as any spelling above or
    as a numpy / jax dtype; FP8 is refused (a weight format, chosen at conversion)."""
    if not isinstance(dtype, str):
        import numpy as np

        try:
            dtype = np.dtype(dtype).name
        except TypeError:
            raise UsageError(f"{flag} {dtype!r} is not a dtype") from None
    canon = parse_dtype(dtype, ("bf16", "fp16", "fp32"), flag,
                        why="FP8 is a weight format chosen at conversion (python -m convert --dtype fp8); an "
                            "FP8 checkpoint stays FP8 whatever the compute dtype")
    return NUMPY_NAMES[canon]


def check_mesh(text: object, flag: str = "--mesh") -> str:
    """A `--mesh` string with stray commas and spaces removed; an empty one is refused (it would
    silently mean one device). The axis names and sizes are checked by `sharding.parse_mesh_spec`."""
    if not isinstance(text, str):
        raise UsageError(f"{flag} must be a string like 'tensor=8', got {text!r}")
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise UsageError(f"{flag} {text!r} is empty; give axis sizes like 'tensor=8' or 'data=2,expert=4' "
                         "(leave the flag out for one device)")
    if "" in parts[:-1]:
        raise UsageError(f"{flag} {text!r} has an empty item between commas")
    return ",".join(p for p in parts if p)


def report_error(prog: str, exc: BaseException) -> int:
    """Print `prog: error: <message>` on stderr and return the bad-input exit code.

    The message is the exception's text; a message spanning several lines (a list of validation
    problems) is kept whole, anything else is one line."""
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        msg = f"{exc.filename}: {exc.strerror}"
    elif isinstance(exc, KeyError):
        msg = f"missing key {msg}"
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT
