"""Whether to shard params: one decision from every rank's plans, and a clear error naming a rank that does not fit."""

from __future__ import annotations

import random

import pytest
import torch

from zero_cache import Sharding, ZeroCacheConfig, dry_run
from zero_cache.plan.planner import DEVICE, HOST, REMOTE, Plan, PlanError
from zero_cache.runtime.shard_params import choose_shard_params, decide_shard_params


def plan(device_groups: int, resident: bool = True) -> Plan:
    tiers = (DEVICE,) * device_groups + (HOST, REMOTE)
    return Plan(params_resident=resident, cache_slots=0, optimizer_tier=tiers, device_bytes=1, host_bytes=1)


def reference(setting, outcomes):
    fits = {shard: all(shard in o for o in outcomes) for shard in (False, True)}
    if setting in (True, False):
        return setting if fits[setting] else None
    if fits[True] and fits[False]:
        return sum(o[True] for o in outcomes) > sum(o[False] for o in outcomes)
    return True if fits[True] else (False if fits[False] else None)


def test_decision_matches_the_rule_on_random_outcomes():
    rng = random.Random(random.randrange(10**6))
    for _ in range(500):
        outcomes = []
        for _ in range(rng.randint(2, 8)):
            outcome = {}
            for shard in (False, True):
                if rng.random() < 0.85:
                    outcome[shard] = rng.randint(0, 20)
            outcomes.append(outcome)
        setting = rng.choice(["auto", True, False])
        assert decide_shard_params(setting, outcomes) == reference(setting, outcomes)


def test_auto_shards_only_for_more_device_groups_and_keeps_replicated_on_a_tie():
    assert decide_shard_params("auto", [{False: 3, True: 5}, {False: 3, True: 4}]) is True
    assert decide_shard_params("auto", [{False: 4, True: 4}, {False: 4, True: 4}]) is False
    assert decide_shard_params("auto", [{True: 1}, {False: 9, True: 1}]) is True  # replicated misses on rank 0


def test_every_rank_makes_the_same_choice_when_one_rank_cannot_replicate():
    """Rank 1 (fewer budget bytes) fits only sharded: rank 0, which fits both, must shard too."""
    config = ZeroCacheConfig(enabled=True)
    sharding = Sharding(rank=0, world_size=2)
    others = {1: {True: 2}}
    choice, chosen = choose_shard_params(config, sharding, lambda shard: plan(6 if shard else 5),
                                         lambda mine: [mine, others[1]])
    assert choice is True and chosen.optimizer_tier.count(DEVICE) == 6


def test_a_rank_that_fits_names_the_rank_that_does_not():
    config = ZeroCacheConfig(enabled=True, shard_params=True)
    sharding = Sharding(rank=0, world_size=4)
    outcomes = [{True: 3}, {True: 3}, {}, {True: 3}]
    with pytest.raises(PlanError, match=r"rank\(s\) \[2\]"):
        choose_shard_params(config, sharding, lambda shard: plan(3), lambda mine: outcomes)


def test_the_rank_that_does_not_fit_raises_its_own_shortfall():
    config = ZeroCacheConfig(enabled=True)

    def plan_for(shard: bool) -> Plan:
        raise PlanError(f"short by 3 GiB ({'sharded' if shard else 'replicated'})")

    with pytest.raises(PlanError, match=r"short by 3 GiB \(sharded\)"):
        choose_shard_params(config, Sharding(rank=1, world_size=2), plan_for, lambda mine: [{True: 1}, mine])


def test_one_rank_never_shards():
    config = ZeroCacheConfig(enabled=True, shard_params=True)
    choice, _ = choose_shard_params(config, Sharding(), lambda shard: plan(2), lambda mine: [mine])
    assert choice is False


def dry_run_plan(device_bytes: int, world_size: int, shard_params="auto", param_home="auto") -> Plan:
    """96 tensors of 4096 fp32 elements in chunks of 8192 (48 chunks of 32 KiB), planned for every rank."""
    shapes = [(f"w{i}", (64, 64)) for i in range(96)]
    config = ZeroCacheConfig(enabled=True, chunk_size=8192, device_memory_budget=device_bytes,
                             host_memory_budget=2**30, shard_params=shard_params, max_live_elements=0,
                             gather_ahead_elements=0, param_home=param_home)
    return dry_run(shapes, config, compute_dtype=torch.float32, device=torch.device("cpu"),
                   world_size=world_size).plan


def test_dry_run_shards_params_when_only_that_fits_on_every_rank():
    """Replicated, a rank holds all 48 param chunks; sharded over 2, its 24 shards and 3 gathered groups and
    3 gradient buckets of 2 chunks each: 36 chunks (and one fp32 scratch chunk)."""
    chunk = 8192 * 4
    assert dry_run_plan(64 * 2**20, 2).params_sharded is False  # both fit with every group on the device
    plan = dry_run_plan(40 * chunk, 2, param_home="device")
    assert plan.params_sharded and plan.optimizer_tier.count(DEVICE) == 0 and set(plan.param_home) == {DEVICE}
    with pytest.raises(PlanError, match="rank 0 of 2: .*24 param shards"):
        dry_run_plan(30 * chunk, 2, param_home="device")
    with pytest.raises(PlanError, match="rank 0 of 2: .*holds every param chunk .*shard_params"):
        dry_run_plan(40 * chunk, 2, shard_params=False)


def test_dry_run_streams_shards_from_the_host_where_the_device_cannot_hold_them():
    """30 chunks cannot hold the 24 shards besides the gathered groups and buckets: some stay home on the host,
    and the step's traffic counts their fetches."""
    chunk = 8192 * 4
    plan = dry_run_plan(30 * chunk, 2)
    assert plan.params_sharded and HOST in plan.param_home
    streamed = plan.param_home.count(HOST)
    assert plan.traffic.h2d_bytes >= 2 * streamed * chunk  # fetched in forward and again in backward
