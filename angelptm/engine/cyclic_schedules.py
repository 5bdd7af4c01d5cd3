"""DeepSpeed's cyclic schedules: ``OneCycle`` (learning rate and momentum) and ``LRRangeTest``.

Both after Smith 2018, "A disciplined approach to neural network hyper-parameters: Part 1"
(arXiv:1803.09820), with DeepSpeed 0.19's formulas, so a config moved over gives the same rate at every step:

* LRRangeTest: ``min_lr * (1 + step_rate * interval)``, where interval is ``(step + 1) / step_size``
  (floored with ``staircase``). It finds the largest rate that still trains.
* OneCycle: a cycle of ``first + second`` steps. With x the position in the cycle (cycle_first_step_size
  steps up, then cycle_second_step_size down), the rate is ``min_lr + (max_lr - min_lr) * scale`` and
  beta1 is ``max_mom - (max_mom - min_mom) * scale``; after the cycle the rate decays as
  ``min_lr / (1 + decay_lr_rate * k / decay_step_size)`` and beta1 grows as
  ``max_mom * (1 + decay_mom_rate * k / decay_step_size)``. A stair count holds the scale flat over that
  many stairs per half-cycle, counted from the integer step (a float scale a hair under a stair would drop
  a whole stair).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from angelptm.engine.schedule_base import Schedule, per_group, write_lrs

logger = logging.getLogger(__name__)


class LRRangeTest(Schedule):
    """Grow the lr from lr_range_test_min_lr by step_rate every step_size steps (continuously or in stairs)."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int) \
                or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def _interval(self, step: int) -> float:
        interval = (step + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def lr_at(self, step: int) -> list[Any]:
        increase = 1 + self.step_rate * self._interval(step)
        return [low * increase for low in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to ``batch_iteration``) and write the new rates."""
        super().step(batch_iteration)


class OneCycle(Schedule):
    """One cycle of the lr between cycle_min_lr and cycle_max_lr (and of beta1 the other way), then decay."""

    def __init__(self, optimizer: Any, cycle_min_lr: float | list, cycle_max_lr: float | list,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float | list = 0.8,
                 cycle_max_mom: float | list = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._shape(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count,
                    decay_step_size)
        # Both bounds are checked before the optimizer is touched, so a bad max leaves no group half updated.
        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and self._momentum_supported()
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
            # beta2 is held at 0.99 through the cycle, as DeepSpeed does.
            self.min_moms = [(mom, 0.99) for mom in per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(mom, 0.99) for mom in per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            write_lrs(self.optimizer.param_groups, self.min_lrs)
            if self.cycle_momentum:
                for group, momentum in zip(self.optimizer.param_groups, self.min_moms):
                    group["betas"] = momentum

    def _shape(self, first: float, second: float | None, first_stairs: int, second_stairs: int | None,
               decay_step_size: float) -> None:
        first = float(first)
        second = float(second) if second is not None else first
        # A first half of 0 steps would divide by a step ratio of 0 at the first rate asked for.
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = first_stairs
        self.second_stair_count = first_stairs if second_stairs is None else second_stairs
        self.decay_step_size = decay_step_size

    def _momentum_supported(self) -> bool:
        if "betas" in self.optimizer.defaults:
            return True
        logger.warning("cycle_momentum is off: optimizer %s has no betas to cycle", type(self.optimizer).__name__)
        return False

    def _scale(self, step: int) -> float:
        """Where in the current cycle ``step`` is: 0 at the bottom, 1 at the peak."""
        batch = step + 1
        x = 1.0 + batch / self.total_size - math.floor(1 + batch / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            in_cycle = batch % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lr_at(self, step: int) -> list[Any]:
        if step < self.total_size:
            scale = self._scale(step)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (step - self.total_size + 1) / self.decay_step_size
        return [low / factor for low in self.min_lrs]

    def mom_at(self, step: int) -> list[tuple[float, float]] | None:
        """(beta1, beta2) of each group at ``step``; None with cycle_momentum off."""
        if not self.cycle_momentum:
            return None
        if step < self.total_size:
            scale = self._scale(step)
            return [(high[0] - (high[0] - low[0]) * scale, low[1]) for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (step - self.total_size + 1) / self.decay_step_size
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """DeepSpeed's name: the momentum pairs at the current step."""
        return self.mom_at(self.last_batch_iteration)

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to ``batch_iteration``) and write the new rates and momenta."""
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, momentum in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = momentum
