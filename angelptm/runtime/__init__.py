"""``angelptm.runtime``: the ``deepspeed.runtime`` modules that scripts import (``activation_checkpointing``,
``lr_schedules``, ``utils``)."""

from angelptm.runtime import activation_checkpointing, lr_schedules, utils

__all__ = ["activation_checkpointing", "lr_schedules", "utils"]
