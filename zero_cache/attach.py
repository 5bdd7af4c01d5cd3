"""Putting a module under ZeRO-Cache: layout -> tiers -> plan -> storage -> hooks -> hybrid Adam.

The first iteration is the warm-up (:mod:`zero_cache.warmup`): forward pre-hooks record the order chunks are
used in, and on CUDA the model's non-model memory is measured; after the first step the plan is made again from
those measurements and optimizer groups move between tiers if it changed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from zero_cache.base.sharding import Sharding
from zero_cache.config import ZeroCacheConfig
from zero_cache.optim.optimizer import ZeroCacheOptimizer
from zero_cache.plan.host_memory import describe_host
from zero_cache.plan.layout import ChunkLayout
from zero_cache.plan.planner import Plan, PlanError, PlanInputs, make_plan
from zero_cache.plan.tier_names import DEVICE, HOST, NVME
from zero_cache.plan.units import AUTO, format_bytes
from zero_cache.plan.working_set import WorkingSet, capped
from zero_cache.resolve import Resolved, activation_room_bytes, least_footprint_inputs, least_footprint_plan, resolve
from zero_cache.runtime.nonmodel import AllocatorStats, CudaAllocatorStats, NonModelMeter
from zero_cache.runtime.shard_params import (
    agree_working_set,
    candidate_plans,
    choose_shard_params,
    choose_streaming,
    decide_shard_params,
    device_groups,
    gather_ahead_groups,
    gather_objects,
    register_saving_hooks,
    wanted_placement,
)
from zero_cache.storage.chunks import ChunkStore
from zero_cache.storage.hardware import Hardware
from zero_cache.storage.nvme import NvmeTier
from zero_cache.storage.state_homes.home import STATE_DTYPES
from zero_cache.storage.tiers import build_tiers, use_expandable_segments
from zero_cache.warmup import WarmupTracer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DryRun:
    """What :func:`dry_run` found for rank 0: the values it resolved and the first plan :func:`attach` would make."""

    resolved: Resolved
    plan: Plan
    warmup_room_bytes: int | None = None
    """Device bytes the warm-up step leaves for activations, where it runs at the plan's least device footprint
    (:func:`warms_up_at_least_footprint`): rank 0's own (several ranks run it at the least of theirs); None where
    it runs under ``plan``."""
    warmup_host_bytes: int | None = None
    """Host bytes of that warm-up placement (at most :func:`~zero_cache.plan.host_memory.warmup_host_cap` of
    ``plan``'s); None where the warm-up runs under ``plan``."""

    @property
    def layout(self) -> ChunkLayout:
        return self.resolved.layout


def working_set_given_up(inputs: PlanInputs, plan: Plan) -> str:
    """What ``plan`` gave up of the working set ``inputs`` wanted (:mod:`zero_cache.plan.working_set`), for the log;
    empty when it kept it (within the groups there are)."""
    groups = inputs.param_chunks_held if plan.params_sharded else inputs.num_chunks
    wanted = capped(WorkingSet(ahead=inputs.gather_ahead, live_groups=inputs.live_groups,
                               buckets=inputs.gradient_buckets), groups)
    parts = [f"{plan.gather_ahead} of {wanted.ahead} groups fetched ahead"] if (
        plan.params_sharded and plan.gather_ahead < wanted.ahead) else []
    if plan.gradient_buckets < wanted.buckets:
        parts.append(f"{plan.gradient_buckets} of {wanted.buckets} gradient buckets "
                     "(each reduction waited for at once)")
    return ", ".join(parts)


def warms_up_at_least_footprint(config: ZeroCacheConfig, device: torch.device) -> bool:
    """Whether the warm-up step runs under the plan's least device footprint (:func:`~zero_cache.resolve.
    least_footprint_plan`): on a GPU with ``activation_memory: "auto"``, where the reserve is a guess. A configured
    reserve is the user's; a CPU run measures no activations (its re-plan sees none)."""
    return config.activation_memory == AUTO and device.type == "cuda"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def dry_run(shapes: list[tuple[str, tuple[int, ...]]], config: ZeroCacheConfig, *, compute_dtype: torch.dtype,
            device: torch.device, accumulation_steps: int = 1, world_size: int = 1,
            ranks_per_host: int | None = None, hardware: Hardware | None = None, moving_device_bytes: int = 0,
            moving_host_bytes: int = 0) -> DryRun:
    """Rank 0's resolved budgets, reserve and layout, and the first plan :func:`attach` would make, without
    allocating anything (``pretrain.py --plan`` reports them, so they are worked out once, as attach does).

    Args:
        shapes: (name, shape) of the trainable parameters in model order (a meta-device model gives them).
        config, compute_dtype, device, accumulation_steps: as for :func:`attach`; "auto" budgets are
            measured now (nothing of the model is resident yet), as if every rank's device and host
            share were this machine's.
        world_size, ranks_per_host: data-parallel ranks, in hosts of this many (default: all on one host).
            Every rank is planned (each owns other chunks), and sharded params decided as the ranks would.
        hardware: plan for this machine, not the one running: "auto" budgets come from its sizes, its NVMe
            space (if any) is the disk tier, and the device is a GPU (:mod:`zero_cache.storage.hardware`).
        moving_device_bytes, moving_host_bytes: bytes of the parameters already stored on the device / in host
            memory, which attach would move into the chunks: added to "auto" budgets measured now, as attach adds
            them (:func:`~zero_cache.storage.hardware.tier_budgets`).

    Raises:
        PlanError: the model states do not fit on some rank; the message has the shortfall per tier.
    """
    per_host = ranks_per_host or (hardware.gpus_per_host if hardware is not None else world_size)
    if hardware is not None:
        device = torch.device("cuda")  # only its type matters: nothing is allocated or measured
    resolved = resolve(shapes, config, compute_dtype=compute_dtype, device=device,
                       accumulation_steps=accumulation_steps,
                       sharding=Sharding(world_size=world_size, ranks_per_host=per_host), hardware=hardware,
                       moving_device_bytes=moving_device_bytes, moving_host_bytes=moving_host_bytes)

    def plan_for(sharding: Sharding, shard_params: bool) -> Plan:
        return make_plan(resolved.plan_inputs(config, compute_dtype, accumulation_steps, sharding, shard_params,
                                              gpu=device.type == "cuda"))

    def found(shard_params: bool, plan: Plan, sharding: Sharding) -> DryRun:
        if not warms_up_at_least_footprint(config, device):
            return DryRun(resolved, plan)
        inputs = resolved.plan_inputs(config, compute_dtype, accumulation_steps, sharding, shard_params, gpu=True)
        warmup = least_footprint_plan(inputs)
        return DryRun(resolved, plan, activation_room_bytes(inputs, warmup), warmup.host_bytes)

    if world_size == 1:
        return found(*choose_streaming(config, functools.partial(plan_for, Sharding())), Sharding())
    ranks = [Sharding(rank=rank, world_size=world_size, ranks_per_host=per_host) for rank in range(world_size)]
    candidates = [candidate_plans(config, functools.partial(plan_for, sharding)) for sharding in ranks]
    choice = decide_shard_params(config.shard_params, [device_groups(plans) for plans, _ in candidates])
    if choice is None:
        wanted = wanted_placement(config.shard_params)
        rank, error = next((r, errors[wanted]) for r, (_, errors) in enumerate(candidates) if wanted in errors)
        raise PlanError(f"rank {rank} of {world_size}: {error}")
    plans = [rank_plans[choice] for rank_plans, _ in candidates]
    return found(choice, agree_working_set(plans[0], lambda _own: [plan.working_set for plan in plans]), ranks[0])


def attach(module: nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str], config: ZeroCacheConfig,
           *, compute_dtype: torch.dtype, device: torch.device, decoupled_weight_decay: bool = True,
           loss_scaler: Any = None, gradient_clipping: float = 0.0, accumulation_steps: int = 1,
           sharding: Sharding = Sharding(),
           deepspeed_import: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> ZeroCacheOptimizer:
    """Move ``module``'s trainable parameters into ZeRO-Cache and return the hybrid optimizer.

    Args:
        module: the model, on ``device`` in ``compute_dtype``.
        optimizer: a torch optimizer over the parameters (its param groups carry the hyperparameters).
        names: id(parameter) -> qualified name.
        config: the ``zero_cache`` section.
        compute_dtype, device: the module's dtype and device.
        decoupled_weight_decay, loss_scaler, gradient_clipping: as in the replicated optimizer.
        accumulation_steps: micro-batches per step (1 writes gradients over the params: no gradient buffers).
        sharding: the data-parallel ranks that share the chunks' optimizer states (one rank: none).
        deepspeed_import: the context in which ``import deepspeed`` gives the installed DeepSpeed, whose C++ Adam the
            host updates use (the caller's to know: its own ``deepspeed`` alias may be in force).

    Raises:
        PlanError: the model states do not fit; nothing has been allocated.
    """
    if device.type == "cuda":
        logger.info("ZeRO-Cache: the CUDA allocator's expandable segments %s", use_expandable_segments(device))
    ordered = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    in_optimizer = {id(p) for p in ordered}
    params = [(name, p) for name, p in module.named_parameters() if id(p) in in_optimizer]
    resolved = resolve([(name, tuple(p.shape)) for name, p in params], config, compute_dtype=compute_dtype,
                       device=device, accumulation_steps=accumulation_steps, sharding=sharding,
                       moving_device_bytes=_bytes_on(params, device),
                       moving_host_bytes=_bytes_on(params, torch.device("cpu")))
    budgets, layout, in_backward = resolved.budgets, resolved.layout, resolved.update_in_backward
    device_tier, host_tier = build_tiers(device, budgets.device_bytes, budgets.host_bytes, sharding.ranks_per_host)
    swap_directory, disk_budget = budgets.nvme_directory, budgets.nvme_bytes

    def inputs_for(shard_params: bool) -> PlanInputs:
        return resolved.plan_inputs(config, compute_dtype, accumulation_steps, sharding, shard_params,
                                    gpu=device.type == "cuda")

    shard_params, plan = choose_shard_params(config, sharding, lambda shard: make_plan(inputs_for(shard)),
                                             gather_objects(sharding))
    plan = agree_working_set(plan, gather_objects(sharding))
    inputs = inputs_for(shard_params)
    tiers = {DEVICE: device_tier, HOST: host_tier}
    if swap_directory is not None:  # even if this plan needs no disk: the re-plan after warm-up may
        tiers[NVME] = NvmeTier(swap_directory, inputs.swap_slot_bytes, disk_budget, config.aio, rank=_rank())
    logger.info("ZeRO-Cache: %d chunks of %d elements (%.1f%% padding) over %d ranks; %s; host chunks update %s; "
                "host: %s", layout.num_chunks, layout.chunk_numel, 100 * layout.waste_fraction, sharding.world_size,
                plan.summary(), "during backward" if in_backward else "after backward",
                describe_host(plan.host_bytes, layout.used_numel))
    given_up = working_set_given_up(inputs, plan)
    if given_up:
        logger.info("ZeRO-Cache: the device budget does not hold the config's working set; planned %s. A larger "
                    "zero_cache.device_memory_budget keeps it", given_up)
    warmup = (_warmup_plan(inputs, plan, resolved.activation_reserve_bytes, sharding, layout.used_numel)
              if warms_up_at_least_footprint(config, device) else plan)
    store = ChunkStore(layout, [p for _, p in params], warmup, tiers, compute_dtype,
                       accumulate=accumulation_steps > 1, sharding=sharding, shard_params=shard_params,
                       state_dtype=STATE_DTYPES[config.state_dtype])
    hybrid = ZeroCacheOptimizer(store, optimizer, names, warmup, decoupled_weight_decay=decoupled_weight_decay,
                                loss_scaler=loss_scaler, gradient_clipping=gradient_clipping,
                                update_in_backward=in_backward,
                                native_host_adam=(device.type == "cuda" if config.native_host_adam == "auto"
                                                  else config.native_host_adam),
                                overlap_comm=config.overlap_comm, fold_waited=config.fold_waited_updates,
                                gather_ahead=gather_ahead_groups(config, layout, sharding),
                                deepspeed_import=deepspeed_import)
    tracer = WarmupTracer(layout, config, compute_dtype, accumulation_steps, in_backward, tiers, sharding=sharding,
                          shard_params=shard_params)
    if warmup is not plan:
        tracer.warm_up_under(hybrid, plan)
    stats = allocator_stats_for(device)
    if stats is not None:  # the warm-up measures the non-model peak from here
        tracer.measure(module, [p for _, p in params], NonModelMeter(device_tier, stats))
        hybrid.hooks += tracer.sampling_hooks  # (removed by the re-plan, or by destroy() if it never comes)
    if shard_params:
        hybrid.hooks += register_saving_hooks(module, hybrid.exchange.gathered)
    hybrid.hooks += _register_forward_hooks(module, store, hybrid, tracer)
    hybrid.observe(tracer)
    return hybrid


def allocator_stats_for(device: torch.device) -> AllocatorStats | None:
    """The allocator whose peaks the warm-up reads its non-model memory from: CUDA's on a GPU; none on a CPU, where
    nothing is measured (its re-plan sees no activations)."""
    return CudaAllocatorStats(device) if device.type == "cuda" else None


def _warmup_plan(inputs: PlanInputs, plan: Plan, activation_reserve_bytes: int, sharding: Sharding,
                 num_params: int) -> Plan:
    """The placement the warm-up step runs under: ``plan``'s mode and layout at its least device footprint within
    the warm-up's host cap (:func:`~zero_cache.resolve.least_footprint_inputs`), so the activations it has not
    measured yet get the room there is (the re-plan after it places by them). Several ranks take the least of their
    reserves (each fits it): they gather groups together, and plan their working sets alike only from the same
    reserve, as the first plan does. ``num_params``: the parameters in the chunks (the log's bytes per param)."""
    warm = least_footprint_inputs(inputs)
    if sharding.world_size > 1:
        warm = replace(warm, activation_reserve_bytes=min(gather_objects(sharding)(warm.activation_reserve_bytes)))
    warmup = agree_working_set(make_plan(warm), gather_objects(sharding))  # (it fits every rank: none is None)
    logger.info("ZeRO-Cache warm-up: the first step runs at the plan's least device footprint, leaving %s of the "
                "device for activations (the first plan, made with activation_memory \"auto\"'s fixed guess of %s, "
                "leaves %s); the re-plan after it places by the measured peak. Host: %s. Warm-up placement: %s",
                format_bytes(activation_room_bytes(inputs, warmup)), format_bytes(activation_reserve_bytes),
                format_bytes(activation_room_bytes(inputs, plan)),
                describe_host(plan.host_bytes, num_params, warmup.host_bytes), warmup.summary())
    return warmup


def _register_forward_hooks(module: nn.Module, store: ChunkStore, hybrid: ZeroCacheOptimizer,
                            tracer: WarmupTracer) -> list[Any]:
    """Before each module with trained params: its chunks made ready (and, gathered, held until after it);
    returns the hooks' handles."""
    chunk_of = {id(p): slot.chunk for p, slot in zip(store.params, store.slots)}
    gathered = hybrid.exchange.gathered if hybrid.exchange is not None else None
    handles = []
    for submodule in module.modules():
        chunks = sorted({chunk_of[id(p)] for p in submodule.parameters(recurse=False) if id(p) in chunk_of})
        if not chunks:
            continue

        def before_forward(_module: nn.Module, _inputs: Any, chunks: list[int] = chunks) -> None:
            tracer.record(chunks)
            for chunk in chunks:
                hybrid.prepare_chunk(chunk)
                if gathered is not None:  # held from its acquisition: the module's later groups must not evict it
                    gathered.hold(store.sharding.group_of(chunk))

        def after_forward(_module: nn.Module, _inputs: Any, _output: Any, chunks: list[int] = chunks) -> None:
            for chunk in chunks:
                gathered.unhold(store.sharding.group_of(chunk))

        handles.append(submodule.register_forward_pre_hook(before_forward))
        if gathered is not None:
            handles.append(submodule.register_forward_hook(after_forward, always_call=True))
    return handles


def _bytes_on(params: list[tuple[str, nn.Parameter]], device: torch.device) -> int:
    """Bytes of the parameters stored on ``device`` (its type, and index where it has one)."""
    return sum(p.numel() * p.element_size() for _, p in params
               if p.device.type == device.type and (device.index is None or p.device.index == device.index))
