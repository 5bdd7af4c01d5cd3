"""AutoPipe training steps over gloo match a single-process AdamW loop on the unpartitioned model.

2 pipeline stages x 2 data-parallel replicas run ``angelptm/pretraining/pipeline_parallel.py``'s ``train_step`` (the
step ``pretrain.py`` runs for ``autopipe.enabled``) on a GPT with tied embeddings, in fp32 with dropout 0 and a
clip that bites. What this pins down is ``reduce_and_clip``: the data-parallel mean, the tied table's
gradient summed over the first and last stage into the fp32 master-gradient buffers, a global norm that
counts the shared table once, and clipping by it. A wrong piece moves the masters away from
``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.AdamW`` on the whole model with the same global batch.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from launch import run_ok, torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from autopipe_train_job import config  # noqa: E402
from reference import RandomTokens  # noqa: E402

from angelptm.config import load_config  # noqa: E402
from angelptm.pretraining.models import build_model  # noqa: E402

JOB = Path(__file__).resolve().parents[1] / "helpers" / "autopipe_train_job.py"
WORLD, STAGES, STEPS = 4, 2, 3
pytestmark = pytest.mark.dist


def run_job(tmp_path: Path) -> list[dict]:
    run_ok(torchrun(WORLD, JOB, "--stages", str(STAGES), "--steps", str(STEPS), "--out", str(tmp_path / "rank")),
           CUDA_VISIBLE_DEVICES="")  # gloo on CPU, fp32 everywhere
    return [torch.load(tmp_path / f"rank.{rank}") for rank in range(WORLD)]


def reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The whole model, one process: global-batch mean loss, clip_grad_norm_, torch AdamW (decay on matrices)."""
    raw = config(STAGES, STEPS)
    cfg = load_config(raw, world_size=WORLD)
    torch.manual_seed(raw["seed"])  # the seed pipeline.build_runner builds every rank's copy from
    model = build_model(dataclasses.replace(cfg.model, activation_checkpointing=False))
    params = raw["optimizer"]["params"]
    optimizer = torch.optim.AdamW(model.param_groups(params["weight_decay"]), lr=params["lr"],
                                  betas=tuple(params["betas"]), eps=params["eps"])
    # Unshuffled, the replicas' strided shards of a step's samples together are the next train_batch_size ones.
    ids, batch = RandomTokens().ids, cfg.batch.train_batch_size
    losses, norms = [], []
    for step in range(STEPS):
        rows = ids[step * batch:(step + 1) * batch]
        loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), raw["gradient_clipping"]).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


def test_pipeline_training_steps_match_single_process_adamw(tmp_path):
    results = run_job(tmp_path)
    expected_losses, expected_norms, expected = reference()
    assert results[0]["train_batch_size"] == 2 * 2 * 4  # replicas x micro-batch x accumulation
    clip = results[0]["clip"]
    assert min(expected_norms) > clip  # every step clips
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
    for rank, result in enumerate(results):
        assert result["chunks"] == [rank % STAGES]
        assert min(result["norms"]) > clip, (rank, result["norms"])
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(expected_norms), rtol=1e-5, atol=1e-7)
        for name, master in result["masters"].items():
            assert master.dtype == torch.float32
            # Adam divides by sqrt(v): the few elements whose gradients are near zero turn the summation-order
            # noise of the pipelined/reduced fp32 gradients into ~5e-6 (updates are ~lr = 1e-2).
            torch.testing.assert_close(master, expected[name], rtol=1e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    # Every parameter is trained somewhere; the tied table on both stages (its gradient summed across them).
    held = {name for r in results for name in r["masters"]}
    assert held == set(expected) - {"tok_emb.weight"} | ({"tok_emb.weight"} & held)
    tied = [r for r in results if r["tied"]]
    assert sorted(r["chunks"][0] for r in tied) == [0, 0, 1, 1] and all(r["tied"] == ["lm_head.weight"] for r in tied)
    # The replicas of a stage hold the same masters (the data-parallel mean made their gradients equal).
    for rank in range(STAGES, WORLD):
        for name, master in results[rank]["masters"].items():
            torch.testing.assert_close(master, results[rank % STAGES]["masters"][name], rtol=0, atol=0)
