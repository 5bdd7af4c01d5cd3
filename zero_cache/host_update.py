"""The host side of ZeRO-Cache's update: pinned staging buffers, transfers, and one worker thread.

For each host-resident chunk the worker runs one :class:`ChunkUpdate`:

1. fetch the chunk's gradient: a device->host copy of the whole param chunk (single-micro-batch
   steps write gradients into the param chunk's own memory) into a pinned staging buffer, or the
   fp32 accumulator that already lives on the host;
2. CPU Adam over the chunk's fp32 master / exp_avg / exp_avg_sq, leaving the new weights in the
   compute dtype in that same staging buffer (``csrc/fused_host_adam.cpp`` does both in one pass
   over the buffer's gradients; the library kernels need a conversion pass before and after);
3. the buffer copied into the param chunk on the host->device stream; the next forward waits for
   that copy alone.

While it updates chunk i the worker has already issued the fetch of chunk i + 1, so the copies of
one chunk overlap CPU Adam of the next. A few buffers serve every transfer (no per-step pinning,
no per-chunk staging), and on a CPU-only run the same code runs with synchronous copies.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zero_cache.chunks import STATE_FIELDS, ChunkStore
from zero_cache.host_adam import HostAdam
from zero_cache.layout import TensorSlot
from zero_cache.planner import HOST
from zero_cache.tiers import Tier

_STOP = object()
STAGING_BUFFERS = 4
"""Pinned chunk-sized buffers: one being fetched ahead, one under CPU Adam, the rest in H2D flight."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient was inf/NaN while host chunks were being updated during backward (cannot be skipped)."""

    def __init__(self, where: str) -> None:
        super().__init__(f"non-finite gradient ({where}) while zero_cache updated host chunks during backward: the "
                         "step cannot be skipped. Resume from the last checkpoint with zero_cache.update_in_backward "
                         "false (or gradient_clipping > 0), which skips such steps")


class Transfers:
    """Copies between the device and pinned host memory on their own CUDA streams (plain copies on CPU).

    Every copy returns the event that marks its completion (None on CPU, where copies are synchronous).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self._lock = threading.Lock()
        self.moved_bytes = {"d2h": 0, "h2d": 0}

    def mark(self) -> torch.cuda.Event | None:
        """An event after everything issued so far on the calling thread's current stream."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, destination: torch.Tensor, source: torch.Tensor, direction: str,
             after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """``destination.copy_(source)`` on the ``direction`` ("d2h" or "h2d") stream, after ``after``."""
        with self._lock:
            self.moved_bytes[direction] += source.numel() * source.element_size()
        if not self.cuda:
            destination.copy_(source)
            return None
        stream = self.d2h if direction == "d2h" else self.h2d
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            destination.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        if direction == "d2h" and source.device.type == "cuda":
            source.record_stream(stream)  # an autograd gradient must outlive the copy
        return done

    def take_moved_bytes(self) -> dict[str, int]:
        with self._lock:
            moved, self.moved_bytes = self.moved_bytes, dict.fromkeys(self.moved_bytes, 0)
        return moved


def wait(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()


class StagingPool:
    """A few pinned buffers of one chunk each, allocated at the first use and reused for the whole run.

    A released buffer carries the event of the copy still reading it; ``acquire`` waits for that
    event before handing the buffer out again.
    """

    def __init__(self, tier: Tier, count: int, numel: int, dtype: torch.dtype) -> None:
        self.tier, self.count, self.numel, self.dtype = tier, count, numel, dtype
        self._free: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self._allocated = False
        self._available = threading.Condition()

    def acquire(self) -> torch.Tensor:
        with self._available:
            if not self._allocated:  # all at once, so the tier's usage does not depend on timing
                self._allocated = True
                self._free.extend((self.tier.allocate(self.numel, self.dtype), None) for _ in range(self.count))
            while not self._free:
                self._available.wait()
            buffer, in_use_until = self._free.popleft()
        wait(in_use_until)
        return buffer

    def release(self, buffer: torch.Tensor, in_use_until: torch.cuda.Event | None = None) -> None:
        with self._available:
            self._free.append((buffer, in_use_until))
            self._available.notify()


@dataclass(slots=True)
class ChunkUpdate:
    """One host chunk's update in one step (everything the worker needs, captured when it is queued)."""

    chunk: int
    members: dict[int, list[TensorSlot]]
    """Param-group index -> slots of this chunk to step (those that received a gradient)."""
    hypers: list[dict[str, Any]]
    """lr, betas, eps, weight_decay per param group, as they were when the update was queued."""
    step: int
    grad_factor: float = 1.0
    """Unscale (1 / loss scale) times the clip coefficient."""
    grads_written: torch.cuda.Event | None = None
    """Compute-stream point after which the chunk's gradients are complete (fetch waits for it)."""
    squares: torch.Tensor | None = None
    """Pinned copy of the chunk's squared gradient norm, checked before updating (update in backward)."""
    restore_only: bool = False
    """Copy the masters back into the param chunk without a step (skipped step over in-param gradients)."""
    issued: threading.Event = field(default_factory=threading.Event)
    """Set once the param chunk's host->device copy is queued (the forward may then order after it)."""


class HostUpdater:
    """Runs :class:`ChunkUpdate` s and other host jobs, in order, on one background thread.

    Args:
        store: the chunk storage.
        transfers: device<->host copies.
        host_adam: the CPU Adam kernel.
    """

    def __init__(self, store: ChunkStore, transfers: Transfers, host_adam: HostAdam) -> None:
        self.store = store
        self.transfers = transfers
        self.host_adam = host_adam
        self.pool = StagingPool(store.tiers[HOST], STAGING_BUFFERS, store.layout.chunk_numel,
                                store.param_chunks[0].dtype if store.param_chunks else torch.float32)
        self.param_ready: dict[int, torch.cuda.Event | None] = {}
        """Chunk -> completion event of its latest host->device param copy (popped by the waiter)."""
        self.busy_s = 0.0
        self.error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        # The thread holds only a weak reference, so a dropped optimizer (and its pinned memory) is
        # freed; the finalizer stops the thread then, or at interpreter exit, before teardown: a
        # thread frozen inside CPU Adam's OpenMP region during teardown aborts the process.
        self._thread = threading.Thread(target=_serve, args=(self._jobs, weakref.ref(self)), name="zero-cache-host",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, _stop, self._jobs, self._thread)

    # ------------------------------------------------------------------ queueing
    def submit_update(self, update: ChunkUpdate) -> None:
        self._jobs.put(update)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker after everything queued before it."""
        self._jobs.put(job)

    def drain(self) -> None:
        """Block until every queued job has run; re-raise the first failure."""
        self._jobs.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ the worker
    def _start(self, job):
        """(job, what its prepare step returned): start a chunk update's gradient transfer."""
        if self.error is not None or not isinstance(job, ChunkUpdate):
            return job, None
        try:
            return job, self._fetch(job)
        except BaseException as err:  # surfaced on the training thread at its next wait
            self.error = self.error or err
            return job, None

    def _run(self, job, prepared) -> None:
        if self.error is None:  # after a failure nothing else runs; waiters re-raise it
            start = time.perf_counter()
            try:
                self._update(job, prepared) if isinstance(job, ChunkUpdate) else job()
            except BaseException as err:
                self.error = err
            self.busy_s += time.perf_counter() - start
        if self.error is not None and isinstance(job, ChunkUpdate):
            job.issued.set()  # wake the waiter, which re-raises the error

    # ------------------------------------------------------------------ one chunk
    def _fetch(self, update: ChunkUpdate) -> tuple[torch.Tensor, torch.cuda.Event | None] | None:
        """Start copying the chunk's in-param gradient to a staging buffer (None: fp32 accumulator on the host)."""
        if update.restore_only or self.store.grads_in_accumulators:
            return None
        buffer = self.pool.acquire()
        return buffer, self.transfers.copy(buffer, self.store.param_chunks[update.chunk], "d2h",
                                           after=update.grads_written)

    def _update(self, update: ChunkUpdate, fetched) -> None:
        chunk = update.chunk
        buffer = None
        if fetched is not None:
            buffer, copied = fetched
            wait(copied)
        if update.squares is not None:
            wait(update.grads_written)
            square = float(update.squares)
            if not math.isfinite(square):
                if buffer is not None:
                    self.pool.release(buffer)
                raise NonFiniteGradientError(f"squared norm {square} in chunk {chunk}")
        if buffer is not None and not update.restore_only and self.host_adam.fuses(buffer.dtype):
            self._step_in_buffer(update, buffer)
        else:
            buffer = self._step_then_round(update, buffer)
        ready = self.transfers.copy(self.store.param_chunks[chunk], buffer, "h2d")
        self.pool.release(buffer, ready)
        self.param_ready[chunk] = ready
        update.issued.set()

    def _step_in_buffer(self, update: ChunkUpdate, buffer: torch.Tensor) -> None:
        """csrc kernel, one pass: the buffer's gradients become the new weights. Slots without a
        gradient still hold their weights (the fetch copied the whole param chunk); padding is zero."""
        for index, slots in update.members.items():
            for slot in slots:
                master, exp_avg, exp_avg_sq = (self.store.state_view(slot, f) for f in STATE_FIELDS)
                self.host_adam.update_in_place(master, buffer[slot.offset:slot.offset + slot.numel], exp_avg,
                                               exp_avg_sq, step=update.step, grad_scale=update.grad_factor,
                                               **update.hypers[index])

    def _step_then_round(self, update: ChunkUpdate, buffer: torch.Tensor | None) -> torch.Tensor:
        """Library kernel on an fp32 gradient, then the masters rounded into a staging buffer (returned)."""
        group = self.store.groups[update.chunk]
        if not update.restore_only:
            source = group.grad if buffer is None else buffer
            grads = fp32_gradient(source, self.store.scratch[HOST], update.grad_factor)
            for index, slots in update.members.items():
                adam_step(self.store, slots, grads, update.hypers[index], update.step, self.host_adam.update)
        if buffer is None:
            buffer = self.pool.acquire()
        buffer.copy_(group.field("master"))  # fp32 -> compute dtype here: half the bus bytes
        return buffer


def _serve(jobs: queue.Queue, updater_ref: weakref.ref) -> None:
    """The worker thread: run jobs in order, starting the next job's transfer before running the current one."""
    ahead = None  # the next job, its transfer already started
    while True:
        entry = jobs.get() if ahead is None else None  # blocks holding no reference to the updater
        updater = updater_ref()
        if entry is _STOP or ahead is _STOP or updater is None:
            jobs.task_done()
            return
        current = ahead if ahead is not None else updater._start(entry)
        ahead = None
        try:
            following = jobs.get_nowait()
            ahead = _STOP if following is _STOP else updater._start(following)
        except queue.Empty:
            pass
        updater._run(*current)
        updater = current = entry = None  # hold nothing of the optimizer while blocked
        jobs.task_done()


def _stop(jobs: queue.Queue, thread: threading.Thread) -> None:
    jobs.put(_STOP)
    if thread is not threading.current_thread():
        thread.join()


def fp32_gradient(source: torch.Tensor, scratch: torch.Tensor, grad_factor: float) -> torch.Tensor:
    """``source`` as fp32 (in place when it is fp32, else through ``scratch``), times ``grad_factor``."""
    grads = source if source.dtype == torch.float32 else scratch.copy_(source)
    if grad_factor != 1.0:
        grads.mul_(grad_factor)
    return grads


def adam_step(store: ChunkStore, slots: list[TensorSlot], grads: torch.Tensor, hyper: dict[str, Any], step: int,
              kernel: Callable[..., None]) -> None:
    """One Adam step over ``slots`` (of one chunk and one param group); ``grads`` is the chunk's fp32 gradient."""
    views = {f: [store.state_view(s, f) for s in slots] for f in ("master", "exp_avg", "exp_avg_sq")}
    grad_views = [grads[s.offset:s.offset + s.numel] for s in slots]
    kernel(views["master"], grad_views, views["exp_avg"], views["exp_avg_sq"], step=step, **hyper)
