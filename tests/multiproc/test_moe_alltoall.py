"""Expert parallelism over 4 gloo processes treated as 2 nodes x 2 ranks: flat and hierarchical
all-to-all (with and without chunked overlap) give identical outputs and gradients, equal to a
single-process layer holding every expert; capacity drops and an expert with no tokens included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import run, torchrun

JOB = Path(__file__).resolve().parents[1] / "helpers" / "moe_ep_job.py"
pytestmark = pytest.mark.dist


def test_flat_and_hierarchical_all_to_all_match_the_single_process_reference(tmp_path):
    seed = torch.randint(0, 2**20, ()).item()
    result = run(torchrun(4, JOB, "--ranks-per-node", "2", "--seed", str(seed), "--out-dir", str(tmp_path)))
    assert result.returncode == 0, f"seed {seed}:\n{result.stderr[-4000:]}"
    assert sorted(p.name for p in tmp_path.glob("ok.*")) == ["ok.0", "ok.1", "ok.2", "ok.3"]
