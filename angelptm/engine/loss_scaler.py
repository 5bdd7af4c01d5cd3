"""fp16 loss scaling with DeepSpeed's semantics (``deepspeed/runtime/fp16/loss_scaler.py``).

Dynamic scaling: every overflow either spends one unit of hysteresis or, when none is left,
halves the scale (not below ``min_scale``); every ``window`` overflow-free steps double it.
"""

from __future__ import annotations

from typing import Any

from angelptm.config.typed import LossScaleConfig


class LossScaler:
    """Holds the current loss scale and updates it from each step's overflow flag."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.dynamic = config.static_scale is None
        self.cur_scale = float(2**config.initial_scale_power) if self.dynamic else float(config.static_scale)
        self.initial_scale_power = config.initial_scale_power
        self.window = config.window
        self.min_scale = config.min_scale
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.cur_hysteresis = config.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self.cur_scale

    def _gave_up(self) -> str:
        """Why the scale search stops: it halved from ``2**initial_scale_power`` to its floor and the gradients still
        overflow (both keys named: a search that starts too high against a floor too high gives up the same way a
        diverged run does)."""
        power = self.initial_scale_power
        return (f"fp16 gradients overflowed with the loss scale at fp16.min_loss_scale={self.min_scale}, the floor "
                f"of its search down from 2**{power} (fp16.initial_scale_power={power}): no scale in that range fits "
                "these gradients, so the run has diverged or the range is wrong: lower the learning rate, lower "
                "fp16.min_loss_scale (or fp16.initial_scale_power), or use bf16")

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome.

        Raises:
            FloatingPointError: gradients overflowed with the scale already at its minimum, so the
                run has diverged; DeepSpeed stops here too.
        """
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloatingPointError(self._gave_up())
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            # Steps since the last overflow, not counting this one (DeepSpeed 0.19's "stable interval").
            stable_interval = self.cur_iter - self.last_overflow_iter - 1
            if stable_interval > 0 and stable_interval % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = state["cur_scale"]
        self.cur_iter = state["cur_iter"]
        self.last_overflow_iter = state["last_overflow_iter"]
        self.cur_hysteresis = state["cur_hysteresis"]
