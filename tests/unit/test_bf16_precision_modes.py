"""DeepSpeed 0.19.8's ``bf16_master_weights_and_grads``, ``bf16_optimizer_states`` and ``torch_autocast``: the same
per-step losses as DeepSpeed itself on a CPU (``tests/helpers/bf16_modes_job.py`` under both, in processes of their own
at once, one OpenMP thread each), DeepSpeed's refusals as config errors naming the keys, and the fp32-moment fallback
against DeepSpeed's C++ Adam on fresh random inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import beside_deepspeed

from angelptm.config import load_config
from angelptm.engine import deepspeed_cpu_adam
from angelptm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "helpers" / "bf16_modes_job.py"
BASE = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("bf16_modes")
    return beside_deepspeed(JOB, root)


def test_every_modes_losses_equal_deepspeeds(results):
    ours, theirs = results["angelptm"], results["deepspeed"]
    assert ours.keys() == theirs.keys()
    for mode, expected in theirs.items():
        got = ours[mode]
        assert min(expected["losses"]) < expected["losses"][0] - 0.01, f"{mode}: the model must move"
        for step, (a, b) in enumerate(zip(got["losses"], expected["losses"], strict=True)):
            assert abs(a - b) <= 1e-6, f"{mode}, step {step + 1}: {a} vs DeepSpeed's {b}"
        for key in ("param_dtype", "master_dtype", "state_dtypes"):
            assert got[key] == expected[key], f"{mode}: {key} {got[key]} vs DeepSpeed's {expected[key]}"
        assert abs(got["weights"] - expected["weights"]) <= 1e-4 * expected["weights"], mode


def test_the_modes_keep_what_deepspeed_keeps_and_change_the_numerics(results):
    ours = results["angelptm"]
    bf16 = {"exp_avg": "torch.bfloat16", "exp_avg_sq": "torch.bfloat16"}
    fp32 = {"exp_avg": "torch.float32", "exp_avg_sq": "torch.float32"}
    assert (ours["masters_and_states_stage1"]["master_dtype"], ours["masters_and_states_stage1"]["state_dtypes"]) == \
        ("torch.bfloat16", bf16)
    assert (ours["masters_only_offload"]["master_dtype"], ours["masters_only_offload"]["state_dtypes"]) == \
        ("torch.bfloat16", fp32)
    assert ours["autocast_bf16_stage0"]["param_dtype"] == "torch.float32"
    # Each mode is its own arithmetic: equal losses would mean a key changed nothing.
    for a, b in (("masters_and_states_stage1", "masters_only_offload"), ("masters_only_offload", "default_bf16_stage1"),
                 ("autocast_bf16_stage0", "default_bf16_stage1")):
        assert ours[a]["losses"] != ours[b]["losses"], (a, b)
    clipped = sum(norm > 0.05 for norm in ours["masters_and_states_gas2_clip"]["norms"])
    assert clipped >= 3, f"the clip row must clip (clipped {clipped} of 6 steps)"


def _problems(**overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_config({**BASE, **overrides}, device_type="cpu")
    return str(err.value)


def test_optimizer_states_without_masters_is_refused_naming_both_keys():
    message = _problems(bf16={"enabled": True, "bf16_optimizer_states": True}, zero_optimization={"stage": 1})
    assert "bf16.bf16_optimizer_states" in message and "bf16.bf16_master_weights_and_grads" in message


def test_deepspeeds_other_asserts_are_config_errors_naming_the_key():
    both = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert "zero_optimization.stage 1, 2 or 3 (got stage 0)" in _problems(bf16=both)
    message = _problems(bf16={"enabled": True, "bf16_master_weights_and_grads": True}, zero_optimization={"stage": 2})
    assert "bf16.bf16_master_weights_and_grads" in message and "offload_optimizer" in message
    zero_cache = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    taken = load_config({**BASE, "bf16": both, "zero_optimization": zero_cache}, device_type="cpu")
    assert (taken.zero_cache.enabled, taken.zero_cache.state_dtype) == (True, "bf16")  # bf16 chunk states
    message = _problems(bf16={"enabled": True, "bf16_master_weights_and_grads": True}, zero_optimization=zero_cache)
    assert "ZeRO-Cache" in message and "bf16_optimizer_states: true" in message
    assert "set bf16.enabled to true" in _problems(bf16={**both, "enabled": False}, zero_optimization={"stage": 1})


def test_torch_autocast_over_a_bf16_module_is_taken_and_its_module_names_are_checked():
    both = load_config({**BASE, "torch_autocast": {"enabled": True}, "bf16": {"enabled": True}},
                       device_type="cpu").precision
    assert (both.dtype, both.autocast_dtype) == (torch.bfloat16, torch.bfloat16)  # as DeepSpeed: no refusal
    message = _problems(torch_autocast={"enabled": True, "lower_precision_safe_modules": ["torch.nn.NoSuchLayer"]})
    assert "torch_autocast.lower_precision_safe_modules" in message and "NoSuchLayer" in message
    assert "torch_autocast.dtype" in _problems(torch_autocast={"enabled": True, "dtype": "int8"})


def test_torch_autocast_resolves_deepspeeds_dtype_defaults():
    autocast = {"torch_autocast": {"enabled": True}, "bf16": {"enabled": "auto"}}
    cpu = load_config({**BASE, **autocast}, device_type="cpu").precision
    cuda = load_config({**BASE, **autocast}, device_type="cuda").precision
    assert (cpu.dtype, cpu.autocast_dtype, cpu.loss_scale) == (torch.float32, torch.bfloat16, None)
    assert (cuda.dtype, cuda.autocast_dtype) == (torch.float32, torch.float16)
    assert cuda.loss_scale is not None, "fp16 autocast without ZeRO scales the loss (DeepSpeed's GradScaler)"
    staged = load_config({**BASE, **autocast, "zero_optimization": {"stage": 1}}, device_type="cuda").precision
    assert staged.loss_scale is None


def test_fp32_moment_fallback_matches_deepspeeds_cpu_adam_on_bf16_masters():
    kernel = deepspeed_cpu_adam.load_kernel(True, (0.9, 0.95))
    if kernel is None:
        pytest.skip("DeepSpeed's C++ Adam cannot be built here")
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(4099, generator=generator).to(torch.bfloat16)
    kernel_weight, kernel_moments = weight.clone(), [torch.zeros(4099), torch.zeros(4099)]
    torch_weight, torch_moments = weight.clone(), [torch.zeros(4099), torch.zeros(4099)]
    for step in range(1, 6):
        grad = torch.randn(4099, generator=generator).to(torch.bfloat16)
        kernel.update(step, 1e-2, (0.9, 0.95), 1e-8, 0.1, kernel_weight, grad, *kernel_moments)
        deepspeed_cpu_adam.adam_step_with_state_dtype(torch_weight, grad, *torch_moments, step, lr=1e-2,
                                                      betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decoupled=True)
    moved = (kernel_weight.float() - weight.float()).abs()
    assert moved.mean() > 1e-3
    # Both round to bf16 once per step; they may part by one bf16 ulp where the fp32 results straddle a rounding edge.
    differ = (kernel_weight.float() - torch_weight.float()).abs()
    assert (differ <= 2 ** -7 * kernel_weight.float().abs().clamp(min=1e-3)).all()
    assert (differ > 0).float().mean() < 0.05
    for ours, theirs in zip(torch_moments, kernel_moments):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
