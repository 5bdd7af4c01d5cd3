"""Whether to shard params: one decision from every rank's plans, and a clear error naming a rank that does not fit."""

from __future__ import annotations

import random

import pytest

from zero_cache import Sharding, ZeroCacheConfig
from zero_cache.planner import DEVICE, HOST, REMOTE, Plan, PlanError
from zero_cache.shard_params import choose_shard_params, decide_shard_params


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


def test_replicated_params_that_would_stream_from_the_host_count_as_not_fitting():
    config = ZeroCacheConfig(enabled=True, shard_params=False)
    with pytest.raises(PlanError, match="streaming them from the host is not implemented"):
        choose_shard_params(config, Sharding(rank=0, world_size=2), lambda shard: plan(0, resident=False),
                            lambda mine: [mine, mine])


def test_one_rank_never_shards():
    config = ZeroCacheConfig(enabled=True, shard_params=True)
    choice, _ = choose_shard_params(config, Sharding(), lambda shard: plan(2), lambda mine: [mine])
    assert choice is False
