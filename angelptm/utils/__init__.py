"""``angelptm.utils``: the ``deepspeed.utils`` names scripts touch (``RepeatingLoader``, ``logger``, ``log_dist``,
the ``logging`` and ``torch`` modules; and the
``zero_to_fp32`` module, imported as ``angelptm.utils.zero_to_fp32`` like DeepSpeed's, not here: it also runs
as ``python -m angelptm.utils.zero_to_fp32``)."""

from angelptm.utils import logging, torch
from angelptm.utils.data import RepeatingLoader
from angelptm.utils.logging import log_dist, logger

__all__ = ["RepeatingLoader", "log_dist", "logger", "logging", "torch"]
