"""A collective that times out while every rank lives is one line naming the rank and comms.timeout_s (issue 29,
point 6); a process group created by pretrain.py is not said to ignore comms.timeout_s, and keeps one heartbeat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import free_port

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "comms_timeout_job.py"
pytestmark = pytest.mark.dist


def test_a_collective_timeout_names_the_rank_and_the_setting(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"train_batch_size": 2, "comms": {"timeout_s": 2, "lost_rank_after_s": 5}}))
    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen([sys.executable, str(JOB), str(config), "8"], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].kill()
    ranks[1].communicate()
    assert "same heartbeat: True" in out and "said it does not apply: False" in out
    assert ranks[0].returncode == 3, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 0 of 2: a collective waited comms.timeout_s = 2 s and timed out while every "
                           "rank's heartbeat still beat") and "raise comms.timeout_s" in last
    assert "Traceback" not in err
