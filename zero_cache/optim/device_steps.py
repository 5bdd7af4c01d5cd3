"""Host-held optimizer groups stepped on the device: states copied in, stepped by the GPU's Adam, copied back.

When params stream from the host, the host's CPU Adam bounds the step: it updates most groups at a
few G elements/s while PCIe, busy only with the streamed shards, has room left. PatrickStar's answer
is to move optimizer-state chunks to the GPU for the update when it has memory to spare. Here the
plan names the host groups to step that way (:func:`~zero_cache.plan.step_cost.cheapest_device_steps`:
those the next forward needs first, as many as lower the step's floor), and ``step()``, which knows
the global norm, updates each of them here instead of queueing it on the host worker. Nothing is
speculative, so clipping, loss scaling and skipped steps need nothing more.

Per chunk, one piece at a time through the device's update scratch (``ChunkStore.scratch``: one fp32
chunk, which the plan keeps anyway), cut into :data:`RING` slots so that piece i's copies in overlap
piece i-1's Adam and piece i-2's copies out:

1. **in** (its own host->device stream): the piece's fp32 master, exp_avg and exp_avg_sq from the
   pinned group, and its gradient when that is on the host (the fp32 accumulator, or the shard's home
   when params stream);
2. **step** (its own compute stream): the gradient made fp32 and scaled, torch's fused Adam over the
   piece's parameters (the kernel the device groups use), the new params rounded to the compute dtype,
   straight into the param chunk when that lives on the device;
3. **out** (its own device->host stream): the states back into the group, and the params into the
   shard's home on the host.

A chunk costs 12 bytes per element each way plus its gradient in and its params out; the host path
would have cost CPU Adam over it. The streams are apart from the gathers' and the worker's, so the
next forward's copies are not queued behind these. On a CPU-only run the same code runs with plain
copies (what the unit tests exercise).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from zero_cache.optim.step_clock import TimedSpans, stream_mark
from zero_cache.plan.layout import TensorSlot
from zero_cache.plan.tier_names import DEVICE
from zero_cache.storage.chunks import STATE_FIELDS, ChunkStore
from zero_cache.storage.tiers import wait

RING = 3
"""Pieces in flight: one coming in, one being stepped, one going out."""
_REGIONS = len(STATE_FIELDS) + 2
"""A slot's regions, one piece each: the three fp32 states, the fp32 gradient, and the compute-dtype
gradient landing from the host / params leaving for it."""


class DeviceSteps:
    """Steps host-held optimizer groups on the device, piece by piece (see the module docstring).

    Args:
        store: the chunk storage (its device scratch is the ring).
        transfers: host<->device copies (:class:`~zero_cache.runtime.transfers.Transfers`), which count the traffic.
        adam: the device's Adam over lists of fp32 tensors (``torch_fused_adam`` with its weight-decay mode).
    """

    def __init__(self, store: ChunkStore, transfers: Any, adam: Callable[..., None]) -> None:
        self.store = store
        self.transfers = transfers
        self.adam = adam
        device = store.tiers[DEVICE].device
        self.cuda = device.type == "cuda"
        self.h2d, self.compute, self.d2h = ((torch.cuda.Stream(device), torch.cuda.Stream(device),
                                             torch.cuda.Stream(device)) if self.cuda else (None, None, None))
        scratch = store.scratch[DEVICE]
        self.piece = max(1, scratch.numel() // (RING * _REGIONS))
        """Elements per piece."""
        self._slots = [scratch[i * _REGIONS * self.piece:(i + 1) * _REGIONS * self.piece] for i in range(RING)]
        self._slot_free: list[Any] = [None] * RING  # the copy out that last read each slot
        self._next_slot = 0
        self._last_out: Any = None  # the latest copy out: every use of the scratch so far is before it
        self._copies: dict[int, Any] = {}  # chunk -> its last copy (in or out) of host memory, until waited for
        self.timing = TimedSpans()
        """Elements stepped here and the seconds each step's took, from when they could start (backward and the
        device-held groups' Adam done) to their last copy out (the step's prediction prices the device steps by it:
        :func:`zero_cache.runtime.rates.with_timed_work`)."""

    # ------------------------------------------------------------------ one chunk
    def begin(self) -> None:
        """A step's updates follow: order them after what the current stream has queued (it used the scratch
        last, and wrote the gradients read here) and after the last step's copies out (the states read here)."""
        self.timing.close_step()
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.store.tiers[DEVICE].device))
            if self._last_out is not None:
                self.h2d.wait_event(self._last_out)

    def step(self, chunk: int, members: dict[int, list[TensorSlot]], hypers: list[dict[str, Any]], step: int,
             grad_factor: float, grads_ready: Any = None) -> Any:
        """Queue ``chunk``'s update on the device; returns the event after which its new params are in place
        (the param chunk on the device, or the shard's home on the host), None on CPU.

        Args:
            members: param-group index -> slots to step (those with a gradient this step).
            hypers: per param group: lr, betas, eps, weight_decay.
            step: the Adam step number.
            grad_factor: what the gradients are multiplied by (unscale and clip).
            grads_ready: the event after which the gradients are complete where they are read.
        """
        store = self.store
        if not self.timing.open:  # the step's first: timed from here, where the copies in queue after begin()'s waits
            self.timing.start(self._mark(self.h2d))
        group = store.groups[chunk]
        assert group.home.device_steppable and group.states is not None, \
            f"chunk {chunk}'s optimizer group is not in a home the device may step"
        params = store.param_chunks[chunk]
        home_on_host = store.home(chunk).in_host_memory
        grads = group.grad if store.grads_in_accumulators else params
        grads_on_host = store.grads_in_accumulators or home_on_host
        fields = [group.field(name) for name in STATE_FIELDS]
        ready = None
        for start in range(0, store.layout.chunk_numel, self.piece):
            end = min(start + self.piece, store.layout.chunk_numel)
            ready = self._step_piece(start, end, fields, grads, grads_on_host, params, home_on_host, members, hypers,
                                     step, grad_factor, grads_ready)
        self._copies[chunk] = self._last_out
        self.timing.extend(self._mark(self.d2h), store.layout.chunk_numel)
        return ready

    def _mark(self, stream: Any) -> Any:
        """A point in time on ``stream``: a timing event on a GPU, the host's clock on CPU (where copies are sync)."""
        return stream_mark(stream) if self.cuda else time.perf_counter()

    def _step_piece(self, start: int, end: int, fields: list[torch.Tensor], grads: torch.Tensor, grads_on_host: bool,
                    params: torch.Tensor, home_on_host: bool, members: dict[int, list[TensorSlot]],
                    hypers: list[dict[str, Any]], step: int, grad_factor: float, grads_ready: Any) -> Any:
        """One piece through a ring slot; returns the event after which its params are in place."""
        index = self._next_slot
        self._next_slot = (index + 1) % RING
        numel, piece = end - start, self.piece
        slot = self._slots[index]
        states = [slot[i * piece:i * piece + numel] for i in range(len(STATE_FIELDS))]
        grad32 = slot[len(STATE_FIELDS) * piece:len(STATE_FIELDS) * piece + numel]
        landing = slot[(_REGIONS - 1) * piece:_REGIONS * piece].view(self.store.compute_dtype)[:numel]
        # in
        free = self._slot_free[index]
        arrived = None
        for device_state, host_state in zip(states, fields):
            arrived = self.transfers.copy(device_state, host_state[start:end], "h2d", after=free, stream=self.h2d)
        source = grads[start:end]
        if grads_on_host:
            into = grad32 if source.dtype == torch.float32 else landing
            arrived = self.transfers.copy(into, source, "h2d", after=grads_ready, stream=self.h2d)
            source = into
        # step
        with torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext():
            for event in (arrived, None if grads_on_host else grads_ready):
                if event is not None:
                    self.compute.wait_event(event)
            if source is not grad32:
                grad32.copy_(source)
            if grad_factor != 1.0:
                grad32.mul_(grad_factor)
            self._adam(states, grad32, start, end, members, hypers, step)
            out = landing if home_on_host else params[start:end]
            out.copy_(states[0])
            stepped = self.transfers.mark()  # (on the compute stream of this context)
        # out
        for device_state, host_state in zip(states, fields):
            done = self.transfers.copy(host_state[start:end], device_state, "d2h", after=stepped, stream=self.d2h)
        if home_on_host:
            done = self.transfers.copy(params[start:end], landing, "d2h", after=stepped, stream=self.d2h)
        self._slot_free[index] = self._last_out = done
        return done if home_on_host else stepped

    def _adam(self, states: list[torch.Tensor], grad32: torch.Tensor, start: int, end: int,
              members: dict[int, list[TensorSlot]], hypers: list[dict[str, Any]], step: int) -> None:
        """The piece's share of each member parameter, stepped per param group (Adam is elementwise)."""
        for group_index, slots in members.items():
            views: list[list[torch.Tensor]] = [[], [], [], []]
            for slot in slots:
                low, high = max(start, slot.offset), min(end, slot.offset + slot.numel)
                if low < high:
                    for view, whole in zip(views, (*states, grad32)):
                        view.append(whole[low - start:high - start])
            if views[0]:
                master, exp_avg, exp_avg_sq, grad = views
                self.adam(master, grad, exp_avg, exp_avg_sq, step=step, **hypers[group_index])

    # ------------------------------------------------------------------ waiting
    def wait(self, chunk: int) -> None:
        """Block until ``chunk``'s copies of host memory have landed (before the host touches its states, its
        accumulator or its home again)."""
        wait(self._copies.pop(chunk, None))

    def fence(self) -> None:
        """Order the current stream after every use of the scratch so far (before it writes the scratch)."""
        if self.cuda and self._last_out is not None:
            torch.cuda.current_stream(self.store.tiers[DEVICE].device).wait_event(self._last_out)

    def synchronize(self) -> None:
        """Block until everything queued here has landed (the copies out run in order: the last one is enough)."""
        wait(self._last_out)
        self._copies.clear()

    def close(self) -> None:
        """Let go of the device scratch (its ring), after what is queued here (:mod:`zero_cache.optim.release`)."""
        self.synchronize()
        self._slots, self._slot_free = [], []

