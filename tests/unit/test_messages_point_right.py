"""Messages that used to point the wrong way (issue 29, point 5): an NVMe tier on a too-small disk, an nvme_path
that is a file, a hostile pickle naming ``posix.system``, a raw pickle behind a matching manifest."""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path

import pytest
import torch

import angelptm
import zero_cache
from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import manifest as checkpoint_manifest
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.config import ZeroCacheConfig
from zero_cache.storage import nvme

SHAPES = [(f"w{i}", (512, 512)) for i in range(32)]  # 8 M elements: 128 MiB of fp32 model states


def small_disk(monkeypatch, free_bytes: int) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda path: usage(free_bytes, 0, free_bytes))


def test_an_nvme_tier_on_a_20_mb_disk_says_the_disk_is_too_small_and_by_how_much(tmp_path, monkeypatch):
    small_disk(monkeypatch, 20 << 20)
    config = ZeroCacheConfig(enabled=True, device_memory_budget="64MiB", host_memory_budget="8MiB",
                             nvme_path=str(tmp_path))
    with pytest.raises(zero_cache.PlanError) as refused:
        zero_cache.dry_run(SHAPES, config, compute_dtype=torch.float32, device=torch.device("cuda"))
    message = str(refused.value)
    short = message.split("(short by ", 1)[1].split(")", 1)[0]
    assert "add an NVMe tier" not in message
    assert (f"give the NVMe tier room: it is set, but its disk is too small by at least {short} (the tier's budget "
            f"is 0 B, and an \"auto\" budget leaves at least 1 GiB of the disk free): free disk space under "
            f"zero_cache.nvme_path") in message
    without = ZeroCacheConfig(enabled=True, device_memory_budget="64MiB", host_memory_budget="8MiB")
    with pytest.raises(zero_cache.PlanError, match=r"add an NVMe tier \(zero_cache.nvme_path\)"):
        zero_cache.dry_run(SHAPES, without, compute_dtype=torch.float32, device=torch.device("cuda"))


def test_an_nvme_path_that_is_a_file_is_named_as_a_file(tmp_path):
    file = tmp_path / "swap"
    file.write_text("")
    with pytest.raises(zero_cache.NvmeSetupError) as refused:
        zero_cache.dry_run(SHAPES, ZeroCacheConfig(enabled=True, nvme_path=str(file)), compute_dtype=torch.float32,
                           device=torch.device("cpu"))
    assert "is a file, not a directory" in str(refused.value) and "mkdir" not in str(refused.value)


class RunsACommand:
    """Unpickling this would run ``touch marker`` through ``os.system`` (pickled as ``posix.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def engine():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, max_seq_len=16, num_layers=1, hidden_size=32, num_heads=4))
    return angelptm.initialize(model=model, config={"train_batch_size": 2,
                                                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})[0]


def replace_with_matching_manifest(directory: Path, write) -> None:
    """Write ``model_states.pt`` with ``write(path)`` and re-sign the manifest, as an attacker would."""
    write(directory / checkpoint.MODEL_FILE)
    records = [checkpoint_manifest.FileRecord(p.name, p.stat().st_size, checkpoint_manifest.file_crc32(p))
               for p in directory.glob("*.pt")]
    checkpoint_manifest.write_manifest(directory, records)


@pytest.mark.parametrize("opt_in", [False, True])
def test_a_pickle_naming_posix_system_is_never_offered_the_opt_in(tmp_path, tmp_path_factory, opt_in):
    marker = tmp_path_factory.mktemp("outside") / "pwned"
    source = engine()
    source.save_checkpoint(tmp_path)
    replace_with_matching_manifest(tmp_path / "global_step0",
                                   lambda path: torch.save({"module": {}, "x": RunsACommand(marker)}, path))
    with pytest.raises(angelptm.CheckpointError) as refused:
        engine().load_checkpoint(tmp_path, allow_unsafe_pickle=opt_in)
    message = str(refused.value)
    assert f"names {os.system.__module__}.system" in message and "which no checkpoint of this engine holds" in message
    assert "allow_unsafe_pickle=True" not in message and "will not load it either" in message
    assert not marker.exists()


def test_a_raw_pickle_with_a_matching_manifest_gets_our_message_not_torchs(tmp_path, tmp_path_factory):
    marker = tmp_path_factory.mktemp("outside") / "pwned"
    engine().save_checkpoint(tmp_path)

    def raw_pickle(path: Path) -> None:
        with open(path, "wb") as handle:
            pickle.dump({"module": {}, "x": RunsACommand(marker)}, handle)

    replace_with_matching_manifest(tmp_path / "global_step0", raw_pickle)
    for opt_in in (False, True):
        with pytest.raises(angelptm.CheckpointError) as refused:
            engine().load_checkpoint(tmp_path, allow_unsafe_pickle=opt_in)
        message = str(refused.value)
        assert "is not a torch.save archive" in message and "mmap" not in message
        assert f"raw pickle naming {os.system.__module__}.system" in message and "hostile" in message
    assert not marker.exists()
