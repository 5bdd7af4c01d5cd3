"""A ``zero_cache`` section resolved before the first plan (pure, no tensors allocated): the tiers' budgets, the
activation reserve, the chunk layout and the update timing, and the planner's inputs made from them.

:func:`~zero_cache.attach.attach`, :func:`~zero_cache.attach.dry_run` and ``pretrain.py --plan`` all go through
:func:`resolve`, so the "auto" values are worked out in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from zero_cache.base.sharding import Sharding
from zero_cache.config import ZeroCacheConfig
from zero_cache.plan.host_memory import warmup_host_cap
from zero_cache.plan.layout import ChunkLayout, pack, search_chunk_size
from zero_cache.plan.planner import DEVICE_MARGIN_FRACTION, Plan, PlanError, PlanInputs, make_plan
from zero_cache.plan.state_costs import SWAP_BUFFERS, planned_staging_buffers
from zero_cache.plan.step_cost import NOMINAL_RATES, Rates, state_bytes_per_element
from zero_cache.plan.tier_names import HOST, NVME
from zero_cache.plan.units import AUTO, parse_budget
from zero_cache.plan.working_set import GRADIENT_BUCKETS, GROUPS_IN_USE, WorkingSet
from zero_cache.runtime.shard_params import gather_ahead_groups, max_live_groups
from zero_cache.storage.hardware import Hardware, TierBudgets, tier_budgets

ACTIVATION_RESERVE_FRACTION = 0.1
"""Share of the device budget held back for activations until the warm-up has measured them..."""
ACTIVATION_RESERVE_FLOOR_BYTES = 12 * 2**30
"""...and at least this much (or half the budget, if less): a 13B model's activations at micro-batch 8, sequence
1024, with checkpointing. A small GPU must not run out of memory in the first step."""


def first_activation_reserve_bytes(config: ZeroCacheConfig, device: torch.device, device_budget: int) -> int:
    """Device bytes for activations in the first plan (``zero_cache.activation_memory``; none on CPU)."""
    configured = parse_budget(config.activation_memory, name="zero_cache.activation_memory")
    if configured is not None:
        return configured
    if device.type != "cuda":
        return 0
    return int(max(ACTIVATION_RESERVE_FRACTION * device_budget, min(device_budget / 2, ACTIVATION_RESERVE_FLOOR_BYTES)))



def activation_room_bytes(inputs: PlanInputs, plan: Plan) -> int:
    """Device bytes ``plan`` leaves for activations and workspace: the budget after the margin, less every byte
    it places there (params, live groups, optimizer groups, the update scratch, the gradient buckets)."""
    return int(inputs.device_budget_bytes * (1 - inputs.margin_fraction)) - plan.device_bytes


def least_footprint_plan(inputs: PlanInputs) -> Plan:
    """The placement of ``inputs`` that leaves the device the most room for activations: the plan
    :func:`~zero_cache.plan.planner.make_plan` makes for :func:`least_footprint_inputs`.

    The warm-up step runs under it when its activations are not known yet (``activation_memory: "auto"`` on a
    GPU), so a guessed reserve cannot run it out of memory; the layout and whether params are gathered are
    decided before, with the guess, and the re-plan after the step places everything by the measured peak.

    Raises:
        PlanError: ``inputs`` itself does not fit (``make_plan``'s message).
    """
    return make_plan(least_footprint_inputs(inputs))


def least_footprint_inputs(inputs: PlanInputs) -> PlanInputs:
    """``inputs`` with the largest ``activation_reserve_bytes`` (at least their own) that ``make_plan`` still fits,
    found by bisection to the byte.

    What the device gives up goes to the host, up to :func:`~zero_cache.plan.host_memory.warmup_host_cap` (the first
    plan's host bytes, the plan made with ``inputs``, times :data:`~zero_cache.plan.host_memory.WARMUP_HOST_FACTOR`,
    or with one optimizer group's bytes more where that is more: a model of few chunks), and to the disk no more than
    the first plan puts there (moving groups onto the disk for one step costs it writes and reads, and the host bounce
    buffers they take stay allocated while the re-plan moves groups back into host memory); what they cannot hold
    stays on the device. Everything else (params gathered or not, homes allowed, the chunks' order) is ``inputs``'.
    Any smaller reserve fits too, so ranks may agree on the least of theirs.

    What is guaranteed (``tests/unit/test_zero_cache_host_memory.py`` checks both on random inputs): the first plan's
    placement fits the capped budgets, so the reserve found is at least ``inputs``' and the warm-up leaves at least
    the first plan's room for activations; and the warm-up's host bytes are at most the cap. Not guaranteed: that the
    warm-up needs at most ~10% more host than the run's settled plan (the re-plan, by the measured activations). With
    resident params and no disk tier the settled plan holds at least the first plan's host bytes where the measured
    peak is at least the guess (what the device gives up goes to the host), and the test checks that there; gathered
    params trade shards' homes against groups by the step's cost, and a disk tier bounce buffers against host
    groups, so their host bytes need not grow with the reserve. Where the guess was too large, the settled plan gives
    groups back to the device and holds less host than the first plan, and the warm-up may exceed it by more than
    10% (the logs and ``--plan`` say both figures).

    Raises:
        PlanError: ``inputs`` itself does not fit (``make_plan``'s message).
    """
    plan = make_plan(inputs)
    inputs = replace(inputs, nvme_budget_bytes=min(inputs.nvme_budget_bytes, plan.nvme_bytes),
                     host_budget_bytes=warmup_host_cap(plan, inputs))
    # Feasibility only falls as the reserve grows: every placement's device room shrinks, and what leaves the
    # device adds to the host and disk. A budget's worth cannot fit (the room is negative), so bisection holds
    # "fits" <= the largest that fits < "too_much".
    fits, too_much = inputs.activation_reserve_bytes, inputs.device_budget_bytes + 1
    while too_much - fits > 1:
        middle = (fits + too_much) // 2
        try:
            make_plan(replace(inputs, activation_reserve_bytes=middle))
            fits = middle
        except PlanError:
            too_much = middle
    return replace(inputs, activation_reserve_bytes=fits)


def build_layout(shapes: list[tuple[str, tuple[int, ...]]], config: ZeroCacheConfig,
                 max_chunk_numel: int | None = None) -> ChunkLayout:
    """Pack parameters ((name, shape) in model order) into chunks of the configured or searched size (searched at
    most ``max_chunk_numel`` when a larger tensor does not force more)."""
    if config.chunk_size != "auto":
        return pack(shapes, int(config.chunk_size))
    return pack(shapes, search_chunk_size(shapes, max_numel=max_chunk_numel))


def chunk_numel_cap(config: ZeroCacheConfig, device_budget: int, activation_reserve_bytes: int,
                    compute_dtype: torch.dtype, sharding: Sharding) -> int:
    """The largest chunk whose fixed device share still fits the budget with streamed params: the scratch chunk
    (state dtype) and the wanted working set's gradient buckets and fewest live groups, each ``world_size`` chunks wide.

    A small device must get small chunks, or the few slots a streamed model needs do not fit at all (and where
    they still do not, at the floor the largest tensor sets, the planner shrinks the working set).
    """
    param_bytes = torch.empty((), dtype=compute_dtype).element_size()
    ahead = max(1, config.prefetch_depth) if not sharding.sharded else 1
    wanted = WorkingSet(ahead=ahead, live_groups=0, buckets=GRADIENT_BUCKETS)
    per_element = config.state_itemsize + (wanted.buckets + wanted.fewest_live) * sharding.world_size * param_bytes
    room = int(device_budget * (1 - DEVICE_MARGIN_FRACTION)) - activation_reserve_bytes
    return max(1, room // per_element)


def grad_bytes_per_element(accumulation_steps: int, state_itemsize: int = 4) -> int:
    """Accumulators in the state dtype when micro-batches accumulate; none when gradients are written over the
    params."""
    return state_itemsize if accumulation_steps > 1 else 0


def resolve_update_in_backward(config: ZeroCacheConfig, *, accumulation_steps: int, world_size: int) -> bool:
    """Whether host chunks update during backward ("auto": wherever it is built). The update stays exact
    under clipping, loss scaling and skipped steps by keeping each such chunk's gradient
    (:mod:`zero_cache.optim.revision`); data-parallel ranks that accumulate micro-batches update after backward, and so
    do bf16 states: a bf16 step cannot be taken back exactly (its rounded master and moments do not invert), and the
    revision's exactness is the point of it."""
    if config.state_dtype != "fp32":
        if config.update_in_backward is True:
            raise ValueError(f"zero_cache.update_in_backward is true, but the optimizer states are "
                             f"{config.state_dtype} (bf16.bf16_master_weights_and_grads with bf16_optimizer_states): "
                             "host chunks update after backward there, since a bf16 step cannot be taken back "
                             "exactly when the step clips. Set it to \"auto\" or false")
        return False
    if accumulation_steps > 1 and world_size > 1:
        if config.update_in_backward is True:
            raise ValueError(f"zero_cache.update_in_backward is true, but with {world_size} data-parallel ranks and "
                             f"gradient_accumulation_steps {accumulation_steps} host chunks update after backward "
                             "(the update during the last micro-batch's backward is built for one rank). Set it "
                             "to \"auto\" or false")
        return False
    return config.update_in_backward in (True, AUTO)


@dataclass(frozen=True, slots=True)
class DeviceStepCount:
    """``zero_cache.device_steps`` resolved (:func:`resolve_device_steps`)."""

    planned: int | None
    """The planner's count of host groups stepped on the device: at most that many, or None for the count with the
    cheapest step (:attr:`PlanInputs.device_steps <zero_cache.plan.placement.PlanInputs.device_steps>`)."""
    tuned: bool
    """Whether the steps after the warm-up choose the count by measured step time (:mod:`zero_cache.plan.tuning`)."""


def resolve_device_steps(config: ZeroCacheConfig, *, gpu: bool) -> DeviceStepCount:
    """The one place ``device_steps: "auto"`` is read: on a GPU the planner's cheapest count, then tuned by measured
    step time; without one, none (there is no device to step host groups on). A number is the count, not tuned.
    Not with bf16 states: the device steps' copies go through the update scratch as fp32 pieces."""
    if config.state_dtype != "fp32":
        if config.device_steps not in (AUTO, 0):
            raise ValueError(f"zero_cache.device_steps: {config.device_steps} host groups stepped on the device is "
                             f"not built for {config.state_dtype} optimizer states (bf16.bf16_master_weights_and_grads "
                             "with bf16_optimizer_states): set it to \"auto\" or 0 (the host's Adam steps them)")
        return DeviceStepCount(planned=0, tuned=False)
    if config.device_steps != AUTO:
        return DeviceStepCount(planned=config.device_steps, tuned=False)
    return DeviceStepCount(planned=None, tuned=True) if gpu else DeviceStepCount(planned=0, tuned=False)


def plan_inputs(layout: ChunkLayout, config: ZeroCacheConfig, compute_dtype: torch.dtype, device_budget: int,
                host_budget: int, accumulation_steps: int, trace: tuple[int, ...] = (),
                activation_reserve_bytes: int = 0, nvme_budget: int = 0, sharding: Sharding = Sharding(),
                shard_params: bool = False, in_backward: bool = False, gpu: bool = False,
                rates: Rates = NOMINAL_RATES) -> PlanInputs:
    """What the planner needs; ``shard_params``: params are gathered on use (sharded over the ranks, or, on one
    rank, streamed from homes on the host); ``in_backward``: host chunks update during backward (one
    micro-batch per step: each wants a kept gradient); ``gpu``: the device is a GPU (host groups may be
    stepped there); ``rates``: what placements are compared at."""
    param_bytes = torch.empty((), dtype=compute_dtype).element_size()
    buckets = GRADIENT_BUCKETS if shard_params or (sharding.sharded and accumulation_steps > 1) else 0
    live = 0
    ahead = gather_ahead_groups(config, layout, sharding)
    if shard_params:
        # One rank: more live groups than the fewest would only spare a few re-fetches in backward, and
        # every one of them is room not given to a resident shard or an optimizer group.
        live = max_live_groups(config, layout, sharding) if sharding.sharded else ahead + GROUPS_IN_USE
    return PlanInputs(num_chunks=layout.num_chunks, chunk_numel=layout.chunk_numel,
                      owned=sharding.owned(layout.num_chunks), gradient_buckets=buckets,
                      param_chunks_held=sharding.num_groups(layout.num_chunks) if shard_params else None,
                      group_size=sharding.world_size, param_home=config.param_home, live_groups=live,
                      param_homes_off_device=(HOST, NVME) if config.nvme_param_homes else (HOST,),
                      gather_ahead=ahead,
                      padding_chunks=sharding.padded_chunks(layout.num_chunks) - layout.num_chunks,
                      param_bytes_per_element=param_bytes,
                      grad_bytes_per_element=grad_bytes_per_element(accumulation_steps, config.state_itemsize),
                      state_bytes_per_element=state_bytes_per_element(config.state_itemsize),
                      device_budget_bytes=device_budget, host_budget_bytes=host_budget, trace=trace,
                      activation_reserve_bytes=activation_reserve_bytes,
                      staging_buffers=planned_staging_buffers(accumulation_steps),
                      nvme_budget_bytes=nvme_budget, nvme_path_set=config.nvme_path is not None,
                      swap_buffers=SWAP_BUFFERS,
                      kept_bytes_per_element=param_bytes if in_backward and accumulation_steps == 1 else 0,
                      device_steps=resolve_device_steps(config, gpu=gpu).planned,
                      rates=rates)


@dataclass(frozen=True, slots=True)
class Resolved:
    """A ``zero_cache`` section's "auto" values resolved for one rank before its first plan (:func:`resolve`):
    what :func:`attach` builds from and :func:`dry_run` plans from, worked out in one place."""

    budgets: TierBudgets
    """The tiers' byte budgets ("auto": measured here, or from a described machine)."""
    activation_reserve_bytes: int
    """Device bytes held back for activations until the warm-up measures them
    (:func:`first_activation_reserve_bytes`)."""
    layout: ChunkLayout
    """The chunks, of the configured size or the one searched under the device's cap (:func:`chunk_numel_cap`)."""
    update_in_backward: bool
    """Host chunks update during backward (:func:`resolve_update_in_backward`)."""

    def plan_inputs(self, config: ZeroCacheConfig, compute_dtype: torch.dtype, accumulation_steps: int,
                    sharding: Sharding, shard_params: bool, gpu: bool) -> PlanInputs:
        """The first plan's inputs for ``sharding``'s rank, params gathered on use or not."""
        return plan_inputs(self.layout, config, compute_dtype, self.budgets.device_bytes, self.budgets.host_bytes,
                           accumulation_steps, activation_reserve_bytes=self.activation_reserve_bytes,
                           nvme_budget=self.budgets.nvme_bytes, sharding=sharding, shard_params=shard_params,
                           in_backward=self.update_in_backward, gpu=gpu)


def resolve(shapes: list[tuple[str, tuple[int, ...]]], config: ZeroCacheConfig, *, compute_dtype: torch.dtype,
            device: torch.device, accumulation_steps: int, sharding: Sharding, hardware: Hardware | None = None,
            moving_device_bytes: int = 0, moving_host_bytes: int = 0) -> Resolved:
    """Budgets, activation reserve, layout and update timing of one rank, from the config and the parameter shapes.

    Args:
        shapes: (name, shape) of the trainable parameters in model order.
        sharding: the data-parallel ranks (its ``ranks_per_host`` share a host's RAM and disk).
        hardware, moving_device_bytes, moving_host_bytes: as for :func:`~zero_cache.storage.hardware.tier_budgets`.

    Raises:
        NvmeSetupError: measuring here, and nvme_path is missing or not writable.
        ValueError: a configured chunk size below the largest parameter, or an update timing the ranks refuse.
    """
    budgets = tier_budgets(config, device, sharding.ranks_per_host, hardware, moving_device_bytes=moving_device_bytes,
                           moving_host_bytes=moving_host_bytes)
    # Before the warm-up has measured activations, keep part of the device for them; the re-plan
    # after the first step replaces this guess with the measured peak (and moves groups back).
    activation_reserve_bytes = first_activation_reserve_bytes(config, device, budgets.device_bytes)
    layout = build_layout(shapes, config, chunk_numel_cap(config, budgets.device_bytes, activation_reserve_bytes,
                                                          compute_dtype, sharding))
    in_backward = resolve_update_in_backward(config, accumulation_steps=accumulation_steps,
                                             world_size=sharding.world_size)
    return Resolved(budgets, activation_reserve_bytes, layout, in_backward)
