"""The kinds of optimizer-state home by tier name: the one registry the store builds state homes from.

A chunk's optimizer group lives in a **state home** (:class:`~zero_cache.storage.state_homes.home.StateHome` and its
subclasses, :mod:`zero_cache.storage.state_homes.home`, :mod:`zero_cache.storage.state_homes.nvme`), each taking what
the planner knows of it from :mod:`zero_cache.plan.state_costs`. A new kind of state home is one class, one entry in
:data:`STATE_HOME_CLASSES` and one in :data:`~zero_cache.plan.state_costs.STATE_COSTS`; the store and the step ask the
home and never branch on a tier's name. (The param homes' registry is :mod:`zero_cache.storage.param_homes.registry`.)
"""

from __future__ import annotations

from typing import Any

import torch

from zero_cache.plan.tier_names import DEVICE, HOST, NVME, REMOTE
from zero_cache.storage.state_homes.home import DeviceStates, HostStates, RemoteStates, StateHome
from zero_cache.storage.state_homes.nvme import NvmeStates

STATE_HOME_CLASSES: dict[str, type[StateHome]] = {DEVICE: DeviceStates, HOST: HostStates, NVME: NvmeStates,
                                                  REMOTE: RemoteStates}
"""Tier name -> the runtime class of a state home there (the plan's ``optimizer_tier`` entries)."""


def state_homes(tiers: dict[str, Any], numel: int, accumulate: bool,
                dtype: torch.dtype = torch.float32) -> dict[str, StateHome]:
    """One state home of each registered kind that the store's ``tiers`` can hold, by tier name.

    Args:
        tiers: the store's tiers by name.
        numel: elements of one chunk.
        accumulate: groups carry a gradient accumulator.
        dtype: the states' dtype (fp32, or bf16).
    """
    return {name: cls(tiers, numel, accumulate, dtype) for name, cls in STATE_HOME_CLASSES.items()
            if cls.present(tiers)}
