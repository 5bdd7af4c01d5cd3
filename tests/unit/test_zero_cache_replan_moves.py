"""A re-plan's moves between tiers (``ChunkStore.apply_plan``): in an order in which each tier has room."""

from __future__ import annotations

import dataclasses

import torch
from reference import random_batches, train_steps
from test_zero_cache_device_steps import resident_budget, tiny_llama
from test_zero_cache_streamed import config
from zero_cache_setup import budgets, six_layer_llama, zero_cache_config

import angelptm
from zero_cache.plan.planner import DEVICE, HOST, NVME
from zero_cache.storage.chunks import STATE_FIELDS


def test_a_group_moves_into_a_full_host_once_another_has_left_it_for_the_disk(tmp_path):
    """A group leaving the device for the host, while another leaves the host for the disk: the host has room for
    the first only after the second has gone. The planned placement fits; the moves must get there (on a GPU the
    warm-up's re-plan stopped here with "host tier: allocating 12.00 MiB exceeds its budget")."""
    seed = torch.randint(0, 10_000, ()).item()
    device_budget, host_budget = budgets(six_layer_llama(seed))
    config = zero_cache_config(2 * device_budget, int(0.6 * host_budget), clip=0.0, bf16={"enabled": False})
    config["zero_cache"]["nvme_path"] = str(tmp_path)
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    batches = random_batches(seed, count=3, batch=2)
    train_steps(engine, batches[:2])  # the warm-up, its re-plan, and a step under it
    optimizer.finish_pending()
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
