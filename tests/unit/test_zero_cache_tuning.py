"""The device-step count chosen by measured step times (zero_cache.plan.tuning), and the plan it applies."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import random
import statistics
import threading

import pytest
import torch
from reference import random_batches, train_steps
from test_zero_cache_device_steps import tiny_llama
from test_zero_cache_streamed import assert_close_to, config, resident_budget

import angelptm
from zero_cache.optim.host_update import HostUpdater
from zero_cache.plan.planner import DEVICE, HOST, PlanInputs, make_plan, with_device_step_count
from zero_cache.plan.tuning import (
    CHECK_STEPS,
    MAX_TRIALS,
    MEASURED_STEPS,
    RESTARTS,
    RETUNE_STEPS,
    SETTLE_STEPS,
    SLOW_FACTOR,
    DeviceStepTuner,
    SettledSteps,
    next_count,
)
from zero_cache.storage.chunks import ChunkStore


def drive(tuner: DeviceStepTuner, cost: dict[int, float], noise: float = 0.05) -> tuple[list[int], list[float]]:
    """Feed ``tuner`` steps until it is done: a settling step pays for the switch (twice its count's cost), a
    measured one runs its count's cost, up to ``noise`` slower. Returns the count in force and the time of each
    step."""
    counts, times = [], []
    while not tuner.done:
        settling = tuner._seen < SETTLE_STEPS
        count = tuner.current
        seconds = cost[count] * (2.0 if settling else random.uniform(1.0, 1.0 + noise))
        counts.append(count)
        times.append(seconds)
        tuner.observe(seconds)
        assert len(counts) <= MAX_TRIALS * (SETTLE_STEPS + MEASURED_STEPS), "the tuning takes too many steps"
    return counts, times


def first_count(planned: int) -> int:
    """The count the tuning tries first: half the plan's (at least one), or none where the plan steps none."""
    return max(1, round(planned / 2)) if planned else 0


def test_next_count_starts_below_the_plans_never_repeats_and_stays_in_range():
    for _ in range(300):
        most = random.randint(0, 40)
        planned = random.randint(0, most)
        measured: dict[int, float] = {}
        while (count := next_count(planned, most, measured)) is not None:
            assert count == first_count(planned) if not measured else count not in measured
            # (below the plan's count, where it steps any)
            assert 0 <= count <= (max(first_count(planned), round(3 * planned / 4)) if planned else most)
            measured[count] = random.uniform(0.2, 2.0)
        assert 1 <= len(measured) <= MAX_TRIALS
        if most:
            assert len(measured) > 1, "a plan with host groups has another count to try"


def test_the_tuning_tries_the_counts_measured_fastest_on_the_gpu_rows():
    """The rows of the regression matrix (bench/results/*-matrix-*.out): the plan's count, and the fastest of the
    counts the earlier order tried (the plan's, half, a quarter). The new order tries the fastest, and not the plan's
    own 7 or 11, whose steps leave work to the next."""
    rows = {"13B, H200": (7, {7: 2.032, 4: 1.781, 2: 1.425}), "10B, H100": (11, {11: 1.683, 6: 1.518, 3: 1.551}),
            "2.7B capped, H100": (7, {7: 0.659, 4: 0.582, 2: 0.620}), "Llama capped, H100": (7, {7: 0.962, 4: 0.889}),
            "13B, H200 (72e71da)": (7, {4: 2.080, 2: 1.751, 1: 1.564}),
            "10B, H100 (949bc3f)": (11, {6: 1.569, 3: 1.537, 2: 1.676})}
    for row, (planned, measured) in rows.items():
        fastest = min(measured, key=measured.__getitem__)
        tried: dict[int, float] = {}
        while (count := next_count(planned, 16, tried)) is not None:
            tried[count] = measured.get(count, 2 * max(measured.values()))  # (one not measured: as slow as any)
        assert fastest in tried and planned not in tried, (row, tried)


def test_the_tuner_settles_within_its_step_bound_on_the_fastest_count_it_tried():
    """Fresh random costs: the tuner is done within MAX_TRIALS * (SETTLE_STEPS + MEASURED_STEPS) steps, ignores the
    settling steps, and settles on the fastest count it tried."""
    for _ in range(100):
        most = random.randint(1, 30)
        planned = random.randint(0, most)
        cost = {count: random.uniform(0.2, 2.0) for count in range(most + 1)}
        tuner = DeviceStepTuner(planned, most)
        counts, _ = drive(tuner, cost)
        assert counts[0] == first_count(planned) and tuner.observe(1.0) is None
        assert set(tuner.measured) == set(counts) and max(tuner.measured.values()) < 2 * max(cost.values())
        best = min(tuner.measured, key=lambda count: (cost[count], count))
        # Noise of 5% may swap two counts within 5% of each other, never more.
        assert cost[tuner.best] <= cost[best] * 1.05 and tuner.current == tuner.best


def test_a_count_much_slower_than_the_best_so_far_is_dropped_after_one_measured_step():
    """The step bound a user feels: a count whose measured step takes SLOW_FACTOR times the best mean so far gets
    one measured step, not MEASURED_STEPS."""
    for _ in range(100):
        most = random.randint(4, 30)
        planned = random.randint(2, most)
        first = first_count(planned)
        cost = {count: random.uniform(0.5, 1.0) for count in range(most + 1)}
        cost[first] = 0.4
        slow = {count: random.uniform(2 * SLOW_FACTOR, 3 * SLOW_FACTOR) * 0.4 for count in cost if count != first}
        tuner = DeviceStepTuner(planned, most)
        counts, _ = drive(tuner, {**cost, **slow}, noise=0.0)
        assert tuner.best == first
        for count in set(counts) - {first}:
            assert counts.count(count) == SETTLE_STEPS + 1, (count, counts)


def test_a_count_whose_steps_leave_work_to_the_next_is_measured_by_its_mean_not_its_fastest_step():
    """The first count alternates fast and slow steps (a step leaves the host's work to the next, which pays for
    it); the others are steady and faster on the whole. A steady one wins, though the first has the fastest step."""
    for _ in range(50):
        # Any two of the alternating steps average 1.3 s or more; the steady ones take 0.6-0.93 s.
        steady, fast, slow = random.uniform(0.6, 0.9), random.uniform(0.4, 0.5), random.uniform(2.2, 2.4)
        tuner = DeviceStepTuner(6, 6)
        first, seen = tuner.current, 0
        while not tuner.done:
            count, seen = tuner.current, seen + 1
            step = (fast if seen % 2 else slow) if count == first else steady * (1 + 0.01 * count)
            tuner.observe(step)
        assert tuner.best != first and len(tuner.measured) > 1
        assert tuner.measured[first] >= 1.3 > max(tuner.measured[c] for c in tuner.measured if c != first)


TUNING_STEPS = MAX_TRIALS * (SETTLE_STEPS + MEASURED_STEPS)


def test_a_change_of_update_timing_starts_the_tuning_over_and_it_chooses_by_the_later_timing():
    """13B on the H200: the first steps clip (their updates wait for the global norm) and run slow whatever the count,
    then the norm falls under the threshold. The counts are compared under the later timing alone."""
    for _ in range(100):
        most = random.randint(2, 30)
        planned = random.randint(1, most)
        clipped = random.randint(2, 4)  # steps whose updates wait (the tuning is still on), then all run in backward
        after = {count: random.uniform(0.5, 1.0) for count in range(most + 1)}
        waiting = {count: 2.5 - after[count] for count in after}  # (the counts in the opposite order)
        tuner = DeviceStepTuner(planned, most)
        seen = []
        while not tuner.done:
            waited = len(seen) < clipped
            seconds = (waiting if waited else after)[tuner.current]
            seen.append((tuner.current, waited))
            tuner.observe(seconds, waited_for_norm=waited)
            assert len(seen) <= (1 + RESTARTS) * TUNING_STEPS
        assert tuner.restarts == 1 and tuner.waited_for_norm is False
        assert tuner.measured == {count: after[count] for count in tuner.measured}  # none of the clipped steps
        assert tuner.best == min(tuner.measured, key=lambda count: (after[count], count))


def test_a_settled_tuning_starts_over_once_the_update_timing_has_changed_for_some_steps():
    """A run that clips through its first steps settles on the count for updates that wait for the norm; once its
    norm stays under the threshold (RETUNE_STEPS steps in a row), it tunes again for updates in backward. One step
    under the other timing does not; nor does anything after the last restart."""
    for _ in range(100):
        most = random.randint(2, 30)
        planned = random.randint(1, most)
        waiting = {count: random.uniform(0.5, 1.0) for count in range(most + 1)}
        after = {count: 2.5 - waiting[count] for count in waiting}  # (the counts in the opposite order)
        tuner = DeviceStepTuner(planned, most)
        while not tuner.done:
            tuner.observe(waiting[tuner.current], waited_for_norm=True)
        first_choice = tuner.best
        assert tuner.observe(1.0, waited_for_norm=False) is None and tuner.done  # (one unclipped step: nothing)
        assert tuner.observe(1.0, waited_for_norm=True) is None and tuner.done
        switched = [tuner.observe(after[tuner.current], waited_for_norm=False) for _ in range(RETUNE_STEPS)]
        assert not tuner.done and tuner.restarts == 1 and tuner.measured == {}
        assert switched[:-1] == [None] * (RETUNE_STEPS - 1)
        assert switched[-1] == (tuner.current if tuner.current != first_choice else None)
        steps = 0
        while not tuner.done:
            tuner.observe(after[tuner.current], waited_for_norm=False)
            steps += 1
            assert steps <= TUNING_STEPS
        assert tuner.measured == {count: after[count] for count in tuner.measured}
        assert tuner.best == min(tuner.measured, key=lambda count: (after[count], count))
        for _ in range(2 * RETUNE_STEPS):  # (the restarts are spent: it stays settled)
            assert tuner.observe(1.0, waited_for_norm=True) is None and tuner.done


def test_an_update_timing_that_flips_every_step_starts_the_tuning_over_once_and_it_settles():
    for _ in range(50):
        most = random.randint(1, 30)
        tuner = DeviceStepTuner(random.randint(0, most), most)
        steps = 0
        while not tuner.done:
            tuner.observe(random.uniform(0.5, 1.0), waited_for_norm=bool(steps % 2))
            steps += 1
        assert tuner.restarts == RESTARTS and steps <= (1 + RESTARTS) * TUNING_STEPS


def test_a_fixed_tuner_measures_the_plans_count_alone_under_one_update_timing():
    """A plan with no count to tune is still checked against its prediction: a fixed tuner measures its count as a
    tuning measures each, starts over where the update timing changes (13B on the H200 with device steps off: its
    check measured the clipped steps 1-4 and logged 2.375 s, where the run went on at 1.58 s), and never switches."""
    for _ in range(100):
        planned = random.randint(0, 30)
        tuner = DeviceStepTuner(planned, planned, fixed=True)
        clipped = random.randint(0, 4)
        seconds = {True: random.uniform(1.5, 2.5), False: random.uniform(0.5, 1.0)}
        steps = 0
        while not tuner.done:
            waited = steps < clipped
            assert tuner.observe(seconds[waited], waited_for_norm=waited) is None and tuner.current == planned
            steps += 1
            assert steps <= (1 + RESTARTS) * (SETTLE_STEPS + MEASURED_STEPS)
        assert tuner.measured == {planned: seconds[tuner.waited_for_norm]} and tuner.best == planned
        # (a clip regime that outlasts the first measurement: measured again once the steps stop clipping)
        if tuner.waited_for_norm and tuner.restarts < RESTARTS:
            for _ in range(RETUNE_STEPS):
                assert tuner.observe(seconds[False], waited_for_norm=False) is None
            assert not tuner.done and tuner.restarts == 1
            while not tuner.done:
                assert tuner.observe(seconds[False], waited_for_norm=False) is None
            assert tuner.measured == {planned: seconds[False]}


def test_the_steps_check_is_taken_over_settled_steps_of_one_update_timing():
    """The check's figure is the median of CHECK_STEPS settled steps (and of their backwards) under one update
    timing: a step under the other timing starts the collection over from it; steps that do not say are one."""
    for _ in range(100):
        settled = SettledSteps()
        waited = random.choice([True, False])
        for seconds in [random.uniform(0.5, 1.0) for _ in range(random.randint(1, CHECK_STEPS - 1))]:
            assert not settled.add(seconds, seconds * 0.4, waited_for_norm=waited)
        later = [random.uniform(1.5, 2.5) for _ in range(CHECK_STEPS)]
        done = [settled.add(seconds, seconds * 0.4, waited_for_norm=not waited) for seconds in later]
        assert done == [False] * (CHECK_STEPS - 1) + [True]  # (none of the first timing's steps counted)
        assert settled.step == statistics.median(later) and settled.waited_for_norm is (not waited)
        assert settled.backward == pytest.approx(0.4 * statistics.median(later))
        untold = SettledSteps()
        steps = [random.uniform(0.5, 2.5) for _ in range(CHECK_STEPS)]
        assert [untold.add(seconds) for seconds in steps][-1] and untold.backward is None
        assert untold.step == statistics.median(steps) and untold.waited_for_norm is None


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_the_tuning_is_told_each_steps_update_timing(monkeypatch, clip):
    warmup = importlib.import_module("zero_cache.warmup")
    monkeypatch.setattr(warmup, "tunes_on", lambda device: True)
    monkeypatch.setattr(warmup, "make_plan", lambda inputs: with_device_step_count(inputs, make_plan(inputs), 4))
    told, flags = [], []
    observe = DeviceStepTuner.observe

    def recorded(tuner, *args, waited_for_norm=None):
        told.append(waited_for_norm)
        return observe(tuner, *args, waited_for_norm=waited_for_norm)

    monkeypatch.setattr(DeviceStepTuner, "observe", recorded)
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("host", clip=clip))
    for batch in random_batches(seed, count=4, batch=2):
        train_steps(engine, [batch])
        flags.append(optimizer.last_updates_after_backward)
    optimizer.finish_pending()
    # (a clip of 0.05 clips every step: every later one waits; without clipping none does)
    assert told == flags[1:] and set(told) == {clip > 0}


def test_a_restart_forgets_the_work_timed_under_the_other_update_timing(monkeypatch):
    """The rates the tuning's end takes (the host's Adam, the device steps and Adam) come from the steps after the
    last restart: what ran while the steps clipped is dropped with their times."""
    warmup = importlib.import_module("zero_cache.warmup")
    monkeypatch.setattr(warmup, "tunes_on", lambda device: True)
    monkeypatch.setattr(warmup, "make_plan", lambda inputs: with_device_step_count(inputs, make_plan(inputs), 4))
    observe, steps = DeviceStepTuner.observe, []

    def first_steps_clipped(tuner, *args, waited_for_norm=None):  # (the engine does not clip; the tuner is told so)
        steps.append(tuner.restarts)
        return observe(tuner, *args, waited_for_norm=len(steps) <= 2)

    dropped = []
    drop = warmup._drop_timed_work

    def recorded(optimizer):
        drop(optimizer)
        dropped.append((len(steps), optimizer.host.adam_work.elements))

    monkeypatch.setattr(DeviceStepTuner, "observe", first_steps_clipped)
    monkeypatch.setattr(warmup, "_drop_timed_work", recorded)
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("host"))
    train_steps(engine, random_batches(seed, count=5, batch=2))
    optimizer.finish_pending()
    # At the re-plan, before the first observed step; then at the third, whose timing differs from the second's.
    assert dropped == [(0, 0), (3, 0)] and steps == [0, 0, 0, 1]


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


def tuning_settled(optimizer) -> bool:
    """The tuning has settled: the warm-up no longer watches the steps, or its tuner is done and only watches the
    update timing."""
    tracer = optimizer.observer
    return not tracer.watching or tracer.tuner.done


def test_training_tunes_the_count_by_step_time_and_stays_exact(monkeypatch, caplog):
    """With the tuning on (a GPU's "auto", here on CPU) and a clock that makes one count fastest, the run ends on
    that count, switching between counts as it goes, and trains exactly as the host's updates do."""
    monkeypatch.setattr(importlib.import_module("zero_cache.warmup"), "tunes_on", lambda device: True)
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

    optimizer.step_clock.clock = clock
    # the warm-up, the tuning's bound, then the steps the check is taken over
    steps = 1 + MAX_TRIALS * (SETTLE_STEPS + MEASURED_STEPS) + CHECK_STEPS + 1
    batches = random_batches(seed, count=steps, batch=2)
    seen, losses, tuned = [], [], None
    for batch in batches:
        tuner = optimizer.observer.tuner if optimizer.observer.watching else None
        if tuned is None and tuner is not None and tuner.done:  # (the settled steps: half what the tuning measured)
            tuned = tuner.measured[tuner.best]
            cost = {count: seconds / 2 for count, seconds in cost.items()}
        losses += train_steps(engine, [batch])
        seen.append(len(optimizer.device_stepped))
    assert tuning_settled(optimizer) and tuned is not None, "the tuning ended"
    # The backward is timed from the engine's backward to the norm: one tick of this clock, at the last count.
    assert optimizer.last_backward_seconds == pytest.approx(cost[seen[-1]])
    line = next(r.getMessage() for r in caplog.records if "the step runs at" in r.getMessage())
    assert f"the step runs at {tuned / 2:.3f} s (the median of {CHECK_STEPS} after the tuning" in line  # (not `tuned`)
    assert f"the tuning measured {tuned:.3f} s for this count, its steps slower than those after it)" in line
    assert "the plan predicts at least" in line
    assert seen[0] == 0 and len(set(seen)) > 1  # a CPU plan steps none on the device; the tuner tried others
    assert seen[-1] == seen[-2] == min(set(seen), key=lambda count: (cost[count], count))
    optimizer.finish_pending()
    reference, reference_optimizer, _, _ = angelptm.initialize(
        model=tiny_llama(seed), config=config("host", device_steps=0, update_in_backward=False))
    assert losses == pytest.approx(train_steps(reference, batches), rel=1e-6)
    reference_optimizer.finish_pending()
    assert_close_to(optimizer.master_state_dict(), reference_optimizer.master_state_dict(), start, rtol=1e-6)


def test_switching_between_trial_counts_allocates_no_kept_gradient_twice(monkeypatch):
    """A trial that steps more groups on the device drops their kept gradients; the switch back to fewer takes the
    same buffers again instead of registering new pinned memory (each switch's step took 2-3 times the settled
    one at 10B on the H100), and the settled plan frees what no count in force needs."""
    monkeypatch.setattr(importlib.import_module("zero_cache.warmup"), "tunes_on", lambda device: True)
    allocated = []
    original = ChunkStore._allocate_kept

    def allocate_kept(self):
        allocated.append(1)
        return original(self)

    monkeypatch.setattr(ChunkStore, "_allocate_kept", allocate_kept)
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("host", clip=0.0))
    batches = random_batches(seed, count=1 + MAX_TRIALS * (SETTLE_STEPS + MEASURED_STEPS) + 1, batch=2)
    elapsed = [0.0]

    def clock() -> float:  # none on the device is fastest: the tuner goes back to it at the end
        elapsed[0] += 0.5 + len(optimizer.device_stepped)
        return elapsed[0]

    optimizer.step_clock.clock = clock
    train_steps(engine, batches[:1])  # the warm-up and its re-plan
    store = optimizer.store
    kept_before, host_before, allocations_before = (len(store.plan.kept_gradients), store.tiers[HOST].used_bytes,
                                                    len(allocated))
    assert kept_before and not optimizer.device_stepped
    seen = []
    for batch in batches[1:]:
        train_steps(engine, [batch])
        seen.append(len(optimizer.device_stepped))
    assert tuning_settled(optimizer) and max(seen) > 0 and seen[-1] == 0
    assert len(allocated) == allocations_before, "a kept gradient was allocated again"
    assert len(store.plan.kept_gradients) == kept_before and store.tiers[HOST].used_bytes == host_before


def test_host_chunks_update_in_backward_after_every_unclipped_step_under_clipping():
    """The speculation rule with clipping configured: a step whose norm stays under the threshold predicts the next
    (its host chunks update during backward), a clipped one predicts another clip (they wait for the norm); the
    rule follows the last step's norm, not whether clipping is configured."""
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("host", clip=1.0))
    batches = random_batches(seed, count=8, batch=2)
    clipped = [random.random() < 0.5 for _ in batches]
    clipped[1:3] = [False, True]  # both kinds follow some step
    clipped[3:5] = [True, False]
    for index, (batch, clips) in enumerate(zip(batches, clipped)):
        loss = engine(**batch)
        engine.backward(loss * (1e4 if clips else 1e-6))  # a norm far above 1.0, or far below it
        engine.step()
        assert (optimizer.last_grad_norm > 1.0) == clips
        if index:  # (the first step speculates: nothing is known yet)
            assert optimizer.last_updates_after_backward == clipped[index - 1], index
    optimizer.finish_pending()
    assert optimizer.reports.counts["speculated_chunks"] > 0


def hold_host_updates(monkeypatch) -> tuple[threading.Event, list[bool]]:
    """While ``held[0]`` is true, the host worker waits at the start of each update until ``gate`` is set."""
    gate, held = threading.Event(), [False]
    original = HostUpdater._update

    def update(self, update, fetched):
        if held[0]:
            gate.wait(30)
        return original(self, update, fetched)

    monkeypatch.setattr(HostUpdater, "_update", update)
    return gate, held


@pytest.mark.parametrize("param_home", ["device", "host"])
def test_a_count_switch_waits_for_no_queued_host_update_and_training_stays_exact(monkeypatch, param_home):
    """The tuner's switches run while the host's updates of the chunks they change are still queued (waiting for them
    made each switching step the tuning's slowest: 1.1-1.2 s more at 10B on the H100 and 13B on the H200). With the
    worker held, a switch that steps half the host groups on the device (dropping their kept gradients), one back
    (taking them again) and another forth each return at once, and the run trains as the host's updates alone do,
    with params resident on the device or streamed from the host."""
    gate, held = hold_host_updates(monkeypatch)
    seed = torch.randint(0, 10_000, ()).item()
    start = {n: p.detach().clone() for n, p in tiny_llama(seed).named_parameters()}
    budget = resident_budget(tiny_llama(seed)) if param_home == "device" else "auto"  # (no optimizer group fits)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config(param_home, budget, clip=0.0))
    batches = random_batches(seed, count=7, batch=2)
    losses = train_steps(engine, batches[:1])  # the warm-up and its re-plan
    store = optimizer.store
    settled = store.plan
    host = tuple(c for c, group in enumerate(store.groups) if group.tier == HOST)
    assert not settled.device_stepped and len(host) >= 4 and set(host) <= set(settled.kept_gradients)
    joining = host[:len(host) // 2]
    stepping = dataclasses.replace(settled, device_stepped=joining,
                                   kept_gradients=tuple(sorted(set(settled.kept_gradients) - set(joining))))
    host_bytes = store.tiers[HOST].used_bytes
    kept_bytes = store.groups[host[0]].kept.numel() * store.groups[host[0]].kept.element_size()
    # Two trials, then the settled count (its dropped kept gradients are freed, not kept spare), after which the
    # next steps run with the switched chunks' work still queued.
    for plan, trial in ((stepping, True), (settled, True), (stepping, False)):
        gate.clear()
        held[0] = True
        watchdog = threading.Timer(20, gate.set)  # (a switch that waits is let through, and fails below)
        watchdog.start()
        losses += train_steps(engine, [batches[len(losses)]])
        assert not gate.is_set(), f"a training step waited for the host's updates ({plan.device_stepped})"
        in_flight = [optimizer.chunk_steps[chunk].host_update for chunk in optimizer.chunk_steps.in_flight()]
        assert any(not update.issued.is_set() for update in in_flight), "no update left queued"
        optimizer.apply_plan(plan, count_switch=True, trial=trial)
        returned_held = not gate.is_set()
        held[0] = False
        gate.set()
        watchdog.cancel()
        assert returned_held, "the switch waited for the host's queued updates"
        assert optimizer.device_stepped == frozenset(plan.device_stepped)
        if trial:
            optimizer.host.drain()  # (the gate holds the next trial's updates: let these through first)
    losses += train_steps(engine, batches[len(losses):])
    freed = len(joining) * kept_bytes
    assert store.tiers[HOST].used_bytes == host_bytes - freed, "a kept gradient was allocated again, lost or kept"
    optimizer.finish_pending()
    reference, reference_optimizer, _, _ = angelptm.initialize(
        model=tiny_llama(seed), config=config(param_home, budget, clip=0.0, device_steps=0, update_in_backward=False))
    assert losses == pytest.approx(train_steps(reference, batches), rel=1e-6)
    reference_optimizer.finish_pending()
    assert_close_to(optimizer.master_state_dict(), reference_optimizer.master_state_dict(), start, rtol=1e-6)


def test_the_replan_puts_the_tunings_first_count_in_force_and_says_so(monkeypatch, caplog):
    """The re-plan's floor steps 4 host groups on the device (forced here: on CPU it steps none); the tuning starts
    at half of it, in force from the step after the warm-up, and the log names both."""
    warmup = importlib.import_module("zero_cache.warmup")
    monkeypatch.setattr(warmup, "tunes_on", lambda device: True)

    def plan_stepping_four(inputs):
        plan = make_plan(inputs)
        return with_device_step_count(inputs, plan, 4)

    monkeypatch.setattr(warmup, "make_plan", plan_stepping_four)
    caplog.set_level(logging.INFO, logger="zero_cache")
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("host"))
    train_steps(engine, random_batches(seed, count=2, batch=2))
    host = [c for c, group in enumerate(optimizer.store.groups) if group.tier == HOST]
    assert len(host) >= 4 and len(optimizer.device_stepped) == 2 == len(optimizer.store.plan.device_stepped)
    assert "the plan's floor steps 4 host groups on the device, the tuning starts at 2" in caplog.text
    optimizer.finish_pending()


def test_a_switch_dropping_the_kept_gradient_of_a_host_updated_chunk_waits_for_its_update(monkeypatch):
    """Not a plan the tuner makes: the chunk stays updated by the host, in the next backward too, so its kept gradient
    cannot stay with it until the next step; the switch finishes the chunk's queued update before letting it go."""
    gate, held = hold_host_updates(monkeypatch)
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_llama(seed), config=config("host", clip=0.0))
    batches = random_batches(seed, count=4, batch=2)
    losses = train_steps(engine, batches[:1])
    settled = optimizer.store.plan
    assert settled.kept_gradients and not settled.device_stepped
    held[0] = True
    losses += train_steps(engine, batches[1:2])
    watchdog = threading.Timer(2, gate.set)  # (what lets the held worker go: the switch waits for it)
    watchdog.start()
    optimizer.apply_plan(dataclasses.replace(settled, kept_gradients=settled.kept_gradients[1:]), count_switch=True)
    waited = gate.is_set()
    held[0] = False
    gate.set()
    watchdog.cancel()
    assert waited, "the switch let a kept gradient go under a queued host update"
    assert optimizer.store.groups[settled.kept_gradients[0]].kept is None
    losses += train_steps(engine, batches[2:])
    optimizer.finish_pending()
    reference, _, _, _ = angelptm.initialize(
        model=tiny_llama(seed), config=config("host", clip=0.0, device_steps=0, update_in_backward=False))
    assert losses == pytest.approx(train_steps(reference, batches), rel=1e-6)
