"""NVMe swap slots carry a checksum checked on read (issue 38): bytes changed on disk stop the step by name."""

from __future__ import annotations

import os

import pytest
import torch
from reference import random_batches, train_steps
from test_zero_cache_nvme import aligned_bytes, nvme_config, tiers_of
from zero_cache_setup import six_layer_llama

import angelptm
from zero_cache.config import AioConfig
from zero_cache.plan.planner import NVME
from zero_cache.storage.nvme import ALIGN_BYTES, NvmeTier, SwapCorruptionError, slot_checksum


def corrupt(tier: NvmeTier, offset: int) -> None:
    """Flip a byte of the nameless swap file through another descriptor (as another process or the drive would)."""
    fd = os.open(f"/proc/self/fd/{tier.file.fd}", os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_slot_changed_on_disk_is_refused_at_read_naming_file_and_slot(tmp_path):
    tier = NvmeTier(tmp_path, slot_bytes=2 * ALIGN_BYTES, budget_bytes=10**6, aio=AioConfig())
    written = aligned_bytes(tier.slot_bytes)
    written.copy_(torch.randint(0, 256, (tier.slot_bytes,), dtype=torch.uint8))
    offsets = [tier.allocate_slot() for _ in range(2)]
    for offset in offsets:
        tier.write(offset, written).wait()
    back = aligned_bytes(tier.slot_bytes)
    tier.read(offsets[0], back).wait()  # intact: reads back
    assert torch.equal(back, written)
    corrupt(tier, offsets[1] + 4097)
    with pytest.raises(SwapCorruptionError, match=rf"slot 1 \(offset {offsets[1]}\) of the swap file "
                                                  rf"{tier.file.path}.*checksum mismatch"):
        tier.read(offsets[1], back).wait()
    tier.close()


def test_the_checksum_sees_one_flipped_bit_and_moved_blocks():
    data = torch.randint(0, 256, (4 * ALIGN_BYTES,), dtype=torch.uint8)
    flipped, moved = data.clone(), data.clone()
    flipped[5000] ^= 1
    moved[:ALIGN_BYTES], moved[ALIGN_BYTES:2 * ALIGN_BYTES] = data[ALIGN_BYTES:2 * ALIGN_BYTES], data[:ALIGN_BYTES]
    assert slot_checksum(data) == slot_checksum(data.clone())
    assert slot_checksum(flipped) != slot_checksum(data) and slot_checksum(moved) != slot_checksum(data)


def test_corruption_mid_run_stops_the_next_step_in_a_users_script(tmp_path):
    seed = 3
    config, _, _ = nvme_config(tmp_path, seed)
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    assert NVME in tiers_of(optimizer)
    batches = random_batches(seed, count=3, batch=4)
    train_steps(engine, batches[:1])
    tier = optimizer.store.tiers[NVME]
    tier.flush()
    group = next(g for g in optimizer.store.groups if g.tier == NVME)
    corrupt(tier, group.swap_offset + 123)
    with pytest.raises(SwapCorruptionError, match=r"swap file .*angelptm-zero-cache-.*checksum mismatch"):
        train_steps(engine, batches[1:])
