"""The warm-up step at the plan's least device footprint (zero_cache.resolve.least_footprint_plan), and an engine
whose first step runs under it: only placement changes, so training is the normal first plan's."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import random

import pytest
import torch
from reference import random_batches, train_steps
from test_zero_cache_streamed import CHUNK_NUMEL, assert_trained_alike, config, state_bytes, tiny_gpt

import angelptm
import zero_cache
from zero_cache.config import ZeroCacheConfig
from zero_cache.plan import host_memory
from zero_cache.plan.host_memory import WARMUP_HOST_FACTOR, warmup_host_cap
from zero_cache.plan.planner import DEVICE, DEVICE_MARGIN_FRACTION, HOST, NVME, PlanError, PlanInputs, make_plan
from zero_cache.resolve import activation_room_bytes, least_footprint_plan


def random_plan_inputs(rng: random.Random) -> PlanInputs:
    """One rank or a data-parallel rank's share, params resident or gathered (any home), host tight or ample,
    with an NVMe tier now and then, a device from the least that could work to roomy, and a guessed reserve."""
    chunks = rng.randint(4, 24)
    numel = rng.choice([1 << 12, 3 << 11, 1 << 14])
    group_size = rng.choice([1, 1, 2, 4])
    padded = -(-chunks // group_size) * group_size
    gathered = rng.random() < 0.7
    held = padded // group_size if gathered else None
    param_bytes = rng.choice([2, 4])
    grad_bytes = rng.choice([0, 4])
    owned = tuple(c for c in range(chunks) if c % group_size == rng.randrange(group_size)) or (0,)
    optimizer_chunk = numel * (12 + grad_bytes)
    model_bytes = padded * numel * param_bytes
    trace = tuple(rng.sample(range(chunks), chunks))
    return PlanInputs(num_chunks=chunks, chunk_numel=numel, param_bytes_per_element=param_bytes,
                      grad_bytes_per_element=grad_bytes, trace=trace + trace[::-1],
                      device_budget_bytes=rng.randint(model_bytes // 4, 2 * model_bytes + len(owned) * optimizer_chunk),
                      host_budget_bytes=rng.choice([rng.randint(1, 3) * len(owned) * optimizer_chunk,
                                                    10 * (model_bytes + chunks * optimizer_chunk)]),
                      nvme_budget_bytes=rng.choice([0, 0, 10 * chunks * optimizer_chunk]),
                      owned=owned if group_size > 1 else None, padding_chunks=padded - chunks,
                      group_size=group_size, param_chunks_held=held,
                      param_home=rng.choice(["auto", "auto", "host", "device"]) if gathered else DEVICE,
                      live_groups=rng.randint(0, 6) if gathered else 0, gather_ahead=rng.randint(1, 3),
                      gradient_buckets=3 if gathered or grad_bytes else 0,
                      kept_bytes_per_element=rng.choice([0, param_bytes]), device_steps=rng.choice([0, None]),
                      activation_reserve_bytes=0)


def fitting_draws(count: int) -> list[PlanInputs]:
    """``count`` random inputs whose first plan, made with a guessed reserve, fits (as attach's must)."""
    rng = random.Random(random.randrange(10**9))
    found = []
    while len(found) < count:
        inputs = random_plan_inputs(rng)
        reserve = int(rng.uniform(0, 0.5) * inputs.device_budget_bytes)
        inputs = dataclasses.replace(inputs, activation_reserve_bytes=reserve)
        try:
            make_plan(inputs)
        except PlanError:
            continue
        found.append(inputs)
    return found


def test_the_warmup_placement_fits_leaves_the_most_room_and_keeps_the_mode():
    for inputs in fitting_draws(150):
        guess = make_plan(inputs)
        warmup = least_footprint_plan(inputs)
        room = activation_room_bytes(inputs, warmup)
        assert warmup.device_bytes + room <= inputs.device_budget_bytes
        assert warmup.host_bytes <= inputs.host_budget_bytes and warmup.nvme_bytes <= inputs.nvme_budget_bytes
        assert room >= activation_room_bytes(inputs, guess) and room >= inputs.activation_reserve_bytes
        assert (warmup.params_sharded, warmup.group_size) == (guess.params_sharded, guess.group_size)
        assert warmup.optimizer_tier.count("remote") == guess.optimizer_tier.count("remote")
        if inputs.param_home in (DEVICE, HOST):  # a named home is every shard's, at the warm-up too
            assert warmup.param_home == guess.param_home
        # No more on the disk than the first plan: what the device gives up goes to the host.
        assert warmup.nvme_bytes <= guess.nvme_bytes
        assert warmup.optimizer_tier.count(NVME) <= guess.optimizer_tier.count(NVME)
        # Maximal: the room it leaves is exactly the largest reserve the planner still fits (within that disk and
        # the warm-up's host cap).
        within = dataclasses.replace(inputs, nvme_budget_bytes=guess.nvme_bytes,
                                     host_budget_bytes=warmup_host_cap(guess, inputs))
        assert make_plan(dataclasses.replace(within, activation_reserve_bytes=room)).device_bytes == warmup.device_bytes
        with pytest.raises(PlanError):
            make_plan(dataclasses.replace(within, activation_reserve_bytes=room + 1))


def test_with_an_ample_host_nothing_movable_stays_on_the_device(monkeypatch):
    """Where the host takes everything (and the warm-up's host cap is raised out of the way: it is the only thing
    that keeps groups on the device then), the warm-up keeps no optimizer group on the device, and with gathered
    params on one rank only the fewest live groups and buckets (shards stream where that is smaller)."""
    monkeypatch.setattr(host_memory, "WARMUP_HOST_FACTOR", 10.0**6)
    for inputs in fitting_draws(150):
        inputs = dataclasses.replace(inputs, host_budget_bytes=10**12)
        warmup = least_footprint_plan(inputs)
        assert DEVICE not in warmup.optimizer_tier
        if warmup.params_sharded and inputs.param_home == "auto" and inputs.group_size == 1:
            all_home = inputs.num_chunks * inputs.param_chunk_bytes
            streamed = (warmup.cache_slots * inputs.live_group_bytes
                        + warmup.param_home.count(DEVICE) * inputs.param_chunk_bytes)
            assert streamed <= all_home
            assert warmup.gradient_buckets <= 2 and warmup.gather_ahead == 1


def test_a_plan_that_does_not_fit_is_refused_as_make_plan_refuses_it():
    inputs = PlanInputs(num_chunks=4, chunk_numel=1000, param_bytes_per_element=2, device_budget_bytes=5_000,
                        host_budget_bytes=10**6)
    with pytest.raises(PlanError, match="every param chunk"):
        least_footprint_plan(inputs)


def on_device(optimizer) -> int:
    return [group.tier for group in optimizer.store.groups].count(DEVICE)


@pytest.mark.parametrize("extra_elements, streams, tight_host", [(4 * CHUNK_NUMEL * 4, False, False),
                                                                 (2 * CHUNK_NUMEL, True, False),
                                                                 (4 * CHUNK_NUMEL * 4, False, True)])
def test_the_first_step_runs_at_the_least_footprint_and_trains_as_the_normal_first_plan(
        monkeypatch, caplog, tmp_path, extra_elements, streams, tight_host):
    """On a GPU with activation_memory "auto" (forced here on CPU), the warm-up step moves off the device the
    optimizer groups its host cap allows (zero_cache.plan.host_memory.warmup_host_cap); the re-plan after it places
    what the normal first run places, and training is the same: losses and fp32 masters within 1e-6. With params
    streamed (a device just short of them all), the warm-up streams every shard, and the re-plan brings some home.
    With a host too small for every group and an NVMe tier the first plan does not use, the warm-up keeps the rest
    on the device, not on the disk."""
    seed = torch.randint(0, 10_000, ()).item()
    start = {n: p.detach().clone() for n, p in tiny_gpt(seed).named_parameters()}
    params = state_bytes(tiny_gpt(seed), 4)
    # fp32 params and the fp32 update scratch, then room for optimizer groups (resident: 4 of 12 B/element and
    # change) or, 1 B short of holding them all, shards at home on the device and a group of their own (streamed)
    budget = int((params + CHUNK_NUMEL * 4 + 4 * extra_elements) / 0.97) - streams
    # (tight: 90% of the optimizer states, no room for kept gradients: those host chunks update after backward,
    # whose clipping sums the norm in another order, so the run is unclipped to compare within 1e-6)
    tight = dict(host_memory_budget=params * 3 * 9 // 10, nvme_path=str(tmp_path), clip=0.0) if tight_host else {}
    cfg = config("auto", budget, prefetch_depth=1 if streams else 2, **tight)
    batches = random_batches(seed, count=4, batch=2)
    reference, reference_optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=cfg)
    expected = train_steps(reference, batches)
    reference_optimizer.finish_pending()

    monkeypatch.setattr(importlib.import_module("zero_cache.attach"), "warms_up_at_least_footprint",
                        lambda config, device: True)
    with caplog.at_level(logging.INFO, logger="zero_cache"):
        engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=cfg)
    assert "the first step runs at the plan's least device footprint" in caplog.text
    assert optimizer.store.shard_params == reference_optimizer.store.shard_params == streams
    if tight_host:  # the host holds what it can, the disk nothing (the first plan put nothing there)
        assert 0 < on_device(optimizer) < on_device(reference_optimizer)
        assert NVME not in [group.tier for group in optimizer.store.groups + reference_optimizer.store.groups]
    else:
        assert on_device(optimizer) < on_device(reference_optimizer), "the warm-up moves groups off the device"
        first_host = reference_optimizer.plan.host_bytes  # (fp32 states, no accumulators: 12 B/element a group)
        assert optimizer.plan.host_bytes <= max(int(WARMUP_HOST_FACTOR * first_host), first_host + CHUNK_NUMEL * 12)
    if streams:
        assert DEVICE not in optimizer.store.param_home, "the warm-up streams every shard"
    losses = train_steps(engine, batches[:1])
    assert optimizer.store.plan == reference_optimizer.store.plan, "the re-plan places as the normal run's"
    assert on_device(optimizer) == on_device(reference_optimizer) > 0
    if streams:
        assert DEVICE in optimizer.store.param_home
    losses += train_steps(engine, batches[1:])
    optimizer.finish_pending()
    assert losses == pytest.approx(expected, rel=1e-6)
    # Bit for bit in most runs; in about half the runs of the first case (varying from run to run with the same seed:
    # the host worker's timing) one tensor, a bias trained up from zero, parts by up to 1.3e-4 of its displacement
    # (12 runs), which a bound of 1e-6 of its norm failed.
    assert_trained_alike(optimizer.master_state_dict(), reference_optimizer.master_state_dict(), start, rtol=1e-3)


@pytest.mark.parametrize("world_size", [1, 2])
def test_dry_run_reports_the_warmup_room_on_a_gpu_with_an_auto_reserve(world_size):
    """``pretrain.py --plan`` for a GPU: the room the warm-up step leaves is its least footprint's, at least the
    first plan's; an explicit activation_memory keeps the first plan for the warm-up (no room reported), and so
    does planning for this CPU."""
    rng = random.Random(random.randrange(10**6))
    hidden, layers = rng.choice([1024, 2048]), rng.randint(8, 24)
    shapes = [("embed", (32000, hidden))] + [(f"h{i}.{k}", (hidden, hidden)) for i in range(layers) for k in "qkvo"]
    machine = zero_cache.Hardware(device_bytes=rng.choice([8, 16, 24]) * 2**30, host_bytes=256 * 2**30,
                                  gpus_per_host=world_size)
    auto = ZeroCacheConfig(enabled=True)
    run = zero_cache.dry_run(shapes, auto, compute_dtype=torch.bfloat16, device=torch.device("cpu"),
                             world_size=world_size, hardware=machine)
    reserve = run.resolved.activation_reserve_bytes
    planned_room = int(run.resolved.budgets.device_bytes * (1 - DEVICE_MARGIN_FRACTION)) - run.plan.device_bytes
    assert run.warmup_room_bytes >= planned_room >= reserve > 0
    first_host, group_bytes = run.plan.host_bytes, run.layout.chunk_numel * 12  # (fp32 states, no accumulators)
    assert 0 < run.warmup_host_bytes <= max(int(WARMUP_HOST_FACTOR * first_host), first_host + group_bytes)
    configured = zero_cache.dry_run(shapes, dataclasses.replace(auto, activation_memory=reserve),
                                    compute_dtype=torch.bfloat16, device=torch.device("cpu"), world_size=world_size,
                                    hardware=machine)
    assert configured.warmup_room_bytes is None and configured.warmup_host_bytes is None
    assert configured.plan == run.plan
    on_cpu = zero_cache.dry_run(shapes, dataclasses.replace(auto, device_memory_budget=8 * 2**30,
                                                            host_memory_budget=16 * 2**30),
                                compute_dtype=torch.float32, device=torch.device("cpu"), world_size=world_size,
                                ranks_per_host=1)  # 16 GiB for each of 2 ranks on one host is more than its RAM
    assert on_cpu.warmup_room_bytes is None
