"""``deepspeed.runtime.fp16.unfused_optimizer``: the name only. DeepSpeed's ZeRO-0 fp16/bf16 optimizer wrapper is
one of its internals; this engine's is :class:`angelptm.engine.mixed_precision.MixedPrecisionOptimizer`, which
``initialize()`` builds from the config (``engine.optimizer``)."""

from __future__ import annotations

from typing import Any


class FP16_UnfusedOptimizer:  # noqa: N801  (DeepSpeed's name)
    """Not provided: raises, naming what to use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("DeepSpeed's FP16_UnfusedOptimizer is not provided by angelptm: angelptm.initialize "
                                  "wraps the optimizer itself (engine.optimizer, fp32 masters and loss scaling)")
