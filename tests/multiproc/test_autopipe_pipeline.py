"""AutoPipe over gloo: 2- and 4-stage pipelines give the unpartitioned model's loss and gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from launch import run_ok, torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from autopipe_job import MICRO_BATCH, batch, model_config  # noqa: E402

from angelptm.pretraining.models import build_model  # noqa: E402

JOB = Path(__file__).resolve().parents[1] / "helpers" / "autopipe_job.py"
pytestmark = pytest.mark.dist


def run_job(tmp_path: Path, world: int, *args: str) -> list[dict]:
    run_ok(torchrun(world, JOB, *args, "--out", str(tmp_path / "rank")))
    return [torch.load(tmp_path / f"rank.{rank}") for rank in range(world)]


def reference(data_seed: int, rows: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(model_config())
    ids, labels = batch(data_seed, rows)
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("world, stages, virtual, schedule, micro", [
    (2, 2, 1, "1f1b", 2),
    (4, 4, 1, "gpipe", 4),
    (4, 2, 2, "interleaved", 2),  # 2 stages x 2 data-parallel replicas, 2 chunks per rank
])
def test_pipeline_matches_unpartitioned_model(tmp_path, world, stages, virtual, schedule, micro):
    data_seed = int(torch.randint(0, 2**31, ()).item())
    results = run_job(tmp_path, world, "--stages", str(stages), "--chunks-per-rank", str(virtual),
                      "--schedule", schedule, "--microbatches", str(micro), "--data-seed", str(data_seed))
    expected_loss, expected_grads = reference(data_seed, (world // stages) * micro * MICRO_BATCH)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == world // stages  # the last stage of each replica
    for loss in losses:
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    seen = set()
    for r in results:
        assert len(r["chunks"]) == virtual
        for name, grad in r["grads"].items():
            assert grad is not None, name
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6)
            seen.add(name)
    # every parameter lives on some stage; the tied table is held by the first and the last stage
    assert seen == set(expected_grads) - {"tok_emb.weight"} | ({"tok_emb.weight"} & seen)
    assert all(r["tied"] == ["lm_head.weight"] for r in results if "lm_head.weight" in r["grads"])
    assert len(set(results[0]["op_starts"])) == stages * virtual
