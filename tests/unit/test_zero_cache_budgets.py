"""The one place "auto" tier budgets are worked out (zero_cache.storage.hardware.tier_budgets), on CPU."""

from __future__ import annotations

import random

import psutil
import pytest
import torch

from zero_cache import ZeroCacheConfig
from zero_cache.storage import tiers
from zero_cache.storage.hardware import Hardware, tier_budgets


@pytest.fixture
def measured(monkeypatch) -> dict[str, int]:
    """What "auto" measures now (fixed, random), whatever this machine has free."""
    free = {"device": random.randint(2**30, 2**36), "host": random.randint(2**30, 2**36)}
    monkeypatch.setattr(tiers, "auto_device_budget", lambda device, ranks=1: free["device"] // ranks)
    monkeypatch.setattr(tiers, "auto_host_budget", lambda device, ranks=1: free["host"] // ranks)
    return free


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_auto_budgets_count_the_parameters_about_to_move_as_free(measured, device_type):
    moving_device, moving_host = random.randint(1, 2**33), random.randint(1, 2**33)
    ranks = random.choice([1, 2, 8])
    budgets = tier_budgets(ZeroCacheConfig(enabled=True), torch.device(device_type), ranks,
                           moving_device_bytes=moving_device, moving_host_bytes=moving_host)
    assert budgets.device_bytes == measured["device"] // ranks + moving_device
    # On a CPU-only run the host tier is the same memory as the device tier: counted once.
    host_extra = moving_host if device_type == "cuda" else 0
    assert budgets.host_bytes == measured["host"] // ranks + host_extra
    assert budgets.nvme_bytes == 0 and budgets.nvme_directory is None


def test_budgets_the_config_gives_are_taken_as_they_are(measured):
    ram = psutil.virtual_memory().total  # a host budget beyond it is refused (issue 38)
    device, host = random.randint(2**20, 2**40), random.randint(2**20, ram)
    config = ZeroCacheConfig(enabled=True, device_memory_budget=device, host_memory_budget=host)
    budgets = tier_budgets(config, torch.device("cuda"), moving_device_bytes=12345, moving_host_bytes=678)
    assert (budgets.device_bytes, budgets.host_bytes) == (device, host)


def test_a_described_machine_ignores_what_this_one_has(measured):
    hardware = Hardware(device_bytes=80 * 2**30, host_bytes=1024 * 2**30, gpus_per_host=8)
    budgets = tier_budgets(ZeroCacheConfig(enabled=True), torch.device("cuda"), 8, hardware,
                           moving_device_bytes=2**30)
    assert budgets.device_bytes == tiers.device_share(80 * 2**30)
    assert budgets.host_bytes == tiers.host_share(1024 * 2**30, 1024 * 2**30, 8)
