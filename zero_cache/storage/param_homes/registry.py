"""The kinds of param home by tier name: the one registry the runtime builds homes from.

A chunk's **home** is where its params live between uses (the device, pinned host memory, NVMe): one class per
kind, :class:`~zero_cache.storage.param_homes.home.ParamHome` and its subclasses
(:mod:`zero_cache.storage.param_homes.home`, :mod:`zero_cache.storage.param_homes.nvme`), each taking what it costs
from :mod:`zero_cache.plan.home_costs`, which is all the planner knows of it. A new kind of home is one class, one
entry in :data:`HOME_CLASSES` and one in :data:`~zero_cache.plan.home_costs.HOME_COSTS`; the runtime asks the home and
never branches on a tier's name.
"""

from __future__ import annotations

from zero_cache.plan.tier_names import DEVICE, HOST, NVME
from zero_cache.storage.param_homes.home import (  # noqa: F401  (re-exported)
    DeviceHome,
    HostHome,
    ParamHome,
    copy_in_and_gather,
)
from zero_cache.storage.param_homes.nvme import NvmeHome

HOME_CLASSES: dict[str, type[ParamHome]] = {DEVICE: DeviceHome, HOST: HostHome, NVME: NvmeHome}
"""Tier name -> the runtime class of a home there (the plan's ``param_home`` entries)."""


def home_class(name: str) -> type[ParamHome]:
    """The home class of a tier name (the plan's ``param_home`` entries)."""
    return HOME_CLASSES[name]
