"""Shared test set-up: GPU tests skip cleanly without CUDA; logs stay quiet unless a test fails."""

from __future__ import annotations

import logging
import os

import pytest
import torch

# A config with bf16.enabled "auto" computes in bf16 on a CPU with bf16 units (angelptm.config.precision).
# The suite pins the answer to "no units" so its fp32 references hold on any CI CPU; set here, at import,
# so the jobs tests start as processes inherit it. tests/unit/test_precision_rule.py passes its own answers.
os.environ.setdefault("ANGELPTM_CPU_BF16", "0")


class _TerminalLines(logging.Handler):
    """Writes a record on the terminal as it happens: pytest holds logs back until a test fails, and a native
    op's first build (zero_cache.base.native) is a minute or two with nothing else to show."""

    def __init__(self, config: pytest.Config) -> None:
        super().__init__(logging.INFO)
        self.config = config

    def emit(self, record: logging.LogRecord) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if reporter is None or capture is None:
            return
        with capture.global_and_fixture_disabled():  # as pytest's live logging writes past the capture
            reporter.write_line(f"[{record.name}] {record.getMessage()}")


def pytest_configure(config: pytest.Config) -> None:
    native = logging.getLogger("zero_cache.base.native")
    native.setLevel(logging.INFO)
    native.addHandler(_TerminalLines(config))


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
    from zero_cache.base.native import load_csrc

    module = load_csrc("fused_host_adam")
    if module is None:
        pytest.skip("no C++ toolchain to build csrc/fused_host_adam.cpp (the library kernel is used instead)")
    return module


# tests/helpers holds the shared reference code and the job scripts that tests start as processes.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
