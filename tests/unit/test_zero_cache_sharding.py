"""Chunk ownership over ranks (flat and per host) and where the two-stage reduce-scatter leaves each sum."""

from __future__ import annotations

import random
import types

import pytest
import torch

import zero_cache.storage.tiers as tiers
from zero_cache.base.sharding import Sharding


def layouts(rng: random.Random, count: int) -> list[tuple[int, int, bool]]:
    """Random (world size, ranks per host, hierarchical) with whole hosts."""
    out = []
    for _ in range(count):
        per_host = rng.choice([1, 2, 4, 8])
        out.append((per_host * rng.randint(1, 6), per_host, rng.random() < 0.5))
    return out


def test_every_chunk_has_exactly_one_owner_and_owned_lists_agree():
    rng = random.Random(7)
    for world, per_host, hierarchical in layouts(rng, 60):
        num_chunks = rng.randint(1, 5 * world)
        ranks = [Sharding(rank=r, world_size=world, ranks_per_host=per_host, hierarchical=hierarchical)
                 for r in range(world)]
        owned = [set(s.owned(num_chunks)) for s in ranks]
        assert sorted(c for mine in owned for c in mine) == list(range(num_chunks))  # a partition
        for sharding, mine in zip(ranks, owned):
            assert mine == {c for c in range(num_chunks) if sharding.owner(c) == sharding.rank}
            assert sharding.rank_of_slot(sharding.slot) == sharding.rank
        if not hierarchical:
            assert all(ranks[0].owner(c) == c % world for c in range(num_chunks))


def test_two_stage_reduce_scatter_leaves_each_rank_the_sum_of_its_own_slot():
    """Emulate the hierarchical reduce-scatter's indexing (host stage on blocks of N slots, then across
    hosts) on random buffers: each rank's ``mine`` slot must hold the sum over all ranks of that slot."""
    rng = random.Random(11)
    for world, per_host, _ in layouts(rng, 30):
        hosts, slot_numel = world // per_host, rng.randint(1, 5)
        buffers = [torch.randn(world * slot_numel, dtype=torch.float64) for _ in range(world)]
        total = torch.stack(buffers).sum(0)
        after = [b.clone() for b in buffers]
        for host in range(hosts):  # stage 1: sum within the host; local rank l keeps block l
            members = range(host * per_host, (host + 1) * per_host)
            summed = torch.stack([buffers[r] for r in members]).sum(0)
            for r in members:
                local = r % per_host
                after[r].view(per_host, -1)[local].copy_(summed.view(per_host, -1)[local])
        final = [b.clone() for b in after]
        for local in range(per_host):  # stage 2: same local index across hosts; host n keeps slot n of the block
            peers = range(local, world, per_host)
            summed = torch.stack([after[r].view(per_host, -1)[local] for r in peers]).sum(0)
            for r in peers:
                final[r].view(per_host, -1)[local].view(hosts, -1)[r // per_host].copy_(
                    summed.view(hosts, -1)[r // per_host])
        for r in range(world):
            sharding = Sharding(rank=r, world_size=world, ranks_per_host=per_host, hierarchical=True)
            torch.testing.assert_close(sharding.mine(final[r]), sharding.mine(total))


def test_bad_layouts_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        Sharding(rank=4, world_size=4)
    with pytest.raises(ValueError, match="6 ranks in whole hosts of 4"):
        Sharding(rank=0, world_size=6, ranks_per_host=4, hierarchical=True)


def test_auto_budgets_split_a_hosts_memory_between_its_ranks(monkeypatch):
    available = random.randint(64, 512) * 2**30
    total = 2 * available  # the host margin (10% of total) then leaves 80% of what is available
    monkeypatch.setattr(tiers.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available, total=total))
    cpu = torch.device("cpu")
    for ranks in (2, 3, 8):
        assert tiers.auto_host_budget(cpu, ranks) == pytest.approx(tiers.auto_host_budget(cpu) / ranks, abs=1)
        assert tiers.auto_device_budget(cpu, ranks) == pytest.approx(tiers.auto_device_budget(cpu) / ranks, abs=1)
    assert tiers.auto_host_budget(cpu) > 0 and tiers.auto_device_budget(cpu) > 0


@pytest.mark.parametrize("fraction, reserved_gib, expected_free_gib", [(1.0, 0, 100), (22 / 139, 1, 21),
                                                                       (0.5, 0, 69.5)])
def test_auto_device_budget_plans_within_the_process_memory_cap(monkeypatch, fraction, reserved_gib,
                                                                 expected_free_gib):
    """A 139 GiB GPU with 100 GiB free: under set_per_process_memory_fraction the process may allocate only
    its share, less what its allocator already holds (the real H200 case: a 22 GiB cap planned for 139)."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 139 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved_gib * gib)
    free = int(139 * gib * fraction) - reserved_gib * gib if fraction < 1 else 100 * gib
    assert free == pytest.approx(expected_free_gib * gib, abs=gib)
    budget = tiers.auto_device_budget(torch.device("cuda", 0))
    assert budget == int(free - max(tiers.AUTO_MARGIN_MIN_BYTES, free * tiers.AUTO_MARGIN_FRACTION))
