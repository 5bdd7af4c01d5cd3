"""The optimizer states as they were at a checkpoint, handed to a writer chunk by chunk through a few staging buffers.

A checkpoint of ZeRO-Cache's states used to copy every state into its own CPU tensor and ``torch.save`` them at
once: the whole fp32 state (12 bytes per parameter: 24.6 GiB at 2.7B, 183 GB at 13B) staged in host memory. Here a
save stages at most ``max_staged`` chunks' states at a time (each ``3 x chunk_numel`` fp32: master | exp_avg |
exp_avg_sq), and the writer writes each staged chunk and gives its buffer back.

**Consistency with training (copy-on-write per chunk).** The writer may still be writing when training goes on:
the snapshot must hold every chunk's states as they were at the save. The step modifies a chunk's states only
through the optimizer's update paths (the device's Adam, a host update or revision queued on the worker, a device
step of a host chunk, a load), and each of those first calls :meth:`StateSnapshot.before_update` for the chunk:
a chunk not yet staged is staged there, before the update is issued, waiting for a free buffer if all
``max_staged`` are full (the writer frees one with each chunk it writes). So a chunk is copied once, either in
order (:meth:`StateSnapshot.pump`, at the engine's calls) or just before its first update, and host memory never
holds more than ``max_staged`` staged chunks: training waits for the disk rather than growing the staging.

Why stage on the training thread only: reading a group's states goes through its home (a device copy on the
compute stream, an NVMe group through the home's bounce buffers), which the training thread and the host worker
use; on the training thread the read is ordered before every later update of that chunk by construction (the
barrier above), and a re-plan moving groups between homes cannot run beside it. The writer thread touches only the
staged buffers.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from zero_cache.storage.chunks import STATE_FIELDS, ChunkStore


@dataclass(frozen=True, slots=True)
class StateRef:
    """One parameter's optimizer state (or its weight, cast from the master) in a checkpoint's structure, standing
    for the tensor until its chunk is staged. Equal refs are the same tensor."""

    field: str
    """``master``, ``exp_avg`` or ``exp_avg_sq``."""
    name: str
    """The parameter's qualified name."""
    chunk: int
    """Its chunk."""
    offset: int
    """Its first element in the chunk."""
    numel: int
    """Its elements."""
    shape: tuple[int, ...]
    """Its shape."""
    dtype: torch.dtype = torch.float32
    """The dtype written: fp32, or the compute dtype for a weight written from its master (the param chunk holds
    exactly the master cast to it: every path that writes a param writes it from its master)."""

    @property
    def num_bytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(slots=True)
class StagedChunk:
    """One chunk's states copied out of its home, for the writer."""

    chunk: int
    states: torch.Tensor
    """``3 x chunk_numel`` fp32 on the host: master | exp_avg | exp_avg_sq."""
    ready: torch.cuda.Event | None
    """The device->host copy to wait for before reading ``states`` (None: the copy was synchronous)."""

    def tensor(self, ref: StateRef) -> torch.Tensor:
        """``ref``'s values: a view of the staged states, or a cast copy (a weight in the compute dtype)."""
        assert ref.chunk == self.chunk, f"{ref.name} is in chunk {ref.chunk}, not {self.chunk}"
        numel = self.states.numel() // len(STATE_FIELDS)
        start = STATE_FIELDS.index(ref.field) * numel + ref.offset
        view = self.states[start:start + ref.numel]
        return view if ref.dtype == view.dtype else view.to(ref.dtype)


class SnapshotAborted(Exception):
    """The snapshot was given up (its writer failed): nothing more is staged."""


class StateSnapshot:
    """The states of ``chunks`` at the moment it is made, staged through at most ``max_staged`` buffers.

    Args:
        store: the chunk storage (its states must be settled: nothing in flight).
        chunks: the chunks to stage, in the order the writer prefers (model order).
        max_staged: the most chunks staged at once (buffers of ``3 x chunk_numel`` fp32 each).
        allocate: makes one staging buffer of a given numel (default: fp32 on the host, pinned beside a GPU);
            tests count with it.
    """

    def __init__(self, store: ChunkStore, chunks: list[int], *, max_staged: int,
                 allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        if max_staged < 1:
            raise ValueError(f"max_staged must be at least 1 (chunks staged at once), got {max_staged}")
        self.store = store
        self.max_staged = max_staged
        self._numel = len(STATE_FIELDS) * store.layout.chunk_numel
        device = next((tier.device for tier in store.tiers.values()
                       if getattr(tier, "device", None) is not None and tier.device.type == "cuda"), None)
        self._allocate = allocate or (lambda numel: torch.empty(numel, dtype=torch.float32,
                                                                pin_memory=device is not None))
        self._lock = threading.Condition()
        self._unstaged: dict[int, None] = dict.fromkeys(chunks)  # (ordered: the writer's preference)
        self._ready: collections.deque[StagedChunk] = collections.deque()
        self._free: list[torch.Tensor] = []
        self._staging = 0  # chunks being copied by the training thread now
        self._held = 0  # buffers staged or being written (<= max_staged)
        self.buffers_allocated = 0
        """Staging buffers made over the snapshot's life (<= max_staged)."""
        self.peak_staged_bytes = 0
        """The most bytes of staging (buffers held plus the writer's cast copies) alive at once."""
        self.staged_before_update = 0
        """Chunks staged by :meth:`before_update` (the step reached them before the writer did)."""
        self._extra_bytes = 0
        self._aborted = False
        self.num_chunks = len(chunks)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one staging buffer (one chunk's three fp32 fields)."""
        return self._numel * 4

    # ------------------------------------------------------------------ the training thread
    def before_update(self, chunk: int) -> None:
        """Stage ``chunk`` if it is not staged yet: the optimizer calls this before it modifies the chunk's states."""
        if chunk not in self._unstaged:  # (read without the lock: the set only shrinks)
            return
        if self._stage(chunk, wait=True):
            self.staged_before_update += 1

    def pump(self) -> None:
        """Stage chunks in order while a buffer is free, without waiting (the engine calls it at its entry points,
        so the writer has work while the model computes)."""
        while self._unstaged and self._stage(None, wait=False):
            pass

    def stage_all(self) -> None:
        """Stage every chunk left, waiting for buffers as the writer frees them (a save that is waited for)."""
        while self._unstaged and self._stage(None, wait=True):
            pass

    def _stage(self, chunk: int | None, *, wait: bool) -> bool:
        """Stage ``chunk`` (None: the next in order); False when nothing was staged (no buffer free without
        waiting, nothing left, or aborted)."""
        with self._lock:
            while not self._aborted and self._held >= self.max_staged and wait:
                self._lock.wait()
            if self._aborted or self._held >= self.max_staged:
                return False
            if chunk is None:
                chunk = next(iter(self._unstaged), None)
            if chunk is None or chunk not in self._unstaged:
                return False
            del self._unstaged[chunk]
            buffer = self._free.pop() if self._free else None
            self._held += 1
            self._staging += 1
        try:
            if buffer is None:
                buffer = self._allocate(self._numel)
                self.buffers_allocated += 1
            ready = self._copy(chunk, buffer)
        except BaseException:
            with self._lock:
                self._staging -= 1
                self._aborted = True  # a chunk the writer will never get: the save cannot complete
                self._lock.notify_all()
            raise
        with self._lock:
            self._staging -= 1
            self._ready.append(StagedChunk(chunk, buffer, ready))
            self._note_bytes()
            self._lock.notify_all()
        return True

    def _copy(self, chunk: int, buffer: torch.Tensor) -> torch.cuda.Event | None:
        """Copy the chunk's states into ``buffer``: on the current stream, so every later update of the chunk (issued
        after this returns) runs after the read."""
        with self.store.open_states(chunk) as states:
            on_device = states.device.type == "cuda"
            buffer.copy_(states.reshape(-1), non_blocking=on_device)
            if not on_device:
                return None
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(states.device))
            return event

    # ------------------------------------------------------------------ the writer thread
    def staged(self) -> Iterator[StagedChunk]:
        """The staged chunks in the order they were staged, until every chunk was handed over; each buffer goes back
        when the loop asks for the next one (so the writer holds one while it writes it).

        Raises:
            SnapshotAborted: the snapshot was given up.
        """
        while True:
            with self._lock:
                while not self._ready and (self._unstaged or self._staging) and not self._aborted:
                    self._lock.wait()
                if self._aborted:
                    raise SnapshotAborted("the checkpoint's snapshot was given up")
                if not self._ready:
                    return
                staged = self._ready.popleft()
            if staged.ready is not None:
                staged.ready.synchronize()
            yield staged
            with self._lock:
                self._free.append(staged.states)
                self._held -= 1
                self._lock.notify_all()

    def hold_extra(self, num_bytes: int) -> None:
        """Count ``num_bytes`` more of staging (the writer's cast copy of a weight) until :meth:`release_extra`."""
        with self._lock:
            self._extra_bytes += num_bytes
            self._note_bytes()

    def release_extra(self, num_bytes: int) -> None:
        with self._lock:
            self._extra_bytes -= num_bytes

    def _note_bytes(self) -> None:
        live = self._held * self.buffer_bytes + self._extra_bytes
        self.peak_staged_bytes = max(self.peak_staged_bytes, live)

    # ------------------------------------------------------------------ either
    def abort(self) -> None:
        """Give up: stage nothing more (updates go ahead at once) and free the buffers."""
        with self._lock:
            self._aborted = True
            self._unstaged.clear()
            self._ready.clear()
            self._free.clear()
            self._lock.notify_all()

    def finished(self) -> bool:
        """Whether every chunk was staged (or the snapshot given up): updates no longer wait for it."""
        return not self._unstaged

    def release(self) -> None:
        """Drop the staging buffers (the save is over)."""
        with self._lock:
            self._free.clear()
            self._ready.clear()
