"""``deepspeed.runtime.utils``: the helpers scripts call (``set_random_seed``)."""

from __future__ import annotations

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
