"""A dead or hung rank ends a 2-rank gloo job of pretrain.py with an error naming it, well within 60 s."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import free_port, shipped_config, torchrun

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"step \d+/\d+ \| loss")
LIMIT_S = 60
pytestmark = pytest.mark.dist


def write_config(tmp_path: Path) -> Path:
    config = shipped_config("tiny.json")
    config["train_micro_batch_size_per_gpu"] = 2
    config["model"].update(num_layers=1, hidden_size=32, max_seq_len=32)
    config["data"]["seq_len"] = 32
    config["train"].update(steps=100_000, save_interval=100_000, log_interval=1)
    config["comms"] = {"timeout_s": 600, "lost_rank_after_s": 5}  # far below the collective timeout
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def wait_for_training(process: subprocess.Popen) -> list[str]:
    """Lines of rank 0's output until it logs a training step."""
    lines, deadline = [], time.monotonic() + 240
    for line in process.stdout:
        lines.append(line)
        if STEP.search(line) or time.monotonic() > deadline:
            return lines
    raise AssertionError("rank 0 ended before training:\n" + "".join(lines[-40:]))


def start_ranks(tmp_path: Path) -> list[subprocess.Popen]:
    """Rank 0 and rank 1 of pretrain.py as plain processes (as a multi-node launcher starts them)."""
    config, port = write_config(tmp_path), str(free_port())
    ranks = []
    for rank in (0, 1):
        env = environment(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen([sys.executable, str(ROOT / "pretrain.py"), "--config", str(config)],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return ranks


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_a_lost_rank_ends_the_job_with_its_name(tmp_path, fault):
    rank0, rank1 = start_ranks(tmp_path)
    try:
        wait_for_training(rank0)
        # SIGKILL: gloo fails the next collective at once; SIGSTOP (a hang): only the heartbeat notices.
        rank1.send_signal(signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
        start = time.monotonic()
        rest = rank0.communicate(timeout=LIMIT_S)[0]
        elapsed = time.monotonic() - start
    finally:
        for process in (rank0, rank1):
            process.kill()
            process.wait()
    print(f"{fault}: rank 0 exited {elapsed:.1f} s after rank 1 was stopped;", *re.findall(r"error: .*", rest))
    assert rank0.returncode == 3, rest[-3000:]
    assert re.search(r"error: rank 1 (of 2 )?(is lost|stopped)", rest), rest[-3000:]
    assert elapsed < LIMIT_S


def child_with_rank(parent: int, rank: int, timeout_s: float = 60) -> int:
    """The pid of torchrun's worker with RANK=``rank``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == parent and f"RANK={rank}\0".encode() in (entry / "environ").read_bytes():
                    return int(entry.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.2)
    raise AssertionError(f"no worker with RANK={rank} under pid {parent}")


def test_under_torchrun_a_killed_rank_ends_the_job(tmp_path):
    command = torchrun(2, ROOT / "pretrain.py", "--config", str(write_config(tmp_path)))
    job = subprocess.Popen(command, cwd=tmp_path, env=environment(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_training(job)
        os.kill(child_with_rank(job.pid, 1), signal.SIGKILL)
        start = time.monotonic()
        rest = job.communicate(timeout=LIMIT_S)[0]
        elapsed = time.monotonic() - start
    finally:
        job.kill()
        job.wait()
    print(f"torchrun: the job ended {elapsed:.1f} s after rank 1 was killed;", *re.findall(r"error: .*", rest))
    assert job.returncode != 0 and elapsed < LIMIT_S
    assert re.search(r"error: rank 1 (of 2 )?(is lost|stopped)", rest), rest[-3000:]
