"""Params homed on NVMe (DeepSpeed's ``offload_param: nvme``): the home class that proved a new kind of home is
one subclass of :class:`~zero_cache.storage.param_homes.home.ParamHome` (and one entry in
:data:`zero_cache.storage.param_homes.registry.HOME_CLASSES`; what it costs the planner is
:class:`~zero_cache.plan.home_costs.NvmeCosts`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from zero_cache.plan.home_costs import (  # noqa: F401
    HOME_COSTS,
    NVME_HELD,
    NVME_HELD_GRADIENTS,
    NVME_READS_AHEAD,
    NVME_STAGING_BUFFERS,  # (re-exported: the buffers' shares are the plan's to count)
)
from zero_cache.plan.tier_names import HOST, NVME
from zero_cache.storage.nvme import ALIGN_BYTES, NvmeTier
from zero_cache.storage.param_homes.home import ParamHome, copy_in_and_gather
from zero_cache.storage.tiers import BufferPool, wait


class NvmeHome(ParamHome):
    """The shard lives in a slot of a swap file on NVMe (DeepSpeed's ``offload_param: nvme``): host memory holds only
    :data:`NVME_STAGING_BUFFERS` pinned buffers for all of them.

    A gather reads the slot into a buffer (started ahead along the recorded trace, through the same asynchronous
    IO as the NVMe optimizer states, :mod:`zero_cache.storage.aio`) and copies it in. The reduced gradient is copied
    into a buffer, where the host's Adam takes it (updates run during backward: soon), writes the new params over it,
    and the buffer goes to the slot (written behind: a later read of the slot waits for it). A gradient whose update
    waits until after backward waits in a buffer, at most :data:`NVME_HELD_GRADIENTS` of them (the last ones
    backward writes, which the step updates first); the oldest beyond them goes to the slot over the params, as a
    host home keeps them, and is read back for its update. A gradient whose update runs during backward stays in its
    buffer until the worker takes it (a write then waits for a buffer rather than send it to disk). Per step that is
    a read per gather and a write per updated shard, plus a write and a read per gradient that waited on disk
    (:meth:`gradients_to_disk_per_step`).
    """

    costs = HOME_COSTS[NVME]

    def __init__(self, tiers: dict[str, Any], numel: int, dtype: torch.dtype, num_shards: int = 0) -> None:
        super().__init__(tiers, numel, dtype)
        if self.name not in tiers:
            raise ValueError("params homed on NVMe need an NVMe tier: set zero_cache.nvme_path (or "
                             "offload_param.nvme_path) to a directory on a local disk")
        self.value_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self._tier: NvmeTier = tiers[NVME]
        self.disk: NvmeTier = self._tier.split(self.value_bytes, self.disk_bytes(num_shards, self.value_bytes))
        """The homes' own swap file (its slots are shard-sized), its bytes taken from the NVMe tier's budget."""
        host = tiers[HOST]
        self.pool = BufferPool(NVME_STAGING_BUFFERS, lambda: host.allocate_aligned(self.disk.slot_bytes, ALIGN_BYTES),
                               free=lambda buffer: host.free_aligned(buffer, ALIGN_BYTES))
        self._offsets: dict[int, int] = {}  # group -> its slot
        self._raw: dict[int, torch.Tensor] = {}  # a buffer's address -> the whole aligned buffer (IO moves whole slots)
        self._ahead: dict[int, tuple[torch.Tensor, Any]] = {}  # group -> (buffer, read) started by prefetch
        self._gradients: dict[int, tuple[torch.Tensor, Any]] = {}  # group -> (buffer, d2h copy): gradients held...
        self._waiting: set[int] = set()  # ...of them, those whose update runs after backward (the others: soon)
        self._stale: set[int] = set()  # groups whose slot's params a gradient replaced, until new params are written
        # Orders reads, writes and the held buffers of one slot between the training thread and the worker.
        self._lock = threading.Lock()
        self.reads_ahead_used = 0
        """Gathers that found their read started ahead (:meth:`prefetch`)."""
        self.gradients_to_disk = 0
        """Gradients that waited for their update on disk (more were waiting than buffers hold)."""

    def allocate(self, group: int) -> torch.Tensor | None:
        if self.disk.slot_bytes > self.disk.free_bytes:  # a re-plan homes more shards here than the first plan did
            self._tier.lend(self.disk, self.disk.slot_bytes)
        self._offsets[group] = self.disk.allocate_slot()
        return None

    def free(self, group: int, shard: torch.Tensor | None) -> None:
        self._drop(group, gradient=True)
        self.disk.free_slot(self._offsets.pop(group))

    def held_bytes(self) -> dict[str, int]:
        return {}  # (a slot of the homes' own swap file, which keeps its slots once lent them)

    def has_room(self) -> bool:
        """A slot free in the homes' swap file, or the NVMe tier's budget to lend one (:meth:`allocate`)."""
        return max(self.disk.free_bytes, self._tier.free_bytes) >= self.disk.slot_bytes

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
        """Write ``values`` (the group's params, in a staging buffer) to its slot and give the buffer back behind
        the write."""
        with self._lock:
            self._stale.discard(group)
            return self._write_locked(group, values)

    def _write_locked(self, group: int, values: torch.Tensor) -> Any:
        # A read started ahead before this write would keep the old values, a gradient held for the slot is
        # superseded (an update that only restored the params): both dropped.
        self._waiting.discard(group)
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
            # A slot whose new params are not written yet would be read for nothing (the write drops the read).
            if group in self._ahead or group in self._stale or len(self._ahead) >= NVME_READS_AHEAD:
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
            if gradient:
                self._waiting.discard(group)
                self._stale.discard(group)
        for buffer_and_token in held:
            if buffer_and_token is not None:
                self._release(*buffer_and_token)

    def forget_prefetched(self) -> None:
        for group in list(self._ahead):
            self._drop(group)

    def trim(self) -> None:
        """The pinned staging buffers go when no shard lives here (the plan counts them only while one does)."""
        if not self._offsets:
            self.forget_prefetched()
            self.pool.trim()
            self._raw.clear()  # (the whole buffers behind the pool's views: kept here, they would stay pinned)

    def gather(self, group: int, shard: torch.Tensor | None, buffer: torch.Tensor, sharding: Any,
               transfers: Any) -> Any:
        values, read = self._take_ahead(group)
        wait(read)
        copied, work = copy_in_and_gather(values, buffer, sharding, transfers)
        self._release(values, copied)
        return work

    def write_gradient(self, group: int, shard: torch.Tensor | None, reduced: torch.Tensor, transfers: Any, *,
                       waits: bool = True) -> Any:
        values = self._acquire()  # (all in use: gradients taken soon by the worker, which gives buffers back)
        copied = transfers.copy(values, reduced, "d2h", after=transfers.mark())
        with self._lock:
            self._gradients[group] = values, copied
            self._stale.add(group)
            if waits:
                self._waiting.add(group)
            while len(self._waiting) > NVME_HELD_GRADIENTS:  # the oldest waits on disk
                oldest = next(g for g in self._gradients if g in self._waiting)
                self._waiting.discard(oldest)
                held, held_copy = self._gradients.pop(oldest)
                wait(held_copy)
                self._write_locked(oldest, held)
                self.gradients_to_disk += 1
        return copied

    def fetch_gradient(self, group: int, param_chunk: torch.Tensor | None, pool: BufferPool, transfers: Any, *,
                       written: Any, landed: Any) -> tuple[torch.Tensor, Any]:
        with self._lock:
            held = self._gradients.pop(group, None)
            self._waiting.discard(group)
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
