"""The names of the memory tiers, and the interface every tier object shares (pure: no tensors).

Every module that says where a state lives spells it with these names: the planner's plan, the
chunk store's tier table, the param homes (:mod:`zero_cache.storage.param_homes.registry`), the optimizer-state homes
(:mod:`zero_cache.storage.state_homes.registry`) and the reports. Only those registries and the reports compare them
(``tests/unit/test_zero_cache_tier_branches.py``): the rest of the runtime asks a home. A name is a
``str`` (:class:`TierName` is a ``StrEnum``), so plans compare and serialise as plain strings.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol, runtime_checkable


class TierName(StrEnum):
    """Where a model state lives."""

    DEVICE = "device"
    """The compute device's memory (CUDA; the CPU in CPU-only runs)."""
    HOST = "host"
    """Pinned host memory."""
    NVME = "nvme"
    """Slots of a swap file on a local disk, read and written through pinned bounce buffers."""
    REMOTE = "remote"
    """Another data-parallel rank's (see ``zero_cache.base.sharding``): this rank holds none of it."""


DEVICE, HOST, NVME, REMOTE = TierName.DEVICE, TierName.HOST, TierName.NVME, TierName.REMOTE
OFF_DEVICE = (HOST, NVME)
"""Tiers whose optimizer groups the host worker updates (NVMe groups through bounce buffers): the plan's words; the
runtime asks a group's state home for its route instead (:mod:`zero_cache.plan.state_costs`)."""
MEMORY_TIERS = (DEVICE, HOST)
"""Tiers that hand out tensors (the NVMe tier hands out slots of its swap file)."""


@runtime_checkable
class BudgetedTier(Protocol):
    """What every tier object has, whatever it stores (``tiers.Tier``: tensors; ``nvme.NvmeTier``: file slots):
    its name and byte budget with usage counters, which the plan is checked against and the reports read."""

    name: str
    budget_bytes: int
    used_bytes: int
    peak_bytes: int

    @property
    def free_bytes(self) -> int:
        """Budget not in use."""
        ...
