"""Tier budgets of a machine described rather than measured: planning for hardware this machine is not.

``pretrain.py --plan --gpus 8 --device-memory 80GiB --host-memory 1TiB --nvme 8TB`` plans a config for a
DGX-class host on a laptop. The budgets are what "auto" would measure on a freshly booted machine of that
size, with the same margins (:mod:`zero_cache.tiers`, :mod:`zero_cache.nvme`), so a plan made here is the
plan that machine would make before its warm-up, up to what else runs there (the OS and page cache take
host memory the margin may not cover; a GPU shared with another process has less free).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zero_cache import nvme, tiers
from zero_cache.config import ZeroCacheConfig


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
        device_budget, host_budget = config.device_budget_bytes, config.host_budget_bytes
        if device_budget is None:
            device_budget = tiers.auto_device_budget(device, ranks_per_host) + moving_device_bytes
        if host_budget is None:
            host_budget = tiers.auto_host_budget(device, ranks_per_host) + (
                moving_host_bytes if device.type == "cuda" else 0)
        directory, disk = nvme.nvme_budget(config, ranks_per_host)
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

