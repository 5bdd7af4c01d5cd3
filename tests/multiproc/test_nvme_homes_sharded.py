"""Params homed on NVMe over gloo ranks (and one rank): the same weights as one process with replicated params."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from launch import run_ok, torchrun

JOB = Path(__file__).resolve().parents[1] / "helpers" / "zero_cache_dp_job.py"
pytestmark = pytest.mark.dist


def train(nproc: int, out: Path, data_seed: int, *extra: str) -> dict:
    args = ("--global-batch", "4", "--data-seed", str(data_seed), "--steps", "4", "--out", str(out), *extra)
    run_ok(torchrun(nproc, JOB, *args) if nproc > 1 else [sys.executable, str(JOB), *args])
    return torch.load(out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[int, dict, dict]:
    """(data seed, weights after 4 steps of one process with replicated params, weights after 0 steps)."""
    root = tmp_path_factory.mktemp("one_process")
    data_seed = torch.randint(0, 2**31, ()).item()
    return (data_seed, train(1, root / "four.pt", data_seed)["weights"],
            train(1, root / "zero.pt", data_seed, "--steps", "0")["weights"])


@pytest.mark.parametrize("nproc, extra", [(1, ()), (2, ("--shard-params", "--destroy"))],
                         ids=["one-rank", "two-ranks-sharded"])
def test_params_homed_on_nvme_train_like_one_process(tmp_path, one_process, nproc, extra):
    """Each rank's shards live in its own swap file (the job asserts every home is "nvme"), read in through a few
    pinned buffers before every gather and updated by the host's Adam; checkpointed blocks gather evicted groups
    again in backward. Equal to one process with replicated params up to summation order (see
    test_zero_cache_sharded.assert_same_weights), and nothing is left under the swap directory. Two ranks end with
    engine.destroy(), and the weights compared are their module's then: whole, the masters of the shards the other
    rank owns gathered (and no swap file is open after it)."""
    data_seed, expected, start = one_process
    swap = tmp_path / "swap"
    swap.mkdir()
    result = train(nproc, tmp_path / "nvme.pt", data_seed, *extra, "--checkpointing", "--param-home", "nvme",
                   "--nvme-path", str(swap))
    assert result["gathers"] > 4 * result["groups"], "groups evicted in forward must be gathered for backward"
    moved = max((expected[k] - start[k]).abs().max().item() for k in expected)
    assert moved > 1e-3, f"training moved the weights by only {moved}"
    for name, value in expected.items():
        torch.testing.assert_close(result["weights"][name], value, rtol=1e-4, atol=1e-4)
    assert not list(swap.iterdir()), "the ranks' swap files outlived them"
