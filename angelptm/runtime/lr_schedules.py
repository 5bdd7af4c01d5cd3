"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules, from :mod:`angelptm.engine.schedulers`.

``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR`` follow DeepSpeed 0.19's formulas (tested against
DeepSpeed's own). ``OneCycle`` and ``LRRangeTest`` are not provided: importing them raises and names
the torch schedule to use.
"""

from __future__ import annotations

from typing import Any

from angelptm.engine.schedulers import SCHEDULERS, WarmupCosineLR, WarmupDecayLR, WarmupLR

WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = list(SCHEDULERS)

_NOT_PROVIDED = {
    "OneCycle": "torch.optim.lr_scheduler.OneCycleLR (cycle_momentum works on the engine's optimizer)",
    "LRRangeTest": "torch.optim.lr_scheduler.LambdaLR with your range-test rule",
}

__all__ = ["VALID_LR_SCHEDULES", "WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LR", "WarmupCosineLR",
           "WarmupDecayLR", "WarmupLR"]


def __getattr__(name: str) -> Any:
    if name in _NOT_PROVIDED:  # ImportError: `from ... import OneCycle` would replace an AttributeError's message
        raise ImportError(f"angelptm.runtime.lr_schedules.{name} is not provided; use {_NOT_PROVIDED[name]} on "
                             "engine.optimizer, or WarmupLR / WarmupDecayLR / WarmupCosineLR")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
