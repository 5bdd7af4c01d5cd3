"""Issue 38, "late or misleading": each ZeRO-Cache shortfall names the one thing to change.

* a host tier short of room for the NVMe tier's bounce/staging buffers was told to "give the NVMe tier room ... its
  disk is too small", though no disk can hold those buffers;
* an explicit NVMe budget larger than the disk was planned with, then failed at the swap file's reservation with a
  message saying both to lower and to raise the budget, and to report a planner bug.
"""

from __future__ import annotations

import collections

import pytest
import torch

import zero_cache
from zero_cache.config import ZeroCacheConfig
from zero_cache.storage import nvme

SHAPES = [(f"w{i}", (512, 512)) for i in range(32)]  # 8 M elements: 128 MiB of fp32 model states
MiB, GiB = 2**20, 2**30


def disk_with_free(monkeypatch, free_bytes: int) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda path: usage(free_bytes, 0, free_bytes))


def plan(tmp_path, **budgets):
    config = ZeroCacheConfig(enabled=True, device_memory_budget="64MiB", nvme_path=str(tmp_path), **budgets)
    return zero_cache.dry_run(SHAPES, config, compute_dtype=torch.float32, device=torch.device("cuda"))


def test_a_host_short_of_the_nvme_buffers_is_told_only_to_raise_the_host_budget(tmp_path, monkeypatch):
    disk_with_free(monkeypatch, 100 * GiB)
    with pytest.raises(zero_cache.PlanError) as refused:
        plan(tmp_path, host_memory_budget="1MiB")
    message = str(refused.value)
    assert "the host tier needs" in message and "bounce buffers" in message
    assert "only host memory can hold them" in message
    assert message.endswith(f"Raise zero_cache.host_memory_budget to at least {message.split('at least ')[-1]}")
    assert "disk is too small" not in message and "NVMe tier room" not in message and "micro-batch" not in message


def test_an_explicit_nvme_budget_above_the_disks_free_space_is_refused_before_planning(tmp_path, monkeypatch):
    disk_with_free(monkeypatch, 20 * GiB)
    with pytest.raises(ValueError) as refused:
        plan(tmp_path, host_memory_budget="32MiB", nvme_memory_budget="100GB")
    message = str(refused.value)
    assert "zero_cache.nvme_memory_budget '100GB'" in message and "20.00 GiB free" in message
    assert "lower it to at most 19.00 GiB" in message
    assert "raise" not in message.lower() and "bug" not in message


def test_an_explicit_nvme_budget_on_a_tiny_disk_names_the_disk(tmp_path, monkeypatch):
    disk_with_free(monkeypatch, 20 * MiB)
    with pytest.raises(ValueError) as refused:
        plan(tmp_path, host_memory_budget="32MiB", nvme_memory_budget="100GB")
    message = str(refused.value)
    assert "zero_cache.nvme_memory_budget '100GB'" in message and "20.00 MiB free" in message
    assert "point zero_cache.nvme_path at a disk" in message and "lower it" not in message


def test_an_explicit_nvme_budget_within_the_disk_still_plans(tmp_path, monkeypatch):
    disk_with_free(monkeypatch, 20 * GiB)
    run = plan(tmp_path, host_memory_budget="32MiB", nvme_memory_budget="1GiB")
    assert run.plan.nvme_bytes > 0
