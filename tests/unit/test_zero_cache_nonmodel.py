"""The warm-up's non-model memory (``zero_cache.runtime.nonmodel``): the model's activations, never the engine's buffers
nor the blocks the allocator still caches from the model as it was before attach."""

from __future__ import annotations

import importlib
import random

import torch
from reference import random_batches, train_steps
from test_zero_cache_device_steps import tiny_llama
from test_zero_cache_streamed import config

import angelptm
from zero_cache.runtime.nonmodel import NonModelMeter
from zero_cache.storage.tiers import Tier

attach_module = importlib.import_module("zero_cache.attach")  # (the package exports a function of that name)


class FakeAllocator:
    """A caching allocator's counters: tensors in use (the tier's and others), blocks cached after a free, and
    the peaks since the last reset, updated on every change as CUDA's are."""

    def __init__(self) -> None:
        self.allocated = self.cached = 0
        self.peak_allocated = self.peak_reserved = 0

    def change(self, num_bytes: int) -> None:
        """Allocate (> 0) or free (< 0): an allocation takes cached blocks first, a free caches them."""
        if num_bytes > 0:
            self.cached = max(0, self.cached - num_bytes)
        else:
            self.cached -= num_bytes
        self.allocated += num_bytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.allocated + self.cached)

    # AllocatorStats
    def release_cached(self) -> None:
        self.cached = 0

    def peak_allocated_bytes(self) -> int:
        return self.peak_allocated

    def peak_reserved_bytes(self) -> int:
        return self.peak_reserved

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.allocated + self.cached


class CountedTier(Tier):
    """A device tier whose allocations reach the fake allocator (bytes only: no tensor is made)."""

    def __init__(self, allocator: FakeAllocator) -> None:
        super().__init__("device", torch.device("cpu"), 1 << 50)
        self.allocator = allocator

    def take(self, num_bytes: int) -> None:
        self.used_bytes += num_bytes
        self.allocator.change(num_bytes)

    def give(self, num_bytes: int) -> None:
        self.free(torch.empty(num_bytes, dtype=torch.uint8))
        self.allocator.change(-num_bytes)


def warm_up(rng: random.Random, allocator: FakeAllocator, tier: CountedTier, meter: NonModelMeter | None,
            model_bytes: int) -> tuple[int, int]:
    """A warm-up step of random shape: the model built on the device and moved into chunks (freed, cached), then
    blocks whose activations grow and shrink while the engine streams buffers through the tier, some of them
    freed just as the activations peak. Samples at each block's start and end. Returns (the true activation
    peak, the most the tier changed within one interval)."""
    allocator.change(model_bytes)
    tier.take(model_bytes)  # the chunks, filled from the model...
    allocator.change(-model_bytes)  # ...which is freed: its blocks stay cached
    tier.take(rng.randrange(1, 10) * 2**20)  # the device-step scratch
    if meter is not None:
        meter.start()
    activations = peak = churn = 0
    for _ in range(rng.randrange(4, 40)):
        buffers = [rng.randrange(1, 64) * 2**20 for _ in range(rng.randrange(0, 4))]
        for size in buffers:  # gathered groups, states in transit
            tier.take(size)
        grow = rng.randrange(-activations, 512 * 2**20)
        allocator.change(grow)
        activations += grow
        peak = max(peak, activations)
        temp = rng.randrange(0, 128 * 2**20)  # an autograd temporary inside the block
        allocator.change(temp)
        peak = max(peak, activations + temp)
        allocator.change(-temp)
        for size in buffers:
            tier.give(size)
        churn = max(churn, sum(buffers))
        if meter is not None:
            meter.sample()
    return peak, churn


def test_the_meter_counts_the_activations_not_the_engines_buffers_nor_the_cached_model():
    """Fresh random warm-ups: the measure is never below the activations' true peak (no OOM where the plan said
    it fits) and above it by at most the tier's churn within one interval; the model's cached blocks (several
    times the activations here, as 26 GB of bf16 13B against 9 GB on the H200) are not in it."""
    for seed in range(200):
        rng = random.Random(seed)
        allocator = FakeAllocator()
        tier = CountedTier(allocator)
        meter = NonModelMeter(tier, allocator)
        model_bytes = rng.randrange(2, 40) * 2**30
        truth, churn = warm_up(rng, allocator, tier, meter, model_bytes)
        measured = meter.peak_bytes()
        assert truth <= measured <= truth + churn, (seed, truth, measured, churn)
        assert meter.slack_bytes < model_bytes // 2


def test_the_peaks_read_at_the_end_alone_count_the_cached_model():
    """What the re-plan read before (the allocator's peak less the tier's peak, plus the allocator's slack at its
    peak, from a reset just before the warm-up): on the same warm-ups it takes the model's cached blocks for
    the model's activations (30.5 GB measured at 13.1B on the H200, where the model needs 9.3)."""
    for seed in range(50):
        rng = random.Random(seed)
        allocator = FakeAllocator()
        tier = CountedTier(allocator)
        model_bytes = rng.randrange(2, 40) * 2**30
        allocator.change(model_bytes)
        allocator.change(-model_bytes)
        allocator.reset_peaks()
        tier.peak_bytes = tier.used_bytes
        truth, churn = warm_up(rng, allocator, tier, None, 0)
        old = (allocator.peak_allocated - tier.peak_bytes) + max(0, allocator.peak_reserved - allocator.peak_allocated)
        assert old > truth + churn + model_bytes // 4, (seed, old, truth, model_bytes)


class TierAllocator(FakeAllocator):
    """The fake allocator of a CPU engine: the device tier's bytes as they are at each reading, and fixed
    ``activations`` beside them (the model's part)."""

    def __init__(self, activations: int) -> None:
        super().__init__()
        self.activations, self.tier = activations, None

    def _now(self) -> int:
        return self.tier.used_bytes + self.activations

    def peak_allocated_bytes(self) -> int:
        return self._now()

    def peak_reserved_bytes(self) -> int:
        return self._now()


def test_the_engine_replans_by_the_sampled_measure(monkeypatch):
    """On a CPU engine whose allocator is a fake (the device tier's usage at each reading plus fixed activations),
    the warm-up samples through forward, recompute and backward, and its re-plan leaves room for the activations
    and nothing of the tier's own bytes, streamed params and device steps included."""
    seed = torch.randint(0, 10_000, ()).item()
    activations = random.Random(seed).randrange(1, 64) * 2**20
    allocators: list[TierAllocator] = []

    def fake_stats(_device):
        allocators.append(TierAllocator(activations))
        return allocators[-1]

    original_meter = attach_module.NonModelMeter

    def meter(tier, stats):
        stats.tier = tier
        return original_meter(tier, stats)

    monkeypatch.setattr(attach_module, "allocator_stats_for", fake_stats)
    monkeypatch.setattr(attach_module, "NonModelMeter", meter)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("host", clip=0.0))
    train_steps(engine, random_batches(seed, count=2, batch=2))
    optimizer.finish_pending()
    assert len(allocators) == 1
    tier = optimizer.store.tiers["device"]
    # Streamed params: the gathered groups come and go through the tier within the step.
    assert optimizer.params_sharded or any(home == "host" for home in optimizer.store.param_home)
    assert activations <= optimizer.observer.activation_reserve_bytes < activations + tier.peak_bytes // 2, (
        activations, optimizer.observer.activation_reserve_bytes, tier.peak_bytes)
