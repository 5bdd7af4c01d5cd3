"""The hybrid optimizer's data-parallel side: reducing sharded gradients and gathering updated params.

Collectives are :class:`~zero_cache.runtime.exchange.ChunkExchange`'s; what is done with a reduced group lives
here: with one micro-batch per step the owner's chunk already holds the summed gradients (written over
its params) and, when updates run during backward, is queued on the host worker; with accumulating
micro-batches the owner adds its reduced slice to its fp32 accumulator. ``step()`` then takes the
global norm from the owners' chunks (one all-reduce) and updates only the owned chunks.

Over W > 1 ranks (``store.sharding``; see :mod:`zero_cache.base.sharding`) each rank updates only the chunks it
owns. As soon as every chunk of a collective group has its gradients on this rank (written over the params, or into a
gradient bucket when micro-batches accumulate), the training thread issues the group's reduce-scatter (async on
NCCL), so it runs under the rest of backward. ``step()`` waits for them, takes the global norm from the owned chunks
(one all-reduce of a float per chunk), updates the owned chunks with the mean gradient, and marks
every group stale; the next forward all-gathers each group in its pre-hook, ahead of use. The
worker thread never issues a collective, so every rank issues them in the same order.

With gathered params each owned chunk is this rank's shard: its gradients arrive by reduce-scatter from
a bucket, the update rewrites it from the masters as above, and the other ranks' chunks exist only while
gathered (:mod:`zero_cache.runtime.gathered`). A shard at home on the host (streamed params, on one rank too)
receives its gradients from the device->host stream and the host worker updates it in place: the next
gather copies the new weights in, so no host->device copy follows the update.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zero_cache.optim.chunk_updates import ChunkUpdates
from zero_cache.optim.window import AccumulationWindow
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.state_costs import Route
from zero_cache.runtime.exchange import ChunkExchange
from zero_cache.storage.chunks import ChunkStore
from zero_cache.storage.tiers import wait


class Speculation(Protocol):
    """What the gradient intake and the sharded side ask of the step: whether a chunk whose gradients are complete is
    updated now, under the rest of backward, and to queue that update (the optimizer's; :mod:`~.revision`)."""

    speculating: bool
    """Whether this window updates host chunks during backward."""

    def speculates(self, chunk: int) -> bool:
        """Whether ``chunk``, its gradient complete, is updated now."""

    def speculate(self, chunk: int, squares: torch.Tensor | None) -> None:
        """Queue ``chunk``'s update now (``squares``: its squared gradient norm, or None: read from its accumulator)."""


class ShardedGradients:
    """What is done with a group's gradients once reduced (see the module docstring).

    Args:
        store: the chunk storage.
        exchange: the collectives (reductions, gathers) over the groups.
        window: the accumulation window (the groups' gradients still to come, the squared norms).
        updates: the update side (the host worker, the device steps' waits).
        speculation: the step's side, for an owned chunk whose reduced gradients are complete.
        members_of_chunk: chunk -> its trained (param-group index, slot) members.
        overlap_comm: reduce each group from backward as soon as it is complete (else at the step).
    """

    def __init__(self, store: ChunkStore, exchange: ChunkExchange, window: AccumulationWindow, updates: ChunkUpdates,
                 *, speculation: Speculation, members_of_chunk: dict[int, list[tuple[int, TensorSlot]]],
                 overlap_comm: bool) -> None:
        self.store = store
        self.sharding = store.sharding
        self.exchange = exchange
        self.window = window
        self.updates = updates
        self.speculation = speculation
        self.members_of_chunk = members_of_chunk
        self.overlap_comm = overlap_comm

    def group_written(self, chunk: int) -> None:
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
        speculating = self.speculation.speculating
        updated_now = None if self.store.grads_in_accumulators or not speculating else self._updated_now
        done = self.exchange.completed(keep_in_flight=self.exchange.reduction_lag, updated_now=updated_now)
        if self.store.grads_in_accumulators:
            self._accumulate_reduced(done)
        elif speculating:
            self._update_reduced(done)

    def finish_micro_step(self) -> None:
        """Accumulating: reduce the groups backward left open, add every reduced slice to its owner's accumulator."""
        if not self.window.micro_step_open:
            return
        self.exchange.reduce_rest()
        self._accumulate_reduced(self.exchange.completed())
        self.window.micro_step_open = False
        self.new_micro_step()

    def new_micro_step(self) -> None:
        """Gradients to come per collective group in the next backward; a new micro-step for the exchange."""
        self.window.reset_group_counts()
        self.exchange.new_micro_step()

    def owned_chunks(self) -> set[int]:
        """This rank's chunks that hold trainable parameters (not padding)."""
        return set(self.sharding.owned(self.store.layout.num_chunks)) & set(self.members_of_chunk)

    def _owned_in(self, group: int) -> list[int]:
        """This rank's chunks of ``group`` that hold trainable parameters (not padding)."""
        return [chunk for chunk in self.sharding.group_chunks(group, self.store.layout.num_chunks)
                if self.sharding.owns(chunk) and chunk in self.members_of_chunk]

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
            self.updates.device_steps.wait(chunk)  # (a device step of the last window may still read the accumulator)
        host, transfers = self.updates.host, self.updates.transfers
        buffer = host.gradient_pool.acquire()
        copied = transfers.copy(buffer, reduced, "d2h", after=transfers.mark())

        def accumulate() -> None:
            wait(copied)
            accumulator.copy_(buffer) if first else accumulator.add_(buffer)
            host.gradient_pool.release(buffer)

        host.submit(accumulate)
        return copied

    def reduce_gradients(self) -> None:
        """Finish every group's reduction (same order on every rank) and put the owned chunks' squared
        norms, summed over ranks, into the window's ``chunk_squares``."""
        owned = self.sharding.owned(self.store.layout.num_chunks)
        if self.store.grads_in_accumulators:
            self.finish_micro_step()
            self.updates.drain_gradients()
            for chunk in owned:
                if chunk in self.window.accumulated:
                    accumulator = self.store.groups[chunk].grad
                    square = torch.linalg.vector_norm(accumulator, dtype=torch.float32).square()
                    self.window.chunk_squares[chunk] = square
        else:
            self.exchange.reduce_rest()
            self.exchange.completed()
            for chunk in owned:
                if self.updates.steps[chunk].speculative is None:  # (a speculated chunk's squares are in; its update
                    # may be overwriting it)
                    self.window.chunk_squares[chunk] = self._owned_square(chunk)
        self.sharding.all_reduce_sum(self.window.chunk_squares)

    def _updated_now(self, group: int) -> bool:
        """Whether :meth:`_update_reduced` queues an owned chunk of ``group`` as soon as its reduction is done."""
        return any(self.speculation.speculates(chunk) for chunk in self._owned_in(group))

    def _update_reduced(self, groups: list[int]) -> None:
        """Queue the host updates of the owned chunks of reduced groups (update during backward)."""
        for chunk in [chunk for group in groups for chunk in self._owned_in(group)
                      if self.speculation.speculates(chunk)]:
            self.window.chunk_squares[chunk] = self._owned_square(chunk)
            squares = self.window.squares_pinned[chunk:chunk + 1]
            squares.copy_(self.window.chunk_squares[chunk:chunk + 1], non_blocking=True)
            self.speculation.speculate(chunk, squares)

    def _owned_square(self, chunk: int) -> torch.Tensor:
        if not self.sharding.sharded:  # one rank (streamed params): the gradient hook summed it per parameter
            return self.window.chunk_squares[chunk].clone()
        # Padding inside a chunk is zero on every rank, so the whole chunk's norm is its gradients'.
        taken = self.exchange.reduced_squares.get(self.sharding.group_of(chunk))  # (a shard at home on the host)
        if taken is not None:
            return taken
        return torch.linalg.vector_norm(self.store.param_chunks[chunk], dtype=torch.float32).square()
