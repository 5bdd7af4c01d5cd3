"""Optimizer states homed on NVMe (DeepSpeed's ``offload_optimizer: nvme``): each group's states in a slot of the NVMe
tier's swap file (:class:`~zero_cache.storage.nvme.NvmeTier`), its gradient accumulator in host memory.

For an update the host worker fetches the states: the slot is read into one of
:data:`~zero_cache.plan.state_costs.SWAP_BUFFERS` pinned bounce buffers alongside the gradient's transfer (one update
ahead), CPU Adam runs over the buffer, and the buffer is written back and returns to the pool with the write in flight
("write behind"); a later read of the same slot waits for it. Per step that is a read and a write of each group
(:meth:`~zero_cache.plan.state_costs.NvmeStateCosts.disk_bytes_per_step`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from zero_cache.plan.state_costs import STATE_COSTS, SWAP_BUFFERS
from zero_cache.plan.tier_names import HOST, NVME
from zero_cache.storage.nvme import ALIGN_BYTES, NvmeTier
from zero_cache.storage.state_homes.home import STATE_FIELDS, FetchedStates, OptimizerGroup, StateHome
from zero_cache.storage.tiers import BufferPool


class NvmeStates(StateHome):
    """The states live in a slot of the NVMe tier's swap file, read and written through pinned bounce buffers."""

    costs = STATE_COSTS[NVME]
    grad_tier = HOST

    def __init__(self, tiers: dict[str, Any], numel: int, accumulate: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(tiers, numel, accumulate, dtype)
        self.disk: NvmeTier = tiers[self.name]
        host, slot_bytes = tiers[HOST], self.disk.slot_bytes
        self.bounce_buffers = BufferPool(SWAP_BUFFERS, lambda: host.allocate_aligned(slot_bytes, ALIGN_BYTES),
                                         free=lambda buffer: host.free_aligned(buffer, ALIGN_BYTES))
        self.num_groups = 0
        """Groups living here (the bounce buffers are needed while there are any)."""

    def allocate(self) -> OptimizerGroup:
        group = OptimizerGroup(home=self, states=None, grad=self._allocate_grad(),
                               swap_offset=self.disk.allocate_slot())
        self.num_groups += 1
        return group

    def free(self, group: OptimizerGroup) -> None:
        self.num_groups -= 1
        self.disk.free_slot(group.swap_offset)
        if group.grad is not None:
            self.tiers[self.grad_tier].free(group.grad)

    def held_bytes(self) -> dict[str, int]:
        return self._with_grad_bytes({self.name: self.disk.slot_bytes})

    def _states_in(self, buffer: torch.Tensor) -> torch.Tensor:
        """The states inside a bounce buffer (the rest of it is block padding)."""
        return buffer[:len(STATE_FIELDS) * self.numel * self.dtype.itemsize].view(self.dtype)

    @contextlib.contextmanager
    def open(self, group: OptimizerGroup, *, write_back: bool = False, fresh: bool = False
             ) -> Iterator[torch.Tensor]:
        """Read into a bounce buffer (zeroed instead when ``fresh``) and, with ``write_back``, written back when the
        block ends."""
        buffer = self.bounce_buffers.acquire()
        try:
            if fresh:
                buffer.zero_()
            else:
                self.disk.read(group.swap_offset, buffer).wait()
            yield self._states_in(buffer)
            if write_back:
                self.disk.write(group.swap_offset, buffer).wait()
        finally:
            self.bounce_buffers.release(buffer)

    def fetch(self, group: OptimizerGroup) -> FetchedStates:
        buffer = self.bounce_buffers.acquire()
        return FetchedStates(home=self, states=self._states_in(buffer), ready=self.disk.read(group.swap_offset, buffer),
                             buffer=buffer)

    def write_back(self, group: OptimizerGroup, fetched: FetchedStates, changed: bool) -> None:
        # Written behind: the buffer is reused once the write has landed.
        written = self.disk.write(group.swap_offset, fetched.buffer) if changed else None
        self.bounce_buffers.release(fetched.buffer, written)

    def give_back(self, fetched: FetchedStates) -> None:
        self.bounce_buffers.release(fetched.buffer, fetched.ready)

    def trim(self) -> None:
        """The pinned bounce buffers go when no group lives here (the plan counts them only while one does)."""
        if self.num_groups == 0:
            self.disk.flush()  # (a write behind still reads a buffer: waited for by the pool too)
            self.bounce_buffers.trim()

    def flush(self) -> None:
        self.disk.flush()

    def close(self) -> None:
        self.disk.close()

    def disk_report(self) -> dict[str, int]:
        return self.disk.traffic.take()

    def use_timeline(self, timeline: Any) -> None:
        self.disk.timeline = timeline
