"""``angelptm.utils``: the ``deepspeed.utils`` names scripts touch (``RepeatingLoader``, ``logger``; and the
``zero_to_fp32`` module, imported as ``angelptm.utils.zero_to_fp32`` like DeepSpeed's, not here: it also runs
as ``python -m angelptm.utils.zero_to_fp32``)."""

import logging

from angelptm.utils.data import RepeatingLoader

logger = logging.getLogger("angelptm")
"""The package's logger (DeepSpeed scripts call ``deepspeed.utils.logger.info``)."""

__all__ = ["RepeatingLoader", "logger"]
