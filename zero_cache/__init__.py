"""ZeRO-Cache: model states in chunks across one GPU + pinned-CPU + NVMe address space.

This package never imports ``angelptm``; it owns its typed config and takes runtime objects
(device, process group, streams) as arguments.
"""

from zero_cache.attach import attach, dry_run
from zero_cache.config import AioConfig, ZeroCacheConfig
from zero_cache.hardware import Hardware, TierBudgets, tier_budgets
from zero_cache.nvme import NvmeSetupError
from zero_cache.optimizer import ZeroCacheOptimizer
from zero_cache.planner import Plan, PlanError, PlanInputs, make_plan
from zero_cache.sharding import Sharding, hierarchical_groups
from zero_cache.units import format_bytes, parse_budget, parse_bytes

__all__ = ["AioConfig", "Hardware", "NvmeSetupError", "Plan", "PlanError", "PlanInputs", "Sharding", "TierBudgets",
           "ZeroCacheConfig", "ZeroCacheOptimizer", "attach", "dry_run", "format_bytes", "hierarchical_groups",
           "make_plan", "parse_budget", "parse_bytes", "tier_budgets"]
