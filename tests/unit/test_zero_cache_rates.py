"""The plan's rates: placements compared at this machine's measured rates (zero_cache.runtime.rates,
zero_cache.plan.step_cost)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib
import logging
import random
import threading
import time
import types

import pytest
import torch
from reference import random_batches, train_steps
from test_zero_cache_device_steps import tiny_llama
from test_zero_cache_streamed import config
from test_zero_cache_tuning import random_inputs
from zero_cache_setup import resident_engine

import angelptm
from zero_cache.config import AioConfig
from zero_cache.optim.host_adam import torch_fused_adam
from zero_cache.plan.planner import DEVICE, HOST, make_plan
from zero_cache.plan.step_cost import NOMINAL_RATES, Rates, agreed_rates, host_adam_bytes_per_element
from zero_cache.plan.tuning import CHECK_STEPS, MEASURED_STEPS, SETTLE_STEPS
from zero_cache.runtime.rates import (
    COPY_MARGIN,
    HOST_MEMORY_PASSES,
    HOST_MEMORY_PROBE_ROOM,
    MIN_HOST_MEMORY_PROBE_BYTES,
    MIN_MEASURED_ELEMENTS,
    MIN_PROBE_BYTES,
    PROBE_BYTES,
    Throughput,
    host_memory_rate,
    measured_copies,
    measured_disk,
    measured_host_memory,
    with_timed_work,
)
from zero_cache.storage.nvme import ALIGN_BYTES, NvmeTier, check_directory
from zero_cache.storage.tiers import Tier, TierFullError


def random_rates(rng: random.Random) -> Rates:
    return Rates(h2d_bytes_per_s=rng.uniform(5, 60) * 2**30, d2h_bytes_per_s=rng.uniform(5, 60) * 2**30,
                 host_adam_elements_per_s=rng.uniform(0.5, 6) * 1e9, copies_measured=True)


def test_a_slower_host_adam_steps_at_least_as_many_groups_on_the_device():
    """The host's Adam rate is what device steps trade PCIe bytes against: the slower it runs, the more groups
    the cheapest plan moves off it, and its floor is the stream that bounds the step at those rates."""
    rng = random.Random(random.randrange(10**6))
    for _ in range(60):
        inputs = random_inputs(trace=tuple(rng.sample(range(24), 24)))
        inputs = dataclasses.replace(inputs, trace=tuple(c for c in inputs.trace if c < inputs.num_chunks))
        rates = random_rates(rng)
        slower = dataclasses.replace(rates, host_adam_elements_per_s=rates.host_adam_elements_per_s
                                     * rng.uniform(0.2, 0.9))
        fast, slow = (make_plan(dataclasses.replace(inputs, rates=r)) for r in (rates, slower))
        assert len(slow.device_stepped) >= len(fast.device_stepped)
        for plan, at in ((fast, rates), (slow, slower)):
            traffic = plan.traffic
            assert traffic.rates == at
            assert traffic.seconds == pytest.approx(max(traffic.h2d_bytes / at.h2d_bytes_per_s,
                                                        traffic.d2h_bytes / at.d2h_bytes_per_s,
                                                        traffic.host_adam_elements / at.host_adam_elements_per_s))


def test_the_host_adam_rate_is_taken_only_from_enough_work():
    rates = Rates(h2d_bytes_per_s=10e9, d2h_bytes_per_s=11e9, host_adam_elements_per_s=3e9)
    elements = random.randint(MIN_MEASURED_ELEMENTS, 10**10)
    seconds = random.uniform(0.01, 5.0)
    measured = with_timed_work(rates, host_adam=(elements, seconds))
    assert measured.host_adam_elements_per_s == pytest.approx(elements / seconds) and measured.host_adam_measured
    assert not measured.copies_measured, "the bus was not probed"
    assert "G elements/s (measured here)" in measured.describe() and "(nominal: an H200's" in measured.describe()
    assert (measured.h2d_bytes_per_s, measured.d2h_bytes_per_s) == (10e9, 11e9)
    assert with_timed_work(rates, host_adam=(MIN_MEASURED_ELEMENTS - 1, seconds)) == rates  # too little to time
    assert with_timed_work(rates, host_adam=(elements, 0.0)) == rates
    # No bus to probe on a CPU-only run: the rates stay what they were.
    assert measured_copies(torch.device("cpu"), None, rates) == rates


def test_throughput_adds_from_several_threads_and_starts_again_when_taken():
    work = Throughput()
    amounts = [(random.randint(1, 1000), random.uniform(0, 1)) for _ in range(400)]

    def add(part):
        for elements, seconds in part:
            work.add(elements, seconds)

    threads = [threading.Thread(target=add, args=(amounts[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elements, seconds = work.take()
    assert elements == sum(e for e, _ in amounts) and seconds == pytest.approx(sum(s for _, s in amounts))
    assert work.take() == (0, 0.0)


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_the_host_worker_times_the_elements_the_plan_counts(update_in_backward):
    """The host's measured Adam work over a step is the plan's host Adam elements for it: every host group's
    chunk once (a speculative update's revision adds seconds, not elements)."""
    seed = random.randrange(10_000)
    engine, optimizer, _, _ = angelptm.initialize(
        model=tiny_llama(seed), config=config("host", device_steps=0, update_in_backward=update_in_backward))
    batches = random_batches(seed, count=3, batch=2)
    train_steps(engine, batches[:1])  # the warm-up: its work is taken by the re-plan
    optimizer.finish_pending()
    assert optimizer.host.adam_work.take() == (0, 0.0)
    train_steps(engine, batches[1:])
    optimizer.finish_pending()
    elements, seconds = optimizer.host.adam_work.take()
    plan = optimizer.store.plan
    host_groups = plan.optimizer_tier.count(HOST)
    assert host_groups >= 3 and seconds > 0
    assert elements == 2 * plan.traffic.host_adam_elements == 2 * host_groups * optimizer.store.layout.chunk_numel
    assert plan.traffic.rates == NOMINAL_RATES  # a CPU-only run plans at the nominal rates


def test_the_disk_probe_writes_and_reads_the_next_slot_through_the_tier_and_takes_nothing(tmp_path):
    """The probe's bytes go to the swap file and come back (the tier's counters are the step's, untouched), the
    probe takes no slot, its host buffer is given back, and only the disk's rate is measured."""
    host = Tier("host", torch.device("cpu"), 64 * 2**20)
    slot = MIN_PROBE_BYTES + 3 * ALIGN_BYTES
    nvme = NvmeTier(check_directory(tmp_path), slot, 3 * slot, AioConfig())
    taken = nvme.allocate_slot()  # one group on disk already
    seen = []
    submit = nvme.io.submit

    def recorded_submit(path, fd, buffer, offset, *, write):
        seen.append((offset, buffer.numel(), write))
        return submit(path, fd, buffer, offset, write=write)

    nvme.io.submit = recorded_submit
    rates = measured_disk(nvme, host, NOMINAL_RATES)
    assert rates.disk_measured and not rates.copies_measured and rates.disk_bytes_per_s > 0
    assert rates.h2d_bytes_per_s == NOMINAL_RATES.h2d_bytes_per_s  # only the disk's rate is measured
    assert [(offset, write) for offset, _, write in seen] == [(slot, True), (slot, False)] and seen[0][0] != taken
    assert seen[0][1] == slot  # the whole slot: it is under PROBE_BYTES
    assert nvme.used_bytes == nvme.slot_bytes and host.used_bytes == 0
    assert nvme.traffic.take() == {"read": 0, "write": 0}
    assert nvme.allocate_slot() == slot  # free again
    nvme.free_slot(slot)
    seen.clear()
    full_host = Tier("host", torch.device("cpu"), 0)
    bounce = host.allocate_aligned(slot, ALIGN_BYTES)  # a swap bounce buffer: the probe borrows it
    assert measured_disk(nvme, full_host, NOMINAL_RATES, bounce).disk_measured
    assert [(buffer, write) for _, buffer, write in seen] == [(slot, True), (slot, False)]
    assert measured_disk(nvme, full_host, NOMINAL_RATES) == NOMINAL_RATES  # no bounce buffer, no host room


def test_no_disk_probe_without_room_in_the_disk_budget_or_a_slot_long_enough_to_time(tmp_path):
    host = Tier("host", torch.device("cpu"), 64 * 2**20)
    full = NvmeTier(check_directory(tmp_path), MIN_PROBE_BYTES, MIN_PROBE_BYTES, AioConfig())
    full.allocate_slot()
    assert measured_disk(full, host, NOMINAL_RATES) == NOMINAL_RATES
    small = NvmeTier(check_directory(tmp_path), MIN_PROBE_BYTES - ALIGN_BYTES, 4 * MIN_PROBE_BYTES, AioConfig())
    assert measured_disk(small, host, NOMINAL_RATES) == NOMINAL_RATES
    assert measured_disk(None, host, NOMINAL_RATES) == NOMINAL_RATES
    assert host.used_bytes == 0


def test_a_disk_probe_that_meets_a_full_disk_keeps_the_known_rates_and_takes_nothing(tmp_path, caplog):
    """The probe runs on a machine the plan has just filled: a write that fails (ENOSPC) is logged and the plan keeps
    the rates it knew, not a traceback at the end of the first step."""
    host = Tier("host", torch.device("cpu"), 64 * 2**20)
    slot = MIN_PROBE_BYTES + ALIGN_BYTES
    nvme = NvmeTier(check_directory(tmp_path), slot, 3 * slot, AioConfig())
    taken = nvme.allocate_slot()
    known = dataclasses.replace(NOMINAL_RATES, disk_bytes_per_s=1.7e9, disk_measured=True)

    def full_disk(path, fd, buffer, offset, *, write):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    nvme.io.submit = full_disk
    with caplog.at_level(logging.WARNING, logger="zero_cache"):
        assert measured_disk(nvme, host, known) == known
    assert "the swap file's disk probe failed (OSError: [Errno 28] No space left on device" in caplog.text
    assert host.used_bytes == 0 and nvme.used_bytes == nvme.slot_bytes  # its buffer given back, no slot taken
    assert nvme.allocate_slot() == taken + slot


def test_a_copy_probe_without_device_memory_keeps_the_known_rates_and_takes_nothing(monkeypatch, caplog):
    host = Tier("host", torch.device("cpu"), 2 * PROBE_BYTES)
    known = random_rates(random.Random(torch.randint(0, 10_000, ()).item()))

    def no_device_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(torch, "empty", no_device_memory)
    with caplog.at_level(logging.WARNING, logger="zero_cache"):
        assert measured_copies(torch.device("cuda"), host, known) == known
    monkeypatch.undo()
    assert "the PCIe copy probe failed (OutOfMemoryError: CUDA out of memory" in caplog.text
    assert host.used_bytes == 0  # (the device buffer comes first: nothing was taken)
    caplog.clear()
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda size, **kwargs: empty(size, dtype=torch.uint8))  # (a "device" buffer)
    monkeypatch.setattr(torch.cuda, "Stream", no_device_memory)  # fails once the pinned buffer is taken
    taken = []
    allocate = host.allocate
    monkeypatch.setattr(host, "allocate", lambda *args, **kwargs: taken.append(1) or allocate(*args, **kwargs))
    with caplog.at_level(logging.WARNING, logger="zero_cache"):
        assert measured_copies(torch.device("cuda"), host, known) == known
    assert taken and host.used_bytes == 0, "the pinned buffer was taken and not given back"
    assert "the PCIe copy probe failed" in caplog.text
    assert known.describe() in caplog.text and host.used_bytes == 0


def test_the_disk_probe_grows_the_swap_file_by_its_own_bytes_not_by_a_slot(tmp_path):
    """A slot can be gigabytes, and reserving one may write zeros where the filesystem cannot allocate."""
    host = Tier("host", torch.device("cpu"), 2 * PROBE_BYTES)
    slot = 2 * PROBE_BYTES
    nvme = NvmeTier(check_directory(tmp_path), slot, 4 * slot, AioConfig())
    taken = nvme.allocate_slot()
    assert measured_disk(nvme, host, NOMINAL_RATES).disk_measured
    assert nvme.file.reserved_bytes == slot + PROBE_BYTES and nvme.used_bytes == slot
    assert nvme.allocate_slot() == taken + slot and nvme.file.reserved_bytes == 2 * slot


@pytest.mark.parametrize("work, field", [("device_steps", "device_step_elements_per_s"),
                                         ("device_adam", "device_adam_elements_per_s")])
def test_a_rate_timed_on_the_device_is_taken_only_from_enough_work(work, field):
    rates = Rates(h2d_bytes_per_s=10e9, d2h_bytes_per_s=11e9, host_adam_elements_per_s=3e9)
    elements = random.randint(MIN_MEASURED_ELEMENTS, 10**10)
    seconds = random.uniform(0.01, 5.0)
    timed = with_timed_work(rates, **{work: (elements, seconds)})
    assert getattr(timed, field) == pytest.approx(elements / seconds)
    assert dataclasses.replace(timed, **{field: 0.0}) == rates  # (nothing else changes)
    assert with_timed_work(rates, **{work: (MIN_MEASURED_ELEMENTS - 1, seconds)}) == rates  # too little to time
    assert with_timed_work(rates, **{work: (elements, 0.0)}) == rates


def test_the_ranks_plan_on_one_set_of_rates_the_middle_reading_of_each():
    """Each rank probes its own bus; one probe reading low (49B on 4 H200s: one rank's H2D 35 GiB/s against about
    50) must not give that rank another placement. Every rate is the middle of the ranks' readings, measured only
    where every rank measured it, and one rank's rates stand as they are."""
    rng = random.Random(random.randrange(10**6))
    every = [field.name for field in dataclasses.fields(Rates)]
    fields = [name for name in every if not name.endswith("_measured")]
    flags = [name for name in every if name.endswith("_measured")]
    for _ in range(200):
        ranks = [dataclasses.replace(random_rates(rng), disk_bytes_per_s=rng.uniform(0.5, 3) * 1e9,
                                     device_step_elements_per_s=rng.choice([0.0, rng.uniform(1, 4) * 1e9]),
                                     device_adam_elements_per_s=rng.choice([0.0, rng.uniform(20, 200) * 1e9]),
                                     copies_measured=rng.random() < 0.8, host_adam_measured=rng.random() < 0.8,
                                     disk_measured=rng.random() < 0.8)
                 for _ in range(rng.randint(1, 8))]
        agreed = agreed_rates(ranks)
        for name in fields:
            values = [getattr(rates, name) for rates in ranks]
            below = sum(value < getattr(agreed, name) for value in values)
            above = sum(value > getattr(agreed, name) for value in values)
            assert getattr(agreed, name) in values and below <= (len(values) - 1) // 2 and above <= len(values) // 2
        for flag in flags:
            assert getattr(agreed, flag) == all(getattr(rates, flag) for rates in ranks)
        assert agreed_rates(ranks[:1]) == ranks[0]
    low = dataclasses.replace(NOMINAL_RATES, h2d_bytes_per_s=35 * 2**30)
    assert agreed_rates([NOMINAL_RATES, low, NOMINAL_RATES, NOMINAL_RATES]).h2d_bytes_per_s == 51 * 2**30
    with pytest.raises(ValueError, match="at least one rank"):
        agreed_rates([])


def test_the_plan_counts_the_devices_adam_over_the_groups_it_holds():
    held = 0
    for _ in range(200):
        inputs = random_inputs()
        plan = make_plan(inputs)
        on_device = [c for c in range(inputs.num_chunks) if plan.optimizer_tier[c] == DEVICE]
        assert plan.traffic.device_adam_elements == len(on_device) * inputs.chunk_numel
        held += bool(on_device)
    assert held, "some of the random placements must hold groups on the device"


def test_the_devices_adam_is_timed_where_it_runs_each_step_after_the_warm_up():
    """On CPU by the step clock; each step's span is added when the next step's begins, and the re-plan drops the
    warm-up's."""
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = resident_engine(seed, clip=0.0)
    train_steps(engine, random_batches(seed, count=4, batch=2))
    device = [c for c, group in enumerate(optimizer.store.groups) if group.tier == DEVICE]
    assert device, "the budgets must leave some optimizer groups on the device"
    elements, seconds = optimizer.device_adam.timing.work.take()
    assert elements == 2 * len(device) * optimizer.store.layout.chunk_numel and seconds > 0  # (steps 1 and 2)


def test_a_plan_not_tuned_is_checked_against_its_prediction_with_the_devices_adam(monkeypatch, caplog):
    """No device steps to tune (a count the config fixes, or no host groups): the engine still logs the measured
    step against the plan's prediction, with the device's Adam timed, as a tuning's end does."""
    warmup = importlib.import_module("zero_cache.warmup")
    monkeypatch.setattr(warmup, "tunes_on", lambda device: True)
    monkeypatch.setattr(importlib.import_module("zero_cache.runtime.rates"), "MIN_MEASURED_ELEMENTS", 1)  # (tiny)
    # (the host memory probe runs on a GPU only; here it reads 7 GB/s)
    monkeypatch.setattr(warmup, "measured_host_memory",
                        lambda device, tier, work, known: dataclasses.replace(known, host_memory_bytes_per_s=7e9))
    caplog.set_level(logging.INFO, logger="zero_cache")
    seed = torch.randint(0, 10_000, ()).item()
    engine, optimizer = resident_engine(seed, clip=0.0, device_steps=0)
    applied, apply_plan = [], optimizer.apply_plan

    def recorded(plan, **kwargs):
        applied.append(kwargs)
        return apply_plan(plan, **kwargs)

    monkeypatch.setattr(optimizer, "apply_plan", recorded)
    steps = 1 + SETTLE_STEPS + MEASURED_STEPS + CHECK_STEPS  # (the warm-up, the measured count, the check's steps)
    train_steps(engine, random_batches(seed, count=steps, batch=2))
    tuner = optimizer.observer.tuner  # (settled, it watches the update timing)
    assert tuner.fixed and tuner.done and tuner.measured.keys() == {len(optimizer.device_stepped)}
    assert applied == [{}], "the re-plan's placement, then no count switch: the check only measures"
    line = next(r.getMessage() for r in caplog.records if "the step runs at" in r.getMessage())
    assert "device Adam" in line.split("after backward:")[1].split(";")[0]  # (a term of the work after backward)
    assert "device Adam" in line.split("; at ")[1] and "(measured here)" in line
    moved = optimizer.store.plan.traffic.host_memory_bytes
    assert f"the host's memory moves {moved / 1e9:.1f} GB a step" in line and "host memory 7 GB/s" in line
    optimizer.finish_pending()


class FakeBus:
    """A :class:`~zero_cache.runtime.rates.CopyLoad` without a GPU: the seconds it was asked to last, and the bytes
    its copies moved between two marks (the marks are the clock's readings)."""

    def __init__(self, clock, copy_rate: float) -> None:
        self.clock, self.copy_rate, self.queued = clock, copy_rate, []

    def queue(self, seconds: float) -> None:
        self.queued.append(seconds)

    def mark(self):
        return types.SimpleNamespace(at=self.clock.now)

    def moved_between(self, first, last) -> int:
        return int((last.at - first.at) * self.copy_rate)

    def outlasted(self, first, last) -> bool:
        return True


class FakeClock:
    """Readings that advance only when the host work says it ran."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_host_memory_probe_counts_the_adams_bytes_and_the_copies_beside_it_over_the_adams_seconds(caplog):
    rng = random.Random(random.randrange(10**6))
    clock = FakeClock()
    host = Tier("host", torch.device("cpu"), 3 * MIN_HOST_MEMORY_PROBE_BYTES)
    alone, mixed = rng.uniform(0.01, 0.05), [rng.uniform(0.02, 0.1) for _ in range(HOST_MEMORY_PASSES)]
    pass_bytes, copy_rate = rng.randrange(10**8, 10**9), rng.uniform(10, 90) * 1e9
    seconds = iter([alone, *mixed])
    prepared = []

    def host_work(buffer):
        prepared.append(buffer.numel())
        assert host.used_bytes == buffer.numel()  # (the scratch comes from the host tier)

        def one_pass():
            clock.now += next(seconds)
            return pass_bytes

        return one_pass

    bus = FakeBus(clock, copy_rate)
    rate = host_memory_rate(host, host_work, bus, clock=clock)
    assert prepared == [3 * MIN_HOST_MEMORY_PROBE_BYTES]  # (the room it had, under the 1 GiB it asks)
    assert bus.queued == [pytest.approx(HOST_MEMORY_PASSES * alone * COPY_MARGIN)]  # (to outlast the Adam)
    span = sum(mixed)
    assert rate == pytest.approx((HOST_MEMORY_PASSES * pass_bytes + int(span * copy_rate)) / span)  # (not `alone`)
    assert host.used_bytes == 0
    seconds = iter([alone, *mixed])
    assert host_memory_rate(host, host_work, clock=clock) == pytest.approx(HOST_MEMORY_PASSES * pass_bytes / span)
    small = Tier("host", torch.device("cpu"), MIN_HOST_MEMORY_PROBE_BYTES - 2)
    assert host_memory_rate(small, host_work) is None and small.used_bytes == 0

    bus.outlasted = lambda first, last: False  # (copies that ran out before the passes did)
    seconds = iter([alone, *mixed])
    with caplog.at_level(logging.WARNING, logger="zero_cache"):
        assert host_memory_rate(host, host_work, bus, clock=clock) is None and host.used_bytes == 0
    assert "ended before its Adam's" in caplog.text and "is not used" in caplog.text

    def failing(buffer):
        raise OSError("the host work failed")

    with pytest.raises(OSError):
        host_memory_rate(host, failing)
    assert host.used_bytes == 0  # (given back whatever happens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_host_memory_probes_work_is_the_host_adams_step_over_a_carved_chunk(native_adam, dtype):
    """The probe's work steps a master, its moments and a gradient carved from one scratch buffer as the host's
    step would, and answers its bytes by the step's own count."""
    from zero_cache.optim.host_adam import HostAdam

    adam = HostAdam(True, try_deepspeed=False, try_native=True)
    assert adam.probe_work(torch.float16) is None  # (a gradient dtype the kernel does not take: no probe)
    element_bytes = 12 + dtype.itemsize
    numel = random.randrange(10**4, 10**5)
    buffer = torch.full((numel * element_bytes + random.randrange(element_bytes),), 255, dtype=torch.uint8)
    one_pass = adam.probe_work(dtype)(buffer)
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    master, exp_avg, exp_avg_sq = (torch.zeros(numel) for _ in range(3))
    param = torch.full((numel,), 1e-3, dtype=dtype)
    for step in (1, 2, 3):
        assert one_pass() == numel * host_adam_bytes_per_element(dtype.itemsize)
        torch_fused_adam([master], [param.float()], [exp_avg], [exp_avg_sq], decoupled=True, step=step, **hyper)
        param = master.to(dtype)  # (the pass writes the new weight where its gradient was)
    states = buffer[:12 * numel].view(torch.float32).view(3, numel)
    for got, want in zip(states, (master, exp_avg, exp_avg_sq)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    assert torch.equal(buffer[12 * numel:element_bytes * numel].view(dtype), states[0].to(dtype))  # (the weight)
    assert torch.isfinite(states).all() and master.abs().min() > 0  # (a step taken, not the zeros it started at)
    assert (buffer[element_bytes * numel:] == 255).all()  # (nothing written past the carved chunk)


def test_the_host_memory_is_probed_for_the_gpus_prediction_and_a_failed_probe_keeps_the_known_rates(
        monkeypatch, caplog):
    rates = importlib.import_module("zero_cache.runtime.rates")
    known = random_rates(random.Random(torch.randint(0, 10_000, ()).item()))
    host = Tier("host", torch.device("cpu"), 2 * MIN_HOST_MEMORY_PROBE_BYTES)
    passes = []

    def host_work(buffer):
        return lambda: passes.append(buffer.numel()) or 10**9

    buses = []

    @contextlib.contextmanager
    def copy_load(device, tier, rates_known):
        assert tier is host and rates_known == known  # (the copies queued at the bus's known rates)
        buses.append(FakeBus(FakeClock(), 0.0))
        yield buses[-1]

    monkeypatch.setattr(rates, "copy_load", copy_load)
    assert measured_host_memory(torch.device("cpu"), host, host_work, known) == known  # (no GPU: no check)
    assert measured_host_memory(torch.device("cuda"), host, None, known) == known  # (no host work to time)
    crowded = Tier("host", torch.device("cpu"), HOST_MEMORY_PROBE_ROOM - 1)
    assert measured_host_memory(torch.device("cuda"), crowded, host_work, known) == known  # (no room: no probe)
    assert not passes and not buses and not caplog.records  # (and nothing to warn of)
    started = time.perf_counter()
    probed = measured_host_memory(torch.device("cuda"), host, host_work, known)
    wall = time.perf_counter() - started
    assert len(passes) == 1 + HOST_MEMORY_PASSES and len(buses) == 1 and buses[0].queued
    assert passes == [2 * MIN_HOST_MEMORY_PROBE_BYTES] * (1 + HOST_MEMORY_PASSES)  # (the whole tier, no bus buffers)
    assert probed.host_memory_bytes_per_s > 0 and dataclasses.replace(probed, host_memory_bytes_per_s=0.0) == known
    # (the timed passes' bytes, not the untimed first's, over no more seconds than the whole call took)
    assert probed.host_memory_bytes_per_s >= HOST_MEMORY_PASSES * 10**9 / wall
    assert "host memory" in probed.describe() and host.used_bytes == 0

    def full(*args, **kwargs):
        raise TierFullError("host tier: allocating 256.00 MiB exceeds its budget")

    host.allocate = full
    with caplog.at_level(logging.WARNING, logger="zero_cache"):
        assert measured_host_memory(torch.device("cuda"), host, host_work, known) == known
    assert "the host memory probe failed (TierFullError" in caplog.text
    # (the record keeps the error's text: the error's traceback would keep the probe's buffers alive with it)
    assert not [arg for record in caplog.records for arg in record.args if isinstance(arg, BaseException)]
