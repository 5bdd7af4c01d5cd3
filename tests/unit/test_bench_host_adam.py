"""bench/host_adam.py's arithmetic: the bandwidth it reports and the Adam's bound it derives, from a fake clock."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from launch import load_script

ROOT = Path(__file__).resolve().parents[2]


def host_adam_bench():
    return load_script("bench/host_adam.py")


def test_the_bound_is_the_bandwidth_over_the_bytes_an_element_moves():
    bench = host_adam_bench()
    rng = random.Random()
    for _ in range(20):
        numel, seconds = rng.randrange(10**6, 10**9), rng.uniform(0.01, 2.0)
        triad = bench.bandwidth_gbs(numel, bench.TRIAD_BYTES, seconds)
        assert triad == pytest.approx(numel * 12 / seconds / 1e9)
        # an Adam that moves 28 bytes an element at exactly the triad's bandwidth runs at 100% of its bound
        adam_seconds = numel * 28 / (triad * 1e9)
        assert numel / adam_seconds / 1e9 == pytest.approx(bench.adam_bound(triad, 28))
    # the engine's own count of those bytes: 12 of state read and 12 written, the bf16 gradient in, the weight out
    from zero_cache.plan.step_cost import host_adam_bytes_per_element

    assert host_adam_bytes_per_element(2) == 28


def test_the_median_leaves_out_the_first_call_and_passes_the_step(monkeypatch):
    bench = host_adam_bench()
    clock, steps = [0.0], []
    durations = {1: 50.0, 2: 3.0, 3: 1.0, 4: 2.0}  # the first call (cold pages) is the slow one

    def run(step: int) -> None:
        steps.append(step)
        clock[0] += durations[step]

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    assert bench.median_seconds(run, 3) == 2.0
    assert steps == [1, 2, 3, 4]  # Adam steps count from 1: bias corrections differ per step
