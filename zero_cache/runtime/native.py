"""The csrc extensions ZeRO-Cache uses, built on first use with ``torch.utils.cpp_extension``.

A build that fails (no compiler, no source in a non-editable install) is logged once with the
reason, and the caller falls back to a library path; nothing else changes.

torch serializes builds with a lock file in the build directory, which the building process removes when it
ends, and every other process waits for it to go, with no limit. A build killed by a signal (a job's time limit,
a ``timeout``, SIGKILL) leaves the lock behind, and every later run then waits forever, silently, at its first
step: on an H100 a pytest killed at 90 s during the first build left it, and the next three runs printed nothing
until their own 90 s limits killed them.
So a lock older than :data:`STALE_LOCK_SECONDS` (a build takes about a minute) is removed, with a warning that
names it, and a younger one is waited for with a log line that says what is awaited.
"""

from __future__ import annotations

import functools
import logging
import os
import time
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

STALE_LOCK_SECONDS = 600.0
"""Age past which torch's build lock is taken for one a killed build left: ten builds' time."""


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

        clear_stale_lock(f"angelptm_{name}")
        if not _built(f"angelptm_{name}"):  # a minute or two of silence otherwise (issue 28)
            logger.info("ZeRO-Cache native %s: compiling %s for this machine (first use only, about a minute; "
                        "cached afterwards)", name, source.name)
        return load(name=f"angelptm_{name}", sources=[str(source)], verbose=False, **_FLAGS[name])
    except Exception as err:  # no compiler or ninja, or a toolchain error: the library path still works
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        logger.warning("ZeRO-Cache native %s did not build (%s: %s); using the library path",
                       name, type(err).__name__, first_line)
        return None


def clear_stale_lock(extension: str, *, clock=time.time, sleep=time.sleep) -> None:
    """Return once ``extension``'s build directory holds no build lock: wait while another process's build holds a
    young one, remove one older than :data:`STALE_LOCK_SECONDS` (logged), return at once where there is none."""
    directory = _build_directory(extension)
    if directory is None:
        return
    lock = directory / "lock"
    announced = False
    while True:
        try:
            seen = lock.stat()
        except FileNotFoundError:
            return
        age = clock() - seen.st_mtime
        if age >= STALE_LOCK_SECONDS:
            _remove_if_unchanged(lock, seen, age)
            return
        if not announced:
            logger.info("ZeRO-Cache native: waiting for another process's build of %s (its lock %s is %.0f s old; "
                        "one older than %.0f s is taken for a killed build's and removed)",
                        extension, lock, age, STALE_LOCK_SECONDS)
            announced = True
        sleep(min(5.0, STALE_LOCK_SECONDS - age))


def _remove_if_unchanged(lock: Path, seen: os.stat_result, age: float) -> None:
    """Remove ``lock`` if it is still the file ``seen`` (a process that removed it and took a new one in between
    keeps its own; the window between this check and the removal is a few microseconds)."""
    try:
        now = lock.stat()
        if (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
            return
        lock.unlink()
    except FileNotFoundError:
        return
    logger.warning("ZeRO-Cache native: removed %s, a build lock %.0f s old that a killed build left (torch would "
                   "wait for it forever); building afresh", lock, age)


def _build_directory(extension: str) -> Path | None:
    """Where torch builds ``extension`` (its extension cache), or None where this torch does not say."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private, hence the guard

        return Path(_get_build_directory(extension, verbose=False))
    except Exception:  # noqa: BLE001 (a torch without it: no lock is looked for, as before)
        return None


def _built(extension: str) -> bool:
    """Whether torch's extension cache already holds a build of ``extension`` (then loading it takes a moment;
    ninja still rebuilds it if the source changed)."""
    directory = _build_directory(extension)
    return directory is not None and any(directory.glob(f"{extension}*.so"))
