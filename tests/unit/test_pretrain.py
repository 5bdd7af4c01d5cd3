"""The main job end to end: `python pretrain.py` trains, logs, checkpoints, resumes and stops cleanly."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"step (\d+)/\d+ \| loss (\d+\.\d+)")


def pretrain(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pretrain.py"), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


def test_default_job_trains_then_resumes(tmp_path):
    first = pretrain(tmp_path, "--steps", "20")
    assert first.returncode == 0, first.stderr[-3000:]
    logged = [(int(s), float(l)) for s, l in LOSS.findall(first.stderr + first.stdout)]
    assert [s for s, _ in logged] == [10, 20]
    assert logged[-1][1] < logged[0][1], "the loss should fall over the first 20 steps"
    assert "TFLOPS" in first.stdout and "tokens/s" in first.stdout
    save_dir = tmp_path / "checkpoints" / "tiny"
    assert (save_dir / "latest").read_text() == "global_step20"
    second = pretrain(tmp_path, "--steps", "30")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    assert [int(s) for s, _ in LOSS.findall(second.stdout)] == [30]
    assert (save_dir / "latest").read_text() == "global_step30"


def test_interrupt_saves_and_exits(tmp_path):
    process = subprocess.Popen([sys.executable, str(ROOT / "pretrain.py"), "--steps", "100000"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    for line in process.stdout:  # wait until training is under way
        if LOSS.search(line) or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGINT)
    rest = process.communicate(timeout=300)[0]
    assert process.returncode == 0, rest[-3000:]
    assert "saving a checkpoint" in rest
    tag = (tmp_path / "checkpoints" / "tiny" / "latest").read_text()
    assert 10 <= int(tag.removeprefix("global_step")) < 100000


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
    (tmp_path / "latest").write_text("global_step5")
    prune_checkpoints(str(tmp_path), keep_last=2)
    left = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert left == ["custom_tag", "global_step100", "global_step20", "global_step5"]
