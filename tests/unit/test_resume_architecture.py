"""Resuming with a changed model (issue 29, point 3): refused before loading, naming each key and the ways out."""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import train_on_seeded_tokens as train_steps

import angelptm
from angelptm.errors import CheckpointError
from angelptm.pretraining.data import TokenWriter
from angelptm.pretraining.models import ModelConfig, build_model

ROOT = Path(__file__).resolve().parents[2]
BASE = dict(vocab_size=64, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=4)


def engine_for(seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(**{**BASE, **changes}))
    engine, *_ = angelptm.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    return engine


@pytest.fixture()
def saved(tmp_path):
    engine = engine_for()
    train_steps(engine, 1)
    engine.save_checkpoint(tmp_path)
    return tmp_path, engine.consolidated_state_dict()


@pytest.mark.parametrize("changes, named", [
    ({"num_heads": 2}, ["num_heads: saved 4, now 2"]),  # same shapes: it used to load silently
    ({"hidden_size": 64}, ["hidden_size: saved 32, now 64"]),
    ({"num_layers": 2, "flavour": "llama"}, ["flavour: saved 'gpt2', now 'llama'", "num_layers: saved 1, now 2"]),
])
def test_a_changed_architecture_is_refused_before_anything_loads(saved, changes, named):
    root, _ = saved
    engine = engine_for(seed=1, **changes)
    before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        engine.load_checkpoint(root)
    message = str(refused.value)
    for key in named:
        assert key in message
    assert "--save-dir" in message and "load_module_only=True" in message and "\n" not in message
    after = engine.consolidated_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and engine.global_steps == 0


def test_load_module_only_takes_the_weights_into_a_model_with_other_heads(saved, caplog):
    root, weights = saved
    engine = engine_for(seed=1, num_heads=2)
    with caplog.at_level(logging.WARNING, logger="angelptm.engine.engine"):
        engine.load_checkpoint(root, load_module_only=True)
    assert "num_heads: saved 4, now 2" in caplog.text
    state = engine.consolidated_state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights)


def test_load_module_only_with_other_shapes_is_one_message_not_a_traceback(saved):
    root, _ = saved
    engine = engine_for(seed=1, hidden_size=64)
    with pytest.raises(CheckpointError, match=r"saved weights do not fit this model: .*size mismatch"):
        engine.load_checkpoint(root, load_module_only=True)


def test_training_only_settings_may_change_on_resume(saved):
    root, weights = saved
    engine = engine_for(seed=1, dropout=0.1, activation_checkpointing=True)
    path, _ = engine.load_checkpoint(root)
    assert path is not None and engine.global_steps == 1
    state = engine.consolidated_state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights)


def test_pretrain_refuses_to_resume_with_other_heads(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    prefix = tmp_path / "data"
    with TokenWriter(prefix, vocab_size=64, eot_id=0) as writer:
        writer.add_document(np.random.default_rng(0).integers(1, 64, 4000))
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "model": {**BASE}, "data": {"path": str(prefix)},
              "train": {"steps": 1, "save_dir": str(tmp_path / f"run{random.randrange(1 << 30)}"), "log_interval": 1}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    assert job.main(["--config", str(path)]) == 0
    config["model"]["num_heads"] = 2
    path.write_text(json.dumps(config))
    assert job.main(["--config", str(path), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "num_heads: saved 4, now 2" in err and "--save-dir" in err
    assert (Path(config["train"]["save_dir"]) / "latest").read_text() == "global_step1"


def test_an_autopipe_resume_with_other_heads_is_refused_before_profiling(tmp_path):
    from angelptm.checkpoints import architecture
    from angelptm.checkpoints import files as checkpoint
    from angelptm.config import load_config
    from angelptm.launch.distributed import DistContext
    from angelptm.pretraining import pipeline_parallel as pipeline
    from autopipe.runtime import PipelineLayout

    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), group=None)
    saved = load_config({"train_batch_size": 2, "model": dict(BASE), "train": {"save_dir": str(tmp_path)}},
                        device_type="cpu")
    meta = {"format": "autopipe", "world_size": 1, "op_starts": [0], "step": 1,
            "architecture": architecture.gpt_record(saved.model)}
    checkpoint.save(tmp_path, "global_step1", ctx, shared={checkpoint.MODEL_FILE: meta}, per_rank={})
    layout = PipelineLayout(world_size=1, num_stages=1)
    assert pipeline.saved_split(saved, ctx, layout) == [0]
    changed = load_config({"train_batch_size": 2, "model": {**BASE, "num_heads": 2},
                           "train": {"save_dir": str(tmp_path)}}, device_type="cpu")
    with pytest.raises(CheckpointError, match=r"num_heads: saved 4, now 2; num_kv_heads: saved 4, now 2\. "
                                              r".*--save-dir"):
        pipeline.saved_split(changed, ctx, layout)
