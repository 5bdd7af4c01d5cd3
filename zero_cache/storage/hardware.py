"""Tier budgets of a machine described rather than measured: planning for hardware this machine is not.

``pretrain.py --plan --gpus 8 --device-memory 80GiB --host-memory 1TiB --nvme 8TB`` plans a config for a
DGX-class host on a laptop. The budgets are what "auto" would measure on a freshly booted machine of that
size, with the same margins (:mod:`zero_cache.storage.tiers`, :mod:`zero_cache.storage.nvme`), so a plan made here is
the plan that machine would make before its warm-up, up to what else runs there (the OS and page cache take
host memory the margin may not cover; a GPU shared with another process has less free).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from zero_cache.config import ZeroCacheConfig
from zero_cache.plan.units import format_bytes
from zero_cache.storage import nvme, tiers


@dataclass(frozen=True, slots=True)
class Hardware:
    """One host of the machine to plan for."""

    device_bytes: int
    """Memory of one GPU (what ``nvidia-smi`` reports as total)."""
    host_bytes: int
    """RAM of one host."""
    gpus_per_host: int = 1
    """GPUs of one host (a rank each, unless fewer ranks are planned), which share its RAM and NVMe drive."""
    nvme_bytes: int = 0
    """Free space for swap files on the host's NVMe drive; 0 = no disk tier."""

    def __post_init__(self) -> None:
        if self.device_bytes <= 0 or self.host_bytes <= 0:
            raise ValueError(f"device and host memory must be > 0 bytes, got {self.device_bytes} and {self.host_bytes}")
        if self.gpus_per_host < 1:
            raise ValueError(f"gpus per host must be >= 1, got {self.gpus_per_host}")
        if self.nvme_bytes < 0:
            raise ValueError(f"NVMe space must be >= 0 bytes, got {self.nvme_bytes}")


@dataclass(frozen=True, slots=True)
class TierBudgets:
    """Bytes one rank may give each tier."""

    device_bytes: int
    host_bytes: int
    nvme_bytes: int = 0
    """0 = no disk tier."""
    nvme_directory: Path | None = None
    """The checked swap directory of a measured NVMe tier (None when planned from a :class:`Hardware`)."""


def tier_budgets(config: ZeroCacheConfig, device: torch.device, ranks_per_host: int = 1,
                 hardware: Hardware | None = None, *, moving_device_bytes: int = 0,
                 moving_host_bytes: int = 0) -> TierBudgets:
    """One rank's budgets: the config's where it gives bytes, else "auto": measured here, or from ``hardware``.
    The one place "auto" budgets are worked out (``attach``, ``dry_run``, ``pretrain.py --plan`` and the engine's
    check before building all ask it).

    With ``hardware`` the disk tier is the one it describes (the config's ``nvme_path`` is not touched);
    its RAM and NVMe space are split between the ``ranks_per_host`` ranks, as "auto" splits the host's RAM.

    Args:
        moving_device_bytes, moving_host_bytes: bytes of the parameters stored on the device / in host memory now
            that are about to move into the chunks. A budget measured now counts them as free: each one's storage
            is released as it is copied into its chunk or its home, and a model built in host memory
            (``zero.Init(remote_device="cpu")``) would otherwise shrink the host tier by its own size. (The host's
            only where the device is a GPU: on a CPU-only run both tiers are the same memory.)

    Raises:
        NvmeSetupError: measuring here, and nvme_path is missing or not writable.
    """
    if hardware is None:
        check_explicit_budgets(config, device, ranks_per_host)
        device_budget, host_budget = config.device_budget_bytes, config.host_budget_bytes
        if device_budget is None:
            device_budget = tiers.auto_device_budget(device, ranks_per_host) + moving_device_bytes
        if host_budget is None:
            host_budget = tiers.auto_host_budget(device, ranks_per_host) + (
                moving_host_bytes if device.type == "cuda" else 0)
        directory, disk = nvme.nvme_budget(config, ranks_per_host)
        if directory is not None and config.nvme_budget_bytes is not None:
            _check_disk_budget(config, directory, ranks_per_host)
        return TierBudgets(device_budget, host_budget, disk, directory)
    device_budget, host_budget = config.device_budget_bytes, config.host_budget_bytes
    if device_budget is None:  # a fresh GPU's free memory is its total, less the CUDA context the margin covers
        device_budget = tiers.device_share(hardware.device_bytes)
    if host_budget is None:
        host_budget = tiers.host_share(hardware.host_bytes, hardware.host_bytes, ranks_per_host)
    disk = 0
    if hardware.nvme_bytes:
        disk = config.nvme_budget_bytes
        if disk is None:
            disk = nvme.disk_share(hardware.nvme_bytes, ranks_per_host)
    return TierBudgets(device_budget, host_budget, disk)



def check_explicit_budgets(config: ZeroCacheConfig, device: torch.device, ranks_per_host: int = 1) -> None:
    """Refuse a budget in host RAM that this machine does not have, before a byte is pinned.

    The host budget (and, on a CPU-only run, the device budget: that tier is host RAM too) is per rank: times the
    ranks of a host it must fit the host's total RAM. A larger budget was trusted, and ``attach`` pinned memory
    until the OOM killer ended the run (200 GB on a 24 GiB machine). "auto" budgets never exceed the RAM.

    Raises:
        ValueError: the budget's key, its value, the machine's RAM and what to set instead.
    """
    memory = psutil.virtual_memory()
    keys = [("host_memory_budget", config.host_memory_budget, config.host_budget_bytes)]
    if device.type == "cpu":
        keys.append(("device_memory_budget", config.device_memory_budget, config.device_budget_bytes))
    for key, value, budget in keys:
        if budget is None or budget * ranks_per_host <= memory.total:
            continue
        ranks = f" x {ranks_per_host} ranks of this host = {format_bytes(budget * ranks_per_host)}" \
            if ranks_per_host > 1 else ""
        auto = format_bytes(tiers.auto_host_budget(device, ranks_per_host))
        raise ValueError(f"zero_cache.{key} {value!r} ({format_bytes(budget)} per rank{ranks}) is more than this "
                         f"machine's {format_bytes(memory.total)} of RAM ({format_bytes(memory.available)} available "
                         f"now): pinned pages beyond it end the run by the OOM killer. Set it to \"auto\" (the "
                         f"available RAM less a margin: {auto} per rank now) or below it, and give what does not "
                         "fit to the NVMe tier (zero_cache.nvme_path)")


def _check_disk_budget(config: ZeroCacheConfig, directory: Path, ranks_per_host: int) -> None:
    """An explicit NVMe budget beyond the disk's free space was planned with, and the swap file's reservation
    failed mid-setup with a message that blamed the planner; refuse it here, naming the one thing to change."""
    budget = config.nvme_budget_bytes
    free = shutil.disk_usage(directory).free
    if budget * ranks_per_host <= free:
        return
    ranks = f" x {ranks_per_host} ranks of this host" if ranks_per_host > 1 else ""
    auto = nvme.disk_share(free, ranks_per_host)
    remedy = (f"lower it to at most {format_bytes(auto)} per rank (what \"auto\" gives now), or point nvme_path at a "
              "disk with that much free" if auto else "point zero_cache.nvme_path at a disk with that much free (an "
              "\"auto\" budget here would be 0 B: it leaves at least 1 GiB of the disk free)")
    raise ValueError(f"zero_cache.nvme_memory_budget {config.nvme_memory_budget!r} ({format_bytes(budget)} per "
                     f"rank{ranks}) is more than the {format_bytes(free)} free on the disk under zero_cache.nvme_path "
                     f"({directory}): {remedy}")
