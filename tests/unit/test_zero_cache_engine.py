"""ZeRO-Cache under the engine, on CPU with a small device budget: placement, numerics, errors, resume."""

from __future__ import annotations

import gc
import importlib
import logging
import weakref

import pytest
import torch
from reference import SEQ, VOCAB, ds_config, random_batches, reference_loop, train_steps
from zero_cache_setup import FP32_BYTES_PER_ELEMENT, budgets, six_layer_llama, zero_cache_config

import angelptm
from angelptm.config import load_config
from angelptm.pretraining.models import ModelConfig, build_model
from zero_cache.plan.planner import DEVICE, HOST


def test_states_four_times_the_device_budget_train_like_the_reference():
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=8, batch=8)
    device_budget, host_budget = budgets(six_layer_llama(seed))
    config = zero_cache_config(device_budget, host_budget)
    config["zero_cache"]["param_home"] = "device"  # params resident: the optimizer states alone are split
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    store = optimizer.store
    tiers = [group.tier for group in store.groups]
    assert DEVICE in tiers and HOST in tiers, f"the budgets must force a split, got {tiers}"
    assert store.tiers[DEVICE].used_bytes <= device_budget and store.tiers[HOST].used_bytes <= host_budget
    losses = train_steps(engine, batches)
    ref_losses, ref_masters = reference_loop(six_layer_llama(seed), batches, dtype=torch.bfloat16,
                                             accumulation=1, lr=3e-3, clip=1.0)
    assert losses[-1] < losses[0] - 0.3, "the model must learn, or agreement proves little"
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    masters = optimizer.master_state_dict()
    initial = dict(six_layer_llama(seed).named_parameters())
    for name, expected in ref_masters.items():
        moved = (expected - initial[name].detach()).abs().max().item()
        diff = (masters[name] - expected).abs().max().item()
        # Fused and foreach Adam round differently and bf16 amplifies it; still far below the movement.
        assert diff < 0.1 * moved, f"{name}: differs by {diff:.2e}, moved {moved:.2e}"
    chunk_storages = {chunk.untyped_storage().data_ptr() for chunk in store.param_chunks}
    for name, param in engine.module.named_parameters():
        assert param.untyped_storage().data_ptr() in chunk_storages, f"{name} is not a view into a chunk"
        torch.testing.assert_close(param.float(), masters[name].to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_fp32_zero_cache_matches_the_replicated_engine_closely(accumulation):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=4 * accumulation, batch=4)
    device_budget, host_budget = budgets(six_layer_llama(seed), FP32_BYTES_PER_ELEMENT)
    config = zero_cache_config(device_budget, host_budget, gradient_accumulation_steps=accumulation)
    del config["bf16"]
    zc_engine, zc_opt, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    plain_engine, plain_opt, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=ds_config(
        gradient_clipping=1.0, gradient_accumulation_steps=accumulation))
    assert train_steps(zc_engine, batches) == pytest.approx(train_steps(plain_engine, batches), rel=1e-5)
    zc, plain = zc_opt.master_state_dict(), plain_opt.master_state_dict()
    for name in plain:
        torch.testing.assert_close(zc[name], plain[name], rtol=1e-4, atol=1e-5)


def test_a_model_that_cannot_fit_stops_before_allocating_with_the_shortfall():
    model = six_layer_llama(0)
    device_budget, _ = budgets(model)
    with pytest.raises(angelptm.ConfigError, match=r"host tier needs .*short by .*zero_cache.host_memory_budget"):
        angelptm.initialize(model=model, config=zero_cache_config(device_budget, 1024))
    with pytest.raises(angelptm.ConfigError, match=r"device tier needs .*short by"):
        angelptm.initialize(model=six_layer_llama(0), config=zero_cache_config(1024, 10**9))


def test_resume_with_zero_cache_is_exact(tmp_path):
    seed = torch.randint(0, 10_000, ()).item()
    batches = random_batches(seed, count=6, batch=4)
    device_budget, host_budget = budgets(six_layer_llama(seed))
    config = zero_cache_config(device_budget, host_budget)
    straight, straight_opt, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    straight_losses = train_steps(straight, batches)
    first, _, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    train_steps(first, batches[:3])
    first.save_checkpoint(tmp_path)
    resumed, resumed_opt, _, _ = angelptm.initialize(model=six_layer_llama(seed + 1), config=config)
    resumed.load_checkpoint(tmp_path)
    assert train_steps(resumed, batches[3:]) == straight_losses[3:]
    expected, got = straight_opt.state_dict(), resumed_opt.state_dict()
    for field in ("exp_avg", "exp_avg_sq"):
        for name, value in expected["optimizer"][field].items():
            assert torch.equal(got["optimizer"][field][name], value)
    for name, value in expected["masters"].items():
        assert torch.equal(got["masters"][name], value)


def test_deepspeed_stage3_offload_turns_zero_cache_on():
    config = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}})
    assert config.zero_cache.enabled
    assert not load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3}}).zero_cache.enabled


def test_deepspeed_nvme_offload_carries_its_path_and_aio_block_over(tmp_path):
    config = load_config({"train_batch_size": 8, "aio": {"block_size": 262144, "queue_depth": 16, "thread_count": 2},
                          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                                  "nvme_path": str(tmp_path)}}})
    assert config.zero_cache.enabled and config.zero_cache.nvme_path == str(tmp_path)
    aio = config.zero_cache.aio
    assert (aio.block_size, aio.queue_depth, aio.thread_count) == (262144, 16, 2)
    assert "aio" not in config.accepted_not_acted


def test_deepspeed_zero_init_block_runs_unchanged():
    import angelptm as deepspeed

    config = zero_cache_config(*budgets(six_layer_llama(0)))
    before = torch.get_default_dtype()
    with deepspeed.zero.Init(config_dict_or_path=config):
        torch.manual_seed(0)
        model = build_model(ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=6,
                                        hidden_size=32, num_heads=4))
    assert torch.get_default_dtype() == before
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # built in the compute dtype
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    batches = random_batches(0, 4, 4)
    losses = train_steps(engine, batches)
    # The same script without zero.Init: built in fp32, cast to bf16 by initialize(). Sampling in
    # bf16 rounds the initial weights by at most one bf16 step, so training agrees to bf16 noise.
    reference, _, _, _ = deepspeed.initialize(model=six_layer_llama(0), config=config)
    assert losses == pytest.approx(train_steps(reference, batches), rel=1e-2)
    assert optimizer.step_count == 4


def test_parameters_without_gradient_are_not_stepped_and_fp16_norms_do_not_overflow():
    """As in torch's AdamW, a parameter with no gradient keeps its weight (no decay, no momentum)."""
    seed = torch.randint(0, 10_000, ()).item()
    model = six_layer_llama(seed)
    model.unused = torch.nn.Linear(8, 8, bias=False)  # never called in forward
    config = zero_cache_config(10**9, 10**9)
    del config["bf16"]
    config["fp16"] = {"enabled": True}  # initial scale 2**16: fp16 squares of scaled norms would overflow
    engine, optimizer, _, _ = angelptm.initialize(model=model, config=config)
    before = engine.module.unused.weight.detach().clone()
    train_steps(engine, random_batches(seed, 3, 4))
    assert engine.skipped_steps == 0, "fp16 norms must be taken in fp32"
    assert torch.equal(engine.module.unused.weight, before)
    assert optimizer.step_count == 3


def test_a_failed_replan_warning_does_not_keep_a_dropped_optimizer_alive(monkeypatch, caplog):
    """On a GPU the warm-up can measure more activations than the budget holds; the warning about the
    kept placement must not pin the optimizer (log records outlive the engine: here, caplog's)."""
    warmup_module = importlib.import_module("zero_cache.warmup")
    real = warmup_module.make_plan

    def replan_fails(inputs):
        if inputs.trace:  # only the re-plan has a trace
            raise warmup_module.PlanError("the measured activations do not fit")
        return real(inputs)

    monkeypatch.setattr(warmup_module, "make_plan", replan_fails)
    seed = torch.randint(0, 10_000, ()).item()
    device_budget, host_budget = budgets(six_layer_llama(seed))
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed),
                                                  config=zero_cache_config(device_budget, host_budget))
    with caplog.at_level(logging.WARNING, logger="zero_cache"):
        train_steps(engine, random_batches(seed, count=2, batch=8))
    assert "keeping the current placement" in caplog.text
    alive = weakref.ref(optimizer)
    del engine, optimizer
    gc.collect()
    assert alive() is None
