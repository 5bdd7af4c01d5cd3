"""ZeRO-Cache sharded over gloo ranks: equal to one process with the same global batch, reshardable checkpoints."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from launch import run, run_ok, torchrun
from safetensors.torch import load_file

JOB = Path(__file__).resolve().parents[1] / "helpers" / "zero_cache_dp_job.py"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.dist


def job(nproc: int, *args: str) -> list[str]:
    return torchrun(nproc, JOB, *args) if nproc > 1 else [sys.executable, str(JOB), *args]


def train(nproc: int, out: Path, data_seed: int, steps: int, *extra: str) -> dict:
    run_ok(job(nproc, "--global-batch", "4", "--data-seed", str(data_seed), "--steps", str(steps),
               "--out", str(out), *extra))
    return torch.load(out)


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        start: dict[str, torch.Tensor], atol: float = 1e-4) -> None:
    """Equal up to summation order, and training moved them far more than that (or equality proves little).

    W ranks sum a gradient in another order than one process; Adam divides by sqrt(exp_avg_sq), so an
    element whose gradient is near zero shows that order at up to ~4e-5 now and then (about one run in
    ten at 1e-5 tolerance): still 30x below one step's movement (lr 3e-3). A wrong shard or a stale
    gather moves weights by a step's size.
    """
    assert got.keys() == expected.keys()
    moved = max((expected[k] - start[k]).abs().max().item() for k in expected)
    assert moved > 1e-3, f"training moved the weights by only {moved}"
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=atol)


def assert_resumes_and_exports(tmp_path: Path, data_seed: int, save_dir: Path, halfway: dict,
                               unsharded: tuple[dict, dict], resumes: tuple[tuple[int, tuple[str, ...]], ...]) -> None:
    """A checkpoint saved after 2 of 4 steps: each (ranks, flags) in ``resumes`` continues it to the one-process
    weights, and the offline export gathers every shard's masters into exactly the weights the saving run held."""
    expected, start = unsharded
    for nproc, extra in resumes:
        resumed = train(nproc, tmp_path / f"resumed{nproc}{''.join(extra)}.pt", data_seed, 2, "--load", str(save_dir),
                        *extra)
        assert resumed["global_steps"] == 4
        assert_same_weights(resumed["weights"], expected, start)
    exported = tmp_path / "model.safetensors"
    run_ok([sys.executable, "-m", "angelptm.checkpoints.export", str(save_dir), str(exported)], cwd=ROOT)
    weights = load_file(exported)
    assert weights.keys() == halfway["weights"].keys()
    for name, tensor in halfway["weights"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)


@pytest.fixture(scope="module")
def data_seed() -> int:
    return torch.randint(0, 2**31, ()).item()


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, data_seed) -> tuple[dict, dict]:
    """One process, 4 steps of global batch 4, and the weights after 0 steps."""
    root = tmp_path_factory.mktemp("unsharded")
    return (train(1, root / "four.pt", data_seed, 4)["weights"], train(1, root / "zero.pt", data_seed, 0)["weights"])


@pytest.mark.parametrize("nproc, extra", [(2, ()), (4, ()), (2, ("--no-overlap",)), (2, ("--destroy",))],
                         ids=["2", "4", "2-no-overlap", "2-destroy"])
def test_sharded_training_equals_one_process_with_the_same_global_batch(tmp_path, data_seed, unsharded, nproc, extra):
    """Groups are reduced from backward (--no-overlap: all at step()); gathers run 2 chunks ahead. --destroy: the
    weights are the module's after engine.destroy(), where the chunks other ranks own held this rank's gradients
    since the last step until destroy() gathered them."""
    expected, start = unsharded
    result = train(nproc, tmp_path / "sharded.pt", data_seed, 4, *extra)
    assert result["world_size"] == nproc and result["global_steps"] == 4
    assert_same_weights(result["weights"], expected, start)


SHARD = "--shard-params"


HOST_HOME = ("--param-home", "host")


@pytest.mark.parametrize("nproc, extra", [(2, ["--checkpointing"]), (2, ["--no-overlap"]), (4, ["--hosts-of", "2"]),
                                          (2, ["--checkpointing", *HOST_HOME]),
                                          (2, ["--checkpointing", *HOST_HOME, "--device-steps", "1000"]),
                                          (2, ["--checkpointing", *HOST_HOME, "--least-working-set"]),
                                          (2, ["--checkpointing", "--warmup-least-footprint"])],
                         ids=["2-recompute", "2-no-overlap", "4-hierarchical", "2-streamed-recompute",
                              "2-streamed-device-steps", "2-streamed-least-working-set", "2-warmup-least-footprint"])
def test_sharded_params_train_like_one_process(tmp_path, data_seed, unsharded, nproc, extra):
    """ZeRO-3: each rank stores one chunk of each group; at 2 ranks only 3 of the 5 groups may be live, so
    forward, the recompute of checkpointed blocks and backward gather evicted groups again. Streamed: each
    rank's shards live in pinned host memory, copied in before every gather and updated there (or, with device
    steps, their optimizer groups stepped through the device's scratch after backward; or, on a device of the
    least working set, through two gradient buckets, each reduction waited for at once; or with the warm-up step
    at the plan's least device footprint, the ranks agreeing on its reserve, then re-planned)."""
    expected, start = unsharded
    result = train(nproc, tmp_path / "sharded.pt", data_seed, 4, SHARD, *extra)
    assert_same_weights(result["weights"], expected, start)
    assert result["gathers"] >= 4 * result["groups"]
    if nproc == 2:
        assert result["gathers"] > 4 * result["groups"], "groups evicted in forward must be gathered for backward"


def test_sharded_params_untied_updated_during_backward_equal_one_process(tmp_path, data_seed):
    """Separate output weights (their group's gradients arrive first), host chunks updated as soon as each
    group's reduce-scatter lands in the owner's shard, checkpointed blocks recomputed."""
    common = ("--untied", "--clip", "0")
    start = train(1, tmp_path / "start.pt", data_seed, 0, *common)["weights"]
    expected = train(1, tmp_path / "one.pt", data_seed, 3, *common)["weights"]
    result = train(2, tmp_path / "two.pt", data_seed, 3, *common, SHARD, "--checkpointing")
    assert_same_weights(result["weights"], expected, start)


def test_hierarchical_collectives_over_two_hosts_of_two_equal_one_process(tmp_path, data_seed, unsharded):
    """Four ranks as 2 hosts x 2: reduce within the host, then across; gathers the other way round."""
    expected, start = unsharded
    result = train(4, tmp_path / "hier.pt", data_seed, 4, "--hosts-of", "2")
    assert_same_weights(result["weights"], expected, start)


def test_host_chunks_updated_during_backward_equal_one_process(tmp_path, data_seed, unsharded):
    """No clipping: each owned host chunk updates as soon as its group's reduce-scatter is done."""
    _, start = unsharded
    expected = train(1, tmp_path / "one.pt", data_seed, 3, "--clip", "0")["weights"]
    result = train(2, tmp_path / "two.pt", data_seed, 3, "--clip", "0")
    assert_same_weights(result["weights"], expected, start)


def test_checkpoint_saved_at_four_ranks_resumes_at_two_and_one_and_exports_offline(tmp_path, data_seed, unsharded):
    save_dir = tmp_path / "ckpt"
    halfway = train(4, tmp_path / "first.pt", data_seed, 2, "--save-dir", str(save_dir))
    files = sorted(p.name for p in (save_dir / "global_step2").iterdir())
    assert files == ["manifest.json", "model_states.pt", "optim_states.pt",
                     *[f"rank_{r:05d}_states.pt" for r in range(4)]]
    # The last: a replicated checkpoint into shards.
    assert_resumes_and_exports(tmp_path, data_seed, save_dir, halfway, unsharded, ((2, ()), (1, ()), (2, (SHARD,))))


def test_checkpoint_saved_with_sharded_params_resumes_sharded_and_replicated_and_exports(tmp_path, data_seed,
                                                                                         unsharded):
    """The weights of a sharded-params checkpoint are its fp32 masters (the module file holds no params)."""
    save_dir = tmp_path / "ckpt"
    halfway = train(4, tmp_path / "first.pt", data_seed, 2, "--save-dir", str(save_dir), SHARD)
    module = torch.load(save_dir / "global_step2" / "model_states.pt", weights_only=False)
    assert module["weights_in_masters"] and not set(module["param_aliases"]) & set(module["module"])
    assert_resumes_and_exports(tmp_path, data_seed, save_dir, halfway, unsharded,
                               ((2, (SHARD,)), (2, (SHARD, *HOST_HOME)), (1, HOST_HOME)))


def test_a_rank_that_dies_mid_training_stops_the_others_with_its_exit_code(tmp_path, data_seed):
    start = time.monotonic()
    result = run(job(2, "--global-batch", "4", "--data-seed", str(data_seed), "--steps", "4", "--die-at-step", "2",
                     "--out", str(tmp_path / "never.pt")), timeout=240)
    assert result.returncode != 0 and not (tmp_path / "never.pt").exists()
    assert "exitcode  : 3" in result.stderr, result.stderr[-3000:]
    assert time.monotonic() - start < 200


@pytest.fixture(scope="module")
def accumulated_one_process(tmp_path_factory, data_seed) -> dict:
    # After backward, as ranks that accumulate update: one process would update during the last backward and
    # revise at clipped steps, equal within an ulp (zero_cache.optim.revision), which Adam amplifies past this
    # tolerance.
    return train(1, tmp_path_factory.mktemp("accumulated") / "one.pt", data_seed, 3, "--accumulation", "2",
                 "--after-backward")["weights"]


@pytest.mark.parametrize("extra", [(), (SHARD,), (SHARD, *HOST_HOME), (SHARD, *HOST_HOME, "--device-steps", "1000"),
                                   (SHARD, *HOST_HOME, "--least-working-set")],
                         ids=["replicated-params", "sharded-params", "streamed-params", "streamed-device-steps",
                              "streamed-least-working-set"])
def test_accumulating_micro_batches_equal_one_process(tmp_path, data_seed, unsharded, accumulated_one_process, extra):
    """Two micro-batches per step: each group's gradients go through a bucket, the owner accumulates in fp32
    (with sharded params the groups gathered in the first micro-step may stay live for the second)."""
    _, start = unsharded
    expected = accumulated_one_process
    result = train(2, tmp_path / "two.pt", data_seed, 3, "--accumulation", "2", *extra)
    assert_same_weights(result["weights"], expected, start)
