"""The one interpret-mode policy of every public kernel function in ``pallas_kernels``.

Owns: what ``interpret=None`` means (Pallas' GPU interpreter whenever the default backend is not a
GPU, the compiled Mosaic GPU kernel on a GPU). Every public kernel takes ``interpret: bool | None =
None`` and resolves it here, so a kernel called on a CPU runs (slowly) instead of raising, and tests
can force either mode. Must not know about any kernel.
"""

from __future__ import annotations

import jax


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret`` itself when given; otherwise True off a GPU backend."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)
