"""Where a chunk's params live between uses: its **home**, one class per kind (device, host, NVMe).

Replicated params live on the device for good (:class:`DeviceHome`). Gathered params (sharded over
ranks, or streamed on one rank) keep this rank's shard of each collective group at a home the plan
names; a group is made whole on the device only while it is used (:mod:`zero_cache.gathered`). A
step asks each home five things, and nothing else in the runtime knows which kind it is:

* ``gather``: make the group whole in a device buffer (its slot among the live groups);
* ``write_gradient``: take the group's reduced gradient, which replaces the params in the home
  until the step regenerates them from the fp32 masters (one micro-batch per step);
* ``fetch_gradient`` / ``update_buffer``: where the host's Adam reads the gradient and writes the
  new params in the compute dtype;
* ``store_params``: put those new params home (a host->device copy, nothing when the update ran in
  the home itself, or a disk write).

And the planner asks the class what a home costs: host bytes, disk bytes, and disk bytes moved per
step (PCIe bytes are the same for every home off the device: :mod:`zero_cache.step_cost`). A new
kind of home is one subclass; it registers itself under its tier name (:func:`home_class`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, ClassVar, Iterator

import torch

from zero_cache.nvme import ALIGN_BYTES, NvmeTier, align_up
from zero_cache.tier_names import DEVICE, HOST, NVME, TierName
from zero_cache.tiers import BufferPool, wait

_HOMES: dict[str, type["ParamHome"]] = {}


def home_class(name: str) -> type["ParamHome"]:
    """The home class of a tier name (the plan's ``param_home`` entries)."""
    return _HOMES[name]


class ParamHome:
    """A kind of home for param chunks (shards): its cost for the planner, and how a step reaches it.

    Args:
        tiers: the store's tiers by name (a home allocates from the one it is named after).
        numel: elements of one shard.
        dtype: the compute dtype.
        num_shards: shards the plan puts in homes of this kind (a home that reserves room up front uses it).
    """

    name: ClassVar[TierName]
    streams: ClassVar[bool] = True
    """Off the device: copied in on use (its gathers cost PCIe bytes each time)."""
    in_host_memory: ClassVar[bool] = False
    """The shard is pinned host memory: the host's Adam updates it in place, and a device step reads its gradient
    from there and writes its params back there (:mod:`zero_cache.device_steps`)."""
    stages_updates: ClassVar[bool] = True
    """Host updates of its chunks go through the updater's staging buffers (planned with the host's bytes)."""
    device_steppable: ClassVar[bool] = True
    """Its chunks' host-held optimizer groups may be stepped on the device after backward."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _HOMES[cls.name] = cls

    # ------------------------------------------------------------------ cost (the planner's questions)
    @classmethod
    def host_bytes(cls, shards: int, shard_bytes: int) -> int:
        """Host bytes that ``shards`` homes of this kind take (buffers included)."""
        return 0

    @classmethod
    def disk_bytes(cls, shards: int, shard_bytes: int) -> int:
        """Swap-file bytes that ``shards`` homes of this kind take."""
        return 0

    @classmethod
    def disk_bytes_per_step(cls, shards: int, owned: int, shard_bytes: int, gathers_per_step: float) -> int:
        """Disk bytes one step moves for ``shards`` homes, ``owned`` of them updated by this rank."""
        return 0

    # ------------------------------------------------------------------ the runtime's questions
    def __init__(self, tiers: dict[str, Any], numel: int, dtype: torch.dtype, num_shards: int = 0) -> None:
        self.tiers, self.numel, self.dtype = tiers, numel, dtype

    def allocate(self, group: int) -> torch.Tensor | None:
        """Room for ``group``'s shard, zeroed: its tensor, or None where the home is not addressable memory (a
        file)."""
        return self.tiers[self.name].allocate(self.numel, self.dtype)

    def free(self, group: int, shard: torch.Tensor | None) -> None:
        self.tiers[self.name].free(shard)

    @contextlib.contextmanager
    def open(self, group: int, shard: torch.Tensor | None, *, fresh: bool = False,
             write_back: bool = False) -> Iterator[torch.Tensor]:
        """The shard's values, readable and (with ``write_back``) writable for the block; synchronous (setup,
        moves between homes, checkpoints). ``fresh``: its old values are not needed."""
        yield shard

    def gather(self, group: int, shard: torch.Tensor | None, buffer: torch.Tensor, sharding: Any,
               transfers: Any) -> Any:
        """Start making ``group`` whole in the device ``buffer``; returns the work to wait for."""
        raise NotImplementedError

    def reduce_target(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        """Where a reduce-scatter may write the reduced gradient itself (device memory), else None: it stays in
        the bucket and :meth:`write_gradient` takes it home."""
        return None

    def write_gradient(self, group: int, shard: torch.Tensor | None, reduced: torch.Tensor, transfers: Any) -> Any:
        """Take this rank's reduced gradient slice (on the device) home, over the params; returns its token."""
        raise NotImplementedError

    def fetch_gradient(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool, transfers: Any, *,
                       written: Any, landed: Any) -> tuple[torch.Tensor, Any]:
        """(host buffer holding the chunk's gradient in the compute dtype, token of its transfer) for the host's
        Adam; ``written``: the compute-stream point after which a gradient in the param chunk is complete,
        ``landed``: :meth:`write_gradient`'s token."""
        buffer = pool.acquire()
        return buffer, transfers.copy(buffer, param_chunk, "d2h", after=written)

    def update_buffer(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool) -> torch.Tensor:
        """A host buffer for the chunk's new params when none was fetched (a revision, restored masters)."""
        return pool.acquire()

    def give_back(self, buffer: torch.Tensor, pool: BufferPool, in_use_until: Any = None) -> None:
        """Return a buffer of :meth:`fetch_gradient` or :meth:`update_buffer` unused (a deferred or failed update)."""
        pool.release(buffer, in_use_until)

    def store_params(self, group: int, param_chunk: torch.Tensor | None, buffer: torch.Tensor, pool: BufferPool,
                     transfers: Any) -> Any:
        """Put the new params in ``buffer`` home and give the buffer back; returns the device-side event the next
        use of the chunk waits for (None: nothing to wait for on the device)."""
        ready = transfers.copy(param_chunk, buffer, "h2d")
        pool.release(buffer, ready)
        return ready

    def prefetch(self, group: int) -> None:
        """``group`` will be gathered soon (along the recorded trace): start what can start early."""

    def forget_prefetched(self) -> None:
        """Drop what :meth:`prefetch` started (the shards change: a step, a restore)."""

    def flush(self) -> None:
        """Wait for the writes in flight (raise a failed one's error)."""

    def close(self) -> None:
        """Free what the home holds outside the tiers' memory (a swap file)."""

    def disk_report(self) -> dict[str, int]:
        """Disk bytes the home holds ("bytes") and has read and written since the last report ("read", "write")."""
        return {}

    def use_timeline(self, timeline: Any) -> None:
        """While a step is traced, the home's disk requests go on the timeline's ``disk`` track."""


class DeviceHome(ParamHome):
    """The shard (or the replicated param chunk) stays in device memory: used in place on one rank, all-gathered
    over several; the device's Adam may update it, and the host's sends its new params back in."""

    name = DEVICE
    streams = False

    def gather(self, group: int, shard: torch.Tensor | None, buffer: torch.Tensor, sharding: Any,
               transfers: Any) -> Any:
        return sharding.all_gather(buffer, source=shard)

    def reduce_target(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        return shard

    def write_gradient(self, group: int, shard: torch.Tensor | None, reduced: torch.Tensor, transfers: Any) -> Any:
        return None  # the reduce-scatter wrote it (reduce_target)


class HostHome(ParamHome):
    """The shard lives in pinned host memory (DeepSpeed's ``offload_param: cpu``): copied in on use, its reduced
    gradient copied home over it, and updated there in place by the host's Adam (it is its own staging buffer)."""

    name = HOST
    in_host_memory = True
    stages_updates = False

    @classmethod
    def host_bytes(cls, shards: int, shard_bytes: int) -> int:
        return shards * shard_bytes

    def gather(self, group: int, shard: torch.Tensor | None, buffer: torch.Tensor, sharding: Any,
               transfers: Any) -> Any:
        return copy_in_and_gather(shard, buffer, sharding, transfers)[1]

    def write_gradient(self, group: int, shard: torch.Tensor | None, reduced: torch.Tensor, transfers: Any) -> Any:
        return transfers.copy(shard, reduced, "d2h", after=transfers.mark())

    def fetch_gradient(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool, transfers: Any, *,
                       written: Any, landed: Any) -> tuple[torch.Tensor, Any]:
        return param_chunk, landed  # already home: updated there, in place

    def update_buffer(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool) -> torch.Tensor:
        return param_chunk

    def give_back(self, buffer: torch.Tensor, pool: BufferPool, in_use_until: Any = None) -> None:
        pass  # the home itself

    def store_params(self, group: int, param_chunk: torch.Tensor | None, buffer: torch.Tensor, pool: BufferPool,
                     transfers: Any) -> Any:
        return None  # updated in place; the next gather copies it in


class _Copied:
    """A host->device copy behind a collective's ``wait()``: orders the caller's stream after it."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream(self.event.device).wait_event(self.event)


def copy_in_and_gather(source: torch.Tensor, buffer: torch.Tensor, sharding: Any, transfers: Any) -> tuple[Any, Any]:
    """This rank's shard copied in from host memory (``source``), then the other ranks' slots gathered behind it;
    returns (the copy's event, the work to wait for).

    The copy waits for the compute stream issued so far: the caching allocator may have handed out memory that
    kernels queued there still read.
    """
    copied = transfers.copy(sharding.mine(buffer), source, "h2d", after=transfers.mark())
    if not sharding.sharded:
        return copied, _Copied(copied)
    if transfers.h2d is None:
        return copied, sharding.all_gather(buffer)
    with torch.cuda.stream(transfers.h2d):  # NCCL's stream then waits for the copy, not for compute
        return copied, sharding.all_gather(buffer)


NVME_STAGING_BUFFERS = 8
"""Pinned buffers of one shard each through which NVMe homes are read and written: the host worker holds up to
three (the update's gradient, the next update's, a revision's output), the training thread one (a gather or a
gradient arriving), and the rest hold reads started ahead along the trace and gradients waiting for their update."""
NVME_HELD = NVME_STAGING_BUFFERS - 4
"""Buffers held between calls, reads started ahead and gradients together (never more, so the worker and the
training thread always find one)."""


class NvmeHome(ParamHome):
    """The shard lives in a slot of a swap file on NVMe (DeepSpeed's ``offload_param: nvme``): host memory holds only
    :data:`NVME_STAGING_BUFFERS` pinned buffers for all of them.

    A gather reads the slot into a buffer (started ahead along the recorded trace, through the same asynchronous
    IO as the NVMe optimizer states, :mod:`zero_cache.aio`) and copies it in. The reduced gradient is copied into a
    buffer, where the host's Adam takes it (updates run during backward: soon), writes the new params over it, and
    the buffer goes to the slot (written behind: a later read of the slot waits for it). Gradients waiting beyond
    :data:`NVME_HELD` buffers (updates after backward) go to the slot over the params, as a host home keeps them,
    and are read back for their update. Per step that is a read per gather and a write per updated shard (plus a
    write and a read per gradient that had to wait on disk).
    """

    name = NVME
    stages_updates = False
    device_steppable = False

    @classmethod
    def host_bytes(cls, shards: int, shard_bytes: int) -> int:
        return NVME_STAGING_BUFFERS * (align_up(shard_bytes) + ALIGN_BYTES) if shards else 0

    @classmethod
    def disk_bytes(cls, shards: int, shard_bytes: int) -> int:
        return shards * align_up(shard_bytes)

    @classmethod
    def disk_bytes_per_step(cls, shards: int, owned: int, shard_bytes: int, gathers_per_step: float) -> int:
        return int((shards * gathers_per_step + owned) * align_up(shard_bytes))

    def __init__(self, tiers: dict[str, Any], numel: int, dtype: torch.dtype, num_shards: int = 0) -> None:
        super().__init__(tiers, numel, dtype)
        if NVME not in tiers:
            raise ValueError("params homed on NVMe need an NVMe tier: set zero_cache.nvme_path (or "
                             "offload_param.nvme_path) to a directory on a local disk")
        self.value_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self.disk: NvmeTier = tiers[NVME].split(self.value_bytes, self.disk_bytes(num_shards, self.value_bytes))
        """The homes' own swap file (its slots are shard-sized), its bytes taken from the NVMe tier's budget."""
        host = tiers[HOST]
        self.pool = BufferPool(NVME_STAGING_BUFFERS, lambda: host.allocate_aligned(self.disk.slot_bytes, ALIGN_BYTES))
        self._offsets: dict[int, int] = {}  # group -> its slot
        self._raw: dict[int, torch.Tensor] = {}  # a buffer's address -> the whole aligned buffer (IO moves whole slots)
        self._ahead: dict[int, tuple[torch.Tensor, Any]] = {}  # group -> (buffer, read) started by prefetch
        self._gradients: dict[int, tuple[torch.Tensor, Any]] = {}  # group -> (buffer, d2h copy): gradients held
        # Orders reads, writes and the held buffers of one slot between the training thread and the worker.
        self._lock = threading.Lock()
        self.reads_ahead_used = 0
        """Gathers that found their read started ahead (:meth:`prefetch`)."""
        self.gradients_to_disk = 0
        """Gradients that waited for their update on disk (more were waiting than buffers hold)."""

    def allocate(self, group: int) -> torch.Tensor | None:
        self._offsets[group] = self.disk.allocate_slot()
        return None

    def free(self, group: int, shard: torch.Tensor | None) -> None:
        self._drop(group, gradient=True)
        self.disk.free_slot(self._offsets.pop(group))

    def _values(self, raw: torch.Tensor) -> torch.Tensor:
        values = raw[:self.value_bytes].view(self.dtype)
        self._raw[values.data_ptr()] = raw
        return values

    def _acquire(self) -> torch.Tensor:
        return self._values(self.pool.acquire())

    def _release(self, values: torch.Tensor, in_use_until: Any = None) -> None:
        self.pool.release(self._raw[values.data_ptr()], in_use_until)

    def _read(self, group: int) -> tuple[torch.Tensor, Any]:
        values = self._acquire()
        return values, self.disk.read(self._offsets[group], self._raw[values.data_ptr()])

    def _write(self, group: int, values: torch.Tensor) -> Any:
        """Write ``values`` (a staging buffer) to the group's slot and give the buffer back behind the write."""
        with self._lock:
            return self._write_locked(group, values)

    def _write_locked(self, group: int, values: torch.Tensor) -> Any:
        # A read started ahead before this write would keep the old values, a gradient held for the slot is
        # superseded (an update that only restored the params): both dropped.
        for held in (self._ahead.pop(group, None), self._gradients.pop(group, None)):
            if held is not None:
                self._release(*held)
        written = self.disk.write(self._offsets[group], self._raw[values.data_ptr()])
        self._release(values, written)
        return written

    @contextlib.contextmanager
    def open(self, group: int, shard: torch.Tensor | None, *, fresh: bool = False,
             write_back: bool = False) -> Iterator[torch.Tensor]:
        if fresh:
            values = self._acquire()
            values.zero_()  # (the padding too: collectives and norms read whole chunks)
        else:
            values, read = self._read(group)
            wait(read)
        try:
            yield values
        except BaseException:
            self._release(values)
            raise
        if write_back:
            wait(self._write(group, values))
        else:
            self._release(values)

    def prefetch(self, group: int) -> None:
        with self._lock:  # (never blocks on a buffer: the worker may hold them, and takes this lock to write)
            if group in self._ahead or len(self._ahead) + len(self._gradients) >= NVME_HELD:
                return
            raw = self.pool.try_acquire()
            if raw is not None:
                self._ahead[group] = self._values(raw), self.disk.read(self._offsets[group], raw)

    def _take_ahead(self, group: int) -> tuple[torch.Tensor, Any]:
        with self._lock:
            started = self._ahead.pop(group, None)
        if started is None:
            return self._read(group)
        self.reads_ahead_used += 1
        return started

    def _drop(self, group: int, *, gradient: bool = False) -> None:
        """Release the read started ahead for ``group`` (and, with ``gradient``, its held gradient)."""
        with self._lock:
            held = [self._ahead.pop(group, None), self._gradients.pop(group, None) if gradient else None]
        for buffer_and_token in held:
            if buffer_and_token is not None:
                self._release(*buffer_and_token)

    def forget_prefetched(self) -> None:
        for group in list(self._ahead):
            self._drop(group)

    def gather(self, group: int, shard: torch.Tensor | None, buffer: torch.Tensor, sharding: Any,
               transfers: Any) -> Any:
        values, read = self._take_ahead(group)
        wait(read)
        copied, work = copy_in_and_gather(values, buffer, sharding, transfers)
        self._release(values, copied)
        return work

    def write_gradient(self, group: int, shard: torch.Tensor | None, reduced: torch.Tensor, transfers: Any) -> Any:
        values = self._acquire()
        copied = transfers.copy(values, reduced, "d2h", after=transfers.mark())
        with self._lock:
            self._gradients[group] = values, copied
            while len(self._ahead) + len(self._gradients) > NVME_HELD:  # the oldest waits on disk
                if self._ahead:
                    self._release(*self._ahead.pop(next(iter(self._ahead))))
                    continue
                oldest = next(iter(self._gradients))
                held, held_copy = self._gradients.pop(oldest)
                wait(held_copy)
                self._write_locked(oldest, held)
                self.gradients_to_disk += 1
        return copied

    def fetch_gradient(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool, transfers: Any, *,
                       written: Any, landed: Any) -> tuple[torch.Tensor, Any]:
        with self._lock:
            held = self._gradients.pop(group, None)
        if held is not None:
            return held
        values = self._acquire()
        with self._lock:  # (after a spilled gradient's write: the read waits for it)
            return values, self.disk.read(self._offsets[group], self._raw[values.data_ptr()])

    def update_buffer(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool) -> torch.Tensor:
        return self._acquire()

    def give_back(self, buffer: torch.Tensor, pool: BufferPool, in_use_until: Any = None) -> None:
        self._release(buffer, in_use_until)

    def store_params(self, group: int, param_chunk: torch.Tensor | None, buffer: torch.Tensor, pool: BufferPool,
                     transfers: Any) -> Any:
        self._write(group, buffer)
        return None  # the next gather's read of the slot waits for the write

    def flush(self) -> None:
        self.disk.flush()

    def disk_report(self) -> dict[str, int]:
        return {"bytes": self.disk.used_bytes, **self.disk.traffic.take()}

    def use_timeline(self, timeline: Any) -> None:
        self.disk.timeline = timeline

    def close(self) -> None:
        self.forget_prefetched()
        self.disk.close()
