"""What DeepSpeed prints, a plain script shows (issue 28): the compute dtype, the ``steps_per_print`` lines and
the pipeline engine's loss lines reach stdout without the script configuring logging; a script that configured
logging decides what is shown, and nothing is printed twice."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import free_port  # tests/helpers

JOB = Path(__file__).resolve().parents[1] / "helpers" / "plain_script_job.py"



@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    running = {}
    for mode, extra in (("none", []), ("warning", []), ("info", []), ("config", ["--config-log-level", "warning"])):
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}
        logging_mode = "none" if mode == "config" else mode
        running[mode] = subprocess.Popen([sys.executable, str(JOB), "--logging", logging_mode, *extra], env=env,
                                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    done = {}
    for mode, process in running.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        done[mode] = stdout + stderr
    return done


def _losses(output: str) -> list[float]:
    return json.loads(re.search(r"^LOSSES (.*)$", output, re.M).group(1))


def test_a_plain_script_shows_what_deepspeed_prints(outputs):
    out = outputs["none"]
    assert out.count("compute dtype float32: the config names no precision") == 2  # once per initialize()
    assert re.findall(r"step=(\d+), skipped=0, lr=\[0\.01\], mom=", out) == ["2", "4"]
    # DeepSpeed's pipeline line, with the loss train_batch returned.
    printed = re.findall(r"steps: (\d+) loss: ([\d.]+) iter time \(s\): [\d.]+ samples/sec: [\d.]+", out)
    assert [int(step) for step, _ in printed] == [1, 2]
    assert [float(loss) for _, loss in printed] == pytest.approx(_losses(out), abs=1e-4)
    assert re.search(r"^\[[\d\- :,]+\] \[INFO\] \[engine\.py:\d+:_print_progress\] step=2", out, re.M)


def test_a_script_that_configured_logging_decides(outputs):
    assert "step=" not in outputs["warning"] and "steps: 1 loss" not in outputs["warning"]
    info = outputs["info"]
    assert info.count("step=2, skipped=0") == 1 and info.count("steps: 2 loss") == 1  # its handler alone prints
    assert "INFO:angelptm.engine.engine:step=2" in info  # in the application's format, not ours


def test_the_config_log_level_quiets_the_info_lines_as_deepspeeds_does(outputs):
    """DeepSpeed's ``"log_level": "warning"`` in the config: no INFO lines, even in a plain script."""
    quiet = outputs["config"]
    assert "step=" not in quiet and "steps: 1 loss" not in quiet and "compute dtype" not in quiet
    assert _losses(quiet) == pytest.approx(_losses(outputs["none"]))  # the same training, quieter
