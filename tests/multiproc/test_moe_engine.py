"""GPT-MoE with experts spread over 2 gloo ranks, trained through the engine, equals one process with every expert."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from launch import run, run_ok, shipped_config, torchrun

from angelptm.checkpoints.export import consolidated_fp32_state_dict

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "moe_engine_job.py"
pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world", [2, 4])  # 4: two expert-parallel groups of 2, expert replicas reduce together
def test_expert_parallel_training_equals_one_process_and_resumes(tmp_path, world):
    run_ok(torchrun(world, JOB, "--ep-size", "2", "--out", str(tmp_path / "ep"), "--save-dir", str(tmp_path / "ckpt")))
    run_ok([sys.executable, str(JOB), "--ep-size", "1", "--out", str(tmp_path / "ref")])
    ranks = [torch.load(tmp_path / f"ep.{r}.pt") for r in range(world)]
    reference = torch.load(tmp_path / "ref.0.pt")
    # The engine's loss is this rank's micro-batch mean; the global batch's is their average.
    mean_losses = [sum(values) / world for values in zip(*(rank["losses"] for rank in ranks))]
    assert mean_losses == pytest.approx(reference["losses"], rel=1e-5)
    assert reference["losses"][-1] < reference["losses"][0], "the model must learn"
    # The clipped global norm counts each expert slice once, and every rank sees the same one.
    for rank in ranks[1:]:
        assert rank["norms"] == pytest.approx(ranks[0]["norms"], rel=1e-6)
    assert ranks[0]["norms"] == pytest.approx(reference["norms"], rel=1e-4)
    assert min(reference["norms"]) > 0.05, "clipping at 0.05 must be active"
    for name, full in reference["masters"].items():
        if ranks[0]["masters"][name].shape == full.shape:  # dense: replicated, equal on every rank
            for rank in ranks:
                torch.testing.assert_close(rank["masters"][name], full, rtol=1e-4, atol=1e-6)
        else:  # experts: rank r holds slice r % 2 of the expert dimension
            for first in range(0, world, 2):
                local = [ranks[first]["masters"][name], ranks[first + 1]["masters"][name]]
                torch.testing.assert_close(torch.cat(local), full, rtol=1e-4, atol=1e-6)
    for rank in ranks:  # saved after step 2 and resumed in a fresh engine: step 3 is the same
        assert rank["resumed_loss"] == pytest.approx(rank["losses"][-1], rel=1e-6)
        for name, value in rank["masters"].items():
            torch.testing.assert_close(rank["resumed_masters"][name], value, rtol=0, atol=0)
    assert not torch.equal(ranks[0]["masters"][expert_name(reference)], ranks[1]["masters"][expert_name(reference)])
    # The offline export gathers every expert: it loads into the one-process model.
    exported = consolidated_fp32_state_dict(tmp_path / "ckpt", tag="resume")
    for name, full in reference["masters"].items():
        saved = [rank["saved_masters"][name] for rank in ranks[:2]]
        expected = saved[0] if saved[0].shape == full.shape else torch.cat(saved)
        torch.testing.assert_close(exported[name], expected, rtol=0, atol=0)
    sys.path.insert(0, str(JOB.parent))
    from moe_engine_job import build

    build(ep_size=1, ep_rank=0).load_state_dict(exported)  # strict: every key, every shape


def expert_name(reference: dict) -> str:
    return next(name for name in reference["masters"] if name.endswith("experts.w_in_LDF"))


def test_pretrain_trains_and_resumes_gpt_moe_with_experts_on_two_ranks(tmp_path):
    config = shipped_config("tiny_moe.json")
    config["model"].update(num_layers=2, max_seq_len=64)
    config["moe"]["ep_size"] = 2
    config["train_micro_batch_size_per_gpu"] = 4
    config["train"].update(steps=6, log_interval=3, save_interval=6, save_dir=str(tmp_path / "ckpt"))
    config["data"]["cache_dir"] = str(ROOT / ".cache" / "angelptm")  # tokenize the shipped corpus once
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(config))
    first = run_ok(torchrun(2, ROOT / "pretrain.py", "--config", str(path)), cwd=tmp_path)
    assert re.findall(r"step (\d+)/6 \| loss", first) == ["3", "6"]
    assert (tmp_path / "ckpt" / "global_step6" / "rank_00001_states.pt").is_file()
    assert set(consolidated_fp32_state_dict(tmp_path / "ckpt")) >= {"blocks.1.mlp.experts.w_in_LDF"}
    config["train"]["steps"] = 9
    path.write_text(json.dumps(config))
    resumed = run_ok(torchrun(2, ROOT / "pretrain.py", "--config", str(path)), cwd=tmp_path)
    assert "global_step6" in resumed and re.findall(r"step (\d+)/9 \| loss", resumed) == ["9"]
    config["moe"]["ep_size"], config["train"]["steps"] = 1, 12  # resuming with the experts split otherwise
    path.write_text(json.dumps(config))
    other = run([sys.executable, str(ROOT / "pretrain.py"), "--config", str(path)], cwd=tmp_path)
    assert other.returncode == 2 and "saved with moe.ep_size=2 and this run has 1" in other.stderr
