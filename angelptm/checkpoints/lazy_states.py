"""Reading a checkpoint's optimizer states one tensor at a time, as ZeRO-Cache loads them chunk by chunk.

``torch.load(mmap=True)`` maps the whole file: every page ZeRO-Cache's load copies from stays in the process's
resident memory while the loaded dict lives, i.e. until the load ends (a 37 GB checkpoint: 34 GiB of RSS). Here the
pickle is read as ``torch.load`` reads it (only the allowlisted globals of :mod:`angelptm.checkpoints.safe_pickle`
are resolved), but each tensor of the states' name tables (``masters``, ``exp_avg``, ``exp_avg_sq``) stays a
:class:`LazyTensor` (its record's place in the file) in a :class:`LazyTensors` table, read with ``pread`` into a
tensor of its own when the load asks for it by name. ZeRO-Cache's load copies one parameter at a time and drops
it, so the host holds one parameter's state at a time, whatever the checkpoint's size. Every other tensor in the
file (loss scale, hyperparameters, scheduler) is read at once.

ZeRO-Cache's load asks a table to read a tensor straight into its place in the chunk (:meth:`LazyTensors.read_into`:
no tensor in between, no page faulted in twice) and in the file's order (:meth:`LazyTensors.position`), so the file
is read front to back, each tensor in pieces read by several threads at once (``pread`` releases the GIL): the disk
always has requests queued, and a file still in the page cache (its verification just read it) is copied out on
several cores.
"""

from __future__ import annotations

import collections.abc
import io
import os
import pickle
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from angelptm.checkpoints import safe_pickle
from angelptm.checkpoints.streamed import contiguous_stride
from angelptm.errors import CheckpointError

STATE_TABLES = ("masters", "exp_avg", "exp_avg_sq")
"""The name tables of a ZeRO-Cache optimizer state (``state_dict()``) that are read lazily."""


_PIECE_BYTES = 8 << 20
"""A tensor's bytes are read in pieces of this size, :data:`_READ_THREADS` at once."""
_READ_THREADS = max(2, min(8, os.cpu_count() or 1))
"""Pieces of a tensor read at once (at least 2: the disk is given the next request while one is copied out)."""

_DTYPE_OF_STORAGE = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
"""``FloatStorage`` -> ``torch.float32``: the element type a pickle's storage type names."""


@dataclass(frozen=True, slots=True)
class _Record:
    key: str
    dtype: torch.dtype
    numel: int


class _File:
    """An open checkpoint file and where its records' bytes start (closed when the last tensor of it goes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)
        self._pool: ThreadPoolExecutor | None = None
        with open(path, "rb") as handle:
            reader = torch._C.PyTorchFileReader(handle)
            self.pickle = reader.get_record("data.pkl")
            # (PyTorchFileReader.get_record_size is newer than some torch builds users run, the GPU images'
            # among them: there the record's size is the one its pickle gives, see LazyTensor.read)
            size_of = getattr(reader, "get_record_size", None)
            self._offsets = {name: (reader.get_record_offset(name), size_of(name) if size_of else None)
                             for name in reader.get_all_records() if name.startswith("data/")}

    def record(self, key: str) -> tuple[int, int | None]:
        try:
            return self._offsets[f"data/{key}"]
        except KeyError:
            raise CheckpointError(f"{self.path} lacks the tensor record data/{key}: the file is damaged") from None

    def read_at(self, memory: memoryview, offset: int, key: str) -> None:
        """Fill ``memory`` (bytes) with the file's bytes from ``offset``, in pieces read by several threads."""
        pieces = [(start, min(_PIECE_BYTES, memory.nbytes - start)) for start in range(0, memory.nbytes, _PIECE_BYTES)]
        if len(pieces) <= 1:
            self._read_piece(memory, offset, key)
            return
        if self._pool is None:  # (its idle threads end with this file)
            self._pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="ckpt-read")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        for _ in self._pool.map(lambda piece: self._read_piece(memory[piece[0]:piece[0] + piece[1]],
                                                                offset + piece[0], key), pieces):
            pass

    def _read_piece(self, memory: memoryview, offset: int, key: str) -> None:
        done = 0
        while done < memory.nbytes:  # (pread may return less than asked)
            read = os.preadv(self.fd, [memory[done:]], offset + done)
            if read <= 0:
                raise CheckpointError(f"{self.path} ended inside record data/{key}")
            done += read


@dataclass(frozen=True, slots=True)
class LazyTensor:
    """A tensor of a checkpoint file, read when :meth:`read` is called."""

    file: _File
    record: _Record
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def position(self) -> tuple[str, int]:
        """(file, offset of its record): the order that reads the file front to back."""
        return str(self.file.path), self.file.record(self.record.key)[0]

    def _span(self) -> tuple[int, int]:
        """(file offset, bytes) of the tensor's extent in its record, checked against the record's size."""
        itemsize = self.record.dtype.itemsize
        extent = 1 + sum((size - 1) * step for size, step in zip(self.shape, self.stride)) if all(self.shape) else 0
        start, size_bytes = self.file.record(self.record.key)
        if size_bytes is None:  # (a torch without get_record_size: the storage's size as the pickle records it)
            size_bytes = self.record.numel * itemsize
        first, num_bytes = self.storage_offset * itemsize, extent * itemsize
        if first + num_bytes > size_bytes:
            raise CheckpointError(f"{self.file.path}: record data/{self.record.key} holds {size_bytes} bytes, a "
                                  f"tensor needs {first + num_bytes}: the file is damaged")
        return start + first, num_bytes

    def _fill(self, memory: memoryview) -> None:
        offset, num_bytes = self._span()
        assert memory.nbytes == num_bytes
        self.file.read_at(memory, offset, self.record.key)
        if hasattr(os, "posix_fadvise"):  # read once: the page cache need not keep it
            os.posix_fadvise(self.file.fd, offset, num_bytes, os.POSIX_FADV_DONTNEED)

    def read(self) -> torch.Tensor:
        """The tensor, read from the file into memory of its own (its storage's extent only)."""
        buffer = torch.empty(self._span()[1], dtype=torch.uint8)
        self._fill(memoryview(buffer.numpy()))
        return buffer.view(self.record.dtype).as_strided(self.shape, self.stride)

    def read_into(self, out: torch.Tensor) -> None:
        """Copy the tensor into ``out`` (same number of elements, any shape): read straight into it when it is
        contiguous host memory of the tensor's dtype and the tensor is stored contiguously, else through
        :meth:`read`."""
        numel = 1
        for size in self.shape:
            numel *= size
        if numel != out.numel():
            raise CheckpointError(f"{self.file.path}: record data/{self.record.key} holds {numel} elements where "
                                  f"{out.numel()} are loaded: the checkpoint is of another model")
        direct = (out.device.type == "cpu" and out.dtype == self.record.dtype and out.is_contiguous()
                  and self.stride == contiguous_stride(self.shape) and numel > 0)
        if not direct:
            out.copy_(self.read().reshape(out.shape))
            return
        self._fill(memoryview(out.detach().view(-1).view(torch.uint8).numpy()))


class LazyTensors(collections.abc.MutableMapping):
    """A name table whose tensors are read from the file when looked up (and not kept)."""

    def __init__(self, entries: dict[str, Any]) -> None:
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> Any:
        value = self._entries[name]
        return value.read() if isinstance(value, LazyTensor) else value

    def __contains__(self, name: object) -> bool:
        return name in self._entries  # (the Mapping's default looks the tensor up: it would read it)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy ``name``'s tensor into ``out`` (same number of elements): read from the file straight into it where
        it can be (:meth:`LazyTensor.read_into`)."""
        value = self._entries[name]
        if isinstance(value, LazyTensor):
            value.read_into(out)
        else:
            out.copy_(value.reshape(out.shape))

    def position(self, name: str) -> tuple[str, int] | None:
        """Where ``name``'s tensor lies (file, offset): reading in this order reads each file front to back. None
        for a tensor already in memory."""
        value = self._entries[name]
        return value.position if isinstance(value, LazyTensor) else None

    def __setitem__(self, name: str, value: Any) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Merge another table without reading it (another rank's shard)."""
        if isinstance(other, LazyTensors):
            self._entries.update(other._entries)
        else:
            super().update(other, **kwargs)


def _lazy_unpickler(allowed: frozenset[str], file: _File) -> Any:
    base = safe_pickle.allowlist_unpickler(allowed)

    class Unpickler(base):
        def find_class(self, module: str, name: str) -> Any:
            found = super().find_class(module, name)  # (refuses what is not allowed, by name)
            if found is torch._utils._rebuild_tensor_v2:
                return _rebuild
            if found is torch._utils._rebuild_parameter:
                return lambda data, requires_grad, hooks: _read(data).requires_grad_(requires_grad)
            return found

        def persistent_load(self, pid: Any) -> Any:
            kind, storage_type, key, _location, numel = pid
            if kind != "storage":
                raise CheckpointError(f"{file.path}: unknown persistent id {kind!r}")
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else _DTYPE_OF_STORAGE[storage_type.__name__]
            return _Record(str(key), dtype, int(numel))

    def _rebuild(record: _Record, offset: int, size: Any, stride: Any, requires_grad: bool, hooks: Any,
                 metadata: Any = None) -> LazyTensor:
        return LazyTensor(file, record, int(offset), tuple(size), tuple(stride))

    return Unpickler


def _read(value: Any) -> Any:
    """``value`` with every :class:`LazyTensor` read, except inside :class:`LazyTensors` tables."""
    if isinstance(value, LazyTensor):
        return value.read()
    if isinstance(value, dict):
        return type(value)((k, _read(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_read(v) for v in value)
    return value


def _tables_lazy(value: Any) -> Any:
    """The ZeRO-Cache state tables (:data:`STATE_TABLES`) in ``value`` as :class:`LazyTensors`."""
    if isinstance(value, dict) and not isinstance(value, LazyTensors):
        return type(value)((k, LazyTensors(v) if k in STATE_TABLES and isinstance(v, dict) else _tables_lazy(v))
                           for k, v in value.items())
    return value


def load_lazily(path: Path, *, allow_unsafe_pickle: bool = False) -> Any:
    """:func:`angelptm.checkpoints.files.load_file` with ZeRO-Cache's state tables read lazily (module docstring).

    Raises:
        CheckpointError: as ``load_file``: unreadable, damaged, or naming a global off the allowlist.
    """
    safe_pickle.check_regular_file(path)
    allowed = safe_pickle.ENGINE_GLOBALS | safe_pickle.LEGACY_GLOBALS if allow_unsafe_pickle \
        else safe_pickle.ENGINE_GLOBALS
    try:
        file = _File(path)
        loaded = _lazy_unpickler(allowed, file)(io.BytesIO(file.pickle)).load()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as err:
        if "refused global" not in str(err):
            raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
        return safe_pickle.load(path, allow_unsafe_pickle=allow_unsafe_pickle)  # (its message names them)
    except Exception as err:  # a truncated or foreign file; say which one
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None
    return _read(_tables_lazy(loaded))
