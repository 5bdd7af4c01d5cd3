"""``deepspeed.runtime.utils``: the helpers scripts call (``set_random_seed``)."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed python's, numpy's and torch's generators (DeepSpeed's function, also PipelineModule's ``seed_fn``)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
