"""DeepSpeed's learning-rate schedules, same names, arguments and formulas: WarmupLR, WarmupDecayLR,
WarmupCosineLR, OneCycle (with cyclic momentum) and LRRangeTest.

Each schedule is a function of the step index (``lr_at``); the objects hold that index only, so a checkpoint
needs nothing but ``last_batch_iteration``. The formulas follow ``deepspeed/runtime/lr_schedules.py``
(DeepSpeed 0.19), including its quirks, since a drop-in must give the same rate at every step:

* the warm-up length is at least 2 steps, and "log" warm-up rises as log(step + 1) / log(warmup_num_steps);
  an unknown ``warmup_type`` falls back to "log" with a warning; ``warmup_num_steps`` that is not a positive
  integer is a ``ValueError``;
* a learning rate the optimizer holds as a tensor stays that tensor (filled in place), so a caller's
  reference (``torch.compile``d steps, capturable optimizers) keeps seeing the rate;
* OneCycle (Smith 2018, "A disciplined approach to neural network hyper-parameters", arXiv:1803.09820) rises
  from ``cycle_min_lr`` to ``cycle_max_lr`` over the first half-cycle, falls back over the second, then decays
  as ``min_lr / (1 + decay_lr_rate * k / decay_step_size)``; momentum (Adam's beta1) moves the opposite way;
* LRRangeTest grows as ``min_lr * (1 + step_rate * (step + 1) / step_size)`` (floored per step_size with
  ``staircase``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from angelptm.config.typed import SchedulerConfig
from angelptm.engine.cyclic_schedules import LRRangeTest, OneCycle
from angelptm.engine.schedule_base import Schedule, per_group

logger = logging.getLogger(__name__)

LOG, LINEAR = "log", "linear"


def _warmup_length(warmup_num_steps: Any) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    return max(2, warmup_num_steps)


def _warmup_type(warmup_type: str) -> str:
    if warmup_type not in (LOG, LINEAR):
        logger.warning("unknown warmup_type %r: using %r (as DeepSpeed does); set \"log\" or \"linear\"", warmup_type,
                       LOG)
        return LOG
    return warmup_type


def _warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at ``step`` (< warmup_num_steps), in [0, 1)."""
    if warmup_type == LOG:
        # DeepSpeed multiplies by a precomputed 1 / log(warmup_num_steps); dividing by the log instead rounds
        # differently at some steps (a last-bit difference in the rate, the first one a replay shows).
        return (1.0 / math.log(warmup_num_steps)) * math.log(step + 1)
    return step / warmup_num_steps


class WarmupLR(Schedule):
    """Rise from warmup_min_lr to warmup_max_lr (default: each group's lr) over warmup_num_steps, then hold."""

    def __init__(self, optimizer: Any, warmup_min_lr: float | list = 0.0, warmup_max_lr: float | list | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = LOG, last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps = _warmup_length(warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        # Taken now: a tensor lr among max_lrs is filled in place as the schedule runs.
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        self.warmup_type = _warmup_type(warmup_type)
        self._start()

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, step: int) -> list[Any]:
        if step < 0:
            return list(self.min_lrs)
        gamma = self._gamma(step)
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | list = 0.0,
                 warmup_max_lr: float | list = 0.001, warmup_num_steps: int = 1000, warmup_type: str = LOG,
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - step
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(Schedule):
    """Scale each group's lr from warmup_min_ratio up to 1, then down a cosine to cos_min_ratio."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = LOG,
                 last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps = _warmup_length(warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)
        self.org_lrs = [group["lr"].clone() if torch.is_tensor(group["lr"]) else group["lr"]
                        for group in self.optimizer.param_groups]
        self._start()

    def ratio_at(self, step: int) -> float:
        """The multiplier applied to each group's original lr at ``step`` (0 before the first step)."""
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            gamma = _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        # Progress is clamped to [0, 1], so the ratio stays at cos_min_ratio past the end.
        progress = min(1.0, (step - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr_ratio(self) -> float:
        """DeepSpeed's name: the ratio at the current step."""
        return self.ratio_at(self.last_batch_iteration)

    def lr_at(self, step: int) -> list[Any]:
        ratio = self.ratio_at(step)
        return [base * ratio for base in self.org_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
              "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> Schedule:
    """Build the configured schedule over ``optimizer``'s param groups."""
    return SCHEDULERS[config.type](optimizer, **config.params)
