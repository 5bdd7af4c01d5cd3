"""Data parallelism over gloo: 2 ranks under torchrun equal 1 process with the doubled micro-batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from launch import run_ok, torchrun

JOB = Path(__file__).resolve().parents[1] / "helpers" / "dp_job.py"
pytestmark = pytest.mark.dist


def test_two_ranks_equal_one_rank_with_double_batch(tmp_path):
    data_seed = torch.randint(0, 2**31, ()).item()
    run_ok(torchrun(2, JOB, "--micro", "2", "--data-seed", str(data_seed), "--out", str(tmp_path / "dp.pt")))
    run_ok([sys.executable, str(JOB), "--micro", "4", "--data-seed", str(data_seed), "--out", str(tmp_path / "single.pt")])
    dp, single = torch.load(tmp_path / "dp.pt"), torch.load(tmp_path / "single.pt")
    assert dp["world_size"] == 2 and single["world_size"] == 1
    assert dp["steps"] == single["steps"] == 3
    for name, expected in single["masters"].items():
        torch.testing.assert_close(dp["masters"][name], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("failing, failed_rank, message", [
    ("rank-file", 1, "CheckpointError: another rank failed"),
    ("finalize", 0, "CheckpointError: rank 0 failed to finish")])  # after every file was written: no hang either
def test_a_rank_failing_mid_save_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, failing, failed_rank,
                                                                                message):
    job = Path(__file__).resolve().parents[1] / "helpers" / "save_fail_job.py"
    run_ok(torchrun(2, job, "--save-dir", str(tmp_path / "ckpt"), "--out-prefix", str(tmp_path / "outcome"),
                    "--failing", failing))
    # The disk-full error (an OSError) as one line with the room needed; the partial .tmp-bad is gone.
    assert (tmp_path / f"outcome.{failed_rank}").read_text().startswith("DiskFullError: no space left on the disk of")
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "ckpt").iterdir())
    assert (tmp_path / f"outcome.{1 - failed_rank}").read_text().startswith(message)
    assert (tmp_path / "ckpt" / "latest").read_text() == "good"
    assert not (tmp_path / "ckpt" / "bad").exists()
    manifest = json.loads((tmp_path / "ckpt" / "good" / "manifest.json").read_text())  # every rank's files
    assert sorted(manifest["files"]) == ["model_states.pt", "optim_states.pt", "rank_00000_states.pt",
                                         "rank_00001_states.pt"]
    for name, entry in manifest["files"].items():
        assert (tmp_path / "ckpt" / "good" / name).stat().st_size == entry["size_bytes"]
