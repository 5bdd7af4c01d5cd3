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
import weakref
from typing import Iterator

import torch
from torch import nn

from zero_cache.optim.revision import SpeculationWindow
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.state_costs import Route
from zero_cache.storage.tiers import wait


class GradientIntake:
    """Mixed into :class:`~zero_cache.optim.optimizer.ZeroCacheOptimizer` (its store, exchange, host worker, transfers,
    speculation settings and :class:`~zero_cache.optim.window.AccumulationWindow`, which ``_reset_window`` starts
    again).

    A mixin still, unlike the checkpoint surface (:class:`~zero_cache.optim.optimizer_state.NamedStates`) and the
    step's timing (:class:`~zero_cache.optim.step_clock.StepClock`): a gradient it takes may start its chunk's update
    at once (``_queue_host_update``, ``_queue_speculative``) or its group's reduction (``_group_written``), and what
    decides that is the step's own state (``step_count``, ``_speculating``, ``device_stepped``, ``_hypers``). As a
    collaborator it would take 18 of the optimizer's attributes and 5 of its methods; the window's bookkeeping, which
    it shares with the step and :class:`~zero_cache.optim.optimizer_sharded.ShardedGradients`, is one of them.
    """

    def prepare_backward(self, boundary: bool) -> None:
        """Told by the engine before each backward whether it completes an accumulation window."""
        self._boundary = boundary
        if self.exchange is not None and self.store.grads_in_accumulators:
            self._finish_micro_step()  # the previous micro-step's last groups

    def _make_grad_hook(self, slot: TensorSlot):
        # Weak: a tensor's hooks are invisible to the garbage collector, so a strong reference
        # from the hook would keep this optimizer, its chunks and its worker alive forever.
        optimizer = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            owner = optimizer()
            if owner is not None and owner._engine_backward:
                owner._take_gradient(slot, param)

        return hook

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """The engine's backward runs inside; gradients go into ZeRO-Cache as autograd finishes them.

        A backward outside (a GAN's generator loss through its discriminator) leaves its gradients in
        ``.grad``, where the script's ``zero_grad()`` clears them; one still there when the next engine
        backward runs is summed into it by autograd and taken with it, as DeepSpeed's step includes it.
        """
        self._engine_backward = True
        self.step_clock.backward_starts()
        try:
            yield
        finally:
            self._engine_backward = False

    def _refuse_stray_gradients(self) -> None:
        """A gradient left in ``.grad`` by a backward after the window's last engine backward cannot join a
        window whose gradients already overwrote their parameters: say so rather than drop it silently."""
        stray = [name for name, param in zip(self.names, self._params) if param.grad is not None]
        if stray:
            raise RuntimeError(f"{', '.join(stray[:4])}{' ...' if len(stray) > 4 else ''} hold a gradient from a "
                               f"backward outside engine.backward() run after this step's engine.backward(); "
                               f"ZeRO-Cache takes gradients only in engine.backward(). Clear it (module.zero_grad()) "
                               f"or run that backward before engine.backward()")

    def _take_gradient(self, slot: TensorSlot, param: nn.Parameter) -> None:
        """Move ``param``'s gradient out of autograd into ZeRO-Cache (post-accumulate-grad hook)."""
        grad = param.grad
        param.grad = None
        first = slot.name not in self.window.written  # the first gradient of a window is copied, not added
        self.window.written.add(slot.name)
        if self._boundary:
            self.window.completed_order.append(slot)
        self.wait_for_chunk(slot.chunk)  # the chunk's last host update has landed before we write it
        if self.exchange is not None and self.exchange.uses_buckets:  # reduced from the group's bucket
            if not first and not self.store.grads_in_accumulators:
                raise self._second_gradient(slot)
            self.exchange.bucket_view(slot.chunk)[slot.offset:slot.offset + slot.numel].copy_(grad.reshape(-1))
            if not (self.sharding.sharded or self.store.grads_in_accumulators):
                self._add_square(slot.chunk, grad)  # one rank: summed per parameter, in the resident path's order
            self.window.micro_step_open = self.store.grads_in_accumulators
            self._group_written(slot.chunk)
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
        if self.exchange is not None:
            self._group_written(slot.chunk)
            return
        self._add_square(slot.chunk, grad)
        if self.window.missing[slot.chunk] == 0 and self._speculates(slot.chunk):
            # The chunk's gradients are complete: update it now, under the rest of backward.
            squares = self.window.squares_pinned[slot.chunk:slot.chunk + 1]
            squares.copy_(self.window.chunk_squares[slot.chunk:slot.chunk + 1], non_blocking=True)
            self._queue_speculative(slot.chunk, squares)

    def _speculates(self, chunk: int) -> bool:
        """Whether ``chunk`` (its gradient complete) is updated now, during backward
        (:mod:`zero_cache.optim.revision`)."""
        group = self.store.groups[chunk]
        return (self._speculating and group.home.route is Route.HOST_ADAM and chunk not in self.device_stepped
                and (group.kept is not None or self.store.grads_in_accumulators))

    def _unscale_factor(self) -> float:
        """What the summed gradients are multiplied by before the clip factor: 1 / (loss scale x ranks summed)."""
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        return 1.0 / (scale * self.sharding.world_size if self.exchange is not None else scale)

    def _queue_speculative(self, chunk: int, squares: torch.Tensor | None) -> None:
        """Update ``chunk`` now with the clip factor taken as 1; ``step()`` revises it (``squares``: its squared
        gradient norm, copied from the device; None: the worker takes it from the accumulator)."""
        factor = self._unscale_factor()
        if self.window.speculation is None:
            self.window.speculation = SpeculationWindow(self.gradient_clipping, factor)
        self._queue_host_update(chunk, frozenset(self.window.written), self._hypers(), step=self.step_count + 1,
                                grad_factor=factor, squares=squares, window=self.window.speculation)
        self.counts["speculated_chunks"] += 1

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
        if first:
            self.device_steps.wait(slot.chunk)  # (a device step of the last window may still read the accumulator)
        buffer = self.host.gradient_pool.acquire()
        staged = buffer[:slot.numel]
        copied = self.transfers.copy(staged, grad.reshape(-1), "d2h", after=self.transfers.mark())
        accumulator = self.store.state_view(slot, "grad")
        boundary = self._boundary

        def accumulate() -> None:
            wait(copied)
            if first:
                self.host.settle(slot.chunk)  # a lazy update of the last step still reads the accumulator
            accumulator.copy_(staged) if first else accumulator.add_(staged)
            self.host.gradient_pool.release(buffer)
            if boundary:
                self.window.host_squares.append(float(torch.linalg.vector_norm(accumulator, dtype=torch.float32)) ** 2)

        self.host.submit(accumulate)
        if boundary and self.exchange is None:
            self.window.missing[slot.chunk] -= 1
            if self.window.missing[slot.chunk] == 0 and self._speculates(slot.chunk):
                self._queue_speculative(slot.chunk, None)  # runs after its accumulations (zero_cache.runtime.jobs)

    def _reset_window(self) -> None:
        self.window.reset()
        self.chunk_steps.new_window()
        self._reset_group_counts()

    def _reset_group_counts(self) -> None:
        """Gradients to come per collective group in the next backward; a new micro-step for the exchange."""
        self.window.reset_group_counts()
        if self.exchange is not None:
            self.exchange.new_micro_step()
