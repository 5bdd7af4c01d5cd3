"""Names inside a checkpoint directory: which tags are allowed, and reading only what lies inside.

Everything read from a checkpoint directory names a path: the ``latest`` file, a tag given to
``load_checkpoint(tag=...)`` or the export tool's ``--tag``, the file names of a manifest. A checkpoint is
data anyone may hand over, so none of those is trusted: a name must be one plain directory or file name
(no ``..``, no separator, no NUL byte, not hidden), resolve inside its directory (a symlink may not lead
out), and name a regular file or directory of the kind expected (``/dev/zero`` would be hashed forever).
Anything else makes the checkpoint damaged: following ``latest`` then falls back to the newest older
checkpoint, as for any damaged one, and an explicit tag is refused by name.

Tags are also refused when they would collide with what the engine writes into ``save_dir`` (``latest``,
the writer lock, hidden ``.tmp-*`` / ``.old-*`` directories) or into a checkpoint (``manifest.json``, the
``.pt`` files): ``save_checkpoint(tag="latest")`` once moved the pointer aside and lost the run.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from angelptm.errors import CheckpointError

LATEST = "latest"
LATEST_UNTRUSTED = "latest.untrusted"
"""What ``latest`` is renamed to when the run that wrote it trusts none of its checkpoints (``pretrain.py``'s run
health): a rerun must not resume the weights that diverged, and the tag stays there to read."""
MODEL_FILE = "model_states.pt"
OPTIM_FILE = "optim_states.pt"
LOCK_FILE = ".writer.lock"
"""In ``save_dir``: names the process that writes checkpoints there (``angelptm.checkpoints.writer_lock``)."""
MANIFEST_FILE = "manifest.json"
"""Each checkpoint's list of files with their sizes and checksums (:mod:`angelptm.checkpoints.manifest`)."""
RESERVED_TAGS = frozenset({LATEST, LATEST_UNTRUSTED, MANIFEST_FILE, MODEL_FILE, OPTIM_FILE, LOCK_FILE})
_RANK_FILE = re.compile(r"rank_\d+_states\.pt")
MAX_LATEST_BYTES = 4096
"""``latest`` holds one tag; a larger file is not one this engine wrote."""
_NAME_MAX_BYTES = 255


def name_problem(name: object) -> str | None:
    """Why ``name`` is not one plain, non-hidden file or directory name (None when it is)."""
    if not isinstance(name, str) or not name:
        return "is not a non-empty string"
    if "\x00" in name:
        return "holds a NUL byte"
    if "/" in name or "\\" in name or (os.altsep is not None and os.altsep in name):
        return "holds a path separator (a tag is one directory name inside save_dir)"
    if name.startswith("."):
        return "starts with '.' (hidden names, '.' and '..' are refused; the engine's own .tmp-*/.old-* use them)"
    if len(name.encode("utf-8", "surrogateescape")) > _NAME_MAX_BYTES:
        return f"is longer than {_NAME_MAX_BYTES} bytes"
    return None


def tag_problem(tag: object) -> str | None:
    """Why ``tag`` cannot name a checkpoint directory (None when it can)."""
    problem = name_problem(tag)
    if problem is not None:
        return problem
    if tag in RESERVED_TAGS or _RANK_FILE.fullmatch(tag):
        return (f"is a name the engine writes itself ({', '.join(sorted(RESERVED_TAGS))}, rank_*_states.pt): "
                "as a tag it would replace that file")
    return None


def check_tag(tag: object) -> str:
    """``tag``, when it may name a checkpoint directory.

    Raises:
        CheckpointError: naming the tag, what is wrong with it, and what is allowed.
    """
    problem = tag_problem(tag)
    if problem is not None:
        raise CheckpointError(f"checkpoint tag {tag!r} {problem}; use a plain directory name such as "
                              "'global_step100'")
    return tag


def is_inside(directory: Path, path: Path) -> bool:
    """Whether ``path`` resolves (symlinks followed) to somewhere strictly inside ``directory``."""
    real_dir, real = os.path.realpath(directory), os.path.realpath(path)
    return real != real_dir and os.path.commonpath([real_dir, real]) == real_dir


def regular_file_problem(directory: Path, name: str) -> str | None:
    """Why ``directory/name`` is not a regular file inside ``directory`` (None when it is; missing: None too,
    the caller reports a missing file its own way)."""
    problem = name_problem(name)
    if problem is not None:
        return f"the file name {name!r} {problem}"
    path = directory / name
    if not path.exists() and not path.is_symlink():
        return None
    if not is_inside(directory, path):
        return f"{path} leads outside {directory} (a symlink)"
    if not stat.S_ISREG(path.stat().st_mode):
        return f"{path} is not a regular file (a directory, device or pipe)"
    return None


def checkpoint_dir_problem(root: Path, tag: str) -> str | None:
    """Why ``root/tag`` is not a checkpoint directory inside ``root`` (None when it is one)."""
    problem = tag_problem(tag)
    if problem is not None:
        return f"the tag {tag!r} {problem}"
    path = root / tag
    if not path.is_dir():
        return f"{path} does not exist"
    if not is_inside(root, path):
        return f"{path} leads outside {root} (a symlink)"
    return None


def read_small_file(path: Path, max_bytes: int) -> tuple[bytes | None, str | None]:
    """``(data, None)`` for a regular file of at most ``max_bytes``, else ``(None, why not)``; never follows a symlink.

    For the small files the engine reads by a fixed name (``latest``, a manifest, the writer lock's holder): a
    symlink there could lead to any file of the machine, a FIFO would block the reader forever and ``/dev/zero``
    or a 20 GiB sparse file would be read into memory. So the name is checked with ``lstat`` before anything is
    opened (opening a device can itself do things), opened with ``O_NOFOLLOW | O_NONBLOCK`` (a swap between the
    two calls is caught by ``fstat`` on what was opened), and at most ``max_bytes + 1`` bytes are read. The
    reasons returned never quote the file's bytes, which may be anyone's.

    Raises:
        FileNotFoundError: there is no such file (callers report a missing file their own way).
    """
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            return None, (f"{path} is a symbolic link (the engine writes this file itself and never follows a link "
                          "there)")
        if not stat.S_ISREG(mode):
            return None, f"{path} is not a regular file (a directory, device or pipe)"
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):  # no such file (or its directory is a file)
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
    except OSError as err:  # ELOOP: it became a symlink after the lstat
        return None, f"{path} cannot be opened: {err.strerror or err}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, f"{path} is not a regular file (it was replaced while being opened)"
        data = os.read(fd, max_bytes + 1)
    except OSError as err:
        return None, f"{path} cannot be read: {err.strerror or err}"
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        return None, f"{path} holds more than {max_bytes} bytes, more than this engine ever writes there"
    return data, None


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """``(tag, problem)`` of ``root/latest``: ``(None, None)`` without one; a problem when it is damaged (a symlink,
    not a regular file, too large, not UTF-8, or naming a tag that is not allowed), and then the tag is None.

    The problem never quotes the file: ``latest`` may be a hard link to any file of the machine."""
    path = root / LATEST
    try:
        data, problem = read_small_file(path, MAX_LATEST_BYTES)
    except FileNotFoundError:
        return None, None
    if problem is not None:
        return None, problem
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{path} is not UTF-8 text (it should hold one checkpoint tag)"
    problem = tag_problem(tag)
    if problem is not None:
        return None, f"{path} does not name a usable checkpoint: the tag it holds ({len(data)} bytes) {problem}"
    return tag, None
