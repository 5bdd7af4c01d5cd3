"""What a plan puts in host memory, part by part, and what it costs per parameter (pure: no tensors).

The planner sums a placement's host bytes as it fills the host (``Plan.host_bytes``); :func:`host_bytes` counts the
same bytes again from the finished plan, one part per kind of runtime allocation in the host tier, so a report can say
where they go and a test can hold the two sums against each other. The parts, each allocated once by the runtime:

* the update scratch: one chunk in the state dtype (``ChunkStore.scratch``), whatever the placement;
* the optimizer states of the host groups (``StateHome.allocate`` of the host home);
* the fp32 gradient accumulators of the groups updated by the host's Adam (host and NVMe groups: an NVMe group's
  accumulator stays in RAM), when micro-batches accumulate;
* the param shards at home in host memory, and the pinned buffers NVMe homes are read through
  (:meth:`~zero_cache.plan.home_costs.HomeCosts.host_bytes`);
* the host's Adam staging buffers (``HostUpdater.pool``, and ``gradient_pool`` when accumulating:
  :func:`~zero_cache.plan.state_costs.planned_staging_buffers`), when some group's update goes through them;
* the NVMe state home's bounce buffers, when some group is on NVMe;
* the kept gradients (:mod:`zero_cache.optim.revision`).

The warm-up step's placement is capped by :data:`WARMUP_HOST_FACTOR` (:func:`warmup_host_cap`): its host must not
outgrow the first plan's, so a run's peak host memory is its plans', not the warm-up's.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_cache.plan.home_costs import home_costs
from zero_cache.plan.placement import Plan, PlanInputs
from zero_cache.plan.state_costs import Route, state_costs
from zero_cache.plan.tier_names import HOST
from zero_cache.plan.units import format_bytes

WARMUP_HOST_FACTOR = 1.05
"""The warm-up step's placement (:func:`~zero_cache.resolve.least_footprint_inputs`) takes at most this many times the
host bytes of the first plan (made with the guessed activation reserve). Without a cap the warm-up moved every group the
host could hold off the device: at 13.1B on 1x H200 the run peaked at 112-113 GiB of host RSS on a 128 GiB host while
its settled plan held 63 GiB. At 1.1 (1x H200, 2026-12-03) the host tier's peak was 1.15x the settled plan's at 13.1B
(72.0 GiB against 62.7: the warm-up's 70.9 and ~1.1 GiB more while it re-plans) and 1.19x at 2.78B under a 22 GB cap,
where the issue asks for ~1.1; the first plan's guessed reserve was above the measured activations each time (13.6
GiB against 9.3 at 13.1B, 9.7 against 6.9 at 2.78B, 13.6 against 10.1 at 16.25B). Five percent still leaves the
warm-up's activations a third more room than the first plan at 13.1B (about 19.7 GiB against 14.5), for a guess that
errs low."""


@dataclass(frozen=True, slots=True)
class HostBytes:
    """A plan's host bytes by part (see the module docstring); :attr:`total` is ``Plan.host_bytes``."""

    scratch: int
    """The update scratch chunk in the state dtype."""
    states: int
    """Master and moments of the groups on the host."""
    accumulators: int
    """Gradient accumulators of the groups the host's Adam updates (on the host or on NVMe)."""
    param_homes: int
    """Param shards at home in host memory, and the NVMe homes' pinned buffers."""
    staging: int
    """The host's Adam staging buffers."""
    bounce: int
    """The NVMe state home's bounce buffers."""
    kept: int
    """Kept gradients of the chunks updated during backward."""

    @property
    def total(self) -> int:
        return (self.scratch + self.states + self.accumulators + self.param_homes + self.staging + self.bounce
                + self.kept)


def host_bytes(plan: Plan, inputs: PlanInputs) -> HostBytes:
    """``plan``'s host bytes by part, counted from its placement (the planner counted them as it filled the host).

    Args:
        plan: a plan :func:`~zero_cache.plan.planner.make_plan` made from ``inputs`` (or a device-step count of it).
        inputs: its inputs.
    """
    tiers = plan.optimizer_tier
    host_adam = [c for c, tier in enumerate(tiers) if state_costs(tier).route is Route.HOST_ADAM]
    homes = plan.param_home
    # As the planner's: a shard at home in host memory is its own staging buffer, except while accumulating.
    staged = bool(host_adam) and (inputs.grad_bytes_per_element > 0 or any(
        not homes or home_costs(homes[c // inputs.group_size]).stages_updates for c in host_adam))
    return HostBytes(
        scratch=inputs.scratch_bytes,
        states=tiers.count(HOST) * inputs.chunk_numel * inputs.state_bytes_per_element,
        accumulators=len(host_adam) * inputs.chunk_numel * inputs.grad_bytes_per_element,
        param_homes=sum(home_costs(name).host_bytes(homes.count(name), inputs.param_chunk_bytes)
                        for name in set(homes)),
        staging=inputs.staging_buffers * inputs.param_chunk_bytes if staged else 0,
        bounce=inputs.swap_buffers * inputs.swap_buffer_bytes if any(swapped(tier) for tier in tiers) else 0,
        kept=len(plan.kept_gradients) * inputs.chunk_numel * inputs.kept_bytes_per_element)


def swapped(tier: str) -> bool:
    """A state home this rank updates whose states are not kept in memory (the disk's): it reads them through the
    pinned bounce buffers."""
    costs = state_costs(tier)
    return costs.owned and not costs.resident


def warmup_host_cap(first: Plan, inputs: PlanInputs) -> int:
    """The host budget of the warm-up step's placement: :data:`WARMUP_HOST_FACTOR` times the ``first`` plan's host
    bytes, or, where that is less than one more optimizer group (a small model of few chunks), the first plan's host
    bytes and one group's (states and accumulator): otherwise no group could leave the device at all. Never more than
    ``inputs``' host budget, never less than the first plan's host bytes (which always fit)."""
    grown = max(int(WARMUP_HOST_FACTOR * first.host_bytes), first.host_bytes + inputs.optimizer_chunk_bytes)
    return max(first.host_bytes, min(inputs.host_budget_bytes, grown))


def bytes_per_param(num_bytes: int, num_params: int) -> float:
    """``num_bytes`` per parameter of a model of ``num_params`` (0 for a model without any)."""
    return num_bytes / num_params if num_params else 0.0


def describe_host(settled_bytes: int, num_params: int, warmup_bytes: int | None = None) -> str:
    """``63.20 GiB (5.2 B/param) in the plan, 69.00 GiB (5.7 B/param) at the warm-up``: a plan's host bytes per
    parameter of the model, and the warm-up placement's where it is another."""
    text = f"{format_bytes(settled_bytes)} ({bytes_per_param(settled_bytes, num_params):.1f} B/param)"
    if warmup_bytes is None:
        return text
    return (f"{text} in the plan, {format_bytes(warmup_bytes)} ({bytes_per_param(warmup_bytes, num_params):.1f} "
            "B/param) at the warm-up")
