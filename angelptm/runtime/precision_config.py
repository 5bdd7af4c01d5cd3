"""``deepspeed.runtime.precision_config``: the ``fp16`` and ``bf16`` sections as DeepSpeed's pydantic models.

Checks, as DeepSpeed 0.19 makes them: ``loss_scale`` is a finite number >= 0 (0 = dynamic scaling; JSON's
true/false are refused, not read as 1/0); with dynamic scaling on, ``loss_scale_window`` and
``min_loss_scale`` are positive integers (with a static scale, or fp16 off, they are unused and not checked
for sign).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import field_validator, model_validator

from angelptm.runtime.config_utils import DeepSpeedConfigModel

BFLOAT16, BFLOAT16_OLD, FP16 = "bf16", "bfloat16", "fp16"


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """``bf16`` (alias key ``bfloat16``)."""

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """``fp16``: half precision with static or dynamic loss scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0
    """0: dynamic scaling; otherwise the static scale."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1
    fp16_master_weights_and_grads: bool = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _finite_non_negative(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"fp16.loss_scale must be a number (0 for dynamic scaling), got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"fp16.loss_scale must be a number (0 for dynamic scaling), got {value!r}") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"fp16.loss_scale must be a finite number >= 0 (0 for dynamic scaling), got {value!r}")
        return number

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _integer(cls, value: Any, info: Any) -> Any:
        whole = isinstance(value, int) and not isinstance(value, bool)
        whole = whole or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
        if not whole:
            raise ValueError(f"fp16.{info.field_name} must be an integer, got {value!r}")
        return int(value)

    @model_validator(mode="after")
    def _positive_when_dynamic(self) -> "DeepSpeedFP16Config":
        if self.enabled and self.loss_scale == 0:
            for name in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"fp16.{name} must be > 0 with dynamic loss scaling (loss_scale 0), "
                                     f"got {getattr(self, name)}")
        return self

    def initial_dynamic_scale(self) -> float:
        return 2**self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic scaler's arguments, under DeepSpeed's key names."""
        return {"init_scale": 2**self.initial_scale_power, "scale_window": self.loss_scale_window,
                "delayed_shift": self.hysteresis, "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_scale": self.min_loss_scale}


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """The ``bf16`` section (or its older name ``bfloat16``) of a config dict."""
    section = param_dict.get(BFLOAT16, param_dict.get(BFLOAT16_OLD, {}))
    return DeepSpeedBF16Config(**section)


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    """The ``fp16`` section of a config dict."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))
