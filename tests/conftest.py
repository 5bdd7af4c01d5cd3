"""Shared test set-up: GPU tests skip cleanly without CUDA; logs stay quiet unless a test fails."""

from __future__ import annotations

import os

import pytest
import torch

# A config with bf16.enabled "auto" computes in bf16 on a CPU with bf16 units (angelptm.config.precision).
# The suite pins the answer to "no units" so its fp32 references hold on any CI CPU; set here, at import,
# so the jobs tests start as processes inherit it. tests/unit/test_precision_rule.py passes its own answers.
os.environ.setdefault("ANGELPTM_CPU_BF16", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def native_adam():
    """``csrc/fused_host_adam.cpp`` built for this machine; the test skips where no toolchain can build it."""
    from zero_cache.native import load_csrc

    module = load_csrc("fused_host_adam")
    if module is None:
        pytest.skip("no C++ toolchain to build csrc/fused_host_adam.cpp (the library kernel is used instead)")
    return module


# tests/helpers holds the shared reference code and the job scripts that tests start as processes.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
