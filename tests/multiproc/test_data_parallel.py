"""Data parallelism over gloo: 2 ranks under torchrun equal 1 process with the doubled micro-batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launch import run_ok, torchrun

import angelptm

JOB = Path(__file__).resolve().parents[1] / "helpers" / "dp_job.py"
pytestmark = pytest.mark.dist


def test_two_ranks_equal_one_rank_with_double_batch(tmp_path):
    data_seed = torch.randint(0, 2**31, ()).item()
    run_ok(torchrun(2, JOB, "--micro", "2", "--data-seed", str(data_seed), "--out", str(tmp_path / "dp.pt")))
    run_ok([sys.executable, str(JOB), "--micro", "4", "--data-seed", str(data_seed),
            "--out", str(tmp_path / "single.pt")])
    dp, single = torch.load(tmp_path / "dp.pt"), torch.load(tmp_path / "single.pt")
    assert dp["world_size"] == 2 and single["world_size"] == 1
    assert dp["steps"] == single["steps"] == 3
    for name, expected in single["masters"].items():
        torch.testing.assert_close(dp["masters"][name], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("failing, failed_rank, message", [
    ("rank-file", 1, "CheckpointError: another rank failed"),
    ("finalize", 0, "CheckpointError: rank(s) [0] failed to finish")])  # after every file was written: no hang either
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


def test_ranks_saving_into_different_directories_each_create_and_publish_their_own(tmp_path):
    """HelloDeepSpeed names its checkpoint directory by a per-rank timestamp, so ranks can disagree: each rank
    must create what it writes, as with DeepSpeed. Each directory then holds its ranks' files under its own
    manifest and ``latest``; rank 0's (the model and optimizer) loads back."""
    from angelptm.checkpoints import files as checkpoint
    from angelptm.checkpoints.paths import LOCK_FILE

    run_ok(torchrun(2, Path(__file__).resolve().parents[1] / "helpers" / "per_rank_dirs_job.py",
                    "--base", str(tmp_path)))
    expected = {"rank0": ["manifest.json", "model_states.pt", "optim_states.pt", "rank_00000_states.pt"],
                "rank1": ["manifest.json", "rank_00001_states.pt"]}
    for directory, files in expected.items():
        root = tmp_path / directory
        # no temporary leftovers (the writer lock names the job that wrote here: angelptm.checkpoints.writer_lock)
        assert sorted(p.name for p in root.iterdir() if p.name != LOCK_FILE) == ["latest", "step1", "step2"]
        assert (root / "latest").read_text() == "step2"
        assert sorted(p.name for p in (root / "step2").iterdir()) == files
        listed = json.loads((root / "step2" / "manifest.json").read_text())["files"]
        assert sorted(listed) == files[1:]
        assert all((root / "step2" / name).stat().st_size == entry["size_bytes"] for name, entry in listed.items())
    assert checkpoint.resolve(tmp_path / "rank0", None) == tmp_path / "rank0" / "step2"  # it verifies
    with pytest.raises(angelptm.CheckpointError, match="lists no model_states.pt"):  # rank 1's alone cannot load
        checkpoint.resolve(tmp_path / "rank1", "step2")
    torch.manual_seed(1)  # other initial weights: only a real load gives the saved ones
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, *_ = angelptm.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                          "bf16": {"enabled": False},
                                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    engine.load_checkpoint(str(tmp_path / "rank0"))
    saved = torch.load(tmp_path / "weights.pt")
    loaded = engine.consolidated_state_dict()
    assert saved["0.weight"].abs().max() > 0.05
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
