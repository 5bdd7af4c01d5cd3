"""The working set of gathered params fitted to the device budget (zero_cache.plan.working_set and the planner).

A device too small for the config's live groups and gradient buckets gets fewer (the lagged bucket, then the
prefetch depth) instead of a refusal; only a device short of the least working set is refused, with the
budget that would hold it. A device that holds the config's working set keeps its counts.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, reference_loop, train_steps

import angelptm
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.plan.layout import pack
from zero_cache.plan.planner import DEVICE, DEVICE_MARGIN_FRACTION, HOST, PlanError, PlanInputs, make_plan
from zero_cache.plan.working_set import (
    GRADIENT_BUCKETS,
    GROUPS_IN_USE,
    WorkingSet,
    agreed,
    budget_for_room,
    minimum,
    shrinking,
)
from zero_cache.runtime.shard_params import agree_working_set


def test_shrinking_gives_up_the_lagged_bucket_then_the_prefetch_depth_one_group_at_a_time():
    steps = list(shrinking(WorkingSet(ahead=3, live_groups=8, buckets=3), num_groups=10))
    assert steps == [WorkingSet(3, 8, 3), WorkingSet(3, 5, 2), WorkingSet(2, 4, 2), WorkingSet(1, 3, 2)]
    # Two groups: neither a third slot nor a third bucket would ever be used.
    assert list(shrinking(WorkingSet(ahead=2, live_groups=4, buckets=3), num_groups=2)) == [WorkingSet(1, 2, 2)]


@pytest.mark.parametrize("seed", range(4))
def test_no_working_set_has_more_slots_or_buckets_than_groups(seed):
    rng = random.Random(seed * 101 + random.randrange(10**6))
    for _ in range(200):
        groups = rng.randint(1, 12)
        wanted = WorkingSet(ahead=rng.randint(1, 6), live_groups=rng.randint(0, 20), buckets=rng.choice([0, 3]))
        sets = list(shrinking(wanted, groups))
        sizes = [s.live_groups + s.buckets for s in sets]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)  # each step gives something up
        for working in sets:
            assert working.live_groups <= groups and working.buckets <= groups and working.ahead >= 1
            assert working.live_groups >= min(working.ahead + GROUPS_IN_USE, groups)
        assert sets[-1] == minimum(wanted, groups) and sets[-1].ahead == 1


def test_the_budget_for_a_room_is_the_least_that_leaves_it_after_the_margin():
    rng = random.Random(random.randrange(10**6))
    for _ in range(500):
        room, margin = rng.randint(1, 10**9), rng.choice([0.0, 0.03, 0.1, 0.25])
        budget = budget_for_room(room, margin)
        assert int(budget * (1 - margin)) >= room > int((budget - 1) * (1 - margin))


CHUNK_BYTES = 2_000
"""The planner tests' param chunks: 500 fp32 elements (scratch 2,000 B, optimizer group 8,000 B)."""


def streamed_inputs(rng: random.Random, budget: int, *, num_chunks: int, ahead: int, size: int = 1) -> PlanInputs:
    """Gathered params on rank 0 of ``size`` (1: streamed from the host), ``num_chunks`` groups of ``size`` chunks;
    with several ranks, every shard at home on the host (a shard on the device costs less than a group)."""
    chunks = num_chunks * size
    return PlanInputs(num_chunks=chunks, chunk_numel=CHUNK_BYTES // 4, param_bytes_per_element=4,
                      device_budget_bytes=budget, host_budget_bytes=10**9, grad_bytes_per_element=0,
                      trace=tuple(rng.sample(range(chunks), chunks)), param_chunks_held=num_chunks, group_size=size,
                      owned=tuple(range(0, chunks, size)), param_home=rng.choice(["auto", "host"] if size == 1 else
                                                                                 ["host"]),
                      live_groups=ahead + GROUPS_IN_USE, gather_ahead=ahead, gradient_buckets=GRADIENT_BUCKETS)


def needed_budget(groups: int, size: int = 1) -> int:
    """Budget for the scratch chunk and ``groups`` buffers of ``size`` chunks, over the margin."""
    return budget_for_room((1 + groups * size) * CHUNK_BYTES, DEVICE_MARGIN_FRACTION)


@pytest.mark.parametrize("seed, size", [(seed, size) for seed in range(3) for size in (1, 2, 4)])
def test_a_device_short_of_the_wanted_working_set_gets_a_smaller_one_and_only_below_the_least_a_refusal(seed, size):
    rng = random.Random(seed * 7919 + random.randrange(10**6))
    ahead = rng.randint(1, 3)
    # More groups than the wanted working set: with fewer, "auto" may hold every param resident under it (5 groups
    # of one chunk fit in less than 3 ahead, 2 in use and 2 buckets), and nothing streams.
    num_chunks = rng.randint(ahead + GROUPS_IN_USE + GRADIENT_BUCKETS + 1, 16)
    wanted = needed_budget(ahead + GROUPS_IN_USE + GRADIENT_BUCKETS, size)  # the old refusal threshold
    least = needed_budget(1 + GROUPS_IN_USE + GROUPS_IN_USE, size)
    for budget in [least, wanted - 1, *(rng.randint(least, wanted - 1) for _ in range(4))]:
        plan = make_plan(streamed_inputs(rng, budget, num_chunks=num_chunks, ahead=ahead, size=size))
        assert plan.param_home == (HOST,) * num_chunks and plan.device_bytes <= budget
        assert plan.gradient_buckets == GROUPS_IN_USE  # the lagged bucket went first
        assert 1 <= plan.gather_ahead <= ahead and plan.cache_slots >= plan.gather_ahead + GROUPS_IN_USE
        assert plan.device_bytes == (1 + (plan.cache_slots + plan.gradient_buckets) * size) * CHUNK_BYTES
    with pytest.raises(PlanError) as refused:
        make_plan(streamed_inputs(rng, least - 1, num_chunks=num_chunks, ahead=ahead, size=size))
    message = str(refused.value)
    assert f"to at least {least} bytes" in message and "(short by 1 B)" in message
    group = f"{size * CHUNK_BYTES / 1024:.2f} KiB"
    assert f"3 gathered groups of {group} (2 in use, 1 fetched ahead), 2 gradient buckets of {group}" in message


@pytest.mark.parametrize("seed", range(4))
def test_a_device_that_holds_the_wanted_working_set_keeps_its_counts(seed):
    rng = random.Random(seed * 31 + random.randrange(10**6))
    num_chunks, ahead = rng.randint(5, 16), rng.randint(1, 3)
    wanted = needed_budget(ahead + GROUPS_IN_USE + GRADIENT_BUCKETS)
    for budget in [wanted, *(rng.randint(wanted, 40 * wanted) for _ in range(4))]:
        inputs = streamed_inputs(rng, budget, num_chunks=num_chunks, ahead=ahead)
        plan = make_plan(inputs)
        assert (plan.gather_ahead, plan.gradient_buckets) == (ahead, GRADIENT_BUCKETS)
        assert plan.cache_slots == min(ahead + GROUPS_IN_USE, plan.streamed_groups)


def test_a_few_chunks_get_no_more_slots_or_buckets_than_there_are():
    rng = random.Random(random.randrange(10**6))
    for num_chunks in range(1, 5):
        inputs = streamed_inputs(rng, 10**6, num_chunks=num_chunks, ahead=4)
        plan = make_plan(dataclasses.replace(inputs, param_home="host", live_groups=50))
        assert plan.cache_slots <= num_chunks and plan.gradient_buckets <= num_chunks
        assert plan.gather_ahead <= max(1, num_chunks - GROUPS_IN_USE)


# ---------------------------------------------------------------- the engine, against torch AdamW (fp32, CPU)
def random_gpt(rng: random.Random, seed: int, tied: bool) -> tuple[ModelConfig, torch.nn.Module]:
    config = ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=rng.randint(2, 4),
                         hidden_size=rng.choice([16, 32, 48]), num_heads=4, tie_embeddings=tied,
                         activation_checkpointing=rng.random() < 0.5)
    torch.manual_seed(seed)
    return config, build_model(config)


def fresh(config: ModelConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(config)


def streamed_config(chunk_numel: int, budget: int, accumulation: int) -> dict:
    return ds_config(gradient_clipping=1.0, gradient_accumulation_steps=accumulation,
                     zero_cache={"enabled": True, "chunk_size": chunk_numel, "param_home": "host",
                                 "device_memory_budget": budget, "host_memory_budget": "1GiB"})


def random_chunk(rng: random.Random, model: torch.nn.Module) -> tuple[int, int]:
    """A chunk size at or above the largest tensor, and the chunk's fp32 bytes once packed."""
    largest = max(p.numel() for p in model.parameters())
    numel = pack([(n, tuple(p.shape)) for n, p in model.named_parameters()],
                 largest + 64 * rng.randint(0, 16)).chunk_numel
    return numel, numel * 4


@pytest.mark.parametrize("accumulation, tied", [(1, True), (1, False), (3, True)])
def test_a_budget_below_the_old_working_set_trains_like_torch_adamw(accumulation, tied, caplog):
    """Between the least working set and the one the config wants (every budget here used to be refused): the
    plan shrinks it, the device tier never passes the budget (it raises if it would), the losses follow
    hand-written fp32 AdamW with clipping, and the weights are bitwise those of the same run on an ample device."""
    seed = torch.randint(0, 10_000, ()).item()
    rng = random.Random(seed)
    model_config, model = random_gpt(rng, seed, tied)
    chunk_numel, chunk_bytes = random_chunk(rng, model)
    least = budget_for_room((1 + 3 + 2) * chunk_bytes, DEVICE_MARGIN_FRACTION)
    wanted = budget_for_room((1 + 4 + 3) * chunk_bytes, DEVICE_MARGIN_FRACTION)  # prefetch_depth 2, 3 buckets
    budget = rng.randint(least, wanted - 1)
    caplog.set_level(logging.INFO, logger="zero_cache.attach")
    engine, optimizer, _, _ = angelptm.initialize(model=model,
                                                  config=streamed_config(chunk_numel, budget, accumulation))
    plan = optimizer.store.plan
    assert plan.gradient_buckets == 2 and 1 <= plan.gather_ahead <= 2  # the config's depth is 2
    assert "does not hold the config's working set; planned " in caplog.text
    assert "2 of 3 gradient buckets" in caplog.text
    batches = random_batches(seed, count=3 * accumulation, batch=2)
    losses = train_steps(engine, batches)
    assert optimizer.store.tiers[DEVICE].peak_bytes <= budget
    exchange = optimizer.exchange  # buckets are kept for reuse once allocated: these are all there ever were
    assert exchange.reduction_lag == 0 and len(exchange._free) + len(exchange._open) <= plan.gradient_buckets
    expected_losses, expected = reference_loop(fresh(model_config, seed), batches, dtype=torch.float32,
                                               accumulation=accumulation, lr=3e-3, clip=1.0)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    start = dict(fresh(model_config, seed).named_parameters())
    masters = optimizer.master_state_dict()
    moved = sum((expected[k] - start[k]).square().sum().item() for k in expected) ** 0.5
    error = sum((masters[k] - expected[k]).square().sum().item() for k in expected) ** 0.5
    assert moved > 1e-2 and error <= 1e-4 * moved, f"masters off by {error:.2e} (norm), moved {moved:.2e}"
    caplog.clear()
    ample, ample_optimizer, _, _ = angelptm.initialize(model=fresh(model_config, seed),
                                                       config=streamed_config(chunk_numel, 4 * wanted, accumulation))
    assert (ample_optimizer.store.plan.gradient_buckets, ample_optimizer.store.plan.gather_ahead) == (3, 2)
    assert "working set" not in caplog.text
    assert train_steps(ample, batches) == losses
    ample_masters = ample_optimizer.master_state_dict()
    assert all(torch.equal(masters[name], ample_masters[name]) for name in expected)


def test_a_budget_below_the_least_working_set_is_refused_with_the_bytes_that_would_do():
    seed = torch.randint(0, 10_000, ()).item()
    rng = random.Random(seed)
    model_config, model = random_gpt(rng, seed, tied=True)
    chunk_numel, chunk_bytes = random_chunk(rng, model)
    least = budget_for_room((1 + 3 + 2) * chunk_bytes, DEVICE_MARGIN_FRACTION)
    with pytest.raises(angelptm.ConfigError) as refused:
        angelptm.initialize(model=model, config=streamed_config(chunk_numel, rng.randint(least // 2, least - 1), 1))
    message = str(refused.value)
    assert "2 gradient buckets" in message and "3 gathered groups" in message
    named = int(re.search(r"zero_cache\.device_memory_budget to at least (\d+) bytes", message).group(1))
    assert named == least
    engine, optimizer, _, _ = angelptm.initialize(model=fresh(model_config, seed),
                                                  config=streamed_config(chunk_numel, named, 1))
    batches = random_batches(seed, count=2, batch=2)
    losses = train_steps(engine, batches)
    expected, _ = reference_loop(fresh(model_config, seed), batches, dtype=torch.float32, accumulation=1, lr=3e-3,
                                 clip=1.0)
    assert losses == pytest.approx(expected, rel=1e-5) and optimizer.store.tiers[DEVICE].peak_bytes <= named


def test_the_ranks_agree_on_the_fewest_of_each_count_or_on_none():
    """Ranks that measured different peaks or rates run one working set: each count the fewest any rank planned
    (which fits every rank), or the current plan everywhere when some rank's re-plan failed."""
    for _ in range(200):
        sets = []
        for _ in range(random.randint(1, 8)):
            ahead = random.randint(1, 4)
            sets.append(WorkingSet(ahead=ahead, live_groups=ahead + GROUPS_IN_USE + random.randint(0, 5),
                                   buckets=random.randint(2, 3)))
        common = agreed(sets)
        assert common == WorkingSet(ahead=min(s.ahead for s in sets), live_groups=min(s.live_groups for s in sets),
                                    buckets=min(s.buckets for s in sets))
        assert common.live_groups >= common.fewest_live  # still a working set that runs
        assert all(common.device_bytes(1) <= s.device_bytes(1) for s in sets)
        assert agreed([*sets, None]) is None


def test_a_rank_plan_takes_the_agreed_working_set_and_keeps_the_rest():
    rng = random.Random(random.randrange(10**6))
    ahead = rng.randint(2, 3)
    mine = make_plan(streamed_inputs(rng, needed_budget(ahead + GROUPS_IN_USE + GRADIENT_BUCKETS),
                                     num_chunks=rng.randint(8, 16), ahead=ahead))
    assert mine.working_set == WorkingSet(ahead=ahead, live_groups=ahead + GROUPS_IN_USE, buckets=GRADIENT_BUCKETS)
    other = WorkingSet(ahead=1, live_groups=GROUPS_IN_USE + 1, buckets=2)
    agreed_plan = agree_working_set(mine, lambda own: [own, other])
    assert agreed_plan.working_set == agreed([mine.working_set, other])
    assert dataclasses.replace(agreed_plan, cache_slots=mine.cache_slots, gather_ahead=mine.gather_ahead,
                               gradient_buckets=mine.gradient_buckets) == mine
    assert agree_working_set(mine, lambda own: [own, None]) is None
    assert agree_working_set(None, lambda own: [other, own]) is None
