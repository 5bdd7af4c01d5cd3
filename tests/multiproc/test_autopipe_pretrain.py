"""``pretrain.py`` with an "autopipe" section: 2 pipeline stages under torchrun train, checkpoint and resume."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
from launch import run, shipped_config, torchrun

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"step (\d+)/\d+ \| loss (\d+\.\d+)")
pytestmark = pytest.mark.dist


def pretrain(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The shipped tiny_autopipe config under torchrun, in fp32: its bf16 matmuls would take 8x as long on a CPU
    without bf16 units, and the split, its checkpoint and the resume do not depend on the dtype."""
    config = shipped_config("tiny_autopipe.json")
    path = tmp_path / "tiny_autopipe_fp32.json"
    path.write_text(json.dumps(config))
    return run(torchrun(2, ROOT / "pretrain.py", "--config", str(path), *args), cwd=tmp_path, timeout=600)


def test_pipeline_job_trains_plans_and_resumes_with_its_split(tmp_path):
    first = pretrain(tmp_path, "--steps", "10")
    assert first.returncode == 0, first.stderr[-4000:]
    output = first.stdout + first.stderr
    assert "AutoPipe plan (1f1b, 2 stages" in output and "predicted speedup of auto over uniform-layers" in output
    # Two ranks: the saves are written before training goes on (their end is a collective), and the log says so.
    assert "train.background_save: with 2 ranks each checkpoint is written before training goes on" in output
    logged = [(int(s), float(loss)) for s, loss in LOSS.findall(output)]
    assert [s for s, _ in logged] == [10] and logged[0][1] < math.log(4096) - 0.1  # below the uniform guess
    save_dir = tmp_path / "checkpoints" / "tiny_autopipe"
    assert (save_dir / "latest").read_text() == "global_step10"
    second = pretrain(tmp_path, "--steps", "12")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "keeping the checkpoint's split" in second.stderr and "resumed from" in second.stderr
    assert [int(s) for s, _ in LOSS.findall(second.stdout + second.stderr)] == [12]
