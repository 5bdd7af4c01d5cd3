"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR), same names and formulas.

Each schedule is a pure function of the step index (``lr_at``); the objects only hold that index,
so a checkpoint needs nothing but ``last_batch_iteration``. Formulas follow
``deepspeed/runtime/lr_schedules.py`` (DeepSpeed 0.19), including its quirks: the warm-up length is
at least 2 steps, and "log" warm-up rises as log(step + 1) / log(warmup_num_steps).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from angelptm.config.typed import SchedulerConfig
from angelptm.errors import ConfigError


def _warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at ``step`` (< warmup_num_steps), in [0, 1)."""
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


class _Schedule:
    """Shared stepping and state; subclasses define :meth:`lr_at`."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def lr_at(self, step: int) -> list[float]:
        """Learning rate of each param group after ``step`` scheduler steps (0-based)."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """The learning rates for the current step."""
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The learning rates last written to the optimizer."""
        assert self._last_lr is not None, "step() has not been called"
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to ``last_batch_iteration``) and write the new rates."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._apply(self.get_lr())

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply(self.get_lr())


def _per_group(optimizer: torch.optim.Optimizer, value: float | list[float], name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(f"scheduler.params.{name}: {len(value)} values for {groups} param groups")
        return list(value)
    return [value] * groups


class WarmupLR(_Schedule):
    """Rise from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        if warmup_max_lr is None:  # DeepSpeed: default to the optimizer's configured lr
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, step: int) -> list[float]:
        if step < 0:
            return list(self.min_lrs)
        gamma = self._gamma(step)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | list[float] = 0.0, warmup_max_lr: float | list[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - step
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Scale the optimizer's lr from warmup_min_ratio up to 1, then down a cosine to cos_min_ratio."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def ratio_at(self, step: int) -> float:
        """The multiplier applied to each group's base lr at ``step``."""
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            gamma = _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        # Progress is clamped to [0, 1] so the ratio stays at cos_min_ratio past the end.
        progress = min(1.0, (step - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, step: int) -> list[float]:
        ratio = self.ratio_at(step)
        return [base * ratio for base in self.base_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> _Schedule:
    """Build the configured schedule over ``optimizer``'s param groups."""
    return SCHEDULERS[config.type](optimizer, **config.params)
