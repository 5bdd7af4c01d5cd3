"""The hybrid optimizer's gradient intake: what happens to a gradient between autograd and the update.

A post-accumulate-grad hook takes each parameter's gradient out of ``.grad`` as autograd finishes it, during
``engine.backward()`` only. With one micro-batch per step it is written over its own parameter in the param chunk
(or into its group's bucket, to be reduced), and its squared norm is added to a per-chunk sum on the device; with
accumulating micro-batches it is added to the chunk's fp32 accumulator, through a pinned staging buffer and the
host worker where the accumulator is on the host. A chunk whose gradients are complete is updated at once, under
the rest of backward, where the plan says so (:mod:`zero_cache.optim.revision` revises that update at the step).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Iterator

import torch
from torch import nn

from zero_cache.optim.chunk_updates import ChunkUpdates
from zero_cache.optim.optimizer_sharded import ShardedGradients, Speculation
from zero_cache.optim.step_clock import StepClock
from zero_cache.optim.window import AccumulationWindow
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.state_costs import Route
from zero_cache.storage.chunks import ChunkStore
from zero_cache.storage.tiers import wait


class GradientIntake:
    """Takes each gradient out of autograd during the engine's backward, into the chunks (see the module docstring).

    Args:
        store: the chunk storage.
        window: the accumulation window it fills.
        updates: the update side (waits for a chunk's update before its gradient is written; the host worker).
        speculation: the step's side, for a chunk whose gradients are complete.
        sharded: the sharded side (a group's gradients written: reduce it), or None.
        step_clock: told when a backward starts.
        members: (param-group index, slot) of the trained parameters, in the optimizer's order...
        params: ...and the parameters.
    """

    def __init__(self, store: ChunkStore, window: AccumulationWindow, updates: ChunkUpdates, *,
                 speculation: Speculation, sharded: ShardedGradients | None, step_clock: StepClock,
                 members: list[tuple[int, TensorSlot]], params: list[nn.Parameter]) -> None:
        self.store = store
        self.window = window
        self.updates = updates
        self.speculation = speculation
        self.sharded = sharded
        self.exchange = sharded.exchange if sharded is not None else None
        self.step_clock = step_clock
        self.members = members
        self.params = params
        self.engine_backward = False
        """Whether the engine's backward is running (gradients are taken only then: :meth:`accumulating`)."""
        self.boundary = True
        """Whether the running backward completes an accumulation window (:meth:`prepare_backward`)."""

    def prepare_backward(self, boundary: bool) -> None:
        """Told by the engine before each backward whether it completes an accumulation window."""
        self.boundary = boundary
        if self.sharded is not None and self.store.grads_in_accumulators:
            self.sharded.finish_micro_step()  # the previous micro-step's last groups

    def make_hook(self, slot: TensorSlot):
        """The post-accumulate-grad hook of ``slot``'s parameter."""
        # Weak: a tensor's hooks are invisible to the garbage collector, so a strong reference
        # from the hook would keep the optimizer, its chunks and its worker alive forever.
        intake = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            owner = intake()
            if owner is not None and owner.engine_backward:
                owner._take_gradient(slot, param)

        return hook

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """The engine's backward runs inside; gradients go into ZeRO-Cache as autograd finishes them.

        A backward outside (a GAN's generator loss through its discriminator) leaves its gradients in
        ``.grad``, where the script's ``zero_grad()`` clears them; one still there when the next engine
        backward runs is summed into it by autograd and taken with it, as DeepSpeed's step includes it.
        """
        self.engine_backward = True
        self.step_clock.backward_starts()
        try:
            yield
        finally:
            self.engine_backward = False

    def refuse_stray_gradients(self) -> None:
        """A gradient left in ``.grad`` by a backward after the window's last engine backward cannot join a
        window whose gradients already overwrote their parameters: say so rather than drop it silently."""
        stray = [slot.name for (_, slot), param in zip(self.members, self.params) if param.grad is not None]
        if stray:
            raise RuntimeError(f"{', '.join(stray[:4])}{' ...' if len(stray) > 4 else ''} hold a gradient from a "
                               f"backward outside engine.backward() run after this step's engine.backward(); "
                               f"ZeRO-Cache takes gradients only in engine.backward(). Clear it (module.zero_grad()) "
                               f"or run that backward before engine.backward()")

    def window_norm(self) -> float:
        """Global norm over the gradients written in this window (the one device sync of the step)."""
        if self.store.grads_in_accumulators and self.store.shard_params and not self.store.sharding.sharded:
            # One rank, streamed params: per parameter in double, in the order the resident path sums them.
            return math.sqrt(sum(float(torch.linalg.vector_norm(self.store.state_view(slot, "grad"),
                                                                dtype=torch.float32)) ** 2
                                 for slot in self.window.completed_order))
        if not self.store.grads_in_accumulators or self.exchange is not None:
            return math.sqrt(float(self.window.chunk_squares.sum()))  # sharded: summed over the owners
        self.updates.drain_gradients()
        total = sum(self.window.host_squares)
        on_device = [torch.linalg.vector_norm(self.store.state_view(slot, "grad"), dtype=torch.float32).square()
                     for _, slot in self.members if slot.name in self.window.written
                     and self.store.state_home(slot.chunk).route is Route.DEVICE_ADAM]
        if on_device:
            total += float(torch.stack(on_device).double().sum())
        return math.sqrt(total)

    def _take_gradient(self, slot: TensorSlot, param: nn.Parameter) -> None:
        """Move ``param``'s gradient out of autograd into ZeRO-Cache (post-accumulate-grad hook)."""
        grad = param.grad
        param.grad = None
        first = slot.name not in self.window.written  # the first gradient of a window is copied, not added
        self.window.written.add(slot.name)
        if self.boundary:
            self.window.completed_order.append(slot)
        self.updates.wait_for_chunk(slot.chunk)  # the chunk's last update has landed before we write it
        if self.exchange is not None and self.exchange.uses_buckets:  # reduced from the group's bucket
            if not first and not self.store.grads_in_accumulators:
                raise self._second_gradient(slot)
            self.exchange.bucket_view(slot.chunk)[slot.offset:slot.offset + slot.numel].copy_(grad.reshape(-1))
            if not (self.store.sharding.sharded or self.store.grads_in_accumulators):
                self._add_square(slot.chunk, grad)  # one rank: summed per parameter, in the resident path's order
            self.window.micro_step_open = self.store.grads_in_accumulators
            self.sharded.group_written(slot.chunk)
        elif not self.store.grads_in_accumulators:
            self._write_over_param(slot, grad, first)
        elif self.store.state_home(slot.chunk).route is Route.DEVICE_ADAM:  # (its accumulator is on the device)
            accumulator = self.store.state_view(slot, "grad")
            accumulator.copy_(grad.reshape(-1)) if first else accumulator.add_(grad.reshape(-1))
        else:
            self._accumulate_on_host(slot, grad, first)

    def _write_over_param(self, slot: TensorSlot, grad: torch.Tensor, first: bool) -> None:
        """Single-micro-batch path: the gradient replaces the parameter it belongs to."""
        if not first:
            raise self._second_gradient(slot)
        self.store.param_view(slot).copy_(grad)
        self.window.missing[slot.chunk] -= 1
        if self.sharded is not None:
            self.sharded.group_written(slot.chunk)
            return
        self._add_square(slot.chunk, grad)
        if self.window.missing[slot.chunk] == 0 and self.speculation.speculates(slot.chunk):
            # The chunk's gradients are complete: update it now, under the rest of backward.
            squares = self.window.squares_pinned[slot.chunk:slot.chunk + 1]
            squares.copy_(self.window.chunk_squares[slot.chunk:slot.chunk + 1], non_blocking=True)
            self.speculation.speculate(slot.chunk, squares)

    def _add_square(self, chunk: int, grad: torch.Tensor) -> None:
        square = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        self.window.chunk_squares[chunk:chunk + 1].add_(square)

    @staticmethod
    def _second_gradient(slot: TensorSlot) -> RuntimeError:
        return RuntimeError(f"{slot.name} received a second gradient in one step; with one micro-batch per step "
                            "ZeRO-Cache writes gradients over the parameters, so backward may run once per step "
                            "(set gradient_accumulation_steps for several micro-batches)")

    def _accumulate_on_host(self, slot: TensorSlot, grad: torch.Tensor, first: bool) -> None:
        """Accumulating path: stage the gradient through a pinned buffer; the worker adds it in fp32.

        At the window's last micro-step the worker also takes the slot's squared norm, so the
        global norm at ``step()`` is a sum of partials computed while backward was still running.
        """
        host, transfers = self.updates.host, self.updates.transfers
        if first:
            self.updates.device_steps.wait(slot.chunk)  # (a device step of the last window may still read it)
        buffer = host.gradient_pool.acquire()
        staged = buffer[:slot.numel]
        copied = transfers.copy(staged, grad.reshape(-1), "d2h", after=transfers.mark())
        accumulator = self.store.state_view(slot, "grad")
        boundary = self.boundary

        def accumulate() -> None:
            wait(copied)
            if first:
                host.settle(slot.chunk)  # a lazy update of the last step still reads the accumulator
            accumulator.copy_(staged) if first else accumulator.add_(staged)
            host.gradient_pool.release(buffer)
            if boundary:
                self.window.host_squares.append(float(torch.linalg.vector_norm(accumulator, dtype=torch.float32)) ** 2)

        host.submit(accumulate)
        if boundary and self.exchange is None:
            self.window.missing[slot.chunk] -= 1
            if self.window.missing[slot.chunk] == 0 and self.speculation.speculates(slot.chunk):
                self.speculation.speculate(slot.chunk, None)  # runs after its accumulations (zero_cache.runtime.jobs)
