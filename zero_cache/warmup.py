"""The warm-up step and what follows it: the chunk-order trace, the non-model memory measure, the re-plan, and the
device-step tuning.

The first iteration is the warm-up: forward pre-hooks record the order chunks are used in, and on CUDA the
model's non-model memory is measured (:mod:`zero_cache.runtime.nonmodel`); after the first step the plan is made again
from those measurements and this machine's rates, and shards and optimizer groups move where it changed. With
``device_steps: "auto"`` on a GPU the steps after it choose the device-step count by measured step time
(:mod:`zero_cache.plan.tuning`), and the settled step is logged against the plan's prediction.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from zero_cache.base.sharding import Sharding
from zero_cache.config import ZeroCacheConfig
from zero_cache.optim.optimizer import ZeroCacheOptimizer
from zero_cache.plan.eviction import gathers_per_group
from zero_cache.plan.host_memory import describe_host
from zero_cache.plan.layout import ChunkLayout
from zero_cache.plan.planner import (
    Plan,
    PlanError,
    PlanInputs,
    device_steppable_groups,
    make_plan,
    with_device_step_count,
)
from zero_cache.plan.step_cost import NOMINAL_RATES, agreed_rates
from zero_cache.plan.tier_names import DEVICE, HOST, NVME
from zero_cache.plan.tuning import CHECK_STEPS, RESTARTS, DeviceStepTuner, SettledSteps
from zero_cache.plan.units import format_bytes
from zero_cache.resolve import plan_inputs, resolve_device_steps
from zero_cache.runtime.gathered import RecordedGathers
from zero_cache.runtime.nonmodel import NonModelMeter
from zero_cache.runtime.rates import measured_copies, measured_disk, measured_host_memory, with_timed_work
from zero_cache.runtime.shard_params import agree_working_set, gather_objects

logger = logging.getLogger(__name__)


def with_measured_gathers(inputs: PlanInputs, optimizer: ZeroCacheOptimizer,
                          as_planned: RecordedGathers | None = None) -> PlanInputs:
    """``inputs`` with how often a group is gathered per step, from the warm-up's recorded acquisitions (forward,
    recomputed blocks, backward) under Belady's rule, the one gathering runs (one rank: only groups that stream take a
    slot).
    Of the live slots, ``ahead`` hold groups being gathered ahead of use, so ``max_live - ahead`` keep groups
    for reuse: with that capacity the rule's count is the runtime's (``tests/unit/test_zero_cache_eviction.py``).
    ``as_planned``: that capacity and the streamed groups of the first plan, where the warm-up ran under another
    placement (:meth:`WarmupTracer.warm_up_under`). Unchanged when nothing streams or nothing was recorded."""
    recorded = optimizer.recorded_gathers()
    if recorded is None:
        return inputs
    planned = as_planned or recorded
    slotted = [g for g in recorded.groups if recorded.sharded or g in planned.streamed]
    if not slotted:
        return inputs
    return dataclasses.replace(inputs, gathers_per_step=gathers_per_group(slotted, planned.reuse_slots))


PREDICTION_TOLERANCE = 0.10
"""A measured step this far above the plan's prediction is logged as such."""


def tunes_on(device: torch.device) -> bool:
    """Whether "auto" device steps are tuned by measured step time on ``device``: on a GPU, where they exist."""
    return device.type == "cuda"


def _drop_timed_work(optimizer: ZeroCacheOptimizer) -> None:
    """Forget the host's Adam, device steps and device Adam timed so far: the rates the tuning's end takes come from
    the steps after this."""
    optimizer.restart_step_timings()


class WarmupTracer:
    """Records chunk order in the first forward and re-plans after the first step; then, on a GPU, tunes the
    device-step count and checks the settled step against the plan. The optimizer's :class:`~zero_cache.optim.
    step_observer.StepObserver`, it reads the optimizer through its named surface only.

    Args:
        layout, config, compute_dtype, accumulation_steps: what the run's plans are made from.
        in_backward: host chunks update during backward.
        tiers: the tiers the store was built on (tier name -> tier): the re-plan's budgets and rate probes.
        sharding, shard_params: the data-parallel ranks, and whether params are gathered on use.
    """

    def __init__(self, layout: ChunkLayout, config: ZeroCacheConfig, compute_dtype: torch.dtype,
                 accumulation_steps: int, in_backward: bool, tiers: dict[str, Any], *, sharding: Sharding,
                 shard_params: bool) -> None:
        self.layout, self.config, self.compute_dtype = layout, config, compute_dtype
        self.accumulation_steps = accumulation_steps
        self.in_backward = in_backward
        self.tiers, self.sharding, self.shard_params = tiers, sharding, shard_params
        self.trace: list[int] = []
        self.recording = True
        self.tune_device_steps = resolve_device_steps(config, gpu=tunes_on(tiers[DEVICE].device)).tuned
        """Choose the device-step count by measured step time after the re-plan (:mod:`zero_cache.plan.tuning`)."""
        self.watching = False
        """Whether the steps after the re-plan are told to the tuner (until its restarts are spent)."""
        self.tuner: DeviceStepTuner | None = None
        """The device-step count's tuning, or on a GPU without one a fixed tuner that measures the plan's count."""
        self.settled_steps: SettledSteps | None = None
        """The steps since the tuning settled, until the step's check is taken over them."""
        self.inputs: PlanInputs | None = None
        """The inputs of the plan in force (the re-plan's)."""
        self.rates = NOMINAL_RATES
        """The rates plans are made at: measured on this machine from the warm-up step on
        (:mod:`zero_cache.runtime.rates`)."""
        self.gathers_as_planned: RecordedGathers | None = None
        """Gathered params, where the warm-up ran under another placement than the first plan's: that plan's slots
        that keep groups for reuse, and its streamed groups (the re-plan estimates gathers as it would have)."""
        self.activation_reserve_bytes: int | None = None
        """Device bytes the re-plan held back for activations: the non-model peak the warm-up measured (activations,
        library workspaces, fragmentation)."""
        self.meter: NonModelMeter | None = None
        """The warm-up's measure of non-model device memory (on CUDA), sampled by :attr:`sampling_hooks`."""
        self.sampling_hooks: list[Any] = []

    def warm_up_under(self, optimizer: ZeroCacheOptimizer, first: Plan) -> None:
        """The warm-up step runs under another placement than the ``first`` plan's (``optimizer`` was built with the
        warm-up's): the re-plan estimates gathers as under the first plan."""
        self.gathers_as_planned = optimizer.recorded_gathers(under=first)

    # ------------------------------------------------------------------ the optimizer's StepObserver
    def after_first_step(self, optimizer: ZeroCacheOptimizer) -> None:
        """The warm-up step is done: re-plan."""
        self.replan(optimizer)

    def after_step(self, optimizer: ZeroCacheOptimizer, step_seconds: float) -> None:
        """A later step: the tuning's, or the check's (nothing once they are done, or where there is neither)."""
        if self.watching:
            self._tune_step(optimizer, step_seconds)

    def record(self, chunks: list[int]) -> None:
        if self.recording:
            self.trace.extend(chunks)

    def measure(self, module: nn.Module, params: list[nn.Parameter], meter: NonModelMeter) -> None:
        """Measure the warm-up step's non-model memory with ``meter``, sampled before and after every submodule's
        forward (recomputed blocks too) and as each gradient lands, until the re-plan."""
        self.meter = meter

        def sample(*_args: Any) -> None:
            meter.sample()

        for submodule in module.modules():
            self.sampling_hooks.append(submodule.register_forward_pre_hook(sample))
            self.sampling_hooks.append(submodule.register_forward_hook(sample, always_call=True))
        self.sampling_hooks += [param.register_post_accumulate_grad_hook(sample) for param in params]
        meter.start()

    def _measured_nonmodel_bytes(self) -> int:
        """The warm-up's non-model peak (0 where nothing was measured: a CPU run), its sampling hooks removed."""
        for handle in self.sampling_hooks:
            handle.remove()
        self.sampling_hooks = []
        if self.meter is None:
            return 0
        self.meter.sample()  # the optimizer step's interval
        logger.info("ZeRO-Cache warm-up measured %s of non-model device memory over %d samples (the allocator's "
                    "peak %s, its slack %s; the engine's own buffers not counted)",
                    format_bytes(self.meter.peak_bytes()), self.meter.samples,
                    format_bytes(self.meter.allocated_bytes), format_bytes(self.meter.slack_bytes))
        return self.meter.peak_bytes()

    def replan(self, optimizer: ZeroCacheOptimizer) -> Plan | None:
        """Plan again from the recorded trace and measured peak; move groups whose tier changed."""
        self.recording = False
        device_tier, host_tier, nvme_tier = self.tiers[DEVICE], self.tiers[HOST], self.tiers.get(NVME)
        optimizer.finish_pending()  # the warm-up's host updates are done, and timed
        self.activation_reserve_bytes = self._measured_nonmodel_bytes()
        # The bus now (after the peak was read). Not the host's Adam: in the warm-up it ran at 1.0 G elements/s where
        # the next steps ran at 3.9 (2.7B on an H100: first touches of its states), so its rate is taken
        # from the steps after it.
        _drop_timed_work(optimizer)  # (the warm-up's ran beside its streaming, as the later steps' do not)
        self.rates = measured_copies(device_tier.device, host_tier, self.rates)
        self.rates = measured_host_memory(device_tier.device, host_tier,
                                          optimizer.host_adam_probe(self.compute_dtype), self.rates)
        # The disk through a bounce buffer of the state homes where groups pass through one (their buffers are in
        # the host's plan), else from the host tier's room.
        with optimizer.lent_bounce_buffer() as bounce:
            self.rates = measured_disk(nvme_tier, host_tier, self.rates, bounce)
        self.rates = agreed_rates(gather_objects(self.sharding)(self.rates))  # (one rank's probe may read low)
        inputs = plan_inputs(self.layout, self.config, self.compute_dtype, device_tier.budget_bytes,
                             host_tier.budget_bytes, self.accumulation_steps, tuple(self.trace),
                             self.activation_reserve_bytes,
                             nvme_budget=nvme_tier.budget_bytes + nvme_tier.split_bytes if nvme_tier is not None else 0,
                             sharding=self.sharding, shard_params=self.shard_params, in_backward=self.in_backward,
                             gpu=device_tier.device.type == "cuda", rates=self.rates)
        inputs = with_measured_gathers(inputs, optimizer, self.gathers_as_planned)
        plan, failure = None, "it failed on another data-parallel rank"
        try:
            plan = make_plan(inputs)
        except PlanError as err:  # the running plan works; a worse estimate must not stop the run
            # The text, not the error: a log record keeps its args, and the error's traceback would keep
            # this frame's optimizer (and its pinned memory and swap file) alive for as long as the record.
            failure = str(err)
        # Each rank measured its own peak: the ranks agree on one working set, or all keep the current one.
        plan = agree_working_set(plan, gather_objects(self.sharding))
        if plan is None:
            logger.warning("ZeRO-Cache re-plan after warm-up failed, keeping the current placement: %s", failure)
            return None
        steppable = len(device_steppable_groups(inputs, plan))
        tuning = ""
        if self.tune_device_steps and steppable:
            planned = len(plan.device_stepped)
            self.tuner = DeviceStepTuner(planned, steppable)
            if self.tuner.current != planned:  # (the count the tuning tries first)
                plan = with_device_step_count(inputs, plan, self.tuner.current)
                tuning = (f"; the plan's floor steps {planned} host groups on the device, the tuning starts at "
                          f"{len(plan.device_stepped)}")
            self.watching = True
        elif tunes_on(device_tier.device):  # (no tuning: the step is still checked against the plan's prediction)
            self.tuner = DeviceStepTuner(len(plan.device_stepped), len(plan.device_stepped), fixed=True)
            self.watching = True
        warmup_host_bytes = optimizer.plan.host_bytes  # (the placement the warm-up ran under, still in force)
        moved = optimizer.apply_plan(plan)
        logger.info("ZeRO-Cache re-plan after warm-up (non-model peak %d MiB; %s): %s; %d groups moved%s; host: %s "
                    "(the host tier's peak so far %s)", self.activation_reserve_bytes // 2**20, self.rates.describe(),
                    plan.summary(), moved, tuning,
                    describe_host(plan.host_bytes, self.layout.used_numel, warmup_host_bytes),
                    format_bytes(host_tier.peak_bytes))
        self.inputs = inputs
        return plan

    def _tune_step(self, optimizer: ZeroCacheOptimizer, step_seconds: float) -> None:
        """A step measured under the tuner's count: switch to the next count to try, or settle on the fastest (and,
        settled, watch for a change of the update timing that starts the tuning over). A fixed tuner's (a plan not
        tuned) only measures. Once settled, the next :data:`~zero_cache.plan.tuning.CHECK_STEPS` steps are checked
        against the plan's prediction (:class:`~zero_cache.plan.tuning.SettledSteps`)."""
        settled, restarts = self.tuner.done, self.tuner.restarts
        waited = optimizer.last_updates_after_backward
        count = self.tuner.observe(step_seconds, waited_for_norm=waited)
        if self.tuner.restarts > restarts:
            _drop_timed_work(optimizer)  # (what ran under the other timing: the rates are taken from the new one)
            self.settled_steps = None
            logger.info("ZeRO-Cache: the host updates now %s; %s",
                        "wait for the global norm (the last step clipped)" if waited
                        else "run in backward (the last step did not clip)",
                        "the step's check against the plan starts over" if self.tuner.fixed else
                        f"the device-step tuning starts over at {self.tuner.current} groups")
        if not self.tuner.done:
            if count is not None:
                optimizer.apply_plan(with_device_step_count(self.inputs, optimizer.plan, count),
                                     count_switch=True, trial=True)
            return
        if not settled:
            self._settle(optimizer)
            return
        if self.settled_steps is not None and self.settled_steps.add(step_seconds, optimizer.last_backward_seconds,
                                                                     waited_for_norm=waited):
            self._check(optimizer)

    def _settle(self, optimizer: ZeroCacheOptimizer) -> None:
        """The tuning is done: the best count goes in force, at the rates the tuning measured, and the steps after
        it are collected for the check."""
        if not self.tuner.fixed:
            logger.info("ZeRO-Cache host groups stepped on the device, by measured step time: %s",
                        self.tuner.summary())
        # The warm-up timed the host's Adam over one step; the tuning steps time it over several, under every
        # count: the plan's floor is worked out again at that rate (the same placement, nothing moves). The device
        # steps' own rate and the device's Adam, timed over the same steps, go into the step's prediction only.
        self._measure_rates(optimizer)
        if not self.tuner.fixed:
            optimizer.apply_plan(with_device_step_count(self.inputs, optimizer.plan, self.tuner.best),
                                 count_switch=True)
        self.settled_steps = SettledSteps()

    def _check(self, optimizer: ZeroCacheOptimizer) -> None:
        """The settled steps against the plan's prediction, at the rates timed over them (the host's Adam, the device
        steps, the device's Adam); then nothing is left to watch for once the tuning's restarts are spent."""
        steps, self.settled_steps = self.settled_steps, None
        self._measure_rates(optimizer)
        plan = optimizer.plan
        plan = replace(plan, traffic=replace(plan.traffic, rates=self.rates))
        self._log_prediction(steps.step, steps.backward, plan, updates_after_backward=bool(steps.waited_for_norm),
                             tuned=self.tuner.measured[self.tuner.best])
        if self.tuner.restarts >= RESTARTS:
            self.watching = False

    def _measure_rates(self, optimizer: ZeroCacheOptimizer) -> None:
        """The rates with what the steps since the re-plan timed: the host's Adam (the warm-up timed it over one
        step), and for the step's prediction only, the device steps and the device's Adam."""
        timed = optimizer.step_timings()
        self.rates = with_timed_work(self.rates, host_adam=timed.host_adam, device_steps=timed.device_steps,
                                     device_adam=timed.device_adam)
        self.inputs = replace(self.inputs, rates=self.rates)

    def _log_prediction(self, measured: float, backward: float | None, plan: Plan, *,
                        updates_after_backward: bool, tuned: float) -> None:
        """The settled step against what the plan predicts for it once its backward is measured
        (:meth:`~zero_cache.plan.step_cost.StepTraffic.predicted_step`), and what bounds it; ``tuned``: what the
        tuning measured for the count, said where it differs from the settled step by more than the tolerance."""
        traffic = plan.traffic
        if backward is None:  # (no backward timed: the whole step's floors alone)
            floors = traffic.whole_step_floors()
            bound = max(floors, key=floors.__getitem__)
            predicted = floors[bound]
        else:
            predicted, bound = traffic.predicted_step(backward, updates_after_backward=updates_after_backward)
        off = measured / predicted - 1 if predicted else float("inf")
        after = traffic.after_backward_floors(backward or 0.0, updates_after_backward=updates_after_backward)
        verdict = ("" if abs(off) <= PREDICTION_TOLERANCE else
                   ": more than the tolerance above it, the forward's compute or waits the plan does not count bound it"
                   if off > 0 else ": below it, the plan's rates are slower than the step's")
        host_memory = (f"; the host's memory moves {traffic.host_memory_bytes / 1e9:.1f} GB a step"
                       if self.rates.host_memory_bytes_per_s else "")
        trials = ("" if abs(tuned / measured - 1) <= PREDICTION_TOLERANCE else
                  f"; the tuning measured {tuned:.3f} s for this count, its steps "
                  f"{'slower' if tuned > measured else 'faster'} than those after it")
        logger.info("ZeRO-Cache: the step runs at %.3f s (the median of %d after the tuning%s); the plan predicts at "
                    "least %.3f s (%+.0f%%), bound by %s (backward %s; the updates %s; after backward: %s%s; at %s)%s",
                    measured, CHECK_STEPS, trials, predicted, 100 * off, bound,
                    "not timed" if backward is None else f"{backward:.3f} s",
                    "waited for the global norm" if updates_after_backward else "ran in backward",
                    ", ".join(f"{stream} {seconds:.3f} s" for stream, seconds in after.items()), host_memory,
                    self.rates.describe(), verdict)
