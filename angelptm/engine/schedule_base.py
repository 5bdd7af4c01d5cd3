"""What every learning-rate schedule shares (:mod:`angelptm.engine.schedulers`,
:mod:`angelptm.engine.cyclic_schedules`): finding the torch optimizer, per-group values, writing rates that
may be tensors, and stepping with a checkpointable index."""

from __future__ import annotations

from typing import Any

import torch


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` a schedule drives: ``optimizer`` itself or the one it wraps (``.optimizer``).

    Raises:
        TypeError: neither is a torch optimizer.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def write_lrs(param_groups: list[dict], lrs: list[Any]) -> list[Any]:
    """Set each group's lr; one held as a tensor is filled in place (its identity, shape and dtype kept)."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """One value per param group: a list/tuple of the right length, or a scalar repeated.

    Raises:
        ValueError: a list whose length is not the number of param groups.
    """
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}: {len(value)} values for {groups} param groups; give one value, or one per group")
        return list(value)
    return [value] * groups


class Schedule:
    """Stepping, state and the write to the optimizer; subclasses define :meth:`lr_at`."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[Any] | None = None

    def _start(self) -> None:
        """Write the first rates (a resumed schedule, ``last_batch_iteration`` >= 0, leaves the optimizer as is)."""
        if self.last_batch_iteration == -1:
            self._apply()

    def lr_at(self, step: int) -> list[Any]:
        """Learning rate of each param group after ``step`` scheduler steps (0-based; -1 = before the first)."""
        raise NotImplementedError

    def get_lr(self) -> list[Any]:
        """The learning rates for the current step."""
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[Any]:
        """The learning rates last written to the optimizer."""
        assert self._last_lr is not None, "need to call step() first"
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to ``last_batch_iteration``) and write the new rates."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._apply()

    def _apply(self) -> None:
        self._last_lr = write_lrs(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step index and write that step's rates (DeepSpeed only restores the index; the rates
        are the same ones the optimizer's own state carries)."""
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()
