"""Sharded ZeRO-Cache over NCCL on two GPUs: in-place reduce-scatter and all-gather on NCCL's stream."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from launch import run_ok, torchrun

JOB = Path(__file__).resolve().parents[1] / "helpers" / "zero_cache_dp_job.py"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def test_two_gpus_equal_one_gpu_with_the_same_global_batch_and_resume(tmp_path):
    seed = str(torch.randint(0, 2**31, ()).item())
    common = ["--global-batch", "4", "--data-seed", seed]
    run_ok([sys.executable, str(JOB), *common, "--steps", "4", "--out", str(tmp_path / "one.pt")])
    run_ok([sys.executable, str(JOB), *common, "--steps", "0", "--out", str(tmp_path / "start.pt")])
    run_ok(torchrun(2, JOB, *common, "--steps", "2", "--save-dir", str(tmp_path / "ckpt"),
                    "--out", str(tmp_path / "half.pt")))
    run_ok(torchrun(2, JOB, *common, "--steps", "2", "--load", str(tmp_path / "ckpt"),
                    "--out", str(tmp_path / "two.pt")))
    one, two, start = (torch.load(tmp_path / f"{name}.pt")["weights"] for name in ("one", "two", "start"))
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3, "training must move the weights"
    for name, expected in one.items():  # fp32 on GPU: equal up to reduction order (TF32 is off by default)
        torch.testing.assert_close(two[name], expected, rtol=1e-3, atol=1e-4)


SHARD = "--shard-params"


@pytest.mark.parametrize("extra", [["--accumulation", "2"], ["--clip", "0"], ["--hosts-of", "1"], [SHARD],
                                   [SHARD, "--checkpointing", "--untied", "--clip", "0"],
                                   [SHARD, "--accumulation", "2"], [SHARD, "--hosts-of", "1"]],
                         ids=["accumulate", "in-backward", "hierarchical", "shard-params",
                              "shard-params-recompute-in-backward", "shard-params-accumulate",
                              "shard-params-hierarchical"])
def test_two_gpus_bucketed_or_in_backward_equal_one_gpu(tmp_path, extra):
    """Accumulating micro-batches reduce from gradient buckets; without clipping host chunks update during
    backward; as 2 hosts of 1 GPU the collectives run as two chained stages on a side stream. Sharded
    params: gathered on NCCL's stream ahead of use, reduced out of place into the owner's shard."""
    common = ["--global-batch", "4", "--data-seed", str(torch.randint(0, 2**31, ()).item()), "--steps", "3", *extra]
    run_ok([sys.executable, str(JOB), *common, "--out", str(tmp_path / "one.pt")])
    run_ok(torchrun(2, JOB, *common, "--out", str(tmp_path / "two.pt")))
    one, two = (torch.load(tmp_path / f"{name}.pt")["weights"] for name in ("one", "two"))
    for name, expected in one.items():
        torch.testing.assert_close(two[name], expected, rtol=1e-3, atol=1e-4)
