"""Host bytes per parameter (zero_cache.plan.host_memory): a plan's host bytes counted part by part, the warm-up's
placement capped at WARMUP_HOST_FACTOR of the first plan's host, and an engine whose host tier holds what the plans
count, at the warm-up and after the re-plan."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import random

import pytest
from reference import random_batches, train_steps
from test_zero_cache_streamed import CHUNK_NUMEL, config, state_bytes, tiny_gpt
from test_zero_cache_warmup_footprint import fitting_draws

import angelptm
from zero_cache.plan import host_memory
from zero_cache.plan.home_costs import DISK_BLOCK_BYTES, align_up
from zero_cache.plan.host_memory import WARMUP_HOST_FACTOR, describe_host, host_bytes, warmup_host_cap
from zero_cache.plan.planner import (
    DEVICE,
    HOST,
    NVME,
    PlanError,
    PlanInputs,
    device_steppable_groups,
    make_plan,
    with_device_step_count,
)
from zero_cache.resolve import activation_room_bytes, least_footprint_inputs, least_footprint_plan


def parts_by_hand(plan, inputs: PlanInputs) -> dict[str, int]:
    """Each part of a plan's host bytes, written out from its placement without the module's helpers."""
    numel = inputs.chunk_numel
    on_host, on_disk = plan.optimizer_tier.count(HOST), plan.optimizer_tier.count(NVME)
    shard = numel * inputs.param_bytes_per_element
    homes = plan.param_home.count(HOST) * shard
    if NVME in plan.param_home:  # 8 pinned buffers of a whole-block shard, each with a block of alignment slack
        homes += 8 * (-(-shard // 4096) * 4096 + 4096)
    host_adam = [c for c, tier in enumerate(plan.optimizer_tier) if tier in (HOST, NVME)]
    staged = host_adam and (inputs.grad_bytes_per_element or not plan.param_home or any(
        plan.param_home[c // inputs.group_size] == DEVICE for c in host_adam))
    slot = -(-numel * inputs.state_bytes_per_element // 4096) * 4096
    return {"scratch": numel * 4, "states": on_host * numel * 12,
            "accumulators": (on_host + on_disk) * numel * inputs.grad_bytes_per_element, "param_homes": homes,
            "staging": inputs.staging_buffers * shard if staged else 0,
            "bounce": inputs.swap_buffers * (slot + 4096) if on_disk else 0,
            "kept": len(plan.kept_gradients) * numel * inputs.kept_bytes_per_element}


def test_the_host_bytes_are_the_sum_of_their_parts_and_the_planners_count():
    """On random inputs (and a device-step count of their plan), the parts match those written out by hand, and their
    sum is what the planner counted as it filled the host."""
    rng = random.Random(random.randrange(10**6))
    checked = 0
    for inputs in fitting_draws(120):
        plan = make_plan(inputs)
        steppable = len(device_steppable_groups(inputs, plan))
        for candidate in [plan] + ([with_device_step_count(inputs, plan, rng.randint(0, steppable))]
                                   if steppable else []):
            parts = host_bytes(candidate, inputs)
            assert dataclasses.asdict(parts) == parts_by_hand(candidate, inputs)
            assert parts.total == candidate.host_bytes == sum(parts_by_hand(candidate, inputs).values())
            checked += parts.states > 0
    assert checked > 20, "too few draws put optimizer states on the host"


def test_the_parts_of_a_plan_with_every_home():
    """Shards at home on NVMe, groups on the host and on disk, kept gradients: every part is there, of its size."""
    inputs = PlanInputs(num_chunks=8, chunk_numel=3000, param_bytes_per_element=2, grad_bytes_per_element=4,
                        device_budget_bytes=50_000, host_budget_bytes=480_000, nvme_budget_bytes=10**7,
                        nvme_path_set=True, param_chunks_held=8, param_home=NVME, param_homes_off_device=(HOST, NVME),
                        live_groups=3, gather_ahead=1, gradient_buckets=1, trace=tuple(range(8)) * 2,
                        activation_reserve_bytes=0, kept_bytes_per_element=2)
    plan = make_plan(inputs)
    assert (plan.optimizer_tier.count(HOST), plan.optimizer_tier.count(NVME), len(plan.kept_gradients)) == (3, 5, 3)
    parts = host_bytes(plan, inputs)
    assert parts == host_memory.HostBytes(
        scratch=3000 * 4, states=3 * 3000 * 12, accumulators=8 * 3000 * 4,
        param_homes=8 * (align_up(3000 * 2) + DISK_BLOCK_BYTES), staging=4 * 3000 * 2,
        bounce=3 * (align_up(3000 * 12) + DISK_BLOCK_BYTES), kept=3 * 3000 * 2)
    assert parts.total == plan.host_bytes <= inputs.host_budget_bytes


def test_the_warmup_needs_at_most_the_cap_and_leaves_at_least_the_first_plans_room(monkeypatch):
    """On random inputs: the first plan's reserve fits the capped budgets (the warm-up leaves at least its room), the
    warm-up's host is within the cap (10% over the first plan's, or one optimizer group's bytes where that is more),
    the room is the most within it, and the cap binds: without it the warm-up would take more host in some draws."""
    draws, caps = fitting_draws(150), []
    for inputs in draws:
        first = make_plan(inputs)
        warm_inputs = least_footprint_inputs(inputs)
        cap = warmup_host_cap(first, inputs)
        caps.append(cap)
        assert warm_inputs.host_budget_bytes == cap
        assert first.host_bytes <= cap <= max(int(WARMUP_HOST_FACTOR * first.host_bytes),
                                              first.host_bytes + inputs.optimizer_chunk_bytes)
        make_plan(dataclasses.replace(warm_inputs, activation_reserve_bytes=inputs.activation_reserve_bytes))
        warmup = make_plan(warm_inputs)
        assert warmup.host_bytes <= cap
        room = activation_room_bytes(inputs, warmup)
        assert room >= activation_room_bytes(inputs, first) and room >= inputs.activation_reserve_bytes
        with pytest.raises(PlanError):  # the most within the cap: a byte more of reserve does not fit
            make_plan(dataclasses.replace(warm_inputs, activation_reserve_bytes=room + 1))
    monkeypatch.setattr(host_memory, "WARMUP_HOST_FACTOR", 10.0**6)  # (the warm-up as it was before the cap)
    bound = sum(least_footprint_plan(inputs).host_bytes > cap for inputs, cap in zip(draws, caps))
    assert bound > 5, "the cap never bound: the draws test nothing"


def test_with_resident_params_and_no_disk_a_larger_measured_peak_keeps_the_warmup_within_the_settled_host():
    """Where the measured activations are at least the guess, params resident and no disk tier: the settled plan
    holds at least the first plan's host, so the warm-up needs at most the cap of the settled plan's host."""
    rng = random.Random(random.randrange(10**6))
    compared = 0
    for inputs in fitting_draws(200):
        if inputs.param_chunks_held is not None or inputs.nvme_budget_bytes:
            continue
        first, warmup = make_plan(inputs), least_footprint_plan(inputs)
        measured = inputs.activation_reserve_bytes + rng.randint(0, inputs.device_budget_bytes // 3)
        try:
            settled = make_plan(dataclasses.replace(inputs, activation_reserve_bytes=measured))
        except PlanError:
            continue
        compared += 1
        assert settled.host_bytes >= first.host_bytes
        assert warmup.host_bytes <= warmup_host_cap(settled, inputs)
    assert compared > 10


def test_describe_host_gives_bytes_per_param():
    assert describe_host(63 * 2**30, 13 * 10**9) == "63.00 GiB (5.2 B/param)"
    assert describe_host(10 * 2**30, 2 * 10**9, 11 * 2**30) == ("10.00 GiB (5.4 B/param) in the plan, 11.00 GiB "
                                                                "(5.9 B/param) at the warm-up")


def host_used(optimizer) -> tuple[int, int]:
    tier = optimizer.store.tiers[HOST]
    return tier.used_bytes, tier.peak_bytes


@pytest.mark.parametrize("streams, accumulation", [(False, 1), (True, 1), (False, 2)])
def test_the_host_tier_holds_what_the_warmup_and_the_settled_plans_count(monkeypatch, caplog, streams, accumulation):
    """A tiny model, its warm-up at the least footprint (forced on CPU, as on a GPU with an "auto" reserve) under a
    device budget that holds a few optimizer groups: after the warm-up step the host tier's peak is the warm-up
    placement's host bytes (its staging buffers allocated with the first host update), within the cap of the first
    plan's; after the re-plan the tier holds the settled plan's bytes, and the logs give both per parameter."""
    seed = random.randrange(10_000)
    params = state_bytes(tiny_gpt(seed), 4)
    extra = 2 * CHUNK_NUMEL if streams else 4 * CHUNK_NUMEL * 4
    budget = int((params + CHUNK_NUMEL * 4 + 4 * extra) / 0.97) - streams
    cfg = config("auto", budget, prefetch_depth=1 if streams else 2, accumulation=accumulation)
    batches = random_batches(seed, count=3 * accumulation, batch=2)
    first_engine, first_optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=cfg)
    first = first_optimizer.plan  # (no warm-up at the least footprint on CPU: the first plan runs the warm-up)
    monkeypatch.setattr(importlib.import_module("zero_cache.attach"), "warms_up_at_least_footprint",
                        lambda config, device: True)
    with caplog.at_level(logging.INFO, logger="zero_cache"):
        engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=cfg)
        warmup = optimizer.plan
        assert warmup.host_bytes > first.host_bytes, "the warm-up moved nothing to the host: the test tests nothing"
        num_params = optimizer.store.layout.used_numel
        inputs_cap = max(int(WARMUP_HOST_FACTOR * first.host_bytes), first.host_bytes + CHUNK_NUMEL * (
            12 + (4 if accumulation > 1 else 0)))
        assert warmup.host_bytes <= inputs_cap
        used, _ = host_used(optimizer)
        assert used <= warmup.host_bytes  # (the staging pool is allocated at the first host update)
        train_steps(engine, batches[:accumulation])
        optimizer.finish_pending()
        settled = optimizer.plan
        used, peak = host_used(optimizer)
        assert peak == warmup.host_bytes, "the host tier's peak is the warm-up placement's host bytes"
        assert used == settled.host_bytes, "after the re-plan the host tier holds the settled plan's bytes"
        train_steps(engine, batches[accumulation:])
        optimizer.finish_pending()
        assert host_used(optimizer) == (settled.host_bytes, warmup.host_bytes)
    assert describe_host(first.host_bytes, num_params, warmup.host_bytes) in caplog.text
    assert describe_host(settled.host_bytes, num_params, warmup.host_bytes) in caplog.text
    train_steps(first_engine, batches[:accumulation])
    first_optimizer.finish_pending()
    assert host_used(first_optimizer)[0] == first_optimizer.plan.host_bytes
