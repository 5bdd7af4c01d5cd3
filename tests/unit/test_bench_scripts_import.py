"""Every script under ``bench/`` imports on a machine without a GPU.

A bench runs on the GPU machine only, so a name it imports from the engine can be renamed under it without any CPU
test noticing; the first to find out was a device call spent on an ``ImportError`` (``bench/device_adam.py`` still
imported ``fp32_gradient`` after it became ``state_gradient``). Importing a script runs its module level only: each
guards its work behind ``__name__ == "__main__"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, load_script

SCRIPTS = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "bench").glob("*.py"))


def test_the_bench_has_scripts_to_import():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_bench_script_imports(script: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # (the scripts import their neighbours, e.g. user_models)
    monkeypatch.setattr(sys, "argv", [script])
    module = load_script(script)
    assert Path(module.__file__).resolve() == (ROOT / script).resolve()
    assert hasattr(module, "main") or module.__doc__, f"{script} has neither a main() nor a docstring saying what it is"
