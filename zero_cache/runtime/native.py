"""The csrc extensions ZeRO-Cache uses, built on first use with ``torch.utils.cpp_extension``.

A build that fails (no compiler, no source in a non-editable install) is logged once with the
reason, and the caller falls back to a library path; nothing else changes.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"

_FLAGS: dict[str, dict[str, list[str]]] = {
    # -fno-math-errno: sqrt must not set errno, or the Adam loop does not vectorise.
    "fused_host_adam": {"extra_cflags": ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                        "extra_ldflags": ["-fopenmp"]},
    "async_io": {"extra_cflags": ["-O2"]},
}


@functools.cache
def load_csrc(name: str) -> ModuleType | None:
    """``csrc/<name>.cpp`` compiled for this machine, or None (logged) if it cannot be built here."""
    source = CSRC / f"{name}.cpp"
    if not source.is_file():
        logger.warning("ZeRO-Cache native %s: %s is missing (install the project with `pip install -e .`); "
                       "using the library path", name, source)
        return None
    try:
        from torch.utils.cpp_extension import load

        if not _built(f"angelptm_{name}"):  # a minute or two of silence otherwise (issue 28)
            logger.info("ZeRO-Cache native %s: compiling %s for this machine (first use only, about a minute; "
                        "cached afterwards)", name, source.name)
        return load(name=f"angelptm_{name}", sources=[str(source)], verbose=False, **_FLAGS[name])
    except Exception as err:  # no compiler or ninja, or a toolchain error: the library path still works
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        logger.warning("ZeRO-Cache native %s did not build (%s: %s); using the library path",
                       name, type(err).__name__, first_line)
        return None


def _built(extension: str) -> bool:
    """Whether torch's extension cache already holds a build of ``extension`` (then loading it takes a moment;
    ninja still rebuilds it if the source changed)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private, hence the guard

        return any(Path(_get_build_directory(extension, verbose=False)).glob(f"{extension}*.so"))
    except Exception:  # noqa: BLE001 (a torch without it: say we are building, which is at worst early)
        return False
