"""Streamed params on a real GPU: shards at home in pinned host memory, copied in on the H2D stream ahead of use,
gradients written home on the D2H stream and updated there by the worker."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from reference import SEQ, VOCAB, assert_masters_close, ds_config, random_batches, reference_loop, train_steps

import angelptm
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.plan.planner import DEVICE, HOST

pytestmark = pytest.mark.gpu
CHUNK_NUMEL = 16384


def tiny_gpt(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(flavour="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=6, hidden_size=64,
                                   num_heads=4, tie_embeddings=True, activation_checkpointing=True))


def config(*, clip: float, accumulation: int, prefetch_depth: int, device_steps: int = 0) -> dict:
    return ds_config(bf16={"enabled": True}, gradient_clipping=clip, gradient_accumulation_steps=accumulation,
                     zero_cache={"enabled": True, "chunk_size": CHUNK_NUMEL, "param_home": "host",
                                 "device_memory_budget": "1GiB", "host_memory_budget": "2GiB",
                                 "prefetch_depth": prefetch_depth, "device_steps": device_steps})


@pytest.mark.parametrize("accumulation, clip", [(1, 1.0), (2, 1.0), (1, 0.0)])
def test_streamed_params_on_cuda_track_the_reference_and_do_not_depend_on_the_prefetch(accumulation, clip):
    """Fetching 1 or 4 groups ahead changes only when copies run, never what they copy: the two runs are bitwise
    equal (a copy racing its use, or a gradient written home before it was final, would show), and both follow
    hand-written mixed precision."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=10 * accumulation, batch=4)
    runs = []
    for depth in (1, 4):
        engine, optimizer, _, _ = angelptm.initialize(
            model=tiny_gpt(seed), config=config(clip=clip, accumulation=accumulation, prefetch_depth=depth))
        store = optimizer.store
        assert set(store.param_home) == {HOST} and store.shards[0].is_pinned()
        assert {group.tier for group in store.groups} == {HOST}
        runs.append((train_steps(engine, batches), optimizer.master_state_dict(), optimizer))
    (losses, masters, optimizer), (deep_losses, deep_masters, _) = runs
    assert losses == deep_losses
    assert all(torch.equal(masters[name], deep_masters[name]) for name in masters)
    assert optimizer.exchange.gathered.gathers > 2 * len(optimizer.store.shards)  # forward and again in backward
    expected, expected_masters = reference_loop(tiny_gpt(seed), batches, dtype=torch.bfloat16,
                                                accumulation=accumulation, lr=3e-3, clip=clip, device="cuda")
    assert expected[-1] < expected[0] - 0.3
    assert losses == pytest.approx(expected, rel=2e-2)
    assert_masters_close(masters, expected_masters, dict(tiny_gpt(seed).named_parameters()))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_host_groups_stepped_on_the_gpu_track_the_reference_whatever_the_prefetch(accumulation):
    """Every host group stepped on the GPU after backward (states in and out on their own streams, gradients read
    from the shards' homes or the fp32 accumulators, params written home): two prefetch depths stay bitwise equal
    (a copy racing the step would show), and both follow hand-written mixed precision."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=10 * accumulation, batch=4)
    runs = []
    for depth in (1, 4):
        engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=config(
            clip=1.0, accumulation=accumulation, prefetch_depth=depth, device_steps=1000))
        assert sorted(optimizer.device_stepped) == list(range(optimizer.store.layout.num_chunks))
        runs.append((train_steps(engine, batches), optimizer.master_state_dict(), optimizer.report()))
    (losses, masters, report), (deep_losses, deep_masters, _) = runs
    assert report["zero_cache_device_stepped_chunks"] > 0 and report["zero_cache_speculated_chunks"] == 0
    assert losses == deep_losses
    assert all(torch.equal(masters[name], deep_masters[name]) for name in masters)
    expected, expected_masters = reference_loop(tiny_gpt(seed), batches, dtype=torch.bfloat16,
                                                accumulation=accumulation, lr=3e-3, clip=1.0, device="cuda")
    assert expected[-1] < expected[0] - 0.3
    assert losses == pytest.approx(expected, rel=2e-2)
    assert_masters_close(masters, expected_masters, dict(tiny_gpt(seed).named_parameters()))


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_count_switches_under_work_in_flight_on_cuda_track_the_reference(clip):
    """Half the host groups joining and leaving the device steps every other step, each switch made while the host's
    updates and the device steps' copies of the chunks it changes are still in flight on their streams (a switch
    waits for none of them): training follows hand-written mixed precision, and CUDA events timed the device steps."""
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=12, batch=4)
    engine, optimizer, _, _ = angelptm.initialize(model=tiny_gpt(seed), config=config(
        clip=clip, accumulation=1, prefetch_depth=1))
    losses = train_steps(engine, batches[:1])  # the warm-up and its re-plan (a fixed count: no tuning)
    settled = optimizer.store.plan
    host = [chunk for chunk, group in enumerate(optimizer.store.groups) if group.tier == HOST]
    joining = tuple(host[:len(host) // 2])
    assert joining and not settled.device_stepped
    stepping = dataclasses.replace(settled, device_stepped=joining,
                                   kept_gradients=tuple(c for c in settled.kept_gradients if c not in joining))
    for index, batch in enumerate(batches[1:]):
        losses += train_steps(engine, [batch])
        if index % 2 == 0:
            optimizer.apply_plan(stepping if index % 4 == 0 else settled, count_switch=True, trial=True)
    optimizer.finish_pending()
    elements, seconds = optimizer.device_steps.timing.work.take()
    assert elements >= len(joining) * optimizer.store.layout.chunk_numel and seconds > 0
    expected, expected_masters = reference_loop(tiny_gpt(seed), batches, dtype=torch.bfloat16, accumulation=1,
                                                lr=3e-3, clip=clip, device="cuda")
    assert losses == pytest.approx(expected, rel=2e-2)
    assert_masters_close(optimizer.master_state_dict(), expected_masters, dict(tiny_gpt(seed).named_parameters()))


def test_built_on_the_host_the_gpu_never_holds_the_model():
    """zero.Init(remote_device="cpu") and a device budget of half the weights: the GPU's peak stays below them.

    The model's largest tensor is a small part of it (vocab 4096), so chunks can be small enough for the
    budget's few live groups; the activation reserve is set, not half of so small a budget. Training is checked by
    the first step alone, seeded: plain torch AdamW on the same batch takes this 24-layer model from 8.47 to 9-15 by
    its fourth step on some inits, at the tests' 3e-3 and at 3e-4 alike (a CPU reference over 8 seeds), which
    failed a check of the last loss once on an H100 with nothing wrong in the engine; its first step lowered the
    loss by 0.3 or more in every draw."""
    model_config = ModelConfig(flavour="gpt2", vocab_size=4096, max_seq_len=256, num_layers=24, hidden_size=768,
                               num_heads=12, activation_checkpointing=True)
    weights = 2 * build_model(model_config).num_params()
    cfg = ds_config(train_micro_batch_size_per_gpu=2, bf16={"enabled": True}, gradient_clipping=1.0,
                    zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}},
                    zero_cache={"enabled": True, "device_memory_budget": weights // 2, "host_memory_budget": "4GiB",
                                "activation_memory": "64MiB"})
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()  # (what earlier tests left, e.g. a failed one's engine in its traceback)
    torch.manual_seed(0)
    with angelptm.zero.Init(config_dict_or_path=cfg, remote_device="cpu"):
        model = build_model(model_config)
    assert all(p.device.type == "cpu" for p in model.parameters())
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=cfg)
    assert HOST in set(optimizer.store.param_home)  # (offload_param permits host homes: the plan keeps some)
    ids = torch.randint(0, 4096, (2, 257), generator=torch.Generator().manual_seed(0))
    losses = train_steps(engine, [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}] * 4)
    assert all(map(math.isfinite, losses)) and losses[1] < losses[0], losses
    assert optimizer.store.tiers[DEVICE].peak_bytes <= weights // 2
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < weights, f"peak {peak} of {weights}"
