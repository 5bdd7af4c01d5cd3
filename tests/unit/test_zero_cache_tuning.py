"""The device-step count chosen by measured step times (zero_cache.tuning), and the plan it applies."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import random

import pytest
import torch

import angelptm
from reference import random_batches, train_steps
from test_zero_cache_device_steps import tiny_llama
from test_zero_cache_streamed import assert_close_to, config
from zero_cache.planner import DEVICE, HOST, PlanInputs, make_plan, with_device_step_count
from zero_cache.tuning import MEASURED_STEPS, SETTLE_STEPS, DeviceStepTuner, trial_counts


def test_trial_counts_start_with_the_plans_and_stay_in_range():
    for _ in range(200):
        most = random.randint(0, 40)
        planned = random.randint(0, most)
        counts = trial_counts(planned, most)
        assert counts[0] == planned and 0 in counts
        assert len(set(counts)) == len(counts) and all(0 <= c <= most for c in counts)
        if most:
            assert len(counts) > 1, "a plan with host groups always has another count to try"


def test_the_tuner_settles_on_the_fastest_count_and_ignores_settling_steps():
    for _ in range(50):
        most = random.randint(1, 30)
        planned = random.randint(0, most)
        cost = {count: random.uniform(0.2, 2.0) for count in range(most + 1)}
        tuner = DeviceStepTuner(planned, most)
        current, switches = planned, []
        for _ in range(len(tuner.counts) * (SETTLE_STEPS + MEASURED_STEPS)):
            settling = tuner._seen < SETTLE_STEPS
            # A settling step pays for the switch (far slower); a measured one only ever runs slower than its count.
            seconds = 100.0 if settling else cost[current] * random.uniform(1.0, 1.05)
            switch = tuner.observe(seconds, backward_seconds=seconds * 0.4)
            if switch is not None:
                switches.append(switch)
                current = switch
        assert tuner.done and tuner.observe(1.0) is None
        assert switches[:len(tuner.counts) - 1] == tuner.counts[1:]
        assert set(tuner.measured) == set(tuner.counts) and max(tuner.measured.values()) < 100
        # Each count keeps the mean backward of its steps, which the prediction is made from.
        assert tuner.backward == pytest.approx({count: seconds * 0.4 for count, seconds in tuner.measured.items()})
        best = min(tuner.counts, key=lambda count: (cost[count], count))
        # Noise of 5% may swap two counts within 5% of each other, never more.
        assert cost[tuner.best] <= cost[best] * 1.05 and current == tuner.best


def test_a_count_whose_steps_leave_work_to_the_next_is_measured_by_its_mean_not_its_fastest_step():
    """One count's steps alternate fast and slow (a step leaves the host's work to the next, which pays for it); the
    other's are steady and faster on the whole. The steady one wins, though the other has the fastest step."""
    for _ in range(50):
        # Any three of the alternating steps average 1.0 s or more; the steady ones take 0.6-0.93 s.
        steady, fast, slow = random.uniform(0.6, 0.9), random.uniform(0.4, 0.5), random.uniform(2.2, 2.4)
        tuner = DeviceStepTuner(3, 3)  # tries 3, 2, 1, 0, (4 is out of range)
        alternating = tuner.counts[random.randrange(len(tuner.counts))]
        seen = 0
        while not tuner.done:
            count, seen = tuner.current, seen + 1
            step = (fast if seen % 2 else slow) if count == alternating else steady * (1 + 0.01 * count)
            tuner.observe(step)
        assert tuner.best != alternating or len(tuner.counts) == 1
        assert tuner.measured[alternating] >= 1.0 > max(tuner.measured[c] for c in tuner.counts if c != alternating)


def test_a_planned_count_outside_the_host_groups_is_refused():
    with pytest.raises(ValueError, match="planned device steps 5 must lie in 0..3"):
        DeviceStepTuner(5, 3)


def random_inputs(**overrides) -> PlanInputs:
    chunks = random.randint(6, 24)
    numel = random.choice([1 << 16, 3 << 15, 1 << 18])
    held_params = chunks * numel * 2
    optimizer_chunk = numel * 12
    device = held_params + numel * 4 + random.randint(0, 3) * optimizer_chunk
    return PlanInputs(num_chunks=chunks, chunk_numel=numel, param_bytes_per_element=2, grad_bytes_per_element=0,
                      device_budget_bytes=int(device / 0.97) + 1, host_budget_bytes=random.randint(2, 4) * chunks
                      * (optimizer_chunk + numel * 2), kept_bytes_per_element=2, device_steps=None, **overrides)


def test_a_device_step_count_keeps_the_placement_and_matches_the_plan_made_for_it():
    """Params resident, so the plan has one placement: forcing a count must give what planning for it gives."""
    for _ in range(100):
        inputs = random_inputs(trace=tuple(random.sample(range(24), 24)))
        inputs = dataclasses.replace(inputs, trace=tuple(c for c in inputs.trace if c < inputs.num_chunks))
        plan = make_plan(inputs)
        host = plan.optimizer_tier.count(HOST)
        count = random.randint(0, host)
        changed = with_device_step_count(inputs, plan, count)
        assert changed.optimizer_tier == plan.optimizer_tier and changed.param_home == plan.param_home
        assert changed == make_plan(dataclasses.replace(inputs, device_steps=count))
        order = [c for c in dict.fromkeys(inputs.trace) if plan.optimizer_tier[c] == HOST]
        assert list(changed.device_stepped) == order[:count]
        assert not set(changed.kept_gradients) & set(changed.device_stepped)
        # The chunks keeping their gradient are those the host may update during backward.
        assert changed.traffic.speculated_elements == len(changed.kept_gradients) * inputs.chunk_numel
        assert changed.host_bytes <= inputs.host_budget_bytes


def test_training_tunes_the_count_by_step_time_and_stays_exact(monkeypatch, caplog):
    """With the tuning on (a GPU's "auto", here on CPU) and a clock that makes one count fastest, the run ends on
    that count, switching between counts as it goes, and trains exactly as the host's updates do."""
    monkeypatch.setattr(importlib.import_module("zero_cache.attach"), "tunes_on", lambda device: True)
    caplog.set_level(logging.INFO, logger="zero_cache")
    seed = torch.randint(0, 10_000, ()).item()
    start = {n: p.detach().clone() for n, p in tiny_llama(seed).named_parameters()}
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("host"))
    host_groups = [g.tier for g in optimizer.store.groups].count(HOST)
    assert host_groups >= 3 and DEVICE not in [g.tier for g in optimizer.store.groups]
    cost = {count: random.uniform(0.1, 1.0) for count in range(host_groups + 1)}
    elapsed = [0.0]

    def clock() -> float:  # each step costs what its count costs
        elapsed[0] += cost[len(optimizer.device_stepped)]
        return elapsed[0]

    optimizer.clock = clock
    counts = trial_counts(0, host_groups)  # a CPU plan steps none on the device
    steps = 1 + len(counts) * (SETTLE_STEPS + MEASURED_STEPS) + 2
    batches = random_batches(seed, count=steps, batch=2)
    seen, losses = [], []
    for batch in batches:
        losses += train_steps(engine, [batch])
        seen.append(len(optimizer.device_stepped))
    assert optimizer.after_step is None, "the tuning ended"
    # The backward is timed from the engine's backward to the norm: one tick of this clock, at the last count.
    assert optimizer.last_backward_seconds == pytest.approx(cost[seen[-1]])
    assert "the step runs at" in caplog.text and "the plan predicts at least" in caplog.text
    assert set(seen) == set(counts)
    assert seen[-1] == min(counts, key=lambda count: (cost[count], count))
    optimizer.finish_pending()
    reference, reference_optimizer, _, _ = angelptm.initialize(
        model=tiny_llama(seed), config=config("host", device_steps=0, update_in_backward=False))
    assert losses == pytest.approx(train_steps(reference, batches), rel=1e-6)
    reference_optimizer.finish_pending()
    assert_close_to(optimizer.master_state_dict(), reference_optimizer.master_state_dict(), start, rtol=1e-6)
