"""Checkpoint manifests: each file of a checkpoint with its size and CRC-32, written with it, checked before a load.

A checkpoint directory holds ``manifest.json``::

    {"format": 1, "algorithm": "crc32", "saved_at_unix": 1767225600.0,
     "files": {"model_states.pt": {"size_bytes": 123, "crc32": "89abcdef"}, "rank_00001_states.pt": ...}}

Every rank hashes the files it writes while writing them (:func:`write_hashed`); rank 0 gathers the
records and writes the manifest into the temporary directory before the rename that publishes the
checkpoint, so a checkpoint directory and its manifest appear together or not at all.

Why CRC-32 (zlib): the manifest guards against damage (a truncated copy, a flipped bit), not against
an attacker, who could rewrite the manifest too (``angelptm.checkpoints.safe_pickle`` is what keeps a hostile file
from running code). zlib's CRC-32 is the fastest checksum in the standard library: 2.3 GB/s on one core
of the 2-core CI machine, against 1.1-1.5 GB/s for SHA-256 (``bench/checkpoint_hash.py``). A large write
is cut into pieces hashed by a thread pool while this thread writes the same bytes (zlib and the write
both release the GIL), and the pieces' CRCs are joined with zlib's ``crc32_combine`` algorithm, so the
hash keeps ahead of a disk that writes faster than one core hashes. A 32-bit checksum misses a random
corruption with probability 2**-32.

``torch.save`` computes a CRC-32 of every record too, for the zip directory, on one thread before each
write (1.6 GB/s here: a third of a second per 0.5 GB tensor), and ``torch.load`` never checks it. Our
write path turns that one off while it saves: the manifest's checksum covers every byte of the file,
the zip's covered the records only, and ours runs in threads beside the write instead of before it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from angelptm.checkpoints.paths import MANIFEST_FILE, read_small_file, regular_file_problem
from angelptm.errors import CheckpointError

logger = logging.getLogger(__name__)

ALGORITHM = "crc32"
MANIFEST_FORMAT = 1
_PARALLEL_HASH_BYTES = 1 << 20
"""Writes at least this large are hashed in threads while they are written; smaller ones inline."""
_PIECE_BYTES = 16 << 20
"""A large write is hashed in pieces of at least this size, one per hashing thread."""
_HASH_THREADS = max(1, min(8, (os.cpu_count() or 1) - 1))
_CRC_POLY = 0xEDB88320  # CRC-32's reflected polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (zlib's ``multmodp``)."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if (a & (m - 1)) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x**(2**n) modulo the polynomial
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's ``crc32_combine``, absent from Python's zlib)."""
    power, k, n = 1 << 31, 3, len2  # x**(8 * len2): shift crc1 past B's bits
    while n:
        if n & 1:
            power = _multmodp(_X2N[k & 31], power)
        n >>= 1
        k += 1
    return _multmodp(power, crc1) ^ crc2


_READ_BYTES = 16 << 20
"""A file is verified in blocks of this size."""
_VERIFY_THREADS = max(2, _HASH_THREADS)
"""Blocks read and hashed at once when a file is verified (at least 2: one is read while another is hashed)."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file of a checkpoint as it was written."""

    name: str
    """File name inside the checkpoint directory."""
    size_bytes: int
    """Its length."""
    crc32: int
    """zlib CRC-32 of its bytes."""


class _HashingFile:
    """A binary file that CRC-32s what is written through it (torch.save's file-like target)."""

    def __init__(self, handle: Any, hasher: ThreadPoolExecutor) -> None:
        self._handle, self._hasher = handle, hasher
        self.crc32, self.size_bytes = 0, 0
        self.error: OSError | None = None
        """The first failed write (torch.save's zip writer replaces it with an unrelated error of its own)."""
        self.closed = False
        """The file was closed (:func:`hashed_file`'s block ended): later writes are dropped."""

    def write(self, data: Any) -> int:
        if self.closed:
            # torch's zip writer, given up by a failed save, writes its end when it is destroyed (a collection, the
            # interpreter's exit): an error raised here would leave its C++ destructor and abort the process.
            return memoryview(data).nbytes
        try:
            return self._write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _PARALLEL_HASH_BYTES:
            # torch.save hands a view of tensor memory it may reuse after write() returns:
            # the hash must finish before this call does, but can run beside the write.
            step = max(_PIECE_BYTES, -(-view.nbytes // _HASH_THREADS))
            pieces = [view[start:start + step] for start in range(0, view.nbytes, step)]
            pending = [self._hasher.submit(zlib.crc32, piece) for piece in pieces]
            self._handle.write(view)
            self._start_writeback(view.nbytes)
            for piece, future in zip(pieces, pending):
                self.crc32 = crc32_combine(self.crc32, future.result(), piece.nbytes)
        else:
            self._handle.write(view)
            self.crc32 = zlib.crc32(view, self.crc32)
        self.size_bytes += view.nbytes
        return view.nbytes

    def _start_writeback(self, num_bytes: int) -> None:
        """Send these bytes to the disk now, not all at the final fsync, so the disk writes while the rest is
        serialised and hashed (Linux: fadvise DONTNEED starts writeback of a dirty range; the checkpoint's
        pages are not read again, so they need not stay cached either)."""
        if not hasattr(os, "posix_fadvise"):
            return
        self._handle.flush()
        os.posix_fadvise(self._handle.fileno(), self.size_bytes, num_bytes, os.POSIX_FADV_DONTNEED)

    def flush(self) -> None:
        self._handle.flush()

    def record(self, path: Path) -> FileRecord:
        """The manifest's record of what was written."""
        return FileRecord(path.name, self.size_bytes, self.crc32)


@contextmanager
def _without_zip_crc() -> Iterator[None]:
    """``torch.save`` without its per-record CRC-32 (see the module docstring); restored afterwards."""
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def write_hashed(obj: Any, path: Path) -> FileRecord:
    """``torch.save`` ``obj`` to ``path`` and fsync it, hashing the bytes on their way out.

    Returns:
        The file's record for the manifest.

    Raises:
        OSError: the write failed (e.g. ENOSPC: the disk is full), with ``path`` as its filename.
    """
    with hashed_file(path) as target, _without_zip_crc():
        torch.save(obj, target)
    return target.record(path)


@contextmanager
def hashed_file(path: Path) -> Iterator[_HashingFile]:
    """A new file at ``path`` (never through a symlink) that hashes what is written to it; flushed and fsynced when
    the block ends (its :meth:`_HashingFile.record` is then the manifest's).

    Raises:
        OSError: a write failed (e.g. ENOSPC: the disk is full), with ``path`` as its filename, even where the
            writer in the block replaced the error with one of its own (torch's zip writer does).
    """
    with _open_for_writing(path, "wb") as handle, \
            ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="ckpt-crc") as hasher:
        target = _HashingFile(handle, hasher)
        try:
            yield target
            handle.flush()
            os.fsync(handle.fileno())
        except Exception as err:
            # (an OSError naming a file already is another file's, passing through this one's block)
            cause = target.error or (err if isinstance(err, OSError) and not err.filename else None)
            if cause is None:
                raise
            raise OSError(cause.errno, f"writing checkpoint file failed: {cause.strerror or cause}", str(path)) from err
        finally:
            target.closed = True


def _open_for_writing(path: Path, mode: str) -> Any:
    """``open(path, mode)`` for writing, except that a symlink at ``path`` is refused (ELOOP), not written through:
    the files go into a temporary directory this process just created, so one is never expected there."""
    return open(path, mode, opener=lambda name, flags: os.open(name, flags | os.O_NOFOLLOW, 0o666))


def write_manifest(directory: Path, records: list[FileRecord]) -> None:
    """Write ``directory/manifest.json`` durably (the caller fsyncs the directory)."""
    files = {r.name: {"size_bytes": r.size_bytes, ALGORITHM: f"{r.crc32:08x}"}
             for r in sorted(records, key=lambda r: r.name)}
    manifest = {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM, "saved_at_unix": time.time(), "files": files}
    with _open_for_writing(directory / MANIFEST_FILE, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory; None when it has none (written before manifests existed).

    Raises:
        CheckpointError: the manifest exists but is unreadable or malformed.
    """
    path = directory / MANIFEST_FILE
    try:  # never through a symlink: another run's manifest would vouch for files that are not its own
        text, problem = read_small_file(path, _MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    if problem is not None:
        raise CheckpointError(f"the manifest is damaged: {problem}")
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{path} is damaged: {err}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict) \
            or not all(_valid_entry(e) for e in files.values()):
        raise CheckpointError(f"{path} is damaged or of an unknown kind (expected algorithm {ALGORITHM!r} and per "
                              "file a size_bytes that is a whole number and a checksum of 8 hex digits)")
    return manifest


_MAX_MANIFEST_BYTES = 64 << 20
"""A manifest lists a few files per rank; a larger one is not ours."""


def _valid_entry(entry: Any) -> bool:
    """A file's manifest entry: a non-negative integer size (not a string, null or bool) and an 8-digit CRC."""
    if not isinstance(entry, dict):
        return False
    size, crc = entry.get("size_bytes"), entry.get(ALGORITHM)
    return (type(size) is int and size >= 0 and isinstance(crc, str) and len(crc) == 8
            and all(c in "0123456789abcdef" for c in crc))


def file_crc32(path: Path) -> int:
    """CRC-32 of a whole file: blocks read with ``pread`` and hashed by a thread pool (both release the GIL), joined
    in order with :func:`crc32_combine`.

    One thread reading then hashing block after block (as this did) never had the disk busy while it hashed: 33 GB
    took ~31 s on the H200 host, where its disk alone reads them in 21 s. With several blocks in flight the disk
    always has requests queued, and a file still in the page cache hashes on every thread.
    """
    size = os.stat(path).st_size
    starts = range(0, size, _READ_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    buffers = threading.local()  # one block's buffer per thread, reused (fresh ones would each be faulted in)
    try:
        def block_crc(start: int) -> tuple[int, int]:
            if not hasattr(buffers, "block"):
                buffers.block = memoryview(bytearray(_READ_BYTES))
            num_bytes = os.preadv(fd, [buffers.block[:min(_READ_BYTES, size - start)]], start)
            return zlib.crc32(buffers.block[:num_bytes]), num_bytes

        crc, done = 0, 0
        with ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="ckpt-verify") as pool:
            for block, num_bytes in pool.map(block_crc, starts):
                crc = crc32_combine(crc, block, num_bytes)
                done += num_bytes
    finally:
        os.close(fd)
    if done != size:
        raise OSError(errno.EIO, f"read {done} of its {size} bytes (it changed while it was read)", str(path))
    return crc


def verify_file(directory: Path, name: str, entry: dict[str, Any]) -> str | None:
    """None when ``directory/name`` matches its manifest entry, else what is wrong with it (a name that leads
    outside ``directory`` or to anything but a regular file is wrong: it is never opened)."""
    path = directory / name
    problem = regular_file_problem(directory, name)
    if problem is not None:
        return f"the manifest lists {name!r}: {problem}"
    try:
        size = path.stat().st_size
        if size != entry["size_bytes"]:
            return f"{path} has {size} bytes, the manifest says {entry['size_bytes']} (truncated or overwritten)"
        crc = f"{file_crc32(path):08x}"
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as err:  # a verdict, not an exception: the other ranks wait for this one's in a collective
        return f"{path} cannot be read: {err}"
    if crc != entry[ALGORITHM]:
        return (f"{path} fails its checksum ({ALGORITHM} {crc}, the manifest says {entry[ALGORITHM]}): "
                "the file is damaged")
    return None


def share_of_files(manifest: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """The files this rank verifies: largest first, each to the rank with the fewest bytes so far."""
    loads = [0] * world_size
    mine = []
    for name, entry in sorted(manifest["files"].items(), key=lambda item: (-item[1]["size_bytes"], item[0])):
        owner = loads.index(min(loads))
        loads[owner] += entry["size_bytes"]
        if owner == rank:
            mine.append(name)
    return mine
