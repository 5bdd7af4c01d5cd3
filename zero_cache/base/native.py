"""The csrc extensions ZeRO-Cache uses, built on first use with ``torch.utils.cpp_extension``.

A build that fails (no compiler, no source in a non-editable install) is logged once with the
reason, and the caller falls back to a library path; nothing else changes.

torch serializes builds with a lock file in the build directory, which the building process removes when it
ends, and every other process waits for it to go, with no limit. A build killed by a signal (a job's time limit,
a ``timeout``, SIGKILL) leaves the lock behind, and every later run then waits forever, silently, at its first
step: on an H100 a pytest killed at 90 s during the first build left it, and the next three runs printed nothing
until their own 90 s limits killed them. The lock's age cannot tell a killed build from a slow one, so our loads
of an extension also hold an ``flock`` on a file beside it (:data:`OWNER_FILE`), which the kernel lets go of when
its process dies, however it dies. Whoever holds that and still finds torch's lock knows it is a dead build's and
removes it (logged); whoever cannot take it waits for the process that holds it, which is alive. (A process that
loads the extension without this, an older version of ours, is not seen: its lock is waited for as before.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from types import ModuleType
from typing import Iterator

try:
    import fcntl
except ImportError:  # (not a POSIX system: torch's lock alone, as before)
    fcntl = None

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"

_FLAGS: dict[str, dict[str, list[str]]] = {
    # -fno-math-errno: sqrt must not set errno, or the Adam loop does not vectorise.
    "fused_host_adam": {"extra_cflags": ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                        "extra_ldflags": ["-fopenmp"]},
    "async_io": {"extra_cflags": ["-O2"]},
}

OWNER_FILE = "angelptm.owner"
"""The file in an extension's build directory whose ``flock`` a loading process holds (see the module docstring)."""


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

        with build_owned(f"angelptm_{name}"):
            if not _built(f"angelptm_{name}"):  # a minute or two of silence otherwise (issue 28)
                logger.info("ZeRO-Cache native %s: compiling %s for this machine (first use only, about a minute; "
                            "cached afterwards)", name, source.name)
            return load(name=f"angelptm_{name}", sources=[str(source)], verbose=False, **_FLAGS[name])
    except Exception as err:  # no compiler or ninja, or a toolchain error: the library path still works
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        logger.warning("ZeRO-Cache native %s did not build (%s: %s); using the library path",
                       name, type(err).__name__, first_line)
        return None


@contextlib.contextmanager
def build_owned(extension: str) -> Iterator[None]:
    """Hold ``extension``'s :data:`OWNER_FILE` lock for the block, waiting (logged) while another process holds it;
    once held, a torch build lock still in the directory is a dead build's, and is removed (logged). Without
    ``fcntl`` or a build directory, the block runs as torch alone would run it."""
    directory = _build_directory(extension)
    if directory is None or fcntl is None:
        yield
        return
    with open(directory / OWNER_FILE, "a+") as owner:
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("ZeRO-Cache native: waiting for another process's build or load of %s (it holds %s)",
                        extension, directory / OWNER_FILE)
            fcntl.flock(owner, fcntl.LOCK_EX)
        try:
            _remove_dead_lock(directory / "lock")
            yield
        finally:
            fcntl.flock(owner, fcntl.LOCK_UN)


def _remove_dead_lock(lock: Path) -> None:
    """Remove torch's build lock, which no live process of ours holds (the caller holds the owner's lock)."""
    try:
        lock.unlink()
    except FileNotFoundError:
        return
    logger.warning("ZeRO-Cache native: removed %s, a build lock that a killed build left (torch would wait for it "
                   "forever); building afresh", lock)


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
