"""Checkpoint files written record by record from a snapshot of ZeRO-Cache's states, in ``torch.save``'s format.

``torch.save(obj)`` needs every tensor of ``obj`` in memory at once; a checkpoint of ZeRO-Cache's states used to copy
all of them into CPU tensors first (24.6 GiB of staging at 2.7B). The files here are the same zip archives
``torch.save`` writes (``data.pkl``, then one ``data/<key>`` record per storage; ``torch.load`` and every reader of
the previous files read them unchanged), but the large tensors are :class:`~zero_cache.StateRef` placeholders in the
structure: :func:`plan_archive` pickles the structure at the save (small values taken as they are then) and
:func:`write_archives` writes each placeholder's record when the snapshot hands over its chunk
(:class:`~zero_cache.StateSnapshot`), into whichever of the open files holds it (a weight in ``model_states.pt``
and its master and moments in ``optim_states.pt`` come from one staged chunk). Each tensor is its own storage,
which is what a reader sees of them anyway.

The pickle is the one ``torch.save`` makes (protocol 2; ``torch._utils._rebuild_tensor_v2`` over a persistent id
``("storage", torch.<Type>Storage, key, "cpu", numel)``), so it names only globals on the loading allowlist
(:mod:`angelptm.checkpoints.safe_pickle`), checked here before anything is written.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from angelptm.checkpoints import manifest, safe_pickle
from zero_cache import StateRef, StateSnapshot

_STORAGE_ALIGNMENT = 64
"""Bytes each record's data is aligned to (``torch.save``'s default), so ``torch.load(mmap=True)`` maps it."""


@dataclass(slots=True)
class ArchivePlan:
    """One file's pickled structure and the records it still needs."""

    data_pkl: bytes
    """The pickle of the structure (``data.pkl``)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Record key -> a tensor taken at the save (CPU, contiguous): RNG state, buffers, client values."""
    refs: dict[str, StateRef] = field(default_factory=dict)
    """Record key -> the state it holds, written from the snapshot."""

    @property
    def num_bytes(self) -> int:
        """Bytes of its tensors (for a full disk's message)."""
        return (sum(t.numel() * t.element_size() for t in self.tensors.values())
                + sum(ref.num_bytes for ref in self.refs.values()))

    def refs_by_chunk(self) -> dict[int, list[tuple[str, StateRef]]]:
        out: dict[int, list[tuple[str, StateRef]]] = {}
        for key, ref in self.refs.items():
            out.setdefault(ref.chunk, []).append((key, ref))
        return out


@dataclass(frozen=True, slots=True)
class _Storage:
    """A record in the pickle: torch's persistent id for a storage."""

    key: str
    dtype: torch.dtype
    numel: int


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch gives them: a size-0 dimension counts as 1)."""
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


class _ArchivePickler(pickle.Pickler):
    """``torch.save``'s pickler, with :class:`StateRef` placeholders as tensors and every other tensor copied to its
    own record (``copy_tensors``: taken now, as a snapshot; else referenced, written from the live tensor)."""

    def __init__(self, buffer: io.BytesIO, plan: ArchivePlan, *, copy_tensors: bool) -> None:
        super().__init__(buffer, protocol=2)  # (torch.save's DEFAULT_PROTOCOL)
        self.plan, self.copy_tensors = plan, copy_tensors
        self._ref_keys: dict[StateRef, str] = {}

    def _new_key(self) -> str:
        return str(len(self.plan.tensors) + len(self.plan.refs))

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, StateRef):
            key = self._ref_keys.get(obj)
            if key is None:
                key = self._ref_keys[obj] = self._new_key()
                self.plan.refs[key] = obj
            return self._rebuild(_Storage(key, obj.dtype, obj.numel), obj.shape, requires_grad=False)
        if type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.is_quantized:
            tensor = obj.detach().to("cpu").contiguous()
            if self.copy_tensors and tensor.untyped_storage().data_ptr() == obj.untyped_storage().data_ptr():
                tensor = tensor.clone()  # (a CPU tensor: a copy, so that training may change the original)
            key = self._new_key()
            self.plan.tensors[key] = tensor
            return self._rebuild(_Storage(key, tensor.dtype, tensor.numel()), tuple(tensor.shape),
                                 requires_grad=obj.requires_grad)
        return NotImplemented  # parameters (rebuilt around their data, a plain tensor), containers, values

    @staticmethod
    def _rebuild(storage: _Storage, shape: tuple[int, ...], *, requires_grad: bool) -> tuple:
        return (torch._utils._rebuild_tensor_v2,
                (storage, 0, shape, contiguous_stride(shape), requires_grad, collections.OrderedDict()))

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            raise TypeError(f"a checkpoint cannot hold a bare {type(obj).__name__}; store tensors")
        return None


def plan_archive(obj: Any, path: Path, *, copy_tensors: bool) -> ArchivePlan:
    """Pickle ``obj`` (with :class:`StateRef` placeholders) for the file ``path``.

    Args:
        copy_tensors: take a copy of every tensor now (a save that goes on beside training); else they are
            written from the live tensors, which must not change until the file is written.

    Raises:
        CheckpointError: ``obj`` holds objects that loading would refuse (named, with what to store instead).
    """
    plan = ArchivePlan(data_pkl=b"")
    buffer = io.BytesIO()
    _ArchivePickler(buffer, plan, copy_tensors=copy_tensors).dump(obj)
    plan.data_pkl = buffer.getvalue()
    safe_pickle.refuse_unsafe_globals(safe_pickle.globals_of_pickle(plan.data_pkl), path)
    return plan


class _ArchiveWriter:
    """One archive being written: the header records at once, the state records as their chunks arrive."""

    def __init__(self, plan: ArchivePlan, target: Any) -> None:
        self.plan = plan
        self.zip = torch._C.PyTorchFileWriter(target, False, _STORAGE_ALIGNMENT)  # (no zip CRC: manifest.py says why)
        self.zip.write_record("data.pkl", plan.data_pkl, len(plan.data_pkl))
        for name, value in ((".format_version", "1"), (".storage_alignment", str(_STORAGE_ALIGNMENT)),
                            ("byteorder", sys.byteorder)):
            self.zip.write_record(name, value, len(value))
        for key, tensor in plan.tensors.items():
            self.write(key, tensor)
        self.unwritten = set(plan.refs)
        self.by_chunk = plan.refs_by_chunk()

    def write(self, key: str, tensor: torch.Tensor) -> None:
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        num_bytes = tensor.numel() * tensor.element_size()
        start = tensor.storage_offset() * tensor.element_size()
        storage = tensor.untyped_storage()[start:start + num_bytes]  # (a view of those bytes: nothing is copied)
        self.zip.write_record(f"data/{key}", storage, num_bytes)

    def write_chunk(self, staged: Any, snapshot: StateSnapshot) -> None:
        for key, ref in self.by_chunk.get(staged.chunk, ()):
            tensor = staged.tensor(ref)
            cast = tensor.dtype != torch.float32
            if cast:
                snapshot.hold_extra(ref.num_bytes)
            try:
                self.write(key, tensor)
            finally:
                if cast:
                    snapshot.release_extra(ref.num_bytes)
            self.unwritten.discard(key)

    def close(self) -> None:
        assert not self.unwritten, f"records never staged: {sorted(self.unwritten)[:5]}"
        self.zip.write_end_of_file()


def write_archives(plans: dict[Path, ArchivePlan], snapshot: StateSnapshot | None) -> list[manifest.FileRecord]:
    """Write every planned file, fsynced and hashed, the state records from ``snapshot``'s chunks as it stages them.

    Returns:
        The files' manifest records.

    Raises:
        OSError: a write failed, naming its file (ENOSPC: the disk is full).
        SnapshotAborted: the snapshot was given up.
    """
    with ExitStack() as files:
        writers = {}
        for path, plan in plans.items():
            target = files.enter_context(manifest.hashed_file(path))
            writers[path] = (_ArchiveWriter(plan, target), target)
        for staged in snapshot.staged() if snapshot is not None else ():
            for writer, _ in writers.values():
                writer.write_chunk(staged, snapshot)
        for writer, _ in writers.values():
            writer.close()
    return [target.record(path) for path, (_, target) in writers.items()]
