"""What an optimizer-state home is to the planner: its update route and what it costs (pure: no tensors).

A chunk's optimizer group (fp32 master, exp_avg, exp_avg_sq, and an fp32 gradient accumulator when micro-batches
accumulate) lives in a **state home**: the device, pinned host memory, a slot of the NVMe swap file, or another
rank. The runtime classes (:mod:`zero_cache.storage.state_homes.registry`) take their answers from :data:`STATE_COSTS`
here, as the param homes take theirs from :mod:`zero_cache.plan.home_costs`, so the plan prices what the runtime does
and the planner never imports a runtime module (``tests/unit/test_layering.py`` imports it with torch hidden).

Where the planner puts a rank's groups is data too (:data:`STATE_FILL_ORDER`): as many on the device as fit, then
the host, the rest on the last home of the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from zero_cache.plan.tier_names import DEVICE, HOST, NVME, REMOTE, TierName


class Route(StrEnum):
    """Which Adam updates a group: what the step asks a state home instead of its tier's name."""

    DEVICE_ADAM = "device Adam"
    """The device's fused Adam on the compute stream, over states in device memory."""
    HOST_ADAM = "host Adam"
    """The host worker's CPU Adam (:mod:`zero_cache.optim.host_update`): the states are fetched for it and written
    back."""
    NONE = "none"
    """Another data-parallel rank updates it (this rank holds none of it)."""


UPDATED_HERE: tuple[Route, ...] = (Route.DEVICE_ADAM, Route.HOST_ADAM)
"""The routes of the groups this rank updates (every one but another rank's)."""

STAGING_BUFFERS = 4
"""Pinned chunk-sized buffers of the host's Adam (:mod:`zero_cache.optim.host_update`): one being fetched ahead, one
under CPU Adam, the rest in H2D flight."""
SWAP_BUFFERS = 3
"""Pinned bounce buffers of the NVMe state home (:mod:`zero_cache.storage.state_homes.nvme`): one being read (chunk
i+1), one under CPU Adam (chunk i), one being written (chunk i-1)."""


def planned_staging_buffers(accumulation_steps: int) -> int:
    """The host's staging buffers the plan counts (``PlanInputs.staging_buffers``): accumulating micro-batches, a
    second pool of :data:`STAGING_BUFFERS` stages their gradients (``HostUpdater.gradient_pool``)."""
    return STAGING_BUFFERS * (2 if accumulation_steps > 1 else 1)


@dataclass(frozen=True, slots=True)
class StateCosts:
    """A kind of optimizer-state home as the planner sees it; the defaults are a host-Adam home in host memory."""

    name: TierName
    """The tier it is named after (the plan's ``optimizer_tier`` entries)."""
    route: Route = Route.HOST_ADAM
    """Which Adam updates its groups."""
    resident: bool = True
    """The states stay addressable in memory between updates (``OptimizerGroup.states``): a lazy update's moments
    can be folded in later (:mod:`zero_cache.optim.revision`), and a device step can copy them in."""
    device_steppable: bool = False
    """A group here may be stepped on the device after backward instead of by the host's Adam
    (:mod:`zero_cache.optim.device_steps`)."""

    @property
    def owned(self) -> bool:
        """This rank holds and updates the group."""
        return self.route is not Route.NONE

    def disk_bytes_per_step(self, groups: int, slot_bytes: int) -> int:
        """Disk bytes one step moves for ``groups`` groups here, each a swap slot of ``slot_bytes``."""
        return 0


@dataclass(frozen=True, slots=True)
class NvmeStateCosts(StateCosts):
    """States in a slot of the swap file: each step reads them into a bounce buffer and writes them back."""

    name: TierName = NVME
    resident: bool = False

    def disk_bytes_per_step(self, groups: int, slot_bytes: int) -> int:
        return 2 * groups * slot_bytes


STATE_COSTS: dict[str, StateCosts] = {costs.name: costs for costs in (
    StateCosts(name=DEVICE, route=Route.DEVICE_ADAM), StateCosts(name=HOST, device_steppable=True), NvmeStateCosts(),
    StateCosts(name=REMOTE, route=Route.NONE, resident=False))}
"""The kinds of optimizer-state home by tier name: how each is updated and what it costs."""

STATE_FILL_ORDER: tuple[TierName, ...] = (DEVICE, HOST, NVME)
"""The homes a rank's optimizer groups fill, in order: the first takes as many as the device has room for (those the
next forward needs first), the next those the host has room for, the last the rest (those used last in the forward,
whose updates start first in backward)."""


def state_costs(name: str) -> StateCosts:
    """What a state home of tier ``name`` is to the planner (the plan's ``optimizer_tier`` entries)."""
    return STATE_COSTS[name]
