"""The README's test command is what CI runs, verbatim, and every test module imports under it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    lines = [line for block in blocks for line in block.splitlines() if "-m pytest" in line]
    assert len(lines) == 1, f"the README should hold one test command, found {lines}"
    return lines[0].strip()


def test_ci_runs_the_readme_test_command_verbatim():
    command = _readme_test_command()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(line.startswith(command + " ") or line == command for line in ci_lines), (
        f"`.ci/run` should run the README's test command as written: {command!r}"
    )
    steps = [part.strip() for part in command.split("&&")]
    assert steps[-1] == "python3 -u -m pytest", "the README's pytest takes no arguments; pyproject holds them"
    assert "ruff check ." in steps, "the README's test command lints the tree with ruff before the tests"


def test_a_bare_pytest_collects_every_test_module():
    # The README's pytest with no arguments on its command line (so sys.argv is the program alone, as a newcomer's
    # is): nothing a test module imports may read sys.argv. The collect-only switch goes in through the environment.
    env = {**os.environ, "PYTEST_ADDOPTS": "--collect-only -q"}
    result = subprocess.run([sys.executable, "-m", "pytest"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    collected = re.search(r"(\d+) tests? collected", result.stdout)
    assert collected and int(collected.group(1)) > 1000, result.stdout[-2000:]
