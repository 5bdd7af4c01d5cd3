"""``zero.GatheredParameters`` over 2 gloo ranks, ZeRO-Cache's params and masters sharded, against plain torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gathered_params_job import BETAS, LR, WEIGHT_DECAY, edit, torch_step
from launch import run_ok, torchrun
from reference import random_batches, tiny_gpt

pytestmark = pytest.mark.dist


def test_two_ranks_with_sharded_params_keep_the_modifiers_edit(tmp_path):
    """ZeRO-3 over 2 gloo ranks: each rank owns half the masters and holds placeholders between uses; the
    modifier's edit (rank 1) must reach every rank's copies and masters, and rank 0's own edit must not."""
    seed = torch.randint(0, 10_000, ()).item()
    job = Path(__file__).resolve().parents[1] / "helpers" / "gathered_params_job.py"
    run_ok(torchrun(2, job, "--seed", str(seed), "--out-prefix", str(tmp_path / "out")), timeout=240)
    reference = tiny_gpt(seed, "llama")
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    train, probe = random_batches(seed, count=2, batch=4)
    torch_step(reference, torch_optimizer, train)  # the mean over both ranks' halves
    with torch.no_grad():
        edit({name: p.data for name, p in reference.named_parameters()}, seed)
        expected_loss = reference(**probe).item()
    expected = reference.state_dict()
    for rank in (0, 1):
        out = torch.load(tmp_path / f"out.{rank}")
        assert out["probe_loss"] == pytest.approx(expected_loss, rel=1e-5)
        for name, tensor in out["weights"].items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-5)
