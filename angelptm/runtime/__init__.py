"""``angelptm.runtime``: the ``deepspeed.runtime`` modules that scripts import (``lr_schedules``, ``utils``)."""

from angelptm.runtime import lr_schedules, utils

__all__ = ["lr_schedules", "utils"]
