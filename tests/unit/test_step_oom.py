"""A device out-of-memory inside a step (issue 29, point 8): reported with the tier budgets in force and the settings
that would help, as a ``torch.OutOfMemoryError`` still. On CPU, fakes raise torch's error where CUDA would."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import angelptm
from angelptm.memory.oom import StepOutOfMemoryError

TORCH_TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB"


class OomBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError(TORCH_TEXT)


class Model(nn.Module):
    """Two linear layers; ``fail_in`` picks where torch's OOM is raised ("forward", "backward" or None)."""

    def __init__(self, fail_in: str | None = None) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(32, 64), nn.Linear(64, 1)
        self.fail_in = fail_in

    def forward(self, x):
        if self.fail_in == "forward":
            raise torch.OutOfMemoryError(TORCH_TEXT)
        hidden = self.first(x)
        if self.fail_in == "backward":
            hidden = OomBackward.apply(hidden)
        return self.second(hidden).pow(2).mean()


def engine_for(model: nn.Module, zero_cache: dict | None = None):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if zero_cache:
        config["zero_cache"] = zero_cache
    engine, *_ = angelptm.initialize(model=model, config=config)
    return engine


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_oom_in_forward_or_backward_names_the_phase_and_what_helps(phase):
    torch.manual_seed(0)
    engine = engine_for(Model(fail_in=phase))
    with pytest.raises(torch.OutOfMemoryError) as caught:  # still torch's type: retry-on-OOM code keeps working
        loss = engine(torch.randn(4, 32))
        engine.backward(loss)
    err = caught.value
    assert isinstance(err, StepOutOfMemoryError) and isinstance(err.__cause__, torch.OutOfMemoryError)
    message = str(err)
    assert f"ran out of memory in the {phase} of step 1 (micro-batch 4 x 2 accumulation, float32; torch: " \
           f"{TORCH_TEXT})" in message
    assert "ZeRO-Cache is off" in message and "enable zero_cache" in message and "--plan" in message
    assert "train_micro_batch_size_per_gpu (now 4)" in message and "activation checkpointing" in message


def test_an_oom_in_the_optimizer_step_names_the_tier_budgets_in_force(monkeypatch):
    torch.manual_seed(0)
    engine = engine_for(Model(), {"enabled": True, "device_memory_budget": "3MiB", "host_memory_budget": "16MiB"})
    for _ in range(2):  # the second micro-batch reaches the boundary
        engine.backward(engine(torch.randn(4, 32)))
        if engine.is_gradient_accumulation_boundary():
            break
        engine.step()

    def oom_step():
        raise torch.OutOfMemoryError(TORCH_TEXT)

    monkeypatch.setattr(engine.optimizer, "step", oom_step)
    with pytest.raises(StepOutOfMemoryError) as caught:
        engine.step()
    message = str(caught.value)
    tiers = engine.optimizer.store.tiers
    from zero_cache.plan.units import format_bytes

    assert "in the optimizer step of step 1" in message
    assert (f"device {format_bytes(tiers['device'].used_bytes)} of 3.00 MiB, host "
            f"{format_bytes(tiers['host'].used_bytes)} of 16.00 MiB") in message
    assert tiers["device"].used_bytes > 0
    assert "lower zero_cache.device_memory_budget (now 3.00 MiB)" in message


def test_other_errors_pass_through_unchanged():
    engine = engine_for(Model())

    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("not memory")

    engine.module.first.register_forward_hook(lambda *args: Boom()(None))
    with pytest.raises(ValueError, match="^not memory$"):
        engine(torch.randn(4, 32))
