"""``deepspeed.utils.torch``: ``required_torch_version``."""

from __future__ import annotations

import torch
from packaging import version as pkg_version


def required_torch_version(min_version: str | float | None = None, max_version: str | float | None = None) -> bool:
    """Whether the running torch is within [min_version, max_version] (either bound may be left out).

    Raises:
        AssertionError: neither bound given (DeepSpeed's check).
    """
    assert min_version or max_version, "Must provide a min_version or max_version argument"
    running = pkg_version.parse(torch.__version__)
    if min_version and pkg_version.parse(str(min_version)) > running:
        return False
    return not (max_version and pkg_version.parse(str(max_version)) < running)
