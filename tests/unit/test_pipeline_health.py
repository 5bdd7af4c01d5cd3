"""Issue 38: the AutoPipe pipeline's training loop stops a run with no healthy step in ``train.max_bad_steps``, as
``pretrain.py``'s main loop does, naming the last checkpoint to trust, which pruning spared and ``latest`` names.

The loop runs for real (its saves, pruning and stop); only the pipeline's step is a fake that reports the
loss and gradient norm of a run that diverges after two healthy steps."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from angelptm.config import load_config
from angelptm.launch.distributed import DistContext
from angelptm.pretraining import pipeline_parallel
from angelptm.pretraining.health import checkpoint_is_healthy
from angelptm.pretraining.job_errors import RunUnhealthyError

ROOT = Path(__file__).resolve().parents[2]


class FakeOptimizer:
    param_groups = [{"lr": 1e-3}]

    def state_dict(self) -> dict:
        return {"masters": {}}


class FakeLoader:
    def __iter__(self):
        return iter(())

    def state_dict(self) -> dict:
        return {"epoch": 0}


def fake_runner() -> SimpleNamespace:
    weight = torch.nn.Parameter(torch.ones(2))
    return SimpleNamespace(named_parameters=lambda: [("w", weight)], op_starts=[0],
                           layout=SimpleNamespace(num_replicas=1))


def test_the_pipeline_loop_stops_after_max_bad_steps_naming_the_last_healthy_checkpoint(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT))
    from pretrain import prune_checkpoints

    save_dir = tmp_path / "run"
    cfg = load_config({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {}},
                       "train": {"steps": 40, "save_dir": str(save_dir), "save_interval": 1, "log_interval": 1,
                                 "keep_last": 1, "max_bad_steps": 3}})
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), group=None)
    steps = iter([(1.0, 2.0), (0.5, 1.5)] + [(math.nan, math.nan)] * 38)  # (loss, gradient norm) per step

    def fake_step(cfg, runner, optimizer, batches):
        loss, norm = next(steps)
        return torch.tensor(loss), norm

    monkeypatch.setattr(pipeline_parallel, "train_step", fake_step)
    with pytest.raises(RunUnhealthyError) as info:
        pipeline_parallel.run_loop(cfg, ctx, fake_runner(), FakeOptimizer(), None, FakeLoader(), 0, 1.0, 8,
                                   stop_requested=lambda: False,
                                   after_save=lambda: prune_checkpoints(str(save_dir), cfg.train.keep_last))
    message = str(info.value)
    assert message.startswith("no healthy step in the last 3 steps (up to step 5; train.max_bad_steps 3): the loss "
                              "is not finite"), message
    # Step 3's NaN loss came from the weights saved as global_step2 (healthy when saved): the last to trust is 1.
    assert f"the last healthy checkpoint is {save_dir / 'global_step1'}" in message, message
    assert "the one of step 2 holds the weights that gave the first non-finite loss" in message, message
    assert (save_dir / "latest").read_text() == "global_step1"
    assert checkpoint_is_healthy(save_dir / "global_step1")
    # Pruning waits for the step after a save, and keep_last 1 never took global_step1 from under the NaN; the
    # checkpoints after it are kept for inspection, those after the NaN marked unhealthy.
    assert not checkpoint_is_healthy(save_dir / "global_step3") and not checkpoint_is_healthy(save_dir / "global_step4")
    assert not (save_dir / "global_step5").exists()  # the stop saves nothing more


def test_a_skipped_pipeline_step_with_a_finite_loss_is_named_as_skipped(tmp_path, monkeypatch):
    save_dir = tmp_path / "run"
    cfg = load_config({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {}},
                       "train": {"steps": 10, "save_dir": str(save_dir), "save_interval": 100, "log_interval": 100,
                                 "max_bad_steps": 2}})
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), group=None)
    monkeypatch.setattr(pipeline_parallel, "train_step", lambda *args: (torch.tensor(3.0), math.inf))
    with pytest.raises(RunUnhealthyError, match=r"last 2 steps \(up to step 2.*the step was skipped.*no healthy "
                                                r"checkpoint in"):
        pipeline_parallel.run_loop(cfg, ctx, fake_runner(), FakeOptimizer(), None, FakeLoader(), 0, 1.0, 8,
                                   stop_requested=lambda: False, after_save=lambda: None)
