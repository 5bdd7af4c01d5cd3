"""One writer per ``save_dir``: a lock file that names its holder, and the names of a save's leftovers.

Two jobs saving into one directory deleted each other's in-progress ``.tmp-*`` directories (9 of 24 saves
failed) and pruned each other's checkpoints. The first save into a directory (or ``pretrain.py`` at its
start) takes ``save_dir/.writer.lock``: an ``flock`` held for the life of the process, and the file's text
names the holder (pid, host, start time) for the message another process gets. The kernel drops an
``flock`` when its process dies however it dies, so a crashed holder's lock is taken over with nothing to
clean up. (On filesystems where ``flock`` is not shared between hosts, two hosts are not kept apart.) A clean
end (``pretrain.py`` finishing or interrupted, ``engine.destroy()``) gives the lock back and empties the file, so
the next holder does not report taking it over from a process that is gone.

The lock file is a name in a directory others may write to: a symlink or hard link there would carry the
holder's JSON into a file outside the run, a FIFO would block reading the holder forever, a 20 GiB sparse file
would be read into memory. So it is opened with ``O_NOFOLLOW | O_NONBLOCK`` after an ``lstat``, refused (by name,
with "remove it") unless it is a regular file, and the holder is read from the open descriptor, at most 4 KiB,
and shown only as fields of their kind (a pid, a host name, a time). A lock file with more than one link (a run
directory snapshotted with ``cp -al run run.snap`` shares it with the snapshot) is locked all the same but never
written: its contents may belong to another tree, so another writer is told the holder is unknown.

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
import stat
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
        self._unwritten: set[str] = set()
        """Locks whose file has other hard links: the holder is not written into it, nor the file emptied."""
        self._users: dict[str, int] = {}
        """Real path -> how many engines of this process saved there (:meth:`join`): the flock is one per process,
        so one engine's ``destroy()`` must not give back the lock another live engine still writes under."""

    def join(self, save_dir: str | os.PathLike) -> str:
        """Count one more user (an engine saving into ``save_dir``) of its lock; returns the real path to
        :meth:`leave` it by (resolved now, so a later ``os.chdir`` or a moved symlink does not lose it)."""
        key = os.path.realpath(save_dir)
        self._users[key] = self._users.get(key, 0) + 1
        return key

    def leave(self, key: str) -> None:
        """One user of the lock at ``key`` (a real path from :meth:`join`) less; the last one gives it back."""
        remaining = self._users.pop(key, 0) - 1
        if remaining > 0:
            self._users[key] = remaining
        else:
            self.release(key)

    def hold(self, save_dir: str | os.PathLike) -> None:
        """Take ``save_dir``'s writer lock, or keep it if this process holds it already.

        Raises:
            CheckpointError: another live process holds it (named), or the lock file is not one the engine can
                write safely (a symlink, hard link, FIFO, directory; or the directory is not writable).
        """
        key = os.path.realpath(save_dir)
        if key in self._held:
            return
        path = Path(key) / LOCK_FILE
        fd = _open_lock_file(path)
        linked = os.fstat(fd).st_nlink > 1  # shared with another tree (cp -al): lock it, never write into it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = f"{_UNKNOWN}: {path} has other hard links, so no holder is written into it" if linked \
                else _describe(fd)
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"cannot lock {path}: {err}") from None
            raise CheckpointError(f"{save_dir!s} is being written by another process ({holder}): two jobs "
                                  "saving into one directory destroy each other's checkpoints. Give this run its "
                                  "own save_dir (pretrain.py --save-dir), or stop the other job first") from None
        if linked:
            self._held[key] = fd
            self._unwritten.add(key)
            return
        previous = _describe(fd)
        os.ftruncate(fd, 0)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started_at_unix": round(time.time(), 3)}
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        if previous != _UNKNOWN:  # a holder that released its lock left the file empty
            logger.info("took over the writer lock of %s from a process that is gone (%s)", save_dir, previous)
        self._held[key] = fd

    def release(self, save_dir: str | os.PathLike) -> None:
        """Give ``save_dir``'s lock back. The file stays (removing it would let two processes lock two different
        files of one name) but is emptied first, so the next holder has no one to report taking it over from. It
        is given back whatever :meth:`join` counted (a job's end: ``pretrain.py``)."""
        key = os.path.realpath(save_dir)
        self._users.pop(key, None)
        fd = self._held.pop(key, None)
        if fd is None:
            return
        try:
            if key in self._unwritten:
                self._unwritten.discard(key)
            else:
                os.ftruncate(fd, 0)
        except OSError:  # the lock is given back all the same
            pass
        finally:
            os.close(fd)  # closing the last descriptor drops the flock


_UNKNOWN = "holder unknown"
_MAX_HOLDER_BYTES = 4096
"""The holder's JSON is under 100 bytes; reading more would let a planted 20 GiB file fill the memory."""
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def _open_lock_file(path: Path) -> int:
    """A read-write descriptor of the lock file, created if missing.

    The holder's name is written into it, so anything but a regular file is refused before it is written: a
    symlink would carry the write to a file outside the run, a FIFO would block the read of the holder's name, a
    device is never opened. (A file with other hard links is returned: the caller locks it without writing.)

    Raises:
        CheckpointError: naming the file, what it is, and that removing it is the fix.
    """
    remedy = f"remove it (rm {str(path)!r}): the engine creates a plain file there"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise CheckpointError(f"cannot inspect the writer lock {path}: {err.strerror or err}") from None
    if mode is not None and stat.S_ISLNK(mode):
        raise CheckpointError(f"the writer lock {path} is a symbolic link, which the engine never writes through "
                              f"(it would overwrite the file it leads to); {remedy}")
    if mode is not None and not stat.S_ISREG(mode):
        raise CheckpointError(f"the writer lock {path} is not a regular file (a directory, FIFO or device); {remedy}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:  # ELOOP: it became a symlink after the lstat
        raise CheckpointError(f"cannot open the writer lock {path}: {err.strerror or err}; it must be a plain "
                              f"file in a directory this user can write: {remedy}, or point save_dir at a "
                              "writable directory") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"the writer lock {path} is not a regular file (it was replaced while being opened); "
                              f"{remedy}")
    return fd


def _describe(fd: int) -> str:
    """The holder a lock file names, for messages: read from the open lock (at most a few KiB), and only the
    fields' values that fit their kind (a pid, a host name, a time), never the file's other bytes."""
    try:
        holder = json.loads(os.pread(fd, _MAX_HOLDER_BYTES, 0))
        pid, host, since = int(holder["pid"]), str(holder["host"]), float(holder["started_at_unix"])
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return _UNKNOWN
    if not _HOST_NAME.fullmatch(host):
        return _UNKNOWN
    return f"pid {pid} on {host}, since {started}"


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
