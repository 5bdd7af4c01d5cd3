"""``angelptm.runtime``: the ``deepspeed.runtime`` modules that scripts and libraries import
(``activation_checkpointing``, ``config`` with ``DeepSpeedConfig``, ``config_utils``, ``lr_schedules``,
``precision_config``, ``utils``, ``zero`` with its ``config``)."""

from angelptm.runtime import activation_checkpointing, config, config_utils, lr_schedules, precision_config, utils, zero

__all__ = ["activation_checkpointing", "config", "config_utils", "lr_schedules", "precision_config", "utils", "zero"]
