"""transformers' Trainer on this engine against Trainer + real DeepSpeed (CPU, fp32, ZeRO stages 0-2).

Both backends run in processes of their own at the same time (tests/helpers/hf_trainer_job.py):
``TrainingArguments(deepspeed=...)`` leaves process-wide state behind, and DeepSpeed needs a launcher
environment. Each writes per-step losses; the checks read them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from hf_trainer_job import CASES, STEPS  # noqa: E402  (tests/helpers, after the skips)

JOB = Path(__file__).resolve().parents[1] / "helpers" / "hf_trainer_job.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("hf_trainer")
    base = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    # Real DeepSpeed needs a launcher's environment even for one rank (else it tries MPI discovery).
    launcher = {"DS_ACCELERATOR": "cpu", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    running = {}
    for backend, env in (("deepspeed", {**base, **launcher}), ("angelptm", base)):
        (root / backend).mkdir()
        running[backend] = subprocess.Popen(
            [sys.executable, str(JOB), backend, str(root / f"{backend}.json"), str(root / backend)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    for backend, process in running.items():
        log, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"{backend} job failed:\n{log[-4000:]}"
        out[backend] = json.loads((root / f"{backend}.json").read_text())
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_equal_trainer_with_deepspeed(results, case):
    ours, theirs = results["angelptm"][case], results["deepspeed"][case]
    assert len(ours) == len(theirs) == STEPS
    assert min(theirs[1:]) < theirs[0], "the model must learn, or agreement proves little"
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)


def test_resume_from_a_trainer_checkpoint_continues_like_the_uninterrupted_run(results):
    resume = results["angelptm"]["resume"]
    straight, resumed = resume["straight"], resume["resumed"]
    assert len(straight) == len(resumed) == STEPS  # steps 1-2 from the checkpoint's log, 3-4 trained after it
    # The resumed model started from other weights (seed 7): only a real load gives these losses.
    assert resumed[2:] == pytest.approx(straight[2:], abs=1e-6)


def test_save_model_and_hf_export_load_with_from_pretrained(results):
    saved = results["angelptm"]["save_model"]
    assert saved["scale"] > 0.1
    assert saved["diff"] <= 1e-6 and saved["export_diff"] <= 1e-6
    assert "model.safetensors.index.json" in saved["export_files"], "a small max_shard_size must shard"


def test_zero_cache_config_trains_and_tracks_the_plain_engine(results):
    cached = results["angelptm"]["zero_cache"]
    assert cached["tiers"] == ["device", "host"], "the budgets must split the states over two tiers"
    assert min(cached["losses"][1:]) < cached["losses"][0]
    assert cached["losses"] == pytest.approx(cached["plain"], rel=1e-5)


def test_training_arguments_without_deepspeed_are_refused(results):
    message = results["angelptm"]["refusal"]
    assert message.startswith("ConfigError") and "TrainingArguments(deepspeed=" in message
