"""The NVMe tier: optimizer states of chunks in a swap file, moved through pinned bounce buffers.

One swap file per engine (``angelptm-zero-cache-<host>-<pid>-rank<r>-<random>.swap`` under
``zero_cache.nvme_path``) holds fixed-size slots, one per disk-resident optimizer group (fp32
master | exp_avg | exp_avg_sq, padded to 4 KiB). Before anything is allocated the directory is
checked: it exists, is writable, supports O_DIRECT (otherwise buffered IO with a warning), and
has the bytes the plan needs. Slots are reserved with ``posix_fallocate`` as they are handed out,
so a full disk is found when the plan is applied, not in the middle of a step.

The swap file has no name while it is used: it is created with ``O_TMPFILE`` (or, where the
filesystem lacks it, unlinked right after it is created), so its open descriptor is the only
reference and the kernel frees its space when the process ends, however it ends: a normal exit,
an exception, ``os._exit`` or SIGKILL. (A 60 GB swap file outlived a benchmark child that left through
``os._exit`` before.) Swap files of earlier versions, which had names, are removed at the next start
when no live run holds their lock. Swap files never carry state across runs: checkpoints hold the
disk-resident states like any other.

Every slot written carries a checksum, kept in memory and checked when the slot is read back, so bytes
changed on the disk (another process writing into the file, a failing drive) stop the step at once with
:class:`SwapCorruptionError` naming the file and slot, instead of feeding garbage to Adam (a corrupted
run once skipped 276 steps as "overflow" and pruned every good checkpoint). The checksum is one torch
reduction over the pinned bounce buffer: the wrapping sum of each 4 KiB block's 64-bit words, and of
those block sums weighted by their block's index. It costs 0.15-0.26 s/GiB on the 2-core CI machine
(zlib.crc32 of the same bytes: 0.43-0.56 s/GiB, one core); it catches any change confined to one word, a random
overwrite with probability 1 - 2**-64, and moved blocks, but not words swapped within one 4 KiB block.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import secrets
import shutil
import socket
import threading
import time
import weakref
from pathlib import Path

import torch

from zero_cache.base.timeline import Timeline
from zero_cache.config import AioConfig, ZeroCacheConfig
from zero_cache.plan.home_costs import DISK_BLOCK_BYTES, HOME_COSTS, align_up
from zero_cache.plan.tier_names import NVME
from zero_cache.plan.units import format_bytes
from zero_cache.storage.aio import FileIO, IORequest, open_file_io
from zero_cache.storage.tiers import TierFullError, TrafficCounter

logger = logging.getLogger(__name__)

ALIGN_BYTES = DISK_BLOCK_BYTES
"""O_DIRECT transfers need buffer addresses, file offsets and lengths aligned to the logical block size."""
SWAP_PREFIX = "angelptm-zero-cache-"
AUTO_MARGIN_FRACTION = 0.02
""""auto" leaves this share of the free disk space (at least 1 GiB) to everything else; the swap file
itself never grows past its plan (its slots are reserved up front with posix_fallocate)."""


class SwapCorruptionError(RuntimeError):
    """A slot read back from the swap file does not hold what was written to it."""


def slot_checksum(buffer: torch.Tensor) -> tuple[int, int]:
    """The checksum of an aligned uint8 slot buffer (a whole number of 4 KiB blocks): the sum of its 64-bit
    words, and the sum of its blocks' sums weighted 1, 3, 5, ... by block index (integer sums wrap)."""
    block_sums = buffer.view(torch.int64).view(-1, ALIGN_BYTES // 8).sum(dim=1)
    return block_sums.sum().item(), (block_sums * _block_weights(block_sums.numel())).sum().item()


@functools.lru_cache(maxsize=8)
def _block_weights(blocks: int) -> torch.Tensor:
    """1, 3, 5, ... per block: made once per slot size, not on every read and write of a slot."""
    return torch.arange(1, 2 * blocks, 2, dtype=torch.int64)


class _CheckedRead:
    """A read whose completion verifies the slot's checksum (once, on the first wait or done that sees it)."""

    def __init__(self, request: IORequest, buffer: torch.Tensor, expected: tuple[int, int], where: str) -> None:
        self._request, self._buffer, self._expected, self._where = request, buffer, expected, where
        self._verified = False
        self._lock = threading.Lock()

    def done(self) -> bool:
        if not self._request.done():
            return False
        self._verify()
        return True

    def wait(self) -> None:
        self._request.wait()
        self._verify()

    def _verify(self) -> None:
        with self._lock:
            if self._verified:
                return
            if slot_checksum(self._buffer) != self._expected:
                raise SwapCorruptionError(
                    f"ZeRO-Cache: {self._where} does not hold what was written to it (checksum mismatch): the swap "
                    "file was changed on disk (another process, or a failing drive). The step stopped before using "
                    "it; resume from the last checkpoint, and check the drive (dmesg, smartctl)")
            self._verified = True


class NvmeSetupError(ValueError):
    """zero_cache.nvme_path cannot hold the swap file (missing, not writable, or too small)."""


def check_directory(path: str) -> Path:
    """The swap directory, after checking it exists and is writable (NvmeSetupError says what to do)."""
    directory = Path(path).expanduser()
    if directory.exists() and not directory.is_dir():
        raise NvmeSetupError(f"zero_cache.nvme_path: {str(directory)!r} is a file, not a directory; set nvme_path to "
                             "a directory on the NVMe drive (the swap file is created inside it), or to null for no "
                             "disk tier")
    if not directory.is_dir():
        raise NvmeSetupError(f"zero_cache.nvme_path: {str(directory)!r} is not an existing directory; create it on "
                             f"the NVMe drive (mkdir -p {directory}) or set nvme_path to null for no disk tier")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise NvmeSetupError(f"zero_cache.nvme_path: {str(directory)!r} is not writable by this user")
    return directory


def auto_nvme_budget(directory: Path, ranks_per_host: int = 1) -> int:
    """Free bytes under ``directory`` less the margin, split between the ranks of a host (who share the drive)."""
    return disk_share(shutil.disk_usage(directory).free, ranks_per_host)


def disk_share(free_bytes: int, ranks_per_host: int = 1) -> int:
    """One rank's "auto" NVMe budget: a drive's free bytes less the margin, split between the host's ranks."""
    return max(0, int(free_bytes - max(2**30, free_bytes * AUTO_MARGIN_FRACTION))) // ranks_per_host


def nvme_budget(config: ZeroCacheConfig, ranks_per_host: int = 1) -> tuple[Path | None, int]:
    """(checked swap directory, this rank's byte budget there), or (None, 0) without an NVMe tier.

    Raises:
        NvmeSetupError: nvme_path is missing or not writable, or not set while param_home is "nvme".
    """
    if config.nvme_path is None:
        home = HOME_COSTS.get(config.param_home)  # (None: "auto", which puts no shard on disk without a tier)
        if home is not None and home.on_disk:
            raise NvmeSetupError("zero_cache.param_home is \"nvme\" but no swap directory is set: set "
                                 "zero_cache.nvme_path (or zero_optimization.offload_param.nvme_path) to a directory "
                                 "on a local NVMe drive, or param_home to \"host\" or \"auto\"")
        return None, 0
    directory = check_directory(config.nvme_path)
    budget = config.nvme_budget_bytes
    return directory, auto_nvme_budget(directory, ranks_per_host) if budget is None else budget


def remove_stale_swap_files(directory: Path) -> list[Path]:
    """Remove swap files that no live run holds locked (left by a crashed run); returns their paths."""
    removed = []
    for path in sorted(directory.glob(f"{SWAP_PREFIX}*.swap")):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue  # its run just removed it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live run's
        else:
            size = os.fstat(fd).st_size
            path.unlink(missing_ok=True)
            removed.append(path)
            logger.warning("ZeRO-Cache: removed %s (%s), the swap file of a run that did not exit cleanly; its "
                           "contents are not needed to resume (checkpoints hold every state)", path, format_bytes(size))
        finally:
            os.close(fd)
    return removed


class SwapFile:
    """This process's swap file: open (O_DIRECT where the filesystem allows) and nameless, freed when closed.

    ``path`` is the name it would have had: it appears in messages only (nothing opens it).
    """

    def __init__(self, directory: Path, rank: int) -> None:
        # The random part keeps several engines of one process apart.
        self.path = directory / (f"{SWAP_PREFIX}{socket.gethostname()}-{os.getpid()}-rank{rank}-"
                                 f"{secrets.token_hex(4)}.swap")
        direct_flag = getattr(os, "O_DIRECT", 0)
        try:
            self.fd = _open_nameless(directory, self.path, direct_flag)
            self.direct = bool(direct_flag) and _direct_io_works(self.fd)
        except OSError as err:
            # Some filesystems refuse O_DIRECT at open (tmpfs before Linux 6.6).
            if err.errno != errno.EINVAL or not direct_flag:
                raise
            self.fd, self.direct = None, False
        if not self.direct:
            if self.fd is not None:
                os.close(self.fd)
            self.fd = _open_nameless(directory, self.path, 0)
            logger.warning("ZeRO-Cache: %s does not support O_DIRECT; the NVMe tier uses buffered IO through the "
                           "page cache (slower and competing with host memory). Point zero_cache.nvme_path at a "
                           "local NVMe filesystem (ext4, xfs)", directory)
        self.reserved_bytes = 0
        self._finalizer = weakref.finalize(self, os.close, self.fd)

    def reserve(self, num_bytes: int) -> None:
        """Make the file hold ``num_bytes`` on disk now, so no later write finds the disk full."""
        if num_bytes <= self.reserved_bytes:
            return
        try:
            os.posix_fallocate(self.fd, self.reserved_bytes, num_bytes - self.reserved_bytes)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise TierFullError(f"nvme tier: {self.path.parent} has no room for {format_bytes(num_bytes)} of swap "
                                    "(the disk filled up since the plan was made); free space or lower "
                                    "zero_cache.nvme_memory_budget") from err
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self.fd, num_bytes)  # no fallocate here: a sparse file; ENOSPC may come at a write
        self.reserved_bytes = num_bytes

    def close(self) -> None:
        self._finalizer()


def _direct_io_works(fd: int) -> bool:
    """One aligned 4 KiB write through the O_DIRECT descriptor (some filesystems accept the flag, then fail IO)."""
    probe = torch.zeros(2 * ALIGN_BYTES, dtype=torch.uint8)
    start = -probe.data_ptr() % ALIGN_BYTES
    try:
        return os.pwritev(fd, [memoryview(probe[start:start + ALIGN_BYTES].numpy())], 0) == ALIGN_BYTES
    except OSError:
        return False


def _open_nameless(directory: Path, path: Path, flags: int) -> int:
    """A read-write descriptor of a new file under ``directory`` that no name refers to.

    ``O_TMPFILE`` creates it without a name (Linux 3.11+; ext4, xfs, btrfs, tmpfs); elsewhere it is
    created as ``path`` and unlinked at once, which leaves a window of one system call for a kill.
    """
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            return os.open(directory, os.O_RDWR | tmpfile | flags, 0o600)
        except OSError as err:  # no O_TMPFILE on this filesystem or kernel (EINVAL may also be O_DIRECT's)
            if err.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.ENOENT, errno.EINVAL):
                raise
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o600)
    finally:
        # Also when the open failed: some filesystems create the file, then refuse O_DIRECT.
        path.unlink(missing_ok=True)
    return fd


class NvmeTier:
    """Fixed-size slots of one swap file, with the byte counters of the other tiers.

    Args:
        directory: checked swap directory (:func:`check_directory`).
        slot_bytes: bytes of one optimizer group (rounded up to 4 KiB).
        budget_bytes: most bytes the swap file may take.
        aio: the IO settings; the backend is chosen here (see ``zero_cache.storage.aio``).
        rank: this process's rank (in the file name).
    """

    name = NVME

    def __init__(self, directory: Path, slot_bytes: int, budget_bytes: int, aio: AioConfig, rank: int = 0) -> None:
        self.slot_bytes = align_up(slot_bytes)
        self.budget_bytes = budget_bytes
        self.used_bytes = self.peak_bytes = 0
        self._directory, self._aio, self._rank = directory, aio, rank
        self.split_bytes = 0
        """Budget handed to the tiers :meth:`split` off (the whole disk budget is this plus ``budget_bytes``)."""
        remove_stale_swap_files(directory)
        self.file = SwapFile(directory, rank)
        self.io: FileIO = open_file_io(aio, direct=self.file.direct)
        self._free_offsets: list[int] = []
        self._end = 0
        self._writes: dict[int, IORequest] = {}  # slot offset -> its latest write, until known complete
        self._checksums: dict[int, tuple[int, int]] = {}  # slot offset -> checksum of its last write
        self._lock = threading.Lock()
        self.traffic = TrafficCounter("read", "write")
        self.timeline: Timeline | None = None
        """Set by the optimizer: while a step is traced, each request's lifetime goes on its ``disk`` track."""

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def allocate_slot(self) -> int:
        """The byte offset of a free slot, reserved on disk."""
        if self.slot_bytes > self.free_bytes:
            raise TierFullError(f"nvme tier: another {format_bytes(self.slot_bytes)} slot exceeds its budget "
                                f"({format_bytes(self.used_bytes)} of {format_bytes(self.budget_bytes)} in use)")
        if self._free_offsets:
            offset = self._free_offsets.pop()
        else:
            offset, self._end = self._end, self._end + self.slot_bytes
            self.file.reserve(self._end)
        self.used_bytes += self.slot_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return offset

    def split(self, slot_bytes: int, budget_bytes: int) -> "NvmeTier":
        """A tier of its own swap file beside this one, for slots of another size (param homes), taking
        ``budget_bytes`` of this tier's budget."""
        if budget_bytes > self.free_bytes:
            raise TierFullError(f"nvme tier: {format_bytes(budget_bytes)} of swap for param homes exceeds its budget "
                                f"({format_bytes(self.used_bytes)} of {format_bytes(self.budget_bytes)} in use)")
        self.budget_bytes -= budget_bytes
        self.split_bytes += budget_bytes
        return NvmeTier(self._directory, slot_bytes, budget_bytes, self._aio, self._rank)

    def lend(self, split: "NvmeTier", budget_bytes: int) -> None:
        """Give a tier :meth:`split` off this one ``budget_bytes`` more of this tier's budget."""
        if budget_bytes > self.free_bytes:
            raise TierFullError(f"nvme tier: another {format_bytes(budget_bytes)} of swap for param homes exceeds its "
                                f"budget ({format_bytes(self.used_bytes)} of {format_bytes(self.budget_bytes)} in use)")
        self.budget_bytes -= budget_bytes
        self.split_bytes += budget_bytes
        split.budget_bytes += budget_bytes

    def free_slot(self, offset: int) -> None:
        self._checksums.pop(offset, None)
        self._free_offsets.append(offset)
        self.used_bytes -= self.slot_bytes
        assert self.used_bytes >= 0, "nvme tier freed more than it allocated"

    def read(self, offset: int, buffer: torch.Tensor) -> IORequest:
        """Start reading one slot into an aligned uint8 ``buffer`` of ``slot_bytes``.

        A write of the same slot still in flight is waited for first (a read must see it).
        """
        with self._lock:
            pending = self._writes.pop(offset, None)
        if pending is not None:
            pending.wait()
        request = self._submit(offset, buffer, write=False)
        expected = self._checksums.get(offset)
        if expected is None:  # never written (a fresh slot): nothing to compare with
            return request
        slot = offset // self.slot_bytes
        return _CheckedRead(request, buffer, expected,
                            f"slot {slot} (offset {offset}) of the swap file {self.file.path}")

    def write(self, offset: int, buffer: torch.Tensor) -> IORequest:
        """Start writing an aligned uint8 ``buffer`` of ``slot_bytes`` to one slot (its checksum is taken first:
        the buffer holds its final bytes from here until the write completes)."""
        self._checksums[offset] = slot_checksum(buffer)
        request = self._submit(offset, buffer, write=True)
        with self._lock:
            self._writes[offset] = request
        return request

    def time_io(self, buffer: torch.Tensor) -> tuple[float, float] | None:
        """Seconds to write an aligned uint8 ``buffer`` (at most a slot) where the next slot goes and read it back,
        through this tier's own IO; None when the budget has no room for it. A freed slot is used if there is one;
        else the file grows by the buffer alone (a whole slot could be gigabytes, and ``posix_fallocate`` writes
        zeros where the filesystem cannot allocate), which the next slot allocated covers."""
        if buffer.numel() > self.slot_bytes or buffer.data_ptr() % ALIGN_BYTES or buffer.numel() % ALIGN_BYTES:
            raise ValueError("the timed buffer must be aligned and fit a slot")
        if buffer.numel() > self.free_bytes:
            return None
        if self._free_offsets:
            offset = self._free_offsets[-1]
            with self._lock:  # (a slot freed with its last write in flight)
                pending = self._writes.pop(offset, None)
            if pending is not None:
                pending.wait()
        else:
            offset = self._end
            try:
                self.file.reserve(offset + buffer.numel())
            except TierFullError:
                return None
        seconds = []
        for write in (True, False):
            started = time.perf_counter()
            self.io.submit(self.file.path, self.file.fd, buffer, offset, write=write).wait()
            seconds.append(time.perf_counter() - started)
        return seconds[0], seconds[1]

    def flush(self) -> None:
        """Wait for every write in flight; raise the first failure (e.g. the disk filled up)."""
        with self._lock:
            pending, self._writes = list(self._writes.values()), {}
        for request in pending:
            request.wait()

    def _submit(self, offset: int, buffer: torch.Tensor, *, write: bool) -> IORequest:
        assert buffer.numel() == self.slot_bytes and buffer.data_ptr() % ALIGN_BYTES == 0, "unaligned swap buffer"
        self.traffic.add("write" if write else "read", self.slot_bytes)
        request = self.io.submit(self.file.path, self.file.fd, buffer, offset, write=write)
        if self.timeline is None:
            return request
        return self.timeline.timed_request(request, f"{'write' if write else 'read'} {self.slot_bytes / 2**20:.0f} MiB")

    def close(self) -> None:
        """Free the swap file now (also done when the tier is garbage-collected, and by the kernel at any exit)."""
        self.file.close()
