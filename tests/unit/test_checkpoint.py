"""Checkpoints: exact resume in a new process, atomicity under simulated crashes, fp32 export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import train_on_seeded_tokens as train_steps
from safetensors.torch import load_file

import angelptm
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints.export import main as export_main
from angelptm.pretraining.data import TokenWriter
from angelptm.pretraining.models import ModelConfig, build_model

JOB = Path(__file__).resolve().parents[1] / "helpers" / "resume_job.py"


@pytest.fixture()
def token_data(tmp_path: Path) -> str:
    """A small random token dataset (fresh each run) with a few hundred windows of 16 tokens."""
    rng = np.random.default_rng()
    prefix = tmp_path / "tokens"
    with TokenWriter(prefix, vocab_size=64, eot_id=0) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(1, 64, size=rng.integers(50, 200)).tolist())
    return str(prefix)


def run_job(*args: str) -> dict:
    out = Path(args[args.index("--out") + 1])
    subprocess.run([sys.executable, str(JOB), *args], check=True, capture_output=True, timeout=300)
    return torch.load(out, weights_only=False)


def assert_states_equal(a: dict, b: dict) -> None:
    for name in a["masters"]:
        assert torch.equal(a["masters"][name], b["masters"][name]), f"master {name} differs"
    for key in a["module"]:
        assert torch.equal(a["module"][key], b["module"][key]), f"module {key} differs"
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][index][key]), f"optimizer state {index}.{key} differs"
    for key in ("lr", "loss_scale", "global_steps", "data"):
        assert a[key] == b[key], key
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_in_new_process_is_bit_exact(tmp_path, token_data, precision):
    common = ["--data", token_data, "--precision", precision, "--total-steps", "8"]
    straight = run_job(*common, "--steps", "8", "--save-dir", str(tmp_path / "a"), "--out", str(tmp_path / "a.pt"))
    first_half = run_job(*common, "--steps", "4", "--save-dir", str(tmp_path / "b"), "--out", str(tmp_path / "b1.pt"))
    resumed = run_job(*common, "--steps", "4", "--save-dir", str(tmp_path / "b"), "--load",
                      "--out", str(tmp_path / "b2.pt"))
    assert first_half["losses"] == straight["losses"][:8]
    moved = [n for n in straight["masters"] if not torch.equal(straight["masters"][n], first_half["masters"][n])]
    assert len(moved) == len(straight["masters"]), "steps 5-8 must change every weight, or the test proves nothing"
    assert resumed["losses"] == straight["losses"][8:], "the resumed run saw other data or other dropout masks"
    assert_states_equal(straight, resumed)


def small_engine(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(vocab_size=64, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=4))
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True}}
    engine, *_ = angelptm.initialize(model=model, config=config)
    return engine


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = small_engine()
    train_steps(engine, 2)
    engine.save_checkpoint(tmp_path, tag="good")
    good = engine.consolidated_state_dict()
    train_steps(engine, 2)
    real_write = checkpoint.write_file_durably

    def crash_on_optimizer(obj, path):
        if path.name == checkpoint.OPTIM_FILE:
            raise OSError(28, "No space left on device")
        real_write(obj, path)

    monkeypatch.setattr(checkpoint, "write_file_durably", crash_on_optimizer)
    with pytest.raises(OSError, match="No space"):
        engine.save_checkpoint(tmp_path, tag="bad")
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    fresh = small_engine(seed=1)
    path, _ = fresh.load_checkpoint(tmp_path)
    assert Path(path).name == "good" and fresh.global_steps == 2
    for key, value in good.items():
        assert torch.equal(fresh.consolidated_state_dict()[key], value)
    engine.save_checkpoint(tmp_path, tag="next")  # the crashed save's leftovers are cleaned up
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_crash_while_replacing_a_tag_falls_back_to_the_old_copy(tmp_path, monkeypatch):
    engine = small_engine()
    train_steps(engine, 1)
    engine.save_checkpoint(tmp_path, tag="step")
    before = engine.consolidated_state_dict()
    train_steps(engine, 1)
    real_rename = checkpoint.os.rename
    calls = []

    def crash_on_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old tag moved aside, new one not yet in place
            raise OSError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", crash_on_second_rename)
    with pytest.raises(OSError, match="power cut"):
        engine.save_checkpoint(tmp_path, tag="step")
    monkeypatch.undo()
    fresh = small_engine(seed=3)
    path, _ = fresh.load_checkpoint(tmp_path)
    assert Path(path).name == ".old-step"
    for key, value in before.items():
        assert torch.equal(fresh.consolidated_state_dict()[key], value)


def test_missing_checkpoint_and_bad_tag(tmp_path):
    engine = small_engine()
    assert engine.load_checkpoint(tmp_path / "nothing") == (None, None)
    with pytest.raises(angelptm.CheckpointError, match="tag"):
        engine.save_checkpoint(tmp_path, tag="../escape")
    (tmp_path / "broken").mkdir()
    with pytest.raises(angelptm.CheckpointError, match="not a complete checkpoint"):
        engine.load_checkpoint(tmp_path, tag="broken")


def test_fp32_export_loads_into_the_plain_model(tmp_path):
    engine = small_engine()
    train_steps(engine, 3)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_fp32_model(str(tmp_path / "live.safetensors"))
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "offline.safetensors")]) == 0
    live, offline = load_file(tmp_path / "live.safetensors"), load_file(tmp_path / "offline.safetensors")
    masters = engine.optimizer.master_state_dict()
    assert set(live) == set(offline) == set(engine.module.state_dict())
    for key in live:
        assert live[key].dtype == torch.float32
        assert torch.equal(live[key], offline[key])
    assert torch.equal(live["lm_head.weight"], masters["tok_emb.weight"])  # tied weight under both names
    plain = build_model(ModelConfig(vocab_size=64, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=4))
    plain.load_state_dict(offline, strict=True)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        expected = engine.module.float()(ids)
    torch.testing.assert_close(plain(ids), expected, rtol=0.05, atol=0.05)
    assert export_main([str(tmp_path / "empty"), str(tmp_path / "x.safetensors")]) == 1


def test_export_into_a_missing_directory_is_an_error_message(tmp_path, capsys):
    engine = small_engine()
    train_steps(engine, 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    missing = tmp_path / f"no_such_dir_{torch.randint(1 << 30, ()).item()}" / "sub"
    capsys.readouterr()
    assert export_main([str(tmp_path / "ckpt"), str(missing / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "does not exist" in err
    assert not missing.exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert export_main([str(tmp_path / "ckpt"), str(a_file / "out.safetensors")]) == 1
    assert str(a_file) in capsys.readouterr().err


def test_module_only_load_takes_weights_not_counters(tmp_path):
    engine = small_engine()
    train_steps(engine, 2)
    engine.save_checkpoint(tmp_path)
    fresh = small_engine(seed=5)
    fresh.load_checkpoint(tmp_path, load_module_only=True)
    assert fresh.global_steps == 0
    assert not fresh.optimizer.state
    for key, value in engine.consolidated_state_dict().items():
        assert torch.equal(fresh.consolidated_state_dict()[key], value)
