"""Queueing each chunk's update where its group is stepped, and ordering the compute stream after it.

A host-held group is updated by the host worker (:class:`~zero_cache.optim.host_update.HostUpdater`: an update
during backward, its revision at the step, an update after the global norm, or a rewrite of the params from the
masters) or, where the plan says so, on the device after backward (:class:`~zero_cache.optim.device_steps.
DeviceSteps`). Whichever it was, the next forward (and the chunk's next gradient) waits for that chunk's update alone,
through its step record (:mod:`zero_cache.optim.step_record`), not for the whole host tier.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch

from zero_cache.optim.counters import OptimizerCounters
from zero_cache.optim.device_steps import DeviceSteps
from zero_cache.optim.host_update import ChunkUpdate, HostUpdater
from zero_cache.optim.revision import SpeculationWindow
from zero_cache.optim.step_record import ChunkSteps
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.placement import Plan
from zero_cache.plan.state_costs import Route
from zero_cache.plan.tier_names import DEVICE
from zero_cache.runtime.transfers import Transfers
from zero_cache.storage.chunks import ChunkStore


class ChunkUpdates:
    """The update side of the optimizer: what queues a chunk's update, and what waits for it.

    Args:
        store: the chunk storage.
        transfers: the copy streams (the mark after which a chunk's gradients are written).
        host: the host worker.
        device_steps: host-held groups stepped on the device.
        steps: the chunks' step records, shared with ``host``.
        counters: the counts and waits a report reads.
        before_update: called with a chunk before its states change (a checkpoint's snapshot stages it first).
        landed: chunk -> the device->host copy that wrote its reduced gradients into its home on the host, or None.
    """

    def __init__(self, store: ChunkStore, transfers: Transfers, host: HostUpdater, device_steps: DeviceSteps, *,
                 steps: ChunkSteps, counters: OptimizerCounters, before_update: Callable[[int], None],
                 landed: Callable[[int], Any]) -> None:
        self.store = store
        self.transfers = transfers
        self.host = host
        self.device_steps = device_steps
        self.steps = steps
        self.counters = counters
        self.before_update = before_update
        self.landed = landed
        self.device = store.tiers[DEVICE].device

    # ------------------------------------------------------------------ queueing
    def queue_host(self, chunk: int, members: dict[int, list[TensorSlot]], hypers: list[dict[str, Any]], *,
                   step: int, grad_factor: float, squares: torch.Tensor | None = None, restore_only: bool = False,
                   window: SpeculationWindow | None = None, fold_later: bool = False) -> ChunkUpdate:
        """Queue ``chunk``'s update on the host worker: from backward (``window``), a rewrite of its params from the
        masters (``restore_only``), or the step's update after the global norm."""
        self.before_update(chunk)  # a checkpoint being written stages the chunk before it changes
        self.device_steps.wait(chunk)  # the host takes the chunk back: its device step's copies have landed
        update = ChunkUpdate(chunk=chunk, members=members, hypers=hypers, step=step, grad_factor=grad_factor,
                             grads_written=self.transfers.mark(), grads_landed=self.landed(chunk), squares=squares,
                             restore_only=restore_only, window=window, fold_later=fold_later)
        if window is not None:
            update.position = window.join(update)
            self.steps.speculate(update)
            self.counters.counts["speculated_chunks"] += 1
        elif restore_only:
            self.steps.restore(update)
        else:
            self.steps.queue(update)
        self.host.submit_update(update)
        return update

    def restore(self, chunks: list[int], members_of: Callable[[int], dict[int, list[TensorSlot]]], step: int) -> None:
        """Rewrite the param chunks of ``chunks`` from their masters (no step): a device-held group's now, the others'
        through the host worker (``members_of``: chunk -> its members with a gradient; ``step``: the step's count)."""
        for chunk in chunks:
            if self.store.state_home(chunk).route is Route.DEVICE_ADAM:
                self.store.param_chunks[chunk].copy_(self.store.groups[chunk].field("master"))
            else:
                self.queue_host(chunk, members_of(chunk), [], step=step, grad_factor=1.0, restore_only=True)

    def revise(self, chunk: int, *, grad_factor: float = 0.0, skip: bool = False) -> None:
        """Queue the revision of ``chunk``'s update from backward: with the step's ``grad_factor``, or taken back
        (``skip``)."""
        self.before_update(chunk)  # (a checkpoint being written stages the chunk first)
        original = self.steps[chunk].speculative
        revision = ChunkUpdate(chunk=chunk, members=original.members, hypers=original.hypers, step=original.step,
                               grad_factor=grad_factor, revises=original, skip=skip)
        self.steps.revise(revision)
        self.host.submit_update(revision)
        if skip or grad_factor != original.grad_factor:
            self.counters.counts["revised_chunks"] += 1

    def steps_on_device(self, chunk: int, device_stepped: frozenset[int]) -> bool:
        """Whether ``chunk`` is stepped on the device now: the plan's choice (``device_stepped``), for a group whose
        home lets the device step it (its states all in host memory, none left to fold in from a lazy update)."""
        return (chunk in device_stepped and self.store.state_home(chunk).device_steppable
                and self.steps.owed_fold(chunk) is None)

    def step_on_device(self, chunk: int, members: dict[int, list[TensorSlot]], hypers: list[dict[str, Any]],
                       step: int, grad_factor: float) -> None:
        """Queue ``chunk``'s update on the device steps; the next forward waits for its params alone. A chunk whose
        step record refuses the device step (:class:`~zero_cache.optim.step_record.StepTransitionError`) raises before
        anything is staged, waited for or queued."""
        self.steps.check_on_device(chunk)
        self.before_update(chunk)
        self.wait_for_chunk(chunk)  # a host job still on it (a restore) has run
        # None unless written home by a copy: on the device it is ordered by begin(), an accumulator is filled
        self.steps.on_device(chunk, self.device_steps.step(chunk, members, hypers, step, grad_factor,
                                                           self.landed(chunk)))
        self.counters.counts["device_stepped_chunks"] += 1

    # ------------------------------------------------------------------ waiting
    def wait_for_chunk(self, chunk: int) -> None:
        """Order the compute stream after ``chunk``'s latest update (forward pre-hook, gradient hook)."""
        stepped, update = self.steps.take_waits(chunk)
        if stepped is not None:
            torch.cuda.current_stream(self.device).wait_event(stepped)
        if update is None:
            return
        if not update.issued.is_set():
            start = time.perf_counter()
            with self.transfers.timeline.waiting(f"chunk {chunk}"):
                while not update.issued.wait(0.005):  # only this chunk's update, not the whole host tier
                    self.host.raise_if_failed()
            self.counters.timings["chunk_wait"] += time.perf_counter() - start
        self.host.raise_if_failed()
        ready = self.steps.take_params_sent(chunk)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def drain_gradients(self) -> None:
        """Wait for the worker's gradient jobs (accumulation), not for the updates queued behind them."""
        start = time.perf_counter()
        with self.transfers.timeline.waiting("host gradients drained"):
            self.host.drain(gradients_only=True)
        self.counters.timings["grad_wait"] += time.perf_counter() - start

    def finish_chunks(self, chunks: Iterable[int]) -> None:
        """Block until the host work and device-step copies of ``chunks`` have landed, and their lazy updates are
        folded: before their kept gradients go, where :meth:`finish_all` would drain the whole host tier."""
        for chunk in chunks:
            self.device_steps.wait(chunk)
            self.wait_for_chunk(chunk)
            # No job of the chunk is left on the worker: its lazy update, if one waits, folds here from the kept
            # gradient the switch may take away.
            self.host.settle(chunk)

    def switch_retains(self, now: Plan, plan: Plan) -> frozenset[int]:
        """The chunks that keep their kept gradient for now although a count switch from ``now`` to ``plan`` drops it.

        A switch changes routes only, and blocking on the chunks it changes would drain their share of the host's
        queue and device steps into the switching step (1.1-1.2 s at 10B and 13B, the tuning's slowest steps). It
        need not: a chunk leaving the device steps is waited for where the host next touches it, its next gradient
        or update, as every step's are; one joining them is updated on the device only after its host update
        (:meth:`step_on_device`). Only a kept gradient the plan drops may still be read by the chunk's
        queued host update or lazy fold, so it stays with its chunk until the next step lets go of it
        (:meth:`release_retired`, by when the forward has waited for that update). That holds for chunks joining the
        device steps, which the step never updates in backward; any other chunk dropping its kept gradient (a plan
        the tuner does not make), or chunks gaining one that would need new memory beside the retained, are finished
        now instead.
        """
        dropping = frozenset(now.kept_gradients) - frozenset(plan.kept_gradients)
        gaining = len(frozenset(plan.kept_gradients) - frozenset(now.kept_gradients))
        if dropping - frozenset(plan.device_stepped) or dropping and gaining > self.store.spare_kept:
            self.finish_chunks(sorted(dropping))
            return frozenset()
        return dropping

    def release_retired(self) -> None:
        """Let go of the kept gradients the last count switch retained, once their chunks' host work is done. They
        stay retired until then: a host failure met while their chunks finish raises with them still retired, and
        the next call finishes and releases them."""
        retired, spare = self.steps.retired_chunks()
        if retired:
            self.finish_chunks(retired)
            self.store.release_kept(frozenset(retired), spare=spare)
            self.steps.unretire(retired)

    def finish_all(self) -> None:
        """Block until every host update and copy has landed, and every moment is stored."""
        self.device_steps.synchronize()
        self.host.settle_all()
        self.host.drain()
        self.store.flush()
        for chunk in self.steps.in_flight():
            self.wait_for_chunk(chunk)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
