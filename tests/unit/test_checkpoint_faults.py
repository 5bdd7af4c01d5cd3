"""Checkpoint faults: a kill mid-save, damaged files, a hostile pickle, a full disk, previous-format files."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import train_on_seeded_tokens as train_steps

import angelptm
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import manifest as checkpoint_manifest
from angelptm.pretraining.models import ModelConfig, build_model

KILL_JOB = Path(__file__).resolve().parents[1] / "helpers" / "kill_during_save_job.py"


def fp32_engine(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(vocab_size=64, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=4))
    engine, *_ = angelptm.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    return engine


def assert_same_weights(engine, expected: dict[str, torch.Tensor]) -> None:
    state = engine.consolidated_state_dict()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


@pytest.fixture()
def two_checkpoints(tmp_path):
    """``global_step1`` and ``global_step2`` (latest), with the weights each holds."""
    engine = fp32_engine()
    weights = {}
    for step in (1, 2):
        train_steps(engine, 1)
        engine.save_checkpoint(tmp_path)
        weights[step] = engine.consolidated_state_dict()
    assert any(not torch.equal(weights[1][k], weights[2][k]) for k in weights[1]), "a fallback must be visible"
    return tmp_path, weights


def test_the_manifest_lists_every_file_with_its_size_and_checksum(two_checkpoints):
    root, _ = two_checkpoints
    saved = json.loads((root / "global_step2" / checkpoint_manifest.MANIFEST_FILE).read_text())
    names = {checkpoint.MODEL_FILE, checkpoint.OPTIM_FILE, checkpoint.rank_file(0)}
    assert set(saved["files"]) == names and saved["algorithm"] == "crc32"
    for name in names:
        path = root / "global_step2" / name
        assert saved["files"][name]["size_bytes"] == path.stat().st_size
        assert saved["files"][name]["crc32"] == f"{checkpoint_manifest.file_crc32(path):08x}"


def test_large_writes_hashed_in_parallel_pieces_match_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_manifest, "_PIECE_BYTES", 1 << 20)
    monkeypatch.setattr(checkpoint_manifest, "_HASH_THREADS", 3)
    state = {"big": torch.randn(3 << 20), "odd": torch.randn(777_777), "small": torch.arange(5)}
    record = checkpoint_manifest.write_hashed(state, tmp_path / "states.pt")
    assert record.size_bytes == (tmp_path / "states.pt").stat().st_size > 12 << 20
    assert record.crc32 == checkpoint_manifest.file_crc32(tmp_path / "states.pt")
    loaded = torch.load(tmp_path / "states.pt", weights_only=True)  # written without the zip's record CRCs
    assert all(torch.equal(loaded[key], state[key]) for key in state)
    assert torch.serialization.get_crc32_options()  # torch's own saves compute them again
    first, second = os.urandom(1000), os.urandom(3333)
    assert checkpoint_manifest.crc32_combine(zlib.crc32(first), zlib.crc32(second), 3333) == zlib.crc32(first + second)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_one_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip_one_bit])
@pytest.mark.parametrize("victim", [checkpoint.OPTIM_FILE, checkpoint.rank_file(0)])
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(two_checkpoints, caplog, damage, victim):
    root, weights = two_checkpoints
    damage(root / "global_step2" / victim)
    fresh = fp32_engine(seed=5)
    with caplog.at_level(logging.WARNING):
        path, _ = fresh.load_checkpoint(root)
    assert Path(path).name == "global_step1" and fresh.global_steps == 1
    assert_same_weights(fresh, weights[1])
    assert f"global_step2/{victim}" in caplog.text and "does not verify" in caplog.text
    with pytest.raises(angelptm.CheckpointError, match=f"global_step2/{victim}"):
        fresh.load_checkpoint(root, tag="global_step2")  # an explicit tag must verify


def test_when_nothing_verifies_the_error_names_every_damaged_file(two_checkpoints):
    root, _ = two_checkpoints
    flip_one_bit(root / "global_step2" / checkpoint.MODEL_FILE)
    (root / "global_step1" / checkpoint.OPTIM_FILE).unlink()
    with pytest.raises(angelptm.CheckpointError, match=r"no checkpoint .* verifies") as caught:
        fp32_engine().load_checkpoint(root)
    assert "global_step2/model_states.pt fails its checksum" in str(caught.value)
    assert "global_step1/optim_states.pt is missing" in str(caught.value)


def test_a_checkpoint_newer_than_latest_is_not_a_fallback(two_checkpoints):
    root, weights = two_checkpoints
    engine = fp32_engine()
    engine.load_checkpoint(root)
    train_steps(engine, 1)
    engine.save_checkpoint(root, tag="side", save_latest=False)
    truncate(root / "global_step2" / checkpoint.MODEL_FILE)
    fresh = fp32_engine(seed=2)
    path, _ = fresh.load_checkpoint(root)
    assert Path(path).name == "global_step1"


class Hostile:
    """Unpickling this would create ``marker`` (the stand-in for any code an attacker wants run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_hostile_pickle_is_refused_without_running_it(two_checkpoints, tmp_path_factory):
    root, _ = two_checkpoints
    marker = tmp_path_factory.mktemp("outside") / "pwned"
    directory = root / "global_step2"
    torch.save({"module": {}, "payload": Hostile(marker)}, directory / checkpoint.MODEL_FILE)
    records = [checkpoint_manifest.FileRecord(p.name, p.stat().st_size, checkpoint_manifest.file_crc32(p))
               for p in directory.glob("*.pt")]
    checkpoint_manifest.write_manifest(directory, records)  # the attacker rewrites the manifest too
    fresh = fp32_engine()
    for opt_in in (False, True):  # its getattr reaches any callable: refused, and the opt-in is neither offered
        with pytest.raises(angelptm.CheckpointError,  # nor honoured
                           match=r"model_states.pt names builtins.getattr.*which no checkpoint of this engine holds.*"
                                 r"will not load it either") as refused:
            fresh.load_checkpoint(root, allow_unsafe_pickle=opt_in)
        assert "allow_unsafe_pickle=True" not in str(refused.value)
    assert not marker.exists()


def test_a_previous_format_checkpoint_loads_only_with_the_opt_in(two_checkpoints, caplog):
    root, weights = two_checkpoints
    directory = root / "global_step2"
    rank_path = directory / checkpoint.rank_file(0)
    per_rank = torch.load(rank_path, weights_only=True)
    kind, keys, *rest = per_rank["rng"]["numpy"]
    per_rank["rng"]["numpy"] = (kind, keys.numpy().astype(np.uint32), *rest)  # format 1: a pickled numpy array
    torch.save(per_rank, rank_path)
    model_states = torch.load(directory / checkpoint.MODEL_FILE, weights_only=True)
    torch.save({**model_states, "format_version": 1}, directory / checkpoint.MODEL_FILE)  # format 1 had no manifest
    (directory / checkpoint_manifest.MANIFEST_FILE).unlink()
    with pytest.raises(angelptm.CheckpointError, match=r"rank_00000_states.pt holds numpy arrays.*"
                                                       r"allow_unsafe_pickle=True"):
        fp32_engine().load_checkpoint(root)
    fresh = fp32_engine(seed=3)
    with caplog.at_level(logging.WARNING):
        path, _ = fresh.load_checkpoint(root, allow_unsafe_pickle=True)
    assert Path(path).name == "global_step2"
    assert_same_weights(fresh, weights[2])
    assert np.random.get_state()[1].tolist() == keys.tolist()


def test_a_checkpoint_that_lost_its_manifest_is_damaged_and_resume_falls_back(two_checkpoints, caplog):
    """Every format-2 checkpoint is written with its manifest: without it (a partial copy) files may be missing."""
    root, weights = two_checkpoints
    for name in (checkpoint_manifest.MANIFEST_FILE, checkpoint.OPTIM_FILE):
        (root / "global_step2" / name).unlink()
    engine = fp32_engine(seed=3)
    with caplog.at_level(logging.WARNING):
        path, _ = engine.load_checkpoint(root)
    assert Path(path).name == "global_step1" and "manifest.json is missing" in caplog.text
    assert_same_weights(engine, weights[1])
    with pytest.raises(angelptm.CheckpointError, match="manifest.json is missing"):
        fp32_engine().load_checkpoint(root, tag="global_step2")


def test_client_state_that_needs_unsafe_unpickling_is_refused_at_save(two_checkpoints):
    root, _ = two_checkpoints
    engine = fp32_engine()
    with pytest.raises(angelptm.CheckpointError,
                       match=r"model_states.pt would hold .*argparse.Namespace.*vars\(args\)"):
        engine.save_checkpoint(root, tag="odd", client_state={"args": __import__("argparse").Namespace(lr=1)})
    assert (root / "latest").read_text() == "global_step2" and not (root / "odd").exists()
    engine.save_checkpoint(root, tag="plain", client_state={"args": {"lr": 1}, "note": [1, 2.0, "x", None]})
    assert fp32_engine().load_checkpoint(root)[1] == {"args": {"lr": 1}, "note": [1, 2.0, "x", None]}


def test_a_disk_filling_up_mid_file_keeps_the_previous_checkpoint(two_checkpoints, monkeypatch):
    root, weights = two_checkpoints
    engine = fp32_engine()
    engine.load_checkpoint(root)
    train_steps(engine, 1)
    real_write = checkpoint_manifest._HashingFile._write  # below it: the file's own write, as the OS fails it

    def full_after_a_page(self, data):
        if self.size_bytes > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(checkpoint_manifest._HashingFile, "_write", full_after_a_page)
    with pytest.raises(OSError, match="No space left") as caught:
        engine.save_checkpoint(root)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename.endswith(checkpoint.MODEL_FILE)
    monkeypatch.undo()
    assert (root / "latest").read_text() == "global_step2" and not (root / "global_step3").exists()
    fresh = fp32_engine(seed=4)
    path, _ = fresh.load_checkpoint(root)
    assert Path(path).name == "global_step2"
    assert_same_weights(fresh, weights[2])


def test_sigkill_during_save_then_resume_is_intact_and_exact(tmp_path):
    result = subprocess.run([sys.executable, str(KILL_JOB), "--save-dir", str(tmp_path / "ckpt"),
                             "--out", str(tmp_path / "first.pt")], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert [p.is_dir() for p in (tmp_path / "ckpt").glob(".tmp-*-global_step4")] == [True], \
        "the kill must land inside the second save"
    expected = torch.load(tmp_path / "first.pt", weights_only=True)
    fresh = fp32_engine(seed=9)
    path, _ = fresh.load_checkpoint(tmp_path / "ckpt")
    assert Path(path).name == "global_step2" and fresh.global_steps == expected["global_steps"] == 2
    assert_same_weights(fresh, expected["module"])
    for index, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(fresh.optimizer.optimizer.state_dict()["state"][index][key], value), (index, key)
    train_steps(fresh, 1)
    fresh.save_checkpoint(tmp_path / "ckpt")  # resumes and saves; the killed save's leftovers go
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".writer.lock", "global_step2", "global_step3",
                                                                      "latest"]
