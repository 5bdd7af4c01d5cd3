"""Asynchronous file reads and writes for the NVMe tier, through the best backend that works here.

Backends, tried in this order by ``backend="auto"`` (the first that loads is used and logged once):

1. ``native``: ``csrc/async_io.cpp``, Linux native AIO through the kernel ABI (no libaio needed);
2. ``deepspeed``: DeepSpeed's ``async_io`` op (needs the libaio development package to build);
3. ``libaio``: the ``libaio`` Python package (python-libaio, over the libaio shared library);
4. ``threads``: a thread pool calling ``os.preadv`` / ``os.pwritev`` (always available).

Every backend takes the same requests: a contiguous uint8 CPU buffer (4 KiB-aligned for O_DIRECT),
a file and an offset, split into ``block_size`` pieces with up to ``queue_depth`` in flight. A
request's completion is polled or waited for by whoever needs the buffer (the host worker thread),
never by the training thread. A failed piece raises :class:`OSError` with its errno and the file
path (ENOSPC for a full disk), so the caller can say what happened.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Protocol

import torch

from zero_cache.base.native import load_csrc
from zero_cache.config import AioConfig

logger = logging.getLogger(__name__)

LIBAIO_HINT = ("install libaio (Debian/Ubuntu: `apt install libaio-dev`; RHEL: `dnf install libaio-devel`; "
               "conda: `conda install -c conda-forge libaio`)")


class IORequest(Protocol):
    def done(self) -> bool:
        """Whether the request has completed (raises its error if it failed); never blocks."""

    def wait(self) -> None:
        """Block until the request has completed; raise :class:`OSError` if it failed. Any thread may wait, and
        several may."""


class FileIO(Protocol):
    name: str

    def submit(self, path: Path, fd: int, buffer: torch.Tensor, offset: int, *, write: bool) -> IORequest:
        """Start reading (or writing) ``buffer``'s bytes at ``offset`` of the open file ``fd`` (named ``path``)."""


def _io_error(code: int, path: Path, write: bool) -> OSError:
    return OSError(code, f"{'writing' if write else 'reading'} the NVMe tier's swap file failed: "
                         f"{os.strerror(code)}", str(path))


def _byte_view(buffer: torch.Tensor) -> memoryview:
    assert buffer.dtype == torch.uint8 and buffer.is_contiguous() and buffer.device.type == "cpu"
    return memoryview(buffer.numpy()).cast("B")


# ---------------------------------------------------------------------------------------- native
class _NativeRequest:
    def __init__(self, context, ident: int, buffer: torch.Tensor, path: Path, write: bool) -> None:
        self._context, self._id, self._buffer = context, ident, buffer  # the buffer lives until completion
        self._path, self._write, self._status = path, write, None
        # Two threads may wait for one request (a slot's reader and its buffer's next user), and the context
        # forgets a request once one wait has returned it.
        self._lock = threading.Lock()

    def done(self) -> bool:
        with self._lock:
            if self._status is None:
                status = self._context.poll(self._id)
                if status < 0:
                    return False
                self._status = status
        self._raise()
        return True

    def wait(self) -> None:
        with self._lock:
            if self._status is None:
                self._status = self._context.wait(self._id)
        self._raise()

    def _raise(self) -> None:
        self._buffer = None
        if self._status:
            raise _io_error(self._status, self._path, self._write)


class NativeFileIO:
    """``csrc/async_io.cpp``: Linux native AIO without libaio."""

    name = "native (csrc/async_io.cpp, Linux AIO)"

    def __init__(self, config: AioConfig) -> None:
        module = load_csrc("async_io")
        if module is None:
            raise RuntimeError("csrc/async_io.cpp did not build (see the log above)")
        self._context = module.AioContext(config.queue_depth, config.block_size, config.single_submit)

    def submit(self, path: Path, fd: int, buffer: torch.Tensor, offset: int, *, write: bool) -> IORequest:
        _byte_view(buffer)  # checks it is a contiguous uint8 CPU buffer
        ident = self._context.submit(fd, buffer.data_ptr(), buffer.numel(), offset, write)
        return _NativeRequest(self._context, ident, buffer, path, write)


# ---------------------------------------------------------------------------------------- deepspeed
class _GenerationRequest:
    """A request of a backend whose only completion call waits for everything submitted so far."""

    def __init__(self, owner: "DeepSpeedFileIO", generation: int, path: Path, write: bool) -> None:
        self._owner, self._generation, self._path, self._write = owner, generation, path, write

    def done(self) -> bool:
        return self._owner.completed_through(self, block=False)

    def wait(self) -> None:
        self._owner.completed_through(self, block=True)


class DeepSpeedFileIO:
    """DeepSpeed's ``async_io`` op; its ``wait()`` completes every outstanding request at once."""

    name = "deepspeed async_io"

    def __init__(self, config: AioConfig) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError(f"DeepSpeed's async_io op cannot build here (libaio missing?); {LIBAIO_HINT}")
        self._handle = builder.load(verbose=False).aio_handle(config.block_size, config.queue_depth,
                                                               config.single_submit, config.overlap_events,
                                                               config.thread_count)
        self._lock = threading.Lock()
        self._submitted = self._completed = 0
        self._failed: dict[int, OSError] = {}
        self._live: list[torch.Tensor] = []

    def submit(self, path: Path, fd: int, buffer: torch.Tensor, offset: int, *, write: bool) -> IORequest:
        with self._lock:
            call = self._handle.async_pwrite if write else self._handle.async_pread
            # The op opens files by name, and the swap file has none (see zero_cache.storage.nvme): /proc/self/fd/N
            # reopens the same open file (O_WRONLY | O_CREAT without O_TRUNC: nothing is cut).
            if call(buffer, f"/proc/self/fd/{fd}", offset) != 0:
                self._failed[self._submitted + 1] = _io_error(errno.EIO, path, write)
            self._submitted += 1
            self._live.append(buffer)
            return _GenerationRequest(self, self._submitted, path, write)

    def completed_through(self, request: _GenerationRequest, *, block: bool) -> bool:
        """Whether ``request`` has completed, waiting for every outstanding request first when ``block``."""
        with self._lock:
            if self._completed < request._generation:
                if not block:
                    return False
                expected = self._submitted - self._completed
                finished = self._handle.wait()
                if finished != expected:  # the op reports completed requests; fewer means some failed
                    self._failed[request._generation] = _io_error(errno.EIO, request._path, request._write)
                self._completed, self._live = self._submitted, []
            error = self._failed.pop(request._generation, None)
        if error is not None:
            raise error
        return True


# ---------------------------------------------------------------------------------------- threads
class _FutureRequest:
    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures

    def done(self) -> bool:
        if not all(f.done() for f in self._futures):
            return False
        self.wait()
        return True

    def wait(self) -> None:
        for future in self._futures:
            future.result()


class ThreadFileIO:
    """A thread pool running ``os.preadv`` / ``os.pwritev`` on ``block_size`` pieces."""

    name = "threads (os.preadv/os.pwritev)"

    def __init__(self, config: AioConfig) -> None:
        self._block = config.block_size
        self._pool = ThreadPoolExecutor(max_workers=max(config.thread_count, config.queue_depth),
                                        thread_name_prefix="zero-cache-io")

    def submit(self, path: Path, fd: int, buffer: torch.Tensor, offset: int, *, write: bool) -> IORequest:
        view = _byte_view(buffer)
        futures = [self._pool.submit(_transfer, fd, view[start:start + self._block], offset + start, path, write)
                   for start in range(0, len(view), self._block)]
        return _FutureRequest(futures)


def _transfer(fd: int, piece: memoryview, offset: int, path: Path, write: bool) -> None:
    call = os.pwritev if write else os.preadv
    try:
        moved = call(fd, [piece], offset)
    except OSError as err:
        raise _io_error(err.errno or errno.EIO, path, write) from err
    if moved != len(piece):
        raise _io_error(errno.ENOSPC if write else errno.EIO, path, write)


# ---------------------------------------------------------------------------------------- libaio
class LibaioFileIO:
    """The ``libaio`` Python package (python-libaio); completions are reaped by whoever waits."""

    name = "python-libaio"

    def __init__(self, config: AioConfig) -> None:
        try:
            import libaio
        except (ImportError, OSError) as err:
            raise RuntimeError(f"python-libaio is unavailable ({err}); pip install libaio and {LIBAIO_HINT}") from err
        self._libaio = libaio
        self._block = config.block_size
        self._context = libaio.AIOContext(config.queue_depth)
        self._depth = config.queue_depth
        self._lock = threading.Lock()
        self._in_flight = 0

    def submit(self, path: Path, fd: int, buffer: torch.Tensor, offset: int, *, write: bool) -> IORequest:
        view = _byte_view(buffer)
        request = _LibaioRequest(self, path, write, buffer)
        mode = self._libaio.AIOBLOCK_MODE_WRITE if write else self._libaio.AIOBLOCK_MODE_READ
        for start in range(0, len(view), self._block):
            piece = view[start:start + self._block]
            block = self._libaio.AIOBlock(mode, fd, [piece], offset + start, onCompletion=request.completed(len(piece)))
            request.pending += 1
            with self._lock:
                while self._in_flight >= self._depth:
                    self._reap_locked(1)
                self._context.submit([block])
                self._in_flight += 1
        return request

    def reap(self, minimum: int) -> None:
        with self._lock:
            self._reap_locked(minimum)

    def _reap_locked(self, minimum: int) -> None:
        got = self._context.getEvents(min_nr=minimum, nr=None, timeout=None if minimum else 0)
        self._in_flight -= len(got)  # getEvents runs each block's onCompletion


class _LibaioRequest:
    def __init__(self, owner: LibaioFileIO, path: Path, write: bool, buffer: torch.Tensor) -> None:
        self._owner, self._path, self._write, self._buffer = owner, path, write, buffer
        self.pending, self.error = 0, 0

    def completed(self, length: int) -> Callable:
        def on_completion(_block, result: int, _result2: int) -> None:  # result: bytes moved, or -errno
            self.pending -= 1
            if not self.error and result != length:
                self.error = -result if result < 0 else (errno.ENOSPC if self._write else errno.EIO)
        return on_completion

    def done(self) -> bool:
        if self.pending:
            self._owner.reap(0)
        if self.pending:
            return False
        self.wait()
        return True

    def wait(self) -> None:
        while self.pending:
            self._owner.reap(1)
        self._buffer = None
        if self.error:
            raise _io_error(self.error, self._path, self._write)


# ---------------------------------------------------------------------------------------- choice
_BUILDERS: dict[str, Callable[[AioConfig], FileIO]] = {
    "native": NativeFileIO, "deepspeed": DeepSpeedFileIO, "libaio": LibaioFileIO, "threads": ThreadFileIO,
}


def open_file_io(config: AioConfig, *, direct: bool) -> FileIO:
    """The configured backend, or with ``"auto"`` the first of native, deepspeed, libaio, threads that loads.

    Args:
        config: the ``aio`` block.
        direct: the swap file is open with O_DIRECT. Without it kernel AIO blocks in submit, so
            "auto" goes straight to the thread pool.

    Raises:
        RuntimeError: a forced backend cannot be loaded here (the message says why).
    """
    if config.backend != "auto":
        backend = _BUILDERS[config.backend](config)
        _log_choice(backend.name)
        return backend
    order = ("native", "deepspeed", "libaio", "threads") if direct else ("threads",)
    for name in order:
        try:
            backend = _BUILDERS[name](config)
        except Exception as err:  # a missing toolchain or library: say why once, try the next
            logger.info("ZeRO-Cache NVMe IO: the %s backend is unavailable: %s", name, _first_line(err))
            continue
        _log_choice(backend.name)
        return backend
    raise AssertionError("the threads backend always loads")


@functools.cache
def _log_choice(name: str) -> None:
    logger.info("ZeRO-Cache NVMe IO backend: %s", name)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
