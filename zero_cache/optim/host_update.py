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

A shard at home on the host (streamed params) is its own staging buffer: its gradients arrive there
from the device->host stream, the update runs in place, and nothing is copied back (the next gather
copies the new weights in).

The chunk's optimizer states come from its state home (:mod:`zero_cache.storage.state_homes`), fetched alongside step 1
and written back after step 2: host memory is updated in place, an NVMe group is read into a pinned bounce buffer
and written behind (:mod:`zero_cache.storage.state_homes.nvme`).

While it updates chunk i the worker has already issued the fetch of chunk i + 1 (its gradient copy
and its disk read), so the transfers of one chunk overlap CPU Adam of the next. A few buffers serve every
transfer (no per-step pinning, no per-chunk staging), and on a CPU-only run the same code runs with synchronous copies.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zero_cache.base.timeline import HOST_ADAM
from zero_cache.optim.chunk_adam import adam_step, state_gradient
from zero_cache.optim.host_adam import HostAdam
from zero_cache.optim.revision import APPLIED, DEFERRED, SpeculationWindow, revision_scales
from zero_cache.optim.step_record import ChunkSteps
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.state_costs import STAGING_BUFFERS
from zero_cache.plan.tier_names import HOST
from zero_cache.runtime.jobs import GRADIENTS, JobQueue, serve, stop
from zero_cache.runtime.rates import Throughput
from zero_cache.runtime.transfers import Transfers
from zero_cache.storage.chunks import STATE_FIELDS, ChunkStore, state_field
from zero_cache.storage.state_homes.home import FetchedStates
from zero_cache.storage.tiers import BufferPool, wait


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
    grads_landed: torch.cuda.Event | None = None
    """A shard at home on the host: the device->host copy that wrote its reduced gradients there."""
    squares: torch.Tensor | None = None
    """Pinned copy of the chunk's squared gradient norm (updates during backward; else read from the accumulator)."""
    restore_only: bool = False
    """Copy the masters back into the param chunk without a step (skipped step over in-param gradients)."""
    window: SpeculationWindow | None = None
    """Set on an update made during backward, before the global norm is known: it keeps its gradient, and the
    window may defer it (:mod:`zero_cache.optim.revision`)."""
    position: int = -1
    """A speculative update's place in ``window``: the order backward completed the window's chunks in."""
    outcome: str | None = None
    """A speculative update, once the worker has run it: APPLIED or DEFERRED."""
    lazy: bool = False
    """Applied without storing its moments (folded in later; :mod:`zero_cache.optim.revision`): a speculative
    update, or a waited one that ``fold_later`` let."""
    fold_later: bool = False
    """A waited update (queued by the step, after the global norm): let it store the weight alone and keep its
    gradient where the chunk has a kept gradient, its moments folded in by :meth:`HostUpdater.settle_all`'s job
    behind the step's updates (:mod:`zero_cache.optim.revision`, "Waited steps")."""
    revises: ChunkUpdate | None = None
    """Set on the step's revision of a speculative update: redo it with ``grad_factor`` (or take it back
    when ``skip``) -- nothing to do when it was applied with that factor already."""
    skip: bool = False
    """A revision for a skipped step (non-finite gradient, or ``zero_grad()``): take the update back."""
    issued: threading.Event = field(default_factory=threading.Event)
    """Set once the param chunk's host->device copy is queued (the forward may then order after it)."""


class HostUpdater:
    """Runs :class:`ChunkUpdate` s and other host jobs, in order, on one background thread.

    Args:
        store: the chunk storage.
        transfers: device<->host copies.
        host_adam: the CPU Adam kernel.
        steps: the chunks' step records (:mod:`zero_cache.optim.step_record`), shared with the optimizer: the worker
            writes the params it sent back and the folds owed there.
    """

    def __init__(self, store: ChunkStore, transfers: Transfers, host_adam: HostAdam, steps: ChunkSteps) -> None:
        self.store = store
        self.steps = steps
        self.transfers = transfers
        self.host_adam = host_adam
        host, numel = store.tiers[HOST], store.layout.chunk_numel
        self.pool = BufferPool(STAGING_BUFFERS, lambda: host.allocate(numel, store.compute_dtype), free=host.free)
        """The worker's transfers: gradients fetched, weights sent back."""
        self.gradient_pool = BufferPool(STAGING_BUFFERS, lambda: host.allocate(numel, store.compute_dtype),
                                        free=host.free)
        """Micro-batch gradients staged by the training thread for the accumulators (allocated only when used).
        Apart from ``pool``: an update during backward that needs a buffer must not wait for gradient jobs that
        hold them and run only after it (a deadlock once the training thread has staged them all)."""
        self.busy_s = 0.0
        self.folded_later = 0
        """Waited updates made lazy (``ChunkUpdate.fold_later``), their moments folded by a job of their own."""
        self.adam_work = Throughput()
        """Elements the host's Adam stepped and the seconds it took (the plan's measured rate)."""
        self.error: BaseException | None = None
        self._jobs = JobQueue()
        # The thread holds only a weak reference, so a dropped optimizer (and its pinned memory) is
        # freed; the finalizer stops the thread then, or at interpreter exit, before teardown: a
        # thread frozen inside CPU Adam's OpenMP region during teardown aborts the process.
        self._thread = threading.Thread(target=serve, args=(self._jobs, weakref.ref(self)), name="zero-cache-host",
                                        daemon=True)
        self._thread.start()
        self._stop_worker = weakref.finalize(self, stop, self._jobs, self._thread)

    def trim_pools(self) -> None:
        """Give the staging buffers back (a plan that leaves the host's Adam no group: the plan counts none), after
        the jobs queued; the next use makes them again."""
        self.drain()
        self.pool.trim()
        self.gradient_pool.trim()

    def close(self) -> None:
        """Stop the worker thread (after the jobs already queued) and drop the staging buffers: the updater cannot
        run again (:mod:`zero_cache.optim.release`)."""
        self._stop_worker()
        self.pool = self.gradient_pool = None
        self.steps.forget_folds()

    # ------------------------------------------------------------------ queueing
    def submit_update(self, update: ChunkUpdate) -> None:
        self._jobs.put(update)

    def submit(self, job: Callable[[], None]) -> None:
        """Run a gradient job (accumulation) on the worker, ahead of queued updates (:mod:`zero_cache.runtime.jobs`)."""
        self._jobs.put(job, GRADIENTS)

    def in_forward_order(self) -> None:
        """Re-sort the updates not yet started by chunk, the order the next forward waits for them in (a
        revision stays after the update it revises; other jobs stay where they are)."""
        self._jobs.reorder(lambda job: job.chunk if isinstance(job, ChunkUpdate) else None)

    def settle_all(self) -> None:
        """Queue the folding of every lazy update's moments, after the updates queued so far (before the states
        are read or replaced: checkpoints, re-plans)."""
        self._jobs.put(self._settle_all)

    def _settle_all(self) -> None:
        for chunk in self.steps.owing_folds():
            self.settle(chunk)

    def settle(self, chunk: int) -> None:
        """On the worker: fold the moments of ``chunk``'s lazy update, if one is waiting, from its kept gradient
        (before anything overwrites that gradient or reads the moments)."""
        lazy = self.steps.take_fold(chunk)
        if lazy is None:
            return
        kept = self._kept(chunk)
        for index, slots in lazy.members.items():
            for slot in slots:
                self.host_adam.fold(self.store.state_view(slot, "exp_avg"), self.store.state_view(slot, "exp_avg_sq"),
                                    kept[slot.offset:slot.offset + slot.numel], scale=lazy.grad_factor,
                                    betas=lazy.hypers[index]["betas"])

    def drain(self, gradients_only: bool = False) -> None:
        """Block until every queued job (or every gradient job) has run; re-raise the first failure."""
        self._jobs.join(GRADIENTS if gradients_only else None)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ the worker (zero_cache.runtime.jobs.serve)
    def start_job(self, job: Any) -> tuple[Any, Any]:
        """(job, what its prepare step returned): start a chunk update's gradient transfer."""
        if self.error is not None or not isinstance(job, ChunkUpdate):
            return job, None
        try:
            return job, self._fetch(job)
        except BaseException as err:  # surfaced on the training thread at its next wait
            self.error = self.error or err
            return job, None

    def run_job(self, job: Any, prepared: Any) -> None:
        """Run ``job`` (a chunk update, or a gradient job's callable) with what :meth:`start_job` prepared."""
        if self.error is None:  # after a failure nothing else runs; waiters re-raise it
            start = time.perf_counter()
            try:
                if isinstance(job, ChunkUpdate):
                    self._update(job, prepared)
                else:
                    with self.transfers.timeline.on_thread(HOST_ADAM, getattr(job, "__name__", "host job")):
                        job()
            except BaseException as err:
                self.error = err
            self.busy_s += time.perf_counter() - start
        elif isinstance(prepared, Fetched):  # skipped: its buffers go back once their transfers have landed
            prepared.release(self.pool)
        if self.error is not None and isinstance(job, ChunkUpdate):
            job.issued.set()  # wake the waiter, which re-raises the error

    # ------------------------------------------------------------------ one chunk
    def _fetch(self, update: ChunkUpdate) -> Fetched:
        """Start the chunk's input transfers: its in-param gradient to a staging buffer (none when the
        fp32 accumulator already lives on the host), and its states from their home (a disk read for NVMe)."""
        chunk = update.chunk
        fetched = Fetched(home=self.store.home(chunk))
        if update.revises is not None:
            pass  # the gradient was kept on the host
        elif not (update.restore_only or self.store.grads_in_accumulators):
            # From the param chunk into a staging buffer, or where the home keeps it (a home on the host: updated
            # there, in place)
            fetched.grads, fetched.grads_copied = fetched.home.fetch_gradient(
                self.store.sharding.group_of(chunk), self.store.param_chunks[chunk], self.pool, self.transfers,
                written=update.grads_written, landed=update.grads_landed)
        group = self.store.groups[chunk]
        fetched.states = group.home.fetch(group)
        return fetched

    def _update(self, update: ChunkUpdate, fetched: Fetched) -> None:
        chunk = update.chunk
        try:
            wait(fetched.grads_copied)
            wait(fetched.states.ready)
            deferred = update.window is not None and not update.window.admits(update.position, self._square)
        except BaseException:
            fetched.release(self.pool)
            raise
        if deferred:  # the step will clip or skip: keep the gradient, apply nothing yet
            self._defer(update, fetched)
            return
        group, states = self.store.groups[chunk], fetched.states.states
        buffer = fetched.grads
        if update.window is not None:  # (moments folded in later need states that stay in memory)
            update.lazy = group.home.resident and self.host_adam.lazy_ok(update.hypers, self._kept(chunk).dtype)
        elif update.fold_later:
            update.lazy = self._folds_later(update, buffer)
        started = time.perf_counter()
        with self.transfers.timeline.on_thread(HOST_ADAM, f"chunk {chunk}"):  # its inputs have landed
            if update.revises is not None:
                buffer = self._revise(update, states)
            elif update.restore_only:
                buffer = self._round_masters(chunk, buffer, states)
            elif buffer is not None and self.host_adam.fuses(buffer.dtype):
                self._step_in_buffer(update, buffer, states)
            elif buffer is None:  # the fp32 accumulator holds the gradient (and keeps it)
                self.settle(chunk)
                buffer = self._step_slots(chunk, update.members, update.hypers, update.step, self._kept(chunk),
                                          states, redo_scale=update.grad_factor, redo_lazy=update.lazy)
            else:
                self.settle(chunk)
                buffer = self._step_then_round(update, buffer, states)
        # A chunk's elements count once a step, by its first pass; a revision's seconds add to that step's.
        first_pass = update.revises is None and not update.restore_only
        self.adam_work.add(self.store.layout.chunk_numel if first_pass else 0, time.perf_counter() - started)
        if update.window is not None:
            update.outcome = APPLIED
        elif update.lazy:  # a waited update: settle_all's job folds its moments in (queued behind the step's updates)
            self.steps.owe_fold(update)
            self.folded_later += 1
        group.home.write_back(group, fetched.states, changed=buffer is not None and not update.restore_only)
        if buffer is not None:
            ready = fetched.home.store_params(self.store.sharding.group_of(chunk), self.store.param_chunks[chunk],
                                              buffer, self.pool, self.transfers)
            if ready is not None:
                self.steps[chunk].params_sent = ready
        update.issued.set()

    def _folds_later(self, update: ChunkUpdate, buffer: torch.Tensor | None) -> bool:
        """Whether a waited update runs lazy: its gradient is in a staging buffer the csrc kernel steps, the chunk
        has a kept gradient to hold it, and its states stay in memory and can take a lazy step."""
        group = self.store.groups[update.chunk]
        return (buffer is not None and self.host_adam.fuses(buffer.dtype) and group.kept is not None
                and group.kept.dtype == buffer.dtype and group.home.resident
                and self.host_adam.lazy_ok(update.hypers, buffer.dtype))

    def _square(self, update: ChunkUpdate) -> float:
        """The chunk's squared gradient norm: computed on the device during backward, or from its accumulator."""
        if update.squares is not None:
            wait(update.grads_written)
            return float(update.squares)
        return float(torch.linalg.vector_norm(self.store.groups[update.chunk].grad, dtype=torch.float32)) ** 2

    def _kept(self, chunk: int) -> torch.Tensor:
        """Where a speculative update's gradient stays until the step: the kept copy, or the fp32 accumulator."""
        group = self.store.groups[chunk]
        return group.grad if self.store.grads_in_accumulators else group.kept

    def _defer(self, update: ChunkUpdate, fetched: Fetched) -> None:
        self.settle(update.chunk)  # (the kept gradient is about to change)
        if fetched.grads is not None:
            self._kept(update.chunk).copy_(fetched.grads)
        fetched.release(self.pool)
        update.outcome = DEFERRED
        update.issued.set()

    def _revise(self, update: ChunkUpdate, states: torch.Tensor) -> torch.Tensor | None:
        """Run the step's revision of a speculative update; returns the buffer holding the new weights, or
        None when the update already stands (applied with the step's factor)."""
        original = update.revises
        undo_scale, redo_scale = revision_scales(original, update)
        if not (undo_scale or redo_scale):
            if original.outcome == APPLIED:
                if original.lazy:  # its moments are folded in before the kept gradient changes
                    self.steps.owe_fold(original)
                return None
            return self._round_masters(update.chunk, None, states)  # deferred, step skipped: weights unchanged
        return self._step_slots(update.chunk, original.members, original.hypers, original.step,
                                self._kept(update.chunk), states, undo_scale=undo_scale, redo_scale=redo_scale,
                                undo_lazy=original.lazy)

    def _step_slots(self, chunk: int, members: dict[int, list[TensorSlot]], hypers: list[dict[str, Any]], step: int,
                    grad: torch.Tensor, states: torch.Tensor, *, undo_scale: float = 0.0,
                    redo_scale: float = 0.0, undo_lazy: bool = False, redo_lazy: bool = False) -> torch.Tensor:
        """Step ``members`` from ``grad`` (a chunk-sized gradient that stays as it is: kept, or an accumulator),
        taking back a step first with ``undo_scale`` (:meth:`HostAdam.revise`); returns the buffer holding the
        chunk's new weights."""
        out = self._update_buffer(chunk)
        stepped = []
        for index, slots in members.items():
            for slot in slots:
                master, exp_avg, exp_avg_sq = (self.store.state_view(slot, f, states) for f in STATE_FIELDS)
                window = slice(slot.offset, slot.offset + slot.numel)
                self.host_adam.revise(master, grad[window], out[window], exp_avg, exp_avg_sq, step=step,
                                      hyper=hypers[index], undo_scale=undo_scale, redo_scale=redo_scale,
                                      undo_lazy=undo_lazy, redo_lazy=redo_lazy)
                stepped.append((slot.offset, slot.offset + slot.numel))
        # Everything else (slots without a gradient, and the padding, which collectives and norms read whole)
        # is the masters, rounded, as after any update: a staging buffer holds whatever it carried last.
        masters = state_field(states, "master")
        start = 0
        for begin, end in sorted(stepped) + [(out.numel(), out.numel())]:
            if begin > start:
                out[start:begin].copy_(masters[start:begin])
            start = max(start, end)
        return out

    def _update_buffer(self, chunk: int) -> torch.Tensor:
        """Where the chunk's new params are written: its home on the host (in place), or a staging buffer."""
        return self.store.home(chunk).update_buffer(self.store.sharding.group_of(chunk),
                                                    self.store.param_chunks[chunk], self.pool)

    def _step_in_buffer(self, update: ChunkUpdate, buffer: torch.Tensor, states: torch.Tensor) -> None:
        """csrc kernel, one pass: the buffer's gradients become the new weights. A speculative update copies them
        to the kept gradient on the way, after folding in the moments of the chunk's lazy update from the step
        before (which that gradient held) when it stepped the same slots. Slots without a gradient are rewritten
        from their masters (a reduction from a bucket left zeros there); padding is zero."""
        kept = self._kept(update.chunk) if update.window is not None or update.lazy else None
        fold = self.steps.take_fold(update.chunk) if kept is not None and self._folds_into(update) else None
        self.settle(update.chunk)  # (one that cannot be folded in this pass)
        stepped = set()
        for index, slots in update.members.items():
            for slot in slots:
                master, exp_avg, exp_avg_sq = (self.store.state_view(slot, f, states) for f in STATE_FIELDS)
                window = slice(slot.offset, slot.offset + slot.numel)
                self.host_adam.update_in_place(master, buffer[window], exp_avg, exp_avg_sq, step=update.step,
                                               grad_scale=update.grad_factor, **update.hypers[index],
                                               kept=None if kept is None else kept[window], lazy=update.lazy,
                                               fold_scale=0.0 if fold is None else fold.grad_factor)
                stepped.add(slot.name)
        for slot in self.store.slots_of(update.chunk):
            if slot.name not in stepped:
                buffer[slot.offset:slot.offset + slot.numel].copy_(self.store.state_view(slot, "master", states))

    def _folds_into(self, update: ChunkUpdate) -> bool:
        """Whether the chunk's lazy update from the step before can be folded in ``update``'s pass: the same slots
        with the same betas (the kernel folds with the step's own)."""
        lazy = self.steps.owed_fold(update.chunk)
        return (lazy is not None and lazy.members == update.members
                and all(lazy.hypers[i]["betas"] == update.hypers[i]["betas"] for i in update.members))

    def _step_then_round(self, update: ChunkUpdate, buffer: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Library kernel on a staged gradient of another dtype (fp16) made fp32, then the masters rounded into
        the buffer (returned). A speculative update's gradient is kept first; a lazy one steps copies of the
        moments."""
        grads = state_gradient(buffer, self.store.scratch[HOST], update.grad_factor, in_place=update.window is None)
        if update.window is not None:
            self._kept(update.chunk).copy_(buffer)
        kernel = self.host_adam.lazy_update if update.lazy else self.host_adam.update
        for index, slots in update.members.items():
            adam_step(self.store, slots, grads, update.hypers[index], update.step, kernel, states)
        return self._round_masters(update.chunk, buffer, states)

    def _round_masters(self, chunk: int, buffer: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
        """The chunk's masters in the compute dtype, in ``buffer`` (or the home on the host, or a staging buffer)."""
        if buffer is None:
            buffer = self._update_buffer(chunk)
        # fp32 -> compute dtype here: half the bus bytes
        buffer.copy_(state_field(states, "master"))
        return buffer


@dataclass(slots=True)
class Fetched:
    """A chunk update's input transfers, started one job ahead by the worker."""

    grads: torch.Tensor | None = None
    """Staging buffer receiving the in-param gradient."""
    grads_copied: torch.cuda.Event | None = None
    home: Any = None
    """The chunk's param home (:mod:`zero_cache.storage.param_homes.registry`), which ``grads`` came from."""
    states: FetchedStates | None = None
    """The chunk's optimizer states as its state home fetched them (:meth:`StateHome.fetch
    <zero_cache.storage.state_homes.home.StateHome.fetch>`)."""

    def release(self, pool: BufferPool) -> None:
        """Give the buffers back without using them (a failed update); pending transfers finish first."""
        if self.grads is not None:
            self.home.give_back(self.grads, pool, self.grads_copied)
        if self.states is not None:
            self.states.home.give_back(self.states)
