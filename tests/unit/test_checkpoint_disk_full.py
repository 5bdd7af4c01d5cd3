"""A full disk during a save (issue 29, point 4): the partial is removed, the last checkpoint kept, one line says
how much room a save needs and the fix."""

from __future__ import annotations

import errno
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import train_on_seeded_tokens as train_steps
from test_checkpoint_faults import fp32_engine

from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import manifest as checkpoint_manifest
from angelptm.errors import CheckpointError, DiskFullError
from angelptm.pretraining.data import TokenWriter

ROOT = Path(__file__).resolve().parents[2]


def fill_disk_after(monkeypatch, bytes_allowed: int, files_allowed: int = 0) -> None:
    """Fail each checkpoint file's own write with ENOSPC once it passes ``bytes_allowed``, after ``files_allowed``
    files were written whole (the OS's error, below the hashing)."""
    real_write = checkpoint_manifest._HashingFile._write
    written = {"files": 0, "last": None}

    def write(self, data):
        if written["last"] is not self:
            written["files"], written["last"] = written["files"] + 1, self
        if written["files"] > files_allowed and self.size_bytes > bytes_allowed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(checkpoint_manifest._HashingFile, "_write", write)


def test_a_full_disk_removes_the_partial_keeps_the_last_and_says_how_much_room(tmp_path, monkeypatch):
    engine = fp32_engine()
    train_steps(engine, 1)
    engine.save_checkpoint(tmp_path)
    weights = engine.consolidated_state_dict()
    last_bytes = sum(p.stat().st_size for p in (tmp_path / "global_step1").iterdir())
    train_steps(engine, 1)
    fill_disk_after(monkeypatch, bytes_allowed=4096)
    with pytest.raises(DiskFullError) as caught:
        engine.save_checkpoint(tmp_path)
    err = caught.value
    assert isinstance(err, OSError) and isinstance(err, CheckpointError) and err.errno == errno.ENOSPC
    assert err.filename.endswith(checkpoint.MODEL_FILE)
    message = str(err)
    assert "\n" not in message and checkpoint.MODEL_FILE in message
    from zero_cache.plan.units import format_bytes

    assert f"the last one, global_step1, takes {format_bytes(last_bytes)}" in message
    assert "is free there now" in message and "train.keep_last" in message and "global_step1 is kept" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [".writer.lock", "global_step1", "latest"]  # no .tmp-*
    monkeypatch.undo()  # room again: the next save works and the kept one still loads exactly
    fresh = fp32_engine(seed=3)
    path, _ = fresh.load_checkpoint(tmp_path)
    assert Path(path).name == "global_step1"
    state = fresh.consolidated_state_dict()
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    engine.save_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text() == "global_step2"


def test_without_an_earlier_checkpoint_the_message_gives_the_tensor_bytes(tmp_path, monkeypatch):
    engine = fp32_engine()
    fill_disk_after(monkeypatch, bytes_allowed=0)
    with pytest.raises(DiskFullError, match=r"this one holds [\d.]+ KiB of tensors.*no earlier checkpoint"):
        engine.save_checkpoint(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] in ([], [".writer.lock"])  # nothing but the writer lock


def test_pretrain_stops_with_one_line_and_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    import pretrain as job

    prefix = tmp_path / "data"
    with TokenWriter(prefix, vocab_size=64, eot_id=0) as writer:
        writer.add_document(np.random.default_rng(0).integers(1, 64, 4000))
    save_dir = tmp_path / f"run{random.randrange(1 << 30)}"
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "model": {"vocab_size": 64, "max_seq_len": 16, "num_layers": 1, "hidden_size": 32, "num_heads": 4},
              "data": {"path": str(prefix)},
              "train": {"steps": 2, "save_dir": str(save_dir), "save_interval": 1, "log_interval": 1}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    fill_disk_after(monkeypatch, bytes_allowed=4096, files_allowed=3)  # global_step1's three files fit
    assert job.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: no space left on the disk of ") and "Traceback" not in "\n".join(err)
    assert sorted(p.name for p in save_dir.iterdir()) == [".writer.lock", "global_step1", "latest"]
    assert (save_dir / "latest").read_text() == "global_step1"
