"""The main job end to end: `python pretrain.py` trains, logs, checkpoints, resumes and stops cleanly."""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import shipped_config

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"step (\d+)/\d+ \| loss (\d+\.\d+)")


def pretrain(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pretrain.py"), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


def test_default_job_trains_then_resumes(tmp_path):
    first = pretrain(tmp_path, "--steps", "20")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "starting fresh" in first.stderr and "WARNING" not in first.stderr  # a first run is not a problem
    logged = [(int(s), float(loss)) for s, loss in LOSS.findall(first.stderr + first.stdout)]
    assert [s for s, _ in logged] == [10, 20]
    assert logged[-1][1] < logged[0][1], "the loss should fall over the first 20 steps"
    assert "TFLOPS" in first.stdout and "tokens/s" in first.stdout
    save_dir = tmp_path / "checkpoints" / "tiny"
    assert (save_dir / "latest").read_text() == "global_step20"
    assert not (save_dir / ".writer.lock").read_text()  # released at the clean end: it names no holder
    second = pretrain(tmp_path, "--steps", "30")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    assert "took over the writer lock" not in second.stderr  # the first run was not "a process that is gone"
    assert [int(s) for s, _ in LOSS.findall(second.stdout)] == [30]
    assert (save_dir / "latest").read_text() == "global_step30"
    again = pretrain(tmp_path, "--steps", "30")  # the finished run, run again: how to go on, not "loss nan"
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already at its last step (train.steps 30)" in again.stderr and "--steps 60" in again.stderr
    assert "nan" not in again.stderr and not LOSS.findall(again.stdout)
    assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith("global_step"))[-1] == "global_step30"


def test_interrupt_saves_and_exits(tmp_path):
    process = subprocess.Popen([sys.executable, str(ROOT / "pretrain.py"), "--steps", "100000"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, seen = time.monotonic() + 300, []
    for line in process.stdout:  # wait until training is under way
        seen.append(line)
        if LOSS.search(line) or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGINT)
    rest = process.communicate(timeout=300)[0]
    everything = "".join(seen) + rest  # (the signal may land right after the step line read above)
    assert process.returncode == 0, rest[-3000:]
    assert "saving a checkpoint" in rest
    tag = (tmp_path / "checkpoints" / "tiny" / "latest").read_text()
    last_step = int(tag.removeprefix("global_step"))
    assert 10 <= last_step < 100000
    # Not "done: final loss" of the last multiple of 10: the loss on the line of the step it stopped at.
    said = re.search(r"interrupted at step (\d+): loss (\d+\.\d+)", rest)
    assert said and int(said[1]) == last_step and "done: final loss" not in rest, rest[-3000:]
    assert f"step {last_step}/100000 | loss {said[2]} " in everything, everything[-3000:]


def test_every_option_has_help(monkeypatch):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    parsers = []
    parse = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, *args, **kwargs: parsers.append(self) or parse(self, *args, **kwargs))
    job.parse_args([])
    (parser,) = parsers
    assert "--log-level" in parser._option_string_actions
    assert not [action.dest for action in parser._actions if not action.help]


@pytest.mark.parametrize("config, message", [
    ({"train_batch_size": 4, "modle": {}}, "did you mean 'model'"),
    ({"train_batch_size": 4, "model": {"hidden_size": 130, "num_heads": 4}}, "hidden_size"),
])
def test_bad_config_is_a_message_not_a_traceback(tmp_path, config, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    result = pretrain(tmp_path, "--config", str(path))
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_prune_keeps_the_newest_and_the_latest(tmp_path):
    sys.path.insert(0, str(ROOT))
    from pretrain import prune_checkpoints

    for step in (1, 5, 10, 20, 100):
        (tmp_path / f"global_step{step}").mkdir()
    (tmp_path / "custom_tag").mkdir()
    (tmp_path / "latest").write_text("global_step100")
    prune_checkpoints(str(tmp_path), keep_last=2)
    left = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert left == ["custom_tag", "global_step100", "global_step20"]


def test_prune_never_touches_tags_newer_than_latest(tmp_path):
    sys.path.insert(0, str(ROOT))
    from pretrain import prune_checkpoints

    rng = random.Random()
    steps = rng.sample(range(1, 1000), rng.randrange(6, 12))
    latest = sorted(steps)[rng.randrange(1, len(steps) - 1)]  # some tags are older than latest, some newer
    keep_last = rng.randrange(1, 4)
    for step in steps:
        (tmp_path / f"global_step{step}").mkdir()
    (tmp_path / "custom_tag").mkdir()
    (tmp_path / "latest").write_text(f"global_step{latest}\n")
    prune_checkpoints(str(tmp_path), keep_last=keep_last)
    older = sorted(s for s in steps if s <= latest)
    expected = {f"global_step{s}" for s in older[-keep_last:] + [s for s in steps if s > latest]} | {"custom_tag"}
    assert {p.name for p in tmp_path.iterdir() if p.is_dir()} == expected, (steps, latest, keep_last)
    assert f"global_step{latest}" in expected
    # No "latest", or one naming a tag that is not global_stepN: nothing to anchor on, nothing deleted.
    before = {p.name for p in tmp_path.iterdir()}
    (tmp_path / "latest").write_text("custom_tag")
    prune_checkpoints(str(tmp_path), keep_last=1)
    (tmp_path / "latest").unlink()
    prune_checkpoints(str(tmp_path), keep_last=1)
    assert {p.name for p in tmp_path.iterdir()} == before - {"latest"}


def test_no_resume_into_a_directory_with_a_checkpoint_is_refused(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    def no_model(*args, **kwargs):
        raise AssertionError("the run should stop before building anything")

    monkeypatch.setattr(job, "build_dataset", no_model)
    monkeypatch.setattr(job, "build_model", no_model)
    save_dir = tmp_path / f"run{random.randrange(1 << 30)}"
    (save_dir / "global_step7").mkdir(parents=True)
    (save_dir / "latest").write_text("global_step7")
    assert job.main(["--no-resume", "--save-dir", str(save_dir), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(save_dir) in err and "--save-dir" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step7", "latest"]  # nothing written or deleted


@pytest.mark.parametrize("top_level", [[], [{"train_batch_size": 4}], "tiny", 3, None])
def test_config_whose_top_level_is_not_an_object_is_a_config_error(tmp_path, top_level):
    sys.path.insert(0, str(ROOT))
    import pretrain as job
    from angelptm.errors import ConfigError

    path = tmp_path / f"cfg{random.randrange(1 << 30)}.json"
    path.write_text(json.dumps(top_level))
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*JSON object"):
        job.read_config(job.parse_args(["--config", str(path)]))
    path.write_text(json.dumps({"train_batch_size": 4, "train": top_level}))
    with pytest.raises(ConfigError, match=re.escape(str(path)) + '.*"train" must be a JSON object'):
        job.read_config(job.parse_args(["--config", str(path), "--steps", "5"]))


def test_zero_cache_job_plans_trains_and_reports_its_tiers(tmp_path):
    # The shipped config in fp32 (its bf16 matmuls take 10x as long as the whole run on a CPU without bf16 units),
    # with the device budget that gives fp32's larger chunks the same split: one chunk's states on each tier.
    config = shipped_config("tiny_zero_cache.json")
    config["zero_cache"]["device_memory_budget"] = "24MiB"
    path = tmp_path / "tiny_zero_cache_fp32.json"
    path.write_text(json.dumps(config))
    plan = pretrain(tmp_path, "--config", str(path), "--plan")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert re.search(r"optimizer states of 2 chunks: 1 on the device, 1 on the host, 0 on NVMe", plan.stdout)
    run = pretrain(tmp_path, "--config", str(path), "--steps", "10")
    assert run.returncode == 0, run.stderr[-3000:]
    # The warm-up's re-plan may move the host chunk's states (it weighs the host's Adam as timed on this machine),
    # so the figures are checked against the budget, not pinned: the device tier within its 24 MiB, the host's
    # staging buffers and kept gradient (zero_cache.optim.revision) at least.
    line = re.search(r"step 10/10 \| loss \d+\.\d+ .*zero-cache device (\d+\.\d+) MiB, host (\d+\.\d+) MiB", run.stdout)
    assert line, run.stdout[-2000:]
    device_mib, host_mib = map(float, line.groups())
    assert 5 < device_mib <= 24 and host_mib > 1, line.group(0)


def test_plan_explains_a_model_that_does_not_fit(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "model": {"num_layers": 2},
                                "zero_cache": {"enabled": True, "device_memory_budget": "1MiB",
                                               "host_memory_budget": "1GB"}}))
    result = pretrain(tmp_path, "--config", str(path), "--plan")
    assert result.returncode == 2
    # Even streamed from the host, a 2 MiB chunk (the largest weight sets the size) of two needs both live, two
    # gradient buckets and the fp32 scratch on the device: 10 MiB, and the 3% margin.
    assert "device tier needs 10.31 MiB but its budget is 1.00 MiB (short by 9.31 MiB)" in result.stdout
    assert "0 param shards of 2.00 MiB at home, 2 gathered groups of 2.00 MiB" in result.stdout
    assert "Raise zero_cache.device_memory_budget to at least 10810062 bytes" in result.stdout
