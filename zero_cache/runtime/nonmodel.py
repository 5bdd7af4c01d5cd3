"""The warm-up's measure of non-model device memory: the model's activations, logits, autograd temporaries and
the allocator's slack, without the engine's own buffers.

The plan already counts what the engine keeps on the device (param chunks, optimizer groups, gathered groups,
gradient buckets, the device-step scratch): all of it comes from the device tier. What the plan must learn from
the warm-up is the rest. It used to be read as the allocator's peak less the tier's peak, plus what the allocator
held unallocated at its peak, and two things made that wrong on the whole GPU (issue 37; 13.1B on the H200 measured
30.5 GB where the model needs 9.3 GB, and the re-plan left 20-30 GB idle):

* the user's model, built on the device before attach, is copied into chunks and freed; the caching allocator
  keeps its blocks, so at the warm-up's peak it held the model's bytes reserved and unallocated, and they were
  taken for fragmentation. Those blocks are released before measuring (:meth:`NonModelMeter.start`);
* the tier's usage moves within a step (streamed groups, buckets), so its peak and the allocator's may come at
  different moments, and their difference is then no measure of either.

So the meter samples: at each hook of the warm-up step it reads the allocator's peak since the previous sample
(and starts a new interval) and the least the tier held over the same interval. Within an interval the
non-model memory is at most ``peak allocated - least tier``: an upper bound, never below the truth (no OOM
where the plan said it fits), and above it by at most the tier's churn inside one interval. The peak over the
intervals is the measure; the allocator's slack (reserved but unallocated at its peak) is added as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class AllocatorStats(Protocol):
    """What the meter reads of a device's caching allocator (CUDA's, or a fake one in tests)."""

    def release_cached(self) -> None:
        """Return blocks held but unallocated to the device (``torch.cuda.empty_cache``)."""

    def peak_allocated_bytes(self) -> int:
        """Most bytes allocated since the last :meth:`reset_peaks`."""

    def peak_reserved_bytes(self) -> int:
        """Most bytes reserved since the last :meth:`reset_peaks`."""

    def reset_peaks(self) -> None:
        """Start the peaks again from the current usage."""


@dataclass(frozen=True, slots=True)
class CudaAllocatorStats:
    """:class:`AllocatorStats` of one CUDA device."""

    device: torch.device

    def release_cached(self) -> None:
        torch.cuda.empty_cache()

    def peak_allocated_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peaks(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class TierUsage(Protocol):
    """What the meter reads of the device tier (:class:`~zero_cache.storage.tiers.Tier`)."""

    def take_interval_low(self) -> int:
        """The least bytes held since the last call (at least the usage then), starting a new interval."""


class NonModelMeter:
    """Samples the warm-up step's non-model device memory (see the module docstring).

    Args:
        tier: the device tier (the engine's own bytes).
        stats: the device's allocator.
    """

    def __init__(self, tier: TierUsage, stats: AllocatorStats) -> None:
        self.tier, self.stats = tier, stats
        self.nonmodel_bytes = 0
        """The largest ``peak allocated - least tier`` over the intervals sampled so far."""
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        """The allocator's peaks over the intervals so far (their difference is its slack)."""
        self.samples = 0

    def start(self) -> None:
        """Begin measuring: the blocks the allocator caches now (the model as it was before its params moved into
        chunks) go back to the device, and the first interval starts."""
        self.stats.release_cached()
        self.stats.reset_peaks()
        self.tier.take_interval_low()

    def sample(self) -> None:
        """End the current interval (fold its peak in) and start the next."""
        allocated, reserved = self.stats.peak_allocated_bytes(), self.stats.peak_reserved_bytes()
        self.nonmodel_bytes = max(self.nonmodel_bytes, allocated - self.tier.take_interval_low())
        self.allocated_bytes = max(self.allocated_bytes, allocated)
        self.reserved_bytes = max(self.reserved_bytes, reserved)
        self.stats.reset_peaks()
        self.samples += 1

    @property
    def slack_bytes(self) -> int:
        """What the allocator held without handing it out at its peak: room the plan cannot count on either."""
        return max(0, self.reserved_bytes - self.allocated_bytes)

    def peak_bytes(self) -> int:
        """The non-model peak the re-plan leaves room for: the sampled peak and the allocator's slack."""
        return max(0, self.nonmodel_bytes) + self.slack_bytes
