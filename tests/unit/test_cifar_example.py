"""DeepSpeedExamples' cifar10 example (tests/helpers/cifar_job.py) under real DeepSpeed and under angelptm, two epochs
of ``training_data``: the same batches in every step (DeepSpeed's epochs: the same order each epoch, ``iter()``
from the epoch's start) and the same losses, to the Trainer test's tolerance and, where the config's Adam steps
through DeepSpeed's C++ Adam as DeepSpeed's FusedAdam does on a CPU, bit for bit.

Both backends run in processes of their own at the same time, one OpenMP thread each (the same kernels, so the same
summation orders); DeepSpeed needs a launcher's environment even for one rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import beside_deepspeed

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "cifar_job.py"
SAMPLES, EPOCHS = 640, 2  # 40 steps an epoch: the first epoch's losses used to part from DeepSpeed's at step 37
TOL = 1e-5  # tests/unit/test_hf_trainer.py's


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("cifar")
    out = beside_deepspeed(JOB, root, "--samples", str(SAMPLES), "--epochs", str(EPOCHS))
    for backend in out:
        out[backend]["weights"] = torch.load(root / f"{backend}.json.weights.pt")
    return out


def test_every_step_sees_deepspeeds_batch_in_both_epochs_and_a_fresh_iter_starts_over(results):
    ours, theirs = results["angelptm"], results["deepspeed"]
    steps = SAMPLES // 16
    assert len(ours["labels"]) == len(theirs["labels"]) == EPOCHS * steps
    for step, (a, b) in enumerate(zip(ours["labels"], theirs["labels"])):
        assert a == b, f"step {step + 1}: another batch than DeepSpeed's"
    assert theirs["labels"][steps:] == theirs["labels"][:steps], "DeepSpeed repeats the first epoch's order"
    assert ours["fresh"] == theirs["fresh"] == theirs["labels"][0]


def test_losses_and_weights_equal_deepspeeds(results):
    ours, theirs = results["angelptm"], results["deepspeed"]
    assert ours["lrs"] == theirs["lrs"], "WarmupLR's rates, bit for bit"
    assert min(theirs["losses"]) < theirs["losses"][0] - 0.01, "the model must move, or agreement proves little"
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
        assert abs(a - b) <= TOL, f"step {step + 1}: {a} vs {b}"
    assert theirs["optimizer"] == "FusedAdam"
    if ours["optimizer"] == "DeepSpeedCpuAdam":  # DeepSpeed's cpu_adam op built here: its arithmetic exactly
        assert ours["losses"] == theirs["losses"]
        for name, weight in theirs["weights"].items():
            assert torch.equal(ours["weights"][name], weight), name
