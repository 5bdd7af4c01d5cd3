"""A re-plan's moves between tiers (``ChunkStore.apply_plan``): in an order in which each tier has room."""

from __future__ import annotations

import dataclasses

import torch
from reference import random_batches, train_steps
from test_zero_cache_device_steps import resident_budget, tiny_llama
from test_zero_cache_streamed import config
from zero_cache_setup import budgets, resident_engine, six_layer_llama, zero_cache_config

import angelptm
from zero_cache.plan.planner import DEVICE, HOST, NVME
from zero_cache.plan.state_costs import STAGING_BUFFERS, SWAP_BUFFERS
from zero_cache.storage.chunks import STATE_FIELDS
from zero_cache.storage.nvme import ALIGN_BYTES


def trained_with_a_disk_tier(tmp_path, batch_count: int):
    """A six-layer Llama whose host holds 60% of what it would need, with an NVMe tier, through its warm-up, re-plan
    and a step under it: (engine, optimizer, batches), the last ``batch_count - 2`` batches not yet trained."""
    seed = torch.randint(0, 10_000, ()).item()
    device_budget, host_budget = budgets(six_layer_llama(seed))
    config = zero_cache_config(2 * device_budget, int(0.6 * host_budget), clip=0.0, bf16={"enabled": False})
    config["zero_cache"]["nvme_path"] = str(tmp_path)
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    batches = random_batches(seed, count=batch_count, batch=2)
    train_steps(engine, batches[:2])  # the warm-up, its re-plan, and a step under it
    optimizer.finish_pending()
    return engine, optimizer, batches


def test_a_group_moves_into_a_full_host_once_another_has_left_it_for_the_disk(tmp_path):
    """A group leaving the device for the host, while another leaves the host for the disk: the host has room for
    the first only after the second has gone. The planned placement fits; the moves must get there (on a GPU the
    warm-up's re-plan stopped here with "host tier: allocating 12.00 MiB exceeds its budget")."""
    engine, optimizer, batches = trained_with_a_disk_tier(tmp_path, batch_count=3)
    store = optimizer.store
    tiers = [group.tier for group in store.groups]
    assert {DEVICE, HOST, NVME} <= set(tiers), tiers
    to_host, to_disk = tiers.index(DEVICE), tiers.index(HOST)
    moved = list(store.plan.optimizer_tier)
    moved[to_host], moved[to_disk] = HOST, NVME
    plan = dataclasses.replace(store.plan, optimizer_tier=tuple(moved),
                               device_stepped=tuple(c for c in store.plan.device_stepped if c != to_disk),
                               kept_gradients=tuple(c for c in store.plan.kept_gradients if c != to_disk))
    # The host has room for no further group until one leaves it; the disk has room for one.
    group_bytes = len(STATE_FIELDS) * store.layout.chunk_numel * 4
    store.tiers[HOST].budget_bytes = store.tiers[HOST].used_bytes + group_bytes - 1
    assert store.tiers[NVME].free_bytes >= store.tiers[NVME].slot_bytes
    before = {name: value.clone() for name, value in optimizer.master_state_dict().items()}

    assert store.apply_plan(plan) == 2
    optimizer.device_stepped = frozenset(plan.device_stepped)
    assert [group.tier for group in store.groups] == moved
    after = optimizer.master_state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    # And it trains on from there, the moved groups stepped where they now live.
    losses = train_steps(engine, batches[2:])
    optimizer.finish_pending()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[n], value) for n, value in optimizer.master_state_dict().items())


def test_a_shard_moves_into_a_full_host_once_a_group_has_left_it_for_the_device():
    """Streamed params: a shard leaving the device for the host, while an optimizer group leaves the host for the
    device. The shard fits only after the group has gone (13B on the H200 with device_steps 0: the warm-up's
    re-plan stopped with "host tier: allocating 600.23 MiB exceeds its budget")."""
    seed = torch.randint(0, 10_000, ()).item()
    budget = int(0.7 * resident_budget(tiny_llama(seed)))
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("auto", budget, clip=0.0))
    batches = random_batches(seed, count=3, batch=2)
    train_steps(engine, batches[:2])
    optimizer.finish_pending()
    store = optimizer.store
    assert DEVICE in store.param_home and HOST in [group.tier for group in store.groups], store.param_home
    shard, group = store.param_home.index(DEVICE), [g.tier for g in store.groups].index(HOST)
    homes, tiers = list(store.plan.param_home), list(store.plan.optimizer_tier)
    homes[shard], tiers[group] = HOST, DEVICE
    plan = dataclasses.replace(store.plan, param_home=tuple(homes), optimizer_tier=tuple(tiers),
                               device_stepped=tuple(c for c in store.plan.device_stepped if c != group),
                               kept_gradients=tuple(c for c in store.plan.kept_gradients if c != group))
    shard_bytes = store.layout.chunk_numel * store.param_chunks[0].element_size()
    store.tiers[HOST].budget_bytes = store.tiers[HOST].used_bytes + shard_bytes - 1
    assert store.tiers[DEVICE].free_bytes >= len(STATE_FIELDS) * store.layout.chunk_numel * 4
    params_before = [params.clone() for params in chunk_params(store)]
    masters_before = {name: value.clone() for name, value in optimizer.master_state_dict().items()}

    assert store.apply_plan(plan) == 2
    optimizer.device_stepped = frozenset(plan.device_stepped)
    assert list(store.param_home) == homes and [g.tier for g in store.groups] == tiers
    assert all(torch.equal(a, b) for a, b in zip(params_before, chunk_params(store)))
    masters = optimizer.master_state_dict()
    assert all(torch.equal(masters_before[name], masters[name]) for name in masters_before)
    losses = train_steps(engine, batches[2:])
    optimizer.finish_pending()
    assert all(torch.isfinite(torch.tensor(losses)))


def chunk_params(store) -> list[torch.Tensor]:
    """Every chunk's params as they are at home (copies)."""
    values = []
    for chunk in range(store.layout.num_chunks):
        with store.open_params(chunk) as params:
            values.append(params.clone())
    return values


def test_a_replan_moving_every_group_off_the_disk_gives_back_the_pinned_bounce_buffers(tmp_path):
    """The NVMe state home's pinned bounce buffers are host memory the plan counts only while some group lives on
    NVMe: a re-plan that moves them all to the host gives the buffers back (host RSS follows the settled plan), and
    a later plan that puts a group on NVMe again makes them anew."""
    engine, optimizer, batches = trained_with_a_disk_tier(tmp_path, batch_count=4)
    store, host = optimizer.store, optimizer.store.tiers[HOST]
    tiers = [group.tier for group in store.groups]
    on_disk = [chunk for chunk, tier in enumerate(tiers) if tier == NVME]
    assert on_disk and host.used_bytes == store.plan.host_bytes, (tiers, host.used_bytes, store.plan.host_bytes)
    bounce_bytes = SWAP_BUFFERS * (store.tiers[NVME].slot_bytes + ALIGN_BYTES)  # (Tier.allocate_aligned's slack)
    group_bytes = len(STATE_FIELDS) * store.layout.chunk_numel * 4
    used_before = host.used_bytes
    host.budget_bytes = used_before + len(on_disk) * group_bytes

    off_disk = dataclasses.replace(store.plan, optimizer_tier=tuple(HOST if t == NVME else t for t in tiers))
    assert optimizer.apply_plan(off_disk) == len(on_disk)
    assert all(group.tier != NVME for group in store.groups)
    assert host.used_bytes == used_before + len(on_disk) * group_bytes - bounce_bytes, \
        "the bounce buffers stayed pinned after no group passed through them"
    before = {name: value.clone() for name, value in optimizer.master_state_dict().items()}
    train_steps(engine, batches[2:3])
    optimizer.finish_pending()
    assert any(not torch.equal(before[n], value) for n, value in optimizer.master_state_dict().items())

    back = list(off_disk.optimizer_tier)  # one group to the disk again: the buffers are made at its first use
    back[on_disk[0]] = NVME
    host.budget_bytes = host.used_bytes + bounce_bytes
    assert optimizer.apply_plan(dataclasses.replace(off_disk, optimizer_tier=tuple(back))) == 1
    losses = train_steps(engine, batches[3:])
    optimizer.finish_pending()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert host.used_bytes == used_before + (len(on_disk) - 1) * group_bytes


def test_a_replan_leaving_the_host_adam_no_group_gives_back_its_pinned_staging_buffers():
    """The host worker's staging buffers are counted by the plan only while it updates some group: a re-plan that
    moves every group to the device gives them back; a later plan with a host group makes them again."""
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = resident_engine(seed, clip=0.0)
    batches = random_batches(seed, count=4, batch=2)
    train_steps(engine, batches[:2])
    optimizer.finish_pending()
    store, host, device = optimizer.store, optimizer.store.tiers[HOST], optimizer.store.tiers[DEVICE]
    tiers = [group.tier for group in store.groups]
    on_host = [chunk for chunk, tier in enumerate(tiers) if tier == HOST]
    assert on_host and optimizer.host.pool.allocated and host.used_bytes == store.plan.host_bytes
    chunk_bytes = store.layout.chunk_numel * store.param_chunks[0].element_size()
    pools = (optimizer.host.pool, optimizer.host.gradient_pool)
    staging_bytes = sum(pool.allocated for pool in pools) * STAGING_BUFFERS * chunk_bytes
    group_bytes = len(STATE_FIELDS) * store.layout.chunk_numel * 4
    kept_bytes = len(store.plan.kept_gradients) * chunk_bytes
    used_before = host.used_bytes
    device.budget_bytes = device.used_bytes + len(on_host) * (group_bytes + store.layout.chunk_numel * 4)

    all_device = dataclasses.replace(store.plan, optimizer_tier=tuple(DEVICE for _ in tiers), device_stepped=(),
                                     kept_gradients=())
    assert optimizer.apply_plan(all_device) == len(on_host)
    assert not any(pool.allocated for pool in pools)
    freed = len(on_host) * group_bytes + kept_bytes + staging_bytes
    if store.grads_in_accumulators:
        freed += len(on_host) * store.layout.chunk_numel * 4
    assert host.used_bytes == used_before - freed, "the host worker's staging buffers stayed pinned"
    before = {name: value.clone() for name, value in optimizer.master_state_dict().items()}
    train_steps(engine, batches[2:3])
    optimizer.finish_pending()
    assert any(not torch.equal(before[n], value) for n, value in optimizer.master_state_dict().items())

    back = list(all_device.optimizer_tier)  # one group to the host again: the host's Adam stages through them again
    back[on_host[0]] = HOST
    assert optimizer.apply_plan(dataclasses.replace(all_device, optimizer_tier=tuple(back))) == 1
    losses = train_steps(engine, batches[3:])
    optimizer.finish_pending()
    assert all(torch.isfinite(torch.tensor(losses))) and optimizer.host.pool.allocated
