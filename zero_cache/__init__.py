"""ZeRO-Cache: model states in chunks across one GPU + pinned-CPU + NVMe address space.

This package never imports ``angelptm``; it owns its typed config and takes runtime objects
(device, process group, streams) as arguments.

Its modules are in sub-packages by concern, in floors that import only below them: ``plan/`` (deciding: the
planner and what it prices with, pure, no torch) and ``base/`` (the step's timeline, ranks, the native loader) at the
bottom, ``config`` (the typed config, over ``plan/``), ``storage/`` (tiers, homes, chunks), ``runtime/`` (streams,
exchange, gathering, the host worker, measuring), ``optim/`` (the hybrid Adam); ``attach``, ``warmup`` and
``resolve`` compose them on top (``docs/design.md``).

Its public names load on first use (PEP 562), so that importing a pure module of it (``zero_cache.plan.planner``,
``zero_cache.plan.home_costs``, ...) runs no torch, and ``import zero_cache.plan.planner`` works where torch is
not installed (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zero_cache.attach import attach, dry_run
    from zero_cache.base.sharding import Sharding, hierarchical_groups
    from zero_cache.base.timeline import TRACKS, Interval, Timeline, overlap_shares
    from zero_cache.config import AioConfig, ZeroCacheConfig
    from zero_cache.optim.optimizer import ZeroCacheOptimizer
    from zero_cache.optim.optimizer_state import OptimizerCheckpoint
    from zero_cache.optim.state_snapshot import SnapshotAborted, StagedChunk, StateRef, StateSnapshot
    from zero_cache.plan.placement import Plan, PlanError, PlanInputs
    from zero_cache.plan.planner import make_plan
    from zero_cache.plan.tier_names import DEVICE, HOST, NVME
    from zero_cache.plan.units import AUTO, format_bytes, parse_budget, parse_bytes
    from zero_cache.storage.hardware import Hardware, TierBudgets, check_explicit_budgets, tier_budgets
    from zero_cache.storage.nvme import NvmeSetupError, SwapCorruptionError
    from zero_cache.storage.tiers import TierFullError

_EXPORTS = {
    "attach": "zero_cache.attach", "dry_run": "zero_cache.attach",
    "AioConfig": "zero_cache.config", "ZeroCacheConfig": "zero_cache.config",
    "ZeroCacheOptimizer": "zero_cache.optim.optimizer",
    "OptimizerCheckpoint": "zero_cache.optim.optimizer_state",
    "SnapshotAborted": "zero_cache.optim.state_snapshot", "StagedChunk": "zero_cache.optim.state_snapshot",
    "StateRef": "zero_cache.optim.state_snapshot", "StateSnapshot": "zero_cache.optim.state_snapshot",
    "Plan": "zero_cache.plan.placement", "PlanError": "zero_cache.plan.placement",
    "PlanInputs": "zero_cache.plan.placement", "make_plan": "zero_cache.plan.planner",
    "DEVICE": "zero_cache.plan.tier_names", "HOST": "zero_cache.plan.tier_names", "NVME": "zero_cache.plan.tier_names",
    "home_costs": "zero_cache.plan.home_costs",
    "AUTO": "zero_cache.plan.units", "format_bytes": "zero_cache.plan.units", "parse_budget": "zero_cache.plan.units",
    "parse_bytes": "zero_cache.plan.units",
    "Sharding": "zero_cache.base.sharding", "hierarchical_groups": "zero_cache.base.sharding",
    "TRACKS": "zero_cache.base.timeline", "Interval": "zero_cache.base.timeline",
    "Timeline": "zero_cache.base.timeline", "overlap_shares": "zero_cache.base.timeline",
    "Hardware": "zero_cache.storage.hardware", "TierBudgets": "zero_cache.storage.hardware",
    "check_explicit_budgets": "zero_cache.storage.hardware", "tier_budgets": "zero_cache.storage.hardware",
    "NvmeSetupError": "zero_cache.storage.nvme", "SwapCorruptionError": "zero_cache.storage.nvme",
    "TierFullError": "zero_cache.storage.tiers",
}
"""Public name -> the module that defines it."""

__all__ = ["AUTO", "AioConfig", "DEVICE", "HOST", "Hardware", "Interval", "NVME", "NvmeSetupError",
           "OptimizerCheckpoint", "Plan", "PlanError", "PlanInputs", "Sharding", "SnapshotAborted", "StagedChunk",
           "StateRef", "StateSnapshot", "SwapCorruptionError", "TRACKS",
           "TierBudgets", "TierFullError", "Timeline", "ZeroCacheConfig", "ZeroCacheOptimizer", "attach",
           "check_explicit_budgets", "dry_run", "format_bytes", "hierarchical_groups", "home_costs", "make_plan",
           "overlap_shares", "parse_budget", "parse_bytes", "tier_budgets"]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then bound here)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package, whose public ``attach`` is the function: importing the module ``zero_cache.attach`` binds the
    module over a package's attribute of its name, which this refuses (the module stays in ``sys.modules``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
