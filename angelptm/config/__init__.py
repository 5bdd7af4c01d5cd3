"""DeepSpeed JSON at the edge, typed dataclasses inside."""

from angelptm.config.loader import load_config, read_config_source, resolve_batch_sizes
from angelptm.config.typed import (
    BatchConfig,
    CommsConfig,
    EngineConfig,
    LossScaleConfig,
    MonitorConfig,
    OptimizerConfig,
    PrecisionConfig,
    SchedulerConfig,
    TrainConfig,
    ZeroConfig,
)

__all__ = [
    "BatchConfig", "CommsConfig", "EngineConfig", "LossScaleConfig", "MonitorConfig", "OptimizerConfig",
    "PrecisionConfig", "SchedulerConfig", "TrainConfig", "ZeroConfig", "load_config", "read_config_source",
    "resolve_batch_sizes",
]
