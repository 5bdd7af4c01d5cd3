"""ZeRO-Cache: model states in chunks across one GPU + pinned-CPU + NVMe address space.

This package never imports ``angelptm``; it owns its typed config and takes runtime objects
(device, process group, streams) as arguments.

Its public names load on first use (PEP 562), so that importing a pure module of it (the planner:
``zero_cache.plan``, ``zero_cache.planner``, ``zero_cache.home_costs``, ...) runs no torch, and
``import zero_cache.planner`` works where torch is not installed (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zero_cache.attach import attach, dry_run
    from zero_cache.config import AioConfig, ZeroCacheConfig
    from zero_cache.hardware import Hardware, TierBudgets, tier_budgets
    from zero_cache.nvme import NvmeSetupError
    from zero_cache.optimizer import ZeroCacheOptimizer
    from zero_cache.planner import Plan, PlanError, PlanInputs, make_plan
    from zero_cache.sharding import Sharding, hierarchical_groups
    from zero_cache.units import format_bytes, parse_budget, parse_bytes

_EXPORTS = {
    "attach": "zero_cache.attach", "dry_run": "zero_cache.attach",
    "AioConfig": "zero_cache.config", "ZeroCacheConfig": "zero_cache.config",
    "Hardware": "zero_cache.hardware", "TierBudgets": "zero_cache.hardware", "tier_budgets": "zero_cache.hardware",
    "NvmeSetupError": "zero_cache.nvme",
    "ZeroCacheOptimizer": "zero_cache.optimizer",
    "Plan": "zero_cache.planner", "PlanError": "zero_cache.planner", "PlanInputs": "zero_cache.planner",
    "make_plan": "zero_cache.planner",
    "Sharding": "zero_cache.sharding", "hierarchical_groups": "zero_cache.sharding",
    "format_bytes": "zero_cache.units", "parse_budget": "zero_cache.units", "parse_bytes": "zero_cache.units",
}
"""Public name -> the module that defines it."""

__all__ = ["AioConfig", "Hardware", "NvmeSetupError", "Plan", "PlanError", "PlanInputs", "Sharding", "TierBudgets",
           "ZeroCacheConfig", "ZeroCacheOptimizer", "attach", "dry_run", "format_bytes", "hierarchical_groups",
           "make_plan", "parse_budget", "parse_bytes", "tier_budgets"]


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
