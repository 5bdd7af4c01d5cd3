"""Expert parallelism over 4 gloo processes treated as 2 nodes x 2 ranks: flat and hierarchical
all-to-all (with and without chunked overlap) give identical outputs and gradients, equal to a
single-process layer holding every expert; capacity drops and an expert with no tokens included."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).resolve().parents[1] / "helpers" / "moe_ep_job.py"
pytestmark = pytest.mark.dist


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_flat_and_hierarchical_all_to_all_match_the_single_process_reference(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    seed = torch.randint(0, 2**20, ()).item()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                             f"--master-port={free_port()}", str(JOB), "--ranks-per-node", "2", "--seed", str(seed),
                             "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"seed {seed}:\n{result.stderr[-4000:]}"
    assert sorted(p.name for p in tmp_path.glob("ok.*")) == ["ok.0", "ok.1", "ok.2", "ok.3"]
