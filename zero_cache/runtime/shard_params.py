"""Sharded params (ZeRO-3) at attach time: whether to shard, how many groups to gather, the autograd hooks.

The choice is collective: every rank plans with its own budgets and chunks, and all must shard or
none, so each rank's plans are gathered and one rule decides (:func:`decide_shard_params`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from zero_cache.base.sharding import Sharding
from zero_cache.config import ZeroCacheConfig
from zero_cache.plan.home_costs import home_costs
from zero_cache.plan.layout import ChunkLayout
from zero_cache.plan.planner import Plan, PlanError
from zero_cache.plan.tier_names import DEVICE
from zero_cache.plan.units import AUTO
from zero_cache.plan.working_set import agreed
from zero_cache.runtime.gathered import GatheredGroups


def gather_ahead_groups(config: ZeroCacheConfig, layout: ChunkLayout, sharding: Sharding) -> int:
    """Groups whose gather starts ahead of use: over ranks, ``gather_ahead_elements`` in whole groups; on one rank
    (params streamed from the host), ``prefetch_depth`` chunks; at least one."""
    if not sharding.sharded:
        return max(1, config.prefetch_depth)
    return max(1, -(-config.gather_ahead_elements // (sharding.world_size * layout.chunk_numel)))


def max_live_groups(config: ZeroCacheConfig, layout: ChunkLayout, sharding: Sharding) -> int:
    """Sharded params: groups gathered at once (``max_live_elements`` in whole groups, at least ahead + 2, at
    most every group)."""
    wanted = max(gather_ahead_groups(config, layout, sharding) + 2,
                 config.max_live_elements // (sharding.world_size * layout.chunk_numel))
    return min(wanted, sharding.num_groups(layout.num_chunks))


def choose_shard_params(config: ZeroCacheConfig, sharding: Sharding, plan_for: Callable[[bool], Plan],
                        gather: Callable[[Any], list[Any]]) -> tuple[bool, Plan]:
    """Whether to shard params over the data-parallel ranks, and this rank's plan that goes with it.

    Every rank plans with its own budgets and chunks, and the choice must be the same on all of them,
    so each rank's outcomes are gathered (``gather``: one object per rank, a collective) and decided by
    :func:`decide_shard_params`.

    Raises:
        PlanError: the chosen (or, for "auto", either) placement does not fit on some rank; that rank
            raises its shortfall, the others name it.
    """
    if not sharding.sharded:
        return choose_streaming(config, plan_for)
    plans, errors = candidate_plans(config, plan_for)
    outcomes = gather(device_groups(plans))
    choice = decide_shard_params(config.shard_params, outcomes)
    if choice is not None:
        return choice, plans[choice]
    wanted = wanted_placement(config.shard_params)
    if wanted in errors:
        raise errors[wanted]
    failed = [rank for rank, outcome in enumerate(outcomes) if wanted not in outcome]
    raise PlanError(f"model states do not fit on data-parallel rank(s) {failed} (their errors give the shortfall); "
                    "on this rank they would")


def choose_streaming(config: ZeroCacheConfig, plan_for: Callable[[bool], Plan]) -> tuple[bool, Plan]:
    """One rank: params resident on the device, or gathered on use from their homes (some or all in pinned host
    memory, or all on NVMe), whichever step costs less (:mod:`zero_cache.plan.step_cost`; resident on a tie).
    ``param_home`` "device" allows only the first, "host" or "nvme" only the second.

    Raises:
        PlanError: no allowed placement fits (the gathered one's shortfall, which needs the least device).
    """
    allowed = (False, True) if config.param_home == AUTO else (home_costs(config.param_home).streams,)
    plans: dict[bool, Plan] = {}
    errors: dict[bool, PlanError] = {}
    for gathered in allowed:
        try:
            plans[gathered] = plan_for(gathered)
        except PlanError as err:
            errors[gathered] = err
    if not plans:
        raise errors[allowed[-1]]
    gathered = min(plans, key=lambda g: (plans[g].traffic.seconds, g))
    return gathered, plans[gathered]


def wanted_placement(setting: bool | str) -> bool:
    """The placement whose shortfall explains a model that fits neither way ("auto": the sharded one, which
    needs the least)."""
    return True if setting == AUTO else bool(setting)


def candidate_plans(config: ZeroCacheConfig, plan_for: Callable[[bool], Plan]
                    ) -> tuple[dict[bool, Plan], dict[bool, PlanError]]:
    """This rank's plan, or why it does not fit, for each placement ``shard_params`` allows ({sharded: ...})."""
    plans: dict[bool, Plan] = {}
    errors: dict[bool, PlanError] = {}
    for shard in (False, True):
        if config.shard_params not in (AUTO, shard):
            continue
        try:
            plans[shard] = plan_for(shard)
        except PlanError as err:
            errors[shard] = err
    return plans, errors


def device_groups(plans: dict[bool, Plan]) -> dict[bool, int]:
    """What a rank tells the others: optimizer groups on its device per placement that fits."""
    return {shard: plan.optimizer_tier.count(DEVICE) for shard, plan in plans.items()}


def decide_shard_params(setting: bool | str, outcomes: list[dict[bool, int]]) -> bool | None:
    """The choice every rank makes from every rank's plans ({shard_params: optimizer groups on the device} for
    the placements that fit there); None when the setting's placement does not fit on some rank.

    "auto" shards when only that fits everywhere, or when it puts more optimizer groups on the ranks'
    devices in all: those skip the host round trip, which outweighs the extra all-gathers of the params.
    """
    fits = {shard: all(shard in outcome for outcome in outcomes) for shard in (False, True)}
    if setting != AUTO:
        return bool(setting) if fits[bool(setting)] else None
    if fits[True] and fits[False]:
        return sum(o[True] for o in outcomes) > sum(o[False] for o in outcomes)
    return True if fits[True] else False if fits[False] else None


def agree_working_set(plan: Plan | None, gather: Callable[[Any], list[Any]]) -> Plan | None:
    """``plan`` with the working set every data-parallel rank holds (:func:`~zero_cache.plan.working_set.agreed`; a
    collective through ``gather``, which every rank must call); None on every rank when some rank has no plan."""
    common = agreed(gather(None if plan is None else plan.working_set))
    if plan is None or common is None:
        return None
    return replace(plan, cache_slots=common.live_groups, gather_ahead=common.ahead, gradient_buckets=common.buckets)


def gather_objects(sharding: Sharding) -> Callable[[Any], list[Any]]:
    """A collective that returns every rank's object, in rank order (``choose_shard_params``'s ``gather``)."""

    def gather(obj: Any) -> list[Any]:
        if not sharding.sharded:
            return [obj]
        out: list[Any] = [None] * sharding.world_size
        torch.distributed.all_gather_object(out, obj, group=sharding.group)
        return out

    return gather


def register_saving_hooks(module: nn.Module, gathered: GatheredGroups) -> list[Any]:
    """Around the model's forward: a new iteration of the gather trace, and autograd saving params by position;
    returns the hooks' handles."""
    saving = contextlib.ExitStack()

    def enter(_module: nn.Module, _inputs: Any) -> None:
        gathered.new_iteration()
        saving.enter_context(gathered.saving())

    def leave(_module: nn.Module, _inputs: Any, _output: Any) -> None:
        saving.close()

    return [module.register_forward_pre_hook(enter, prepend=True),
            module.register_forward_hook(leave, always_call=True)]
