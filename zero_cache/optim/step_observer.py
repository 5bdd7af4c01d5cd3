"""The seam between the optimizer and what watches its steps (the warm-up's re-plan and the device-step tuning).

The warm-up (:mod:`zero_cache.warmup`) registers one :class:`StepObserver` (``ZeroCacheOptimizer.observe``) and
reads the optimizer through a few named methods: the work its steps timed (:class:`StepTimings`), the group
acquisitions the warm-up recorded (:class:`~zero_cache.runtime.gathered.RecordedGathers`), the rate probe's work for
the host's Adam and a bounce buffer for the disk probe; it changes the optimizer only by ``apply_plan``. It never
reaches into the optimizer's parts (its host worker, device steps or store), so those can change without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class StepObserver(Protocol):
    """Told of each applied step (a skipped one is not applied)."""

    def after_first_step(self, optimizer: Any) -> None:
        """After the first applied step (the warm-up's re-plan)."""

    def after_step(self, optimizer: Any, step_seconds: float) -> None:
        """After each later applied step whose time was measured (``step_seconds``: from one norm to the next)."""


@dataclass(frozen=True, slots=True)
class StepTimings:
    """The work the steps timed since the last :meth:`take <ZeroCacheOptimizer.step_timings>`, each as
    ``(elements, seconds)`` (what :func:`zero_cache.runtime.rates.with_timed_work` takes)."""

    host_adam: tuple[int, float]
    """The host worker's Adam."""
    device_steps: tuple[int, float]
    """Host-held groups stepped on the device, from when they may start to their last copy out."""
    device_adam: tuple[int, float]
    """The device's Adam over the groups it holds."""
