"""``deepspeed.runtime.utils``: the helpers scripts call (``set_random_seed``, ``see_memory_usage``)."""

from __future__ import annotations

import gc
import logging
import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed python's, numpy's and torch's generators, as DeepSpeed 0.19's function does: the one seeding of the
    package (``initialize()`` with a config ``seed``, the pipeline engine, PipelineModule's default ``seed_fn``).

    Any integer is taken: numpy's generator gets ``seed % 2**32`` (it takes 32 bits) and torch's
    ``seed % 2**63``; python's takes ``seed`` whole.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log device and host memory in use with ``message`` (rank 0; only with ``force``, as DeepSpeed's)."""
    import psutil
    import torch.distributed as dist

    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    device = ""
    if torch.cuda.is_available():
        device = (f"device allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, max "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
                  f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB; ")
        torch.cuda.reset_peak_memory_stats()
    host = psutil.virtual_memory()
    logging.getLogger("angelptm").info("%s | %shost used %.2f GiB (%.1f%%)", message, device, host.used / 2**30,
                                       host.percent)
