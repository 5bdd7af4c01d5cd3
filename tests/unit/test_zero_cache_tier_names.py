"""Tier names are one enum of plain strings, and every tier object has the shared budget interface."""

from __future__ import annotations

import json
import pickle

import torch

from zero_cache.config import PARAM_HOMES, AioConfig
from zero_cache.plan.planner import PlanInputs, make_plan
from zero_cache.plan.tier_names import DEVICE, HOST, NVME, BudgetedTier, TierName
from zero_cache.storage.nvme import NvmeTier
from zero_cache.storage.tiers import Tier


def test_every_tier_object_has_the_budget_interface(tmp_path):
    device = Tier(DEVICE, torch.device("cpu"), 1 << 20)
    disk = NvmeTier(tmp_path, slot_bytes=4096, budget_bytes=1 << 20, aio=AioConfig(backend="threads"))
    try:
        for tier in (device, disk):
            assert isinstance(tier, BudgetedTier)
            assert tier.free_bytes == tier.budget_bytes - tier.used_bytes == 1 << 20
        device.allocate(1024, torch.float32)
        disk.allocate_slot()
        assert (device.used_bytes, disk.used_bytes) == (4096, 4096) and device.free_bytes == disk.free_bytes
    finally:
        disk.close()


def test_tier_names_are_plain_strings_in_plans_configs_and_messages():
    assert [str(name) for name in TierName] == ["device", "host", "nvme", "remote"]
    assert PARAM_HOMES == ("auto", "device", "host", "nvme")  # what a config may say, spelled as it says it
    plan = make_plan(PlanInputs(num_chunks=2, chunk_numel=1000, param_bytes_per_element=2, device_budget_bytes=20_000,
                                host_budget_bytes=10**6, margin_fraction=0.0, grad_bytes_per_element=0))
    assert plan.optimizer_tier == (DEVICE, HOST) and plan.optimizer_tier == ("device", "host")
    assert json.loads(json.dumps(plan.optimizer_tier)) == ["device", "host"]  # (reports write them as JSON)
    assert pickle.loads(pickle.dumps(plan)) == plan  # (ranks exchange plans as objects)
    assert f"{NVME} tier" == "nvme tier"
