"""The csrc extensions ZeRO-Cache uses, built on first use with ``torch.utils.cpp_extension``.

A build that fails (no compiler, no source in a non-editable install) is logged once with the
reason, and the caller falls back to the library path; nothing else changes.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"


@functools.cache
def fused_host_adam() -> ModuleType | None:
    """``csrc/fused_host_adam.cpp`` compiled for this CPU, or None if it cannot be built here."""
    source = CSRC / "fused_host_adam.cpp"
    if not source.is_file():
        logger.warning("ZeRO-Cache native host Adam: %s is missing (install the project with `pip install -e .`); "
                       "using the library CPU Adam", source)
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="angelptm_fused_host_adam", sources=[str(source)], verbose=False,
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as err:  # no compiler or ninja, or a toolchain error: the library path still works
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        logger.warning("ZeRO-Cache native host Adam did not build (%s: %s); using the library CPU Adam",
                       type(err).__name__, first_line)
        return None
