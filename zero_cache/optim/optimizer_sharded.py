"""The hybrid optimizer's data-parallel side: reducing sharded gradients and gathering updated params.

Collectives are :class:`~zero_cache.runtime.exchange.ChunkExchange`'s; what is done with a reduced group lives
here: with one micro-batch per step the owner's chunk already holds the summed gradients (written over
its params) and, when updates run during backward, is queued on the host worker; with accumulating
micro-batches the owner adds its reduced slice to its fp32 accumulator. ``step()`` then takes the
global norm from the owners' chunks (one all-reduce) and updates only the owned chunks.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_cache.plan.state_costs import UPDATED_HERE, Route
from zero_cache.storage.tiers import wait


class ShardedGradients:
    """Mixed into :class:`~zero_cache.optim.optimizer.ZeroCacheOptimizer` (its ``exchange``, ``sharding``, ``store``,
    host worker, transfers and :class:`~zero_cache.optim.window.AccumulationWindow`).

    A mixin still, for the reason :class:`~zero_cache.optim.optimizer_gradients.GradientIntake` is one: a reduced
    group goes straight to the update side (``_queue_speculative``, ``_speculates``, ``_rewrite_from_masters``), and
    the gradient intake and ``step()`` call this part in turn. As a collaborator it would take 10 of the optimizer's
    attributes and 7 of its methods.
    """

    def _group_written(self, chunk: int) -> None:
        """One more gradient of ``chunk``'s group written on this rank; reduce the group once complete."""
        group = self.sharding.group_of(chunk)
        self.window.group_missing[group] -= 1
        if self.window.group_missing[group] > 0:
            return
        if not self.overlap_comm and not self.store.shard_params:  # without overlap: all at the step
            return
        self.exchange.reduce(group)
        # Lagged by one group, so the compute stream rarely waits for NCCL (the wait orders what follows).
        # Sharded params cannot keep every bucket until the step: without overlap each is waited for at once.
        # (With no bucket planned for it, none stays in flight either: see ChunkExchange.reduction_lag.)
        updated_now = None if self.store.grads_in_accumulators or not self._speculating else self._updated_now
        done = self.exchange.completed(keep_in_flight=self.exchange.reduction_lag, updated_now=updated_now)
        if self.store.grads_in_accumulators:
            self._accumulate_reduced(done)
        elif self._speculating:
            self._update_reduced(done)

    def _finish_micro_step(self) -> None:
        """Accumulating: reduce the groups backward left open, add every reduced slice to its owner's accumulator."""
        if not self.window.micro_step_open:
            return
        self.exchange.reduce_rest()
        self._accumulate_reduced(self.exchange.completed())
        self.window.micro_step_open = False
        self._reset_group_counts()

    def _owned_in(self, group: int) -> list[int]:
        """This rank's chunks of ``group`` that hold trainable parameters (not padding)."""
        return [chunk for chunk in self.sharding.group_chunks(group, self.store.layout.num_chunks)
                if self.sharding.owns(chunk) and chunk in self._members_of_chunk]

    def _accumulate_reduced(self, groups: list[int]) -> None:
        for group in groups:
            reduced, in_use_until = self.exchange.reduced_slice(group), None
            for chunk in self._owned_in(group):
                in_use_until = self._add_to_accumulator(chunk, reduced)
            self.exchange.release_bucket(group, in_use_until)

    def _add_to_accumulator(self, chunk: int, reduced: torch.Tensor) -> Any:
        """Add an owned chunk's reduced gradients to its fp32 accumulator; returns what reads ``reduced`` until done."""
        first = chunk not in self.window.accumulated  # the window's first micro-step is copied, not added
        self.window.accumulated.add(chunk)
        accumulator = self.store.groups[chunk].grad
        if self.store.state_home(chunk).route is Route.DEVICE_ADAM:  # (its accumulator is on the device)
            accumulator.copy_(reduced) if first else accumulator.add_(reduced)
            return None  # the bucket's next use is on the compute stream too, ordered after this add
        if first:
            self.device_steps.wait(chunk)  # (a device step of the last window may still read the accumulator)
        buffer = self.host.gradient_pool.acquire()
        copied = self.transfers.copy(buffer, reduced, "d2h", after=self.transfers.mark())

        def accumulate() -> None:
            wait(copied)
            accumulator.copy_(buffer) if first else accumulator.add_(buffer)
            self.host.gradient_pool.release(buffer)

        self.host.submit(accumulate)
        return copied

    def _reduce_gradients(self) -> None:
        """Finish every group's reduction (same order on every rank) and put the owned chunks' squared
        norms, summed over ranks, into ``_chunk_squares``."""
        owned = self.sharding.owned(self.store.layout.num_chunks)
        if self.store.grads_in_accumulators:
            self._finish_micro_step()
            self._drain_host_gradients()
            for chunk in owned:
                if chunk in self.window.accumulated:
                    accumulator = self.store.groups[chunk].grad
                    square = torch.linalg.vector_norm(accumulator, dtype=torch.float32).square()
                    self.window.chunk_squares[chunk] = square
        else:
            self.exchange.reduce_rest()
            self.exchange.completed()
            for chunk in owned:
                if self.chunk_steps[chunk].speculative is None:  # (a speculated chunk's squares are in; its update
                    # may be overwriting it)
                    self.window.chunk_squares[chunk] = self._owned_square(chunk)
        self.sharding.all_reduce_sum(self.window.chunk_squares)

    def _updated_now(self, group: int) -> bool:
        """Whether :meth:`_update_reduced` queues an owned chunk of ``group`` as soon as its reduction is done."""
        return any(self._speculates(chunk) for chunk in self._owned_in(group))

    def _update_reduced(self, groups: list[int]) -> None:
        """Queue the host updates of the owned chunks of reduced groups (update during backward)."""
        for chunk in [chunk for group in groups for chunk in self._owned_in(group) if self._speculates(chunk)]:
            self.window.chunk_squares[chunk] = self._owned_square(chunk)
            squares = self.window.squares_pinned[chunk:chunk + 1]
            squares.copy_(self.window.chunk_squares[chunk:chunk + 1], non_blocking=True)
            self._queue_speculative(chunk, squares)

    def _restore_unreached(self, written: frozenset) -> None:
        """Sharded, one micro-batch: every group's reduce-scatter wrote into its owner's chunk, also where no
        gradient reached it on this rank (a parameter used without one): rewrite those from their masters."""
        if self.exchange is None or self.store.grads_in_accumulators:
            return
        reached = set(self._chunks_in(UPDATED_HERE, written))
        owned = set(self.sharding.owned(self.store.layout.num_chunks))
        self._rewrite_from_masters(sorted(owned & set(self._members_of_chunk) - reached), written)

    def _owned_square(self, chunk: int) -> torch.Tensor:
        if not self.sharding.sharded:  # one rank (streamed params): the gradient hook summed it per parameter
            return self.window.chunk_squares[chunk].clone()
        # Padding inside a chunk is zero on every rank, so the whole chunk's norm is its gradients'.
        taken = self.exchange.reduced_squares.get(self.sharding.group_of(chunk))  # (a shard at home on the host)
        if taken is not None:
            return taken
        return torch.linalg.vector_norm(self.store.param_chunks[chunk], dtype=torch.float32).square()

    def prepare_chunk(self, chunk: int) -> None:
        """Make ``chunk``'s params current before a forward uses it (forward pre-hook): wait for its host
        update, or, sharded, gather its group from the owners (see :class:`ChunkExchange`)."""
        if self.exchange is None:
            self.wait_for_chunk(chunk)
        else:
            self.exchange.prepare(chunk)

    def sync_params(self) -> None:
        """Gather every stale group now (sharded; every rank calls it, e.g. before a checkpoint)."""
        if self.exchange is not None:
            self.exchange.sync()

    def _mark_stale(self) -> None:
        if self.exchange is not None:
            self.exchange.mark_stale()
