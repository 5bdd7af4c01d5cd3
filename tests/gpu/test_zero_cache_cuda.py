"""ZeRO-Cache on a real GPU: host groups go through the D2H/H2D streams and the worker thread."""

from __future__ import annotations

import pytest
import torch

import angelptm
from angelptm.models import ModelConfig, build_model
from reference import SEQ, VOCAB, ds_config, random_batches, reference_loop, train_steps
from zero_cache.layout import pack
from zero_cache.planner import DEVICE, HOST

pytestmark = pytest.mark.gpu


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=6, hidden_size=32,
                                   num_heads=4))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_split_tiers_on_cuda_track_the_reference_over_20_steps(accumulation):
    """accumulation 1: bf16 gradients copied straight into pinned host chunks; 2: fp32 accumulation on the worker."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=20 * accumulation, batch=8)
    layout = pack([(n, tuple(p.shape)) for n, p in model(seed).named_parameters()], 8192)
    total = layout.num_chunks * layout.chunk_numel * 18
    config = ds_config(bf16={"enabled": True}, gradient_clipping=1.0, gradient_accumulation_steps=accumulation,
                       zero_cache={"enabled": True, "chunk_size": 8192, "device_memory_budget": total // 4,
                                   "host_memory_budget": total})
    engine, optimizer, _, _ = angelptm.initialize(model=model(seed), config=config)
    tiers = {group.tier for group in optimizer.store.groups}
    assert tiers == {DEVICE, HOST} and engine.device.type == "cuda"
    losses = train_steps(engine, batches)
    ref_losses, ref_masters = reference_loop(model(seed), batches, dtype=torch.bfloat16, accumulation=accumulation,
                                             lr=3e-3, clip=1.0, device="cuda")
    assert losses[-1] < losses[0] - 0.5
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    masters = optimizer.master_state_dict()
    initial = dict(model(seed).named_parameters())
    for name, expected in ref_masters.items():
        moved = (expected.cpu() - initial[name].detach()).abs().max().item()
        assert (masters[name] - expected.cpu()).abs().max().item() < 0.1 * moved


def test_host_tier_pins_exactly_what_it_allocates():
    from zero_cache.tiers import Tier

    tier = Tier("host", torch.device("cpu"), 2**31, pin_memory=True)
    tensor = tier.allocate(3 * 2**20 + 7, torch.float32)  # not a power of two
    assert tensor.is_pinned() and tier.used_bytes == (3 * 2**20 + 7) * 4
    on_gpu = torch.randn(tensor.numel(), device="cuda")
    tensor.copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(tensor, on_gpu.cpu())
    tier.free(tensor)
    assert tier.used_bytes == 0
