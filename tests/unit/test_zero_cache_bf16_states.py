"""ZeRO-Cache with DeepSpeed's ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``: bf16 chunk states.

The same model and JSON trained by the non-ZeRO-Cache bf16 mode (stage 1, whose losses equal DeepSpeed 0.19.8's:
``test_bf16_precision_modes.py``) and by ZeRO-Cache under budgets that split the chunks between the device and the
host. Host-held groups are stepped by DeepSpeed's cpu_adam on bf16 masters, moments and gradients, as the stage 1
run steps its parameters, so their losses are equal bit for bit. Device-held groups take torch's fused Adam (on a GPU
that is the device's kernel, as DeepSpeed's FusedAdam is there); on a CPU its rounding is not cpu_adam's, so a run
with every group on the device is compared with a plain torch loop: bf16 parameters stepped by torch's fused AdamW.
"""

from __future__ import annotations

import pytest
import torch
from reference import ds_config, random_batches, train_steps
from zero_cache_setup import CHUNK_NUMEL, budgets, six_layer_llama

import angelptm
from angelptm.config.loader import load_config
from angelptm.errors import ConfigError
from zero_cache.plan.planner import OFF_DEVICE

BOTH = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
STEPS = 6
PARAMS_ONLY_DEVICE_BYTES = 345_000
"""A device budget that holds the six-layer model's param chunks and scratch (320,924 bytes with bf16 states, 337,815
with fp32: as the planner says) and no optimizer group (48 KiB in bf16)."""


def bf16_config(**overrides) -> dict:
    return ds_config(bf16=dict(BOTH), **overrides)


def zero_cache_engine(seed: int, device_budget: int, host_budget: int, **overrides):
    config = bf16_config(zero_optimization={"stage": 3}, **overrides)
    config["zero_cache"] = {"enabled": True, "device_memory_budget": device_budget, "host_memory_budget": host_budget,
                            "chunk_size": CHUNK_NUMEL, "param_home": "device"}
    engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(seed), config=config)
    return engine, optimizer


def stage1_losses(seed: int, batches, **overrides) -> list[float]:
    engine, _, _, _ = angelptm.initialize(model=six_layer_llama(seed),
                                          config=bf16_config(zero_optimization={"stage": 1}, **overrides))
    return train_steps(engine, batches)


def tiers_of(optimizer) -> set[str]:
    return {group.tier for group in optimizer.store.groups}


@pytest.mark.parametrize("overrides", [{}, {"gradient_accumulation_steps": 2}], ids=["one", "accumulating"])
def test_host_and_device_groups_in_bf16_give_stage_ones_losses(overrides):
    """Host-held groups: DeepSpeed's arithmetic, equal bit for bit to the stage 1 bf16 run (the reference whose
    losses are DeepSpeed's). The device-held ones here (the device's Adam is torch's) stay within bf16's rounding."""
    accumulation = overrides.get("gradient_accumulation_steps", 1)
    batches = random_batches(3, STEPS * accumulation, 4)
    device_budget, host_budget = budgets(six_layer_llama(0))
    engine, optimizer = zero_cache_engine(0, device_budget, 4 * host_budget, **overrides)
    losses = train_steps(engine, batches)
    assert {"device", "host"} <= tiers_of(optimizer), tiers_of(optimizer)
    for group in optimizer.store.groups:
        assert group.states.dtype == torch.bfloat16
        assert group.grad is None or group.grad.dtype == torch.bfloat16
    reference = stage1_losses(0, batches, **overrides)
    torch.testing.assert_close(losses, reference, rtol=2e-2, atol=0)
    assert losses[-1] < losses[0]

    # Every group on the host: the stage 1 run's losses exactly.
    engine, optimizer = zero_cache_engine(0, PARAMS_ONLY_DEVICE_BYTES, 4 * host_budget, **overrides)
    assert tiers_of(optimizer) == {"host"}
    assert train_steps(engine, batches) == reference


def test_clipped_host_steps_in_bf16_follow_stage_ones_within_its_rounding():
    """Clipping: the stage 1 run takes the norm over its flat bf16 buffer, ZeRO-Cache sums per-chunk squares, so the
    clip coefficients differ in their last fp32 bits, and the bf16 gradients scaled by them in a few elements by one
    bf16 ulp: the losses agree to bf16's rounding, not bit for bit. The steps clip (the rows would be equal else)."""
    batches = random_batches(3, STEPS, 4)
    _, host_budget = budgets(six_layer_llama(0))
    engine, optimizer = zero_cache_engine(0, PARAMS_ONLY_DEVICE_BYTES, 4 * host_budget, gradient_clipping=0.3)
    losses, norms = [], []
    for batch in batches:
        losses += train_steps(engine, [batch])
        norms.append(optimizer.last_grad_norm)
    assert sum(norm > 0.3 for norm in norms) >= STEPS - 1, norms
    reference = stage1_losses(0, batches, gradient_clipping=0.3)
    torch.testing.assert_close(losses, reference, rtol=1e-3, atol=0)


def test_device_groups_in_bf16_are_torchs_fused_adamw_on_bf16_parameters():
    batches = random_batches(5, STEPS, 4)
    engine, optimizer = zero_cache_engine(1, 1 << 30, 1 << 30)
    assert tiers_of(optimizer) == {"device"}
    losses = train_steps(engine, batches)

    model = six_layer_llama(1).to(torch.bfloat16)
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    reference = []
    for batch in batches:
        loss = model(**batch)
        loss.backward()
        adamw.step()
        adamw.zero_grad()
        reference.append(loss.item())
    assert losses == reference
    assert all(state["exp_avg"].dtype == torch.bfloat16 for state in adamw.state.values())


def test_the_plan_prices_bf16_states_at_six_bytes_an_element():
    model = six_layer_llama(0)
    plans = {}
    for name, bf16 in (("fp32", {"enabled": True}), ("bf16", dict(BOTH))):
        config = ds_config(bf16=bf16, zero_optimization={"stage": 3},
                           zero_cache={"enabled": True, "device_memory_budget": PARAMS_ONLY_DEVICE_BYTES,
                                       "host_memory_budget": 1 << 30,
                                       "chunk_size": CHUNK_NUMEL, "param_home": "device"})
        engine, optimizer, _, _ = angelptm.initialize(model=six_layer_llama(0), config=config)
        plans[name] = optimizer.store.plan
        held = optimizer.store.state_homes["host"].held_bytes()["host"]
        assert held == CHUNK_NUMEL * (12 if name == "fp32" else 6), (name, held)
    assert plans["fp32"].optimizer_tier == plans["bf16"].optimizer_tier
    assert set(plans["bf16"].optimizer_tier) <= {"host", *OFF_DEVICE}
    num_chunks = len(plans["fp32"].optimizer_tier)
    states_fp32 = num_chunks * CHUNK_NUMEL * 12
    assert plans["fp32"].host_bytes - plans["bf16"].host_bytes >= states_fp32 // 2
    assert plans["bf16"].traffic.host_adam_bytes == 2 * 6 + 2 * 2  # (fp32: 28)
    assert plans["fp32"].traffic.host_adam_bytes == 28
    del model


def test_masters_alone_under_zero_cache_is_refused_with_what_works():
    config = ds_config(bf16={"enabled": True, "bf16_master_weights_and_grads": True},
                       zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ConfigError) as err:
        load_config(config, device_type="cpu")
    assert "bf16_optimizer_states: true" in str(err.value) and "ZeRO-Cache" in str(err.value)
    config = ds_config(bf16={"enabled": True}, zero_cache={"enabled": True, "state_dtype": "bf16"})
    with pytest.raises(ConfigError, match="zero_cache.state_dtype"):
        load_config(config, device_type="cpu")


def test_bf16_states_update_after_backward_and_refuse_speculation_when_asked():
    device_budget, host_budget = budgets(six_layer_llama(0))
    config = bf16_config(zero_optimization={"stage": 3}, gradient_clipping=1.0)
    config["zero_cache"] = {"enabled": True, "device_memory_budget": device_budget, "host_memory_budget": host_budget,
                            "chunk_size": CHUNK_NUMEL, "param_home": "device", "update_in_backward": True}
    with pytest.raises(ValueError, match="update_in_backward"):
        angelptm.initialize(model=six_layer_llama(0), config=config)


def test_a_bf16_checkpoint_resumes_exactly_and_is_written_as_fp32(tmp_path):
    """The checkpoint holds the bf16 states upcast to fp32 (exact, and what DeepSpeed's readers and zero_to_fp32 read);
    a load rounds them back to the very bf16 values, so the resumed run is the uninterrupted one bit for bit."""
    batches = random_batches(7, 2 * STEPS, 4)
    device_budget, host_budget = budgets(six_layer_llama(2))
    engine, optimizer = zero_cache_engine(2, device_budget, 4 * host_budget)
    assert {"device", "host"} <= tiers_of(optimizer)
    train_steps(engine, batches[:STEPS])
    engine.save_checkpoint(str(tmp_path), tag="bf16")
    expected = train_steps(engine, batches[STEPS:])
    saved = torch.load(next(tmp_path.rglob("*optim_states.pt")), weights_only=False)
    tensors = [value for value in _tensors(saved) if value.is_floating_point() and value.numel() > 1]
    assert tensors and all(value.dtype == torch.float32 for value in tensors)
    assert all(torch.equal(value, value.bfloat16().float()) for value in tensors)  # (bf16 values, upcast)

    resumed, resumed_optimizer = zero_cache_engine(2, device_budget, 4 * host_budget)
    resumed.load_checkpoint(str(tmp_path), tag="bf16")
    assert train_steps(resumed, batches[STEPS:]) == expected
    for name, value in optimizer.master_state_dict().items():
        assert torch.equal(resumed_optimizer.master_state_dict()[name], value), name


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
