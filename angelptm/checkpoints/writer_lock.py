"""One writer per ``save_dir``: a lock file that names its holder, and the names of a save's leftovers.

Two jobs saving into one directory deleted each other's in-progress ``.tmp-*`` directories (9 of 24 saves
failed) and pruned each other's checkpoints. The first save into a directory (or ``pretrain.py`` at its
start) takes ``save_dir/.writer.lock``: an ``flock`` held for the life of the process, and the file's text
names the holder (pid, host, start time) for the message another process gets. The kernel drops an
``flock`` when its process dies however it dies, so a crashed holder's lock is taken over with nothing to
clean up. (On filesystems where ``flock`` is not shared between hosts, two hosts are not kept apart.)

A save's temporary directory is ``.tmp-<pid>-<host id>-<random>-<tag>``: the cleanup at the next save removes
only those whose process is gone (same host, pid not alive), never a live save's.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import time
import zlib
from pathlib import Path

from angelptm.checkpoints.paths import LOCK_FILE
from angelptm.errors import CheckpointError

logger = logging.getLogger(__name__)


class SaveDirLocks:
    """The ``save_dir`` locks this process holds (an ``flock`` belongs to an open file: the descriptors stay open
    while the process runs, or until :meth:`release`)."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def hold(self, save_dir: str | os.PathLike) -> None:
        """Take ``save_dir``'s writer lock, or keep it if this process holds it already.

        Raises:
            CheckpointError: another live process holds it (named), or the directory cannot hold a lock file.
        """
        key = os.path.realpath(save_dir)
        if key in self._held:
            return
        path = Path(key) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise CheckpointError(f"cannot create the writer lock {path}: {err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"cannot lock {path}: {err}") from None
            raise CheckpointError(f"{save_dir!s} is being written by another process ({_describe(path)}): two jobs "
                                  "saving into one directory destroy each other's checkpoints. Give this run its "
                                  "own save_dir (pretrain.py --save-dir), or stop the other job first") from None
        previous = _describe(path)
        os.ftruncate(fd, 0)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started_at_unix": round(time.time(), 3)}
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        if previous != "holder unknown":
            logger.info("took over the writer lock of %s from a process that is gone (%s)", save_dir, previous)
        self._held[key] = fd

    def release(self, save_dir: str | os.PathLike) -> None:
        """Give ``save_dir``'s lock back (the file stays; the next holder rewrites it)."""
        fd = self._held.pop(os.path.realpath(save_dir), None)
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


def _describe(path: Path) -> str:
    """The holder a lock file names, for messages."""
    try:
        holder = json.loads(path.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["started_at_unix"])))
        return f"pid {int(holder['pid'])} on {holder['host']}, since {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


LOCKS = SaveDirLocks()
"""This process's locks: a process-wide resource like its open files, so one table per process."""

_HOST_ID = f"{zlib.crc32(socket.gethostname().encode()):08x}"
_TMP_NAME = re.compile(r"\.tmp-(\d+)-([0-9a-f]{8})-[0-9a-f]{8}-(.+)")


def temporary_name(tag: str) -> str:
    """A fresh temporary directory name for a save of ``tag`` by this process."""
    return f".tmp-{os.getpid()}-{_HOST_ID}-{secrets.token_hex(4)}-{tag}"


def temporary_is_stale(name: str) -> bool:
    """Whether a ``.tmp-*`` directory was left by a save whose process is gone (this host's, pid not alive).

    Names without a pid (written by earlier versions) count as stale: they are only cleaned by the process
    holding the writer lock, so no live writer of this version owns them.
    """
    match = _TMP_NAME.fullmatch(name)
    if match is None:
        return name.startswith(".tmp-")
    pid, host = int(match.group(1)), match.group(2)
    return host == _HOST_ID and pid != os.getpid() and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
