"""Streamed params on a real GPU: shards at home in pinned host memory, copied in on the H2D stream ahead of use,
gradients written home on the D2H stream and updated there by the worker."""

from __future__ import annotations

import pytest
import torch

import angelptm
from angelptm.models import ModelConfig, build_model
from reference import SEQ, VOCAB, ds_config, random_batches, train_steps
from zero_cache.planner import DEVICE, HOST

pytestmark = pytest.mark.gpu
CHUNK_NUMEL = 16384


def tiny_gpt(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=6, hidden_size=64,
                                   num_heads=4, tie_embeddings=True, activation_checkpointing=True))


def config(param_home: str, *, clip: float, accumulation: int, device_budget: int | str = "1GiB") -> dict:
    return ds_config(bf16={"enabled": True}, gradient_clipping=clip, gradient_accumulation_steps=accumulation,
                     zero_cache={"enabled": True, "chunk_size": CHUNK_NUMEL, "param_home": param_home,
                                 "device_memory_budget": device_budget, "host_memory_budget": "2GiB",
                                 "prefetch_depth": 2})


@pytest.mark.parametrize("accumulation, clip", [(1, 1.0), (2, 1.0), (1, 0.0)])
def test_streamed_params_on_cuda_equal_resident_params(accumulation, clip):
    """Both keep every optimizer group on the host (the resident run's budget holds the params only), so they
    run the same host Adam on the same gradients: the streams and events must not change a bit."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=10 * accumulation, batch=4)
    weights = sum(p.numel() * 2 for p in tiny_gpt(seed).parameters())
    resident_engine, resident, _, _ = angelptm.initialize(
        model=tiny_gpt(seed), config=config("device", clip=clip, accumulation=accumulation,
                                            device_budget=int(1.5 * weights) + 40 * 2**20))
    streamed_engine, streamed, _, _ = angelptm.initialize(
        model=tiny_gpt(seed), config=config("host", clip=clip, accumulation=accumulation))
    assert {group.tier for group in resident.store.groups} == {HOST} and not resident.store.shard_params
    assert set(streamed.store.param_home) == {HOST} and streamed.store.shards[0].is_pinned()
    expected = train_steps(resident_engine, batches)
    losses = train_steps(streamed_engine, batches)
    assert expected[-1] < expected[0] - 0.3
    assert losses == pytest.approx(expected, rel=1e-5)
    got, want = streamed.master_state_dict(), resident.master_state_dict()
    for name, value in want.items():
        error = (got[name] - value).norm() / value.norm()
        assert error <= 1e-6, f"{name}: relative error {error:.2e}"
    assert streamed.exchange.gathered.gathers > 2 * len(streamed.store.shards)  # fetched in forward and backward


def test_built_on_the_host_the_gpu_never_holds_the_model():
    """zero.Init(remote_device="cpu") and a device budget of half the weights: the GPU's peak stays below them."""
    model_config = ModelConfig(flavour="gpt2", vocab_size=32000, max_seq_len=256, num_layers=8, hidden_size=512,
                               num_heads=8, activation_checkpointing=True)
    weights = 2 * build_model(model_config).num_params()
    cfg = ds_config(train_micro_batch_size_per_gpu=2, bf16={"enabled": True}, gradient_clipping=1.0,
                    zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}},
                    zero_cache={"enabled": True, "device_memory_budget": weights // 2, "host_memory_budget": "4GiB"})
    torch.cuda.reset_peak_memory_stats()
    with angelptm.zero.Init(config_dict_or_path=cfg, remote_device="cpu"):
        model = build_model(model_config)
    assert all(p.device.type == "cpu" for p in model.parameters())
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=cfg)
    ids = torch.randint(0, 32000, (2, 257), generator=torch.Generator().manual_seed(0))
    losses = train_steps(engine, [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}] * 4)
    assert losses[-1] < losses[0]
    assert optimizer.store.tiers[DEVICE].peak_bytes <= weights // 2
    assert torch.cuda.max_memory_allocated() < weights, f"peak {torch.cuda.max_memory_allocated()} of {weights}"
