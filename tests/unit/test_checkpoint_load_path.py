"""How a ZeRO-Cache checkpoint is read back: the manifest's checksum in parallel blocks, the optimizer file front to
back with each byte read once (straight into the chunks), and the module's weights taken from the fp32 masters rather
than read a second time from the module's file."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from reference import random_batches, train_steps
from zero_cache_setup import resident_engine

from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints import lazy_states
from angelptm.checkpoints import manifest as checkpoint_manifest

STATE_BYTES_PER_ELEMENT = 12  # fp32 master, exp_avg, exp_avg_sq


@pytest.mark.parametrize("num_bytes", [0, 1, 4096, 3 * 4096, 3 * 4096 + 17])
def test_the_checksum_in_parallel_blocks_is_the_files_crc32(tmp_path, monkeypatch, num_bytes):
    monkeypatch.setattr(checkpoint_manifest, "_READ_BYTES", 4096)  # several blocks, the last one partial
    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(num_bytes))
    path = tmp_path / "file.bin"
    path.write_bytes(data.numpy().tobytes())
    assert checkpoint_manifest.file_crc32(path) == zlib.crc32(data.numpy().tobytes())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint after two steps, with the saver's module weights and optimizer state."""
    save_dir = tmp_path_factory.mktemp("load_path")
    engine, optimizer = resident_engine(0)
    train_steps(engine, random_batches(1, count=2, batch=4))
    engine.save_checkpoint(str(save_dir))
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return save_dir, weights, optimizer.state_dict()


@pytest.mark.parametrize("piece_bytes", [8 << 20, 1000])  # (1000: a tensor read in pieces by several threads)
def test_the_optimizer_file_is_read_front_to_back_each_state_once(saved, monkeypatch, piece_bytes):
    save_dir, _, expected = saved
    monkeypatch.setattr(lazy_states, "_PIECE_BYTES", piece_bytes)
    reads: list[tuple[str, int, int]] = []
    read_at = lazy_states._File.read_at

    def recorded(self, memory, offset, key):
        reads.append((self.path.name, offset, memory.nbytes))
        return read_at(self, memory, offset, key)

    monkeypatch.setattr(lazy_states._File, "read_at", recorded)
    engine, optimizer = resident_engine(5)
    engine.load_checkpoint(str(save_dir))
    numel = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    assert {name for name, _, _ in reads} == {checkpoint.OPTIM_FILE}
    offsets = [offset for _, offset, _ in reads]
    assert offsets == sorted(offsets), "the records are read in the file's order"
    assert all(a + n <= b for (_, a, n), (_, b, _) in zip(reads, reads[1:])), "no byte is read twice"
    assert sum(n for _, _, n in reads) == STATE_BYTES_PER_ELEMENT * numel  # (the masters were read twice before)
    loaded = optimizer.state_dict()
    for table in ("exp_avg", "exp_avg_sq"):
        for name, value in expected["optimizer"][table].items():
            assert torch.equal(loaded["optimizer"][table][name], value), (table, name)
    for name, value in expected["masters"].items():
        assert torch.equal(loaded["masters"][name], value), name


def test_the_weights_come_from_the_masters_not_the_module_file(saved):
    save_dir, weights, _ = saved
    engine, _ = resident_engine(7)
    loaded_keys: list[str] = []
    load_state_dict = engine.module.load_state_dict

    def recorded(state, *args, **kwargs):
        loaded_keys.extend(state)
        return load_state_dict(state, *args, **kwargs)

    engine.module.load_state_dict = recorded
    engine.load_checkpoint(str(save_dir))
    trained = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    assert trained and not trained & set(loaded_keys), "the module's file is not read for weights the masters hold"
    differs = [k for k, v in engine.module.state_dict().items() if not torch.equal(v, weights[k])]
    assert not differs, differs  # restored from the masters: the saver's weights, bit for bit
