"""Run health (issue 38): pretrain.py stops a run that no longer trains, and pruning keeps its last good checkpoint."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from angelptm.pretraining.health import RunHealth, checkpoint_is_healthy
from angelptm.pretraining.job_errors import RunUnhealthyError

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_stops_after_max_bad_steps_in_a_row_and_a_healthy_step_resets_the_count():
    health = RunHealth(max_bad_steps=3)
    for step, (applied, finite) in enumerate([(False, True), (True, False), (True, True), (False, True),
                                              (True, False)], start=1):
        health.record(step, applied=applied, finite=finite)
    assert health.bad_steps == 2 and not health.healthy
    with pytest.raises(RunUnhealthyError, match=r"no healthy step in the last 3 steps \(up to step 6; "
                                                r"train.max_bad_steps 3\): the step was skipped"):
        health.record(6, applied=False, finite=True)


def fake_checkpoint(path: Path, healthy: bool | None) -> None:
    path.mkdir()
    client_state = {} if healthy is None else {"healthy": healthy}
    torch.save({"module": {}, "client_state": client_state}, path / "model_states.pt")


def test_pruning_keeps_the_newest_healthy_checkpoint_when_unhealthy_ones_are_newer(tmp_path):
    sys.path.insert(0, str(ROOT))
    from pretrain import prune_checkpoints

    for step, healthy in ((1, None), (2, True), (3, False), (4, False), (5, False)):
        fake_checkpoint(tmp_path / f"global_step{step}", healthy)
    (tmp_path / "latest").write_text("global_step5")
    prune_checkpoints(str(tmp_path), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step2", "global_step4",
                                                                        "global_step5"]
    assert checkpoint_is_healthy(tmp_path / "global_step2") and not checkpoint_is_healthy(tmp_path / "global_step4")


def tiny_diverging_config(tmp_path: Path, **params: float) -> Path:
    config = json.loads((ROOT / "configs" / "tiny.json").read_text())
    config["optimizer"]["params"].update(params)
    config.pop("scheduler")
    config["model"].update(num_layers=1, hidden_size=32, max_seq_len=32)
    config["train_micro_batch_size_per_gpu"] = 2
    config["data"]["cache_dir"] = str(ROOT / ".cache" / "angelptm")
    config["train"] = {"steps": 40, "save_dir": str(tmp_path / "run"), "save_interval": 1, "log_interval": 1,
                       "keep_last": 1, "max_bad_steps": 3}
    (tmp_path / "c.json").write_text(json.dumps(config))
    return tmp_path / "c.json"


def test_pretrain_that_diverges_stops_naming_the_last_healthy_checkpoint(tmp_path, capsys):
    """The largest lr and weight decay the parse allows (10 each): AdamW's decoupled decay multiplies every weight
    by 1 - lr * weight_decay = -99 per step, so after a healthy step or two the gradients overflow at every step."""
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    save_dir = tmp_path / "run"
    assert job.main(["--config", str(tiny_diverging_config(tmp_path, lr=10.0, weight_decay=10.0))]) == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: no healthy step in the last 3 steps"), errors
    found = re.search(r"up to step (\d+);.* the last healthy checkpoint is (\S+) and `latest` names it", errors[0])
    assert found, errors[0]
    stop_step, healthy = int(found[1]), Path(found[2])
    assert healthy.parent == save_dir and (save_dir / "latest").read_text() == healthy.name
    assert checkpoint_is_healthy(healthy) and healthy.name == f"global_step{stop_step - 3}"
    assert not checkpoint_is_healthy(save_dir / f"global_step{stop_step - 1}")
    assert not (save_dir / f"global_step{stop_step}").exists()  # the stop saves nothing more


def test_pretrain_refuses_the_issues_lr_of_1e10_before_building_anything(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    assert job.main(["--config", str(tiny_diverging_config(tmp_path, lr=1e10))]) == 2
    err = capsys.readouterr().err
    assert "optimizer.params.lr: 10000000000.0 is outside [0, 10]" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_second_pretrain_on_the_same_save_dir_is_refused_at_start(tmp_path, capsys, monkeypatch):
    import subprocess

    from test_checkpoint_safety import HOLD_LOCK

    sys.path.insert(0, str(ROOT))
    import pretrain as job

    def no_model(*args, **kwargs):
        raise AssertionError("the run should stop before building anything")

    monkeypatch.setattr(job, "build_dataset", no_model)
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(save_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert job.main(["--save-dir", str(save_dir), "--steps", "3"]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"is being written by another process (pid {holder.pid}" in err and "Traceback" not in err


# ------------------------------------------------------------------ every diverged run ends non-zero
def test_fp16_scale_search_steps_are_not_counted_and_a_nan_distrusts_the_checkpoint_before_it():
    health = RunHealth(max_bad_steps=2)
    for step in range(1, 30):  # fp16's scaler halving from 2**40: skipped, finite, never a stop
        health.record(step, applied=False, finite=True, scale_search=True)
    assert health.healthy and health.last_trusted_step is None
    health.record(30, applied=False, finite=True)  # an overflow without a scaler: counted
    assert health.last_trusted_step == 29 and not health.diverged
    health.record(31, applied=True, finite=True)
    health.record(32, applied=False, finite=False, scale_search=True)  # a NaN loss always counts
    assert health.diverged and health.last_trusted_step == 30  # step 32's NaN came from the weights saved at 31
    assert "the run ended at step 32 with a non-finite loss: it diverged at step 32" in str(health.ended_diverged(32))


def job_config(tmp_path: Path, *, steps: int, save_interval: int, log_interval: int, **sections: dict) -> Path:
    """The small GPT of :func:`tiny_diverging_config` with the default lr and ``train.max_bad_steps`` (20)."""
    config = json.loads(tiny_diverging_config(tmp_path).read_text())
    config["train"].update(steps=steps, save_interval=save_interval, log_interval=log_interval, keep_last=100)
    del config["train"]["max_bad_steps"]
    config.update(sections)
    (tmp_path / "c.json").write_text(json.dumps(config))
    return tmp_path / "c.json"


def test_a_run_shorter_than_max_bad_steps_that_ends_with_a_nan_loss_exits_3_and_latest_is_trusted(tmp_path, capsys,
                                                                                            monkeypatch):
    """NaN losses over the last steps of a run, fewer than the 20 of train.max_bad_steps. (The issue's cause,
    ``warmup_max_lr: 1e10``, is refused at parse now: the model's loss turns NaN from its fourth forward instead.)
    It used to end "done: final loss nan" with exit status 0 and `latest` on a NaN checkpoint."""
    STEPS = 6
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    nan_from_the_fourth_forward(monkeypatch)
    config = job_config(tmp_path, steps=STEPS, save_interval=1, log_interval=1)
    assert job.main(["--config", str(config)]) == 3
    out, err = capsys.readouterr()
    nan_steps = [int(step) for step in re.findall(rf"step (\d+)/{STEPS} \| loss nan", out)]
    assert nan_steps and nan_steps[-1] == STEPS and len(nan_steps) < 20, out
    first_nan = nan_steps[0]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: the run ended at step {STEPS} with a non-finite loss: it diverged at step {first_nan}"), errors
    trusted = tmp_path / "run" / f"global_step{first_nan - 2}"  # step first_nan's NaN came from first_nan - 1's weights
    assert f"the last healthy checkpoint is {trusted} and `latest` names it" in errors[0], errors[0]
    assert (tmp_path / "run" / "latest").read_text() == trusted.name and checkpoint_is_healthy(trusted)
    assert not checkpoint_is_healthy(tmp_path / "run" / f"global_step{first_nan}")  # kept, for inspection only
    assert "done: final loss" not in err


def test_fp16_searching_down_from_a_scale_of_2_40_is_not_a_diverged_run(tmp_path, capsys, caplog):
    """fp16.initial_scale_power 40 overflows for 20-odd steps while the scaler halves its scale, then trains:
    it used to stop after 20 halvings with "no healthy checkpoint ... lower the lr"."""
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    config = job_config(tmp_path, steps=36, save_interval=12, log_interval=12, bf16={"enabled": False},
                        fp16={"enabled": True, "initial_scale_power": 40})
    assert job.main(["--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert "error:" not in err and "no healthy step" not in caplog.text + err, err[-2000:]
    assert "step skipped, loss scale lowered to" in caplog.text  # the search did happen
    losses = [float(loss) for loss in re.findall(r"step \d+/36 \| loss (\d+\.\d+)", out)]
    assert len(losses) == 3, out
    assert (tmp_path / "run" / "latest").read_text() == "global_step36"
    assert checkpoint_is_healthy(tmp_path / "run" / "global_step12")  # saved mid-search: its weights are fine


def test_fp16_overflowing_at_its_minimum_loss_scale_stops_with_one_error_line(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    config = job_config(tmp_path, steps=30, save_interval=4, log_interval=4, bf16={"enabled": False},
                        fp16={"enabled": True, "initial_scale_power": 40, "min_loss_scale": 2 ** 34})
    assert job.main(["--config", str(config)]) == 3
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert f"loss scale at fp16.min_loss_scale={2 ** 34}" in errors[0], errors[0]
    assert "fp16.initial_scale_power=40" in errors[0], errors[0]  # the search's start, as well as its floor
    # The checkpoints saved while the scaler searched (every step skipped so far) are healthy: one is named.
    found = re.search(r"the last healthy checkpoint is (\S+global_step\d+) and `latest` names it", errors[0])
    assert found and Path(found[1]).is_dir() and checkpoint_is_healthy(Path(found[1])), errors[0]


def nan_from_the_fourth_forward(monkeypatch) -> None:
    """The pretraining GPT's loss turns NaN from its fourth forward (one micro-batch a step: from step 4)."""
    from angelptm.pretraining.models.gpt import GPT

    forward, calls = GPT.forward, []

    def nan_from_the_fourth(self, *args, **kwargs):
        calls.append(None)
        loss = forward(self, *args, **kwargs)
        return loss * float("nan") if len(calls) >= 4 else loss

    monkeypatch.setattr(GPT, "forward", nan_from_the_fourth)


def test_with_no_trusted_checkpoint_latest_is_moved_aside_and_a_rerun_refuses(tmp_path, capsys, monkeypatch):
    """save_interval 3, NaN from step 4: global_step3 holds the weights that gave it, so no checkpoint is trusted.
    `latest` used to stay on global_step3 and every rerun resumed it and diverged again."""
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    nan_from_the_fourth_forward(monkeypatch)
    config = job_config(tmp_path, steps=6, save_interval=3, log_interval=1)
    run = tmp_path / "run"
    assert job.main(["--config", str(config)]) == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no healthy checkpoint" in errors[0], errors
    assert f"moved aside to {run / 'latest.untrusted'}" in errors[0] and "named global_step3" in errors[0], errors[0]
    assert not (run / "latest").exists() and (run / "latest.untrusted").read_text() == "global_step3"
    assert job.main(["--config", str(config)]) == 2  # a checkpoint problem
    err = capsys.readouterr().err
    assert "latest.untrusted" in err and "trusted none of its checkpoints" in err, err[-2000:]
    assert "step 4/6" not in err


def test_without_latest_a_checkpoint_saved_unhealthy_is_not_resumed(tmp_path, capsys, monkeypatch):
    """save_interval 5, NaN from step 4: global_step5 is kept for inspection (saved unhealthy, `latest` never
    written). The rerun's fallback to the newest checkpoint used to resume it."""
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    nan_from_the_fourth_forward(monkeypatch)
    config = job_config(tmp_path, steps=6, save_interval=5, log_interval=1)
    run = tmp_path / "run"
    assert job.main(["--config", str(config)]) == 3
    assert not (run / "latest").exists() and not checkpoint_is_healthy(run / "global_step5")
    capsys.readouterr()
    assert job.main(["--config", str(config)]) == 2  # a checkpoint problem
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no checkpoint to resume from: global_step5 was saved while the run was unhealthy" \
        in errors[0], err[-2000:]
