"""The update of the optimizer groups held on the device: Adam on the compute stream, the param chunk rewritten.

Where Triton runs, each written device chunk is updated in one pass over device memory
(:mod:`zero_cache.optim.device_adam`); elsewhere through the fp32 scratch and torch's fused Adam, in four. Host-held
groups are not this module's: the host worker (:mod:`zero_cache.optim.host_update`) or the device steps
(:mod:`zero_cache.optim.device_steps`) update them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from zero_cache.optim.chunk_adam import adam_step, state_gradient
from zero_cache.optim.device_adam import adam_in_one_pass, contiguous_runs, one_pass_available
from zero_cache.optim.device_adam import warm as warm_one_pass
from zero_cache.optim.host_adam import torch_fused_adam
from zero_cache.optim.step_clock import StepClock, TimedSpans
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.state_costs import Route
from zero_cache.plan.tier_names import DEVICE
from zero_cache.storage.chunks import STATE_FIELDS, ChunkStore


class DeviceGroups:
    """Adam over the device-held optimizer groups, each step, timed on the compute stream.

    Args:
        store: the chunk storage.
        decoupled_weight_decay: AdamW (True) or Adam with L2 (False).
        step_clock: marks points on the compute stream (the timing's ends).
        before_update: called with a chunk before its states change (a checkpoint's snapshot stages it first).
        fence: orders the compute stream after the device steps' last use of the scratch (the four passes use it).
    """

    def __init__(self, store: ChunkStore, *, decoupled_weight_decay: bool, step_clock: StepClock,
                 before_update: Callable[[int], None], fence: Callable[[], None]) -> None:
        self.store = store
        self.decoupled = decoupled_weight_decay
        self.adam = functools.partial(torch_fused_adam, decoupled=decoupled_weight_decay)
        """torch's fused Adam over lists of fp32 (or bf16) tensors (the four passes, and the device steps' kernel)."""
        self.step_clock = step_clock
        self.before_update = before_update
        self.fence = fence
        self.one_pass = one_pass_available(store.tiers[DEVICE].device) and store.state_dtype == torch.float32
        """Whether device chunks update in one pass over device memory (:mod:`zero_cache.optim.device_adam`, whose
        kernel reads fp32 states; bf16 states take torch's fused Adam, which steps them in fp32 and rounds)."""
        self._compiled = False
        self.timing = TimedSpans()
        """The device's Adam over the groups it holds, timed on the compute stream each step (the step's prediction
        prices it by this: :func:`zero_cache.runtime.rates.with_timed_work`)."""

    def compile_if_held(self) -> None:
        """Compile the one-pass Adam now, once a plan holds groups on the device: compiled on first use, it fell in
        the step after (the tuning's first measured step at 2.7B capped on an H100: 1.78 s against 0.63)."""
        store = self.store
        if self.one_pass and not self._compiled and any(
                store.state_home(chunk).route is Route.DEVICE_ADAM for chunk in range(store.layout.num_chunks)):
            warm_one_pass(store.tiers[DEVICE].device,
                          store.state_dtype if store.grads_in_accumulators else store.compute_dtype,
                          store.compute_dtype, self.decoupled)
            self._compiled = True

    def update(self, chunks: list[int], members_of: Callable[[int], dict[int, list[TensorSlot]]],
               all_members: Callable[[int], int], hypers: list[dict[str, Any]], step: int, grad_factor: float) -> None:
        """Adam over each of ``chunks`` (device-held, written this step) and its param chunk rewritten from the masters.

        Args:
            members_of: chunk -> param-group index -> its slots with a gradient this step.
            all_members: chunk -> how many trained parameters it holds (with a gradient or not).
            hypers, step, grad_factor: the step's hyperparameters per param group, Adam step, unscale x clip factor.
        """
        store = self.store
        if not self.one_pass:  # (the four passes use the scratch, which the last step's device steps used)
            self.fence()
        self.timing.close_step()
        if chunks:
            self.timing.start(self.step_clock.mark())
        for chunk in chunks:
            self.before_update(chunk)
            group = store.groups[chunk]
            params = store.param_chunks[chunk]
            source = group.grad if store.grads_in_accumulators else params
            members = members_of(chunk)
            if self.one_pass:
                states = [group.field(name) for name in STATE_FIELDS]
                for index, slots in members.items():
                    for low, high in contiguous_runs(slots):
                        adam_in_one_pass([state[low:high] for state in states], source[low:high], params[low:high],
                                         grad_factor=grad_factor, step=step, decoupled=self.decoupled,
                                         **hypers[index])
                if sum(map(len, members.values())) == all_members(chunk):
                    continue  # (else the params of those without a gradient come from their masters below)
            else:
                grads = state_gradient(source, store.scratch[DEVICE], grad_factor)
                for index, slots in members.items():
                    adam_step(store, slots, grads, hypers[index], step, self.adam)
            params.copy_(group.field("master"))
        if chunks:
            self.timing.extend(self.step_clock.mark(), len(chunks) * store.layout.chunk_numel)
